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

Refused at install, naming the value (never silently skipped):

* a model chunk that is not Megatron-core's ``DistributedDataParallel``;
* ``use_distributed_optimizer=True``: the bucket group then reduce-scatters (and all-gathers parameters on the same
  group attribute); the components here take all-reduces only;
* ``num_distributed_optimizer_instances > 1`` and ``average_in_collective=True`` (an AVG reduce op);
* expert bucket groups (MoE: a second data-parallel group per expert-parallel rank; not built);
* a bucket group another feature already holds: Hermod's DDP hooks (``start_grad_sync`` replaced on the instance)
  or another component's ``flowlane_dp`` group.

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

log = logging.getLogger("flowlane.dp_collective")

BACKEND_NAME = "flowlane_dp"
"""The registered backend's name (``torch.distributed.Backend.FLOWLANE_DP`` once registered)."""


class DPHandle(Protocol):
    def wait(self) -> Any: ...


class DPComponent(Protocol):
    """What takes over a data-parallel group's gradient all-reduce: ``all_reduce(tensors)`` sums every tensor in place
    over the group (SUM; Megatron has already scaled them) and returns a handle whose ``wait()`` completes it."""

    def all_reduce(self, tensors: list[torch.Tensor]) -> DPHandle: ...


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


class _NoEagerConnect:
    supports_splitting = False


_NO_EAGER_CONNECT = _NoEagerConnect()


class _DPGroup(dist.ProcessGroup):
    """The ``flowlane_dp`` process group: all-reduces (SUM) go to the component; every other collective is refused
    by name (Megatron's bucket group issues none on this attribute without the distributed optimizer)."""

    def __init__(self, rank: int, size: int, component: DPComponent, ranks: tuple[int, ...]) -> None:
        super().__init__(rank, size)
        self.component, self.ranks, self.calls = component, ranks, 0

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

    def _take(self, tensors: list[torch.Tensor], op: Any) -> _Work:
        if op != dist.ReduceOp.SUM:
            names = ("AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR", "PREMUL_SUM")
            name = next(
                (n for n in names if hasattr(dist.ReduceOp, n) and op == getattr(dist.ReduceOp, n)), op
            )
            raise RuntimeError(
                f"{BACKEND_NAME}: reduce op {name} is not SUM (the only one routed to a component)"
            )
        bad = [i for i, t in enumerate(tensors) if not t.is_contiguous()]
        if bad:
            raise RuntimeError(f"{BACKEND_NAME}: tensors {bad} are not contiguous (Megatron's buckets are)")
        self.calls += 1
        return _Work(self.component.all_reduce(list(tensors)), list(tensors))

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> _Work:
        return self._take(tensors, opts.reduceOp if opts is not None else dist.ReduceOp.SUM)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> _Work:
        return self._take(tensors, opts.reduceOp if opts is not None else dist.ReduceOp.SUM)


_REGISTERED = False
_CREATING: dict[str, Any] = {}


def _create(store: Any, rank: int, size: int, timeout: Any) -> _DPGroup:
    component, ranks = _CREATING["component"], _CREATING["ranks"]
    if size != len(ranks):
        raise RuntimeError(f"{BACKEND_NAME}: group of {size} ranks created for {ranks}")
    return _DPGroup(rank, size, component, ranks)


def _register() -> None:
    global _REGISTERED
    if not _REGISTERED:
        dist.Backend.register_backend(BACKEND_NAME, _create, devices=["cpu", "cuda"])
        _REGISTERED = True


