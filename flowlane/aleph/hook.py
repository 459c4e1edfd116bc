"""Tier 0 of ALEPH's data plane: hierarchical all-reduce over torch.distributed (point-to-point stars inside clusters,
a subgroup of aggregators on top), and a DDP comm hook.

Digest §5.4 tier 0 / §6: for a :class:`flowlane.aleph.Plan` over the ranks of a data-parallel group,

1. every member sends its tensor to its aggregator, which adds them (a star of point-to-point transfers, so each
   member sends S once, as in the paper's worker -> aggregator step);
2. aggregators combine: ``all_reduce`` among them (``top="allreduce"``: no dedicated PS, digest §5.1 #12), or a
   star into the first aggregator and back (``top="ps"``: the first aggregator plays the PS; give the PS its own
   rank, contributing zeros, to model a separate server);
3. the aggregator sends the sum to each member (the PS -> aggregator -> worker multicast).

With ``top="ps"`` the whole tree is pipelined per ``chunk_bytes`` chunk, as the paper pipelines segments: a node
forwards chunk k up as soon as its children's chunk k are in and relays the result's chunk k down as soon as it
arrives, so the tree runs at its tightest link (the flow model of :mod:`flowlane.aleph.model`), not at the sum of
four store-and-forward steps. With ``top="allreduce"`` the three steps run one after the other.

Singleton clusters skip steps 1 and 3. Sums of integers are exact; float sums differ from ``all_reduce`` only in the
order of additions. The aggregators' subgroup is made with ``new_group`` on every rank (torch requires it), at
construction, never inside backward. Steps 1 and 3 use ``isend``/``irecv`` rather than ``reduce``/``broadcast``,
whose algorithms are the backend's choice, so the traffic is the paper's: S up and S down per member. The plan must be the same on every rank: the constructor all-gathers it and
raises on every rank when two disagree (a mismatch would otherwise hang).

The DDP hook (``DistributedDataParallel.register_comm_hook``) multiplies the bucket by 1/size, as DDP's built-in
reducer does, then runs the three steps. (torch's Python ``allreduce_hook`` divides by the size instead, and dividing
after the sum rounds differently again: at 7 ranks neither is bitwise DDP's own; a power-of-two size hides it.) It runs them synchronously and returns a completed
future: correct and simple, without overlap between buckets (tier 0 validates plan semantics and traffic shape).
"""

import logging
import threading
from typing import Any

import torch
import torch.distributed as dist

from flowlane.aleph.cluster import Plan
from flowlane.aleph.config import TOP_MODES

log = logging.getLogger(__name__)


