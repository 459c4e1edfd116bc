"""One intercept for Megatron-core's data-parallel gradient collective, shared by ALEPH and SYNDICATE.

Megatron-core's DDP decides *when* a bucket group's gradients are ready (its backward hooks, ``no_sync``, the
first-batch path through ``finish_grad_sync``), scales them (``gradient_scaling_factor``), and then, inside
``_ParamAndGradBucketGroup.start_grad_sync``, issues one ``torch.distributed.all_reduce`` per bucket on the bucket
group's ``data_parallel_group`` under ``torch.distributed._coalescing_manager``; ``finish_grad_sync`` waits for the
coalesced handle. A component that wants to carry that collective (ALEPH's hierarchy, SYNDICATE's motifs) must
replace only the collective and keep the rest.

Why a process-group backend, not a wrapper of ``start_grad_sync`` (the two designs open): wrapping
``start_grad_sync`` as :mod:`megatron_plugin.ddp_hooks` does works when the wrapper still calls Megatron's own method
(Hermod only defers it). A component that changes the collective would have to re-implement the method's body
(NaN checks, scaling, the AVG/SUM choice, the first-batch guard, the handle it leaves for ``finish_grad_sync``): a
copy of Megatron's code. Instead this module registers a torch.distributed backend
(``torch.distributed.Backend.register_backend``, the documented extension point for third-party process groups),
creates one group of it per data-parallel group (``new_group(backend="flowlane_dp")``, same ranks), and sets it as
each bucket group's ``data_parallel_group``. Megatron's ``start_grad_sync`` then runs unchanged; its
``_coalescing_manager`` collects the per-bucket ``all_reduce`` calls and hands them to the group's
``allreduce_coalesced`` (checked on gloo), which gives them to the component; the component returns a handle that
Megatron keeps as ``grad_reduce_handle`` and waits for in ``finish_grad_sync``. The creator returns a Python
``torch.distributed.ProcessGroup`` subclass (the path torch keeps for Python process groups; checked on torch 2.15),
which keeps its group name itself (torch reads it from C++ backends, which it has none of). Swapping the attribute
of a private class is still private API: megatron-core is pinned
(:func:`megatron_plugin.hermod.check_megatron_core_version`, 0.14-0.16) and refused outside the range.

With the distributed optimizer (``use_distributed_optimizer=True``) the bucket group keeps its collective group as
``intra_distributed_optimizer_instance_group`` instead, and issues on it the gradients' reduce-scatter (each bucket
into this rank's shard, a view of the bucket) and the parameters' all-gather (``start_param_sync``: one coalesced
call per bucket group, from the forward pre-hooks with ``overlap_param_gather``, else after the optimizer step). The
reduce-scatter goes to the component's ``reduce_scatter``. The all-gather goes to the component's ``all_gather`` when
it was set up with ``param_gather=True`` (SYNDICATE: the gathers are plan ops too), and otherwise passes through,
unchanged, to Megatron's own group (ALEPH: it moves no gradient, and ALEPH shapes gradient traffic only).

Refused at install, naming the value (never silently skipped):

* a model chunk that is not Megatron-core's ``DistributedDataParallel``;
* ``num_distributed_optimizer_instances > 1`` (a second, inter-instance all-reduce on another group),
  ``average_in_collective=True`` (an AVG reduce op) and, with the distributed optimizer,
  ``reduce_scatter_with_fp32_accumulation=True`` (Megatron then reduce-scatters with its own ``all_to_all_single``
  on the bucket group's group and sums in fp32 itself: no reduce-scatter reaches the component);
* a bucket group another feature already holds: Hermod's DDP hooks (``start_grad_sync`` replaced on the instance)
  or another component's ``flowlane_dp`` group.

MoE: Megatron keeps the experts' gradients in separate bucket groups (``expert_parallel_bucket_groups``) that reduce
over the expert-data-parallel group; ``DPCollective(..., expert=True)`` takes those over, with their own component per
expert-data-parallel group (a component decides whether it can carry them, and refuses them otherwise). Megatron-core
marks expert parameters ``allreduce=False`` (which is what puts them there) only at expert-model-parallel size > 1:
at EP 1 the experts sit in the dense bucket groups and there is no expert lane (:func:`expert_parallel`); a pipeline
stage or virtual chunk of dense layers only (``moe_layer_freq``) has none either, at any EP.

``overlap_grad_reduce=False`` is accepted: Megatron then starts and waits for each bucket group inside
``finish_grad_sync``, one after the other (a component that orders collectives across bucket groups says what that
means for it).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist

from megatron_plugin.undo import GROUP_OWNER, Patch, check_all, check_group_free, undo_all

log = logging.getLogger("flowlane.dp_collective")

BACKEND_NAME = "flowlane_dp"
"""The registered backend's name (``torch.distributed.Backend.FLOWLANE_DP`` once registered)."""


