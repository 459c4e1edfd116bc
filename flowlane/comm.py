"""Recorded communication: thin wrappers over torch.distributed.

Every byte flowlane moves goes through these functions, and each call appends one :class:`CommOp` (kind, op, group,
peers, bytes, start, end, optional scheduling key) to the process-wide :class:`CommRecorder` (its newest 100,000,
with totals of all). This is the one place where bytes are counted: benchmarks and summaries read the recorder, never
wall-clock guesses.

Asynchronous calls return a :class:`RecordedWork`; the op's ``end`` is stamped when it is waited on (or, for the
common case of ``batch_isend_irecv``, when the last request completes).

``kind`` is the traffic category a summary groups by: "dp", "pp", "tp", "ep", "cp", "p2p", "graph", ...
``key`` is an optional scheduling key (e.g. a Hermod ``CoflowKey``); it is stored, not interpreted.
"""

from __future__ import annotations

import gc
import threading
import time
from collections import defaultdict, deque
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

_clock = time.perf_counter


@dataclass
class CommOp:
    kind: str
    op: str
    group_ranks: tuple[int, ...]
    peers: tuple[int, ...]
    nbytes: int
    start: float
    end: float | None = None
    key: Any = None
    rank: int = -1

    @property
    def duration(self) -> float:
        return (self.end - self.start) if self.end is not None else 0.0


@dataclass
class ComputeSpan:
    name: str
    start: float
    end: float
    args: dict[str, Any] = field(default_factory=dict)


class CommRecorder:
    """Thread-safe log of communication ops and compute spans for this process, with running totals per kind.

    ``max_entries``: the newest ops (and, separately, spans) kept, None for all. The process-wide recorder is
    bounded: a training job that never clears it (Megatron's pipeline sends, DGL's halo exchange, Hermod's
    all-to-alls, one op each) would otherwise grow by every op it sends; the totals count every op either way
    and ``dropped`` says how many left the log."""

    def __init__(self, max_entries: int | None = None) -> None:
        self._lock = threading.Lock()
        self.ops: deque[CommOp] = deque(maxlen=max_entries)
        self.spans: deque[ComputeSpan] = deque(maxlen=max_entries)
        self.enabled = True
        self.dropped = 0
        self._bytes: dict[str, int] = defaultdict(int)
        self._count: dict[str, int] = defaultdict(int)

    def add(self, op: CommOp) -> CommOp:
        if self.enabled:
            with self._lock:
                self.dropped += len(self.ops) == self.ops.maxlen
                self.ops.append(op)
                self._count[op.kind] += 1
                if op.op not in ("recv", "irecv"):
                    self._bytes[op.kind] += op.nbytes
        return op

    def add_span(self, span: ComputeSpan) -> None:
        if self.enabled:
            with self._lock:
                self.spans.append(span)

    def clear(self) -> None:
        with self._lock:
            self.ops.clear()
            self.spans.clear()
            self.dropped = 0
            self._bytes.clear()
            self._count.clear()

    def bytes_by_kind(self) -> dict[str, int]:
        """Bytes this rank sent (or contributed, for collectives), grouped by kind, since the last :meth:`clear`."""
        with self._lock:
            return dict(self._bytes)

    def count_by_kind(self) -> dict[str, int]:
        """Ops recorded per kind since the last :meth:`clear` (also those no longer in the log)."""
        with self._lock:
            return dict(self._count)


_recorder = CommRecorder(max_entries=100_000)  # about 35 MB of ops at most, plus as many spans


def get_recorder() -> CommRecorder:
    return _recorder


@contextmanager
def recording(recorder: CommRecorder | None = None) -> Iterator[CommRecorder]:
    """Temporarily record into a fresh (or the given) recorder."""
    global _recorder
    previous, _recorder = _recorder, recorder or CommRecorder()
    try:
        yield _recorder
    finally:
        _recorder = previous


