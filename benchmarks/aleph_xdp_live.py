"""ALEPH E5 on a live interface (digest §4.4 E5): CPU per aggregated DATA packet, tier 1's userspace aggregator vs
the XDP program attached to the aggregator's veth -- MEASURED on CPU, veth in network namespaces.

One cluster of --children workers under one aggregator, whose parent is tier 1's PS; every process is tier 1's C
binary (workers send real UDP DATA datagrams over veths and a bridge), each in its own namespace
(flowlane.aleph.xdp.run_live_tree). Modes, alternated per rep on the same namespaces:

- ``userspace``: tier 1's aggregator node (aleph_udp node) receives, sums and sends up each segment;
- ``xdp-native``: the program on the aggregator's veth in the veth driver's XDP (the bridge port facing it runs
  aleph_xdp_pass, which a veth needs to receive XDP_TX frames), a relay node behind it for RESULT / NACK / RETX;
- ``xdp-skb``: the same in generic (SKB) mode.

Per run, divided by the DATA packets the aggregator aggregates (children x segments x iterations):

- ``agg_proc_us``: CPU time (user + system, getrusage) of the aggregator namespace's process (the node, or the relay);
- ``xdp_prog_us``: the XDP program's own run time in the kernel (BPF_ENABLE_STATS run_time_ns; 0 in userspace mode);
- ``agg_us`` = the two together: what the aggregation role costs that is attributable to it;
- ``tree_us``: CPU time of every process of the tree (workers, PS, aggregator: getrusage) plus the machine's softirq
  time in the run -- the whole tree's CPU per aggregated packet. On veth the receive path of a datagram (up to the
  socket, or the XDP program) runs in the *sender's* context or in softirq, not in the receiver's process, so the
  aggregator's own process time misses its receive path in both modes; this total does not (it also holds softirq
  work of anything else on the host);
- ``machine_softirq_us``, ``machine_busy_us``: /proc/stat's machine-wide softirq and non-idle time from the go to the
  last worker's exit (every process of the tree, both ends of every veth, and anything else running on the host:
  an upper bound, USER_HZ ticks, noisy on a shared host).

Every run's sums are checked exactly at every worker (exit 1 otherwise).

Run: .venv-llm/bin/python benchmarks/aleph_xdp_live.py [--children 4 --segments 512 --iters 10 --reps 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from flowlane.aleph import Plan  # noqa: E402
from flowlane.aleph import wire as W  # noqa: E402
from flowlane.aleph import xdp as X  # noqa: E402
from flowlane.testing.netem import EmulatedNetwork  # noqa: E402
from flowlane.testing.netem import unavailable_reason as netns_unavailable  # noqa: E402
from flowlane.testing.provenance import write_result  # noqa: E402

MODES = {"userspace": {"userspace": True}, "xdp-native": {"mode": "native"}, "xdp-skb": {"mode": "skb"}}
TICK_US = 1e6 / os.sysconf("SC_CLK_TCK")


def one(plan: Plan, x: np.ndarray, net: EmulatedNetwork, mode: str, children: int, rto_ms: int) -> dict:
    r = X.run_live_tree(plan, x, net, timeout_s=300, rto_ms=rto_ms, **MODES[mode])
    n, iters, elems = x.shape
    want = x.astype(np.int64).sum(0)
    exact = bool(np.array_equal(r.outputs, np.broadcast_to(want, r.outputs.shape)))
    pkts = children * -(-elems // W.SEG_ELEMS) * iters
    (agg,) = r.stats["aggregator"]
    prog_ns = sum(a["run_time_ns"] for a in r.xdp)
    t = r.proc_stat_ticks
    busy = sum(v for k, v in t.items() if k not in ("idle", "iowait"))
    tree_cpu_s = sum(p["cpu_s"] for role in r.stats.values() for p in role)
    row = {
        "mode": mode,
        "exact": exact,
        "aggregated_packets": pkts,
        "wall_s": r.wall_s,
        "agg_proc_us": agg["cpu_s"] * 1e6 / pkts,
        "xdp_prog_us": prog_ns / 1e3 / pkts,
        "tree_us": (tree_cpu_s * 1e6 + t["softirq"] * TICK_US) / pkts,
        "tree_proc_us": tree_cpu_s * 1e6 / pkts,
        "machine_softirq_us": t["softirq"] * TICK_US / pkts,
        "machine_busy_us": busy * TICK_US / pkts,
        "xdp_attached": [
            {k: a[k] for k in ("mode", "native_error", "run_cnt", "run_time_ns")} for a in r.xdp
        ],
        "xdp_counters": [a["counters"] for a in r.xdp],
        "nacks": sum(s["nacks"] for role in r.stats.values() for s in role),
        "aggregator_counters": agg,
        "proc_stat_ticks": t,
    }
    row["agg_us"] = row["agg_proc_us"] + row["xdp_prog_us"]
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--children", type=int, default=4)
    ap.add_argument("--segments", type=int, default=512, help="128-value segments per iteration")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument(
        "--rto-ms", type=int, default=1000, help="tier 1's NACK timeout (long: no spurious NACKs)"
    )
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    ap.add_argument("--out", default=str(ROOT / "results" / "aleph" / "e5_xdp_live.json"))
    a = ap.parse_args()
    reason = X.unavailable_reason() or netns_unavailable()
    if reason:
        print(f"skipped: {reason}")
        return
    plan = Plan.from_clusters(a.children, [list(range(a.children))])
    rng = np.random.default_rng(0)
    x = rng.integers(-(2**24), 2**24, size=(a.children, a.iters, a.segments * W.SEG_ELEMS), dtype=np.int32)
    rows = []
    load0 = os.getloadavg()[0]
    with EmulatedNetwork(X.live_nodes(plan), subnet="10.234.0.0/24", prefix="ale5") as net:
        for rep in range(a.reps):
            for mode in a.modes:
                row = one(plan, x, net, mode, a.children, a.rto_ms)
                row["rep"] = rep
                rows.append(row)
                print(
                    f"rep {rep} {mode:10s} exact {row['exact']}  aggregator {row['agg_us']:.2f} us/pkt "
                    f"(process {row['agg_proc_us']:.2f} + program {row['xdp_prog_us']:.2f})  tree {row['tree_us']:.2f}  softirq "
                    f"{row['machine_softirq_us']:.2f}, busy {row['machine_busy_us']:.2f} us/pkt  wall "
                    f"{row['wall_s']:.2f} s  NACKs {row['nacks']}",
                    flush=True,
                )
    summary = {}
    for mode in a.modes:
        mine = [r for r in rows if r["mode"] == mode]
        summary[mode] = {
            k: statistics.median(r[k] for r in mine)
            for k in (
                "agg_us",
                "agg_proc_us",
                "xdp_prog_us",
                "tree_us",
                "tree_proc_us",
                "machine_softirq_us",
                "machine_busy_us",
                "wall_s",
            )
        }
        summary[mode]["xdp_mode"] = sorted({x["mode"] for r in mine for x in r["xdp_attached"]})
    doc = {
        "label": "measured on CPU, veth in network namespaces (one host; tier-1 processes in every role)",
        "what": "CPU per aggregated DATA packet at one aggregator: userspace node vs XDP attached (see the docstring)",
        "children": a.children,
        "segments": a.segments,
        "iters": a.iters,
        "reps": a.reps,
        "rto_ms": a.rto_ms,
        "exact": all(r["exact"] for r in rows),
        "summary_median": summary,
        "runs": rows,
        "loadavg_1m_before_after": [load0, os.getloadavg()[0]],
    }
    out = write_result(a.out, doc)
    for mode, s in summary.items():
        print(
            f"median {mode:10s} aggregator {s['agg_us']:.2f} us/pkt (process {s['agg_proc_us']:.2f} + program "
            f"{s['xdp_prog_us']:.2f}); tree {s['tree_us']:.2f}; machine softirq {s['machine_softirq_us']:.2f}, busy "
            f"{s['machine_busy_us']:.2f} us/pkt; wall {s['wall_s']:.2f} s"
        )
    print(f"-> {out}")
    if not doc["exact"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
