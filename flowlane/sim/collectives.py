"""Collectives decomposed into flows (flow-level, pipelined models).

Each collective becomes one coflow whose flows run concurrently; a pipelined ring moves its data in 2(n-1) steps of
S/n, so each ring edge carries 2(n-1)/n * S bytes and the collective takes 2(n-1)/n * S / B + 2(n-1) * latency on a
ring of bandwidth B (Patarasuk & Yuan's bandwidth-optimal ring; seed 000 §5.3.2 "a ring of line-rate flows").
``chunks > 1`` splits a collective into that many sequential coflows of S/chunks on the same stream, so that a
priority policy can slip other coflows in between (ByteScheduler/Lina-style tensor partitioning, decisions.md A6.1 #5).

All-to-all comes in four forms (``A2A_MODES``), for Hermod's intra-coflow scheduling (seed 000 §5.3.2):
``plain`` (every flow at once, as NCCL does), ``phases`` (the incast-free schedule as flowlane's runtime sends it:
the integer matrix is decomposed by :func:`flowlane.hermod.matching.bvn_phases` and each rank steps through the
phases, see :func:`_a2a_phases`; one :class:`~flowlane.sim.graph.PhasedAllToAll` node), ``phases_bottleneck``
(the same with bottleneck BvN, the runtime's ``bvn_bottleneck``: fewer, longer phases, e.g. ~180 instead of ~940
for a Zipf EP-32 matrix) and ``matched`` (one coflow marked incast-free: a cheaper fluid abstraction of the phases
that counts each receiver's matched senders as one flow; optimistic, since it has no phase boundaries).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import replace

import numpy as np

from flowlane.policy import CoflowMeta
from flowlane.sim.graph import SimSpecError, Workload

ALGOS = ("ring", "tree")
A2A_MODES = ("plain", "matched", "phases", "phases_bottleneck")


def _group(w: Workload, group: Sequence[int] | np.ndarray, what: str, min_size: int = 1) -> np.ndarray:
    g = np.asarray(group, dtype=np.int64).ravel()
    if len(g) < min_size:
        raise SimSpecError(f"{what}: group must have at least {min_size} devices, got {len(g)}")
    if len(np.unique(g)) != len(g):
        raise SimSpecError(f"{what}: group has duplicate devices {g.tolist()[:8]}")
    return g


def _size(nbytes: float, what: str) -> float:
    if not (isinstance(nbytes, int | float | np.floating) and np.isfinite(nbytes) and nbytes >= 0):
        raise SimSpecError(f"{what}: size must be a finite number >= 0 bytes, got {nbytes!r}")
    return float(nbytes)


def ring_flows(g: np.ndarray, per_edge: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return g, np.roll(g, -1), np.full(len(g), per_edge)


def tree_flows(g: np.ndarray, per_tree: float) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """NCCL-style double binary tree: two trees over the ranks (the second over the reversed order), each moving
    half the data up (reduce) and down (broadcast), pipelined, so all edges are concurrent; "each tree allocated
    half of the line-rate bandwidth" (seed 000 §5.3.2)."""
    n = len(g)
    src: list[int] = []
    dst: list[int] = []
    depth = 0
    for order in (g, g[::-1]):
        for i in range(1, n):
            parent = (i - 1) // 2
            src += [order[i], order[parent]]
            dst += [order[parent], order[i]]
        depth = max(depth, int(np.floor(np.log2(n))) if n > 1 else 0)
    return np.array(src, np.int64), np.array(dst, np.int64), np.full(len(src), per_tree), max(1, 2 * depth)


def _emit(
    w: Workload, flows, meta: CoflowMeta, deps, name, stream, steps, chunks: int, matched: bool = False
) -> int:
    if not isinstance(chunks, int) or chunks < 1:
        raise SimSpecError(f"{name}: chunks must be an integer >= 1, got {chunks!r}")
    src, dst, nb = flows
    prev: list[int | None] = list(deps)
    last = -1
    for c in range(chunks):
        last = w.coflow(
            (src, dst, np.asarray(nb) / chunks),
            replace(meta, seq=0),
            prev,
            name if chunks == 1 else f"{name}[{c}]",
            stream,
            steps,
            matched=matched,
        )
        prev = [last]
    return last


