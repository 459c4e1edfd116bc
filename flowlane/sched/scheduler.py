"""Runtime communication scheduler: ops carry keys, deferrable ops go out in priority order, chunk by chunk.

Seed 000 §5.4 deploys Hermod at each end host as "a single-threaded process ... [that] maintains a priority queue
for coflows"; decisions.md A6.1 #5 separates *ordering* (submit to the backend in key order, DP buckets in chunks so that
EP/PP can slip in between) from *wire priority* (a traffic class per op). This module is the ordering half.

Two kinds of ops:

* **critical** (PP send/recv, EP all-to-all, anything the local rank is about to wait on): launched immediately by
  the caller -- the scheduler never holds back an op on the local critical path. While one is outstanding, the
  *gate* is closed for deferred traffic.
* **deferred** (DP gradient reductions, parameter gathers): split into chunks by the caller, queued, and launched by
  one pacer thread in a *deterministic* sequence, at most ``max_inflight_chunks`` at a time, only while the gate is
  open (or after ``gate_timeout_s``, which bounds the hold-back and so guarantees progress).

Same decisions on every rank (no deadlock, no mismatched collectives): the *sequence* in which deferred chunks are
launched depends only on program order and keys, never on timing. Deferred ops are collected in a *window*; a
window is sealed at program-order events (every :meth:`critical` call, every handle ``wait()``, :meth:`seal`),
sorted by ``policy.order`` (priority, then issue order), and appended to the launch sequence. Timing only decides
*when* the next chunk of that sequence goes out. Contract: the ranks of a process group submit that group's
deferred ops and hit seal points in the same program order (true for SPMD ranks of one pipeline stage, i.e. DP and
EP groups), and deferred ops use communicators that nothing else issues on concurrently (see
:mod:`flowlane.sched.groups`). Waiting on a deferred handle makes it urgent: it and everything before it in the
sequence are launched at once.

``mode="fifo"`` is the baseline (Megatron's default): deferred chunks launch at submit, in issue order, no gate.

``launch="program_order"`` (Hermod on NCCL): no pacer thread. A sealed window is launched at once, in key order,
from the thread that sealed it, so every rank issues every collective at the same program point (no cross-rank
timing dependence), and waits are the backend's own (on NCCL stream-ordered: no host synchronisation). NCCL queues
an op on the device the moment it is issued, so a host-side gate could only delay the launch, not hold traffic
back; the precedence of PP/EP over DP comes from the device and the wire instead (the class communicators' stream
priorities and traffic classes: :mod:`flowlane.sched.groups`). ``chunk_bytes`` still splits what the caller chunks.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from flowlane.policy import CoflowMeta, FifoPolicy, SchedulingPolicy

Launch = Callable[[], Any]  # returns something with .wait() (a Work, RecordedWork, list of them) or None


@dataclass
class SchedulerConfig:
    """Runtime comm-scheduler knobs."""

    mode: Literal["hermod", "fifo"] = "hermod"
    """``hermod``: gated, chunked, priority-ordered deferred ops; ``fifo``: launch at submit (baseline)."""
    chunk_bytes: int = 1 << 20
    """Deferred ops are split into chunks of at most this many bytes (ByteScheduler/Lina-style partitioning)."""
    max_inflight_chunks: int = 1
    """Deferred chunks on the wire at once; 1 gives the shortest pre-emption latency (one chunk)."""
    gate_timeout_s: float = 0.05
    """Longest a ready deferred chunk is held back while critical ops are outstanding (guarantees progress)."""
    wait_timeout_s: float = 300.0
    """A deferred handle's ``wait()`` raises after this long (a stuck peer is an error, never a hang)."""
    launch: Literal["pacer", "program_order"] = "pacer"
    """Who launches deferred chunks: ``pacer`` (one thread, gated, at most ``max_inflight_chunks`` on the wire; the
    host waits, as on gloo) or ``program_order`` (the sealing thread, the whole window at once; see the module
    docstring)."""
    gate_ctypes: tuple[str, ...] | None = None
    """Coflow types whose critical ops close the gate; None: all of them (Hermod: EP, PP and CP go before DP).
    ``("ep",)`` is Lina's rule (all-to-all before all-reduce; the thesis' Lina baseline, seed 000 §5.5.1), which
    lets DP chunks share the link with pipeline sends."""
    log_entries: int = 100_000
    """Newest entries of ``CommScheduler.log`` kept (traces, tests); older ones are dropped, so a long run's memory
    stays bounded (about 100 B each). ``CommScheduler.events`` keeps every count. 0 keeps none."""

    def __post_init__(self) -> None:
        if self.mode not in ("hermod", "fifo"):
            raise ValueError(f"SchedulerConfig.mode {self.mode!r} is not one of ['fifo', 'hermod']")
        if self.launch not in ("pacer", "program_order"):
            raise ValueError(
                f"SchedulerConfig.launch {self.launch!r} is not one of ['pacer', 'program_order']"
            )
        if not isinstance(self.chunk_bytes, int) or self.chunk_bytes < 1:
            raise ValueError(f"SchedulerConfig.chunk_bytes must be an integer >= 1, got {self.chunk_bytes!r}")
        if not isinstance(self.max_inflight_chunks, int) or self.max_inflight_chunks < 1:
            raise ValueError(
                f"SchedulerConfig.max_inflight_chunks must be an integer >= 1, "
                f"got {self.max_inflight_chunks!r}"
            )
        if not self.gate_timeout_s >= 0:
            raise ValueError(f"SchedulerConfig.gate_timeout_s must be >= 0, got {self.gate_timeout_s!r}")
        if not isinstance(self.log_entries, int) or self.log_entries < 0:
            raise ValueError(f"SchedulerConfig.log_entries must be an integer >= 0, got {self.log_entries!r}")
        if not self.wait_timeout_s > 0:
            raise ValueError(f"SchedulerConfig.wait_timeout_s must be > 0, got {self.wait_timeout_s!r}")
        if self.gate_ctypes is not None:
            if isinstance(self.gate_ctypes, str) or not all(isinstance(c, str) for c in self.gate_ctypes):
                raise ValueError(
                    f"SchedulerConfig.gate_ctypes must be a sequence of coflow type names or None, "
                    f"got {self.gate_ctypes!r}"
                )
            self.gate_ctypes = tuple(self.gate_ctypes)


