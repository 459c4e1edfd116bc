"""Tiny GPT on Megatron-core: pipeline x data parallel on local ranks, synthetic tokens.

This is the default recipe's job. One readable train loop (torchtitan style): build the model for this rank's
pipeline stage, wire flowlane's communication hooks into Megatron's documented extension points, run Megatron's own
1F1B schedule, and report iteration time, bytes per communication kind, metrics JSON and a Chrome trace.

Feature hooks (Hermod scheduling, SSD offload) plug in through ``install_features`` by their config group.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Literal

import torch

from recipes.validate import MAX_TIMEOUT_S


@dataclass
class GPTRecipe:
    """The default recipe (mirrored by recipes/conf/default.yaml)."""

    world_size: int = 4
    """Ranks in the job (pipeline_parallel x tensor_parallel x data-parallel size)."""
    pipeline_parallel: int = 2
    """Pipeline stages (Megatron's --pipeline-model-parallel-size); the 1F1B schedule runs when > 1."""
    tensor_parallel: int = 1
    """Tensor-parallel size (Megatron's --tensor-model-parallel-size)."""
    num_layers: int = 4
    """Transformer layers, split evenly over the pipeline stages."""
    hidden_size: int = 64
    """Model width (Megatron's --hidden-size)."""
    num_attention_heads: int = 4
    """Attention heads per layer (Megatron's --num-attention-heads)."""
    vocab_size: int = 256
    """Vocabulary of the synthetic tokens."""
    seq_length: int = 32
    """Tokens per sample (Megatron's --seq-length)."""
    micro_batch_size: int = 2
    """Samples per microbatch (Megatron's --micro-batch-size)."""
    num_microbatches: int = 4
    """Microbatches per iteration (global batch = micro_batch_size x num_microbatches x data-parallel size)."""
    iterations: int = 5
    """Training iterations."""
    lr: float = 1e-3
    """Adam learning rate (Megatron-core's get_megatron_optimizer)."""
    seed: int = 1234
    """Seed of the model's initialisation and the synthetic tokens (the same on every data-parallel rank)."""
    dp_bucket_bytes: int = 1 << 20
    """Megatron-core DDP's gradient bucket size in bytes (its bucket_size; one bucket group is one DP coflow)."""
    distributed_optimizer: bool = False
    """Megatron's --use-distributed-optimizer (ZeRO-1: reduce-scattered gradients, sharded Adam, gathered
    parameters); the job always runs on Megatron-core's own DistributedDataParallel, get_megatron_optimizer and
    finalize_model_grads."""
    overlap_param_gather: bool = False
    """Megatron's --overlap-param-gather (parameter gathers dispatched one bucket group ahead of the forward; needs
    distributed_optimizer)."""
    overlap_grad_reduce: bool = True
    """Megatron's --overlap-grad-reduce (each bucket group's reduction starts in the last microbatch's backward as
    soon as its gradients are final; without it they run synchronously in finalize_model_grads). Hermod
    (scheduler=hermod) needs it: it orders those overlapped reductions."""
    num_moe_experts: int | None = None
    """Experts per MoE layer (Megatron's --num-experts); null = a dense model."""
    expert_parallel: int = 1
    """Expert-parallel size (Megatron's --expert-model-parallel-size), folded into data parallel."""
    moe_router_topk: int = 2
    """Experts each token is routed to (Megatron's --moe-router-topk)."""
    timeout_s: float = 300.0
    """A stall timeout, not a cap on the run: on local ranks, seconds a rank may go without progress (an iteration)
    before the job fails as stuck, and start-up (imports, rendezvous) may take max(300, timeout_s); under an external
    launcher, seconds one collective may wait. At most a year."""
    output_dir: str = "results/train"
    """Folder for the run's metrics JSON and Chrome trace."""
    progress: bool = True
    """Show a progress bar of the last pipeline stage's iterations and loss."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where the ranks train: cpu, cuda or auto. cpu: gloo, Megatron-core through megatron_plugin.cpu_shim (CUDA hidden from the
    ranks). cuda: NCCL, one GPU per local rank; only under an external launcher (torchrun, srun), which starts one
    process per rank. auto: cuda under an external launcher on a machine with CUDA, else cpu."""
    bf16: bool = False
    """Train in bf16 as Megatron-LM's --bf16 does: bf16 parameters and pipeline activations (Float16Module), fp32
    main gradients and master weights in Megatron-core's optimizer."""
    features: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Feature groups, name -> config dict (empty or {"name": "none"} = off): Hydra's scheduler, offload and
    dp_collective groups, not a key of default.yaml."""

    def validate(self) -> None:
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise ValueError(msg)

        for name in (
            "world_size",
            "pipeline_parallel",
            "tensor_parallel",
            "num_layers",
            "hidden_size",
            "num_attention_heads",
            "vocab_size",
            "seq_length",
            "micro_batch_size",
            "num_microbatches",
            "iterations",
            "expert_parallel",
        ):
            v = getattr(self, name)
            need(isinstance(v, int) and v >= 1, f"{name} must be an integer >= 1, got {v!r}")
        mp = self.pipeline_parallel * self.tensor_parallel
        need(
            self.world_size % mp == 0,
            f"world_size={self.world_size} must be a multiple of pipeline_parallel x tensor_parallel = {mp}",
        )
        need(
            self.num_layers % self.pipeline_parallel == 0,
            f"num_layers={self.num_layers} must be divisible by pipeline_parallel={self.pipeline_parallel}",
        )
        need(
            self.hidden_size % self.num_attention_heads == 0,
            f"hidden_size={self.hidden_size} must be divisible by num_attention_heads={self.num_attention_heads}",
        )
        # Megatron-core's own checks, which fail only inside every rank after start-up (TransformerConfig,
        # VocabParallelEmbedding: Megatron-LM pads the vocabulary, this recipe gives it as it is)
        need(
            self.num_attention_heads % self.tensor_parallel == 0,
            f"num_attention_heads={self.num_attention_heads} must be divisible by "
            f"tensor_parallel={self.tensor_parallel} (each tensor-parallel rank takes whole heads)",
        )
        need(
            self.vocab_size % self.tensor_parallel == 0,
            f"vocab_size={self.vocab_size} must be divisible by tensor_parallel={self.tensor_parallel} "
            "(Megatron-core's vocab-parallel embedding splits it evenly)",
        )
        need(
            isinstance(self.dp_bucket_bytes, int) and self.dp_bucket_bytes >= 4,
            f"dp_bucket_bytes={self.dp_bucket_bytes!r} must be an integer >= 4 (bytes of fp32 gradients: "
            "Megatron-core's bucket_size counts elements)",
        )
        need(
            0 < self.timeout_s <= MAX_TIMEOUT_S,
            f"timeout_s={self.timeout_s!r} must be > 0 and at most {MAX_TIMEOUT_S:.0f} seconds (a year)",
        )
        need(self.lr > 0, f"lr must be > 0, got {self.lr}")
        need(
            self.device in ("auto", "cpu", "cuda"),
            f"device={self.device!r} must be one of ['auto', 'cpu', 'cuda']",
        )
        need(
            self.distributed_optimizer or not self.overlap_param_gather,
            "overlap_param_gather=True needs distributed_optimizer=True (as Megatron's --overlap-param-gather)",
        )
        need(
            self.overlap_param_gather <= self.overlap_grad_reduce,
            "overlap_param_gather=True needs overlap_grad_reduce=True (as Megatron's --overlap-param-gather)",
        )
        if (self.features.get("scheduler") or {}).get("name", "none") != "none":
            need(
                self.overlap_grad_reduce,
                "scheduler=hermod needs overlap_grad_reduce=true: Hermod orders the "
                "overlapped bucket reductions of Megatron's DDP (without the flag they run synchronously at the "
                "end of the step, after the pipeline traffic, and there is nothing to schedule)",
            )
        if self.num_moe_experts is not None:
            need(
                self.tensor_parallel == 1,
                f"num_moe_experts={self.num_moe_experts} needs tensor_parallel=1, got {self.tensor_parallel}: the "
                "experts' linear layers have biases, which Megatron-core allows only with expert tensor-parallel "
                "size 1 (it follows tensor_parallel)",
            )
            need(
                self.num_moe_experts >= 1 and self.num_moe_experts % self.expert_parallel == 0,
                f"num_moe_experts={self.num_moe_experts} must be >= 1 and divisible by "
                f"expert_parallel={self.expert_parallel}",
            )
            need(
                1 <= self.moe_router_topk <= self.num_moe_experts,
                f"moe_router_topk={self.moe_router_topk} must be in [1, num_moe_experts={self.num_moe_experts}]",
            )
        need(
            self.data_parallel % self.expert_parallel == 0,
            f"expert_parallel={self.expert_parallel} must divide the data-parallel size {self.data_parallel}",
        )
        syn = self.features.get("dp_collective") or {}
        if syn.get("name") == "syndicate":
            from megatron_plugin.syndicate import SyndicateMegatronConfig

            syn = {
                "mode": SyndicateMegatronConfig.mode,
                "profile_iteration": SyndicateMegatronConfig.profile_iteration,
                **syn,
            }
        if syn.get("name") == "syndicate" and syn["mode"] == "fifo":
            # the run writes the profile of this iteration at its end: refused now, not after the training
            at = syn["profile_iteration"]
            need(
                not isinstance(at, int) or at < self.iterations,
                f"dp_collective=syndicate in FIFO mode profiles iteration dp_collective.profile_iteration={at} "
                f"(counted from 0), but iterations={self.iterations}: set iterations > {at}, or "
                "dp_collective.profile_iteration=-1 to write no profile",
            )

    @property
    def data_parallel(self) -> int:
        return self.world_size // (self.pipeline_parallel * self.tensor_parallel)


@dataclass
class TrainContext:
    """What a feature installer may hook into (one per rank)."""

    recipe: GPTRecipe
    model: torch.nn.Module
    config: Any  # megatron TransformerConfig
    p2p_communicator: Any
    grad_sync: Any  # config.finalize_model_grads_func
    rank: int
    optimizer: Any = None
    iteration: int = 0


def install_features(features: dict[str, dict[str, Any]], ctx: TrainContext) -> list[Any]:
    """Install the recipe's feature groups on this rank; each plugin decides from its group whether it is on.
    Returns the handles to close at the end (disabled features return None or a handle with enabled=False)."""
    handles: list[Any] = []
    if features.get("scheduler"):
        from megatron_plugin import hermod

        handles.append(hermod.install_from_config(features["scheduler"], ctx))
    if features.get("offload"):
        from megatron_plugin import ssd_offload

        handles.append(ssd_offload.install_from_config(features["offload"], ctx.model))
    dp = features.get("dp_collective") or {}
    if dp.get("name", "none") == "aleph":
        from megatron_plugin import aleph

        handles.append(aleph.install_from_config(dp, ctx))
    elif dp.get("name", "none") == "syndicate":
        from megatron_plugin import syndicate

        handles.append(syndicate.install_from_config(dp, ctx))
    return [h for h in handles if h is not None and getattr(h, "enabled", True)]


def synthetic_batches(recipe: GPTRecipe, dp_rank: int, iteration: int) -> Iterator[dict[str, torch.Tensor]]:
    """Deterministic synthetic tokens: a learnable pattern (next token = (token * 7 + 3) mod V) plus noise."""
    for mb in range(recipe.num_microbatches):
        g = torch.Generator().manual_seed(recipe.seed * 1_000_003 + iteration * 1009 + mb * 31 + dp_rank)
        start = torch.randint(0, recipe.vocab_size, (recipe.micro_batch_size, 1), generator=g)
        seq = [start]
        for _ in range(recipe.seq_length):
            seq.append((seq[-1] * 7 + 3) % recipe.vocab_size)
        tokens = torch.cat(seq, dim=1)
        yield {"tokens": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous()}


def _loss_func(output_tensor: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    loss = output_tensor.float().mean()
    # clone: Megatron divides the returned loss by num_microbatches in place
    return loss, {"lm loss": loss.detach().clone()}


def _forward_step(
    data_iterator: Iterator[dict[str, torch.Tensor]],
    model: torch.nn.Module,
    recipe: GPTRecipe,
    device: str = "cpu",
) -> tuple[torch.Tensor, Any]:
    batch = next(data_iterator)
    tokens = batch["tokens"].to(device)
    position_ids = torch.arange(recipe.seq_length, device=device).unsqueeze(0).expand_as(tokens)
    # GPTModel returns per-token losses on the last stage when labels are given, hidden states elsewhere
    # explicit causal mask (True = masked): Megatron's default mask is built on CUDA
    mask = torch.triu(
        torch.ones(recipe.seq_length, recipe.seq_length, dtype=torch.bool, device=device), diagonal=1
    )
    out = model(tokens, position_ids, mask.view(1, 1, *mask.shape), labels=batch["labels"].to(device))
    return out, _loss_func


def build_model(recipe: GPTRecipe, device: str = "cpu") -> tuple[torch.nn.Module, Any]:
    """This rank's pipeline stage of the GPT, on ``device``. Weights are initialised on the CPU (Megatron's
    --use-cpu-initialization), so a CUDA run starts from the same weights as a CPU run; with ``recipe.bf16`` the
    model is wrapped in Megatron-core's Float16Module as Megatron-LM's get_model does for --bf16."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_plugin.te_compat import UNFUSED

    dtype = torch.bfloat16 if recipe.bf16 else torch.float32
    config = TransformerConfig(
        num_layers=recipe.num_layers,
        hidden_size=recipe.hidden_size,
        num_attention_heads=recipe.num_attention_heads,
        use_cpu_initialization=True,
        pipeline_model_parallel_size=recipe.pipeline_parallel,
        tensor_model_parallel_size=recipe.tensor_parallel,
        pipeline_dtype=dtype,
        params_dtype=dtype,
        bf16=recipe.bf16,
        fp16=False,
        **UNFUSED,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        batch_p2p_sync=False,
        **(
            {}
            if recipe.num_moe_experts is None
            else dict(
                num_moe_experts=recipe.num_moe_experts,
                moe_router_topk=recipe.moe_router_topk,
                expert_model_parallel_size=recipe.expert_parallel,
                moe_token_dispatcher_type="alltoall",
                moe_grouped_gemm=False,
                moe_aux_loss_coeff=0.0,
            )
        ),
    )
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(
            num_experts=recipe.num_moe_experts, moe_grouped_gemm=False
        ),
        vocab_size=recipe.vocab_size,
        max_sequence_length=recipe.seq_length,
        pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=False,
        position_embedding_type="learned_absolute",
    )
    if device == "cuda":
        model.cuda(torch.cuda.current_device())
    if recipe.bf16:
        model = Float16Module(config, model)
    return model, config


