"""The enforcer (seed 004 §5.2, Pseudocode 2): every rank launches the plan's motifs in one order.

The application submits comm-ops as usual, in its own (FIFO) order, through :class:`Enforcer`'s ``all_reduce``,
``all_to_all_single``, ``all_gather_into_tensor`` and ``reduce_scatter_tensor``. The enforcer matches the i-th
submission of the iteration to the plan's i-th op by signature (kind, element count, dtype; digest §5 item 8), cuts
it into motifs, and launches motifs strictly in the plan's sequence: motif ``k`` goes out once it and every motif
before it have been submitted.

* **Where launches happen.** The paper's progress thread busy-waits for the next sequence number. Here a motif is
  launched by the thread whose submission makes it launchable, at that program point: the same order, with no
  thread whose timing could change anything. The time a motif waits for an earlier one is recorded (``held_s``).
* **FIFO fallback.** A submission that does not match the plan (a new op, a dynamic shape), or a ``wait()`` on an op
  whose motifs sit behind an op not yet submitted (a host wait point the plan did not know: digest §5 item 9),
  switches the rest of the iteration to FIFO: the motifs already submitted go out in submission order, then every
  later op whole. Both triggers are program points, so every rank of an SPMD program falls back at the same one.
* **Watchdog.** :meth:`Enforcer.install` compares the plan's digest on every rank and raises
  :class:`PlanMismatchError` naming the ranks that differ; :meth:`Enforcer.step` (the iteration boundary) compares a
  fingerprint of the iteration's launch sequence, so a rank that launched another order (which gloo may run
  *silently* when two ops have one size) is named too; a rank that never arrives is named by the timeout.
* **Paths.** Each plan path maps to a process group (gloo: one group per path, e.g. per netns interface; NCCL: a
  communicator per path/traffic class, :mod:`flowlane.sched.groups`). Motifs of different paths overlap.
* **Replanning.** With ``replanner`` (rank 0 runs it; :class:`flowlane.syndicate.replan.SearchReplanner`), a fired
  ``trigger`` starts the search in a thread; its plan is proposed at the next boundary through ``channel`` (two-phase
  commit) and every rank switches two boundaries later, or none does.
* **Profile** (FIFO mode; digest §7 "comm-op trace to training DAG"). The enforcer records one steady iteration
  (``EnforcerConfig.profile_iteration``, the second by default) for the search to plan from: each op's signature,
  group ranks, submission time and completion time, and the iteration's length; :meth:`Enforcer.profile` returns it
  as JSON-ready data (:data:`PROFILE_FORMAT`, below). Only host clocks are read and only that iteration's ops are
  kept: nothing is launched otherwise, no sync is added, and memory stays bounded however long the job runs.
* **With Hermod.** :func:`shape_for_hermod` hands one op's motifs to Hermod's
  :class:`~flowlane.sched.CommScheduler` as its chunks: Hermod orders the coflows, SYNDICATE shapes them.

Refused at install, never silently skipped: algorithms the backend cannot be told to use (``tree``, ``rs_ag``:
gloo and torch expose no per-call algorithm), and paths with no process group.
"""

from __future__ import annotations

import copy
import hashlib
import logging
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.distributed as dist

from flowlane.syndicate.motif import Motif
from flowlane.syndicate.plan import (
    PlanChannel,
    PlanError,
    PlanOp,
    ReplanTrigger,
    Store,
    SyndicatePlan,
    disagreeing,
    exchange,
)

log = logging.getLogger("flowlane.syndicate")

#: Option algorithms the enforcer runs: the backend's own collective (ring) or one message per destination (direct).
RUNNABLE_ALGOS: tuple[str, ...] = ("ring", "direct")
_KINDS = ("all_reduce", "all_to_all", "all_gather", "reduce_scatter")

#: The ``format`` of :meth:`Enforcer.profile`'s dict (the input of the plan search; bump on a change of fields)::
#:
#:     {"format": "flowlane.syndicate.profile/1", "iteration": int, "iteration_s": float,
#:      "ranks": [int, ...],  # global ranks of the enforcer's group
#:      "ops": [{"kind": str, "numel": int, "dtype": str, "ranks": [int, ...],
#:               "submit_s": float, "done_s": float | None}, ...]}  # in submission order
PROFILE_FORMAT = "flowlane.syndicate.profile/1"

#: The optimizer's replanning entry: (plan in force, the enforcer's stats rows) -> a newer plan, or None to keep it
#: (:class:`flowlane.syndicate.replan.SearchReplanner` re-runs the joint search).
Replanner = Callable[[SyndicatePlan | None, Sequence[tuple[int, float, float]]], SyndicatePlan | None]


