"""ALEPH E6 + E5 (userspace half): the UDP aggregator tree under injected loss (MEASURED on loopback, one host).

The testbed plan (seed 002 Sec. 6.3: workers at 30/20/20/10x5 Gbit/s -> |D| = 4 with M-WCHA fill) runs through
``aleph_dataplane`` (one PS process, three aggregator processes, eight worker processes on 127.0.0.1). Every
process drops each received datagram with probability p (userspace injection before parsing, seeded; the kernel here
has no netem). For p in {0, 0.1 %, 0.2 %, 1 %, 5 %} (the paper's loss levels and one harsher), --reps runs of
--iters iterations of --elems int32 values per worker report: exactness of every worker's sums, wall time per
iteration, injected drops, NACKs, retransmission requests, duplicates refused, and CPU seconds per DATA packet
aggregated by the nodes (E5's userspace figure; the XDP tier is not built here, so there is no XDP figure).
Loopback is not shaped: the time is CPU and protocol cost, not a network's.

Run: .venv-llm/bin/python benchmarks/aleph_loss.py [--reps 3]  -> results/aleph/e6_loss.json, e6_loss.png
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from flowlane.aleph import AlephConfig, plan_clusters  # noqa: E402
from flowlane.aleph.udp import run_tree  # noqa: E402
from flowlane.aleph.wire import SEG_ELEMS  # noqa: E402
from flowlane.testing.provenance import provenance  # noqa: E402

TESTBED = [30, 20, 20, 10, 10, 10, 10, 10]
DROPS = (0.0, 0.001, 0.002, 0.01, 0.05)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--elems", type=int, default=64 * SEG_ELEMS * 4)  # 128 KiB a worker, 256 segments
    ap.add_argument("--rto-ms", type=int, default=20)
    ap.add_argument("--out", default=str(ROOT / "results" / "aleph" / "e6_loss.json"))
    a = ap.parse_args()
    plan = plan_clusters(TESTBED, config=AlephConfig(seed=0))
    rng = np.random.default_rng(0)
    x = rng.integers(-(2**27), 2**27, size=(plan.n, a.iters, a.elems), dtype=np.int64).astype(np.int32)
    want = x.astype(np.int64).sum(0)
    segs = -(-a.elems // SEG_ELEMS)
    rows = []
    t0, load0 = time.perf_counter(), os.getloadavg()[0]
    for drop in DROPS:
        runs = []
        for rep in range(a.reps):
            r = run_tree(plan, x, drop=drop, seed=rep + 1, rto_ms=a.rto_ms)
            every = [s for role in r.stats.values() for s in role]
            nodes = r.stats["ps"] + r.stats["aggregator"]
            data_in = (
                a.iters * segs * sum(len(c.members) for c in plan.clusters if len(c.members) > 1)
                + a.iters * segs * plan.num_flows
            )  # DATA packets the nodes must add (aggregators' members + PS's)
            runs.append(
                {
                    "exact": bool(np.array_equal(r.outputs, np.broadcast_to(want, r.outputs.shape))),
                    "wall_s": r.wall_s,
                    "per_iter_ms": 1e3 * r.wall_s / a.iters,
                    "injected_drops": sum(s["injected_drops"] for s in every),
                    "nacks": sum(s["nacks"] for s in every),
                    "retx_requests": sum(s["retx_requests"] for s in every),
                    "dup_refused": sum(s["dup"] for s in every),
                    "bad": sum(sum(s["bad"].values()) for s in every),
                    "node_cpu_us_per_data_packet": 1e6 * sum(s["cpu_s"] for s in nodes) / data_in,
                }
            )
        row = {
            "drop": drop,
            "runs": runs,
            "all_exact": all(q["exact"] for q in runs),
            "per_iter_ms_median": statistics.median(q["per_iter_ms"] for q in runs),
        }
        rows.append(row)
        print(
            f"drop {drop:6.3%}: exact {row['all_exact']}  {row['per_iter_ms_median']:7.1f} ms/iteration  "
            f"drops {[q['injected_drops'] for q in runs]}  nacks {[q['nacks'] for q in runs]}  "
            f"cpu us/pkt {[round(q['node_cpu_us_per_data_packet'], 2) for q in runs]}"
        )
    base = rows[0]["per_iter_ms_median"]
    res = {
        "label": "measured on loopback (CPU, one host); loss injected in userspace at every receiver",
        **provenance(),
        "plan": plan.to_dict(),
        "iters": a.iters,
        "elems": a.elems,
        "segments": segs,
        "rto_ms": a.rto_ms,
        "rows": rows,
        "slowdown_vs_no_loss": {str(r["drop"]): r["per_iter_ms_median"] / base for r in rows},
        "all_exact": all(r["all_exact"] for r in rows),
        "wall_s": time.perf_counter() - t0,
        "loadavg_1m_before_after": [load0, os.getloadavg()[0]],
    }
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1) + "\n")
    print(f"all exact: {res['all_exact']} -> {out}")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    for i, r in enumerate(rows):
        ax.scatter([i] * len(r["runs"]), [q["per_iter_ms"] for q in r["runs"]], color="C0")
    ax.set_xticks(range(len(rows)), [f"{r['drop']:.1%}" for r in rows])
    ax.set_xlabel("injected loss per received datagram")
    ax.set_ylabel("ms per iteration")
    ax.set_title(f"ALEPH UDP tier, testbed plan, {a.elems * 4 // 1024} KiB/worker (loopback)")
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=110)


if __name__ == "__main__":
    main()
