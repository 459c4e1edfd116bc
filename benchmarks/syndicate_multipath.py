"""SYNDICATE's multi-path plans in the flow-level simulator, for the E2 DLRM-like DAG and mixture-of-experts LLM
presets (EP all-to-alls beside the DP all-reduce). **Simulated** (optSched's cost model and flowlane.sim's
flow-level engine, with assumed path parameters).

Each path is a fabric of its own in the flow engine (flowlane.syndicate.flowsim): F is the cluster's leaf-spine
fabric (100 Gb/s), S a separate non-blocking switch at the cost model's S bandwidth (10 GB/s per GPU). Rows: FIFO +
greedy vs the joint search (plans and order), each scored by optSched and replayed in the flow engine.

Run: .venv-llm/bin/python benchmarks/syndicate_multipath.py   -> results/syndicate/multipath.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flowlane.syndicate import SearchConfig, mcmc_search, opt_sched  # noqa: E402
from flowlane.syndicate.flowsim import simulate  # noqa: E402
from flowlane.syndicate.workloads import DLRMSpec, dlrm_dag, llm_moe_stage  # noqa: E402
from flowlane.testing.provenance import write_result  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget-s", type=float, default=5.0)
    ap.add_argument("--gpus", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--presets", nargs="+", default=["qwen-moe-12l", "mixtral-8x7b"])
    ap.add_argument("--out", default="results/syndicate/multipath.json")
    a = ap.parse_args()
    rows = []
    for gpus in a.gpus:
        cases = [("dlrm-like (E2)", *dlrm_dag(DLRMSpec(ranks=gpus)))]
        cases += [(f"{p} (MoE stage)", *llm_moe_stage(p, gpus)) for p in a.presets]
        for name, dag, cost in cases:
            greedy = dag.greedy_plan(cost)
            fifo = opt_sched(dag, greedy, cost, order="fifo")
            best = mcmc_search(dag, cost, SearchConfig(seed=0, time_budget_s=a.budget_s))
            row = {
                "workload": name,
                "gpus": gpus,
                "optsched_ms": {"fifo_greedy": fifo.per_iteration * 1e3, "joint": best.cost * 1e3},
                "flow_level_ms": {
                    "fifo_greedy": simulate(dag, greedy, fifo, cost) * 1e3,
                    "joint": simulate(dag, best.plan, best.schedule, cost) * 1e3,
                },
                "joint_plan": {k: v.label() for k, v in best.plan.items()},
                "paths_used": sorted({v.path for v in best.plan.values()}),
                "search": {
                    "iters": best.iters,
                    "stopped_by": best.stopped_by,
                    "elapsed_s": best.elapsed_s,
                    "pick": best.pick,
                },
            }
            row["flow_level_speedup"] = row["flow_level_ms"]["fifo_greedy"] / row["flow_level_ms"]["joint"]
            row["optsched_speedup"] = row["optsched_ms"]["fifo_greedy"] / row["optsched_ms"]["joint"]
            rows.append(row)
            print(
                f"{name:28s} {gpus:4d} GPUs  optSched {row['optsched_speedup']:.3f}x  "
                f"flow-level {row['flow_level_speedup']:.3f}x  paths {row['paths_used']}  rule {best.pick}",
                flush=True,
            )
    doc = {
        "label": (
            "simulated (optSched cost model and flowlane.sim flow-level engine; F = the cluster fabric at "
            "100 Gb/s, S = its own switch at 10 GB/s per GPU; alphas, deltas, incast and MoE sizes assumed: "
            "see flowlane.syndicate.workloads.llm_moe_stage)"
        ),
        "rows": rows,
    }
    print("wrote", write_result(a.out, doc))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