class DPHandle(Protocol):
    def wait(self) -> Any: ...


class DPComponent(Protocol):
    """What takes over a data-parallel group's gradient reduction (SUM; Megatron has already scaled the gradients):
    ``all_reduce(tensors)`` sums every tensor in place over the group; ``reduce_scatter(outputs, inputs)`` (the
    distributed optimizer) sums every ``inputs[i]`` over the group into ``outputs[i]``, this rank's block of it (group
    size equal blocks; Megatron's output is a view of its input's block). Both return a handle whose ``wait()``
    completes them."""

    def all_reduce(self, tensors: list[torch.Tensor]) -> DPHandle: ...

    def reduce_scatter(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor]) -> DPHandle: ...


class DPGatherComponent(DPComponent, Protocol):
    """A component that also carries the distributed optimizer's parameter all-gathers (``param_gather=True``):
    ``all_gather(outputs, inputs)`` gathers every ``inputs[i]`` (this rank's block, a view of ``outputs[i]`` in
    Megatron) from every rank into ``outputs[i]``, rank order."""

    def all_gather(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor]) -> DPHandle: ...


class _Work(dist._Work):
    """The handle Megatron keeps (``grad_reduce_handle``): ``wait()`` waits for the component's handle."""

    def __init__(self, handle: DPHandle, tensors: list[torch.Tensor]) -> None:
        super().__init__()
        self._handle, self._tensors, self._done = handle, tensors, False

    def wait(self, timeout: Any = None) -> bool:
        if not self._done:
            self._handle.wait()
            self._done = True
        return True

    def is_completed(self) -> bool:
        return self._done

    def get_future(self) -> torch.futures.Future:
        self.wait()
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result(self._tensors)
        return fut


class _Works:
    """Works of the all-gathers passed through to Megatron's own group, waited for together."""

    def __init__(self, works: list[Any]) -> None:
        self.works = works

    def wait(self) -> bool:
        for w in self.works:
            w.wait()
        return True


class _NoEagerConnect:
    supports_splitting = False


_NO_EAGER_CONNECT = _NoEagerConnect()