def all_reduce(
    w: Workload,
    group: Sequence[int] | np.ndarray,
    nbytes: float,
    meta: CoflowMeta,
    deps: Iterable[int | None] = (),
    algo: str = "ring",
    chunks: int = 1,
    stream: str | None = None,
    name: str | None = None,
) -> int:
    """All-reduce of ``nbytes`` per rank. ring: n flows of 2(n-1)/n*S; tree: double binary tree."""
    g = _group(w, group, "all_reduce")
    s = _size(nbytes, "all_reduce")
    n = len(g)
    meta = replace(meta, op="all_reduce")
    name = name or f"{meta.ctype}:all_reduce"
    if n == 1:
        return w.join(deps)
    if algo == "ring":
        return _emit(w, ring_flows(g, 2 * (n - 1) / n * s), meta, deps, name, stream, 2 * (n - 1), chunks)
    if algo == "tree":
        src, dst, nb, steps = tree_flows(g, s / 2)
        return _emit(w, (src, dst, nb), meta, deps, name, stream, steps, chunks)
    raise SimSpecError(f"all_reduce: algo {algo!r} is not one of {ALGOS}")


def reduce_scatter(
    w: Workload,
    group: Sequence[int] | np.ndarray,
    nbytes: float,
    meta: CoflowMeta,
    deps: Iterable[int | None] = (),
    chunks: int = 1,
    stream: str | None = None,
    name: str | None = None,
) -> int:
    """Ring reduce-scatter of an ``nbytes`` buffer per rank: n flows of (n-1)/n*S, n-1 steps."""
    g = _group(w, group, "reduce_scatter")
    s = _size(nbytes, "reduce_scatter")
    n = len(g)
    if n == 1:
        return w.join(deps)
    meta = replace(meta, op="reduce_scatter")
    return _emit(
        w,
        ring_flows(g, (n - 1) / n * s),
        meta,
        deps,
        name or f"{meta.ctype}:reduce_scatter",
        stream,
        n - 1,
        chunks,
    )


def all_gather(
    w: Workload,
    group: Sequence[int] | np.ndarray,
    nbytes: float,
    meta: CoflowMeta,
    deps: Iterable[int | None] = (),
    chunks: int = 1,
    stream: str | None = None,
    name: str | None = None,
) -> int:
    """Ring all-gather producing an ``nbytes`` buffer per rank: n flows of (n-1)/n*S, n-1 steps."""
    g = _group(w, group, "all_gather")
    s = _size(nbytes, "all_gather")
    n = len(g)
    if n == 1:
        return w.join(deps)
    meta = replace(meta, op="all_gather")
    return _emit(
        w,
        ring_flows(g, (n - 1) / n * s),
        meta,
        deps,
        name or f"{meta.ctype}:all_gather",
        stream,
        n - 1,
        chunks,
    )


def all_to_all(
    w: Workload,
    group: Sequence[int] | np.ndarray,
    matrix: np.ndarray,
    meta: CoflowMeta,
    deps: Iterable[int | None] = (),
    chunks: int = 1,
    stream: str | None = None,
    name: str | None = None,
    mode: str = "plain",
    unit_bytes: float = 1.0,
) -> int:
    """All-to-all with ``matrix[i, j] * unit_bytes`` bytes from group rank i to rank j (diagonal = local, not sent).
    ``mode``: one of :data:`A2A_MODES` (module docstring); the phased modes need an integer matrix (token counts)."""
    g = _group(w, group, "all_to_all")
    m = np.asarray(matrix, dtype=np.float64)
    n = len(g)
    if mode not in A2A_MODES:
        raise SimSpecError(f"all_to_all: mode {mode!r} is not one of {A2A_MODES}")
    if m.shape != (n, n):
        raise SimSpecError(f"all_to_all: matrix shape {m.shape} does not match group size {n}")
    if not np.isfinite(m).all() or (m < 0).any():
        raise SimSpecError("all_to_all: matrix entries must be finite and >= 0 bytes")
    if not (np.isfinite(unit_bytes) and unit_bytes > 0):
        raise SimSpecError(f"all_to_all: unit_bytes must be a finite number > 0, got {unit_bytes!r}")
    meta = replace(meta, op=meta.op if meta.op in ("dispatch", "combine") else "all_to_all")
    name = name or f"{meta.ctype}:{meta.op}"
    if mode in ("phases", "phases_bottleneck"):
        return _a2a_phases(w, g, m, meta, deps, chunks, stream, name, unit_bytes, mode)
    ii, jj = np.nonzero(~np.eye(n, dtype=bool))
    return _emit(
        w,
        (g[ii], g[jj], m[ii, jj] * unit_bytes),
        meta,
        deps,
        name,
        stream,
        1,
        chunks,
        matched=mode == "matched",
    )