def check_dp_gradient_plan(
    plan: SyndicatePlan,
    dp_size: int,
    framework: str,
    serial_why: str | None = None,
    kind: str = "all_reduce",
    gather_why: str | None = None,
) -> None:
    """Refuse, naming the op, a plan that a framework's data-parallel gradient path cannot run: an op of another
    kind than ``kind`` (``framework`` submits only its buckets' all-reduces there, or reduce-scatters with a
    distributed optimizer), an op spanning another number of ranks than ``dp_size``, an algorithm the enforcer
    cannot force per call (:data:`RUNNABLE_ALGOS`), and, where the framework waits for each op before it submits the
    next (``serial_why`` says why), an order that launches an op's motif before the previous op's last one.

    ``gather_why`` (a distributed optimizer whose parameter all-gathers are plan ops; it says why they are serial):
    the plan's first ops may be ``all_gather`` ops (the parameters are gathered in the forward, before the backward
    reduces the gradients), and each one's motifs must all launch before any later op's (the framework waits for
    each gather before it submits the next op): only their order within the op is free."""
    what = {"all_reduce": "all-reduces", "reduce_scatter": "reduce-scatters"}[kind]
    gathers = 0
    for i, op in enumerate(plan.ops):
        if gather_why is not None and op.kind == "all_gather":
            if gathers != i:
                raise PlanError(
                    f"plan v{plan.version} op {i} ({op.name!r}) is an all-gather after op {i - 1} "
                    f"({plan.ops[i - 1].name!r}, {plan.ops[i - 1].kind!r}): {framework} gathers the parameters "
                    f"(forward) before it reduces the gradients (backward), so the all-gathers are the plan's "
                    f"first ops"
                )
            gathers += 1
        elif op.kind != kind:
            also = " and its parameters' all-gathers" if gather_why is not None else ""
            raise PlanError(
                f"plan v{plan.version} op {i} ({op.name!r}) is {op.kind!r}: {framework} submits only its "
                f"gradient buckets' {what}{also} here"
            )
        if op.ranks != dp_size:
            raise PlanError(
                f"plan v{plan.version} op {i} ({op.name!r}) spans {op.ranks} ranks; {framework}'s data-parallel "
                f"group has {dp_size}"
            )
        if op.option.algo not in RUNNABLE_ALGOS:
            raise PlanError(
                f"plan v{plan.version} op {i} ({op.name!r}): algorithm {op.option.algo!r} cannot be forced per "
                f"call on torch.distributed; runnable: {RUNNABLE_ALGOS}"
            )
    ops_in_order = [i for i, _ in plan.order]
    for i in range(gathers):
        last = max(k for k, o in enumerate(ops_in_order) if o == i)
        later = next((o for o in ops_in_order[:last] if o > i), None)
        if later is not None:
            raise PlanError(
                f"plan v{plan.version} launches op {later} ({plan.ops[later].name!r}) before the last motif of "
                f"all-gather op {i} ({plan.ops[i].name!r}), but {gather_why}, so an all-gather's motifs must all "
                "go before any later op's (reorder motifs within it only)"
            )
    if serial_why and ops_in_order != sorted(ops_in_order):
        k = next(k for k in range(1, len(ops_in_order)) if ops_in_order[k] < ops_in_order[k - 1])
        raise PlanError(
            f"plan v{plan.version} launches op {ops_in_order[k]} after op {ops_in_order[k - 1]} has started, "
            f"but {serial_why}, so ops must go in submission order (reorder motifs within an op only)"
        )


class PlanMismatchError(PlanError):
    """Ranks hold different plans or launched different sequences; the message names them."""


