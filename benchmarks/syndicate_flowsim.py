"""SYNDICATE plans replayed in the flow-level simulator (flowlane.sim: max-min link sharing on a leaf-spine fabric)
beside optSched's cost model, at cluster scale. Single-path plans only (the engine has one fabric). **Simulated**.

Rows: the E3 linear chain and an LLM preset's DP buckets (gpt3-13b, one pipeline stage) at 8-256 GPUs, FIFO + greedy
vs the joint search, each scored by optSched and by the flow-level engine. The joint search also runs on the seed's
order space alone (``joint_priority_only``: optSched's digest §2.4.4 priority rule, boosts searched) beside ours
(``joint``: the list-scheduling rule searched too, flowlane.syndicate.search), and each plan's order is replayed
every iteration by optSched as the enforcer runs it (``optsched_replayed_ms``). The flow engine replays the
search's two-iteration schedule.

Run: .venv-llm/bin/python benchmarks/syndicate_flowsim.py   -> results/syndicate/flowsim.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flowlane.syndicate import SearchConfig, mcmc_search, opt_sched  # noqa: E402
from flowlane.syndicate.flowsim import simulate  # noqa: E402
from flowlane.syndicate.replan import plan_from_search, replayed  # noqa: E402
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
            dtypes = {c.name: "float32" for c in dag.comms}
            searches = {
                "joint": mcmc_search(dag, cost, SearchConfig(seed=0, time_budget_s=a.budget_s)),
                "joint_priority_only": mcmc_search(
                    dag, cost, SearchConfig(seed=0, time_budget_s=a.budget_s, picks=("priority",))
                ),
            }
            best = searches["joint"]
            row = {
                "workload": name,
                "gpus": gpus,
                "optsched_ms": {
                    "fifo_greedy": fifo.per_iteration * 1e3,
                    **{k: r.cost * 1e3 for k, r in searches.items()},
                },
                "optsched_replayed_ms": {
                    "fifo_greedy": fifo.per_iteration * 1e3,
                    **{
                        k: replayed(dag, plan_from_search(dag, r, dtypes, 1), cost).per_iteration * 1e3
                        for k, r in searches.items()
                    },
                },
                "flow_level_ms": {
                    "fifo_greedy": simulate(dag, greedy, fifo, cost) * 1e3,
                    **{k: simulate(dag, r.plan, r.schedule, cost) * 1e3 for k, r in searches.items()},
                },
                "joint_pick": best.pick,
                "joint_plan": {k: v.label() for k, v in best.plan.items()},
                "joint_priority_only_plan": {
                    k: v.label() for k, v in searches["joint_priority_only"].plan.items()
                },
            }
            row["flow_level_speedup"] = row["flow_level_ms"]["fifo_greedy"] / row["flow_level_ms"]["joint"]
            row["optsched_speedup"] = row["optsched_ms"]["fifo_greedy"] / row["optsched_ms"]["joint"]
            row["flow_level_speedup_priority_only"] = (
                row["flow_level_ms"]["fifo_greedy"] / row["flow_level_ms"]["joint_priority_only"]
            )
            rows.append(row)
            print(
                name,
                gpus,
                {k: round(v, 3) for k, v in row["optsched_ms"].items()},
                {k: round(v, 3) for k, v in row["flow_level_ms"].items()},
                best.pick,
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
