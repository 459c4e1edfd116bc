"""ALEPH E5, XDP half (digest §4.4): kernel CPU per aggregated DATA packet of the XDP tier, MEASURED in the kernel with
BPF_PROG_TEST_RUN (the program on a copy of each frame; no NIC, driver or socket: the userspace figure of
benchmarks/aleph_loss.py is a whole process's CPU per packet, so the two bound the aggregation work from both sides,
they are not the same measurement).

One aggregator with --children children, --segments full segments (128 values each) per iteration, --iters
iterations; every child's DATA packet once per segment, in a seeded shuffled order. Records each packet's run time
(ns, BPF_PROG_TEST_RUN's duration with repeat=1) split into "added" (consumed) and "completing" (rewritten and sent up
with XDP_TX), checks every sum sent up, and writes results/aleph/e5_xdp.json with provenance.

Run: .venv-llm/bin/python benchmarks/aleph_xdp.py [--children 4 --segments 256 --iters 3]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from flowlane.aleph import wire as W  # noqa: E402
from flowlane.aleph import xdp as X  # noqa: E402
from flowlane.testing.provenance import provenance  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--children", type=int, default=4)
    ap.add_argument("--segments", type=int, default=256)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "results" / "aleph" / "e5_xdp.json"))
    a = ap.parse_args()
    reason = X.unavailable_reason()
    if reason:
        print(f"skipped: {reason}")
        return
    cfg = X.XdpConfig(port=9000, iters=a.iters, elems=a.segments * W.SEG_ELEMS, children=a.children, my_id=0)
    rng = np.random.default_rng(0)
    x = rng.integers(-(2**24), 2**24, size=(a.iters, a.children, cfg.elems), dtype=np.int32)
    frames, keys = [], []
    order = random.Random(0)
    for it in range(1, a.iters + 1):
        pk = [(s, c) for s in range(a.segments) for c in range(a.children)]
        order.shuffle(pk)
        for s, c in pk:
            sl = slice(s * W.SEG_ELEMS, (s + 1) * W.SEG_ELEMS)
            frames.append(X.frame(W.pack(W.DATA, it, s, x[it - 1, c, sl], src=c)))
            keys.append((it, s))
    load0, t0 = os.getloadavg()[0], time.perf_counter()
    run = X.run_frames(frames, cfg, timeout_s=600)
    sums = x.astype(np.int64).sum(1)
    exact = True
    for v, out, (it, s) in zip(run.verdicts, run.out, keys, strict=True):
        if v == "TX":
            _, vals = W.unpack(X.parse_frame(out)["payload"])
            exact &= bool(np.array_equal(vals, sums[it - 1, s * W.SEG_ELEMS : (s + 1) * W.SEG_ELEMS]))
    added = [ns for v, ns in zip(run.verdicts, run.ns, strict=True) if v == "DROP"]
    sent = [ns for v, ns in zip(run.verdicts, run.ns, strict=True) if v == "TX"]
    res = {
        "label": "measured in the kernel with BPF_PROG_TEST_RUN (program run time per frame; no NIC or driver)",
        **provenance(),
        "children": a.children,
        "segments": a.segments,
        "iters": a.iters,
        "packets": len(frames),
        "exact": exact and run.counters["tx_up"] == a.iters * a.segments,
        "counters": run.counters,
        "ns_per_packet": {
            "added_median": statistics.median(added),
            "completing_median": statistics.median(sent),
            "all_mean": statistics.fmean(run.ns),
        },
        "wall_s": time.perf_counter() - t0,
        "loadavg_1m_before_after": [load0, os.getloadavg()[0]],
    }
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=1) + "\n")
    n = res["ns_per_packet"]
    print(
        f"XDP (BPF_PROG_TEST_RUN): {len(frames)} DATA packets, exact {res['exact']}; median ns per packet: added "
        f"{n['added_median']}, completing (rewritten + XDP_TX) {n['completing_median']}; mean {n['all_mean']:.0f}"
        f" -> {a.out}"
    )
    if not res["exact"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
