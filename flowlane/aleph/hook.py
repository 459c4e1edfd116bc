"""Tier 0 of ALEPH's data plane: hierarchical all-reduce over torch.distributed subgroups, and a DDP comm hook.

Digest §5.4 tier 0 / §6: for a :class:`flowlane.aleph.Plan` over the ranks of a data-parallel group,

1. ``reduce`` inside each cluster to its aggregator (the paper's worker -> aggregator step);
2. aggregators combine: ``all_reduce`` among them (``top="allreduce"``: no dedicated PS, digest §5.1 #12), or
   ``reduce`` to the first aggregator and ``broadcast`` back (``top="ps"``: the first aggregator plays the PS);
3. ``broadcast`` inside each cluster from its aggregator (the PS -> aggregator -> worker multicast).

Singleton clusters skip steps 1 and 3. Sums of integers are exact; float sums differ from ``all_reduce`` only in the
order of additions. Subgroups are made with ``new_group`` on every rank in one order (torch requires it), at
construction, never inside backward. The plan must be the same on every rank: the constructor all-gathers it and
raises on every rank when two disagree (a mismatch would otherwise hang).

The DDP hook (``DistributedDataParallel.register_comm_hook``) divides the bucket by the group size first, as DDP's
default ``allreduce_hook`` does, then runs the three steps. It runs them synchronously and returns a completed
future: correct and simple, without overlap between buckets (tier 0 validates plan semantics and traffic shape).
"""

import logging
from typing import Any

import torch
import torch.distributed as dist

from flowlane.aleph.cluster import Plan
from flowlane.aleph.config import TOP_MODES

log = logging.getLogger(__name__)


class HierarchicalAllReduce:
    """The three-step all-reduce of ``plan`` over ``group`` (default: the world); ``plan`` indexes positions in the
    group (0..size-1)."""

    def __init__(self, plan: Plan, group: dist.ProcessGroup | None = None, top: str = "allreduce") -> None:
        if top not in TOP_MODES:
            raise ValueError(f"top={top!r} is not one of {TOP_MODES}")
        if not dist.is_initialized():
            raise RuntimeError("HierarchicalAllReduce needs an initialised torch.distributed process group")
        self.group = group
        self.ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
        if plan.n != len(self.ranks):
            raise ValueError(f"plan covers {plan.n} workers but the group has {len(self.ranks)} ranks")
        plans = [None] * len(self.ranks)
        dist.all_gather_object(plans, plan.to_dict(), group=group)
        if any(p != plans[0] for p in plans):
            diff = next(i for i, p in enumerate(plans) if p != plans[0])
            raise ValueError(f"ranks disagree on the ALEPH plan: position 0 has {plans[0]}, position {diff} has "
                             f"{plans[diff]}; plan with the same inputs and seed everywhere")
        self.plan, self.top = plan, top
        me = dist.get_rank()
        self.me = self.ranks.index(me) if group is not None else me
        self.cluster = plan.cluster_of(self.me)
        # every rank creates every group in the same order, also the ones it is not in
        self._cluster_pg: Any = None
        for c in plan.clusters:
            if len(c.members) > 1:
                pg = dist.new_group([self.ranks[m] for m in c.members])
                if c is self.cluster:
                    self._cluster_pg = pg
        self._top_pg: Any = None
        if plan.num_flows > 1:
            pg = dist.new_group([self.ranks[h] for h in plan.heads])
            if self.me in plan.heads:
                self._top_pg = pg
        log.info("ALEPH hierarchical all-reduce: %d clusters (|D|), this rank in cluster of %d, top=%s",
                 plan.num_flows, self.cluster.head, top)

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over the group in place (SUM only) and return it."""
        head = self.ranks[self.cluster.head]
        if self._cluster_pg is not None:
            dist.reduce(tensor, dst=head, group=self._cluster_pg)
        if self._top_pg is not None:
            if self.top == "allreduce":
                dist.all_reduce(tensor, group=self._top_pg)
            else:
                root = self.ranks[self.plan.heads[0]]
                dist.reduce(tensor, dst=root, group=self._top_pg)
                dist.broadcast(tensor, src=root, group=self._top_pg)
        if self._cluster_pg is not None:
            dist.broadcast(tensor, src=head, group=self._cluster_pg)
        return tensor


def aleph_comm_hook(state: "HierarchicalAllReduce", bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: the bucket's mean over the group through the plan's hierarchy (no ``from __future__ import
    annotations`` in this module: DDP checks that ``bucket`` is annotated with the class itself)."""
    buf = bucket.buffer()
    buf.div_(len(state.ranks))
    state(buf)
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(buf)
    return fut


def install_aleph_hook(model: torch.nn.parallel.DistributedDataParallel, plan: Plan,
                       top: str = "allreduce") -> HierarchicalAllReduce:
    """Register the ALEPH hook on a DDP model (its process group); returns the hook's state."""
    if not isinstance(model, torch.nn.parallel.DistributedDataParallel):
        raise TypeError(f"install_aleph_hook needs a torch DistributedDataParallel model, got {type(model).__name__}")
    state = HierarchicalAllReduce(plan, getattr(model, "process_group", None), top)
    model.register_comm_hook(state, aleph_comm_hook)
    return state
