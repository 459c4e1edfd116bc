"""Rank functions for tests/test_syndicate_deepspeed.py and the replanning scenario of tests/syndicate_workers.py
(spawned processes must import them)."""

from __future__ import annotations

import random
import time

import torch
import torch.distributed as dist

from flowlane.syndicate.cost import Option
from flowlane.syndicate.plan import PlanOp, SyndicatePlan


def deepspeed_with_and_without(rank: int, world: int) -> dict:
    """DeepSpeed ZeRO 0, then ZeRO 2: its own run (recording the signatures of its DP SUM all-reduces), then the same
    run with a plan that cuts each of them into up to 3 motifs launched last-first on path S; then ZeRO 3, which
    install refuses. ZeRO 0 also runs in FIFO mode for 3 iterations, writing the profile of iteration 1 (by
    ``profile_out`` on rank 0, and by ``write_profile``); a ``profile_out`` rank 0 cannot write is refused."""
    import json
    import tempfile

    from tests.ds_workers_common import init_deepspeed_gloo, tiny_engine, tiny_net, train

    init_deepspeed_gloo()
    import deepspeed.comm.comm as dscomm

    from deepspeed_plugin.syndicate import install

    out: dict = {"refused": {}}
    recorded: list[tuple[int, str]] = []

    def run(
        name: str,
        zero: int,
        section: dict | None,
        steps: int = 4,
        record: bool = False,
        disk_full: bool = False,
    ) -> None:
        """``steps`` micro-steps (2 per iteration); a flowlane run also tries to write its profile. ``disk_full``:
        every profile write fails with ENOSPC."""
        if record:
            recorded.clear()
        engine, cfg = tiny_engine(zero, None if section is None else {"syndicate": section})
        try:
            s = install(engine, cfg)
        except (ValueError, RuntimeError) as e:
            out["refused"][name] = f"{type(e).__name__}: {e}"
            engine.destroy()
            return
        if disk_full and s is not None:

            def full(path):
                raise OSError(28, "No space left on device", str(path))

            s.write_profile = full
        cdb = dscomm.cdb
        if record:  # DeepSpeed's own run, observed only: the signature of each DP all-reduce of one iteration
            original = cdb.all_reduce

            def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
                if len(recorded) < 100 and engine.global_steps == 0 and "SUM" in str(op):
                    recorded.append((tensor.numel(), str(tensor.dtype).removeprefix("torch.")))
                return original(tensor, op, group, async_op)

            cdb.all_reduce = all_reduce
        losses = train(engine, rank, steps)
        if record:
            vars(cdb).pop("all_reduce", None)
        out[name] = {"params": [p.detach().clone() for p in engine.module.parameters()], "losses": losses}
        if s is not None:
            out[name].update(
                log=list(s.enforcer.log),
                events=list(s.enforcer.events),
                submitted=list(s.submitted),
                iterations=s.enforcer.iteration,
            )
            if s.profile_written is not None:  # profile_out, written at the step that ended the iteration
                out[name]["profile_out"] = json.loads(s.profile_written.read_text())
            if disk_full:
                out[name]["profile_failed"] = s._profile_failed
                s.close()
                engine.destroy()
                return
            with tempfile.TemporaryDirectory() as tmp:
                try:
                    out[name]["profile"] = json.loads(s.write_profile(f"{tmp}/p.json").read_text())
                except ValueError as e:  # plan mode: no profile
                    out[name]["profile"] = str(e)
            s.close()
        engine.destroy()

    def last_first() -> SyndicatePlan:
        # each op cut into up to 3 segments (DeepSpeed also sums 1-element tensors), launched last segment first
        ops = [
            PlanOp(f"op{i}", "all_reduce", n, d, world, Option("S", "ring", min(3, n)))
            for i, (n, d) in enumerate(recorded)
        ]
        order = tuple((i, j) for i, op in enumerate(ops) for j in reversed(range(op.option.segments)))
        return SyndicatePlan(1, tuple(ops), order)

    for zero, suffix in ((0, ""), (2, "2")):
        run(f"own{suffix}", zero, None, record=True)
        if zero == 0:
            with tempfile.TemporaryDirectory() as auto:
                run("fifo", 0, {"mode": "fifo", "profile_out": f"{auto}/sub/auto.json"}, steps=6)
            # rank 0 cannot make the folder (rank 1 could): refused on both, before any group is made
            bad = "/dev/null/p.json" if rank == 0 else f"{tempfile.gettempdir()}/p.json"
            run("profile_out_bad", 0, {"mode": "fifo", "profile_out": bad}, steps=0)
            # the write fails on rank 0 (a full disk): said once, and every rank trains on (no rank left waiting)
            with tempfile.TemporaryDirectory() as auto:
                run(
                    "disk_full", 0, {"mode": "fifo", "profile_out": f"{auto}/p.json"}, steps=6, disk_full=True
                )
            out["disk_full"]["same_losses"] = out["disk_full"].pop("losses")[:4] == out["own"]["losses"]
            out["disk_full"].pop("params")
            out["fifo"]["same_losses"] = out["fifo"].pop("losses")[:4] == out["own"]["losses"]
            out["fifo"].pop("params")
            out["recorded"] = list(recorded)
        plan = last_first()
        out[f"plan_order{suffix}"] = [list(e) for e in plan.order]
        run(f"plan{suffix}", zero, {"plan": plan.to_dict()})
        own, planned = out.pop(f"own{suffix}"), out[f"plan{suffix}"]
        planned["bitwise"] = all(
            torch.equal(a, b) for a, b in zip(own["params"], planned.pop("params"), strict=True)
        )
        planned["same_losses"] = planned["losses"] == own["losses"]
        if zero == 0:
            out["moved"] = max(
                float((a - b).abs().max())
                for a, b in zip(own["params"], tiny_net().parameters(), strict=True)
            )
    run("zero3", 3, {"plan": plan.to_dict()}, steps=0)
    return out