@contextmanager
def owned_process_groups() -> Iterator[None]:
    """Destroy the process groups created inside the block when it exits normally (after a barrier on the default
    group, so no peer is still using them).

    Megatron's ``destroy_model_parallel`` only forgets its groups, and a gloo group keeps its threads and a socket
    per peer: a process that builds model-parallel state again and again (tests, a benchmark alternating variants)
    gained ~50 threads, 80 file descriptors and 45 MB per build and ran slower each time. On an exception the groups
    are left alone (a peer may still be blocked in one; the launcher tears the ranks down)."""
    from torch.distributed import distributed_c10d as c10d

    before = set(c10d._world.pg_map)  # torch keeps no public list of groups
    yield
    created = [pg for pg in list(c10d._world.pg_map) if pg not in before and pg is not dist.GroupMember.WORLD]
    if created:
        dist.barrier()
        for pg in reversed(created):
            dist.destroy_process_group(pg)
        # a group's threads and sockets go with its last reference; models, optimizers and their hooks often form
        # reference cycles that hold one (e.g. a bucket's group), which only the cycle collector frees
        gc.collect()


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _group_ranks(group: dist.ProcessGroup | None) -> tuple[int, ...]:
    if group is None or group is dist.GroupMember.WORLD:
        return tuple(range(dist.get_world_size()))
    return tuple(dist.get_process_group_ranks(group))


def _start(
    kind: str, op: str, group: dist.ProcessGroup | None, peers: Sequence[int], nbytes: int, key: Any
) -> CommOp:
    return _recorder.add(
        CommOp(kind, op, _group_ranks(group), tuple(peers), nbytes, _clock(), None, key, dist.get_rank())
    )


class RecordedWork:
    """Wraps a torch.distributed Work: waiting stamps the op's end time."""

    def __init__(self, work: Any, ops: Sequence[CommOp]) -> None:
        self._work = work
        self._ops = list(ops)

    def wait(self, timeout: Any = None) -> bool:
        if self._work is not None:
            if isinstance(self._work, list):
                for w in self._work:
                    w.wait()
            elif timeout is None:
                self._work.wait()
            else:
                self._work.wait(timeout)
        now = _clock()
        for op in self._ops:
            if op.end is None:
                op.end = now
        return True

    def is_completed(self) -> bool:
        works = self._work if isinstance(self._work, list) else [self._work]
        return all(w is None or w.is_completed() for w in works)


def _finish(work: Any, ops: Sequence[CommOp], async_op: bool) -> RecordedWork | None:
    rw = RecordedWork(work, ops)
    if async_op:
        return rw
    rw.wait()
    return None


# -- point to point ------------------------------------------------------------------------------------------------
def send(
    tensor: torch.Tensor, dst: int, group: dist.ProcessGroup | None = None, kind: str = "p2p", key: Any = None
) -> None:
    op = _start(kind, "send", group, [dst], _nbytes(tensor), key)
    dist.send(tensor, dst, group=group)
    op.end = _clock()


def recv(
    tensor: torch.Tensor, src: int, group: dist.ProcessGroup | None = None, kind: str = "p2p", key: Any = None
) -> None:
    op = _start(kind, "recv", group, [src], _nbytes(tensor), key)
    dist.recv(tensor, src, group=group)
    op.end = _clock()


def isend(
    tensor: torch.Tensor, dst: int, group: dist.ProcessGroup | None = None, kind: str = "p2p", key: Any = None
) -> RecordedWork:
    op = _start(kind, "isend", group, [dst], _nbytes(tensor), key)
    return RecordedWork(dist.isend(tensor, dst, group=group), [op])


def irecv(
    tensor: torch.Tensor, src: int, group: dist.ProcessGroup | None = None, kind: str = "p2p", key: Any = None
) -> RecordedWork:
    op = _start(kind, "irecv", group, [src], _nbytes(tensor), key)
    return RecordedWork(dist.irecv(tensor, src, group=group), [op])


