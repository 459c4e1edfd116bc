"""A tap on ``deepspeed.comm``: every collective DeepSpeed issues passes through here (seed 000 §5.4).

DeepSpeed routes all of its communication (ZeRO reductions and gathers, the pipeline's p2p) through the backend
object ``deepspeed.comm.comm.cdb``. :class:`CommTap` wraps that object's collective methods on the instance (the
class is not patched; :meth:`CommTap.close` restores it) and does two things:

* **records** each op: name, element count, the group's ranks, which thread issued it (``"pacer"`` for Hermod's
  deferred ops, ``"main"`` otherwise) and the Hermod key it was issued under, so tests can check the order on the
  wire against Hermod's keys and against DeepSpeed's own run (a tap with ``classes=None`` only records);
* **redirects** the ops of a deferred coflow to the Hermod class clone of their group (:mod:`flowlane.sched.groups`):
  inside :meth:`CommTap.on_class`, which the pacer enters around each deferred launch, a ``group`` argument (None
  meaning the world) is replaced by its clone, so paced traffic never interleaves with what the training thread
  issues on the original group, and on NCCL it carries the clone's traffic class. A group with no clone is an
  error (never a silent fallback onto the shared communicator);
* **moves point-to-point ops** to a class clone: inside :meth:`CommTap.p2p_on_class`, which Hermod enters around
  each PipelineEngine p2p instruction, the ``send``/``recv`` DeepSpeed's ``runtime.pipe.p2p`` issues without a group
  (the world) go to the given clone of the pipeline group (the critical class: on NCCL its traffic class and a
  high-priority stream), as Megatron's pipeline p2p does (megatron_plugin.hermod).

:func:`unwrapped_backend` and :func:`route_dp_all_reduce` serve the features that replace ZeRO-0's data-parallel
all-reduce itself (ALEPH's hierarchy, SYNDICATE's enforcer): one wrap of ``cdb.all_reduce`` and one refusal when
another flowlane feature already holds it.
"""

from __future__ import annotations

import inspect
import threading
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from flowlane.patching import Patch, check_all, undo_all
from flowlane.policy import CoflowMeta
from flowlane.sched import ClassGroups

#: ``deepspeed.comm`` backend methods that move data (the ones that take a ``group``)
COLLECTIVES = (
    "all_reduce",
    "reduce",
    "reduce_scatter_tensor",
    "reduce_scatter",
    "all_gather_into_tensor",
    "all_gather",
    "all_gather_coalesced",
    "all_reduce_coalesced",
    "broadcast",
    "all_to_all_single",
    "send",
    "recv",
    "isend",
    "irecv",
)
#: the point-to-point ops of ``deepspeed.runtime.pipe.p2p`` (issued with ``group=None``: the world)
P2P_OPS = frozenset({"send", "recv", "isend", "irecv"})


@dataclass(frozen=True)
class CommRecord:
    """One op as DeepSpeed issued it through ``deepspeed.comm``."""

    op: str
    numel: int
    ranks: tuple[int, ...]
    """The ranks of the group DeepSpeed named (before any redirect)."""
    thread: str
    """``pacer`` (a Hermod deferred coflow, on a class clone) or ``main``."""
    meta: CoflowMeta | None
    """The Hermod key it was issued under (None outside any keyed op)."""
    hermod_class: int | None = None
    """The Hermod class whose clone carried it (None: the group DeepSpeed named)."""


def _ranks(group: Any) -> tuple[int, ...]:
    if group is None or group is dist.GroupMember.WORLD:
        return tuple(range(dist.get_world_size()))
    return tuple(dist.get_process_group_ranks(group))


def _numel(args: dict[str, Any]) -> int:
    for v in args.values():
        if isinstance(v, torch.Tensor):
            return v.numel()
        if isinstance(v, list | tuple) and v and isinstance(v[0], torch.Tensor):
            return sum(t.numel() for t in v)
    return 0


def _real_signature(cls: type, name: str) -> inspect.Signature:
    """The signature of ``cls.name`` under DeepSpeed's decorators (``stage_on_cpu`` wraps without functools.wraps:
    the decorated function is found in the wrapper's closure)."""
    fn = getattr(cls, name)
    for _ in range(8):
        sig = inspect.signature(fn)
        if not any(p.kind is p.VAR_POSITIONAL for p in sig.parameters.values()):
            return sig
        inner = next(
            (
                c.cell_contents
                for c in (getattr(fn, "__closure__", None) or ())
                if inspect.isfunction(c.cell_contents) and c.cell_contents.__name__ == name
            ),
            None,
        )
        if inner is None:
            break
        fn = inner
    raise RuntimeError(
        f"flowlane.hermod: cannot read the signature of deepspeed.comm's {cls.__name__}.{name}; "
        "this DeepSpeed version is not supported"
    )