class FireAt:
    """A replan trigger that fires at one iteration (the rule itself, ReplanTrigger, is tested in the core)."""

    def __init__(self, iteration: int) -> None:
        self.iteration = iteration

    def observe(self, iteration: int, held_s: float, iteration_s: float) -> bool:
        return iteration == self.iteration


def replan_scenario(rank: int, store: dist.Store, paths: dict, ref_group: dist.ProcessGroup) -> dict:
    """On 2 ranks (``paths``: path -> group of them; ``ref_group``: another group of them for the reference
    collectives): the E1 toy's comm-ops (all-reduces b, c, d then all-to-all a, uint8) under the greedy FIFO plan;
    the trigger fires at iteration 1; rank 0 re-runs the joint search out of band and the new plan is switched to by
    two-phase commit. Every iteration's outputs are compared with plain torch.distributed collectives."""
    world = 2
    from flowlane.syndicate.enforcer import Enforcer, EnforcerConfig
    from flowlane.syndicate.optsched import opt_sched
    from flowlane.syndicate.plan import PlanChannel
    from flowlane.syndicate.replan import SearchReplanner, plan_from_search
    from flowlane.syndicate.search import SearchConfig, SearchResult
    from flowlane.syndicate.workloads import two_path_toy

    dag, cost = two_path_toy()
    dtypes = {c.name: "uint8" for c in dag.comms}
    greedy = dag.greedy_plan(cost)
    fifo_s = opt_sched(dag, greedy, cost, order="fifo")
    start = plan_from_search(dag, SearchResult(greedy, {}, fifo_s.per_iteration, fifo_s, 0.0), dtypes, 1)
    chan = PlanChannel(store, rank, world, prefix="replan-chan", timeout_s=60)
    replanner = SearchReplanner(dag, cost, dtypes, SearchConfig(seed=0, max_iters=300, time_budget_s=20))
    enf = Enforcer(
        paths,
        store,
        rank,
        world,
        EnforcerConfig(namespace="replan"),
        channel=chan,
        trigger=FireAt(1),
        replanner=replanner,
    )
    enf.install(start)
    rng = random.Random(rank)
    equal = []
    switched_at = None
    for it in range(40):
        g = torch.Generator().manual_seed(10 * it + rank)
        xs = [torch.randint(0, 255, (op.numel,), dtype=torch.uint8, generator=g) for op in start.ops]
        ref = [x.clone() for x in xs]
        outs = [
            torch.empty_like(x) if op.kind == "all_to_all" else x for x, op in zip(xs, start.ops, strict=True)
        ]
        handles = []
        for x, o, op in zip(xs, outs, start.ops, strict=True):
            time.sleep(rng.uniform(0, 0.005))
            handles.append(enf.all_to_all_single(o, x) if op.kind == "all_to_all" else enf.all_reduce(x))
        for h in handles:
            h.wait()
        enf.step()
        for r, op in zip(ref, start.ops, strict=True):
            if op.kind == "all_to_all":
                got = torch.empty_like(r)
                dist.all_to_all_single(got, r, group=ref_group)
                r.copy_(got)
            else:
                dist.all_reduce(r, group=ref_group)
        equal.append(all(torch.equal(o, r) for o, r in zip(outs, ref, strict=True)))
        if switched_at is None and enf.plan is not None and enf.plan.version == 2:
            switched_at = enf.iteration
        if switched_at is not None and enf.iteration >= switched_at + 1:
            break  # one iteration under the new plan (the switch lands on one iteration everywhere)
    enf.close()
    return {
        "events": enf.events,
        "switched_at": switched_at,
        "version": enf.plan.version if enf.plan else None,
        "a_path": {o.name: o.option.path for o in enf.plan.ops}["a"] if enf.plan else None,
        "start_a_path": {o.name: o.option.path for o in start.ops}["a"],
        "searches": len(replanner.results),
        "search_cost": replanner.results[0].cost if replanner.results else None,
        "start_cost": fifo_s.per_iteration,
        "equal": equal,
        "log_tail": [e for e in enf.log if e[0] == enf.iteration - 1],
        "channel": chan.log,
    }
