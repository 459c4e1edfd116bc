"""E7: SYNDICATE's joint plan vs FIFO + greedy on two emulated paths, real gloo ranks. **Measured on CPU with
emulated links** (network namespaces + tc; needs root).

Each rank sits in its own namespace (flowlane.testing.netem.EmulatedNetwork): path F is its ``eth0`` access link
(``--fast-mbit``), path S a separate lane (``bulk0``, ``--slow-mbit``) beside it; one gloo group per path
(flowlane.sched.groups.build_class_groups with interfaces eth0, bulk0). Per iteration the application submits
all-reduces b, c, d and then all-to-all a (the E1 toy on real links). The ranks first time each op alone on each
path it may use (plain gloo calls) and fit each (collective, path)'s effective bandwidth from that (the cost model's
calibration by measurement: gloo's all-to-all moves about half the bytes per second its all-reduce does on the same
lane); every rank then runs the same MCMC search
on that model, and the enforcer runs the plan. The baseline is the greedy plan (everything on the faster path) in
FIFO order, through the same enforcer. The model predicts FIFO ``t_a^F + t_bcd`` against joint
``max(t_a^S, t_bcd)``; both are reported beside the measured times. Plans alternate run by run.

Run: sudo .venv-llm/bin/python benchmarks/syndicate_netns.py [--reps 6]   -> results/syndicate/netns.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from flowlane.syndicate import (  # noqa: E402  # noqa: E402
    Comm,
    CommOp,
    Compute,
    CostModel,
    Option,
    PathCost,
    SearchConfig,
    TrainingDAG,
    mcmc_search,
    opt_sched,
)
from flowlane.testing.provenance import write_result  # noqa: E402

PORT = 29731
AR_MB = (1.0, 1.0, 1.5)
A2A_MB = 4.0


def build(world: int, fast_mbit: float, slow_mbit: float) -> tuple[TrainingDAG, CostModel]:
    cost = CostModel(
        {"F": PathCost(2e-3, 8 / (fast_mbit * 1e6)), "S": PathCost(2e-3, 8 / (slow_mbit * 1e6))},
        allowed={"all_reduce": ("F",)},
    )
    mb = 1 << 20
    steps: list = [Compute("start", 0.0)]
    for name, size in zip("bcd", AR_MB, strict=True):
        op = CommOp(name, "all_reduce", int(size * mb) // (4 * world) * 4 * world, world)
        steps.append(Comm(op, ("start",), (Option("F", "ring"),)))
    a = CommOp("a", "all_to_all", int(A2A_MB * mb) // (4 * world) * 4 * world, world)
    steps.append(Comm(a, ("start",), (Option("F", "direct"), Option("S", "direct"))))
    steps.append(Compute("end", 0.0, ("a", "b", "c", "d")))
    return TrainingDAG("e7-two-path", steps, carry=[("end", "start")]), cost


def plan_from(world: int, cal: dict[str, float]) -> tuple:
    """The calibrated model (each path's effective bandwidth from the solo runs; alpha 0) and the two plans:
    greedy + FIFO, and the MCMC joint plan with its order."""
    from flowlane.syndicate.plan import PlanOp, SyndicatePlan

    dag, _ = build(world, 1.0, 1.0)
    ops = {c.name: c.op for c in dag.comms}
    wire_a = ops["a"].nbytes * (world - 1) / world
    wire_bcd = sum(2 * (world - 1) / world * ops[n].nbytes for n in "bcd")
    cost = CostModel(
        {"F": PathCost(0.0, cal["bcd_on_F"] / wire_bcd), "S": PathCost(0.0, cal["a_on_S"] / wire_a)},
        allowed={"all_reduce": ("F",)},
        per_kind={
            "all_to_all": {
                "F": PathCost(0.0, cal["a_on_F"] / wire_a),
                "S": PathCost(0.0, cal["a_on_S"] / wire_a),
            }
        },
    )
    greedy = dag.greedy_plan(cost)
    fifo_s = opt_sched(dag, greedy, cost, order="fifo")
    best = mcmc_search(dag, cost, SearchConfig(seed=0, max_iters=200, time_budget_s=60))

    def plan_ops(plan: dict) -> list:
        return [
            PlanOp(c.name, c.op.kind, c.op.nbytes // 4, "float32", world, plan[c.name]) for c in dag.comms
        ]

    plans = {
        "fifo": SyndicatePlan.from_schedule(plan_ops(greedy), fifo_s.order(), version=1),
        "joint": SyndicatePlan.from_schedule(plan_ops(best.plan), best.schedule.order(), version=2),
    }
    return (
        dag,
        cost,
        plans,
        {
            "fifo": fifo_s.per_iteration,
            "joint": best.cost,
            "model_a_on_F": cost.standalone(ops["a"], Option("F", "direct")),
        },
    )


# -- rank side -------------------------------------------------------------------------------------------------------
def worker(rank: int, world: int, master: str, spec_path: str, out_path: str, store_path: str) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    from flowlane.sched.groups import build_class_groups
    from flowlane.syndicate.enforcer import Enforcer, EnforcerConfig

    torch.set_num_threads(1)
    spec = json.loads(Path(spec_path).read_text())
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{master}:{PORT}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=240),
    )
    cg = build_class_groups([list(range(world))], gloo_class_ifnames="eth0,bulk0")
    clones = cg.groups[tuple(range(world))]
    paths = {"F": clones[0], "S": clones[1]}
    store = dist.FileStore(store_path, world)
    dag, _ = build(world, 1.0, 1.0)
    ops = {c.name: c.op for c in dag.comms}
    g = torch.Generator().manual_seed(rank)
    inputs = {n: torch.randn(op.nbytes // 4, generator=g) for n, op in ops.items()}
    # 1. calibrate: each op alone on each path it may use (plain gloo calls), slowest rank's median
    solo: dict[str, float] = {}
    for name, fn in (
        (
            "a_on_F",
            lambda: dist.all_to_all_single(torch.empty_like(inputs["a"]), inputs["a"], group=paths["F"]),
        ),
        (
            "a_on_S",
            lambda: dist.all_to_all_single(torch.empty_like(inputs["a"]), inputs["a"], group=paths["S"]),
        ),
        ("bcd_on_F", lambda: [dist.all_reduce(inputs[n].clone(), group=paths["F"]) for n in "bcd"]),
    ):
        fn()  # connections
        ts = []
        for _ in range(3):
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            dist.barrier()
            ts.append(time.perf_counter() - t0)
        solo[name] = statistics.median(ts)
    every: list = [None] * world
    dist.all_gather_object(every, solo)
    cal = {k: max(s[k] for s in every) for k in solo}
    # 2. plan on the calibrated model (every rank computes the same plan; install() compares digests)
    dag, cost, plans, predicted = plan_from(world, cal)
    enfs = {k: Enforcer(paths, store, rank, world, EnforcerConfig(namespace=k, check_every=1)) for k in plans}
    for k, p in plans.items():
        enfs[k].install(p)
    inputs_l = [inputs[o.name] for o in plans["fifo"].ops]

    def iteration(k: str) -> list:
        enf = enfs[k]
        bufs = [x.clone() for x in inputs_l]
        outs = []
        hs = []
        for op, x in zip(plans[k].ops, bufs, strict=True):
            if op.kind == "all_reduce":
                hs.append(enf.all_reduce(x))
                outs.append(x)
            else:
                y = torch.empty_like(x)
                hs.append(enf.all_to_all_single(y, x))
                outs.append(y)
        for h in hs:
            h.wait()
        enf.step()
        return outs

    res = {k: iteration(k) for k in plans}
    same = all(torch.equal(x, y) for x, y in zip(res["fifo"], res["joint"], strict=True))
    times: dict[str, list[float]] = {k: [] for k in plans}
    for rep in range(spec["reps"]):
        for k in ("fifo", "joint") if rep % 2 == 0 else ("joint", "fifo"):
            dist.barrier()
            t0 = time.perf_counter()
            iteration(k)
            dist.barrier()
            times[k].append(time.perf_counter() - t0)
    gathered: list = [None] * world
    dist.all_gather_object(
        gathered,
        {
            "rank": rank,
            "times": times,
            "same": same,
            "solo": solo,
            "calibrated": cal,
            "predicted": predicted,
            "plans": {k: {o.name: o.option.label() for o in p.ops} for k, p in plans.items()},
            "held_s": {k: e.held_s for k, e in enfs.items()},
        },
    )
    if rank == 0:
        Path(out_path).write_text(json.dumps(gathered))
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)


# -- driver ----------------------------------------------------------------------------------------------------------
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", nargs=6, metavar=("RANK", "WORLD", "MASTER", "SPEC", "OUT", "STORE"))
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--fast-mbit", type=float, default=200.0)
    ap.add_argument("--slow-mbit", type=float, default=150.0)
    ap.add_argument("--reps", type=int, default=6)
    ap.add_argument("--timeout", type=float, default=400.0)
    ap.add_argument("--out", default="results/syndicate/netns.json")
    a = ap.parse_args()
    if a.worker:
        r, w, m, s, o, st = a.worker
        worker(int(r), int(w), m, s, o, st)
        return 0
    from flowlane.testing.netem import EmulatedNetwork, check_available

    check_available()
    world = a.ranks
    doc: dict = {
        "label": "measured on CPU with emulated links (netns + tc), gloo",
        "ranks": world,
        "fast_mbit": a.fast_mbit,
        "slow_mbit": a.slow_mbit,
        "ar_mb": AR_MB,
        "a2a_mb": A2A_MB,
        "goal_speedup": 1.15,
    }
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="fl_syn_netns") as tmp:
        spec, res = os.path.join(tmp, "spec.json"), os.path.join(tmp, "res.json")
        Path(spec).write_text(json.dumps({"reps": a.reps}))
        with (
            contextlib.ExitStack() as stack,
            EmulatedNetwork(
                world, rate_mbit=a.fast_mbit, bulk_subnet="10.214.9.0/24", bulk_lane_mbit=a.slow_mbit
            ) as net,
        ):
            env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
            logs = [stack.enter_context(open(os.path.join(tmp, f"rank{r}.log"), "w+")) for r in range(world)]
            procs = [
                net.popen(
                    r,
                    [
                        sys.executable,
                        "-m",
                        "benchmarks.syndicate_netns",
                        "--worker",
                        str(r),
                        str(world),
                        net.ips[0],
                        spec,
                        res,
                        os.path.join(tmp, "store"),
                    ],
                    env=net.env(r, env),
                    cwd=str(REPO),
                    stdout=logs[r],
                    stderr=subprocess.STDOUT,
                )
                for r in range(world)
            ]
            deadline = time.monotonic() + a.timeout
            failed = False
            for p in procs:
                try:
                    p.wait(timeout=max(deadline - time.monotonic(), 1))
                except subprocess.TimeoutExpired:
                    failed = True
                    for q in procs:
                        q.kill()
                    for q in procs:
                        q.wait()
            doc["links"] = net.describe()
            errs = []
            for f in logs:
                f.seek(0)
                errs.append(f.read())
        if failed or any(p.returncode for p in procs):
            detail = "\n".join(
                f"--- rank {r} (rc {procs[r].returncode}):\n{errs[r][-2000:]}" for r in range(world)
            )
            raise RuntimeError(f"E7 ranks failed or timed out\n{detail}")
        ranks = sorted(json.loads(Path(res).read_text()), key=lambda r: r["rank"])
    plans = ("fifo", "joint")
    meas = {k: [max(r["times"][k][i] for r in ranks) for i in range(a.reps)] for k in plans}
    med = {k: statistics.median(v) for k, v in meas.items()}
    pred = ranks[0]["predicted"]
    doc.update(
        {
            "calibrated_solo_s": ranks[0]["calibrated"],
            "plans": ranks[0]["plans"],
            "predicted_s": pred,
            "predicted_speedup": pred["fifo"] / pred["joint"],
            "measured_s": meas,
            "measured_median_s": med,
            "measured_speedup": med["fifo"] / med["joint"],
            "measured_over_predicted": {k: med[k] / pred[k] for k in plans},
            "outputs_bitwise_equal_fifo_vs_joint": all(r["same"] for r in ranks),
            "held_s": [r["held_s"] for r in ranks],
            "wall_s": time.perf_counter() - t_start,
        }
    )
    print(
        f"measured fifo {med['fifo']:.3f} s, joint {med['joint']:.3f} s -> {doc['measured_speedup']:.2f}x "
        f"(predicted {doc['predicted_speedup']:.2f}x); equal outputs {doc['outputs_bitwise_equal_fifo_vs_joint']}"
    )
    print("wrote", write_result(a.out, doc))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