class _DPGroup(dist.ProcessGroup):
    """The ``flowlane_dp`` process group: all-reduces and reduce-scatters (SUM) go to the component, all-gathers to
    the component with ``param_gather``, else to ``passthrough`` (Megatron's own group); every other collective is
    refused by torch (the Python base class implements none)."""

    def __init__(
        self, rank: int, size: int, component: DPComponent, ranks: tuple[int, ...], param_gather: bool = False
    ) -> None:
        super().__init__(rank, size)
        self.component, self.ranks, self.calls = component, ranks, 0
        self.param_gather = param_gather
        """Whether the parameters' all-gathers go to the component (else to ``passthrough``)."""
        self.passthrough: dist.ProcessGroup | None = None
        """Megatron's own data-parallel group (set by :class:`DPCollective`): the parameters' all-gathers run there
        unless ``param_gather``."""
        self.gathers = 0

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        return BACKEND_NAME

    # torch names a group through its C++ backends, which a Python process group has none of: keep the name here
    # (new_group sets it; destroy_process_group reads it)
    def _set_group_name(self, name: str) -> None:
        self._flowlane_group_name = name

    @property
    def group_name(self) -> str:
        return self._flowlane_group_name

    def name(self) -> str:
        return BACKEND_NAME

    # when the world was initialised with a device_id (Megatron-LM binds each rank's GPU), new_group asks the new
    # group's backend for that device whether it splits and connects eagerly; torch keeps no per-device backend for
    # a Python process group, so say here that there is nothing to split or connect
    def _get_backend(self, device: Any) -> Any:
        return _NO_EAGER_CONNECT

    def _check(self, tensors: list[torch.Tensor], op: Any) -> None:
        if op != dist.ReduceOp.SUM:
            names = ("AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR", "PREMUL_SUM")
            name = next(
                (n for n in names if hasattr(dist.ReduceOp, n) and op == getattr(dist.ReduceOp, n)), op
            )
            raise RuntimeError(
                f"{BACKEND_NAME}: reduce op {name} is not SUM (the only one routed to a component)"
            )
        self._check_contiguous(tensors)

    @staticmethod
    def _check_contiguous(tensors: list[torch.Tensor]) -> None:
        bad = [i for i, t in enumerate(tensors) if not t.is_contiguous()]
        if bad:
            raise RuntimeError(f"{BACKEND_NAME}: tensors {bad} are not contiguous (Megatron's buckets are)")

    def _all_reduce(self, tensors: list[torch.Tensor], opts: Any) -> _Work:
        self._check(tensors, opts.reduceOp if opts is not None else dist.ReduceOp.SUM)
        self.calls += 1
        return _Work(self.component.all_reduce(list(tensors)), list(tensors))

    def _check_blocks(
        self, op: str, whole: list[torch.Tensor], whole_name: str, blocks: list[torch.Tensor], block_name: str
    ) -> None:
        """Every ``whole[i]`` holds one ``blocks[i]`` per rank (a reduce-scatter's input, an all-gather's output)."""
        for i, (w, b) in enumerate(zip(whole, blocks, strict=True)):
            if w.numel() != b.numel() * self.size():
                raise RuntimeError(
                    f"{BACKEND_NAME}: {op} {i} has {w.numel()} {whole_name} elements, not "
                    f"{self.size()} x {b.numel()} (the {block_name}'s)"
                )

    def _reduce_scatter(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any) -> _Work:
        self._check(outputs + inputs, opts.reduceOp if opts is not None else dist.ReduceOp.SUM)
        self._check_blocks("reduce-scatter", inputs, "input", outputs, "output")
        self.calls += 1
        return _Work(self.component.reduce_scatter(list(outputs), list(inputs)), list(outputs))

    def _all_gather(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor]) -> _Work:
        if self.param_gather:
            self._check_contiguous(outputs + inputs)
            self._check_blocks("all-gather", outputs, "output", inputs, "input")
            self.gathers += 1
            return _Work(self.component.all_gather(list(outputs), list(inputs)), list(outputs))  # type: ignore[attr-defined]
        if self.passthrough is None:
            raise RuntimeError(f"{BACKEND_NAME}: an all-gather before the group was attached to Megatron's")
        self.gathers += 1
        works = [
            dist.all_gather_into_tensor(o, x, group=self.passthrough, async_op=True)
            for o, x in zip(outputs, inputs, strict=True)
        ]
        return _Work(_Works(works), list(outputs))

    # torch calls these (and, outside a coalescing manager, their single-tensor forms); the names changed between
    # torch versions, so both generations are here
    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> _Work:
        return self._all_reduce(tensors, opts)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> _Work:
        return self._all_reduce(tensors, opts)

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> _Work:
        return self._reduce_scatter([output], [input], opts)

    def reduce_scatter_single_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> _Work:
        return self._reduce_scatter(outputs, inputs, opts)

    _reduce_scatter_base = reduce_scatter_single
    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> _Work:
        return self._all_gather([output], [input])

    def all_gather_single_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> _Work:
        return self._all_gather(outputs, inputs)

    _allgather_base = all_gather_single
    allgather_into_tensor_coalesced = all_gather_single_coalesced