def check_chunks(model_chunks: Sequence[torch.nn.Module], feature: str) -> list[Any]:
    """The bucket groups of ``model_chunks`` a component may take over; raises naming what cannot apply."""
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
        if cfg.use_distributed_optimizer:
            raise ValueError(
                f"{feature}: use_distributed_optimizer=True is not supported: the bucket groups then "
                "reduce-scatter gradients (and gather parameters on the same group); only the all-reduce "
                "is taken over (drop --use-distributed-optimizer)"
            )
        if cfg.num_distributed_optimizer_instances != 1:
            raise ValueError(
                f"{feature}: num_distributed_optimizer_instances={cfg.num_distributed_optimizer_instances} is "
                "not supported (1 only)"
            )
        if cfg.average_in_collective:
            raise ValueError(
                f"{feature}: average_in_collective=True (an AVG reduce op) is not supported; Megatron's "
                "default (scale, then SUM) is"
            )
        if c.expert_parallel_bucket_groups:
            raise ValueError(
                f"{feature}: model chunk {i} has {len(c.expert_parallel_bucket_groups)} expert bucket "
                "group(s) (MoE): their expert-data-parallel reduction is not taken over; dense models only"
            )
        for bg in c.bucket_groups:
            if "start_grad_sync" in vars(bg):
                raise RuntimeError(
                    f"{feature}: a bucket group's start_grad_sync is already wrapped (Hermod's DDP hooks): "
                    "the two cannot share Megatron's DP reduction; use one of them"
                )
            if isinstance(bg.data_parallel_group, _DPGroup):
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
    bucket groups' collective group. :meth:`remove` restores Megatron's groups."""

    def __init__(
        self,
        dp_group: dist.ProcessGroup,
        make_component: Callable[[dist.ProcessGroup | None, tuple[int, ...]], DPComponent | None],
        feature: str,
    ) -> None:
        self.feature = feature
        mine = tuple(dist.get_process_group_ranks(dp_group))
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        self.all_groups = sorted({tuple(r) for r in everyone})
        _register()
        self.group: _DPGroup | None = None
        self.component: DPComponent | None = None
        for (
            ranks
        ) in self.all_groups:  # every rank creates every group, in one order (new_group is collective)
            component = make_component(dp_group if ranks == mine else None, ranks)
            _CREATING.update(component=component, ranks=ranks)
            try:
                pg = dist.new_group(list(ranks), backend=BACKEND_NAME)
            finally:
                _CREATING.clear()
            if ranks == mine:
                self.group, self.component = pg, component  # type: ignore[assignment]
        self.ranks = mine
        self._undo: list[tuple[Any, Any]] = []
        self.bucket_groups = 0

    def attach(self, model_chunks: Sequence[torch.nn.Module]) -> int:
        """Take over the bucket groups of ``model_chunks``; returns how many. Checks everything first."""
        bucket_groups = check_chunks(model_chunks, self.feature)
        for bg in bucket_groups:
            ranks = tuple(dist.get_process_group_ranks(bg.data_parallel_group))
            if ranks != self.ranks:
                raise ValueError(
                    f"{self.feature}: a bucket group reduces over ranks {list(ranks)}, not the data-parallel "
                    f"group {list(self.ranks)} this was set up for"
                )
        for bg in bucket_groups:
            self._undo.append((bg, bg.data_parallel_group))
            bg.data_parallel_group = self.group
        self.bucket_groups += len(bucket_groups)
        log.info(
            "%s: took over the gradient all-reduce of %d Megatron-core DDP bucket group(s)",
            self.feature,
            len(bucket_groups),
        )
        return len(bucket_groups)

    @property
    def calls(self) -> int:
        """Coalesced all-reduces (one per bucket group and iteration) the component took."""
        return self.group.calls if self.group is not None else 0

    def remove(self) -> None:
        for bg, original in reversed(self._undo):
            bg.data_parallel_group = original
        self._undo.clear()


def data_parallel_group_of(model_chunks: Sequence[torch.nn.Module]) -> dist.ProcessGroup:
    """The group Megatron's DDP chunks reduce dense gradients over (their first bucket group's)."""
    for c in model_chunks:
        for bg in getattr(c, "bucket_groups", []):
            return bg.data_parallel_group
    raise ValueError(
        "no Megatron-core DDP bucket group in the model chunks (not DDP-wrapped, or no parameters)"
    )