@dataclass
class LogEntry:
    """One scheduler decision: ``event`` is "critical" (launched by the caller) or "chunk" (deferred chunk)."""

    event: str
    meta: CoflowMeta
    chunk: int
    t: float
    window: int = -1
    """The sealed window a deferred chunk belonged to (-1: critical, or fifo mode)."""


def _wait(work: Any) -> None:
    if work is None:
        return
    if isinstance(work, list | tuple):
        for w in work:
            _wait(w)
    else:
        work.wait()


def _wait_done(work: Any, stream: Any = None) -> None:
    """The pacer's wait for a chunk: returns once the chunk has finished on the device as well, so that
    ``max_inflight_chunks`` bounds what is on the wire and a deferred handle completes when its data has arrived.
    gloo's ``wait()`` blocks until the op is done. NCCL's only makes the calling thread's current CUDA stream wait and
    returns at once; in the pacer that was the *default* stream, so the model's next kernels -- and the next pipeline
    send, which NCCL orders after them -- queued behind DP traffic: the critical path blocked on a deferred op, and
    on the first GPU run (4 NCCL ranks, Hermod mode) the ranks deadlocked. So with CUDA the wait goes to ``stream``, a
    stream of the pacer's own, and synchronising that stream returns when the chunk is done (a dead peer ends it
    through NCCL's watchdog, the process group's timeout). Not ``is_completed()`` polling: some gloo works (torch
    2.15's reduce_scatter_tensor) never report completed, and a pacer polling them hung."""
    if stream is None:
        _wait(work)
        return
    with torch.cuda.stream(stream):
        _wait(work)
    stream.synchronize()