@dataclass
class EnforcerConfig:
    """Knobs of :class:`Enforcer`."""

    mode: Literal["plan", "fifo"] = "plan"
    """``plan``: launch in the plan's order; ``fifo``: every op whole, at submission (the baseline)."""
    check_every: int = 1
    """Compare launch fingerprints across ranks every this many iterations (0: never)."""
    timeout_s: float = 60.0
    """How long install/step wait for the other ranks before naming the missing ones."""
    namespace: str = "syndicate"
    """Store key prefix (one per enforcer sharing a store)."""
    log_entries: int = 4096
    """How many launches :attr:`Enforcer.log` keeps, the latest (0: none); the watchdog does not read it."""
    stats_entries: int = 4096
    """How many iterations' rows :attr:`Enforcer.stats` keeps, the latest (0: none): the replanner's feedback."""
    profile_iteration: int | None = 1
    """FIFO mode: the iteration :meth:`Enforcer.profile` records (counted from 0 by ``step()``); -1 or None: none.
    The second by default: in Megatron's first iteration ``finish_grad_sync`` starts and waits for each bucket
    group in turn, which is not the steady state."""

    def __post_init__(self) -> None:
        if self.mode not in ("plan", "fifo"):
            raise ValueError(f"EnforcerConfig.mode {self.mode!r} is not one of ['fifo', 'plan']")
        if not isinstance(self.check_every, int) or self.check_every < 0:
            raise ValueError(f"EnforcerConfig.check_every must be an integer >= 0, got {self.check_every!r}")
        if not self.timeout_s > 0:
            raise ValueError(f"EnforcerConfig.timeout_s must be > 0, got {self.timeout_s!r}")
        if not isinstance(self.log_entries, int) or self.log_entries < 0:
            raise ValueError(f"EnforcerConfig.log_entries must be an integer >= 0, got {self.log_entries!r}")
        if not isinstance(self.stats_entries, int) or self.stats_entries < 0:
            raise ValueError(
                f"EnforcerConfig.stats_entries must be an integer >= 0, got {self.stats_entries!r}"
            )
        p = self.profile_iteration
        if p is not None and (not isinstance(p, int) or isinstance(p, bool) or p < -1):
            raise ValueError(
                f"EnforcerConfig.profile_iteration must be an integer >= -1 (-1: no profile) or None, got {p!r}"
            )

    @property
    def profiled_iteration(self) -> int | None:
        """The iteration :meth:`Enforcer.profile` records: ``profile_iteration`` in FIFO mode, else None."""
        p = self.profile_iteration
        return p if self.mode == "fifo" and p is not None and p >= 0 else None

    def why_nothing_recorded(self) -> str:
        """Why this config records no profile ('' when it records one): what a profile path next to it is refused
        with (the plugins name their own keys)."""
        if self.mode != "fifo":
            return "only FIFO mode records a profile"
        if self.profiled_iteration is None:
            return f"profile_iteration {self.profile_iteration} records nothing"
        return ""


def _dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


@dataclass
class _MotifRun:
    """One motif ready to go: ``launch`` returns works; ``repack`` copies results into the op's output."""

    launch: Callable[[], list[Any]]
    repack: Callable[[], None] | None = None
    works: list[Any] = field(default_factory=list)
    launched: bool = False
    submitted_at: float = 0.0


def motif_runs(
    kind: str,
    motifs: list[Motif],
    out: torch.Tensor,
    inp: torch.Tensor,
    group: Any,
    rank: int,
    world: int,
    tag_base: int,
) -> list[_MotifRun]:
    """Closures that run ``motifs`` of one op on ``group``: segments as the backend's own collective on a slice,
    splined motifs as isend/irecv to destinations ``(rank + t) % world`` (rule R2). Results equal the whole op's."""
    es = inp.element_size()
    if kind == "reduce_scatter":
        return _reduce_scatter_runs(motifs, out, inp, group, world)
    runs: list[_MotifRun] = []
    if kind != "all_reduce":  # the per-destination (all-to-all) or per-source (all-gather) block views
        src = inp.view(world, -1) if kind == "all_to_all" else inp.view(1, -1)
        dst = out.view(world, -1)
    for m in motifs:
        a, b = m.lo // es, m.hi // es
        full = len(m.dests) == world
        tag = tag_base + m.index
        if kind == "all_reduce":
            flat = out.view(-1)
            runs.append(_MotifRun(lambda s=flat[a:b]: [dist.all_reduce(s, group=group, async_op=True)]))
            continue
        if full and (a, b) == (0, src.shape[1]):  # the whole op: the backend's collective, no copies
            fn = dist.all_to_all_single if kind == "all_to_all" else dist.all_gather_into_tensor
            runs.append(_MotifRun(lambda fn=fn: [fn(out, inp, group=group, async_op=True)]))
        elif full:
            seg_in = torch.empty((src.shape[0], b - a), dtype=inp.dtype, device=inp.device)
            seg_out = torch.empty((world, b - a), dtype=out.dtype, device=out.device)

            def launch(seg_in=seg_in, seg_out=seg_out, a=a, b=b, kind=kind) -> list[Any]:
                seg_in.copy_(src[:, a:b])
                fn = dist.all_to_all_single if kind == "all_to_all" else dist.all_gather_into_tensor
                return [
                    fn(
                        seg_out.view(-1) if kind == "all_gather" else seg_out,
                        seg_in.view(-1) if kind == "all_gather" else seg_in,
                        group=group,
                        async_op=True,
                    )
                ]

            runs.append(_MotifRun(launch, lambda seg_out=seg_out, a=a, b=b: dst[:, a:b].copy_(seg_out)))
        else:
            recv_bufs: list[tuple[int, torch.Tensor]] = []

            def launch(m=m, a=a, b=b, tag=tag, recv_bufs=recv_bufs) -> list[Any]:
                ops = []
                for t in m.dests:
                    to, frm = (rank + t) % world, (rank - t) % world
                    row = to if kind == "all_to_all" else 0
                    if t == 0:
                        dst[rank, a:b].copy_(src[row if kind == "all_to_all" else 0, a:b])
                        continue
                    buf = torch.empty(b - a, dtype=out.dtype, device=out.device)
                    recv_bufs.append((frm, buf))
                    ops.append(dist.P2POp(dist.isend, src[row, a:b].contiguous(), to, group, tag))
                    ops.append(dist.P2POp(dist.irecv, buf, frm, group, tag))
                return list(dist.batch_isend_irecv(ops)) if ops else []

            def repack(a=a, b=b, recv_bufs=recv_bufs) -> None:
                for frm, buf in recv_bufs:
                    dst[frm, a:b].copy_(buf)
                recv_bufs.clear()

            runs.append(_MotifRun(launch, repack))
    return runs


