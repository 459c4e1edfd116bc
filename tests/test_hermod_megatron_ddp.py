"""Hermod under Megatron-core's own machinery (megatron_plugin.ddp_hooks, Hermod.attach_pipeline): a tiny GPT,
PP 2 x DP 2 on 4 gloo ranks, Megatron-core's DistributedDataParallel (overlap_grad_reduce, with and without the
distributed optimizer), get_megatron_optimizer (Adam, clipping), finalize_model_grads and the stock 1F1B schedule
(which builds its own P2PCommunicator). With and without Hermod: bitwise equal losses and parameters; with it, every
bucket group's reduction is a keyed deferred coflow on the bulk-class clone and every p2p step a keyed critical op.
The plain-DDP run changes its microbatch count every iteration (3, 2, 4: a batch-size ramp-up).
The distributed-optimizer run gets Hermod the way a Megatron-LM user does: ``--coflow-scheduler hermod`` (and
``--ssd-offload``) parsed by add_flowlane_args, then megatron_plugin.megatron_lm's model provider and forward step in
pretrain's call sequence (get_model, DDP, optimizer, train()'s config hooks, train_step's forward_backward_func)."""

from __future__ import annotations

import tempfile

import pytest

pytestmark = pytest.mark.llm
pytest.importorskip("megatron.core")

import torch  # noqa: E402 - after the skip: the layouts' norm below is a torch module

M, ITERATIONS = 3, 3
#: microbatches per iteration in the API runs: a changing count (batch-size ramp-up); Megatron's no_sync marks the
#: last microbatch, Hermod reads the next count at the end of each iteration
RAMP = (3, 2, 4)
RECIPE = dict(
    world_size=4,
    pipeline_parallel=2,
    num_layers=2,
    hidden_size=32,
    num_attention_heads=4,
    vocab_size=64,
    seq_length=16,
    micro_batch_size=2,
    num_microbatches=M,
    iterations=ITERATIONS,
)