def batch_isend_irecv(
    p2p_ops: Sequence[dist.P2POp], kind: str = "p2p", key: Any = None, keys: Sequence[Any] | None = None
) -> list[RecordedWork]:
    """Like ``dist.batch_isend_irecv``; one CommOp per P2POp (with ``keys[i]``, or ``key`` for all).
    Global peer ranks, as torch expects. Like torch, returns one handle per op where the backend gives one (gloo) and
    one handle for the whole batch where it coalesces (NCCL); wait on every handle returned."""
    if not p2p_ops:
        return []
    if keys is not None and len(keys) != len(p2p_ops):
        raise ValueError(f"keys has {len(keys)} entries for {len(p2p_ops)} ops")
    recs = []
    for i, p in enumerate(p2p_ops):
        name = "isend" if p.op in (dist.isend, dist.send) else "irecv"
        recs.append(
            _start(kind, name, p.group, [p.peer], _nbytes(p.tensor), keys[i] if keys is not None else key)
        )
    works = dist.batch_isend_irecv(list(p2p_ops))
    if len(works) == len(recs):  # gloo: one Work per op
        return [RecordedWork(w, [r]) for w, r in zip(works, recs, strict=True)]
    # NCCL coalesces the batch into one Work (torch returns a one-element list): waiting on it completes every op
    return [RecordedWork(list(works), recs)]


def collective_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """Where a small metadata tensor for a collective on ``group`` must live: NCCL moves CUDA tensors only (a CPU
    tensor is an error there), gloo takes CPU tensors."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# -- collectives ---------------------------------------------------------------------------------------------------
def all_reduce(
    tensor: torch.Tensor,
    op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
    group: dist.ProcessGroup | None = None,
    kind: str = "dp",
    key: Any = None,
    async_op: bool = False,
) -> RecordedWork | None:
    rec = _start(kind, "all_reduce", group, (), _nbytes(tensor), key)
    return _finish(dist.all_reduce(tensor, op=op, group=group, async_op=async_op), [rec], async_op)


def all_gather_into_tensor(
    output: torch.Tensor,
    input: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    kind: str = "dp",
    key: Any = None,
    async_op: bool = False,
) -> RecordedWork | None:
    rec = _start(kind, "all_gather", group, (), _nbytes(input), key)
    return _finish(
        dist.all_gather_into_tensor(output, input, group=group, async_op=async_op), [rec], async_op
    )


def reduce_scatter_tensor(
    output: torch.Tensor,
    input: torch.Tensor,
    op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
    group: dist.ProcessGroup | None = None,
    kind: str = "dp",
    key: Any = None,
    async_op: bool = False,
) -> RecordedWork | None:
    rec = _start(kind, "reduce_scatter", group, (), _nbytes(input), key)
    return _finish(
        dist.reduce_scatter_tensor(output, input, op=op, group=group, async_op=async_op), [rec], async_op
    )


def all_to_all_single(
    output: torch.Tensor,
    input: torch.Tensor,
    output_split_sizes: list[int] | None = None,
    input_split_sizes: list[int] | None = None,
    group: dist.ProcessGroup | None = None,
    kind: str = "ep",
    key: Any = None,
    async_op: bool = False,
) -> RecordedWork | None:
    rec = _start(kind, "all_to_all", group, (), _nbytes(input), key)
    work = dist.all_to_all_single(
        output, input, output_split_sizes, input_split_sizes, group=group, async_op=async_op
    )
    return _finish(work, [rec], async_op)


def broadcast(
    tensor: torch.Tensor,
    src: int,
    group: dist.ProcessGroup | None = None,
    kind: str = "p2p",
    key: Any = None,
    async_op: bool = False,
) -> RecordedWork | None:
    nbytes = _nbytes(tensor) if dist.get_rank() == src else 0
    rec = _start(kind, "broadcast", group, [src], nbytes, key)
    return _finish(dist.broadcast(tensor, src, group=group, async_op=async_op), [rec], async_op)


def all_gather_object(obj: Any, group: dist.ProcessGroup | None = None) -> list[Any]:
    """Control-plane gather (not counted as traffic)."""
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out