class CommTap:
    """Wraps ``deepspeed.comm``'s backend (see the module docstring). One per process at a time."""

    def __init__(self, classes: ClassGroups | None = None, max_records: int = 100_000) -> None:
        import deepspeed.comm.comm as dscomm  # noqa: PLC0415 - plugin-only dependency

        cdb = dscomm.cdb
        if cdb is None:
            raise RuntimeError(
                "deepspeed.comm is not initialised: call deepspeed.init_distributed (or "
                "deepspeed.initialize) before installing flowlane.hermod"
            )
        if getattr(cdb, "_flowlane_tap", None) is not None:
            raise RuntimeError(
                "deepspeed.comm already has a flowlane tap: close the previous Hermod install first"
            )
        self.cdb, self.classes = cdb, classes
        self.records: deque[CommRecord] = deque(maxlen=max_records)
        self._local = threading.local()
        # close() removes only what is still its own wrapper and puts back what it wrapped (flowlane.patching)
        self._patches: list[Patch] = []
        for name in COLLECTIVES:
            original = getattr(cdb, name, None)
            if original is not None:
                self._patches.append(Patch(cdb, name, self._wrap(name, original), "flowlane.hermod"))
        cdb._flowlane_tap = self

    def _wrap(self, name: str, original: Any) -> Any:
        sig = _real_signature(type(self.cdb), name)  # (self, ...): bound with the backend as self
        has_group = "group" in sig.parameters
        local, records, cdb = self._local, self.records, self.cdb

        def tapped(*args: Any, **kwargs: Any) -> Any:
            bound = sig.bind_partial(cdb, *args, **kwargs)
            group = bound.arguments.get("group")
            cls = getattr(local, "cls", None)
            p2p = getattr(local, "p2p", None)
            moved = p2p is not None and name in P2P_OPS and has_group and group is None
            records.append(
                CommRecord(
                    name,
                    _numel(bound.arguments),
                    _ranks(group),
                    "pacer" if cls is not None else "main",
                    getattr(local, "meta", None),
                    p2p[0] if moved else cls if has_group else None,
                )
            )
            if moved:
                peer = bound.arguments.get("dst", bound.arguments.get("src"))
                if peer is not None and int(peer) not in p2p[2]:
                    raise RuntimeError(
                        f"flowlane.hermod: pipeline {name} with peer rank {peer} outside the pipeline "
                        f"group {list(p2p[2])} whose class clone carries the p2p"
                    )
                bound.arguments["group"] = p2p[1]
                return original(*bound.args[1:], **bound.kwargs)
            if cls is not None and has_group:
                clone = self.classes.get(group, cls) if self.classes is not None else None
                if clone is None or clone is group:
                    raise RuntimeError(
                        f"flowlane.hermod: deferred {name} on group {list(_ranks(group))} has no "
                        "Hermod class clone; it would share a communicator with the training "
                        "thread's ops"
                    )
                bound.arguments["group"] = clone
                return original(*bound.args[1:], **bound.kwargs)
            return original(*args, **kwargs)

        return tapped

    @contextmanager
    def on_class(self, hermod_class: int, meta: CoflowMeta) -> Iterator[None]:
        """Ops issued by this thread inside the block go to ``hermod_class``'s clone and are recorded under ``meta``."""
        self._local.cls, self._local.meta = hermod_class, meta
        try:
            yield
        finally:
            self._local.cls = self._local.meta = None

    @contextmanager
    def p2p_on_class(self, hermod_class: int, meta: CoflowMeta, group: Any) -> Iterator[None]:
        """Point-to-point ops this thread issues inside the block with no group (DeepSpeed's pipe p2p) go to
        ``hermod_class``'s clone of ``group`` (the pipeline group) and are recorded under ``meta``; other ops are
        recorded under ``meta`` and keep their group."""
        clone = self.classes.get(group, hermod_class) if self.classes is not None else None
        if clone is None or clone is group:
            raise RuntimeError(
                f"flowlane.hermod: the pipeline group {list(_ranks(group))} has no Hermod class clone"
            )
        old = getattr(self._local, "p2p", None), getattr(self._local, "meta", None)
        self._local.p2p, self._local.meta = (hermod_class, clone, frozenset(_ranks(group))), meta
        try:
            yield
        finally:
            self._local.p2p, self._local.meta = old

    @contextmanager
    def keyed(self, meta: CoflowMeta) -> Iterator[None]:
        """Record this thread's ops inside the block under ``meta`` (no redirect: critical ops keep their group)."""
        old = getattr(self._local, "meta", None)
        self._local.meta = meta
        try:
            yield
        finally:
            self._local.meta = old

    def check_removable(self) -> None:
        """Raise, changing nothing, when closing would remove what is not this tap's: it is no longer the backend's
        tap, or a method it wrapped was wrapped again since (a feature installed after it); no-op once closed."""
        if self._patches and getattr(self.cdb, "_flowlane_tap", None) is not self:
            raise RuntimeError(
                "flowlane.hermod: cannot close the deepspeed.comm tap: it is no longer the backend's tap (another "
                "tap or wrapper replaced it); close the features in the reverse order of their install (the last "
                "installed first)"
            )
        check_all(self._patches)

    def close(self) -> None:
        """Restore the backend's methods (refused, changing nothing, out of close order: :meth:`check_removable`).
        Idempotent: a second close does nothing."""
        if not self._patches:
            return
        self.check_removable()
        undo_all(self._patches)
        del self.cdb._flowlane_tap