def _train(dist_opt: bool, mode: str, tmp: str = "", ms: tuple[int, ...] = (M,) * ITERATIONS) -> dict:
    """``mode``: ``stock`` (no flowlane), ``api`` (Hermod's attach_* calls), ``megatron_lm`` (the launch flags)."""
    import argparse
    import os
    from dataclasses import replace
    from functools import partial

    import torch
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.num_microbatches_calculator import (
        destroy_num_microbatches_calculator,
        init_num_microbatches_calculator,
    )
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from flowlane import comm
    from megatron_plugin.args import add_flowlane_args
    from megatron_plugin.hermod import Hermod, HermodConfig
    from megatron_plugin.megatron_lm import FlowlaneHooks
    from recipes.gpt import GPTRecipe, _forward_step, build_model, synthetic_batches

    recipe = GPTRecipe(**RECIPE)
    forward_step = partial(_forward_step, recipe=recipe)
    hooks = None
    with comm.owned_process_groups():
        ps.initialize_model_parallel(pipeline_model_parallel_size=2)
        init_num_microbatches_calculator(
            torch.distributed.get_rank(), None, M * recipe.micro_batch_size * 2, recipe.micro_batch_size, 2
        )
        try:
            torch.manual_seed(0)
            model_parallel_cuda_manual_seed(0)
            if mode == "megatron_lm":  # what pretrain_gpt.py + add_flowlane_args give a Megatron-LM run
                os.makedirs(tmp, exist_ok=True)  # offload.dirs must exist (OffloadConfig creates none)
                args = add_flowlane_args(argparse.ArgumentParser()).parse_args(
                    [
                        "--coflow-scheduler",
                        "hermod",
                        "--hermod-gate-timeout-s",
                        "0.02",
                        "--ssd-offload",
                        "--ssd-offload-dirs",
                        tmp,
                        "--ssd-offload-cpu-tensors",
                        "--ssd-offload-min-bytes",
                        "4096",
                        "--ssd-offload-keep-last-k",
                        "0",
                    ]
                )
                args.num_layers, args.pipeline_model_parallel_size = recipe.num_layers, 2
                args.overlap_grad_reduce, args.use_distributed_optimizer = True, dist_opt
                hooks = FlowlaneHooks(
                    lambda **kw: build_model(recipe)[0], forward_step, get_args=lambda: args
                )
                module = hooks.model_provider(
                    pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage()
                )
                config = module.config
                forward_step = hooks.forward_step
            else:
                module, config = build_model(recipe)
            ddp_config = DistributedDataParallelConfig(
                grad_reduce_in_fp32=True,
                overlap_grad_reduce=True,
                use_distributed_optimizer=dist_opt,
                overlap_param_gather=dist_opt,
                bucket_size=3000,
            )
            model = DistributedDataParallel(config, ddp_config, module)
            opt = get_megatron_optimizer(
                OptimizerConfig(optimizer="adam", lr=1e-2, clip_grad=1.0, use_distributed_optimizer=dist_opt),
                [model],
            )
            config.no_sync_func = model.no_sync
            config.finalize_model_grads_func = finalize_model_grads
            if dist_opt:
                config.param_sync_func = model.start_param_sync
            out: dict = {"refused": None}
            h = None
            if mode == "api":
                h = Hermod(
                    HermodConfig(gate_timeout_s=0.02),
                    num_microbatches=ms[0],
                    layers_per_stage=1,
                    stage=ps.get_pipeline_model_parallel_rank(),
                    num_stages=2,
                    dp_group=ps.get_data_parallel_group(with_context_parallel=True),
                )
                try:
                    h.attach_ddp([module])
                except TypeError as e:
                    out["refused"] = str(e)
                h.attach_pipeline()
                ddp_hooks = h.attach_ddp([model])
                h.attach_finalize(config, iter(ms[1:] + ms[-1:]).__next__)
                groups = [
                    bg.intra_distributed_optimizer_instance_group if dist_opt else bg.data_parallel_group
                    for bg in model.bucket_groups
                ]
                out["on_clones"] = all(
                    g is not ps.get_data_parallel_group(with_context_parallel=True)
                    and torch.distributed.get_process_group_ranks(g)
                    == torch.distributed.get_process_group_ranks(
                        ps.get_data_parallel_group(with_context_parallel=True)
                    )
                    for g in groups
                )
                out["bucket_groups"] = ddp_hooks.bucket_groups
            fwd_bwd = get_forward_backward_func()
            losses = []
            for it in range(ITERATIONS):
                model.zero_grad_buffer()
                opt.zero_grad()
                res = fwd_bwd(
                    forward_step_func=forward_step,
                    data_iterator=synthetic_batches(
                        replace(recipe, num_microbatches=ms[it]), ps.get_data_parallel_rank(), it
                    ),
                    model=[model],
                    num_microbatches=ms[it],
                    seq_length=recipe.seq_length,
                    micro_batch_size=recipe.micro_batch_size,
                    forward_only=False,
                )
                opt.step()
                if res:
                    losses.append(float(torch.stack([o["lm loss"] for o in res]).mean()))
            if hooks is not None:
                h = hooks.hermod
                hooks.offload.wait_io()  # a store still queued counts when it runs
                out["offloaded"] = hooks.offload.stats.bytes_written + hooks.offload.stats.bytes_cancelled
                groups = [
                    bg.intra_distributed_optimizer_instance_group if dist_opt else bg.data_parallel_group
                    for bg in model.bucket_groups
                ]
                out["on_clones"] = all(
                    g is not ps.get_data_parallel_group(with_context_parallel=True) for g in groups
                )
                out["bucket_groups"] = len(model.bucket_groups)
            if dist_opt:
                model.start_param_sync(force_sync=True)  # the last step's shards, gathered
            out["params"] = [p.detach().clone() for p in model.parameters()]
            out["losses"] = losses
            if h is not None:
                out["log"] = [
                    (e.event, e.meta.ctype, e.meta.op, e.meta.iteration, e.meta.microbatch, e.meta.layer)
                    for e in h.sched.log
                ]
                if hooks is not None:
                    hooks.close()
                else:
                    h.close()
                groups = [
                    bg.intra_distributed_optimizer_instance_group if dist_opt else bg.data_parallel_group
                    for bg in model.bucket_groups
                ]
                out["restored"] = all(
                    g is ps.get_data_parallel_group(with_context_parallel=True) for g in groups
                )
            return out
        finally:
            destroy_num_microbatches_calculator()
            ps.destroy_model_parallel()


def _both(rank: int, world: int, tmp: str) -> dict:
    import os

    import torch

    from megatron_plugin import cpu_shim

    cpu_shim.apply()
    from megatron.core import parallel_state as ps  # noqa: F401 - imported once, before the runs

    res = {}
    for dist_opt, mode in ((False, "api"), (True, "megatron_lm")):
        ms = RAMP if mode == "api" else (M,) * ITERATIONS
        base, herm = (
            _train(dist_opt, "stock", ms=ms),
            _train(dist_opt, mode, os.path.join(tmp, f"rank{rank}"), ms),
        )
        res[dist_opt] = {
            "offloaded": herm.get("offloaded"),
            "losses_equal": base["losses"] == herm["losses"],
            "losses": herm["losses"],
            "params_equal": len(base["params"]) == len(herm["params"])
            and all(torch.equal(a, b) for a, b in zip(base["params"], herm["params"], strict=True)),
            "log": herm["log"],
            "on_clones": herm["on_clones"],
            "restored": herm["restored"],
            "bucket_groups": herm["bucket_groups"],
            "refused": herm["refused"],
        }
    return res


