"""Tier 0 of ALEPH's data plane: hierarchical all-reduce over torch.distributed (point-to-point stars inside clusters,
a subgroup of aggregators on top), and a DDP comm hook.

Digest §5.4 tier 0 / §6: for a :class:`flowlane.aleph.Plan` over the ranks of a data-parallel group,

1. every member sends its tensor to its aggregator, which adds them (a star of point-to-point transfers, so each
   member sends S once, as in the paper's worker -> aggregator step);
2. aggregators combine: ``all_reduce`` among them (``top="allreduce"``: no dedicated PS, digest §5.1 #12), or a
   star into one aggregator and back (``top="ps"``: an aggregator plays the PS, by default the first; the plugins
   and re-planning, which have bandwidth figures, pick :func:`flowlane.aleph.model.ps_head`; give the PS its own
   rank, contributing zeros, to model the seed's separate server). With ``ps=`` naming q PS positions (seed Sec. 7,
   digest §2.9), every aggregator sends PS j the part ``split[j]`` of its partial sums (default: proportional to
   ``ps_bandwidths``), the parts' chunks interleaved so the PSs' links work in parallel; ``dedicated_ps=True``
   leaves the PS ranks out of the sum;
3. the aggregator sends the sum to each member (the PS -> aggregator -> worker multicast).

With ``top="ps"`` the whole tree is pipelined per ``chunk_bytes`` chunk, as the paper pipelines segments: a node
forwards chunk k up as soon as its children's chunk k are in and relays the result's chunk k down as soon as it
arrives, so the tree runs at its tightest link (the flow model of :mod:`flowlane.aleph.model`), not at the sum of
four store-and-forward steps. With ``top="allreduce"`` the three steps run one after the other.

Singleton clusters skip steps 1 and 3. Sums of integers are exact; float sums differ from ``all_reduce`` only in the
order of additions. The aggregators' subgroup is made with ``new_group`` on every rank (torch requires it), at
construction, never inside backward. Steps 1 and 3 use ``isend``/``irecv`` rather than ``reduce``/``broadcast``,
whose algorithms are the backend's choice, so the traffic is the paper's: S up and S down per member. With
``top="ps"`` they run on one group per PS and direction, every send down from one thread in piece order: NCCL runs a
pair's messages in order on one stream and ignores tags, so a pair must talk one way per group and send in the order
the other side posted its receives (the Megatron check on an H200 hung when a member posted its result receive
before its partial sum's send on one group, no stacks kept: that order is the likely cause;
``tests/test_aleph_multips.py`` checks both rules on the recorded messages). The plan must be the same on every rank: the constructor all-gathers it and
raises on every rank when two disagree (a mismatch would otherwise hang).

The DDP hook (``DistributedDataParallel.register_comm_hook``) multiplies the bucket by 1/size, as DDP's built-in
reducer does, then runs the three steps. (torch's Python ``allreduce_hook`` divides by the size instead, and dividing
after the sum rounds differently again: at 7 ranks neither is bitwise DDP's own; a power-of-two size hides it.) It runs them synchronously and returns a completed
future: correct and simple, without overlap between buckets (tier 0 validates plan semantics and traffic shape).
"""

import contextlib
import logging
import threading
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from flowlane.aleph.cluster import Plan
from flowlane.aleph.config import TOP_MODES
from flowlane.aleph.model import multi_ps_split, ps_head

log = logging.getLogger(__name__)
# the connection greeting's tag (gloo matches by tag; NCCL by order): above any piece index
_CONNECT_TAG = 1 << 20


