"""Rank functions for tests/test_syndicate_enforcer.py (spawned processes must import them)."""

from __future__ import annotations

import random
import time

import torch
import torch.distributed as dist

from flowlane.syndicate.cost import Option
from flowlane.syndicate.enforcer import Enforcer, EnforcerConfig, PlanMismatchError, shape_for_hermod
from flowlane.syndicate.plan import PlanChannel, PlanOp, SyndicatePlan


def plan_ops(world: int) -> list[PlanOp]:
    """Four ops in submission order: float64 all-reduce, float32 all-to-all, int64 all-gather, float32 all-reduce."""
    return [
        PlanOp("ar0", "all_reduce", 1024, "float64", world, Option("F", "ring", 4)),
        PlanOp("a2a", "all_to_all", world * 96, "float32", world, Option("S", "direct", 2, world)),
        PlanOp("ag", "all_gather", 64, "int64", world, Option("F", "direct", 2, world)),
        PlanOp("ar1", "all_reduce", 999, "float32", world, Option("S", "ring", 2)),
    ]


def shuffled_plan(world: int, seed: int = 7, version: int = 1) -> SyndicatePlan:
    fifo = SyndicatePlan.fifo(plan_ops(world), version)
    order = list(fifo.order)
    random.Random(seed).shuffle(order)
    return SyndicatePlan(version, fifo.ops, tuple(order))


def _inputs(rank: int, world: int, it: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * it + rank)
    return [
        torch.randn(1024, dtype=torch.float64, generator=g),
        torch.randn(world * 96, generator=g),
        torch.randint(-1000, 1000, (64,), generator=g),
        torch.randn(999, generator=g),
    ]


def _reference(rank: int, world: int, it: int) -> list[torch.Tensor]:
    """The framework's own path: plain torch.distributed collectives on the world group."""
    x = _inputs(rank, world, it)
    dist.all_reduce(x[0])
    a2a = torch.empty_like(x[1])
    dist.all_to_all_single(a2a, x[1])
    ag = torch.empty(world * 64, dtype=torch.int64)
    dist.all_gather_into_tensor(ag, x[2])
    dist.all_reduce(x[3])
    return [x[0], a2a, ag, x[3]]


def _iteration(
    enf: Enforcer,
    rank: int,
    world: int,
    it: int,
    jitter: random.Random | None,
    wait_early: bool = False,
    bad_numel: bool = False,
) -> list[torch.Tensor]:
    x = _inputs(rank, world, it)
    a2a = torch.empty_like(x[1])
    ag = torch.empty(world * 64, dtype=torch.int64)
    handles = []

    def nap() -> None:
        if jitter is not None:
            time.sleep(jitter.uniform(0, 0.03))

    nap()
    handles.append(enf.all_reduce(x[0]))
    if wait_early:  # a host wait point the plan does not know about
        handles[0].wait()
    nap()
    handles.append(enf.all_to_all_single(a2a, x[1]))
    nap()
    handles.append(enf.all_gather_into_tensor(ag, x[2]))
    nap()
    if bad_numel:  # a dynamic shape: the plan does not match
        x[3] = x[3][:998].contiguous()
    handles.append(enf.all_reduce(x[3]))
    for h in handles:
        h.wait()
    enf.step()
    return [x[0], a2a, ag, x[3]]


def _same(got: list[torch.Tensor], ref: list[torch.Tensor]) -> dict:
    return {
        "a2a_bitwise": torch.equal(got[1], ref[1]),
        "ag_bitwise": torch.equal(got[2], ref[2]),
        "ar64_close": bool(torch.allclose(got[0], ref[0], rtol=1e-12, atol=1e-12)),
        "ar32_close": bool(torch.allclose(got[3], ref[3][: got[3].numel()], rtol=1e-5, atol=1e-6)),
    }