@pytest.mark.slow  # 4 ranks x 4 Megatron trainings: ~3 min on a 2-core machine
def test_hermod_on_megatron_core_ddp_and_schedules_is_bitwise_stock_and_keys_every_op() -> None:
    from flowlane.launch import launch

    with tempfile.TemporaryDirectory() as tmp:
        res = launch(_both, 4, args=(tmp,), timeout=900)
    for rank, r in enumerate(res):
        stage = rank // 2  # initialize_model_parallel(pp=2) on 4 ranks: pipeline groups (0, 2), (1, 3)
        for dist_opt, x in r.items():
            assert x["losses_equal"] and x["params_equal"], (rank, dist_opt)
            # Megatron buckets the first stage only (later stages' DP traffic is off the critical path)
            assert x["on_clones"] and x["restored"] and (x["bucket_groups"] >= 2 if stage == 0 else True)
            if dist_opt:  # the launch flags: Hermod and the offload both took effect
                assert x["offloaded"] > 0
            else:
                assert "not megatron.core.distributed.DistributedDataParallel" in x["refused"]
            log = x["log"]
            dp = [e for e in log if e[0] == "chunk" and e[2] != "all_gather"]
            # one deferred coflow per bucket group and iteration, keyed (MID M-1, DP, the group's highest layer)
            assert len(dp) == x["bucket_groups"] * ITERATIONS, (rank, dist_opt, dp)
            ms = (M,) * ITERATIONS if dist_opt else RAMP
            # MID M-1 of its iteration
            assert {e[1] for e in dp} == {"dp"} and all(e[4] == ms[e[3]] - 1 for e in dp)
            assert {e[2] for e in dp} == {"reduce_scatter" if dist_opt else "all_reduce"}
            assert {e[3] for e in dp} == set(range(ITERATIONS))
            assert {e[5] for e in dp} <= {stage}  # one layer per stage
            # the distributed optimizer's overlapped parameter gathers: keyed for the iteration that consumes them
            # (the first iteration's come from Megatron's initial state, before any step: iterations 1..)
            gathers = [e for e in log if e[0] == "chunk" and e[2] == "all_gather"]
            if dist_opt:
                assert gathers and {e[1] for e in gathers} == {"dp"} and {e[4] for e in gathers} == {0}
                assert {e[3] for e in gathers} <= set(range(ITERATIONS + 1)) and {e[5] for e in gathers} <= {
                    stage
                }
            else:
                assert gathers == []
            pp = [e for e in log if e[0] == "critical"]
            # every microbatch's p2p is a critical op, keyed with its microbatch id
            for it in range(ITERATIONS):
                mbs = sorted(e[4] for e in pp if e[3] == it)
                assert mbs and set(mbs) == set(range(ms[it])), (rank, it, mbs)
        if stage == 1:
            assert r[False]["losses"] and r[True]["losses"]


LAYOUTS = {
    # MoE, expert-data-parallel 2: PP 1 x DP 4, EP 2, the alltoall token dispatcher (Hermod's matched all-to-all)
    "moe_ep2_edp2": dict(pp=1, tp=1, ep=2, experts=4, sp=False, tied=False),
    # TP 2 x PP 2, input embedding tied to the output layer across the stages (finalize_model_grads all-reduces the
    # pair); Hermod launching in program order from the training thread, as on NCCL
    "tp2_pp2_tied": dict(pp=2, tp=2, ep=1, experts=None, sp=False, tied=True, launch="program_order"),
    # TP 2 x PP 2 with sequence parallelism: Megatron's SP linears (all-gather / reduce-scatter over TP), SP-sized
    # pipeline p2p (seq / TP), finalize_model_grads all-reducing the norms' grads over TP. The norms are SPLayerNorm
    # (below) through the layer spec: megatron-core's torch norm refuses SP, TE and Apex are not on CPU runs.
    # Otherwise tp2_pp2_tied's model and data (same initial weights): its losses must match to rounding.
    "tp2_pp2_sp": dict(pp=2, tp=2, ep=1, experts=None, sp=True, tied=True),
    # the interleaved schedule: PP 2 x DP 2, two model chunks per stage (one layer each), overlapped p2p
    # (overlap_p2p_comm: Megatron waits for the requests later, one by one), 4 microbatches
    "interleaved_vpp2": dict(pp=2, tp=1, ep=1, experts=None, sp=False, tied=False, vpp=2, m=4),
    # bf16 with fp32 main grads and master weights: PP 2 x DP 2, the model in Megatron's Float16Module (bf16
    # parameters, bf16 pipeline p2p), grad_reduce_in_fp32, the distributed optimizer (fp32 main-parameter shards)
    # with overlap_param_gather (bf16 parameter all-gathers on gloo)
    "bf16_pp2_distopt": dict(
        pp=2, tp=1, ep=1, experts=None, sp=False, tied=False, precision="bf16", dist_opt=True
    ),
    # fp16 with Megatron's dynamic loss scaling: PP 2 x DP 2, Float16Module (fp16 parameters, fp16 p2p),
    # Float16OptimizerWithFloat16Params (fp32 master weights) and its DynamicGradScaler, hysteresis 1; fp16 grad
    # buffers (grad_reduce_in_fp32 off, Megatron-LM's default: fp16 all-reduces on gloo)
    "fp16_pp2_scaler": dict(pp=2, tp=1, ep=1, experts=None, sp=False, tied=False, precision="fp16"),
}
#: the fp16 layout's initial loss scale. Its gradients overflow fp16 at it in iteration 0 (Megatron skips the step and
#: halves the scale), fit at half of it in iteration 1 (the step is taken) and overflow again in iteration 2, after
#: that step (skipped). On CPU the overflow thresholds are ~1.3, ~1.5 and ~0.85 x 2**18: each margin >= 10%.
FP16_INITIAL_SCALE = 2.0**19