def _a2a_phases(
    w: Workload,
    g: np.ndarray,
    m: np.ndarray,
    meta: CoflowMeta,
    deps,
    chunks: int,
    stream: str | None,
    name: str,
    unit_bytes: float,
    mode: str,
) -> int:
    """The incast-free schedule as the runtime runs it (flowlane.sched.alltoall.matched_all_to_all): every rank
    walks the phases in order and posts phase k's send and receive once its own phase k-1 ops have completed; no
    global barrier. So the flow i -> j of phase k is an op of its own, started when ranks i and j have both finished
    their latest earlier phase (the rendezvous gloo and NCCL make: no receiver ever has two phase flows at once; a
    flow may wait on a slow peer). Sends complete on delivery here, so the sender-side overlap gloo shows
    (flowlane.sched.alltoall) is not modelled. The result is one :class:`PhasedAllToAll` node that the engine steps
    flow by flow; it bypasses ``stream`` (the phase flows are not serialised against each other)."""
    # Imported here: flowlane.sched pulls in torch for its runtime parts; the simulator needs only the matcher.
    from flowlane.hermod.matching import bvn_phases

    if chunks != 1:
        raise SimSpecError(
            f"{name}: mode {mode!r} already splits the all-to-all; chunks must be 1, got {chunks}"
        )
    if (m != np.round(m)).any():
        raise SimSpecError(
            f"{name}: mode {mode!r} needs an integer matrix (e.g. token counts); got fractions"
        )
    t = np.round(m).astype(np.int64)
    np.fill_diagonal(t, 0)  # local traffic never enters the network
    plan = bvn_phases(t.tolist(), matching="bottleneck" if mode == "phases_bottleneck" else "first")
    sends = [(k, a, b, amt) for k, ph in enumerate(plan) for a, b, amt in ph.sends]
    latest: list[list[int]] = [[] for _ in range(len(g))]  # per group rank: its latest phase's flows
    preds: list[list[int]] = []
    k_prev = -1
    ops: dict[int, list[int]] = {}
    for f, (k, a, b, _) in enumerate(sends):
        if k != k_prev:  # a new phase: the ranks in the last one move on
            for r, fs in ops.items():
                latest[r] = fs
            ops, k_prev = {}, k
        preds.append(sorted({*latest[a], *latest[b]}))
        ops.setdefault(a, []).append(f)
        ops.setdefault(b, []).append(f)
    arr = np.array(sends, dtype=np.int64).reshape(-1, 4)  # (phase, src, dst, amount) per flow
    # the runtime's plan-cache key: algorithm + the matrix with its diagonal zeroed (plan_all_to_all)
    key = hashlib.blake2b(mode.encode() + t.tobytes(), digest_size=16).digest()
    return w.phased_all_to_all(
        g[arr[:, 1]],
        g[arr[:, 2]],
        arr[:, 3] * unit_bytes,
        arr[:, 0],
        preds,
        replace(meta, seq=0),
        deps,
        name,
        plan_key=key,
        group=g.tolist(),
    )


def p2p(
    w: Workload,
    src: Sequence[int] | int,
    dst: Sequence[int] | int,
    nbytes: float | Sequence[float],
    meta: CoflowMeta,
    deps: Iterable[int | None] = (),
    chunks: int = 1,
    stream: str | None = None,
    name: str | None = None,
) -> int:
    """Point-to-point send(s): one flow per (src[i], dst[i]) pair, grouped as one coflow."""
    s = np.atleast_1d(np.asarray(src, dtype=np.int64))
    d = np.atleast_1d(np.asarray(dst, dtype=np.int64))
    nb = np.broadcast_to(np.asarray(nbytes, dtype=np.float64), s.shape).copy()
    if s.shape != d.shape:
        raise SimSpecError(f"p2p: {len(s)} sources but {len(d)} destinations")
    meta = replace(meta, op=meta.op if meta.op in ("send_fwd", "send_bwd", "ring_attn") else "p2p")
    return _emit(w, (s, d, nb), meta, deps, name or f"{meta.ctype}:{meta.op}", stream, 1, chunks)