def enforcer_scenarios(rank: int, world: int, store_path: str) -> dict:
    store = dist.FileStore(store_path, world)
    paths = {"F": dist.new_group(list(range(world))), "S": dist.new_group(list(range(world)))}
    out: dict = {}

    # 1. the plan under per-rank jitter: one launch order everywhere, results equal the plain collectives
    enf = Enforcer(paths, store, rank, world, EnforcerConfig(namespace="s1"))
    plan = shuffled_plan(world)
    enf.install(plan)
    jitter = random.Random(rank * 7919)
    checks = []
    for it in range(2):
        got = _iteration(enf, rank, world, it, jitter)
        checks.append(_same(got, _reference(rank, world, it)))
    out["jitter"] = {
        "log": enf.log,
        "order": [list(e) for e in plan.order],
        "checks": checks,
        "events": enf.events,
        "held_s": enf.held_s,
        "stats": enf.stats,
    }

    # 2. rank 0 installs a different plan: caught at install, naming the ranks
    enf = Enforcer(paths, store, rank, world, EnforcerConfig(namespace="s2"))
    try:
        enf.install(shuffled_plan(world, seed=8 if rank == 0 else 7))
        out["install_mismatch"] = None
    except PlanMismatchError as e:
        out["install_mismatch"] = str(e)

    # 3. unverified, rank 0 swaps two same-size motifs of one op: gloo runs it silently; the watchdog names rank 0
    enf = Enforcer(paths, store, rank, world, EnforcerConfig(namespace="s3"))
    fifo = SyndicatePlan.fifo(plan_ops(world), 1)
    order = list(fifo.order)
    if rank == 0:
        order[0], order[1] = order[1], order[0]
    enf.install(SyndicatePlan(1, fifo.ops, tuple(order)), verify=False)
    try:
        _iteration(enf, rank, world, 0, None)
        out["step_mismatch"] = None
    except PlanMismatchError as e:
        out["step_mismatch"] = str(e)

    # 4. FIFO fallback: a wait the plan did not expect, then a shape it does not know; results still right
    enf = Enforcer(paths, store, rank, world, EnforcerConfig(namespace="s4"))
    fifo = SyndicatePlan.fifo(plan_ops(world), 1)
    order = [e for e in fifo.order if e[0] == 1] + [e for e in fifo.order if e[0] != 1]  # a2a's motifs first
    enf.install(SyndicatePlan(1, fifo.ops, tuple(order)))
    got = _iteration(enf, rank, world, 0, None, wait_early=True)
    got2 = _iteration(enf, rank, world, 1, None, bad_numel=True)
    ref2 = _reference(rank, world, 1)
    x = _inputs(rank, world, 1)[3][:998].contiguous()
    dist.all_reduce(x)
    ref2[3] = x
    out["fallback"] = {
        "events": enf.events,
        "log": enf.log,
        "checks": [_same(got, _reference(rank, world, 0)), _same(got2, ref2)],
    }

    # 5. two-phase plan switch with random delays: every rank switches at the same iteration
    chan = PlanChannel(store, rank, world, prefix="s5chan", timeout_s=60)
    enf = Enforcer(paths, store, rank, world, EnforcerConfig(namespace="s5"), channel=chan)
    enf.install(SyndicatePlan.fifo(plan_ops(world), 1))
    rng = random.Random(rank)
    for it in range(5):
        if it == 1 and rank == 0:
            chan.propose(shuffled_plan(world, seed=3, version=2), switch_at=3)
        time.sleep(rng.uniform(0, 0.02))
        _iteration(enf, rank, world, it, None)
        if it == 1 and rank == 0:
            chan.decide(2)
    out["switch"] = {
        "events": enf.events,
        "channel": chan.log,
        "version": enf.plan.version if enf.plan else None,
    }

    # 6. with Hermod: its CommScheduler orders the coflow, SYNDICATE shapes it into motifs
    from flowlane.policy import CoflowMeta
    from flowlane.sched import CommScheduler, SchedulerConfig

    sched = CommScheduler(config=SchedulerConfig(mode="hermod"))
    x = _inputs(rank, world, 5)
    ref = torch.empty_like(x[1])
    dist.all_to_all_single(ref, x[1])
    got = torch.empty_like(x[1])
    h = shape_for_hermod(
        sched,
        CoflowMeta("ep", op="all_to_all"),
        plan_ops(world)[1],
        "all_to_all",
        got,
        x[1],
        paths["S"],
        rank,
        world,
        tag_base=1 << 20,
    )
    sched.seal()
    h.wait()
    sched.close()
    out["hermod_a2a_bitwise"] = torch.equal(got, ref)
    out["hermod_chunks"] = sum(1 for e in sched.log if e.event == "chunk")

    # 7. reduce-scatters (a distributed optimizer's buckets): the output a view of the input's block, as Megatron's
    # shard is, or a tensor of its own; integers, so any summation order gives the plain collective's bits
    ops = (
        PlanOp("rs_view", "reduce_scatter", 101, "int64", world, Option("F", "ring", 3)),
        PlanOp("rs_own", "reduce_scatter", 64, "int64", world, Option("S", "ring", 2)),
    )
    enf = Enforcer(paths, store, rank, world, EnforcerConfig(namespace="s7"))
    enf.install(SyndicatePlan(1, ops, ((1, 1), (0, 2), (1, 0), (0, 0), (0, 1))))
    g = torch.Generator().manual_seed(77 + rank)
    bucket, own_in = (torch.randint(-1000, 1000, (world * n,), generator=g) for n in (101, 64))
    ref_view, ref_own = torch.empty(101, dtype=torch.int64), torch.empty(64, dtype=torch.int64)
    dist.reduce_scatter_tensor(ref_view, bucket.clone())
    dist.reduce_scatter_tensor(ref_own, own_in)
    view, own = bucket[rank * 101 : (rank + 1) * 101], torch.empty(64, dtype=torch.int64)
    handles = [enf.reduce_scatter_tensor(view, bucket), enf.reduce_scatter_tensor(own, own_in)]
    for h in handles:
        h.wait()
    enf.step()
    try:
        enf.reduce_scatter_tensor(torch.empty(5), torch.empty(5 * world + 1))
        bad = ""
    except ValueError as e:
        bad = str(e)
    out["reduce_scatter"] = {
        "bitwise": torch.equal(view, ref_view) and torch.equal(own, ref_own),
        "log": [list(e[2:]) for e in enf.log],
        "events": enf.events,
        "bad": bad,
    }

    # 9. a long run keeps a bounded launch log, stats and store: each step deletes the rank's previous fingerprint key
    enf = Enforcer(
        {"F": paths["F"]}, store, rank, world, EnforcerConfig(namespace="s9", log_entries=8, stats_entries=5)
    )
    enf.install(
        SyndicatePlan.fifo((PlanOp("b", "all_reduce", 16, "float32", world, Option("F", segments=2)),), 1)
    )
    keys, rows = [], []
    for it in range(40):
        enf.all_reduce(torch.zeros(16)).wait()
        enf.step()
        rows.append(enf.stats[-1])  # every iteration's row, as it was made
        if it in (9, 39):  # every rank past this boundary, none at the next, while the store is counted
            dist.barrier()
            keys.append(store.num_keys())
            dist.barrier()
    out["long_run"] = {
        "log": list(enf.log),
        "stats": list(enf.stats),
        "rows": rows,
        "held_s": enf.held_s,
        "iteration": enf.iteration,
        "keys": keys,
        "fp0": store.check([f"s9/fp/0/{rank}"]),
        "fp39": store.check([f"s9/fp/39/{rank}"]),
    }

    # 10. FIFO mode profiles iteration 1 (signatures, group ranks, submit/done times), launching exactly what an
    # enforcer that profiles nothing launches, with bitwise the same results
    runs = {}
    for name, at in (("on", 1), ("off", -1)):
        enf = Enforcer(
            paths, store, rank, world, EnforcerConfig("fifo", namespace=f"s10{name}", profile_iteration=at)
        )
        got, seen = [], []
        for it in range(3):
            got += _iteration(enf, rank, world, it, None)
            seen.append(enf.profile())
        runs[name] = {"got": got, "log": list(enf.log), "seen": seen}
    out["profile"] = {
        "seen": runs["on"]["seen"],
        "off": runs["off"]["seen"],
        "same_log": runs["on"]["log"] == runs["off"]["log"],
        "bitwise": all(torch.equal(a, b) for a, b in zip(runs["on"]["got"], runs["off"]["got"], strict=True)),
    }

    # 8. replanning on ranks 0 and 1 (the E1 toy is a 2-rank instance); rank 2 only joins the group creations
    from tests.syndicate_fw_workers import replan_scenario

    pair = [dist.new_group([0, 1]) for _ in range(3)]
    if rank < 2:
        out["replan"] = replan_scenario(
            rank, dist.PrefixStore("replan", store), {"F": pair[0], "S": pair[1]}, pair[2]
        )
    return out