class SPLayerNorm(torch.nn.Module):
    """A LayerNorm for sequence parallelism, as Megatron's FusedLayerNorm / TENorm are one without Apex or TE (the
    norm layer spec's interface): each TP rank normalizes its own sequence shard with replicated weight and bias,
    marked ``sequence_parallel`` so finalize_model_grads all-reduces their grads over TP. Megatron-core's own
    WrappedTorchNorm asserts ``not config.sequence_parallel`` (transformer/torch_norm.py)."""

    def __init__(
        self,
        config,
        hidden_size: int,
        eps: float = 1e-5,
        persist_layer_norm: bool = False,
        zero_centered_gamma: bool = False,
        normalization: str = "LayerNorm",
    ) -> None:
        super().__init__()
        assert config.normalization == "LayerNorm" and not config.layernorm_zero_centered_gamma
        self.hidden_size, self.eps = hidden_size, eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        self.bias = torch.nn.Parameter(torch.zeros(hidden_size, dtype=config.params_dtype))
        for p in (self.weight, self.bias):  # what FusedLayerNorm sets
            p.sequence_parallel = config.sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.layer_norm(x, (self.hidden_size,), self.weight, self.bias, self.eps)


def _sp_block_spec(config, layer_spec, vp_stage: int | None = None):
    """Megatron's local GPT layer spec with SPLayerNorm for the layers' two norms and the block's final norm (a
    layer spec alone gets the block's default final norm, WrappedTorchNorm here)."""
    from dataclasses import replace

    from megatron.core.transformer.transformer_block import (
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )

    layer = replace(
        layer_spec,
        submodules=replace(layer_spec.submodules, input_layernorm=SPLayerNorm, pre_mlp_layernorm=SPLayerNorm),
    )
    return TransformerBlockSubmodules(
        layer_specs=[layer] * get_num_layers_to_build(config, vp_stage=vp_stage), layer_norm=SPLayerNorm
    )


