"""Hermod under Megatron-core's own ``DistributedDataParallel`` (seed 000 §5.3.1, §5.4; decisions.md A6.1 #5).

Megatron-core's DDP already decides *when* a gradient bucket is ready: its backward hooks count each parameter's
gradient in the last microbatch (the schedules' ``no_sync`` marks the others) and call the bucket group's
``start_grad_sync`` once all of them are in; ``finalize_model_grads`` later calls ``finish_grad_sync``. Hermod keeps
all of that and changes only *when the collective goes on the wire and on which communicator*:

* ``start_grad_sync`` of each bucket group (dense and expert) becomes a deferred coflow keyed
  (MID M-1, DP, the bucket group's highest layer: :meth:`flowlane.hermod.keys.HermodKeys.dp_reduce`), sealed at that
  program point as a launch window of its own; the pacer (or, under ``launch=program_order``, the sealing thread)
  runs Megatron's own ``start_grad_sync`` (its scaling, its all-reduce or reduce-scatter, its coalescing) when the
  gate allows. The math is Megatron's, so results are bitwise equal. Windows go out in seal order, so the bucket
  groups leave in Megatron's order (backward reaches the highest layers first), not sorted by key: holding them
  until the next point common to every DP rank (a p2p op, or ``finalize_model_grads`` on the first stage) to sort
  them lowest layer first would take the reductions' overlap with the rest of backward away. Hermod's part is the
  gate (held behind outstanding PP/EP ops) and the bulk class; ``dp_mid`` is refused for that reason
  (:data:`megatron_plugin.hermod.NO_EFFECT`).
* the bucket group's collective group becomes its Hermod bulk-class clone (same ranks, same order:
  :mod:`flowlane.sched.groups`), so deferred traffic never interleaves with what the training thread issues on the
  original group (a cross-rank ordering hazard), and on NCCL it carries the bulk traffic class.
* ``finish_grad_sync`` first waits for the deferred coflow (which makes it urgent), then runs Megatron's own.
* ``start_param_sync`` / ``finish_param_sync`` (distributed optimizer, ``overlap_param_gather``): the same pattern for
  the parameter all-gathers that Megatron dispatches one bucket group ahead of the forward.
* Hermod's iteration ends after ``finalize_model_grads`` (:meth:`megatron_plugin.hermod.Hermod.attach_finalize`
  wraps ``config.finalize_model_grads_func``), at the same program point on every rank.

What is refused at install (clear errors, never silently skipped): a model chunk that is not Megatron-core's DDP,
``overlap_grad_reduce=False`` (Megatron then reduces synchronously inside ``finalize_model_grads``, after the
pipeline traffic of the step: there is nothing to order), ``num_distributed_optimizer_instances > 1``, and a bucket
group whose collective group Hermod has no clone of. With the distributed optimizer and ``overlap_param_gather``,
its parameter all-gathers are deferred coflows too (keyed for the consuming iteration, microbatch 0, the group's
lowest layer); without ``overlap_param_gather`` they run synchronously in the optimizer step, as Megatron issues
them (on the bulk clone). A bucket group is one coflow: Hermod does not split it (``SchedulerConfig.chunk_bytes`` does not apply); Megatron's ``bucket_size`` sets the granularity.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from megatron_plugin.hermod import FEATURE
from megatron_plugin.undo import GROUP_OWNER, Patch, check_group_free, undo_all

if TYPE_CHECKING:
    from megatron_plugin.hermod import Hermod

#: Hermod's bulk class (flowlane.hermod.wire.WireEncoder.nccl_class: DP traffic)
BULK_CLASS = 2


def layer_of_parameters(chunk: torch.nn.Module) -> dict[int, int]:
    """Global 0-based layer id (LID) of every parameter of a model chunk, by ``id(param)``: the ``layer_number`` of
    the enclosing Megatron transformer layer (1-based, pipeline and virtual-pipeline offsets included) minus one.
    Parameters outside every layer take the chunk's lowest layer when they come before its first layer in parameter
    order (embeddings: needed first in forward) and its highest otherwise (final norm, output layer)."""
    from megatron.core.transformer.transformer_layer import BaseTransformerLayer

    in_layer: dict[int, int] = {}
    for module in chunk.modules():
        if isinstance(module, BaseTransformerLayer):
            for p in module.parameters():
                in_layer.setdefault(id(p), int(module.layer_number) - 1)
    if not in_layer:
        raise ValueError(
            f"no Megatron transformer layer in model chunk {type(chunk).__name__}: Hermod keys DP "
            "buckets by the layer_number of megatron.core's TransformerLayer"
        )
    lo, hi = min(in_layer.values()), max(in_layer.values())
    order = [id(p) for p in chunk.parameters()]
    first = next(i for i, pid in enumerate(order) if pid in in_layer)
    return {pid: in_layer.get(pid, lo if i < first else hi) for i, pid in enumerate(order)}


class DDPHooks:
    """Hermod's hooks on Megatron-core DDP model chunks (see the module docstring); :meth:`remove` undoes them
    (refused, changing nothing, where a feature installed later wraps one again: :mod:`megatron_plugin.undo`)."""

    def __init__(self, h: Hermod, model_chunks: Sequence[torch.nn.Module]) -> None:
        from megatron.core.distributed import DistributedDataParallel

        chunks = list(model_chunks)
        if not chunks:
            raise ValueError("Hermod.attach_ddp: no model chunks given")
        for i, c in enumerate(chunks):
            if not isinstance(c, DistributedDataParallel):
                raise TypeError(
                    f"Hermod.attach_ddp: model chunk {i} is a {type(c).__name__}, not "
                    "megatron.core.distributed.DistributedDataParallel"
                )
            cfg = c.ddp_config
            if not cfg.overlap_grad_reduce:
                raise ValueError(
                    "Hermod.attach_ddp needs DistributedDataParallelConfig(overlap_grad_reduce=True): "
                    "without it Megatron reduces every bucket synchronously inside "
                    "finalize_model_grads, after the step's pipeline traffic, so there is nothing to "
                    "schedule"
                )
            if cfg.num_distributed_optimizer_instances != 1:
                raise ValueError(
                    f"Hermod.attach_ddp supports num_distributed_optimizer_instances=1, got "
                    f"{cfg.num_distributed_optimizer_instances}"
                )
        self.h = h
        self._pending: dict[int, Any] = {}
        self._gathers: dict[int, Any] = {}
        self.patches: list[Patch] = []
        """Every attribute set on the bucket groups (Hermod's close undoes them too)."""
        plans = []  # everything is checked before anything is patched: never half-installed
        gathers: list[tuple[Any, int]] = []
        check_group_free(
            (bg for c in chunks for bg in c.bucket_groups + c.expert_parallel_bucket_groups), FEATURE
        )
        for c in chunks:
            layers = layer_of_parameters(c)
            dist_opt = bool(c.ddp_config.use_distributed_optimizer)
            attr = "intra_distributed_optimizer_instance_group" if dist_opt else "data_parallel_group"
            for bg in c.bucket_groups + c.expert_parallel_bucket_groups:
                group = getattr(bg, attr)
                clone = h.classes.get(group, BULK_CLASS)
                if clone is group and group.size() > 1:
                    ranks = torch.distributed.get_process_group_ranks(group)
                    raise ValueError(
                        f"Hermod has no bulk-class clone of the data-parallel group {ranks} that "
                        "Megatron's DDP reduces over; build Hermod with dp_group (and expert_dp_group) "
                        "set to the groups the DDP uses"
                    )
                layer = max(layers[id(p)] for p in bg.params)
                plans.append((bg, attr, clone, layer, "reduce_scatter" if dist_opt else "all_reduce"))
                if dist_opt and c.ddp_config.overlap_param_gather:
                    gathers.append((bg, min(layers[id(p)] for p in bg.params)))
        for plan in plans:
            self._hook_bucket_group(*plan)
        for bg, layer in gathers:
            self._hook_param_gather(bg, layer)
        self.param_gather_groups = len(gathers)
        self.bucket_groups = len(plans)

    def _hook_bucket_group(self, bg: Any, attr: str, clone: Any, layer: int, op: str) -> None:
        start, finish = bg.start_grad_sync, bg.finish_grad_sync  # Megatron's own, bound to this bucket group
        pending = self._pending
        sched, keys = self.h.sched, self.h.keys

        def start_grad_sync(force_all_reduce: bool | None = False) -> None:
            if id(bg) in pending or (bg.is_first_batch and bg.grad_reduce_handle is not None):
                return  # already deferred, or Megatron's first-batch re-entry from finish_grad_sync

            def launch() -> Any:
                start(force_all_reduce=force_all_reduce)
                return bg.grad_reduce_handle

            pending[id(bg)] = sched.defer(keys.dp_reduce(layer, op), [launch])
            # a window of its own: this program point is the same on every DP rank, and the bucket may go out now,
            # overlapping the rest of backward (see the module docstring)
            sched.seal()

        def finish_grad_sync(force_all_reduce: bool | None = False) -> None:
            if bg.is_first_batch and id(bg) not in pending:
                start_grad_sync(force_all_reduce)  # Megatron starts the first batch's reductions here
            handle = pending.pop(id(bg), None)
            if handle is not None:
                handle.wait()
            finish(force_all_reduce=force_all_reduce)

        self.patches += [
            Patch(bg, GROUP_OWNER, FEATURE, FEATURE),
            Patch(bg, attr, clone, FEATURE),
            Patch(bg, "start_grad_sync", start_grad_sync, FEATURE),
            Patch(bg, "finish_grad_sync", finish_grad_sync, FEATURE),
        ]

    def _hook_param_gather(self, bg: Any, layer: int) -> None:
        """The distributed optimizer's parameter all-gather of one bucket group (``overlap_param_gather``): Megatron
        dispatches it (the first from a forward pre-hook, each next one when the previous finishes); Hermod defers
        it, keyed for the iteration about to consume it, microbatch 0 and the group's lowest layer (decisions.md
        A6.1 #6), and the forward pre-hook's ``finish_param_sync`` waits for it first."""
        start, finish = bg.start_param_sync, bg.finish_param_sync
        pending = self._gathers
        sched, keys = self.h.sched, self.h.keys

        def start_param_sync(force_sync: bool = False) -> None:
            if force_sync:  # a synchronous gather (e.g. before a checkpoint): what is deferred goes first
                handle = pending.pop(id(bg), None)
                if handle is not None:
                    handle.wait()
                start(force_sync=True)
                return
            if id(bg) in pending:
                return

            def launch() -> Any:
                start()
                return bg.param_gather_handle

            pending[id(bg)] = sched.defer(keys.dp_gather(layer), [launch])
            # Megatron's own flag: finish_param_sync must not dispatch it again
            bg.param_gather_dispatched = True
            sched.seal()

        def finish_param_sync(skip_next_bucket_dispatch: bool = False) -> None:
            if not bg.param_gather_dispatched and id(bg) not in pending:
                start_param_sync()
            handle = pending.pop(id(bg), None)
            if handle is not None:
                handle.wait()
            finish(skip_next_bucket_dispatch=skip_next_bucket_dispatch)

        self.patches += [
            Patch(bg, "start_param_sync", start_param_sync, FEATURE),
            Patch(bg, "finish_param_sync", finish_param_sync, FEATURE),
        ]

    def remove(self) -> None:
        undo_all(self.patches)