def _check_multi_ps(
    plan: Plan,
    ps: Sequence[int] | None,
    split: Sequence[float] | str | None,
    ps_bandwidths: Sequence[float] | None,
    dedicated: bool,
) -> tuple[tuple[int, ...], tuple[float, ...]]:
    """The PS positions and the fraction of the tensor each sums (digest §2.9); bad input is refused, naming it."""
    ps = (plan.heads[0],) if ps is None else tuple(ps)
    if not ps or any(not isinstance(p, int) or isinstance(p, bool) for p in ps):
        raise ValueError(f"ps={ps!r} must be a non-empty sequence of group positions (integers)")
    if len(set(ps)) != len(ps):
        raise ValueError(f"ps={ps!r} names a position twice")
    for p in ps:
        if not 0 <= p < plan.n:
            raise ValueError(f"PS position {p} is outside the group's positions 0..{plan.n - 1}")
        if p not in plan.heads:
            raise ValueError(
                f"PS position {p} is a member of the cluster of {plan.cluster_of(p).head}; a PS must be an "
                f"aggregator (a cluster head, e.g. a singleton cluster for a dedicated PS): heads are {plan.heads}"
            )
        if dedicated and len(plan.cluster_of(p).members) > 1:
            raise ValueError(
                f"dedicated_ps: PS position {p} has members {list(plan.cluster_of(p).members[1:])}; a dedicated PS must be a singleton cluster"
            )
    if dedicated and len(ps) == len(plan.heads):
        raise ValueError(f"dedicated_ps: every aggregator {plan.heads} is a PS, so nothing would be summed")
    q = len(ps)
    if split is None:
        if ps_bandwidths is None:
            if q > 1:
                raise ValueError(
                    f"{q} PSs {ps}: give split= (fractions or 'equal') or ps_bandwidths= (proportional)"
                )
            return ps, (1.0,)
        bw = list(ps_bandwidths)
        if len(bw) != q:
            raise ValueError(f"ps_bandwidths={bw} has {len(bw)} values for {q} PSs {ps}")
        return ps, tuple(multi_ps_split(bw))
    if ps_bandwidths is not None:
        raise ValueError("give split= or ps_bandwidths=, not both")
    if isinstance(split, str):
        if split != "equal":
            raise ValueError(f"split={split!r}: a string split must be 'equal' (or give fractions)")
        return ps, tuple(1.0 / q for _ in ps)
    fr = [float(f) for f in split]
    if len(fr) != q or any(not (0 <= f <= 1) for f in fr) or abs(sum(fr) - 1) > 1e-9:
        raise ValueError(
            f"split={list(split)} must have one fraction in [0, 1] per PS ({q}: {ps}), summing to 1"
        )
    return ps, tuple(fr)