def _megatron_ddp(recipe: GPTRecipe, module: torch.nn.Module, config: Any) -> tuple[Any, Any]:
    """Wrap the model in Megatron-core's DistributedDataParallel and build its optimizer, and set the config hooks
    as Megatron-LM's train() does (no_sync, param_sync, finalize_model_grads)."""
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=recipe.overlap_grad_reduce,
        use_distributed_optimizer=recipe.distributed_optimizer,
        overlap_param_gather=recipe.overlap_param_gather,
        bucket_size=max(1, recipe.dp_bucket_bytes // 4),
    )  # elements of fp32 gradients
    model = DistributedDataParallel(config, ddp_config, module)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            lr=recipe.lr,
            bf16=recipe.bf16,
            use_distributed_optimizer=recipe.distributed_optimizer,
        ),
        [model],
    )
    if recipe.overlap_grad_reduce:
        config.no_sync_func = model.no_sync
    if recipe.overlap_param_gather:
        config.param_sync_func = model.start_param_sync
    config.finalize_model_grads_func = finalize_model_grads
    return model, optimizer


def dp_bytes_per_iteration(model: Any) -> int:
    """Bytes Megatron's DDP reduces per iteration on this rank: every bucket's gradient buffer (padding included),
    dense and expert. Megatron issues these collectives itself, so flowlane.comm does not see them."""
    return sum(
        b.grad_data.numel() * b.grad_data.element_size()
        for buf in [*model.buffers, *model.expert_parallel_buffers]
        for b in buf.buckets
    )


