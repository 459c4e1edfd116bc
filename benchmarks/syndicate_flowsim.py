"""SYNDICATE plans replayed in the flow-level simulator (flowlane.sim: max-min link sharing on a leaf-spine fabric)
beside optSched's cost model, at cluster scale. Single-path plans only (the engine has one fabric). **Simulated**.

Rows: the E3 linear chain and an LLM preset's DP buckets (gpt3-13b, one pipeline stage) at 8-256 GPUs, FIFO + greedy
vs the joint search, each scored by optSched and by the flow-level engine.

Run: .venv-llm/bin/python benchmarks/syndicate_flowsim.py   -> results/syndicate/flowsim.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flowlane.syndicate import SearchConfig, mcmc_search, opt_sched  # noqa: E402
from flowlane.syndicate.flowsim import simulate  # noqa: E402
from flowlane.syndicate.workloads import linear_chain, llm_dp_chain  # noqa: E402
from flowlane.testing.provenance import write_result  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget-s", type=float, default=5.0)
    ap.add_argument("--gpus", type=int, nargs="+", default=[8, 64, 256])
    ap.add_argument("--out", default="results/syndicate/flowsim.json")
    a = ap.parse_args()
    rows = []
    for gpus in a.gpus:
        for name, (dag, cost) in (
            ("linear-chain", linear_chain(ranks=gpus)),
            ("gpt3-13b-dp", llm_dp_chain("gpt3-13b", gpus)),
        ):
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
            }
            row["flow_level_speedup"] = row["flow_level_ms"]["fifo_greedy"] / row["flow_level_ms"]["joint"]
            row["optsched_speedup"] = row["optsched_ms"]["fifo_greedy"] / row["optsched_ms"]["joint"]
            rows.append(row)
            print(
                name,
                gpus,
                {k: round(v, 3) for k, v in row["optsched_ms"].items()},
                {k: round(v, 3) for k, v in row["flow_level_ms"].items()},
                flush=True,
            )
    doc = {
        "label": "simulated (optSched cost model and flowlane.sim flow-level engine; assumed path parameters)",
        "rows": rows,
    }
    print("wrote", write_result(a.out, doc))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
