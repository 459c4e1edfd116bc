"""E4's open question, flow by flow (MEASURED with emulated links): do TCP flows that share one tbf FIFO progress
unevenly, which a lockstep tree (chunk k goes up only when every child's chunk k is in) pays for?

One receiver (an aggregator's downlink: --rate Mbit/s) and --senders senders (uplinks at the same rate, so the
receiver's port is the only bottleneck), each in its own network namespace (flowlane.testing.netem). Each sender
opens one TCP connection and sends --mb MB at once; the receiver timestamps, per connection, when each quarter of
the bytes has arrived. Per repetition we record every flow's completion time and the *lockstep* time of the first
half: when the slowest flow has delivered half of its bytes (a tree needs every child's chunk k before it forwards
chunk k; the fair-share ideal is half the total bytes at the link rate). Queues: ``fifo`` (netem's one tbf per port)
or ``fair`` (per-peer htb classes at the same rate: benchmarks/aleph_netns.py fair_queues).

Run (root): .venv-llm/bin/python benchmarks/aleph_fairness.py [--reps 5] -> results/aleph/e4_fairness.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from flowlane.testing.provenance import provenance  # noqa: E402

RECV = r"""
import json, selectors, socket, sys, time
n, size, port = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
ls = socket.socket(); ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); ls.bind(("0.0.0.0", port)); ls.listen(n)
print("ready", flush=True)
conns = [ls.accept()[0] for _ in range(n)]
sel = selectors.DefaultSelector()
got = [0] * n; marks = [[] for _ in range(n)]; t0 = None
for i, c in enumerate(conns):
    sel.register(c, selectors.EVENT_READ, i)
while any(g < size for g in got):
    for key, _ in sel.select():
        i = key.data
        b = key.fileobj.recv(1 << 20)
        now = time.perf_counter()
        if t0 is None: t0 = now
        got[i] += len(b)
        while len(marks[i]) < 4 and got[i] >= size * (len(marks[i]) + 1) / 4:
            marks[i].append(now - t0)
        if not b or got[i] >= size: sel.unregister(key.fileobj)
print(json.dumps(marks), flush=True)
"""
SEND = r"""
import socket, sys, time
host, port, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
s = socket.create_connection((host, port)); sys.stdin.readline(); s.sendall(b"x" * size); s.close()
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--senders", type=int, default=3)
    ap.add_argument("--rate", type=float, default=300.0, help="Mbit/s of every access link")
    ap.add_argument("--mb", type=float, default=4.0)
    ap.add_argument("--burst-kb", type=float, default=128.0)
    ap.add_argument("--out", default=str(ROOT / "results" / "aleph" / "e4_fairness.json"))
    a = ap.parse_args()
    import subprocess

    from aleph_netns import fair_queues  # type: ignore[import-not-found]

    from flowlane.testing.netem import EmulatedNetwork, check_available

    check_available()
    n, size = a.senders + 1, int(a.mb * 2**20)
    t_start, load0 = time.perf_counter(), os.getloadavg()[0]
    out: dict = {}
    for queues in ("fifo", "fair"):
        reps = []
        with EmulatedNetwork(n, rate_mbit=a.rate, burst_kb=a.burst_kb) as net:
            if queues == "fair":
                fair_queues(net, [a.rate] * n, a.burst_kb)
            for rep in range(a.reps):
                port = 40000 + rep
                rx = net.popen(0, [sys.executable, "-c", RECV, str(a.senders), str(size), str(port)],
                               stdout=subprocess.PIPE, text=True)  # fmt: skip
                assert rx.stdout is not None and rx.stdout.readline().strip() == "ready"
                tx = [net.popen(s, [sys.executable, "-c", SEND, net.ips[0], str(port), str(size)],
                                stdin=subprocess.PIPE, text=True) for s in range(1, n)]  # fmt: skip
                time.sleep(1.0)  # every connection is accepted before anyone sends
                for p in tx:
                    assert p.stdin is not None
                    p.stdin.write("go\n")
                    p.stdin.flush()
                for p in tx:
                    p.stdin.close()  # type: ignore[union-attr]
                    p.wait(timeout=120)
                marks = json.loads(rx.communicate(timeout=120)[0].strip().splitlines()[-1])
                done = [m[-1] for m in marks]
                reps.append({
                    "quarter_marks_s": marks,
                    "completion_s": done,
                    "half_lockstep_s": max(m[1] for m in marks),
                    "first_last_completion_ratio": min(done) / max(done),
                })  # fmt: skip
            # the receiver's port (switch side) after all reps: drops / overlimits / requeues per qdisc
            qdisc = subprocess.run(["ip", "netns", "exec", net.switch_ns, "tc", "-s", "qdisc", "show", "dev", "p0"],
                                   capture_output=True, text=True, timeout=30).stdout  # fmt: skip
        out[queues] = {
            "receiver_port_tc_stats": qdisc,
            "drops": sum(int(d) for d in re.findall(r"dropped (\d+)", qdisc)),
            "reps": reps,
            "median_half_lockstep_s": statistics.median(r["half_lockstep_s"] for r in reps),
            "median_last_completion_s": statistics.median(max(r["completion_s"]) for r in reps),
            "median_first_last_ratio": statistics.median(r["first_last_completion_ratio"] for r in reps),
        }
    ideal_all = a.senders * size * 8 / (a.rate * 1e6)
    res = {
        "label": "measured on CPU with emulated links (netns + tbf / htb, TCP)",
        **provenance(),
        "senders": a.senders,
        "rate_mbit": a.rate,
        "mb_per_flow": a.mb,
        "burst_kb": a.burst_kb,
        "ideal_s": {"all_bytes": ideal_all, "half_lockstep_fair": ideal_all / 2},
        **out,
        "wall_s": time.perf_counter() - t_start,
        "loadavg_1m_before_after": [load0, os.getloadavg()[0]],
    }
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=1) + "\n")
    for q in ("fifo", "fair"):
        o = out[q]
        print(
            f"{q}: half of every flow in {o['median_half_lockstep_s']:.3f} s (fair ideal {ideal_all / 2:.3f}), "
            f"last flow done {o['median_last_completion_s']:.3f} s (ideal {ideal_all:.3f}), "
            f"first/last completion {o['median_first_last_ratio']:.2f}, drops at the port {o['drops']}"
        )
    print(f"-> {a.out}")


if __name__ == "__main__":
    main()