@dataclass
class _Chunk:
    op: _Deferred
    index: int
    launch: Launch | None
    """None once launched: the closure may hold the op's data (a DeepSpeed bucket and its buffer), which must not
    live on in a handle the caller keeps until the end of backward."""
    seq_no: int = -1
    window: int = -1

    def take_launch(self) -> Launch:
        """The launch, dropped from the chunk (a chunk is launched once)."""
        fn, self.launch = self.launch, None
        if fn is None:
            raise RuntimeError(f"chunk {self.index} of {self.op.meta} was already launched")
        return fn


@dataclass
class _Deferred:
    meta: CoflowMeta
    chunks: list[_Chunk] = field(default_factory=list)
    remaining: int = 0
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None
    works: list[Any] = field(default_factory=list)  # launch="program_order": the launched chunks' works


class DeferredHandle:
    """Returned by :meth:`CommScheduler.defer`; ``wait()`` makes the op urgent and blocks until all chunks finish."""

    def __init__(self, sched: CommScheduler, op: _Deferred) -> None:
        self._sched, self._op = sched, op

    @property
    def meta(self) -> CoflowMeta:
        return self._op.meta

    def is_completed(self) -> bool:
        return self._op.done.is_set()

    def wait(self, timeout: Any = None) -> bool:
        self._sched._make_urgent(self._op)
        if self._sched.program_order:
            if not self._op.done.is_set():
                # the backend's own wait (NCCL: the caller's stream waits, the host does not)
                _wait(self._op.works)
                self._op.works = []
                self._op.done.set()
                with self._sched._cond:
                    self._sched._live.pop(id(self._op), None)
            return True
        limit = self._sched.config.wait_timeout_s
        if not self._op.done.wait(limit):
            raise TimeoutError(
                f"deferred coflow {self._op.meta} did not complete within {limit:.0f} s "
                f"(wait_timeout_s); a peer rank is stuck or issued a different sequence"
            )
        if self._op.error is not None:
            raise RuntimeError(f"deferred coflow {self._op.meta} failed") from self._op.error
        return True