_REGISTERED = False
_CREATING: dict[str, Any] = {}


def _create(store: Any, rank: int, size: int, timeout: Any) -> _DPGroup:
    component, ranks = _CREATING["component"], _CREATING["ranks"]
    if size != len(ranks):
        raise RuntimeError(f"{BACKEND_NAME}: group of {size} ranks created for {ranks}")
    return _DPGroup(rank, size, component, ranks, _CREATING["param_gather"])


def _register() -> None:
    global _REGISTERED
    if not _REGISTERED:
        dist.Backend.register_backend(BACKEND_NAME, _create, devices=["cpu", "cuda"])
        _REGISTERED = True


def _group_attr(bucket_group: Any) -> str:
    # Megatron-core keeps the bucket group's collective group under one of two names (param_and_grad_buffer.py)
    return (
        "intra_distributed_optimizer_instance_group"
        if bucket_group.ddp_config.use_distributed_optimizer
        else "data_parallel_group"
    )


def collective_group(bucket_group: Any) -> dist.ProcessGroup:
    """The group a Megatron-core bucket group reduces gradients over (and, with the distributed optimizer, gathers
    parameters over)."""
    return getattr(bucket_group, _group_attr(bucket_group))


def check_chunks(model_chunks: Sequence[torch.nn.Module], feature: str, expert: bool = False) -> list[Any]:
    """The dense (or, with ``expert``, the expert) bucket groups of ``model_chunks`` a component may take over;
    raises naming what cannot apply."""
    from megatron.core.distributed import DistributedDataParallel

    from megatron_plugin.hermod import check_megatron_core_version

    check_megatron_core_version(feature)
    chunks = list(model_chunks)
    if not chunks:
        raise ValueError(f"{feature}: no model chunks given")
    groups = []
    for i, c in enumerate(chunks):
        if not isinstance(c, DistributedDataParallel):
            raise TypeError(
                f"{feature}: model chunk {i} is a {type(c).__name__}, not "
                "megatron.core.distributed.DistributedDataParallel"
            )
        cfg = c.ddp_config
        if cfg.num_distributed_optimizer_instances != 1:
            raise ValueError(
                f"{feature}: num_distributed_optimizer_instances={cfg.num_distributed_optimizer_instances} is "
                "not supported (1 only: more add an inter-instance all-reduce on another group)"
            )
        if cfg.average_in_collective:
            raise ValueError(
                f"{feature}: average_in_collective=True (an AVG reduce op) is not supported; Megatron's "
                "default (scale, then SUM) is"
            )
        if cfg.use_distributed_optimizer and getattr(cfg, "reduce_scatter_with_fp32_accumulation", False):
            raise ValueError(
                f"{feature}: reduce_scatter_with_fp32_accumulation=True is not supported with the distributed "
                "optimizer: Megatron then reduce-scatters with its own all_to_all_single on the bucket group's "
                f"group, which the {BACKEND_NAME} group does not carry; Megatron's default (False) is"
            )
        for bg in c.expert_parallel_bucket_groups if expert else c.bucket_groups:
            if "start_grad_sync" in vars(bg):
                raise RuntimeError(
                    f"{feature}: a bucket group's start_grad_sync is already wrapped (Hermod's DDP hooks): "
                    "the two cannot share Megatron's DP reduction; use one of them"
                )
            if isinstance(collective_group(bg), _DPGroup):
                raise RuntimeError(
                    f"{feature}: a bucket group's collective is already taken over by another flowlane "
                    "feature (its group is a flowlane_dp group); close that one first"
                )
            groups.append(bg)
    return groups