class HierarchicalAllReduce:
    """The three-step all-reduce of ``plan`` over ``group`` (default: the world); ``plan`` indexes positions in the
    group (0..size-1). Construct it on every rank of the world (with ``top="allreduce"`` it calls ``new_group``,
    which torch requires of every rank), the same plan everywhere."""

    def __init__(
        self,
        plan: Plan,
        group: dist.ProcessGroup | None = None,
        top: str = "allreduce",
        chunk_bytes: int = 256 << 10,
    ) -> None:
        if top not in TOP_MODES:
            raise ValueError(f"top={top!r} is not one of {TOP_MODES}")
        if not (isinstance(chunk_bytes, int) and chunk_bytes >= 1024):
            raise ValueError(f"chunk_bytes={chunk_bytes!r} must be an integer >= 1024")
        self.chunk_bytes = chunk_bytes
        if not dist.is_initialized():
            raise RuntimeError("HierarchicalAllReduce needs an initialised torch.distributed process group")
        self.group = group
        self.ranks = (
            dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
        )
        if plan.n != len(self.ranks):
            raise ValueError(f"plan covers {plan.n} workers but the group has {len(self.ranks)} ranks")
        plans = [None] * len(self.ranks)
        dist.all_gather_object(plans, plan.to_dict(), group=group)
        if any(p != plans[0] for p in plans):
            diff = next(i for i, p in enumerate(plans) if p != plans[0])
            raise ValueError(
                f"ranks disagree on the ALEPH plan: position 0 has {plans[0]}, position {diff} has "
                f"{plans[diff]}; plan with the same inputs and seed everywhere"
            )
        self.plan, self.top = plan, top
        me = dist.get_rank()
        if me not in self.ranks:
            raise ValueError(f"rank {me} is not in the group {self.ranks} this all-reduce is for")
        self.me = self.ranks.index(me)
        self.cluster = plan.cluster_of(self.me)
        self._top_pg: Any = None  # every rank creates it (new_group is collective), only heads keep it
        if plan.num_flows > 1 and top == "allreduce":
            pg = dist.new_group([self.ranks[h] for h in plan.heads])
            if self.me in plan.heads:
                self._top_pg = pg
        # the PS-rooted tree: parent and children of this rank (global ranks)
        root = plan.heads[0]
        if self.me == self.cluster.head:
            self._parent = None if self.me == root else self.ranks[root]
            kids = list(self.cluster.members[1:]) + (
                [h for h in plan.heads if h != root] if self.me == root else []
            )
        else:
            self._parent, kids = self.ranks[self.cluster.head], []
        self._children = [self.ranks[k] for k in kids]
        log.info(
            "ALEPH hierarchical all-reduce: %d clusters (|D|), this rank in cluster of %d, top=%s",
            plan.num_flows,
            self.cluster.head,
            top,
        )

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over the group in place (SUM only) and return it."""
        if not tensor.is_contiguous():
            raise ValueError(
                "HierarchicalAllReduce needs a contiguous tensor (DDP buckets and DeepSpeed's are)"
            )
        if self.top == "ps":
            self._tree(tensor)
            return tensor
        c = self.cluster
        head = self.ranks[c.head]
        if len(c.members) > 1:
            self._gather_sum(tensor, head, [self.ranks[m] for m in c.members[1:]])
        if self._top_pg is not None:  # this rank is an aggregator (top="allreduce")
            dist.all_reduce(tensor, group=self._top_pg)
        if len(c.members) > 1:
            self._scatter(tensor, head, [self.ranks[m] for m in c.members[1:]])
        return tensor

    def _tree(self, tensor: torch.Tensor) -> None:
        """The PS-rooted two-level tree, pipelined per chunk (the paper's per-segment pipelining, Sec. 3.3): a node
        adds chunk k of all its children as soon as they are in and sends it up at once, and relays the parent's
        result for chunk k down as soon as it arrives, so sending up and down overlap (full duplex). The root's sum is
        the result. Children are added in plan order, so every run adds in the same order."""
        flat = tensor.view(-1)
        step = max(1, self.chunk_bytes // max(1, flat.element_size()))
        mine = list(flat.split(step))
        n = len(mine)
        kids, parent = self._children, self._parent
        bufs = [[torch.empty_like(x) for x in mine] for _ in kids]
        ups = [[dist.irecv(b[k], src=c, tag=k) for k in range(n)] for b, c in zip(bufs, kids, strict=True)]
        sends: list[Any] = []
        if parent is None:  # the root (the PS): its sum of chunk k is the result, sent down at once
            for k in range(n):
                for u, b in zip(ups, bufs, strict=True):
                    u[k].wait()
                    mine[k].add_(b[k])
                sends += [dist.isend(mine[k], dst=c, tag=k) for c in kids]
            for w in sends:
                w.wait()
            return
        out = [torch.empty_like(x) for x in mine]
        downs = [dist.irecv(out[k], src=parent, tag=k) for k in range(n)]
        relay_sends: list[Any] = []
        errors: list[BaseException] = []

        def relay() -> None:  # results down to the members as they arrive (gloo's wait releases the GIL)
            try:
                for k in range(n):
                    downs[k].wait()
                    relay_sends.extend(dist.isend(out[k], dst=c, tag=k) for c in kids)
            except BaseException as e:  # re-raised by the caller after join
                errors.append(e)

        # (a gloo Work reports completion only once waited on, so the two directions get a thread each, not a poll)
        relayer = threading.Thread(target=relay, name="aleph-relay", daemon=True) if kids else None
        if relayer is not None:
            relayer.start()
        for k in range(n):  # partial sums up to the parent, chunk by chunk
            for u, b in zip(ups, bufs, strict=True):
                u[k].wait()
                mine[k].add_(b[k])
            sends.append(dist.isend(mine[k], dst=parent, tag=k))
        if relayer is not None:
            relayer.join()
            if errors:
                raise errors[0]
        else:
            for d in downs:
                d.wait()
        for w in sends + relay_sends:
            w.wait()
        torch.cat(out, out=flat)

    def _gather_sum(self, tensor: torch.Tensor, root: int, others: list[int]) -> None:
        """Star: every rank in ``others`` sends to ``root``, which adds them in list order (the aggregation service
        of Sec. 5.3: one flow per member into its aggregator)."""
        me = dist.get_rank()
        if me == root:
            bufs = [torch.empty_like(tensor) for _ in others]
            for w in [dist.irecv(b, src=o) for b, o in zip(bufs, others, strict=True)]:
                w.wait()
            for b in bufs:
                tensor.add_(b)
        elif me in others:
            dist.isend(tensor, dst=root).wait()

    def _scatter(self, tensor: torch.Tensor, root: int, others: list[int]) -> None:
        """Star: ``root`` sends the sum to every rank in ``others`` (the Gradient Forwarder's multicast, Sec. 5.4)."""
        me = dist.get_rank()
        if me == root:
            for w in [dist.isend(tensor, dst=o) for o in others]:
                w.wait()
        elif me in others:
            dist.irecv(tensor, src=root).wait()


def aleph_comm_hook(
    state: "HierarchicalAllReduce", bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: the bucket's mean over the group through the plan's hierarchy, scaled by 1/size first (no ``from __future__ import
    annotations`` in this module: DDP checks that ``bucket`` is annotated with the class itself)."""
    buf = bucket.buffer()
    buf.mul_(
        1.0 / len(state.ranks)
    )  # DDP's built-in reducer scales by 1/size before the sum: bitwise at any size
    state(buf)
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(buf)
    return fut


def install_aleph_hook(
    model: torch.nn.parallel.DistributedDataParallel,
    plan: Plan,
    top: str = "allreduce",
    chunk_bytes: int = 256 << 10,
    dataplane: str = "torch",
    **udp_options: Any,
) -> Any:
    """Register the ALEPH hook on a DDP model (its process group); returns the hook's state. ``dataplane``: "torch"
    (tier 0, :class:`HierarchicalAllReduce`) or "udp" (tier 1, :class:`flowlane.aleph.udp_allreduce.UdpAllReduce`,
    PS-rooted; ``udp_options`` go to it, ``top`` and ``chunk_bytes`` do not apply)."""
    if dataplane not in ("torch", "udp"):
        raise ValueError(f"dataplane={dataplane!r} is not one of ('torch', 'udp')")
    if dataplane == "torch" and udp_options:
        raise ValueError(f"{sorted(udp_options)} apply to dataplane='udp' only")
    if not isinstance(model, torch.nn.parallel.DistributedDataParallel):
        raise TypeError(
            f"install_aleph_hook needs a torch DistributedDataParallel model, got {type(model).__name__}"
        )
    group = getattr(model, "process_group", None)
    if dataplane == "udp":
        from flowlane.aleph.udp_allreduce import UdpAllReduce

        state: Any = UdpAllReduce(plan, group, **udp_options)
    else:
        state = HierarchicalAllReduce(plan, group, top, chunk_bytes)
    model.register_comm_hook(state, aleph_comm_hook)
    return state