class CommScheduler:
    """Per-rank Hermod comm scheduler (see the module docstring). Thread-safe; one pacer thread."""

    def __init__(self, policy: SchedulingPolicy | None = None, config: SchedulerConfig | None = None) -> None:
        self.config = config or SchedulerConfig()
        self.policy = policy or FifoPolicy()
        self.log: deque[LogEntry] = deque(maxlen=self.config.log_entries)
        self.events: Counter[str] = Counter()  # every decision's count, however long the run
        self._cond = threading.Condition()
        self._open: list[_Deferred] = []
        self._live: dict[int, _Deferred] = {}
        self._seq: deque[_Chunk] = deque()
        self._next_seq_no = 0
        self._windows = 0
        self._urgent_upto = -1
        self._critical = 0
        self._gate_closed_since: float | None = None
        self._issue = 0
        self._stop = False
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._cuda_device: int | None = None  # the caller's device, for the pacer's own wait stream
        self.program_order = self.config.mode == "hermod" and self.config.launch == "program_order"
        if self.config.mode == "hermod" and not self.program_order:
            self._thread = threading.Thread(target=self._pacer, name="flowlane-hermod-pacer", daemon=True)
            self._thread.start()

    # -- public API -------------------------------------------------------------------------------------------------
    def next_seq(self) -> int:
        """Issue counter (program order); use it as ``CoflowMeta.seq``."""
        with self._cond:
            self._issue += 1
            return self._issue

    def chunk_bounds(self, numel: int, element_size: int) -> list[tuple[int, int]]:
        """[start, end) element ranges of at most ``chunk_bytes`` each (one range in fifo mode).

        Chunking a SUM keeps it bitwise over 2 ranks (a + b = b + a). Over 3 or more the backend's ring gives each
        element a summation order that depends on its position in the buffer, so a chunked reduction can differ
        from the whole-bucket one in the last bits (measured ~1e-9 relative on a DP-4 Megatron run); the
        tests check bitwise at DP 2 and to rounding at DP 4."""
        if numel <= 0:
            return []
        if self.config.mode == "fifo":
            return [(0, numel)]
        per = max(1, self.config.chunk_bytes // max(1, element_size))
        return [(s, min(s + per, numel)) for s in range(0, numel, per)]

    @contextmanager
    def critical_section(self, meta: CoflowMeta) -> Iterator[None]:
        """Mark a critical op that the caller launches *and waits for* inside the block (e.g. Megatron p2p)."""
        gates = self._enter_critical(meta)
        try:
            yield
        finally:
            self._leave_critical(gates)

    def hold(self, meta: CoflowMeta) -> Callable[[], None]:
        """Mark a critical op that the caller launches now and waits for later, elsewhere (Megatron's overlapped
        pipeline p2p): the gate stays closed until the returned ``release`` is called (idempotent)."""
        gates = self._enter_critical(meta)
        lock, released = threading.Lock(), [False]

        def release() -> None:
            with lock:
                if released[0]:
                    return
                released[0] = True
            self._leave_critical(gates)

        return release

    def critical(self, meta: CoflowMeta, launch: Launch) -> _CriticalHandle:
        """Launch a critical op now; the gate stays closed until the returned handle is waited on."""
        gates = self._enter_critical(meta)
        try:
            work = launch()
        except BaseException:
            self._leave_critical(gates)
            raise
        return _CriticalHandle(self, work, gates)

    def defer(self, meta: CoflowMeta, launches: Sequence[Launch]) -> DeferredHandle:
        """Queue a deferrable op as chunks (each a closure launching one async chunk op)."""
        if self._cuda_device is None and torch.cuda.is_available() and torch.cuda.is_initialized():
            self._cuda_device = torch.cuda.current_device()  # the pacer thread's device would default to 0
        op = _Deferred(meta)
        op.chunks = [_Chunk(op, i, fn) for i, fn in enumerate(launches)]
        op.remaining = len(op.chunks)
        if not op.chunks:
            op.done.set()
            return DeferredHandle(self, op)
        if self.config.mode == "fifo":
            works = []
            for c in op.chunks:
                self._log("chunk", meta, c.index)
                works.append(c.take_launch()())
            op.remaining = 0
            handle_works = works

            class _Fifo(DeferredHandle):
                def wait(self, timeout: Any = None) -> bool:
                    _wait(handle_works)
                    op.done.set()
                    return True

                def is_completed(self) -> bool:
                    return all(getattr(w, "is_completed", lambda: True)() for w in handle_works)

            return _Fifo(self, op)
        with self._cond:
            self._raise_if_failed()
            self._open.append(op)
            self._live[id(op)] = op
        return DeferredHandle(self, op)

    def seal(self) -> None:
        """Close the current window: sort it by priority and append it to the launch sequence."""
        with self._cond:
            self._seal_locked()
            self._cond.notify_all()

    def flush(self) -> None:
        """Launch and wait for everything queued so far."""
        with self._cond:
            self._seal_locked()
            pending = list(self._live.values())
        for op in pending:
            DeferredHandle(self, op).wait()

    def close(self) -> None:
        if self._thread is None:
            if self.program_order:
                self.flush()
            return
        self.flush()
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join(timeout=5)
        self._thread = None

    @property
    def outstanding_critical(self) -> int:
        return self._critical

    # -- internals --------------------------------------------------------------------------------------------------
    def _log(self, event: str, meta: CoflowMeta, chunk: int, window: int = -1) -> None:
        self.events[event] += 1
        if self.config.log_entries:
            self.log.append(LogEntry(event, meta, chunk, time.perf_counter(), window))

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise RuntimeError("the Hermod pacer thread failed") from self._error

    def _seal_locked(self) -> None:
        if not self._open:
            return
        self._windows += 1
        for op in sorted(self._open, key=lambda o: self.policy.order(o.meta)):
            for c in op.chunks:
                c.window = self._windows
                c.seq_no = self._next_seq_no
                self._next_seq_no += 1
                self._seq.append(c)
        self._open.clear()
        if self.program_order:  # the sealing thread launches the window now, in key order
            while self._seq:
                c = self._seq.popleft()
                self._log("chunk", c.op.meta, c.index, c.window)
                c.op.works.append(c.take_launch()())

    def _enter_critical(self, meta: CoflowMeta) -> bool:
        """Seal (a program-order point) and close the gate if ``meta``'s type gates; returns whether it did."""
        gates = self.config.gate_ctypes is None or meta.ctype in self.config.gate_ctypes
        with self._cond:
            self._raise_if_failed()
            self._seal_locked()
            self._log("critical", meta, 0)
            if gates:
                if self._critical == 0:
                    self._gate_closed_since = time.monotonic()
                self._critical += 1
            self._cond.notify_all()  # the seal may have queued chunks the pacer can launch
        return gates

    def _leave_critical(self, gates: bool = True) -> None:
        if not gates:
            return
        with self._cond:
            self._critical -= 1
            if self._critical == 0:
                self._gate_closed_since = None
            self._cond.notify_all()

    def _make_urgent(self, op: _Deferred) -> None:
        if self.config.mode == "fifo":
            return
        with self._cond:
            self._seal_locked()
            if op.chunks and not op.done.is_set():
                self._urgent_upto = max(self._urgent_upto, op.chunks[-1].seq_no)
            self._cond.notify_all()

    def _launchable(self, head: _Chunk, inflight: int) -> tuple[bool, float | None]:
        """(may launch now, seconds until the gate times out or None)."""
        if head.seq_no <= self._urgent_upto:
            return True, None
        if inflight >= self.config.max_inflight_chunks:
            return False, None
        if self._critical == 0:
            return True, None
        held = time.monotonic() - (self._gate_closed_since or time.monotonic())
        if held >= self.config.gate_timeout_s:
            return True, None
        return False, self.config.gate_timeout_s - held

    def _pacer(self) -> None:
        inflight: deque[tuple[_Chunk, Any]] = deque()
        wait_stream: Any = None
        try:
            while True:
                with self._cond:
                    launch: _Chunk | None = None
                    while True:
                        if self._stop and not self._seq and not inflight:
                            return
                        if self._seq:
                            ok, until = self._launchable(self._seq[0], len(inflight))
                            if ok:
                                launch = self._seq.popleft()
                                break
                        else:
                            until = None
                        if inflight:
                            break
                        self._cond.wait(timeout=until)
                if wait_stream is None and self._cuda_device is not None:
                    # before the first launch: the current device is per thread, and a launch (DeepSpeed's bucket
                    # function runs in this thread) or the wait stream would otherwise land on device 0
                    torch.cuda.set_device(self._cuda_device)
                    wait_stream = torch.cuda.Stream()
                if launch is not None:
                    self._log("chunk", launch.op.meta, launch.index, launch.window)
                    inflight.append((launch, launch.take_launch()()))
                    continue
                # wait for the oldest chunk on the wire; it stays listed until done, so that a failure fails its op too
                chunk, work = inflight[0]
                _wait_done(work, wait_stream)
                inflight.popleft()
                chunk.op.remaining -= 1
                if chunk.op.remaining == 0:
                    with self._cond:
                        self._live.pop(id(chunk.op), None)
                        chunk.op.chunks = []
                    chunk.op.done.set()
                del chunk, work  # nothing of a finished chunk stays alive in this frame while the pacer waits
        except BaseException as e:  # noqa: BLE001 - surface in the caller's thread
            with self._cond:
                self._error = e
                # every live op fails (in flight, queued, or still in the open window): no thread would launch them
                for op in list(self._live.values()):
                    op.error = e
                    op.done.set()


class _CriticalHandle:
    def __init__(self, sched: CommScheduler, work: Any, gates: bool = True) -> None:
        self._sched, self._work, self._done, self._gates = sched, work, False, gates

    def wait(self, timeout: Any = None) -> bool:
        if not self._done:
            try:
                _wait(self._work)
            finally:
                self._done = True
                self._sched._leave_critical(self._gates)
        return True

    def is_completed(self) -> bool:
        return self._done
