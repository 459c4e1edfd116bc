"""Collectives decomposed into flows (flow-level, pipelined models).

Each collective becomes one coflow whose flows run concurrently; a pipelined ring moves its data in 2(n-1) steps of
S/n, so each ring edge carries 2(n-1)/n * S bytes and the collective takes 2(n-1)/n * S / B + 2(n-1) * latency on a
ring of bandwidth B (Patarasuk & Yuan's bandwidth-optimal ring; seed 000 §5.3.2 "a ring of line-rate flows").
``chunks > 1`` splits a collective into that many sequential coflows of S/chunks on the same stream, so that a
priority policy can slip other coflows in between (ByteScheduler/Lina-style tensor partitioning, digest A6.1 #5).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import replace

import numpy as np

from flowlane.policy import CoflowMeta
from flowlane.sim.graph import SimSpecError, Workload

ALGOS = ("ring", "tree")


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


def _emit(w: Workload, flows, meta: CoflowMeta, deps, name, stream, steps, chunks: int) -> int:
    if not isinstance(chunks, int) or chunks < 1:
        raise SimSpecError(f"{name}: chunks must be an integer >= 1, got {chunks!r}")
    src, dst, nb = flows
    prev: list[int | None] = list(deps)
    last = -1
    for c in range(chunks):
        last = w.coflow((src, dst, np.asarray(nb) / chunks), replace(meta, seq=0), prev,
                        name if chunks == 1 else f"{name}[{c}]", stream, steps)
        prev = [last]
    return last


def all_reduce(w: Workload, group: Sequence[int], nbytes: float, meta: CoflowMeta, deps: Iterable[int | None] = (),
               algo: str = "ring", chunks: int = 1, stream: str | None = None, name: str | None = None) -> int:
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


def reduce_scatter(w: Workload, group: Sequence[int], nbytes: float, meta: CoflowMeta,
                   deps: Iterable[int | None] = (), chunks: int = 1, stream: str | None = None,
                   name: str | None = None) -> int:
    """Ring reduce-scatter of an ``nbytes`` buffer per rank: n flows of (n-1)/n*S, n-1 steps."""
    g = _group(w, group, "reduce_scatter")
    s = _size(nbytes, "reduce_scatter")
    n = len(g)
    if n == 1:
        return w.join(deps)
    meta = replace(meta, op="reduce_scatter")
    return _emit(w, ring_flows(g, (n - 1) / n * s), meta, deps, name or f"{meta.ctype}:reduce_scatter", stream,
                 n - 1, chunks)


def all_gather(w: Workload, group: Sequence[int], nbytes: float, meta: CoflowMeta, deps: Iterable[int | None] = (),
               chunks: int = 1, stream: str | None = None, name: str | None = None) -> int:
    """Ring all-gather producing an ``nbytes`` buffer per rank: n flows of (n-1)/n*S, n-1 steps."""
    g = _group(w, group, "all_gather")
    s = _size(nbytes, "all_gather")
    n = len(g)
    if n == 1:
        return w.join(deps)
    meta = replace(meta, op="all_gather")
    return _emit(w, ring_flows(g, (n - 1) / n * s), meta, deps, name or f"{meta.ctype}:all_gather", stream,
                 n - 1, chunks)


def all_to_all(w: Workload, group: Sequence[int], matrix: np.ndarray, meta: CoflowMeta,
               deps: Iterable[int | None] = (), chunks: int = 1, stream: str | None = None,
               name: str | None = None) -> int:
    """All-to-all with ``matrix[i, j]`` bytes from group rank i to rank j (diagonal = local, not sent)."""
    g = _group(w, group, "all_to_all")
    m = np.asarray(matrix, dtype=np.float64)
    n = len(g)
    if m.shape != (n, n):
        raise SimSpecError(f"all_to_all: matrix shape {m.shape} does not match group size {n}")
    if not np.isfinite(m).all() or (m < 0).any():
        raise SimSpecError("all_to_all: matrix entries must be finite and >= 0 bytes")
    ii, jj = np.nonzero(~np.eye(n, dtype=bool))
    meta = replace(meta, op=meta.op if meta.op in ("dispatch", "combine") else "all_to_all")
    return _emit(w, (g[ii], g[jj], m[ii, jj]), meta, deps, name or f"{meta.ctype}:{meta.op}", stream, 1, chunks)


def p2p(w: Workload, src: Sequence[int] | int, dst: Sequence[int] | int, nbytes: float | Sequence[float],
        meta: CoflowMeta, deps: Iterable[int | None] = (), chunks: int = 1, stream: str | None = None,
        name: str | None = None) -> int:
    """Point-to-point send(s): one flow per (src[i], dst[i]) pair, grouped as one coflow."""
    s = np.atleast_1d(np.asarray(src, dtype=np.int64))
    d = np.atleast_1d(np.asarray(dst, dtype=np.int64))
    nb = np.broadcast_to(np.asarray(nbytes, dtype=np.float64), s.shape).copy()
    if s.shape != d.shape:
        raise SimSpecError(f"p2p: {len(s)} sources but {len(d)} destinations")
    meta = replace(meta, op=meta.op if meta.op in ("send_fwd", "send_bwd", "ring_attn") else "p2p")
    return _emit(w, (s, d, nb), meta, deps, name or f"{meta.ctype}:{meta.op}", stream, 1, chunks)
