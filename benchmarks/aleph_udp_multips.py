"""ALEPH E8 in tier 1 (digest §4.4 E8, seed Sec. 7): several PSs for the userspace UDP aggregator on emulated links --
MEASURED on CPU with emulated links (tbf in network namespaces).

q PSs at --ps-mbit (default 300/150/100, the testbed's 30/15/10 Gbit/s / 100, as benchmarks/aleph_multips.py) and 4
workers at --worker-mbit (200), each its own aggregator (singleton clusters: every worker is one of the |D| = 4 flows into every
PS), one namespace each, tbf on both directions of every access link (--burst-kb bucket). The workers sum --mb MB of
int32 per iteration through tier 1 (flowlane.aleph.udp.run_tree) with split = proportional (P_j / sum P), equal, or
single (the fastest PS alone); reps alternate the three. Time: from the workers' common go to the last one's exit
(per run, --iters iterations), after one untimed small run per split (ARP: a neighbour still being resolved
queues only ~100 datagrams and drops the rest of a burst, which the first timed run otherwise paid for in NACKs). Sums are checked exactly at every worker every run (exit 1 otherwise). The flow model:
max(max_j 4 S f_j / P_j, S / 200) per direction, both directions overlapping (full duplex), per iteration.

Tier 1 has no pacing: a PS whose downlink queue overflows loses datagrams and NACK/RETX repair them (with netem's
default 100 ms tbf queues at 30/15/10 and 20 Mbit/s, 0.5 MB: 2,300-5,800 tbf drops per run and 3-5x the model's
time), so the queues here hold --queue-ms (default 2 s) of their rate; the JSON counts drops (tbf) and NACKs per run.

Run: .venv-llm/bin/python benchmarks/aleph_udp_multips.py [--reps 5 --mb 1 --iters 3]
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from flowlane.aleph import Plan  # noqa: E402
from flowlane.aleph.model import multi_ps_split  # noqa: E402
from flowlane.aleph.udp import run_tree  # noqa: E402
from flowlane.testing.netem import EmulatedNetwork  # noqa: E402
from flowlane.testing.netem import unavailable_reason as netns_unavailable  # noqa: E402
from flowlane.testing.provenance import write_result  # noqa: E402

NWORKERS = 4


def tbf_drops(net: EmulatedNetwork) -> int:
    total = 0
    for ns in net.namespaces:
        out = subprocess.run(
            ["tc", "-n", ns, "-s", "qdisc"], capture_output=True, text=True, timeout=30
        ).stdout
        total += sum(int(m) for m in re.findall(r"dropped (\d+)", out))
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ps-mbit", type=float, nargs="+", default=[300.0, 150.0, 100.0])
    ap.add_argument("--mb", type=float, default=1.0, help="MB of int32 per worker per iteration")
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--worker-mbit", type=float, default=200.0)
    ap.add_argument("--burst-kb", type=float, default=128.0, help="tbf bucket")
    ap.add_argument(
        "--queue-ms", type=float, default=2000.0, help="tbf queue (latency): deep, tier 1 has no pacing"
    )
    ap.add_argument("--rto-ms", type=int, default=200)
    ap.add_argument("--out", default=str(ROOT / "results" / "aleph" / "e8_udp_multips.json"))
    a = ap.parse_args()
    reason = netns_unavailable()
    if reason:
        print(f"skipped: {reason}")
        return
    q, P = len(a.ps_mbit), a.ps_mbit
    fastest = max(range(q), key=lambda j: P[j])
    splits = {
        "proportional": multi_ps_split(P),
        "equal": [1.0 / q] * q,
        "single": [1.0 if j == fastest else 0.0 for j in range(q)],
    }
    elems = int(a.mb * 1e6 / 4)
    S = elems * 4 * 8 / 1e6  # Mbit per worker per iteration
    model = {k: max(max(NWORKERS * S * f / p for f, p in zip(sp, P, strict=True)), S / a.worker_mbit)
             for k, sp in splits.items()}  # fmt: skip
    plan = Plan.from_clusters(NWORKERS, [[w] for w in range(NWORKERS)])
    rng = np.random.default_rng(0)
    x = rng.integers(-(2**20), 2**20, size=(NWORKERS, a.iters, elems), dtype=np.int32)
    want = x.astype(np.int64).sum(0)
    rows = []
    load0 = os.getloadavg()[0]
    rates = [*P, *[a.worker_mbit] * NWORKERS]
    with EmulatedNetwork(
        q + NWORKERS,
        rate_mbit=rates,
        burst_kb=a.burst_kb,
        tbf_latency_ms=a.queue_ms,
        subnet="10.235.0.0/24",
        prefix="ale8",
    ) as net:
        wrap = [lambda argv, r=r: [*net.exec_prefix(r), *argv] for r in range(q + NWORKERS)]
        for sp in splits.values():  # untimed: resolves every neighbour (ARP), whose queue drops a first burst
            run_tree(plan, x[:, :1, :4096], rto_ms=200, timeout_s=120, hosts=net.ips[q:], wrap=[*wrap[q:], None],
                     split=sp, ps_hosts=net.ips[:q], ps_wrap=wrap[:q])  # fmt: skip
        for rep in range(a.reps):
            for name, sp in splits.items():
                d0 = tbf_drops(net)
                run = run_tree(plan, x, rto_ms=a.rto_ms, seed=rep, timeout_s=300, hosts=net.ips[q:],
                               wrap=[*wrap[q:], None], split=sp, ps_hosts=net.ips[:q], ps_wrap=wrap[:q])  # fmt: skip
                exact = bool(np.array_equal(run.outputs, np.broadcast_to(want, run.outputs.shape)))
                every = [s for role in run.stats.values() for s in role]
                row = {
                    "rep": rep,
                    "split_name": name,
                    "split": sp,
                    "exact": exact,
                    "s_per_iter": run.wall_s / a.iters,
                    "tbf_drops": tbf_drops(net) - d0,
                    "nacks": sum(s["nacks"] for s in every),
                    "by_role": {
                        role: {
                            k: sum(s[k] for s in ss)
                            for k in ("nacks", "nacks_rx", "dup", "stale", "retx_data")
                        }
                        for role, ss in run.stats.items()
                    },
                    "ps_added": {s["part"]: s["data_rx"] - s["dup"] for s in run.stats["ps"]},
                }
                rows.append(row)
                print(f"rep {rep} {name:12s} exact {exact} {row['s_per_iter']:.3f} s/iter (model "
                      f"{model[name]:.3f}) drops {row['tbf_drops']} NACKs {row['nacks']}", flush=True)  # fmt: skip
    summary = {
        k: {
            "median_s_per_iter": statistics.median(r["s_per_iter"] for r in rows if r["split_name"] == k),
            "model_s_per_iter": model[k],
            "split": splits[k],
        }
        for k in splits
    }
    doc = {
        "label": "measured on CPU with emulated links (tbf in network namespaces), tier 1 (userspace UDP)",
        "ps_mbit": P,
        "worker_mbit": a.worker_mbit,
        "burst_kb": a.burst_kb,
        "queue_ms": a.queue_ms,
        "workers": NWORKERS,
        "mb_per_worker_iter": a.mb,
        "iters": a.iters,
        "reps": a.reps,
        "rto_ms": a.rto_ms,
        "links": net.describe(),
        "exact": all(r["exact"] for r in rows),
        "summary": summary,
        "runs": rows,
        "loadavg_1m_before_after": [load0, os.getloadavg()[0]],
    }
    out = write_result(a.out, doc)
    for k, s in summary.items():
        print(f"median {k:12s} {s['median_s_per_iter']:.3f} s/iter (model {s['model_s_per_iter']:.3f})")
    print(f"-> {out}")
    if not doc["exact"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
