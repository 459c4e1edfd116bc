"""What one TCP flow gets through a link shaped by flowlane.testing.netem, per rate and tbf bucket (measured on CPU
with emulated links).

Two namespaces (``EmulatedNetwork(2, rate_mbit=R, burst_kb=B)``); rank 0 sends for ``--seconds`` as fast as one TCP
socket can, rank 1 counts what arrives from its first byte. The figure is goodput (TCP/IP headers not counted), so a
link the bucket does not throttle gives about 0.96x its rate. Backs the comment on ``netem._burst`` (which sizes the
bucket at least 1 ms of traffic) and the docs' note that the 32 KB default limits a link only on a loaded host.
Needs root (ip netns, tc); namespaces are uniquely named and removed on exit.

    .venv-llm/bin/python benchmarks/netem_tbf_burst.py [--rates 100,400,1000] [--bursts-kb 32,128] [--seconds 4]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from flowlane.testing.netem import EmulatedNetwork, unavailable_reason  # noqa: E402
from flowlane.testing.provenance import write_result  # noqa: E402

PORT = 5301
RECEIVER = f"""
import socket, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind(("0.0.0.0", {PORT})); s.listen(1)
c, _ = s.accept(); n, t0 = 0, None
while True:
    b = c.recv(1 << 20)
    if not b:
        break
    t0 = t0 or time.perf_counter()
    n += len(b)
print(n * 8 / (time.perf_counter() - t0) / 1e6)
"""
SENDER = f"""
import socket, sys, time
c = socket.create_connection((sys.argv[1], {PORT}), timeout=30); buf = b"x" * (1 << 20); end = time.time() + float(sys.argv[2])
while time.time() < end:
    c.sendall(buf)
c.close()
"""


def _numbers(text: str, flag: str) -> list[float]:
    try:
        vals = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"{flag} {text!r}: give comma-separated numbers, e.g. 100,400") from None
    if not vals or any(v <= 0 for v in vals):
        raise SystemExit(f"{flag} {text!r}: every value must be > 0")
    return vals


def goodput(rate_mbit: float, burst_kb: float, seconds: float) -> float:
    """Mbit/s one TCP flow delivers over a link of ``rate_mbit`` with a ``burst_kb`` tbf bucket."""
    with EmulatedNetwork(2, rate_mbit=rate_mbit, burst_kb=burst_kb) as net:
        rx = net.popen(1, [sys.executable, "-c", RECEIVER], stdout=subprocess.PIPE, text=True)
        time.sleep(0.5)  # listening
        tx = net.popen(0, [sys.executable, "-c", SENDER, net.ips[1], str(seconds)])
        tx.wait(timeout=seconds + 30)
        out, _ = rx.communicate(timeout=30)
        if tx.returncode or rx.returncode:
            raise RuntimeError(f"sender exited {tx.returncode}, receiver {rx.returncode}")
        return float(out.strip())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rates", default="100,400,1000", help="link rates in Mbit/s")
    ap.add_argument("--bursts-kb", dest="bursts_kb", default="32,128", help="tbf buckets in KB")
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--out", default=str(REPO / "results/netem/tbf_burst.json"))
    a = ap.parse_args()
    rates, bursts = _numbers(a.rates, "--rates"), _numbers(a.bursts_kb, "--bursts-kb")
    if not a.seconds > 0:
        raise SystemExit(f"--seconds {a.seconds}: must be > 0")
    why = unavailable_reason()
    if why:
        raise SystemExit(f"netem_tbf_burst: {why}")
    load = os.getloadavg()[0]
    rows = []
    for rate in rates:
        for burst in bursts:
            got = goodput(rate, burst, a.seconds)
            rows.append(
                {"rate_mbit": rate, "burst_kb": burst, "goodput_mbit": round(got, 1), "ratio": got / rate}
            )
            print(f"{rate:g} Mbit/s, {burst:g} KB bucket: {got:.1f} Mbit/s ({got / rate:.2f}x)", flush=True)
    doc = {
        "label": "measured on CPU with emulated links (one TCP flow through a tbf-shaped veth pair)",
        "seconds": a.seconds,
        "load_average_1m_start": load,
        "rows": rows,
    }
    print("wrote", write_result(a.out, doc))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