def _reduce_scatter_runs(
    motifs: list[Motif], out: torch.Tensor, inp: torch.Tensor, group: Any, world: int
) -> list[_MotifRun]:
    """A reduce-scatter's segments: motif ``[lo, hi)`` (bytes of the output block) reduce-scatters those columns of
    every rank's block (copied together at launch, so ``out`` may be a view of ``inp``, as Megatron's shard is)."""
    es, blk = inp.element_size(), out.numel()
    src, flat = inp.view(world, blk), out.view(-1)
    runs: list[_MotifRun] = []
    for m in motifs:
        a, b = m.lo // es, m.hi // es
        if (a, b) == (0, blk):  # the whole op: the backend's collective, no copies
            runs.append(_MotifRun(lambda: [dist.reduce_scatter_tensor(out, inp, group=group, async_op=True)]))
            continue
        seg_in = torch.empty((world, b - a), dtype=inp.dtype, device=inp.device)

        def launch(seg_in: torch.Tensor = seg_in, a: int = a, b: int = b) -> list[Any]:
            seg_in.copy_(src[:, a:b])
            return [dist.reduce_scatter_tensor(flat[a:b], seg_in.view(-1), group=group, async_op=True)]

        runs.append(_MotifRun(launch))
    return runs


class Handle:
    """Returned by a submission; ``wait()`` completes the op (launching held motifs if it must)."""

    def __init__(self, enf: Enforcer, index: int, runs: list[_MotifRun], iteration: int) -> None:
        self._enf, self._index, self._runs, self._iteration = enf, index, runs, iteration
        self._done = False

    def wait(self) -> bool:
        if self._done:
            return True
        if any(not r.launched for r in self._runs):
            self._enf._blocked_wait(self._index, self._iteration)
        for r in self._runs:
            for w in r.works:
                w.wait()
            if r.repack is not None:
                r.repack()
        self._done = True
        self._enf._op_done(self._index, self._iteration)
        return True

    def is_completed(self) -> bool:
        return self._done