def _train_layout(name: str, hermod: bool) -> dict:
    from functools import partial

    import torch
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.transformer_config import TransformerConfig

    from flowlane import comm
    from megatron_plugin.hermod import Hermod, HermodConfig
    from megatron_plugin.te_compat import UNFUSED
    from recipes.gpt import GPTRecipe, _forward_step, synthetic_batches

    lay = LAYOUTS[name]
    vpp, m = lay.get("vpp"), lay.get("m", M)
    precision, dist_opt = lay.get("precision"), lay.get("dist_opt", False)
    dtype = {None: torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    half = dict(bf16=precision == "bf16", fp16=precision == "fp16")
    recipe = GPTRecipe(
        **{
            **RECIPE,
            "pipeline_parallel": lay["pp"],
            "num_layers": 4 if vpp else RECIPE["num_layers"],
            "num_microbatches": m,
        }
    )
    with comm.owned_process_groups():
        ps.initialize_model_parallel(
            tensor_model_parallel_size=lay["tp"],
            pipeline_model_parallel_size=lay["pp"],
            expert_model_parallel_size=lay["ep"],
            virtual_pipeline_model_parallel_size=vpp,
        )
        try:
            torch.manual_seed(0)
            model_parallel_cuda_manual_seed(0)
            moe = (
                {}
                if lay["experts"] is None
                else dict(
                    num_moe_experts=lay["experts"],
                    moe_router_topk=2,
                    expert_model_parallel_size=lay["ep"],
                    moe_token_dispatcher_type="alltoall",
                    moe_grouped_gemm=False,
                    moe_aux_loss_coeff=0.0,
                )
            )
            interleaved = (
                {}
                if vpp is None
                else dict(
                    virtual_pipeline_model_parallel_size=vpp, overlap_p2p_comm=True, batch_p2p_comm=False
                )
            )
            config = TransformerConfig(
                num_layers=recipe.num_layers,
                hidden_size=recipe.hidden_size,
                num_attention_heads=recipe.num_attention_heads,
                use_cpu_initialization=True,
                pipeline_model_parallel_size=lay["pp"],
                tensor_model_parallel_size=lay["tp"],
                sequence_parallel=lay["sp"],
                pipeline_dtype=dtype,
                params_dtype=dtype,
                **half,
                **UNFUSED,
                hidden_dropout=0.0,
                attention_dropout=0.0,
                **moe,
                **interleaved,
            )
            chunks = []
            for vp in range(vpp or 1):  # as Megatron-LM's get_model builds the model chunks
                stage = dict(ignore_virtual=False, vp_stage=vp) if vpp else {}
                spec = get_gpt_layer_local_spec(num_experts=lay["experts"], moe_grouped_gemm=False)
                if lay["sp"]:  # the norms swapped through the layer spec, Megatron's extension point
                    spec = _sp_block_spec(config, spec, vp if vpp else None)
                module = GPTModel(
                    config=config,
                    transformer_layer_spec=spec,
                    vocab_size=recipe.vocab_size,
                    max_sequence_length=recipe.seq_length,
                    pre_process=ps.is_pipeline_first_stage(**stage),
                    post_process=ps.is_pipeline_last_stage(**stage),
                    share_embeddings_and_output_weights=lay["tied"],
                    position_embedding_type="learned_absolute",
                    **({"vp_stage": vp} if vpp else {}),
                )
                if precision:  # what Megatron-LM's get_model does for --bf16 / --fp16
                    module = Float16Module(config, module)
                chunks.append(
                    DistributedDataParallel(
                        config,
                        DistributedDataParallelConfig(
                            grad_reduce_in_fp32=precision != "fp16",
                            overlap_grad_reduce=True,
                            use_distributed_optimizer=dist_opt,
                            overlap_param_gather=dist_opt,
                            bucket_size=3000,
                        ),
                        module,
                        disable_bucketing=vp > 0,
                    )
                )
            # Megatron-LM's optimizer arguments for --fp16 (loss_scale None: the dynamic scaler), hysteresis 1
            scaler = (
                dict(loss_scale=None, initial_loss_scale=FP16_INITIAL_SCALE, min_loss_scale=1.0, hysteresis=1)
                if precision == "fp16"
                else {}
            )
            opt = get_megatron_optimizer(
                OptimizerConfig(
                    optimizer="adam",
                    lr=1e-2,
                    clip_grad=1.0,
                    params_dtype=dtype,
                    use_distributed_optimizer=dist_opt,
                    **half,
                    **scaler,
                ),
                chunks,
            )
            if precision:  # as Megatron-LM's train() sets it: the schedule scales each microbatch's loss
                config.grad_scale_func = opt.scale_loss
            if vpp:  # what Megatron-LM's train() sets for several chunks
                config.no_sync_func = [c.no_sync for c in chunks]
                config.grad_sync_func = [c.start_grad_sync for c in chunks]
            else:
                config.no_sync_func = chunks[0].no_sync
            config.finalize_model_grads_func = finalize_model_grads
            h = None
            if hermod:
                launch = lay.get("launch", "auto")
                h = Hermod(
                    HermodConfig(
                        gate_timeout_s=0.02 if launch != "program_order" else 0.05,
                        schedule="interleaved" if vpp else "1f1b",
                        launch=launch,
                    ),
                    num_microbatches=m,
                    layers_per_stage=recipe.num_layers // lay["pp"],
                    stage=ps.get_pipeline_model_parallel_rank(),
                    num_stages=lay["pp"],
                    dp_group=ps.get_data_parallel_group(with_context_parallel=True),
                    expert_dp_group=ps.get_expert_data_parallel_group() if lay["experts"] else None,
                    virtual_chunks=vpp or 1,
                )
                h.attach_pipeline()
                h.attach_ddp(chunks)
                h.attach_finalize(config)
                if lay["experts"]:
                    h.patch_moe_dispatcher(config)
            norms = [mod for c in chunks for mod in c.modules() if isinstance(mod, SPLayerNorm)]
            rows: set[int] = set()  # the sequence length each norm sees: seq / TP under sequence parallelism
            for mod in norms:
                mod.register_forward_pre_hook(lambda _m, args: rows.add(args[0].shape[0]))
            fwd_bwd = get_forward_backward_func()
            initial = [p.detach().clone() for c in chunks for p in c.parameters()]
            losses, steps, scales = [], [], []
            for it in range(ITERATIONS):
                for c in chunks:
                    c.zero_grad_buffer()
                opt.zero_grad()
                data = [synthetic_batches(recipe, ps.get_data_parallel_rank(), it) for _ in chunks]
                res = fwd_bwd(
                    forward_step_func=partial(_forward_step, recipe=recipe),
                    data_iterator=data if vpp else data[0],
                    model=chunks,
                    num_microbatches=m,
                    seq_length=recipe.seq_length,
                    micro_batch_size=recipe.micro_batch_size,
                    forward_only=False,
                )
                scales.append(float(opt.get_loss_scale()))  # the scale this iteration's backward ran with
                steps.append(opt.step()[0])  # False: Megatron found inf / nan gradients and skipped the step
                if res:
                    losses.append(float(torch.stack([o["lm loss"] for o in res]).mean()))
            if dist_opt:
                for c in chunks:
                    c.start_param_sync(force_sync=True)  # the last step's shards, gathered
            inner = getattr(opt, "chained_optimizers", [opt])
            params = [p.detach().clone() for c in chunks for p in c.parameters()]
            out = {
                "params": params,
                "losses": losses,
                "precision": {
                    "float16_module": all(isinstance(c.module, Float16Module) for c in chunks),
                    "param_dtypes": {p.dtype for c in chunks for p in c.parameters()},
                    "main_grad_dtypes": {p.main_grad.dtype for c in chunks for p in c.parameters()},
                    "main_param_dtypes": {
                        p.dtype for o in inner for g in o.optimizer.param_groups for p in g["params"]
                    },
                    "optimizers": {type(o).__name__ for o in inner},
                    "scalers": {type(getattr(o, "grad_scaler", None)).__name__ for o in inner},
                    "scales": scales,
                    "steps": steps,
                    "moved": sum(not torch.equal(a, b) for a, b in zip(initial, params, strict=True)),
                },
                "expert_groups": sum(len(c.expert_parallel_bucket_groups) for c in chunks),
                "sp": {
                    "config": config.sequence_parallel,
                    "norms": len(norms),
                    "marked": all(p.sequence_parallel for mod in norms for p in mod.parameters()),
                    "rows": rows,
                    "norm_params": [p.detach().clone() for mod in norms for p in mod.parameters()],
                },
            }
            if h is not None:
                out["log"] = [
                    (e.event, e.meta.ctype, e.meta.op, e.meta.iteration, e.meta.microbatch, e.meta.layer)
                    for e in h.sched.log
                ]
                h.close()
            return out
        finally:
            ps.destroy_model_parallel()


def _layouts(rank: int, world: int, tmp: str) -> dict:
    import os

    import torch

    from megatron_plugin import cpu_shim

    cpu_shim.apply()
    res, stock = {}, {}
    for name in LAYOUTS:
        base, herm = _train_layout(name, False), _train_layout(name, True)
        stock[name] = base["params"]
        res[name] = {
            "losses_equal": base["losses"] == herm["losses"],
            "losses": herm["losses"],
            "params_equal": len(base["params"]) == len(herm["params"])
            and all(torch.equal(a, b) for a, b in zip(base["params"], herm["params"], strict=True)),
            "log": herm["log"],
            "expert_groups": herm["expert_groups"],
            "sp": herm["sp"],
            "precision": herm["precision"],
            # Megatron's loss scales and its skipped steps (found inf) the same with and without Hermod
            "scaling_equal": (base["precision"]["scales"], base["precision"]["steps"])
            == (herm["precision"]["scales"], herm["precision"]["steps"]),
            "num_params": len(herm["params"]),
        }
    # sequence parallelism changes where Megatron reduces, not the model: stock SP against stock TP, to rounding
    sp, tp = stock["tp2_pp2_sp"], stock["tp2_pp2_tied"]
    res["tp2_pp2_sp"]["sp"]["vs_tp"] = (
        max(float((a - b).abs().max()) for a, b in zip(sp, tp, strict=True)) if len(sp) == len(tp) else None
    )
    base = _checkpoint_resume(False, os.path.join(tmp, "stock"))
    herm = _checkpoint_resume(True, os.path.join(tmp, "hermod"))
    res["checkpoint"] = {
        "restored": base["restored"] and herm["restored"],
        "log": herm["log"],
        "params_equal": all(torch.equal(a, b) for a, b in zip(base["params"], herm["params"], strict=True)),
    }
    return res


@pytest.mark.slow  # 4 ranks x 16 Megatron trainings: ~1 min on an idle 2-core machine, ~4 on a busy one
def test_hermod_on_megatron_core_moe_tp_layouts_and_checkpoint_resume_is_bitwise_stock() -> None:
    """Plus a dist_checkpointing save / fresh build / load / resume of the distributed optimizer, with Hermod on
    both jobs or on neither: the restored model equals the saved one and the resumed step is bitwise stock's."""
    from flowlane.launch import launch

    with tempfile.TemporaryDirectory() as tmp:
        res = launch(_layouts, 4, args=(tmp,), timeout=900)
    for rank, r in enumerate(res):
        ck = r.pop("checkpoint")
        assert ck["restored"] and ck["params_equal"], rank
        assert "chunk" in ck["log"] and "critical" in ck["log"]  # Hermod scheduled the resumed job
        for name, x in r.items():
            assert x["losses_equal"] and x["params_equal"], (rank, name)
            dp = [e for e in x["log"] if e[0] == "chunk"]
            assert {e[3] for e in dp} == set(range(ITERATIONS)), (
                rank,
                name,
                dp,
            )  # reductions every iteration
        il = [e for e in r["interleaved_vpp2"]["log"] if e[0] == "critical" and e[1] == "pp"]
        stage = rank // 2
        # every microbatch's overlapped p2p is a keyed critical op; the layers name both chunks' boundaries
        assert {e[4] for e in il} == set(range(4)), (rank, il)
        assert {e[5] for e in il if e[2] == "send_next"} == ({0, 2} if stage == 0 else {1}), (rank, il)
        moe = r["moe_ep2_edp2"]
        assert moe["expert_groups"] >= 1  # expert parameters reduce over the expert-data-parallel group
        assert any(e[1] == "ep" for e in moe["log"])  # the token dispatcher's all-to-alls are keyed
        # sequence parallelism took effect: Megatron's config, every norm (the layer's two, the last stage's final
        # one) an SPLayerNorm marked sequence_parallel, seeing seq / TP rows
        sp = r["tp2_pp2_sp"]
        x = sp["sp"]
        assert x["config"] and x["marked"] and x["norms"] == (2 if stage == 0 else 3), (rank, x)
        assert x["rows"] == {RECIPE["seq_length"] // 2}, (rank, x["rows"])
        # finalize_model_grads all-reduced the norms' grads over TP (groups (0, 1), (2, 3)): each rank normalizes
        # its own shard, so without it the TP ranks' norms drift apart (by ~5e-2 after 3 steps)
        peer = res[rank ^ 1]["tp2_pp2_sp"]["sp"]["norm_params"]
        assert all(torch.equal(a, b) for a, b in zip(x["norm_params"], peer, strict=True)), rank
        # the same model as tp2_pp2_tied, to rounding (~1e-5; an unreduced norm grad: ~5e-2)
        assert x["vs_tp"] is not None and x["vs_tp"] < 1e-3, (rank, x["vs_tp"])
        assert sp["losses"] == pytest.approx(r["tp2_pp2_tied"]["losses"], rel=1e-5, abs=0), rank
        # the (seq / TP)-sized p2p, keyed
        assert {e[4] for e in sp["log"] if e[0] == "critical"} == set(range(M)), rank
        # mixed precision: Megatron's Float16Module holds bf16 / fp16 parameters, the optimizer fp32 master weights;
        # the grad buffers Megatron reduces are fp32 with grad_reduce_in_fp32 (bf16), fp16 without it
        for name, half, grads in (
            ("bf16_pp2_distopt", torch.bfloat16, torch.float32),
            ("fp16_pp2_scaler", torch.float16, torch.float16),
        ):
            x = r[name]
            p = x["precision"]
            assert p["float16_module"] and p["param_dtypes"] == {half}, (rank, name, p)
            assert p["main_param_dtypes"] == {torch.float32}, (rank, name, p)
            assert p["main_grad_dtypes"] == {grads}, (rank, name, p)
            # the same loss scales and skipped steps with and without Hermod; every parameter trained
            assert x["scaling_equal"] and p["moved"] == x["num_params"], (rank, name, p)
            assert stage == 0 or len(set(x["losses"])) == ITERATIONS, (rank, name, x["losses"])
        bf, fp = r["bf16_pp2_distopt"]["precision"], r["fp16_pp2_scaler"]["precision"]
        assert bf["optimizers"] == {"DistributedOptimizer"} and bf["scalers"] == {"NoneType"}, (rank, bf)
        assert bf["steps"] == [True] * ITERATIONS, (rank, bf)
        # the fp32 grads' reduce-scatters and the bf16 parameters' overlapped all-gathers, keyed by Hermod
        ops = {e[2] for e in r["bf16_pp2_distopt"]["log"] if e[0] == "chunk"}
        assert ops == {"reduce_scatter", "all_gather"}, (rank, ops)
        assert fp["optimizers"] == {"Float16OptimizerWithFloat16Params"}, (rank, fp)
        assert fp["scalers"] == {"DynamicGradScaler"}, (rank, fp)
        # Megatron's dynamic loss scaling: overflow (step skipped, scale halved), a step, overflow again (skipped)
        s = FP16_INITIAL_SCALE
        assert fp["steps"] == [False, True, False] and fp["scales"] == [s, s / 2, s / 2], (rank, fp)
    assert all(any(r[name]["losses"] for r in res) for name in ("tp2_pp2_tied", "tp2_pp2_sp", "moe_ep2_edp2"))


def _checkpoint_resume(hermod: bool, ckpt_dir: str) -> dict:
    """Train 2 iterations (distributed optimizer), save with Megatron's dist_checkpointing, build a fresh model and
    optimizer, load, train 1 more: with Hermod attached to both the saving and the resumed job, or to neither."""
    import os
    from functools import partial

    import torch
    from megatron.core import dist_checkpointing
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
    from megatron_plugin.hermod import Hermod, HermodConfig
    from recipes.gpt import GPTRecipe, _forward_step, build_model, synthetic_batches

    recipe = GPTRecipe(**RECIPE)
    meta = {"distrib_optim_sharding_type": "dp_reshardable"}
    hermods = []

    def build() -> tuple:
        torch.manual_seed(0)
        model_parallel_cuda_manual_seed(0)
        module, config = build_model(recipe)
        model = DistributedDataParallel(
            config,
            DistributedDataParallelConfig(
                grad_reduce_in_fp32=True,
                overlap_grad_reduce=True,
                use_distributed_optimizer=True,
                bucket_size=3000,
            ),
            module,
        )
        opt = get_megatron_optimizer(
            OptimizerConfig(optimizer="adam", lr=1e-2, use_distributed_optimizer=True), [model]
        )
        config.no_sync_func, config.finalize_model_grads_func = model.no_sync, finalize_model_grads
        if hermod:
            h = Hermod(
                HermodConfig(gate_timeout_s=0.02),
                num_microbatches=M,
                layers_per_stage=1,
                stage=ps.get_pipeline_model_parallel_rank(),
                num_stages=2,
                dp_group=ps.get_data_parallel_group(with_context_parallel=True),
            )
            h.attach_pipeline()
            h.attach_ddp([model])
            h.attach_finalize(config)
            hermods.append(h)
        return model, opt

    def step(model, opt, it: int) -> None:
        model.zero_grad_buffer()
        opt.zero_grad()
        get_forward_backward_func()(
            forward_step_func=partial(_forward_step, recipe=recipe),
            model=[model],
            data_iterator=synthetic_batches(recipe, ps.get_data_parallel_rank(), it),
            num_microbatches=M,
            seq_length=recipe.seq_length,
            micro_batch_size=recipe.micro_batch_size,
            forward_only=False,
        )
        opt.step()

    with comm.owned_process_groups():
        ps.initialize_model_parallel(pipeline_model_parallel_size=2)
        try:
            model, opt = build()
            for it in range(2):
                step(model, opt, it)
            sd = model.module.sharded_state_dict()
            if torch.distributed.get_rank() == 0:
                os.makedirs(ckpt_dir, exist_ok=True)
            torch.distributed.barrier()
            dist_checkpointing.save(
                {"model": sd, "optimizer": opt.sharded_state_dict(sd, metadata=meta)}, ckpt_dir
            )
            saved = [p.detach().clone() for p in model.parameters()]
            for h in hermods:
                h.close()
            hermods.clear()
            model2, opt2 = build()
            # megatron-core without Apex/TE reads Adam's step from the optimizer state, which a fresh one lacks
            opt2.chained_optimizers[0]._init_optimizer_states_with_dummy_values()
            sd2 = model2.module.sharded_state_dict()
            loaded = dist_checkpointing.load(
                {"model": sd2, "optimizer": opt2.sharded_state_dict(sd2, is_loading=True, metadata=meta)},
                ckpt_dir,
            )
            model2.module.load_state_dict(loaded["model"])
            with torch.no_grad():
                opt2.load_state_dict(loaded["optimizer"])
            restored = all(torch.equal(a, b) for a, b in zip(saved, model2.parameters(), strict=True))
            step(model2, opt2, 2)
            out = {
                "restored": restored,
                "params": [p.detach().clone() for p in model2.parameters()],
                "log": [e.event for h in hermods for e in h.sched.log],
            }
            for h in hermods:
                h.close()
            return out
        finally:
            ps.destroy_model_parallel()