def train_rank(rank: int, world: int, recipe_dict: dict[str, Any]) -> dict[str, Any]:
    """One rank of the default recipe (under flowlane.launch, torchrun or srun; ``device`` resolved to cpu or cuda
    by :func:`resolve_device`, or ``auto``, which means the local launcher's CPU ranks). Collective; the process groups it creates (Megatron's, a feature's)
    are destroyed when it returns, so it can run again in the same process."""
    from flowlane import comm

    with comm.owned_process_groups():
        return _train_rank(rank, world, GPTRecipe(**recipe_dict))


def _train_rank(rank: int, world: int, recipe: GPTRecipe) -> dict[str, Any]:
    device = _rank_device(recipe)
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from flowlane import comm, trace
    from megatron_plugin.comm_hooks import FlowlaneP2PCommunicator

    ps.initialize_model_parallel(
        tensor_model_parallel_size=recipe.tensor_parallel,
        pipeline_model_parallel_size=recipe.pipeline_parallel,
        expert_model_parallel_size=recipe.expert_parallel,
    )
    try:
        torch.manual_seed(recipe.seed)
        model_parallel_cuda_manual_seed(recipe.seed)
        model, config = build_model(recipe, device)
        p2p = FlowlaneP2PCommunicator(ps.get_pipeline_model_parallel_group(), config)
        # Megatron-core's own DDP, optimizer and finalize_model_grads, as Megatron-LM's train() sets them up
        model, optimizer = _megatron_ddp(recipe, model, config)
        grad_sync = config.finalize_model_grads_func
        dp_bytes = dp_bytes_per_iteration(model)
        ctx = TrainContext(recipe, model, config, p2p, grad_sync, rank, optimizer=optimizer)
        handles = install_features(recipe.features, ctx)
        t_start = time.perf_counter()
        losses, iter_times = _iterate(ctx, device, show_progress=rank == world - 1 and recipe.progress)
        if recipe.distributed_optimizer:
            model.start_param_sync(force_sync=True)  # the last step's shards, gathered
        rec = comm.get_recorder()
        bytes_by_kind = rec.bytes_by_kind()
        bytes_by_kind["dp"] = dp_bytes * (recipe.iterations - 1)  # steady state, as the recorder counts
        return {
            "rank": rank,
            "pp_stage": ps.get_pipeline_model_parallel_rank(),
            "dp_rank": ps.get_data_parallel_rank(),
            "losses": losses,
            "iteration_times": iter_times,
            "bytes_by_kind": bytes_by_kind,
            "ops_by_kind": rec.count_by_kind(),
            "param_digest": float(sum(p.detach().double().sum() for p in model.parameters())),
            "num_params": sum(p.numel() for p in model.parameters()),
            "feature_stats": _close_features(handles, recipe),
            "trace": trace.rank_events(rank, t_start),
            "wall": time.perf_counter() - t_start,
        }
    finally:
        ps.destroy_model_parallel()