class Enforcer:
    """Per-rank enforcer (see the module docstring). ``paths``: plan path name -> process group (None: WORLD).
    ``store``: a key-value store every rank shares (``TCPStore``), for the watchdog and plan switches."""

    def __init__(
        self,
        paths: Mapping[str, Any],
        store: Store,
        rank: int | None = None,
        world: int | None = None,
        config: EnforcerConfig | None = None,
        channel: PlanChannel | None = None,
        trigger: ReplanTrigger | None = None,
        replanner: Replanner | None = None,
    ) -> None:
        self.config = config or EnforcerConfig()
        if replanner is not None and (channel is None or trigger is None):
            raise ValueError("Enforcer: a replanner needs a channel (to distribute its plans) and a trigger")
        self.paths = dict(paths)
        self.store = store
        self.rank = dist.get_rank() if rank is None else rank
        self.world = dist.get_world_size() if world is None else world
        self.channel = channel
        self.plan: SyndicatePlan | None = None
        self.iteration = 0
        self.log: deque[tuple[int, int, int, int]] = deque(maxlen=self.config.log_entries)
        """(iteration, launch position, op submission index, motif index) of the last ``config.log_entries``
        launches (bounded: a long job would otherwise keep every launch)."""
        self.events: list[tuple[int, str, str]] = []
        """(iteration, event, detail): "fallback", "switch"."""
        self._warned: set[str] = set()  # the fallback reasons logged as a warning (each once)
        self.held_s = 0.0
        """Seconds motifs waited, after submission, for an earlier motif of the order (the busy-wait)."""
        self.trigger = trigger
        self.replanner = replanner
        """Coordinator rank only (rank 0): re-runs the search when ``trigger`` fires, out of band (a thread); the
        plan it returns is proposed through ``channel`` at the next boundary and switched to two boundaries later."""
        self._search: Future[SyndicatePlan | None] | None = None
        self._proposed: tuple[int, int] | None = None  # (version, switch iteration) awaiting the decision
        self._pool: ThreadPoolExecutor | None = None
        self.stats: deque[tuple[int, float, float]] = deque(maxlen=self.config.stats_entries)
        """(iteration, held seconds, wall seconds since the previous boundary) of the last ``config.stats_entries``
        iterations: the feedback the optimizer pulls (seed 004 §5.1 interface C); ``trigger`` turns it into "replan"
        events. Bounded (a long job would otherwise keep a row per step); ``held_s`` and ``iteration`` are the
        totals. A deque: ``list()`` it to serialise."""
        self._held_at_start = 0.0
        self._t_start = time.perf_counter()
        # the profile (FIFO mode): the iteration it records, that iteration's start (the return of the step() that
        # opened it; iteration 0: its first submission), its rows while it runs, then the finished dict
        self._profile_at = self.config.profiled_iteration
        self._t_iteration: float | None = None
        self._profile_ops: list[dict[str, Any]] | None = None
        self._profile: dict[str, Any] | None = None
        self._verifies = 0
        # this rank's last fingerprint key, deleted once every rank is past it
        self._fp_key: str | None = None
        self._reset_iteration()

    # -- plan ---------------------------------------------------------------------------------------------------
    def install(self, plan: SyndicatePlan | None, verify: bool = True) -> None:
        """Use ``plan`` from the next iteration boundary (now, if none has started). Refuses what cannot run;
        with ``verify`` every rank must call it and all must hold the same digest."""
        if plan is not None:
            for i, op in enumerate(plan.ops):
                if op.kind not in _KINDS:
                    raise PlanError(
                        f"plan v{plan.version} op {i} ({op.name!r}): the enforcer runs {_KINDS}, "
                        f"not {op.kind!r}"
                    )
                if op.option.algo not in RUNNABLE_ALGOS:
                    raise PlanError(
                        f"plan v{plan.version} op {i} ({op.name!r}): algorithm {op.option.algo!r} "
                        f"cannot be forced per call on torch.distributed; runnable: {RUNNABLE_ALGOS}"
                    )
                if op.option.path not in self.paths:
                    raise PlanError(
                        f"plan v{plan.version} op {i} ({op.name!r}): path {op.option.path!r} has no "
                        f"process group; paths: {sorted(self.paths)}"
                    )
                if op.ranks != self.world:
                    raise PlanError(
                        f"plan v{plan.version} op {i} ({op.name!r}) spans {op.ranks} ranks; this "
                        f"enforcer's paths span {self.world}"
                    )
        if verify:
            self._verifies += 1
            digest = plan.digest() if plan is not None else "none"
            got = exchange(
                self.store,
                self.rank,
                self.world,
                f"{self.config.namespace}/install/{self._verifies}",
                digest,
                self.config.timeout_s,
            )
            diff = disagreeing(got)
            if diff:
                raise PlanMismatchError(f"plan mismatch at install {self._verifies}: {diff}")
        self.plan = plan
        if self._sub == 0:  # nothing submitted this iteration yet: the plan applies from now
            self._reset_iteration()

    # -- submissions ----------------------------------------------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor) -> Handle:
        """In-place SUM all-reduce of a contiguous tensor."""
        return self._submit("all_reduce", tensor, tensor)

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor) -> Handle:
        """Equal-split all-to-all: block r of ``input`` goes to rank r."""
        if input.numel() % self.world or output.numel() != input.numel():
            raise ValueError(
                f"all_to_all_single: {input.numel()} input / {output.numel()} output elements must be "
                f"equal and split into {self.world} blocks"
            )
        return self._submit("all_to_all", output, input)

    def all_gather_into_tensor(self, output: torch.Tensor, input: torch.Tensor) -> Handle:
        if output.numel() != input.numel() * self.world:
            raise ValueError(
                f"all_gather_into_tensor: output has {output.numel()} elements, needs "
                f"{self.world} x {input.numel()}"
            )
        return self._submit("all_gather", output, input)

    def reduce_scatter_tensor(self, output: torch.Tensor, input: torch.Tensor) -> Handle:
        """SUM reduce-scatter: ``output`` gets this rank's block of the sum of ``input`` (``world`` equal blocks;
        ``output`` may be a view of that block). Its signature's element count is the block's (the IR's payload)."""
        if input.numel() != output.numel() * self.world:
            raise ValueError(
                f"reduce_scatter_tensor: input has {input.numel()} elements, needs {self.world} x "
                f"{output.numel()} (the output's)"
            )
        return self._submit("reduce_scatter", output, input)

    def step(self) -> None:
        """The iteration boundary: launch what is left, compare fingerprints, take up a committed plan."""
        if self.iteration == self._profile_at:
            self._finish_profile(time.perf_counter())
        if self._pending:
            self._fallback("the iteration ended before the plan's remaining ops were submitted")
        it = self.iteration
        every = self.config.check_every
        if every and it % every == 0:
            # this iteration's launches only (scanning a log of every launch made each step slower: 0.9 ms at
            # iteration 0, 23 ms at 4000)
            fp = hashlib.sha256(repr(self._launches).encode()).hexdigest()
            key = f"{self.config.namespace}/fp/{it}"
            got = exchange(self.store, self.rank, self.world, key, fp, self.config.timeout_s)
            diff = disagreeing(got)
            if diff:
                raise PlanMismatchError(f"iteration {it}: ranks launched different motif sequences: {diff}")
            # every rank has published this fingerprint, so every rank has read the previous one: this rank's
            # previous key goes, and the store holds at most two fingerprints per rank however long the job runs
            if self._fp_key is not None:
                self.store.delete_key(self._fp_key)
            self._fp_key = f"{key}/{self.rank}"
        now = time.perf_counter()
        held, wall = self.held_s - self._held_at_start, now - self._t_start
        self.stats.append((it, held, wall))
        self._held_at_start, self._t_start = self.held_s, now
        if self.trigger is not None and self.trigger.observe(it, held, wall):
            self.events.append((it, "replan", f"held {held / wall:.1%} of the iteration"))
            if self._coordinating and self._search is None and self._proposed is None:
                self._pool = self._pool or ThreadPoolExecutor(1, thread_name_prefix="syndicate-replan")
                self._search = self._pool.submit(self.replanner, self.plan, list(self.stats))  # type: ignore[arg-type]
        self.iteration += 1
        if self._coordinating:
            self._coordinate_before_poll()
        if self.channel is not None:
            new = self.channel.poll(self.iteration)
            if new is not None and new is not self.plan:
                self.install(new, verify=False)  # the two-phase commit already compared digests
                self.events.append((self.iteration, "switch", f"v{new.version}"))
        if self._coordinating and self._proposed is not None and self.iteration >= self._proposed[1] - 1:
            # every rank has voted by its poll of this boundary (it saw PREPARE one boundary ago at the latest)
            self.channel.decide(self._proposed[0])  # type: ignore[union-attr]
            self._proposed = None
        self._reset_iteration()
        self._t_iteration = time.perf_counter()  # the next iteration starts as this boundary returns

    def profile(self) -> dict[str, Any] | None:
        """The profile of iteration ``config.profile_iteration`` (FIFO mode), JSON-ready (:data:`PROFILE_FORMAT`);
        None before the ``step()`` that ends that iteration, in plan mode, or with profiling off.

        Times are ``time.perf_counter`` seconds since the iteration's start: the return of the ``step()`` that
        opened it (iteration 0, which no ``step()`` opens: its first submission). ``iteration_s`` is the entry of
        the ``step()`` that ends it. Per op, in submission order: ``kind``, ``numel`` (the plan's signature: a
        reduce-scatter's output block, an all-gather's input block), ``dtype``, ``ranks`` (global ranks of the group
        it ran on), ``submit_s`` (when the application submitted it) and ``done_s``: when its handle's ``wait()``
        returned, its motifs done, or None if nothing waited for it before that ``step()``. Observed at the
        application's wait, ``done_s`` is an upper bound on when the op finished (gloo: ``wait()`` blocks until
        it has); on CUDA (NCCL) ``wait()`` only makes the current stream wait, so ``done_s`` is the host time the
        application reached its wait point, not the op's end: no sync is added to learn more. So
        ``0 <= submit_s <= done_s <= iteration_s``."""
        return copy.deepcopy(self._profile)

    def why_no_profile(self) -> str:
        """Why :meth:`profile` is None, for an error message ('' when there is a profile)."""
        if self._profile is not None:
            return ""
        if why := self.config.why_nothing_recorded():
            return why
        return f"iteration {self._profile_at} (profile_iteration) has not ended; the run is at iteration {self.iteration}"

    @property
    def _coordinating(self) -> bool:
        return self.replanner is not None and self.rank == 0

    def _coordinate_before_poll(self) -> None:
        """Coordinator: a finished search becomes a PREPARE switching at ``iteration + 2``, so a rank that reaches
        this boundary before the proposal exists still sees it at the next one, before the switch."""
        if self._search is None or not self._search.done():
            return
        fut, self._search = self._search, None
        plan = fut.result()  # a search that raised raises here, on the coordinator, naming its error
        if plan is None:
            self.events.append((self.iteration, "replan", "the search kept the plan"))
            return
        if self.plan is not None and plan.version <= self.plan.version:
            raise PlanError(
                f"replanner returned plan v{plan.version}; it must be newer than v{self.plan.version}"
            )
        switch_at = self.iteration + 2
        self.channel.propose(plan, switch_at)  # type: ignore[union-attr]
        self._proposed = (plan.version, switch_at)
        self.events.append((self.iteration, "propose", f"v{plan.version} at {switch_at}"))

    def close(self) -> None:
        """Stop the replanning thread (a search in flight is abandoned)."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    # -- internals ------------------------------------------------------------------------------------------------
    def _reset_iteration(self) -> None:
        self._sub = 0
        self._pos = 0
        self._launched = 0
        self._fifo = self.config.mode == "fifo" or self.plan is None
        self._ready: dict[tuple[int, int], _MotifRun] = {}
        self._pending: list[tuple[int, int]] = []  # submitted, not launched, in submission order
        # (launch position, op, motif) of this iteration: the fingerprint's input
        self._launches: list[tuple[int, int, int]] = []

    def _submit(self, kind: str, out: torch.Tensor, inp: torch.Tensor) -> Handle:
        if not (out.is_contiguous() and inp.is_contiguous()):
            raise ValueError("the enforcer needs contiguous tensors")
        t_submit = time.perf_counter() if self.iteration == self._profile_at else None
        i = self._sub
        self._sub += 1
        numel = out.numel() if kind == "reduce_scatter" else inp.numel()  # the IR's payload (CommOp.nbytes)
        if not self._fifo:
            op = self.plan.ops[i] if self.plan is not None and i < len(self.plan.ops) else None  # type: ignore[union-attr]
            if op is None or (op.kind, op.numel, op.dtype) != (kind, numel, _dtype_name(inp)):
                want = (op.kind, op.numel, op.dtype) if op else "no op"
                self._fallback(f"submission {i} is ({kind}, {numel}, {_dtype_name(inp)}), plan has {want}")
        if self._fifo:
            block = inp.numel() // self.world if kind == "all_to_all" else numel
            motifs = [Motif("op", 0, kind, 0, block * inp.element_size(), tuple(range(self.world)))]
            group = self.paths.get("default", next(iter(self.paths.values()), None))
            if self.plan is not None and i < len(self.plan.ops) and self.plan.ops[i].kind == kind:
                group = self.paths[self.plan.ops[i].option.path]
        else:
            op = self.plan.ops[i]  # type: ignore[union-attr]
            motifs = self.plan.motifs(i)  # type: ignore[union-attr]
            group = self.paths[op.option.path]
        runs = motif_runs(kind, motifs, out, inp, group, self.rank, self.world, tag_base=(i + 1) * 4096)
        now = time.perf_counter()
        for j, r in enumerate(runs):
            r.submitted_at = now
            self._ready[(i, j)] = r
            self._pending.append((i, j))
        if self._fifo:
            self._launch_pending_fifo()
        else:
            self._advance()
        if t_submit is not None:  # after the launch: profiling changes nothing launched, nor when
            self._profile_op(kind, numel, _dtype_name(inp), group, t_submit)
        return Handle(self, i, runs, self.iteration)

    def _launch(self, key: tuple[int, int]) -> None:
        r = self._ready.pop(key)
        self._pending.remove(key)
        self.held_s += time.perf_counter() - r.submitted_at
        r.works = r.launch()
        r.launched = True
        self._launches.append((self._launched, key[0], key[1]))
        self.log.append((self.iteration, self._launched, key[0], key[1]))
        self._launched += 1

    def _advance(self) -> None:
        order = self.plan.order  # type: ignore[union-attr]
        while self._pos < len(order) and order[self._pos] in self._ready:
            self._launch(order[self._pos])
            self._pos += 1

    def _launch_pending_fifo(self) -> None:
        for key in sorted(self._pending):
            self._launch(key)

    def _fallback(self, why: str) -> None:
        if not self._fifo:
            self.events.append((self.iteration, "fallback", why))
            self._fifo = True
            if why not in self._warned:  # a plan that never fits would otherwise run as FIFO unnoticed
                self._warned.add(why)
                log.warning(
                    "flowlane.syndicate: iteration %d runs as FIFO, not the plan: %s (logged once per reason; "
                    "every fallback is in Enforcer.events)",
                    self.iteration,
                    why,
                )
        self._launch_pending_fifo()

    def _profile_op(self, kind: str, numel: int, dtype: str, group: Any, t: float) -> None:
        if self._profile_ops is None:  # the profiled iteration's first submission
            self._profile_ops = []
            if self._t_iteration is None:  # iteration 0: no step() opened it
                self._t_iteration = t
        self._profile_ops.append(
            {
                "kind": kind,
                "numel": numel,
                "dtype": dtype,
                "ranks": _group_ranks(group),
                "submit_s": t - self._t_iteration,  # type: ignore[operator]
                "done_s": None,
            }
        )

    def _op_done(self, index: int, iteration: int) -> None:
        """Op ``index`` of ``iteration`` completed (its handle's ``wait()`` returned): its profile row's ``done_s``."""
        if self._profile_ops is not None and iteration == self.iteration and index < len(self._profile_ops):
            self._profile_ops[index]["done_s"] = time.perf_counter() - self._t_iteration  # type: ignore[operator]

    def _finish_profile(self, t_end: float) -> None:
        t0 = t_end if self._t_iteration is None else self._t_iteration  # iteration 0 without submissions
        self._profile = {
            "format": PROFILE_FORMAT,
            "iteration": self.iteration,
            "iteration_s": t_end - t0,
            "ranks": _group_ranks(self.paths.get("default", next(iter(self.paths.values()), None))),
            "ops": self._profile_ops or [],
        }
        self._profile_ops = None

    def _blocked_wait(self, index: int, iteration: int) -> None:
        if iteration != self.iteration:
            raise PlanError(f"wait() on op {index} of iteration {iteration} after step() ended it unlaunched")
        self._fallback(f"wait() on op {index}, whose motifs wait behind an op not yet submitted")


def _group_ranks(group: Any) -> list[int]:
    """Global ranks of a path's process group (None: the world)."""
    if group is None:
        return list(range(dist.get_world_size()))
    return list(dist.get_process_group_ranks(group))


def shape_for_hermod(
    sched: Any,
    meta: Any,
    op: PlanOp,
    kind: str,
    out: torch.Tensor,
    inp: torch.Tensor,
    group: Any,
    rank: int,
    world: int,
    tag_base: int,
) -> Any:
    """Submit one op to Hermod's :class:`~flowlane.sched.CommScheduler` as its motifs: Hermod decides when the
    coflow goes (its key order), SYNDICATE its shape (segments, spline, path ``group``, order within). Returns a
    handle whose ``wait()`` also repacks the motif outputs. ``tag_base`` must advance identically on every rank."""
    if op.option.algo not in RUNNABLE_ALGOS:
        raise PlanError(
            f"op {op.name!r}: algorithm {op.option.algo!r} cannot be forced per call; runnable: "
            f"{RUNNABLE_ALGOS}"
        )
    from flowlane.syndicate.plan import element_size

    motifs = op.option.motifs(op.comm_op(element_size(op.dtype)))
    runs = motif_runs(kind, motifs, out, inp, group, rank, world, tag_base)
    handle = sched.defer(meta, [lambda r=r: r.launch() for r in runs])

    class _Shaped:
        def wait(self, timeout: Any = None) -> bool:
            handle.wait()
            for r in runs:
                if r.repack is not None:
                    r.repack()
            return True

        def is_completed(self) -> bool:
            return handle.is_completed()

    return _Shaped()
