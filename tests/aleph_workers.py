"""Module-level rank functions for ALEPH's multi-rank tests (spawned processes must import them)."""

import copy

import torch
import torch.distributed as dist

from flowlane.aleph import Plan
from flowlane.aleph.hook import HierarchicalAllReduce, install_aleph_hook
from flowlane.aleph.probe import probe_bandwidth


def _ddp_run(
    model: torch.nn.Module,
    plan: Plan | None,
    rank: int,
    steps: int = 3,
    top: str = "allreduce",
    replan: dict | None = None,
) -> list[torch.Tensor]:
    """``replan``: keyword arguments of install_aleph_hook's re-planning (``replanner``, ``probe``)."""
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.001)  # several buckets
    if plan is not None:
        # pipelined over several chunks with "ps"
        state = install_aleph_hook(ddp, plan, top=top, chunk_bytes=1024, **(replan or {}))
        if replan:
            replan["state"] = state
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(100 + rank)
    for _ in range(steps):
        x = torch.randn(16, 12, generator=g)
        loss = ddp(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return [p.detach().clone() for p in ddp.module.parameters()]


def hierarchical_cases(rank: int, world: int, cases: list) -> dict:
    """For each (clusters, top): integer and float sums against dist.all_reduce; then DDP with the hook against
    DDP's own all-reduce (all-singleton plan: bitwise; the first case's plan: close); then the bandwidth probe."""
    out: dict = {"int_equal": [], "rs_equal": [], "float_maxdiff": []}
    for clusters, top in cases:
        # 40 KB: 10 chunks
        h = HierarchicalAllReduce(Plan.from_clusters(world, clusters), top=top, chunk_bytes=4096)
        x = torch.arange(5000, dtype=torch.int64) * (rank + 1) + rank**3 - 7
        ref = x.clone()
        dist.all_reduce(ref)
        out["int_equal"].append(bool(torch.equal(h(x.clone()), ref)))
        b = 5000 // world  # the reduce-scatter: world equal blocks of b elements, each rank checks its own
        blk = slice(rank * b, (rank + 1) * b)
        out["rs_equal"].append(bool(torch.equal(h.reduce_scatter(x[: b * world].clone())[blk], ref[blk])))
        f = torch.randn(5000, generator=torch.Generator().manual_seed(rank))
        fref = f.clone()
        dist.all_reduce(fref)
        out["float_maxdiff"].append(float((h(f.clone()) - fref).abs().max()))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    ref = _ddp_run(copy.deepcopy(model), None, rank)
    flat = _ddp_run(copy.deepcopy(model), Plan.from_clusters(world, [[w] for w in range(world)]), rank)
    hier = _ddp_run(copy.deepcopy(model), Plan.from_clusters(world, cases[0][0]), rank)
    hier_ps = _ddp_run(copy.deepcopy(model), Plan.from_clusters(world, cases[0][0]), rank, top="ps")
    out["ddp_singletons_bitwise"] = all(torch.equal(a, b) for a, b in zip(ref, flat, strict=True))
    out["ddp_hier_maxdiff"] = max(
        float((a - b).abs().max()) for a, b in zip(ref + ref, hier + hier_ps, strict=True)
    )
    # re-planning every iteration (a stub probe, the same figures on every rank): the figures of
    if world == 4:
        # iteration 2 make the plan in force infeasible, so a new hierarchy takes over for the third step
        from flowlane.aleph import AlephConfig, Replanner

        replanner = Replanner([30.0, 20.0, 10.0, 10.0], AlephConfig(replan_every=1, top="ps"))
        seen = iter([[30.0, 20.0, 10.0, 10.0], [10.0, 10.0, 20.0, 30.0], [10.0, 10.0, 20.0, 30.0]])
        replan: dict = {"replanner": replanner, "probe": lambda: next(seen)}
        got = _ddp_run(copy.deepcopy(model), replanner.plan, rank, top="ps", replan=replan)
        out["replan_maxdiff"] = max(float((a - b).abs().max()) for a, b in zip(ref, got, strict=True))
        out["replan_decisions"] = [tuple(d[:2]) for d in replan["state"].decisions]
        # the hook's own probe (probe_bandwidth over the group, confirmed where it moves a worker): loopback figures
        # decide, but every rank must decide alike (they are all-gathered) and the sums stay DDP's
        real: dict = {"replanner": Replanner([30.0, 20.0, 10.0, 10.0], AlephConfig(replan_every=1, top="ps"))}
        got = _ddp_run(copy.deepcopy(model), real["replanner"].plan, rank, top="ps", replan=real)
        out["real_probe_maxdiff"] = max(float((a - b).abs().max()) for a, b in zip(ref, got, strict=True))
        out["real_probe_decisions"] = [tuple(d) for d in real["state"].decisions]
    out["ddp_moved"] = max(float((a - b).abs().max()) for a, b in zip(ref, model.parameters(), strict=True))
    figures, rate = probe_bandwidth(nbytes=1 << 16)
    out["probe"] = figures
    out["mismatch"] = mismatched_plans(rank, world)
    return out


def mismatched_plans(rank: int, world: int) -> str:
    """Rank 0 plans differently from the others: every rank must raise, none may hang."""
    clusters = [[0, 1], *([w] for w in range(2, world))] if rank == 0 else [[w] for w in range(world)]
    try:
        HierarchicalAllReduce(Plan.from_clusters(world, clusters))
    except ValueError as e:
        return str(e)
    return "no error"


def deepspeed_with_and_without(rank: int, world: int) -> dict:
    """DeepSpeed ZeRO 0, 1 and 2: each stage's own run vs the same run with ALEPH's hierarchy on the DP all-reduce
    (ZeRO 0 with two PSs); then ZeRO 3 must be refused at install."""
    from deepspeed_plugin.aleph import install
    from tests.ds_workers_common import init_deepspeed_gloo, tiny_engine, tiny_net, train

    init_deepspeed_gloo()
    out: dict = {}
    plan = {"clusters": [[3, 1, 2], [0]], "top": "ps"}
    two_ps = {**plan, "ps": [3, 0], "split": [0.6, 0.4]}  # both aggregators PSs, each summing its part
    # re-planning at every step boundary from a forced probe (the same on every rank, as the all-gathered real one):
    # steady at step 1, then rank 0 (an aggregator) slow, which the plan in force cannot carry
    replan = {"bandwidth_gbps": [30, 20, 10, 10], "top": "ps", "replan_every": 1}
    seen = iter([[30.0, 20.0, 10.0, 10.0], [5.0, 20.0, 10.0, 10.0], [5.0, 20.0, 10.0, 10.0]])
    for name, zero, aleph in (
        ("own", 0, None),
        ("replan", 0, replan),
        ("aleph", 0, two_ps),
        ("own1", 1, None),
        ("aleph1", 1, plan),
        ("own2", 2, None),
        ("aleph2", 2, plan),
        ("zero3", 3, plan),
    ):
        engine, cfg = tiny_engine(zero, None if aleph is None else {"aleph": aleph})
        try:
            h = install(engine, cfg, probe=(lambda: next(seen)) if name == "replan" else None)
        except ValueError as e:
            out[name] = str(e)
            engine.destroy()
            continue
        train(engine, rank, 3)
        out[name] = [p.detach().clone() for p in engine.module.parameters()]
        if name == "replan":
            out["replan_decisions"] = [d[:2] + d[3:] for d in h.decisions]
            out["replan_heads"] = list(h.plan.heads)
        elif h is not None:
            out[f"calls{zero or ''}"] = h.calls
        if h is not None:
            h.close()
        engine.destroy()
    out["moved"] = max(
        float((a - b).abs().max()) for a, b in zip(out["own"], tiny_net().parameters(), strict=True)
    )
    out["replan_maxdiff"] = max(
        float((a - b).abs().max()) for a, b in zip(out["own"], out.pop("replan"), strict=True)
    )
    for z in ("", "1", "2"):
        out[f"maxdiff{z}"] = max(
            float((a - b).abs().max()) for a, b in zip(out.pop(f"own{z}"), out.pop(f"aleph{z}"), strict=True)
        )
    return out
