"""Rank functions for tests/test_aleph_megatron.py and tests/test_syndicate_megatron.py (spawned processes import
them): a tiny GPT on Megatron-core's own DistributedDataParallel (data parallel only), get_megatron_optimizer,
finalize_model_grads and the stock schedule, trained with and without ALEPH / SYNDICATE on the DP all-reduce."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

RECIPE = dict(
    pipeline_parallel=1,
    num_layers=2,
    hidden_size=32,
    num_attention_heads=4,
    vocab_size=64,
    seq_length=16,
    micro_batch_size=2,
    num_microbatches=2,
    iterations=3,
)
BUCKET = 3000  # elements: several bucket groups


def train(
    mode: str,
    world: int,
    setup: Any = None,
    flags: tuple[str, ...] = (),
    overlap: bool = True,
    device: str = "cpu",
    pp: int = 1,
    tp: int = 1,
    dist_opt: bool = False,
    experts: int | None = None,
    ep: int = 1,
    param_overlap: bool = True,
) -> dict:
    """``mode``: ``stock`` (no flowlane), ``api`` (``setup(model, config)`` installs a feature and returns it), or
    ``megatron_lm`` (``flags`` parsed by add_flowlane_args, then FlowlaneHooks' model provider and forward step in
    pretrain's call sequence). ``device``: cpu (gloo, the tests) or cuda (NCCL, tests/gpu/megatron_dp_nccl.py).
    ``pp``: pipeline stages (world / pp data-parallel groups, one per stage; losses only on the last stage); ``tp``:
    tensor-parallel ranks (a data-parallel group per tensor-parallel rank); ``dist_opt``: Megatron's distributed
    optimizer (gradients reduce-scattered, parameters all-gathered: with ``overlap_param_gather`` in the forward
    pre-hooks, or with ``param_overlap=False`` synchronously after the optimizer step); ``experts``: a MoE
    model with that many experts, ``ep`` expert-parallel ranks (its expert bucket groups reduce over the
    expert-data-parallel groups)."""
    import argparse
    from functools import partial

    import torch
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from flowlane import comm
    from flowlane.launch import heartbeat
    from megatron_plugin.args import add_flowlane_args
    from megatron_plugin.dp_collective import collective_group
    from megatron_plugin.megatron_lm import FlowlaneHooks
    from recipes.gpt import GPTRecipe, _forward_step, build_model, synthetic_batches

    recipe = GPTRecipe(
        world_size=world,
        **{**RECIPE, "pipeline_parallel": pp, "tensor_parallel": tp},
        num_moe_experts=experts,
        expert_parallel=ep,
    )
    forward_step = partial(_forward_step, recipe=recipe, device=device)
    with comm.owned_process_groups():
        ps.initialize_model_parallel(
            tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, expert_model_parallel_size=ep
        )
        try:
            torch.manual_seed(0)
            model_parallel_cuda_manual_seed(0)
            hooks = None
            if mode == "megatron_lm":
                args = add_flowlane_args(argparse.ArgumentParser()).parse_args(list(flags))
                args.num_layers, args.pipeline_model_parallel_size = recipe.num_layers, pp
                args.tensor_model_parallel_size, args.num_experts = tp, experts
                args.expert_model_parallel_size = ep
                args.overlap_grad_reduce, args.use_distributed_optimizer = overlap, dist_opt
                hooks = FlowlaneHooks(
                    lambda **kw: build_model(recipe, device)[0], forward_step, get_args=lambda: args
                )
                module = hooks.model_provider(pre_process=True, post_process=True)
                config = module.config
                forward_step = hooks.forward_step
            else:
                module, config = build_model(recipe, device)
            model = DistributedDataParallel(
                config,
                DistributedDataParallelConfig(
                    grad_reduce_in_fp32=True,
                    overlap_grad_reduce=overlap,
                    bucket_size=BUCKET,
                    use_distributed_optimizer=dist_opt,
                    overlap_param_gather=dist_opt and param_overlap,
                ),
                module,
            )
            opt = get_megatron_optimizer(
                OptimizerConfig(optimizer="adam", lr=1e-2, clip_grad=1.0, use_distributed_optimizer=dist_opt),
                [model],
            )
            config.no_sync_func = model.no_sync
            config.finalize_model_grads_func = finalize_model_grads
            if dist_opt:
                config.param_sync_func = model.start_param_sync
            feature = setup(model, config) if mode == "api" else None
            fwd_bwd = get_forward_backward_func()
            losses = []
            for it in range(recipe.iterations):
                heartbeat()  # progress for flowlane.launch's stall timeout (the GPU checks run many trainings)
                model.zero_grad_buffer()
                opt.zero_grad()
                res = fwd_bwd(
                    forward_step_func=forward_step,
                    data_iterator=synthetic_batches(recipe, ps.get_data_parallel_rank(), it),
                    model=[model],
                    num_microbatches=recipe.num_microbatches,
                    seq_length=recipe.seq_length,
                    micro_batch_size=recipe.micro_batch_size,
                    forward_only=False,
                )
                opt.step()
                if res:  # the last pipeline stage's
                    losses.append(float(torch.stack([o["lm loss"] for o in res]).mean()))
            if hooks is not None:
                feature = hooks.aleph or hooks.syndicate
            out: dict = {
                "losses": losses,
                "params": [p.detach().clone() for p in model.parameters()],
                "bucket_groups": len(model.bucket_groups),
                "expert_bucket_groups": len(model.expert_parallel_bucket_groups),
            }
            if feature is not None:
                out["calls"] = feature.calls
                out["expert_calls"] = getattr(feature, "expert_calls", 0)
                out["gathers"] = feature.gathers
                out["expert_gathers"] = getattr(feature, "expert_gathers", 0)
                out["decisions"] = getattr(feature, "decisions", [])
                enforcer = getattr(feature, "enforcer", None)
                if enforcer is not None:
                    out.update(
                        log=list(enforcer.log),
                        events=list(enforcer.events),
                        submitted=feature.submitted,
                        iterations=enforcer.iteration,
                    )
                expert = getattr(feature, "expert_enforcer", None)
                if expert is not None:
                    out.update(
                        expert_log=list(expert.log),
                        expert_events=list(expert.events),
                        expert_submitted=feature.expert_submitted,
                    )
                plan = getattr(feature, "plan", None)
                if plan is not None and hasattr(plan, "num_flows"):
                    out["num_flows"] = plan.num_flows
                if hooks is not None:
                    hooks.close()
                else:
                    feature.close()
                out["restored"] = all(
                    collective_group(bg) is ps.get_data_parallel_group(with_context_parallel=True)
                    for bg in model.bucket_groups
                ) and all(
                    type(collective_group(bg)).__name__ != "_DPGroup"
                    for bg in model.expert_parallel_bucket_groups
                )
            return out
        finally:
            ps.destroy_model_parallel()


def refusal(
    world: int, what: Any, dist_opt: bool = False, experts: int | None = None, ep: int = 1, **ddp: Any
) -> str:
    """The error ``what(model, config)`` raises on a fresh DDP model ('' when it raises none); ``experts``, ``ep``:
    a MoE model (as in :func:`train`); ``ddp``: more DistributedDataParallelConfig fields."""
    import torch
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from flowlane import comm
    from recipes.gpt import GPTRecipe, build_model

    recipe = GPTRecipe(world_size=world, **RECIPE, num_moe_experts=experts, expert_parallel=ep)
    with comm.owned_process_groups():
        ps.initialize_model_parallel(expert_model_parallel_size=ep)
        try:
            torch.manual_seed(0)
            model_parallel_cuda_manual_seed(0)
            module, config = build_model(recipe)
            ddp_config = DistributedDataParallelConfig(
                grad_reduce_in_fp32=True, overlap_grad_reduce=True, use_distributed_optimizer=dist_opt, **ddp
            )
            model = DistributedDataParallel(config, ddp_config, module)
            config.finalize_model_grads_func = finalize_model_grads
            try:
                what(model, config)
            except (ValueError, RuntimeError) as e:
                return f"{type(e).__name__}: {e}"
            return ""
        finally:
            ps.destroy_model_parallel()


@contextlib.contextmanager
def _warnings(logger: str) -> Iterator[list[str]]:
    """The messages ``logger`` warns with inside the block."""
    import logging

    got: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: got.append(record.getMessage())  # type: ignore[method-assign]
    log = logging.getLogger(logger)
    log.addHandler(handler)
    try:
        yield got
    finally:
        log.removeHandler(handler)


def _equal(a: dict, b: dict) -> dict:
    import torch

    return {
        "bitwise": a["losses"] == b["losses"]
        and all(torch.equal(x, y) for x, y in zip(a["params"], b["params"], strict=True)),
        "maxdiff": max(float((x - y).abs().max()) for x, y in zip(a["params"], b["params"], strict=True)),
    }


def last_first_plan(submitted: list, dp: int, segments: int):  # -> SyndicatePlan
    """A plan for the steady state's (iteration 1) submissions recorded in FIFO mode: every bucket cut into up to
    ``segments`` motifs, launched last bucket first, last motif first (an order across ops)."""
    from flowlane.syndicate.cost import Option
    from flowlane.syndicate.plan import PlanOp, SyndicatePlan

    sigs = [(n, d) for it, _, n, d in submitted if it == 1]
    ops = tuple(
        PlanOp(f"bucket{i}", "all_reduce", n, d, dp, Option("S", "ring", min(segments, n)))
        for i, (n, d) in enumerate(sigs)
    )
    order = tuple((i, j) for i in reversed(range(len(ops))) for j in reversed(range(ops[i].option.segments)))
    return SyndicatePlan(1, ops, order)


def aleph_runs(rank: int, world: int) -> dict:
    """Megatron's own run; ALEPH with an all-singleton plan (API), a two-pair PS tree (the Megatron-LM flags) and an
    M-WCHA plan from bandwidth figures (API); then refusals."""
    from megatron_plugin import cpu_shim

    cpu_shim.apply()
    from megatron_plugin.aleph import AlephMegatronConfig, install

    stock = train("stock", world)
    res: dict = {}
    runs = {
        "singletons": ("api", AlephMegatronConfig(clusters="0;1;2;3"), ()),
        "pairs_ps_flags": (
            "megatron_lm",
            None,
            ("--aleph", "--aleph-clusters", "0,2;1,3", "--aleph-top", "ps"),
        ),
        # two PSs (the two aggregators), each summing half of every bucket
        "two_ps_flags": (
            "megatron_lm",
            None,
            (
                "--aleph",
                "--aleph-clusters",
                "0,2;1,3",
                "--aleph-top",
                "ps",
                "--aleph-ps",
                "0,1",
                "--aleph-split",
                "equal",
            ),
        ),
        # (and Megatron's synchronous path: each bucket group started and waited for inside finish_grad_sync)
        "mwcha_no_overlap": ("api", AlephMegatronConfig(bandwidth_gbps="30,20,10,10"), ()),
    }
    for name, (mode, cfg, flags) in runs.items():
        overlap = name != "mwcha_no_overlap"
        out = train(mode, world, (lambda m, c, cfg=cfg: install([m], cfg)), flags, overlap=overlap)
        res[name] = {k: out[k] for k in ("calls", "bucket_groups", "restored", "num_flows") if k in out}
        res[name].update(_equal(stock, out))
    # re-planning every iteration from probed figures (a stub: the same on every rank, as the real probe's are):
    # unchanged at iteration 1, then ranks 2 and 3 fast and 0, 1 slow, which the plan in force cannot carry
    seen = iter([[30.0, 20.0, 10.0, 10.0], [10.0, 10.0, 20.0, 30.0], [10.0, 10.0, 20.0, 30.0]])
    cfg = AlephMegatronConfig(bandwidth_gbps="30,20,10,10", top="ps", replan_every=1)
    out = train("api", world, lambda m, c: install([m], cfg, c, probe=lambda group: next(seen)))
    res["replan"] = {k: out[k] for k in ("calls", "bucket_groups", "restored", "decisions")}
    res["replan"].update(_equal(stock, out))
    res["refused_avg"] = refusal(
        world,
        lambda m, c: install([m], AlephMegatronConfig(clusters="0;1;2;3")),
        dist_opt=True,
        average_in_collective=True,
    )
    res["refused_size"] = refusal(
        world, lambda m, c: install([m], AlephMegatronConfig(bandwidth_gbps="30,20"))
    )

    def twice(m: Any, c: Any) -> None:
        first = install([m], AlephMegatronConfig(clusters="0;1;2;3"))
        try:
            install([m], AlephMegatronConfig(clusters="0;1;2;3"))
        finally:
            first.close()

    res["refused_twice"] = refusal(world, twice)

    def under_hermod(m: Any, c: Any) -> None:
        from megatron.core import parallel_state as ps

        from megatron_plugin.hermod import Hermod, HermodConfig

        h = Hermod(
            HermodConfig(),
            num_microbatches=2,
            layers_per_stage=2,
            stage=0,
            dp_group=ps.get_data_parallel_group(with_context_parallel=True),
        )
        h.attach_ddp([m])
        try:
            install([m], AlephMegatronConfig(clusters="0;1;2;3"))
        finally:
            h.close()

    res["refused_hermod"] = refusal(world, under_hermod)
    return res


def syndicate_runs(rank: int, world: int, tmp: str) -> dict:
    """Megatron's own run; the enforcer in FIFO mode (API, recording the signatures); a plan that cuts every bucket
    into up to 3 motifs launched last op first, last motif first (the Megatron-LM flags); a rank holding another
    plan."""
    from megatron_plugin import cpu_shim

    cpu_shim.apply()
    from flowlane.syndicate.plan import SyndicatePlan
    from megatron_plugin.syndicate import SyndicateMegatronConfig, install

    stock = train("stock", world)
    fifo = train("api", world, lambda m, c: install([m], SyndicateMegatronConfig(mode="fifo"), c))
    res: dict = {"fifo": _equal(stock, fifo), "fifo_events": fifo["events"]}
    res["ops"] = len([1 for it, *_ in fifo["submitted"] if it == 1])  # the steady state's submissions

    def plan_with(segments: int) -> SyndicatePlan:
        return last_first_plan(fifo["submitted"], world, segments)

    plan = plan_with(3)
    path = os.path.join(tmp, "plan.json")
    if rank == 0:
        with open(path, "w") as f:
            f.write(plan.to_json())
    import torch.distributed as dist

    dist.barrier()
    out = train("megatron_lm", world, flags=("--syndicate", "--syndicate-plan", path))
    res["plan"] = _equal(stock, out)
    res["plan"].update(
        {k: out[k] for k in ("calls", "bucket_groups", "restored", "log", "events", "iterations")}
    )
    res["plan_order"] = [list(e) for e in plan.order]
    # the Megatron-LM flags in FIFO mode write the recorded iteration's profile at the end (DP rank 0 only)
    prof = os.path.join(tmp, "profile.json")
    flags = ("--syndicate", "--syndicate-mode", "fifo", "--syndicate-profile-out", prof)
    res["profile_run"] = _equal(stock, train("megatron_lm", world, flags=flags))["bitwise"]
    dist.barrier()
    res["profile_ops"] = len(json.loads(Path(prof).read_text())["ops"]) if os.path.exists(prof) else None
    other = os.path.join(tmp, f"plan{rank}.json")
    with open(other, "w") as f:
        f.write((plan_with(2) if rank == 1 else plan).to_json())
    res["mismatch"] = refusal(
        world, lambda m, c: install([m], SyndicateMegatronConfig(plan=other, timeout_s=30), c)
    )
    return res


def pp_runs(rank: int, world: int, tmp: str, device: str = "cpu") -> dict:
    """PP 2 x DP 2 (two data-parallel groups, one per stage): Megatron's own run; ALEPH, a pair's PS tree on each
    group (the Megatron-LM flags); SYNDICATE in FIFO mode (API), then each stage's own plan (``{pp_rank}`` in the
    flag's path) that cuts every bucket into up to 3 motifs launched last op first; then TP 2 x DP 2. ``device``:
    cpu (gloo, with Megatron's CPU shim) or cuda (NCCL, tests/gpu/megatron_dp_pp_nccl.py)."""
    if device == "cpu":
        from megatron_plugin import cpu_shim

        cpu_shim.apply()
    from megatron_plugin import te_compat

    te_compat.apply()
    import torch.distributed as dist

    from megatron_plugin.syndicate import SyndicateMegatronConfig, install

    stock = train("stock", world, pp=2, device=device)
    res: dict = {}
    out = train(
        "megatron_lm",
        world,
        flags=("--aleph", "--aleph-clusters", "0,1", "--aleph-top", "ps"),
        pp=2,
        device=device,
    )
    res["aleph"] = {k: out[k] for k in ("calls", "bucket_groups", "restored") if k in out}
    res["aleph"].update(_equal(stock, out), losses=len(out["losses"]))
    fifo = train(
        "api", world, lambda m, c: install([m], SyndicateMegatronConfig(mode="fifo"), c), pp=2, device=device
    )
    res["fifo"] = _equal(stock, fifo)
    plan = last_first_plan(fifo["submitted"], world // 2, 3)
    # Megatron's rank order puts PP outermost: ranks 0, 1 are stage 0 (the test checks the losses)
    stage = rank // 2
    if rank % 2 == 0:  # the stage's first data-parallel rank writes its plan
        with open(f"{tmp}/stage{stage}.json", "w") as f:
            f.write(plan.to_json())
    dist.barrier()
    out = train(
        "megatron_lm",
        world,
        flags=("--syndicate", "--syndicate-plan", f"{tmp}/stage{{pp_rank}}.json"),
        pp=2,
        device=device,
    )
    res["plan"] = _equal(stock, out)
    res["plan"].update({k: out[k] for k in ("calls", "bucket_groups", "restored", "log", "events")})
    res["plan"]["steady"] = [[op, m] for i, _, op, m in out["log"] if i == 1]
    res["plan_order"] = [list(e) for e in plan.order]
    res["stage"] = stage
    # TP 2 x DP 2: a data-parallel group per tensor-parallel rank ({0, 2} and {1, 3}), the same bucket sizes in both,
    # so one plan serves both groups
    stock = train("stock", world, tp=2, device=device)
    out = train(
        "megatron_lm",
        world,
        flags=("--aleph", "--aleph-clusters", "0,1", "--aleph-top", "ps"),
        tp=2,
        device=device,
    )
    res["tp_aleph"] = {k: out[k] for k in ("calls", "bucket_groups", "restored") if k in out}
    res["tp_aleph"].update(_equal(stock, out))
    fifo = train(
        "api", world, lambda m, c: install([m], SyndicateMegatronConfig(mode="fifo"), c), tp=2, device=device
    )
    plan = last_first_plan(fifo["submitted"], world // 2, 3)
    if rank == 0:
        with open(f"{tmp}/tp.json", "w") as f:
            f.write(plan.to_json())
    dist.barrier()
    out = train(
        "megatron_lm", world, flags=("--syndicate", "--syndicate-plan", f"{tmp}/tp.json"), tp=2, device=device
    )
    res["tp_plan"] = _equal(stock, out)
    res["tp_plan"].update({k: out[k] for k in ("calls", "bucket_groups", "restored")})
    res["tp_plan"]["steady"] = [[op, m] for i, _, op, m in out["log"] if i == 1]
    res["tp_plan_order"] = [list(e) for e in plan.order]
    return res


def gather_plan(submitted: list, dp: int, segments: int, reverse_gathers: bool = False):  # -> SyndicatePlan
    """A plan for the distributed optimizer's steady-state (iteration 1) submissions recorded in FIFO mode: the
    parameter all-gathers first (Megatron gathers in the forward, before the backward's reduce-scatters), each cut
    into up to ``segments`` motifs of this rank's block and launched in submission order, last motif first (Megatron
    waits for each gather before it starts the next); then the reduce-scatters cut alike, last op first, last motif
    first. ``reverse_gathers``: the gathers in the other bucket-group order (recorded with ``overlap_param_gather``,
    whose forward pre-hooks gather the last bucket group first, planned for a run without it, which gathers
    bucket group 0 first)."""
    from flowlane.syndicate.cost import Option
    from flowlane.syndicate.plan import PlanOp, SyndicatePlan

    sigs = [(k, n, d) for it, k, n, d in submitted if it == 1]
    gathers = [(n, d) for k, n, d in sigs if k == "all_gather"]
    scatters = [(n, d) for k, n, d in sigs if k == "reduce_scatter"]
    if reverse_gathers:
        gathers.reverse()
    ops = tuple(
        PlanOp(f"gather{i}", "all_gather", n, d, dp, Option("S", "ring", min(segments, n)))
        for i, (n, d) in enumerate(gathers)
    ) + tuple(
        PlanOp(f"bucket{i}", "reduce_scatter", n, d, dp, Option("S", "ring", min(segments, n)))
        for i, (n, d) in enumerate(scatters)
    )
    g = len(gathers)
    order = tuple((i, j) for i in range(g) for j in reversed(range(ops[i].option.segments))) + tuple(
        (i, j) for i in reversed(range(g, len(ops))) for j in reversed(range(ops[i].option.segments))
    )
    return SyndicatePlan(1, ops, order)


def dist_opt_runs(rank: int, world: int, tmp: str, device: str = "cpu") -> dict:
    """Megatron's distributed optimizer (DP ``world``, gradients reduce-scattered, parameters all-gathered with
    ``overlap_param_gather``): Megatron's own run; ALEPH, a pair's PS tree (the Megatron-LM flags; the gathers pass
    through to Megatron's group); SYNDICATE in FIFO mode (API, recording the gathers' and reduce-scatters'
    signatures), then a plan cutting every parameter all-gather and every reduce-scatter block into up to 3 motifs
    (:func:`gather_plan`, the flags); the same without ``overlap_param_gather`` (the gathers after the optimizer step)
    against Megatron's own run so; plans refused at install."""
    if device == "cpu":
        from megatron_plugin import cpu_shim

        cpu_shim.apply()
    from megatron_plugin import te_compat

    te_compat.apply()
    import torch.distributed as dist

    from flowlane.syndicate.plan import PlanOp, SyndicatePlan
    from megatron_plugin.syndicate import SyndicateMegatronConfig, install

    stock = train("stock", world, dist_opt=True, device=device)
    res: dict = {"losses": len(stock["losses"])}
    out = train(
        "megatron_lm",
        world,
        flags=("--aleph", "--aleph-clusters", ",".join(map(str, range(world))), "--aleph-top", "ps"),
        dist_opt=True,
        device=device,
    )
    res["aleph"] = {k: out[k] for k in ("calls", "gathers", "bucket_groups", "restored")}
    res["aleph"].update(_equal(stock, out))
    fifo = train(
        "api",
        world,
        lambda m, c: install([m], SyndicateMegatronConfig(mode="fifo"), c),
        dist_opt=True,
        device=device,
    )
    res["fifo"] = _equal(stock, fifo)
    res["fifo"].update(
        kinds=[k for it, k, _, _ in fifo["submitted"] if it == 1],
        events=fifo["events"],
        gathers=fifo["gathers"],
    )

    def write(name: str, plan: SyndicatePlan) -> str:
        path = os.path.join(tmp, name)
        if rank == 0:
            with open(path, "w") as f:
                f.write(plan.to_json())
        dist.barrier()
        return path

    def log_of(out: dict) -> dict:
        return {
            "steady": [[op, m] for i, _, op, m in out["log"] if i == 1],
            "first": [[op, m] for i, _, op, m in out["log"] if i == 0],
        }

    keys = ("calls", "gathers", "bucket_groups", "restored", "events")
    plan = gather_plan(fifo["submitted"], world, 3)
    path = write("plan.json", plan)
    out = train(
        "megatron_lm", world, flags=("--syndicate", "--syndicate-plan", path), dist_opt=True, device=device
    )
    res["plan"] = _equal(stock, out)
    res["plan"].update({k: out[k] for k in keys}, **log_of(out))
    res["plan_order"] = [list(e) for e in plan.order]
    res["plan_gathers"] = sum(op.kind == "all_gather" for op in plan.ops)
    # without overlap_param_gather: Megatron gathers synchronously after the optimizer step (so after the iteration
    # boundary at the end of finalize_model_grads), bucket group 0 first; iteration 0 gathers nothing
    stock_sync = train("stock", world, dist_opt=True, param_overlap=False, device=device)
    sync_plan = gather_plan(fifo["submitted"], world, 3, reverse_gathers=True)
    sync_path = write("sync_plan.json", sync_plan)
    with _warnings("flowlane.syndicate") as warned:
        out = train(
            "megatron_lm",
            world,
            flags=("--syndicate", "--syndicate-plan", sync_path),
            dist_opt=True,
            param_overlap=False,
            device=device,
        )
    res["sync"] = _equal(stock_sync, out)
    res["sync"].update({k: out[k] for k in keys}, **log_of(out), warnings=warned)
    res["sync_order"] = [list(e) for e in sync_plan.order]
    if device == "cpu":  # the refusals are device-free (checked on CPU only)
        g = res["plan_gathers"]
        # the reduce-scatters alone
        scatters = SyndicatePlan(1, plan.ops[g:], tuple((i - g, j) for i, j in plan.order if i >= g))
        rs_path = write("rs_plan.json", scatters)
        res["refused_rs_plan"] = refusal(
            world, lambda m, c: install([m], SyndicateMegatronConfig(plan=rs_path, timeout_s=30), c)
        )
        res["refused_no_gathers"] = refusal(
            world,
            lambda m, c: install([m], SyndicateMegatronConfig(plan=rs_path, timeout_s=30), c),
            dist_opt=True,
        )
        res["passthrough"] = refusal(  # '' when installed: the gathers stay on Megatron's group, unshaped
            world,
            lambda m, c: install(
                [m], SyndicateMegatronConfig(plan=rs_path, param_gather="passthrough", timeout_s=30), c
            ).close(),
            dist_opt=True,
        )
        short = SyndicatePlan(  # the first gather left out
            1, plan.ops[1:], tuple((i - 1, j) for i, j in plan.order if i >= 1)
        )
        short_path = write("short_plan.json", short)
        res["refused_short"] = refusal(
            world,
            lambda m, c: install([m], SyndicateMegatronConfig(plan=short_path, timeout_s=30), c),
            dist_opt=True,
        )
        ar = SyndicatePlan(
            1,
            plan.ops[:g]
            + tuple(
                PlanOp(o.name, "all_reduce", o.numel * world, o.dtype, world, o.option) for o in plan.ops[g:]
            ),
            plan.order,
        )
        ar_path = write("ar_plan.json", ar)
        res["refused_ar_plan"] = refusal(
            world,
            lambda m, c: install([m], SyndicateMegatronConfig(plan=ar_path, timeout_s=30), c),
            dist_opt=True,
        )
        # a gather no bucket has, through the Megatron-LM flags (each chunk attached at its first forward step):
        # refused once the last chunk is attached, not run as FIFO every iteration
        first = plan.ops[0]
        extra = SyndicatePlan(
            1,
            (PlanOp("extra", "all_gather", first.numel + 8, first.dtype, world, first.option), *plan.ops),
            tuple((0, j) for j in range(first.option.segments)) + tuple((i + 1, j) for i, j in plan.order),
        )
        extra_path = write("extra_plan.json", extra)
        try:
            train("megatron_lm", world, flags=("--syndicate", "--syndicate-plan", extra_path), dist_opt=True)
            res["refused_extra_flags"] = ""
        except (ValueError, RuntimeError) as e:
            res["refused_extra_flags"] = f"{type(e).__name__}: {e}"
        # Megatron's own all-to-all reduce-scatter (summed in fp32) bypasses the group's reduce-scatter (last: a DDP
        # built with it makes it megatron-core's reduce-scatter for the whole process)
        from megatron_plugin.aleph import AlephMegatronConfig
        from megatron_plugin.aleph import install as aleph_install

        fp32acc = {"dist_opt": True, "reduce_scatter_with_fp32_accumulation": True}
        res["refused_fp32acc"] = [
            refusal(world, lambda m, c: aleph_install([m], AlephMegatronConfig(clusters="0;1")), **fp32acc),
            refusal(world, lambda m, c: install([m], SyndicateMegatronConfig(mode="fifo"), c), **fp32acc),
        ]
    return res


def moe_runs(rank: int, world: int, tmp: str, device: str = "cpu") -> dict:
    """MoE, 4 experts, EP 2 on 4 ranks: the experts' bucket groups reduce over two expert-data-parallel groups
    ({0, 2}, {1, 3}). Megatron's own run; ALEPH with a flat dense plan (Megatron's own gloo all-reduce) and a cluster
    of two per expert group (the flags); SYNDICATE in FIFO mode (API), then a FIFO-ordered dense plan and an expert
    plan cutting every expert bucket into up to 3 motifs launched last first (the flags). Every run is bitwise: the
    dense plans keep Megatron's whole all-reduces in its order, and an expert group's sum has two terms. On CPU also
    the distributed optimizer (``overlap_param_gather``): Megatron's own run, FIFO mode, then a dense and an expert
    :func:`gather_plan` (gathers and blocks in up to 3 motifs; the flags). ``device``: cpu (gloo, with Megatron's
    CPU shim) or cuda (NCCL, tests/gpu/megatron_dp_pp_nccl.py)."""
    if device == "cpu":
        from megatron_plugin import cpu_shim

        cpu_shim.apply()
    from megatron_plugin import te_compat

    te_compat.apply()
    import torch.distributed as dist

    from flowlane.syndicate.plan import SyndicatePlan
    from megatron_plugin.aleph import AlephMegatronConfig
    from megatron_plugin.aleph import install as aleph_install
    from megatron_plugin.syndicate import SyndicateMegatronConfig, install

    model = {"experts": 4, "ep": 2}
    moe = {**model, "device": device}
    stock = train("stock", world, **moe)
    res: dict = {}
    out = train(
        "megatron_lm",
        world,
        flags=("--aleph", "--aleph-clusters", "0;1;2;3", "--aleph-expert-clusters", "0,1"),
        **moe,
    )
    keys = ("calls", "expert_calls", "bucket_groups", "expert_bucket_groups", "restored")
    res["aleph"] = {k: out[k] for k in keys}
    res["aleph"].update(_equal(stock, out))
    if device == "cpu":  # the refusals are device-free (checked on CPU only)
        res["aleph_no_expert_plan"] = refusal(
            world, lambda m, c: aleph_install([m], AlephMegatronConfig(clusters="0;1;2;3")), **model
        )
    fifo = train("api", world, lambda m, c: install([m], SyndicateMegatronConfig(mode="fifo"), c), **moe)
    res["fifo"] = _equal(stock, fifo)
    dense = SyndicatePlan.fifo(last_first_plan(fifo["submitted"], world, 1).ops, 1)
    expert = last_first_plan(fifo["expert_submitted"], world // 2, 3)
    paths = [os.path.join(tmp, f"moe_{k}.json") for k in ("dense", "expert")]
    if rank == 0:
        for p, pl in zip(paths, (dense, expert), strict=True):
            with open(p, "w") as f:
                f.write(pl.to_json())
    dist.barrier()
    out = train(
        "megatron_lm",
        world,
        flags=("--syndicate", "--syndicate-plan", paths[0], "--syndicate-expert-plan", paths[1]),
        **moe,
    )
    res["plan"] = _equal(stock, out)
    res["plan"].update({k: out[k] for k in keys})
    res["plan"]["steady"] = [[op, m] for i, _, op, m in out["log"] if i == 1]
    res["plan"]["expert_steady"] = [[op, m] for i, _, op, m in out["expert_log"] if i == 1]
    res["orders"] = [[list(e) for e in pl.order] for pl in (dense, expert)]
    if device == "cpu":
        res["syndicate_no_expert_plan"] = refusal(
            world, lambda m, c: install([m], SyndicateMegatronConfig(plan=paths[0]), c), **model
        )
        # the distributed optimizer (overlap_param_gather): each lane's parameter all-gathers and reduce-scatters
        # are its plan's ops (gather_plan: every gather and every block cut into up to 3 motifs), the dense lane's
        # over DP 4, the expert lane's over its expert-data-parallel group
        do = {**moe, "dist_opt": True}
        stock = train("stock", world, **do)
        fifo = train("api", world, lambda m, c: install([m], SyndicateMegatronConfig(mode="fifo"), c), **do)
        res["do_fifo"] = _equal(stock, fifo)
        plans = (
            gather_plan(fifo["submitted"], world, 3),
            gather_plan(fifo["expert_submitted"], world // 2, 3),
        )
        do_paths = [os.path.join(tmp, f"moe_do_{k}.json") for k in ("dense", "expert")]
        if rank == 0:
            for p, pl in zip(do_paths, plans, strict=True):
                with open(p, "w") as f:
                    f.write(pl.to_json())
        dist.barrier()
        flags = ("--syndicate", "--syndicate-plan", do_paths[0], "--syndicate-expert-plan", do_paths[1])
        out = train("megatron_lm", world, flags=flags, **do)
        res["do_plan"] = _equal(stock, out)
        res["do_plan"].update(
            {k: out[k] for k in (*keys, "gathers", "expert_gathers", "events", "expert_events")}
        )
        for k in ("log", "expert_log"):
            res["do_plan"][k.replace("log", "steady")] = [[op, m] for i, _, op, m in out[k] if i == 1]
        res["do_orders"] = [[list(e) for e in pl.order] for pl in plans]
        res["do_kinds"] = [
            [k for it, k, _, _ in fifo[s] if it == 1] for s in ("submitted", "expert_submitted")
        ]
    return res


def moe_ep1_runs(rank: int, world: int) -> dict:
    """MoE (2 experts) at expert-model-parallel size 1 on DP ``world``: megatron-core marks expert parameters
    ``allreduce=False`` only at EP > 1, so here they sit in the dense bucket groups and the model has no expert bucket
    groups. Megatron's own run; ALEPH (``--aleph-clusters``, no expert flags) and SYNDICATE (FIFO) through the
    Megatron-LM flags; expert flags given anyway (refused)."""
    import dataclasses

    import megatron.core.transformer.transformer_config as tc

    from megatron_plugin import cpu_shim

    cpu_shim.apply()

    # megatron-core 0.16 cannot train experts with biases at EP 1 and TP 1 (MLP.forward adds the bias in place to
    # the output of an autograd Function that returns its input); the recipe's layers have biases, so this process
    # builds them without (Megatron-LM: --disable-bias-linear)
    @dataclasses.dataclass
    class NoBias(tc.TransformerConfig):
        add_bias_linear: bool = False

    tc.TransformerConfig = NoBias  # type: ignore[misc]
    moe = {"experts": 2, "ep": 1}
    stock = train("stock", world, **moe)
    singletons = ";".join(map(str, range(world)))
    res: dict = {}
    keys = ("calls", "expert_calls", "bucket_groups", "expert_bucket_groups", "restored")
    for name, flags in (
        ("aleph", ("--aleph", "--aleph-clusters", singletons)),
        ("syndicate", ("--syndicate", "--syndicate-mode", "fifo")),
    ):
        out = train("megatron_lm", world, flags=flags, **moe)
        res[name] = {k: out[k] for k in keys}
        res[name].update(_equal(stock, out))
    try:
        train(
            "megatron_lm",
            world,
            flags=("--aleph", "--aleph-clusters", singletons, "--aleph-expert-clusters", "0"),
            **moe,
        )
        res["expert_flags"] = ""
    except ValueError as e:
        res["expert_flags"] = str(e)
    return res