def _rank_device(recipe: GPTRecipe) -> str:
    """'cpu' or 'cuda' for this rank, with the shims that device needs applied (before Megatron-core is used)."""
    device = recipe.device
    # called directly (tests, benchmarks under flowlane.launch): as flowlane-train's local ranks
    if device == "auto":
        device = resolve_device(recipe, None)
    if device not in ("cpu", "cuda"):
        raise ValueError(
            f"device={device!r}: train_rank needs it resolved to 'cpu' or 'cuda' (resolve_device)"
        )
    if device == "cpu":
        from megatron_plugin import cpu_shim

        cpu_shim.apply()
    from megatron_plugin import te_compat

    te_compat.apply()
    return device


def _iterate(ctx: TrainContext, device: str, show_progress: bool) -> tuple[list[float], list[float]]:
    """The recipe's iterations under Megatron-core's own schedule: zero the grad buffers, forward-backward over the
    micro-batches, optimizer step. Returns the last stage's mean loss and every rank's time per iteration."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.process_groups_config import ProcessGroupCollection

    from flowlane import comm, trace

    recipe, model, optimizer = ctx.recipe, ctx.model, ctx.optimizer
    fwd_bwd = get_forward_backward_func()
    # a custom p2p_communicator must come with the full process-group collection (megatron-core >= 0.15)
    pg_collection = ProcessGroupCollection.use_mpu_process_groups()
    dp_rank = ps.get_data_parallel_rank()
    is_last = ps.is_pipeline_last_stage()
    losses: list[float] = []
    iter_times: list[float] = []
    progress = _progress(show_progress, recipe.iterations)
    for it in range(recipe.iterations):
        ctx.iteration = it
        comm.get_recorder().enabled = it > 0  # iteration 0 warms up; count bytes of steady state
        t0 = time.perf_counter()
        model.zero_grad_buffer()
        optimizer.zero_grad()
        with trace.span("forward_backward", iteration=it):
            out = fwd_bwd(
                forward_step_func=partial(_forward_step, recipe=recipe, device=device),
                data_iterator=synthetic_batches(recipe, dp_rank, it),
                model=[model],
                num_microbatches=recipe.num_microbatches,
                seq_length=recipe.seq_length,
                micro_batch_size=recipe.micro_batch_size,
                forward_only=False,
                p2p_communicator=ctx.p2p_communicator,
                pg_collection=pg_collection,
            )
        with trace.span("optimizer", iteration=it):
            optimizer.step()
        if device == "cuda":
            torch.cuda.synchronize()
        iter_times.append(time.perf_counter() - t0)
        if is_last:
            losses.append(float(torch.stack([o["lm loss"] for o in out]).mean()))
        progress(it, losses[-1] if losses else None)
    return losses, iter_times


def _close_features(handles: list[Any], recipe: GPTRecipe) -> dict[str, Any]:
    """Each installed feature's ``stats`` (a dataclass) by its class name; the features' outputs are written
    (:func:`_write_syndicate_profile`), then the features that can close are closed, the last installed first (each
    close refuses another order: :mod:`megatron_plugin.undo`)."""
    stats: dict[str, Any] = {}
    for h in handles:
        s = getattr(h, "stats", None)
        if dataclasses.is_dataclass(s) and not isinstance(s, type):
            stats[type(h).__name__] = dataclasses.asdict(s)
    _write_syndicate_profile(handles, recipe)
    for h in reversed(handles):
        if hasattr(h, "close"):
            h.close()
    return stats


def _write_syndicate_profile(handles: list[Any], recipe: GPTRecipe) -> None:
    """dp_collective=syndicate in FIFO mode: data-parallel rank 0 (tensor-parallel rank 0) of each pipeline stage
    writes the profile its enforcers recorded (``SyndicateMegatron.write_profile``; MoE's expert enforcer beside it,
    ``*_expert.json``) to ``output_dir/syndicate_profile.json``, with several stages
    ``syndicate_profile_stage{pp_rank}.json`` (as the plan path's ``{pp_rank}``): the plan search's input."""
    dp = recipe.features.get("dp_collective") or {}
    if dp.get("name", "none") != "syndicate":
        return
    from megatron.core import parallel_state as ps

    from megatron_plugin.syndicate import SyndicateMegatron, write_stage_profile

    pp = ps.get_pipeline_model_parallel_world_size()
    name = "syndicate_profile.json" if pp == 1 else "syndicate_profile_stage{pp_rank}.json"
    for h in handles:
        if isinstance(h, SyndicateMegatron) and h.config.mode == "fifo" and h.config.profile_iteration >= 0:
            write_stage_profile(h, str(Path(recipe.output_dir) / name))


def _progress(enabled: bool, total: int) -> Any:
    if not enabled:
        return lambda it, loss: None
    from tqdm import tqdm

    bar = tqdm(total=total, desc="flowlane-train (last stage)", unit="it")

    def update(it: int, loss: float | None) -> None:
        bar.update(1)
        if loss is not None:
            bar.set_postfix(loss=f"{loss:.4f}")
        if it + 1 == total:
            bar.close()

    return update


def resolve_device(recipe: GPTRecipe, ext: Any) -> str:
    """ "cpu" or "cuda" for this run (``ext``: the :class:`flowlane.launch_external.ExternalLaunch` or None). Raises
    ValueError naming the key and the fix when the ranks cannot be placed there; nothing has started yet."""
    from flowlane.launch_external import cuda_device_for

    cuda = torch.cuda.is_available()
    dev = recipe.device
    if dev == "auto":
        dev = "cuda" if ext is not None and cuda else "cpu"
    if dev == "cuda":
        if ext is None:
            raise ValueError(
                "device=cuda runs one process per GPU, started by torchrun or srun (flowlane-train "
                "alone starts CPU ranks): torchrun --nproc_per_node <GPUs> $(which flowlane-train) "
                "world_size=<GPUs> device=cuda"
            )
        if not cuda:
            raise ValueError(
                f"device=cuda but torch {torch.__version__} sees no CUDA device here "
                f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')!r})"
            )
        cuda_device_for(ext)  # one GPU per local rank
    elif ext is not None and cuda:
        raise ValueError(
            f"device=cpu under {ext.launcher} on a machine with CUDA: the CPU ranks need CUDA hidden "
            "(start them with CUDA_VISIBLE_DEVICES= ) or use device=cuda"
        )
    return dev


def launch_mode(recipe: GPTRecipe) -> tuple[Any, str]:
    """(the external launcher or None, the resolved device): every launcher and placement check, before any
    rank starts (flowlane.launch_external.LauncherEnvError / ValueError name the variable or key)."""
    from flowlane.launch_external import check_world, detect_launcher

    ext = detect_launcher()
    if ext is not None:
        check_world(ext, recipe.world_size, "world_size")
    return ext, resolve_device(recipe, ext)


# what train_rank imports: preloaded by the local launcher's fork server (flowlane.launch.preload)
MEGATRON_MODULES = (
    "megatron.core.models.gpt.gpt_layer_specs",
    "megatron.core.distributed",
    "megatron.core.optimizer",
    "megatron.core.pipeline_parallel",
    "megatron_plugin.comm_hooks",
)


def run(recipe: GPTRecipe) -> dict[str, Any]:
    """Run every rank (local CPU ranks through flowlane.launch, or this process's rank under torchrun/srun), gather
    the results to rank 0, which writes metrics JSON + Chrome trace into ``output_dir`` and prints a summary.
    Returns the metrics (under an external launcher, on rank 0; the other ranks return ``{}``)."""
    from flowlane.launch import launch, preload
    from flowlane.launch_external import run_this_rank
    from flowlane.trace import write_chrome_trace

    recipe.validate()
    ext, device = launch_mode(recipe)
    rdict = asdict(dataclasses.replace(recipe, device=device))
    if ext is None:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        # the ranks' fork server imports Megatron-core once (~20 s of CPU) instead of every rank doing it
        preload(*MEGATRON_MODULES)
        # CPU ranks: CUDA hidden, so Megatron-core runs through the CPU shim even on a machine with GPUs
        results = launch(
            train_rank,
            recipe.world_size,
            args=(rdict,),
            timeout=recipe.timeout_s,
            env={"CUDA_VISIBLE_DEVICES": ""},
            timeout_key="timeout_s",
        )
        mode = {"launcher": "flowlane.launch (local)", "world_size": recipe.world_size}
        note = "measured on CPU ranks (gloo over loopback)"
    else:
        backend = "nccl" if device == "cuda" else "gloo"
        gathered = run_this_rank(
            train_rank,
            ext,
            recipe.world_size,
            args=(rdict,),
            backend=backend,
            op_timeout=recipe.timeout_s,
            key="world_size",
        )
        if gathered is None:
            return {}  # rank 0 reports for every rank
        results = gathered
        mode = ext.describe()
        note = f"measured on {ext.world_size} {device} ranks started by {ext.launcher} ({backend})"
    out_dir = Path(recipe.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    trace_path = write_chrome_trace(out_dir / "trace.json", [e for r in results for e in r.pop("trace")])
    steady = [max(r["iteration_times"][i] for r in results) for i in range(1, recipe.iterations)] or [
        max(r["iteration_times"][0] for r in results)
    ]
    total_bytes: dict[str, int] = {}
    for r in results:
        for k, v in r["bytes_by_kind"].items():
            total_bytes[k] = total_bytes.get(k, 0) + v
    # the last rank's: the one the progress bar shows (each data-parallel replica of the last stage has its own)
    losses = results[-1]["losses"]
    metrics = {
        "recipe": rdict,
        "launch": mode,
        "iteration_time_s": sum(steady) / len(steady),
        "iteration_times_s": steady,
        "loss": losses,
        "bytes_by_kind": total_bytes,
        "per_rank": results,
        "trace": str(trace_path),
        "note": f"{note}; iteration 0 excluded; pp/ep bytes counted at flowlane.comm, dp bytes = the gradient "
        "buffers Megatron's DDP reduces each iteration",
    }
    tmp = out_dir / "metrics.json.tmp"
    tmp.write_text(json.dumps(metrics, indent=1))
    tmp.replace(out_dir / "metrics.json")
    _print_summary(metrics, out_dir)
    return metrics


class _PlainTable:
    """rich's Table where rich is not installed (a bare GPU machine): the same rows as plain text."""

    def __init__(self, title: str) -> None:
        self.lines = [title]

    def add_column(self, *a: Any, **k: Any) -> None:
        pass

    def add_row(self, name: str, value: str) -> None:
        self.lines.append(f"  {name}: {value}")


def _print_summary(metrics: dict[str, Any], out_dir: Path) -> None:
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        Console, Table = None, _PlainTable  # type: ignore[assignment,misc]

    t = Table(title="flowlane-train summary")
    t.add_column("metric")
    t.add_column("value", justify="right")
    t.add_row(
        "ranks",
        f"{metrics['launch']['world_size']} ({metrics['launch']['launcher']}, "
        f"{metrics['recipe']['device']}{', bf16' if metrics['recipe']['bf16'] else ''})",
    )
    t.add_row("iteration time (steady, max over ranks)", f"{metrics['iteration_time_s'] * 1e3:.1f} ms")
    t.add_row("loss first -> last (last rank)", f"{metrics['loss'][0]:.4f} -> {metrics['loss'][-1]:.4f}")
    for kind, b in sorted(metrics["bytes_by_kind"].items()):
        t.add_row(f"bytes sent, {kind} (all ranks, steady iterations)", f"{b:,}")
    offload = [
        r["feature_stats"]["SSDOffload"] for r in metrics["per_rank"] if "SSDOffload" in r["feature_stats"]
    ]
    if offload:
        t.add_row(
            "activations offloaded (all ranks, all iterations)",
            f"{sum(o['bytes_written'] for o in offload):,} B written, {sum(o['bytes_read'] for o in offload):,} B read",
        )
    t.add_row("metrics", str(out_dir / "metrics.json"))
    t.add_row("trace (open in ui.perfetto.dev)", metrics["trace"])
    if Console is None:
        print("\n".join(t.lines))  # type: ignore[attr-defined]
    else:
        Console().print(t)