# -- one data-parallel all-reduce routed elsewhere (ALEPH's hierarchy, SYNDICATE's enforcer) -------------------------
def unwrapped_backend(feature: str) -> Any:
    """``deepspeed.comm``'s backend object, refusing a process where it is not initialised or where another flowlane
    feature (Hermod's tap, ALEPH, SYNDICATE) already wraps its ``all_reduce``: two cannot share the DP all-reduce."""
    import deepspeed.comm.comm as dscomm  # noqa: PLC0415 - plugin-only dependency

    cdb = dscomm.cdb
    if cdb is None:
        raise RuntimeError(
            f"flowlane.{feature}: deepspeed.comm is not initialised: call deepspeed.initialize before install"
        )
    if getattr(cdb, "_flowlane_tap", None) is not None or "all_reduce" in vars(cdb):
        raise RuntimeError(
            f"flowlane.{feature}: deepspeed.comm's all_reduce is already wrapped (Hermod's tap, ALEPH or "
            "SYNDICATE); close that install first: they cannot share the DP all-reduce"
        )
    return cdb


def _is_sum(op: Any) -> bool:
    return op == dist.ReduceOp.SUM or getattr(op, "name", None) == "SUM"


def route_dp_all_reduce(
    cdb: Any, ranks: tuple[int, ...], reduce: Callable[[torch.Tensor, bool], Any], feature: str
) -> Patch:
    """Wrap ``cdb.all_reduce`` on the instance (the class is not patched): a SUM all-reduce of a contiguous tensor
    over exactly ``ranks`` (ZeRO-0's ``allreduce_bucket`` on the DP group) returns ``reduce(tensor, async_op)``;
    every other call goes to DeepSpeed's own. Returns the :class:`flowlane.patching.Patch` (calling it undoes it);
    ``feature`` (e.g. ``flowlane.aleph``) names the feature in its close-order error."""
    original = cdb.all_reduce
    world = tuple(range(dist.get_world_size()))

    def all_reduce(
        tensor: Any, op: Any = dist.ReduceOp.SUM, group: Any = None, async_op: bool = False
    ) -> Any:
        on = world if group is None else tuple(dist.get_process_group_ranks(group))
        if on == ranks and _is_sum(op) and tensor.is_contiguous():
            return reduce(tensor, async_op)
        return original(tensor, op, group, async_op)

    return Patch(cdb, "all_reduce", all_reduce, feature)


def after_iteration(engine: Any, fn: Callable[[], None], feature: str) -> Patch:
    """Wrap ``engine.step`` on the instance: ``fn()`` runs after each step that ends a gradient-accumulation boundary,
    DeepSpeed's iteration boundary (every DP rank reaches it at the same micro-step, after the boundary's
    all-reduces). Returns the :class:`flowlane.patching.Patch` (calling it undoes it)."""
    step = engine.step

    def step_then(*args: Any, **kwargs: Any) -> Any:
        boundary = engine.is_gradient_accumulation_boundary()
        out = step(*args, **kwargs)
        if boundary:
            fn()
        return out

    return Patch(engine, "step", step_then, feature)


def check_zero_all_reduce(engine: Any, feature: str) -> None:
    """Refuse, naming the setting, a DeepSpeed engine whose DP gradient reduction is not a SUM all-reduce of
    buckets on its data-parallel group: ZeRO 3, ZeRO 1/2 reducing to owners, MoE under ZeRO 1/2."""
    stage = engine.zero_optimization_stage()
    if stage == 3:
        raise ValueError(
            f"{feature} on DeepSpeed supports ZeRO stages 0-2 (their gradient buckets are all-reduced), got stage "
            "3 (partitioned parameters, reduce-scattered gradients)"
        )
    if stage in (1, 2):
        opt = engine.optimizer
        if opt.reduce_scatter and not opt.use_multi_rank_bucket_allreduce:
            raise ValueError(
                f"{feature}: ZeRO {stage} with use_multi_rank_bucket_allreduce off reduces each gradient slice to "
                "its partition's owner (dist.reduce), not an all-reduce; turn it on (the default) or set "
                '"reduce_scatter": false'
            )
        if getattr(engine, "has_moe_layers", False):
            raise ValueError(
                f"{feature}: ZeRO {stage} with MoE layers reduces expert gradients over expert groups; dense only"
            )