class HierarchicalAllReduce:
    """The three-step all-reduce of ``plan`` over ``group`` (default: the world); ``plan`` indexes positions in the
    group (0..size-1). Construct it on every rank of the world (with ``top="allreduce"`` it calls ``new_group``,
    which torch requires of every rank), the same plan everywhere.

    ``top="ps"`` only: ``ps``, the PS positions (cluster heads; default: the first head, as a plan carries no
    figures: with them, :func:`flowlane.aleph.model.ps_head` is the better choice); ``split``, the fraction of
    the tensor each PS sums (fractions >= 0 summing to 1, or ``"equal"``), or ``ps_bandwidths`` for the proportional
    split P_j / sum(P); ``dedicated_ps``: the PSs (singleton clusters) are separate servers, left out of the sum,
    each ending with its own part's sum and zeros elsewhere. ``p2p_groups``: the (up, down) groups over the group's
    ranks, one per PS each (made here by the group's ranks when not given; a caller with several data-parallel groups
    on NCCL must make them on every rank in one order, since NCCL splits them from the world's communicator)."""

    def __init__(
        self,
        plan: Plan,
        group: dist.ProcessGroup | None = None,
        top: str = "allreduce",
        chunk_bytes: int = 256 << 10,
        *,
        ps: Sequence[int] | None = None,
        split: Sequence[float] | str | None = None,
        ps_bandwidths: Sequence[float] | None = None,
        dedicated_ps: bool = False,
        p2p_groups: tuple[Sequence[Any], Sequence[Any]] | None = None,
    ) -> None:
        if top not in TOP_MODES:
            raise ValueError(f"top={top!r} is not one of {TOP_MODES}")
        if top != "ps" and (ps is not None or split is not None or ps_bandwidths is not None or dedicated_ps):
            raise ValueError(
                f"ps, split, ps_bandwidths and dedicated_ps apply to top='ps' only, not top={top!r}"
            )
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
        self.ps, self.split = _check_multi_ps(plan, ps, split, ps_bandwidths, dedicated_ps)
        self.dedicated_ps = dedicated_ps
        mine_cfg = {
            "plan": plan.to_dict(),
            "ps": list(self.ps),
            "split": list(self.split),
            "dedicated": dedicated_ps,
        }
        plans: list[Any] = [None] * len(self.ranks)
        dist.all_gather_object(plans, mine_cfg, group=group)
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
        # top="ps": one group per PS and direction. Where two ranks' messages run in order on one stream per pair and
        # group, matched by order and not by tag (NCCL), a pair must talk one way per group: a receive posted first
        # would wait for a send queued behind it. Partial sums go up to PS j on up[j], results come down from it on
        # down[j]; two aggregators that are both PSs send each other parts, each on its own PS's group.
        q = len(self.ps) if top == "ps" else 0
        if p2p_groups is None:  # made by the group's ranks only (as the plan exchange above)
            p2p_groups = tuple(  # type: ignore[assignment]
                [dist.new_group(self.ranks, use_local_synchronization=True) for _ in range(q)]
                for _ in range(2)
            )
        elif top != "ps" or any(len(g) != q for g in p2p_groups):
            raise ValueError(
                f"p2p_groups: top='ps' with {q} PS(s) needs (up, down) lists of {q} group(s) each; got "
                f"{[len(g) for g in p2p_groups]} with top={top!r}"
            )
        self._up_pgs, self._down_pgs = (list(g) for g in p2p_groups)  # type: ignore[union-attr]
        # the PS-rooted tree(s): this rank's members (global ranks); the other heads are children only of a PS
        c = self.cluster
        self._members = [self.ranks[m] for m in c.members[1:]] if self.me == c.head else []
        self._up = None if self.me == c.head else self.ranks[c.head]
        self._dedicated = set(self.ps) if dedicated_ps else set()
        self._roles = [self._role(p) for p in self.ps]  # per PS: fixed by the plan, read on every all-reduce
        self._connected = False  # top="ps": the trees' pairs greeted once (_connect)
        log.info(
            "ALEPH hierarchical all-reduce: %d clusters (|D|), this rank in cluster of %d, top=%s",
            plan.num_flows,
            self.cluster.head,
            top,
        )

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over the group in place (SUM only) and return it."""
        return self._run(tensor, None)

    def reduce_scatter(self, tensor: torch.Tensor) -> torch.Tensor:
        """The distributed optimizer's reduce-scatter through the hierarchy (SUM, in place): on return, block ``p``
        of ``tensor`` (``numel / n`` elements per group position, in position order) holds the sum at the rank at
        position ``p``; the rest of the tensor is unspecified. Going up and across the top tier is the all-reduce's
        (an aggregator needs every block of its cluster); going down, a node receives only the span of the blocks
        below it (a member: its own block), so the way back moves 1/n of the bucket to a member, not all of it."""
        n = len(self.ranks)
        if tensor.numel() % n:
            raise ValueError(f"reduce_scatter: {tensor.numel()} elements do not split into {n} equal blocks")
        if self.dedicated_ps:
            raise ValueError("reduce_scatter: dedicated PSs hold only their own part; use the all-reduce")
        return self._run(tensor, tensor.numel() // n)

    def _run(self, tensor: torch.Tensor, block: int | None) -> torch.Tensor:
        if not tensor.is_contiguous():
            raise ValueError(
                "HierarchicalAllReduce needs a contiguous tensor (DDP buckets and DeepSpeed's are)"
            )
        if self.top == "ps":
            self._tree(tensor, block)
            return tensor
        c = self.cluster
        head = self.ranks[c.head]
        if len(c.members) > 1:
            self._gather_sum(tensor, head, [self.ranks[m] for m in c.members[1:]])
        if self._top_pg is not None:  # this rank is an aggregator (top="allreduce")
            dist.all_reduce(tensor, group=self._top_pg)
        if len(c.members) > 1:
            self._scatter(tensor, head, [self.ranks[m] for m in c.members[1:]], block)
        return tensor

    def _span(self, global_rank: int, block: int | None, numel: int) -> tuple[int, int]:
        """The elements of the bucket a rank needs back: all of it (all-reduce), or with ``block`` the blocks of the
        positions below it in the tree (an aggregator: its cluster; a member: its own)."""
        if block is None:
            return 0, numel
        pos = self.ranks.index(global_rank)
        below = self.plan.cluster_of(pos).members if pos in self.plan.heads else (pos,)
        return min(below) * block, (max(below) + 1) * block

    def _pieces(self, flat: torch.Tensor) -> list[tuple[torch.Tensor, int]]:
        """(view of ``flat``, index j of the PS that sums it), in sending order. One PS: ``chunk_bytes`` chunks. Several
        (digest §2.9): PS j's part is the slice of ``split[j]`` of the tensor, cut into as many chunks as one PS would
        use and sent interleaved (chunk i of part 0, of part 1, ...), so every PS's link works from the first chunk
        on, each at its share; empty pieces are dropped (every rank computes the same list)."""
        step = max(1, self.chunk_bytes // max(1, flat.element_size()))
        if len(self.ps) == 1:
            return [(x, 0) for x in flat.split(step)]
        n, acc, off = flat.numel(), 0.0, [0]
        for f in self.split[:-1]:
            acc += f
            off.append(min(n, max(off[-1], round(acc * n))))
        off.append(n)
        m = max(1, -(-n // step))
        parts = [flat[a:b].tensor_split(m) for a, b in zip(off, off[1:], strict=False)]
        return [(p[i], j) for i in range(m) for j, p in enumerate(parts) if p[i].numel()]

    def _role(self, p: int) -> tuple[int | None, list[int]]:
        """(parent, children) of this rank, as global ranks, in the tree of the PS at position ``p``: parent None at
        that PS, -1 at a dedicated PS outside its own part (it takes no part in that tree)."""
        me = self.me
        if self._up is not None:  # a member: everything goes through its aggregator
            return self._up, []
        if p == me:
            return None, self._members + [
                self.ranks[h] for h in self.plan.heads if h != me and h not in self._dedicated
            ]
        if me in self._dedicated:
            return -1, []
        return self.ranks[p], self._members

    def _connect(self, tensor: torch.Tensor) -> None:
        """One small exchange with every neighbour in every PS's tree, up and down groups in one order, before the
        first all-reduce. NCCL connects a pair of ranks at their first message, and the call blocks until the peer
        connects too: in :meth:`_tree` a member posts its receives from its aggregator (down) before its sends up,
        while the aggregator sends down only after a sum that needs those sends (the hang measured on an H200). Here
        each node greets its children first, then its parent (no cycle in a tree); a parent sends then receives, a
        child receives then sends, so the two ends' messages pair in order."""
        x = torch.zeros(1, dtype=tensor.dtype, device=tensor.device)
        y = torch.empty_like(x)
        for j, (parent, kids) in enumerate(self._roles):
            for g in (self._up_pgs[j], self._down_pgs[j]):
                for c in kids:
                    dist.isend(x, dst=c, tag=_CONNECT_TAG, group=g).wait()
                    dist.irecv(y, src=c, tag=_CONNECT_TAG, group=g).wait()
                if parent is not None and parent >= 0:
                    dist.irecv(y, src=parent, tag=_CONNECT_TAG, group=g).wait()
                    dist.isend(x, dst=parent, tag=_CONNECT_TAG, group=g).wait()
        self._connected = True

    def _tree(self, tensor: torch.Tensor, block: int | None = None) -> None:
        """The PS-rooted two-level tree(s), pipelined per chunk (the paper's per-segment pipelining, Sec. 3.3): a node
        adds chunk k of all its children as soon as they are in and sends it up at once, and relays the parent's
        result for chunk k down as soon as it arrives, so sending up and down overlap (full duplex). With q PSs
        (Sec. 7, digest §2.9) each chunk belongs to one PS's part: an aggregator sends it to that PS, which adds it
        over all aggregators and sends it back, so the q PSs' links carry their parts at the same time. Children are
        added in plan order (a node's members, then, at a PS, the other aggregators), so every run adds in the same
        order; with one PS this is exactly the single tree. With ``block`` (reduce-scatter) each message down carries
        only the piece's overlap with the span its receiver needs (:meth:`_span`); empty overlaps are not sent, and
        both ends skip the same ones."""
        flat = tensor.view(-1)
        pieces = self._pieces(flat)
        start = [(x.data_ptr() - flat.data_ptr()) // flat.element_size() for x, _ in pieces]

        def cut(k: int, global_rank: int) -> tuple[int, int]:
            """Piece k's overlap with what ``global_rank`` needs back, relative to the piece (empty: a >= b)."""
            lo, hi = self._span(global_rank, block, flat.numel())
            a, b = max(lo - start[k], 0), min(hi - start[k], pieces[k][0].numel())
            return a, max(a, b)

        me, dedicated = self.me, self._dedicated
        if not self._connected:
            self._connect(tensor)
        roles = [self._roles[j] for _, j in pieces]
        parent = [r[0] for r in roles]
        kids = [r[1] for r in roles]
        mine = [x for x, _ in pieces]
        up = [self._up_pgs[j] for _, j in pieces]
        down = [self._down_pgs[j] for _, j in pieces]
        bufs = [[torch.empty_like(mine[k]) for _ in kids[k]] for k in range(len(pieces))]
        ups = [
            [dist.irecv(b, src=c, tag=k, group=up[k]) for b, c in zip(bufs[k], kids[k], strict=True)]
            for k in range(len(pieces))
        ]
        below = [k for k, q in enumerate(parent) if q is not None and q >= 0]
        out = {k: torch.empty_like(mine[k]) for k in below}
        here = {k: cut(k, self.ranks[me]) for k in below}
        downs = {
            k: dist.irecv(out[k][a:b], src=parent[k], tag=k, group=down[k])
            for k, (a, b) in here.items()
            if a < b
        }
        # what goes down for piece k: the sum computed here (at k's PS), or the parent's result relayed to the members
        down_to = {k: kids[k] for k in range(len(pieces)) if kids[k] and (parent[k] is None or k in below)}
        summed = {k: threading.Event() for k in down_to if parent[k] is None}
        sends: list[Any] = []
        relay_sends: list[Any] = []
        errors: list[BaseException] = []
        failed = threading.Event()
        # CUDA: the relay waits and sends on a stream of its own (its stream-ordered waits for results must not hold up
        # the caller's sums, which those results depend on); a sum it sends is ordered by an event after it
        cuda = tensor.is_cuda
        caller = torch.cuda.current_stream(tensor.device) if cuda else None
        relay_stream = torch.cuda.Stream(tensor.device) if cuda and down_to else None
        ready = {k: torch.cuda.Event() for k in summed} if cuda else {}

        def relay() -> None:
            """Every send down, from one thread, in piece order. The receivers post their receives in piece order, and
            a backend that matches point-to-point messages by order per pair of ranks, not by tag (NCCL), needs the
            sends in that order too."""
            try:
                with (
                    torch.cuda.stream(relay_stream) if relay_stream is not None else contextlib.nullcontext()
                ):
                    for k, dst in down_to.items():
                        if k in summed:
                            summed[k].wait()
                            if failed.is_set():
                                return
                            if k in ready:
                                relay_stream.wait_event(ready[k])  # type: ignore[union-attr]
                        elif k in downs:
                            downs[k].wait()  # gloo's wait releases the GIL; NCCL's orders the stream after it
                        x = mine[k] if k in summed else out[k]
                        for c in dst:  # (a child's span lies within this node's: nothing missing is relayed)
                            a, b = cut(k, c)
                            if a < b:
                                relay_sends.append(dist.isend(x[a:b], dst=c, tag=k, group=down[k]))
            except BaseException as e:  # re-raised by the caller after join
                errors.append(e)

        # (a gloo Work reports completion only once waited on, so the two directions get a thread each, not a poll)
        relayer = threading.Thread(target=relay, name="aleph-relay", daemon=True) if down_to else None
        if relayer is not None:
            relayer.start()
        try:
            for k in range(len(pieces)):  # partial sums up, chunk by chunk
                if parent[k] == -1:
                    continue
                if parent[k] is None and me in dedicated:
                    mine[k].zero_()  # a dedicated PS's own tensor is not part of the sum
                for u, b in zip(ups[k], bufs[k], strict=True):
                    u.wait()
                    mine[k].add_(b)
                if parent[k] is None:
                    if k in summed:
                        if k in ready:
                            ready[k].record(caller)
                        summed[k].set()
                else:
                    sends.append(dist.isend(mine[k], dst=parent[k], tag=k, group=up[k]))
        except BaseException:
            failed.set()
            raise
        finally:
            for e in summed.values():
                e.set()  # a relay waiting for a sum that will not come ends (the error is the caller's)
            if relayer is not None:
                relayer.join()
        if errors:
            raise errors[0]
        if relay_stream is not None:
            caller.wait_stream(relay_stream)  # type: ignore[union-attr]  # its received results, before reading them
        # those the relay passed on it waited for (a gloo Work is waited for once only)
        for k, d in downs.items():
            if k not in down_to:
                d.wait()
        for w in sends + relay_sends:
            w.wait()
        for k, q in enumerate(parent):
            if q == -1:
                mine[k].zero_()
            elif q is not None:
                a, b = here[k]
                mine[k][a:b].copy_(out[k][a:b])

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

    def _scatter(self, tensor: torch.Tensor, root: int, others: list[int], block: int | None = None) -> None:
        """Star: ``root`` sends the sum to every rank in ``others`` (the Gradient Forwarder's multicast, Sec. 5.4);
        with ``block`` (reduce-scatter) each gets only its own block."""
        me, flat = dist.get_rank(), tensor.view(-1)

        def part(r: int) -> torch.Tensor:
            a, b = self._span(r, block, flat.numel())
            return flat[a:b]

        if me == root:
            for w in [dist.isend(part(o), dst=o) for o in others]:
                w.wait()
        elif me in others:
            dist.irecv(part(me), src=root).wait()


class ReplanningAllReduce:
    """A :class:`HierarchicalAllReduce` that re-plans when measured bandwidth drifts (digest §5.1 #13, E10). Call it
    like the hierarchy; :meth:`end_iteration` (the DDP hook calls it after an iteration's last bucket, the same
    program point on every rank) counts iterations, and at the replanner's due ones probes the group (``probe()``:
    one Gbit/s figure per group rank, the same on every rank) and, when :meth:`flowlane.aleph.Replanner.observe`
    changes the plan, builds a new hierarchy over the same up/down groups (``top="ps"``, one PS: a new plan's PS is
    :func:`flowlane.aleph.model.ps_head` of it under the replanner's figures). ``decisions``: (iteration, changed,
    reason, |D|) of every re-planning point."""

    def __init__(self, har: HierarchicalAllReduce, replanner: Any, probe: Any) -> None:
        if har.top != "ps" or len(har.ps) != 1 or har.dedicated_ps:
            raise ValueError(
                f"re-planning needs top='ps' with one PS (its groups serve any plan), not top={har.top!r} with PSs "
                f"{list(har.ps)}"
            )
        if replanner.plan != har.plan:
            raise ValueError(
                "re-planning: the hierarchy must start from the replanner's plan (replanner.plan)"
            )
        self.har, self.replanner, self.probe = har, replanner, probe
        self.iteration = 0
        self.decisions: list[tuple[int, bool, str, int]] = []

    @property
    def ranks(self) -> list[int]:
        return self.har.ranks

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.har(tensor)

    def reduce_scatter(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.har.reduce_scatter(tensor)

    def end_iteration(self) -> None:
        self.iteration += 1
        if not self.replanner.due(self.iteration):
            return
        d = self.replanner.observe(self.probe())
        if d.changed:
            h = self.har
            ps = (ps_head(d.plan, self.replanner.bandwidth),)  # the figures in use: the same on every rank
            self.har = HierarchicalAllReduce(
                d.plan, h.group, "ps", h.chunk_bytes, ps=ps, p2p_groups=(h._up_pgs, h._down_pgs)
            )
        self.decisions.append((self.iteration, d.changed, d.reason, d.plan.num_flows))
        log.info("ALEPH re-planning at iteration %d: %s", self.iteration, d.reason)


def aleph_comm_hook(
    state: "HierarchicalAllReduce", bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: the bucket's mean over the group through the plan's hierarchy, scaled by 1/size first (no ``from __future__ import
    annotations`` in this module: DDP checks that ``bucket`` is annotated with the class itself)."""
    buf = bucket.buffer()
    # DDP's built-in reducer scales by 1/size before the sum: bitwise at any size
    buf.mul_(1.0 / len(state.ranks))
    state(buf)
    if bucket.is_last() and isinstance(state, ReplanningAllReduce):
        state.end_iteration()  # every rank reduces the iteration's buckets in one order: the same point everywhere
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(buf)
    return fut


def install_aleph_hook(
    model: torch.nn.parallel.DistributedDataParallel,
    plan: Plan,
    top: str = "allreduce",
    chunk_bytes: int = 256 << 10,
    dataplane: str = "torch",
    *,
    ps: Sequence[int] | None = None,
    split: Sequence[float] | str | None = None,
    ps_bandwidths: Sequence[float] | None = None,
    dedicated_ps: bool = False,
    replanner: Any = None,
    probe: Any = None,
    **udp_options: Any,
) -> Any:
    """Register the ALEPH hook on a DDP model (its process group); returns the hook's state. ``dataplane``: "torch"
    (tier 0, :class:`HierarchicalAllReduce`; ``ps``, ``split``, ``ps_bandwidths``: its several PSs) or "udp" (tier 1,
    :class:`flowlane.aleph.udp_allreduce.UdpAllReduce`, PS-rooted; ``udp_options`` go to it, and so do ``ps``,
    ``split`` and ``ps_bandwidths``; ``top`` and ``chunk_bytes`` do not apply). ``dedicated_ps=True`` is refused: every
    DDP rank is a trainer, and a dedicated PS is left out of the sum.
    ``replanner`` (a :class:`flowlane.aleph.Replanner` whose plan is ``plan``; torch tier, ``top="ps"``, one PS):
    re-plan after every ``replan_every``-th iteration's last bucket from ``probe()`` (default:
    :func:`flowlane.aleph.probe.probe_bandwidth` over the model's group, probed a second time where the first
    moves a worker, :func:`flowlane.aleph.replan.confirmed_probe`; gloo only: refused on another backend), see
    :class:`ReplanningAllReduce`. With a ``replanner`` and no ``ps``, the PS is
    :func:`flowlane.aleph.model.ps_head` under its figures."""
    if dataplane not in ("torch", "udp"):
        raise ValueError(f"dataplane={dataplane!r} is not one of ('torch', 'udp')")
    if dedicated_ps:
        # a dedicated PS is a server outside the sum, not a DDP trainer: DDP on it would apply a gradient it did not
        # help make, and the hook's 1/size would count it (3 ranks, one dedicated: every rank got 5/3, not 5/2)
        raise ValueError(
            "install_aleph_hook: dedicated_ps=True is not allowed (a dedicated PS is no DDP trainer); use "
            "dedicated_ps=False, or HierarchicalAllReduce(..., dedicated_ps=True) directly outside DDP"
        )
    multi = {"ps": ps, "split": split, "ps_bandwidths": ps_bandwidths}
    if dataplane == "udp" and replanner is not None:
        raise ValueError("replanner applies to dataplane='torch' only")
    if dataplane == "torch" and udp_options:
        raise ValueError(f"{sorted(udp_options)} apply to dataplane='udp' only")
    group = getattr(model, "process_group", None)
    # the default probe runs on gloo only: refused before anything is made
    if replanner is not None and probe is None:
        from flowlane.aleph.probe import check_probe_backend

        check_probe_backend(group, "install_aleph_hook(replanner=...)")
    if not isinstance(model, torch.nn.parallel.DistributedDataParallel):
        raise TypeError(
            f"install_aleph_hook needs a torch DistributedDataParallel model, got {type(model).__name__}"
        )
    if dataplane == "udp":
        from flowlane.aleph.udp_allreduce import UdpAllReduce

        state: Any = UdpAllReduce(plan, group, ps=ps, split=split, ps_bandwidths=ps_bandwidths, **udp_options)
    else:
        # figures known: the PS on the head they favour
        if replanner is not None and top == "ps" and ps is None:
            multi["ps"] = (ps_head(plan, replanner.bandwidth),)
        state = HierarchicalAllReduce(plan, group, top, chunk_bytes, **multi)
        if replanner is not None:
            from flowlane.aleph.replan import confirmed_probe

            # the real probe's figures are confirmed by a second probe where they move a worker (E10: one slow probe
            # on a loaded host re-planned for nothing); a caller's own probe is used as it is
            figures = probe or confirmed_probe(replanner, group)
            state = ReplanningAllReduce(state, replanner, figures)
    model.register_comm_hook(state, aleph_comm_hook)
    return state
