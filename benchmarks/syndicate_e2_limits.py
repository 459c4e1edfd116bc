"""E2: what limits the joint plan on the DLRM-like DAG (the 1.3x goal is not met: score 1.26x, replayed 1.17x). **Simulated** (optSched's
cost model, assumed path parameters; flowlane.syndicate.workloads.dlrm_dag). Nothing here tunes the instance.

Three measurements of the joint plan's steady-state iteration (the second of optSched's two), on the search's own
schedule (its score); the plan's order replayed every iteration, as the enforcer runs it, is reported beside it:
1. resource busy time per iteration (the compute stream, path F, path S) against the iteration time;
2. the critical path: walking back from the iteration's last task, each step names what held the task's start
   (a DAG dependency, its resource's previous task, or the enforced launch order);
3. sensitivity: each comm-op made nearly free (its payload cut to one element per rank), then the joint search
   re-run, and the iteration time it reaches; also every comm-op free at once (the compute bound).

Run: .venv-llm/bin/python benchmarks/syndicate_e2_limits.py   -> results/syndicate/e2_limits.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flowlane.syndicate import CommOp, SearchConfig, TrainingDAG, mcmc_search, opt_sched  # noqa: E402
from flowlane.syndicate.optsched import Comm, Compute  # noqa: E402
from flowlane.syndicate.replan import plan_from_search, replayed  # noqa: E402
from flowlane.syndicate.workloads import dlrm_dag  # noqa: E402
from flowlane.testing.provenance import write_result  # noqa: E402

EPS = 1e-12


def shrink(dag: TrainingDAG, names: set[str]) -> TrainingDAG:
    """``dag`` with the comm-ops in ``names`` cut to one element per rank (per destination for an all-to-all)."""
    steps: list[Compute | Comm] = []
    for s in dag.steps:
        if isinstance(s, Comm) and s.name in names:
            n = s.op.ranks
            small = CommOp(s.op.name, s.op.kind, 4 * n * 4, n)  # 4 elements per rank: room for 4 segments
            steps.append(Comm(small, s.deps, s.options))
        else:
            steps.append(s)
    return TrainingDAG(dag.name, steps, dag.carry, dag.iterations)


def critical_path(dag: TrainingDAG, sched) -> list[dict]:  # noqa: ANN001 - optsched.Schedule
    """Walk back from the last task of the last iteration: at each task, the task whose finish equals its start."""
    tasks = []  # (iteration, name, motif index or None, resource, start, finish)
    for it, name, s, f in sched.compute:
        tasks.append((it, name, None, "compute", s, f))
    for m in sched.motifs:
        tasks.append((m.iteration, m.op, m.index, m.path, m.start, m.finish))
    steps = {s.name: s for s in dag.steps}
    last = dag.iterations - 1
    cur = max((t for t in tasks if t[0] == last), key=lambda t: t[5])
    chain = []
    while True:
        it, name, idx, res, s, f = cur
        preds = set(steps[name].deps) | ({a for a, b in dag.carry if b == name} if it > 0 else set())
        held_by = None
        for t in tasks:
            if abs(t[5] - s) > 1e-9 or t is cur:
                continue
            same_op_dep = t[1] == name and t[0] == it and idx is not None and t[2] is not None
            dag_dep = t[1] in preds and (t[0] == it or (t[0] == it - 1 and (t[1], name) in set(dag.carry)))
            if dag_dep or same_op_dep:
                held_by = (t, "dependency")
                break
            if t[3] == res and t[0] in (it, it - 1) and held_by is None:
                held_by = (t, f"resource {res}")
        chain.append(
            {
                "iteration": it,
                "task": name + (f"#{idx}" if idx is not None else ""),
                "resource": res,
                "start_ms": s * 1e3,
                "finish_ms": f * 1e3,
                "held_by": held_by[1] if held_by else ("start" if s <= EPS else "launch order / release"),
            }
        )
        if held_by is None or s <= EPS:
            break
        cur = held_by[0]
    return chain[::-1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget-s", type=float, default=10.0)
    ap.add_argument("--out", default="results/syndicate/e2_limits.json")
    a = ap.parse_args()
    dag, cost = dlrm_dag()
    greedy = dag.greedy_plan(cost)
    fifo = opt_sched(dag, greedy, cost, order="fifo")
    best = mcmc_search(dag, cost, SearchConfig(seed=0, time_budget_s=a.budget_s))
    s = best.schedule
    # what the enforcer runs: the plan's steady-state order replayed every iteration (the score may mix iterations)
    rep = replayed(dag, plan_from_search(dag, best, {c.name: "float32" for c in dag.comms}, 1), cost)
    last = dag.iterations - 1
    busy = {"compute": sum(f - st for it, _, st, f in s.compute if it == last)}
    for m in s.motifs:
        if m.iteration == last:
            busy[m.path] = busy.get(m.path, 0.0) + (m.finish - m.start)
    chain = critical_path(dag, s)
    on_path: dict[str, float] = {}
    for c in chain:
        if c["iteration"] == last:
            on_path[c["resource"]] = on_path.get(c["resource"], 0.0) + c["finish_ms"] - c["start_ms"]
    sens = []
    for c in dag.comms:
        d2 = shrink(dag, {c.name})
        r = mcmc_search(d2, cost, SearchConfig(seed=0, time_budget_s=a.budget_s / 4))
        sens.append(
            {"free_op": c.name, "joint_ms": r.cost * 1e3, "speedup_vs_fifo": fifo.per_iteration / r.cost}
        )
        print(
            f"{c.name:16s} free: joint {r.cost * 1e3:.2f} ms ({fifo.per_iteration / r.cost:.3f}x)", flush=True
        )
    all_free = mcmc_search(
        shrink(dag, {c.name for c in dag.comms}), cost, SearchConfig(seed=0, time_budget_s=a.budget_s / 4)
    )
    doc = {
        "label": "simulated (optSched cost model, assumed path parameters; E2 DLRM-like DAG, 16 ranks)",
        "fifo_greedy_ms": fifo.per_iteration * 1e3,
        "joint_ms": best.cost * 1e3,
        "joint_speedup": fifo.per_iteration / best.cost,
        "joint_replayed_ms": rep.per_iteration * 1e3,
        "joint_replayed_speedup": fifo.per_iteration / rep.per_iteration,
        "joint_plan": {k: v.label() for k, v in best.plan.items()},
        "joint_pick": best.pick,
        "busy_ms_per_iteration": {k: v * 1e3 for k, v in busy.items()},
        "critical_path": chain,
        "critical_path_ms_by_resource_last_iteration": on_path,
        "one_op_free": sens,
        "all_comm_free_ms": all_free.cost * 1e3,
        "speedup_needed_ms_for_1_3x": fifo.per_iteration / 1.3 * 1e3,
        # the score is makespan / 2 (two unrolled iterations), so the first iteration's fill counts; the
        # second iteration alone (end of iteration 1 - end of iteration 0) is the steady state
        "second_iteration_ms": {
            "fifo_greedy": (fifo.iteration_end[1] - fifo.iteration_end[0]) * 1e3,
            "joint": (s.iteration_end[1] - s.iteration_end[0]) * 1e3,
        },
    }
    doc["second_iteration_speedup"] = (
        doc["second_iteration_ms"]["fifo_greedy"] / doc["second_iteration_ms"]["joint"]
    )
    print(
        f"FIFO+greedy {doc['fifo_greedy_ms']:.2f} ms, joint {doc['joint_ms']:.2f} ms ({doc['joint_speedup']:.3f}x; "
        f"replayed {doc['joint_replayed_ms']:.2f} ms, {doc['joint_replayed_speedup']:.3f}x); "
        f"rule {best.pick}; 1.3x needs {doc['speedup_needed_ms_for_1_3x']:.2f} ms; busy {doc['busy_ms_per_iteration']}; "
        f"all comm free {doc['all_comm_free_ms']:.2f} ms"
    )
    print(f"second iteration alone: {doc['second_iteration_ms']} ({doc['second_iteration_speedup']:.3f}x)")
    for c in chain:
        print(
            f"  it{c['iteration']} {c['task']:18s} {c['resource']:8s} {c['start_ms']:7.2f}-{c['finish_ms']:7.2f} {c['held_by']}"
        )
    print("wrote", write_result(a.out, doc))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