class DPCollective:
    """A component's hold on Megatron-core DDP bucket groups (see the module docstring), in two steps.

    Construction is collective (every rank of the world, at one program point: process groups are created in one
    order everywhere): for ``dp_group`` (this rank's data-parallel group, the one Megatron's DDP reduces over),
    ``make_component(group, ranks)`` is called for every data-parallel group of the world, in one order on every
    rank, so it may create process groups too: ``group`` is Megatron's group when this rank is in it (return the
    component; it may use that group for its traffic) and None otherwise (return None). :meth:`attach` is local
    (any point before a chunk's first backward): it checks the chunks and sets the ``flowlane_dp`` group as their
    bucket groups' collective group. :meth:`remove` restores Megatron's groups (refused, changing nothing, where a
    feature attached later holds one: :mod:`megatron_plugin.undo`). ``expert``: the chunks' expert bucket groups
    (MoE), ``dp_group`` then being this rank's expert-data-parallel group. ``param_gather``: the distributed
    optimizer's parameter all-gathers go to the component's ``all_gather`` (:class:`DPGatherComponent`) instead of
    Megatron's own group."""

    def __init__(
        self,
        dp_group: dist.ProcessGroup,
        make_component: Callable[[dist.ProcessGroup | None, tuple[int, ...]], DPComponent | None],
        feature: str,
        expert: bool = False,
        param_gather: bool = False,
    ) -> None:
        self.feature, self.expert, self.param_gather = feature, expert, param_gather
        mine = tuple(dist.get_process_group_ranks(dp_group))
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        self.all_groups = sorted({tuple(r) for r in everyone})
        _register()
        self.group: _DPGroup | None = None
        self.component: DPComponent | None = None
        # every rank creates every group, in one order (new_group is collective)
        for ranks in self.all_groups:
            component = make_component(dp_group if ranks == mine else None, ranks)
            if (
                param_gather
                and component is not None
                and not callable(getattr(component, "all_gather", None))
            ):
                raise TypeError(
                    f"{feature}: param_gather=True needs a component with all_gather(outputs, inputs)"
                )
            _CREATING.update(component=component, ranks=ranks, param_gather=param_gather)
            try:
                pg = dist.new_group(list(ranks), backend=BACKEND_NAME)
            finally:
                _CREATING.clear()
            if ranks == mine:
                self.group, self.component = pg, component  # type: ignore[assignment]
        self.ranks = mine
        self._undo: list[Patch] = []
        self.bucket_groups = 0

    def attach(self, model_chunks: Sequence[torch.nn.Module]) -> int:
        """Take over the bucket groups of ``model_chunks``; returns how many. Checks everything first."""
        bucket_groups = check_chunks(model_chunks, self.feature, self.expert)
        check_group_free(bucket_groups, self.feature)
        for bg in bucket_groups:
            ranks = tuple(dist.get_process_group_ranks(collective_group(bg)))
            if ranks != self.ranks:
                raise ValueError(
                    f"{self.feature}: a{'n expert' if self.expert else ''} bucket group reduces over ranks "
                    f"{list(ranks)}, not the {'expert-' if self.expert else ''}data-parallel group "
                    f"{list(self.ranks)} this was set up for"
                )
        for bg in bucket_groups:
            if self.group is not None:
                self.group.passthrough = collective_group(bg)
            self._undo.append(Patch(bg, GROUP_OWNER, self.feature, self.feature))
            self._undo.append(Patch(bg, _group_attr(bg), self.group, self.feature))
        self.bucket_groups += len(bucket_groups)
        log.info(
            "%s: took over the gradient %s of %d Megatron-core DDP %sbucket group(s)",
            self.feature,
            "reduce-scatter"
            if any(bg.ddp_config.use_distributed_optimizer for bg in bucket_groups)
            else "all-reduce",
            len(bucket_groups),
            "expert " if self.expert else "",
        )
        return len(bucket_groups)

    @property
    def calls(self) -> int:
        """Coalesced all-reduces or reduce-scatters (one per bucket group and iteration) the component took."""
        return self.group.calls if self.group is not None else 0

    @property
    def gathers(self) -> int:
        """Coalesced parameter all-gathers (distributed optimizer): carried by the component with ``param_gather``,
        else passed through to Megatron's group."""
        return self.group.gathers if self.group is not None else 0

    def check_removable(self) -> None:
        """Raise, changing nothing, if a bucket group's collective group is no longer this one's."""
        check_all(self._undo)

    def remove(self) -> None:
        """Put Megatron's groups back (checked first; a second call does nothing)."""
        undo_all(self._undo)


def data_parallel_group_of(
    model_chunks: Sequence[torch.nn.Module], expert: bool = False
) -> dist.ProcessGroup:
    """The group Megatron's DDP chunks reduce dense (``expert``: expert) gradients over: their first such bucket
    group's (with the distributed optimizer, its instance group, which is the data-parallel group with one
    instance)."""
    for c in model_chunks:
        for bg in getattr(c, "expert_parallel_bucket_groups" if expert else "bucket_groups", []):
            return collective_group(bg)
    if expert:
        raise ValueError("no Megatron-core DDP expert bucket group in the model chunks (not a MoE model)")
    raise ValueError(
        "no Megatron-core DDP bucket group in the model chunks (not DDP-wrapped, or no parameters)"
    )


def has_expert_groups(model_chunks: Sequence[torch.nn.Module]) -> bool:
    """Whether any chunk has expert bucket groups (a MoE model under Megatron-core DDP)."""
    return any(getattr(c, "expert_parallel_bucket_groups", None) for c in model_chunks)


def expert_parallel(args: Any) -> bool:
    """Whether a Megatron-LM run's experts get bucket groups of their own, reduced over the expert-data-parallel
    group: a MoE model (``--num-experts``) at ``--expert-model-parallel-size`` > 1. Megatron-core marks expert
    parameters ``allreduce=False`` only then; at EP 1 they sit in the dense bucket groups (reduced over the
    data-parallel group), so there is no expert lane to set up and no expert plan to give."""
    return (
        bool(getattr(args, "num_experts", None)) and (getattr(args, "expert_model_parallel_size", 1) or 1) > 1
    )


def check_expert_setup(
    model_chunks: Sequence[torch.nn.Module], expert_collective: bool, feature: str
) -> None:
    """Refuse chunks with expert bucket groups (MoE) when ``feature`` was set up without a collective for the
    expert-data-parallel group. The converse is accepted: with one, a chunk may still have none (a pipeline stage or
    virtual chunk of dense layers only, ``moe_layer_freq``), and the expert lane then carries nothing of it."""
    if has_expert_groups(model_chunks) and not expert_collective:
        raise ValueError(
            f"{feature}: the chunks have expert bucket groups (MoE at expert-model-parallel size > 1) but "
            f"{feature} was set up without the expert-data-parallel group"
        )


FINALIZE_UNSET = (
    "config.finalize_model_grads_func is not set; its end is the iteration boundary (set it to "
    "megatron.core.distributed.finalize_model_grads first, as Megatron-LM's train() does)"
)


def after_finalize(model_config: Any, step: Callable[[], None], feature: str) -> Patch:
    """Call ``step()`` at the end of Megatron's ``model_config.finalize_model_grads_func`` (wrapped, kept whole): the
    same program point on every rank, after the iteration's gradient reductions. Returns the undo (a
    :class:`~megatron_plugin.undo.Patch`: it removes only this wrapper)."""
    finalize = getattr(model_config, "finalize_model_grads_func", None)
    if finalize is None:
        raise ValueError(f"{feature}: {FINALIZE_UNSET}")

    def finalize_then_step(*args: Any, **kwargs: Any) -> Any:
        out = finalize(*args, **kwargs)
        step()
        return out

    return Patch(model_config, "finalize_model_grads_func", finalize_then_step, feature)


def groups_of(
    model_chunks: Sequence[torch.nn.Module], feature: str
) -> tuple[dist.ProcessGroup, dist.ProcessGroup | None]:
    """Check the chunks (dense, and expert with MoE) and return (data-parallel group, expert-data-parallel group or
    None): what an adapter's ``install`` hands its constructor."""
    chunks = list(model_chunks)
    check_chunks(chunks, feature)
    moe = has_expert_groups(chunks)
    if moe:
        check_chunks(chunks, feature, expert=True)
    return data_parallel_group_of(chunks), data_parallel_group_of(chunks, expert=True) if moe else None
