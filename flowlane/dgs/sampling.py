"""DGS sampling arithmetic, free of DGL (numpy only): masks -> probabilities, the ε quota split, picks inside a quota,
top-N_f column selection and byte accounting. Digest 000-dgs-g3.md A2.8, A2.10 (sampler), A6 #8-#10.

A hop is described by its *candidates*: for the frontier nodes ``0..S-1`` (``offsets`` splits the candidate arrays by
frontier node, CSR style), each candidate in-edge has its neighbour id, whether the neighbour is local to the worker
that will pull its features, and a non-negative weight (1 for local neighbours, 𝒮𝒩 + floor for remote ones).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

_U64 = np.uint64


SN_TRANSFORMS = ("sigmoid", "minmax")


def node_probabilities(sn: np.ndarray, floor: float = 1e-6, transform: str = "sigmoid") -> np.ndarray:
    """A6 #8: node-mask values 𝒮𝒩 in [0, 1] (σ of the mask parameters) to sampling weights, plus a floor so no node
    is starved. ``transform="sigmoid"``: the mask value itself (the seed's σ(M)). ``"minmax"`` (A6 #8's "option for
    normalisation"): ``(𝒮𝒩 - min) / (max - min)`` over the explanation, so a mask whose values all sit close together
    (the regularisers shrink every node's mask alike; measured spreads of a few per cent) still ranks the picks;
    all-equal values give equal weights."""
    sn = np.asarray(sn, dtype=np.float64)
    if transform not in SN_TRANSFORMS:
        raise ValueError(f"transform={transform!r}: choose one of {list(SN_TRANSFORMS)}")
    if sn.size and (not np.isfinite(sn).all() or sn.min() < 0 or sn.max() > 1):
        raise ValueError(
            f"node mask values must be finite and in [0, 1]; got min={sn.min()!r} max={sn.max()!r}"
        )
    if transform == "minmax" and sn.size:
        lo, span = sn.min(), sn.max() - sn.min()
        sn = (sn - lo) / span if span > 0 else np.ones_like(sn)
    return sn + floor


def labor_inclusion(group: np.ndarray, weight: np.ndarray, quota: np.ndarray) -> np.ndarray:
    """LABOR's inclusion probability of each candidate, ``π_t = min(1, c_s · w_t)``, with ``c_s`` per group
    (frontier node and side) solved so that ``Σ_t π_t`` is the group's quota (Balin & Catalyurek, NeurIPS'23):
    water-filling, exact: candidates with ``c_s · w_t >= 1`` are fixed at 1 and ``c_s`` is solved again over the
    rest, until none is added (``c_s`` only grows, so at most one round per candidate). Without this a heavy
    candidate clipped at 1 loses the excess and the group falls short of its quota. Zero-weight candidates get 0, so
    a group with fewer positive weights than its quota takes all of them."""
    group = np.asarray(group, dtype=np.int64)
    weight = np.asarray(weight, dtype=np.float64)
    quota = np.asarray(quota, dtype=np.float64)
    pos = weight > 0
    sat = np.zeros(weight.size, dtype=bool)
    while True:
        q_rest = quota - np.bincount(group, weights=sat, minlength=quota.size)
        w_rest = np.bincount(group, weights=np.where(sat, 0.0, weight), minlength=quota.size)
        c = np.where(w_rest > 0, np.maximum(q_rest, 0.0) / np.maximum(w_rest, 1e-300), 0.0)
        new = pos & ~sat & (c[group] * weight >= 1.0)
        if not new.any():
            return np.where(sat, 1.0, np.minimum(1.0, c[group] * weight))
        sat |= new


def quota_split(
    n_local: np.ndarray, n_remote: np.ndarray, fanout: int, epsilon: float
) -> tuple[np.ndarray, np.ndarray]:
    """A2.10 / A6 #9: per frontier node, how many local and remote neighbours to pick. The fanout is split in
    proportion to the local/remote neighbour counts, then ``round(ε · fanout)`` moves from remote to local, and the
    total stays the fanout ("remaining the number of total sampled nodes unchanged"); a node with at most ``fanout``
    neighbours (or ``fanout = -1``) takes all of them."""
    nl = np.asarray(n_local, dtype=np.int64)
    nr = np.asarray(n_remote, dtype=np.int64)
    if fanout == -1:
        return nl.copy(), nr.copy()
    if fanout < 1:
        raise ValueError(f"fanout={fanout!r} must be >= 1, or -1 for all neighbours")
    if not 0.0 <= epsilon <= 1.0:
        raise ValueError(f"epsilon={epsilon!r} must be in [0, 1]")
    total = nl + nr
    prop = np.floor(fanout * nl / np.maximum(total, 1) + 0.5).astype(np.int64)
    q_loc = np.minimum(np.minimum(prop + int(math.floor(epsilon * fanout + 0.5)), nl), fanout)
    q_rmt = np.minimum(fanout - q_loc, nr)
    q_loc = np.minimum(fanout - q_rmt, nl)
    small = total <= fanout
    return np.where(small, nl, q_loc), np.where(small, nr, q_rmt)


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser: a counter-free hash, so every server draws the same variate for a vertex and key."""
    with np.errstate(over="ignore"):
        x = (x ^ (x >> _U64(30))) * _U64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> _U64(27))) * _U64(0x94D049BB133111EB)
        return x ^ (x >> _U64(31))


def shared_uniform(ids: np.ndarray, key: int) -> np.ndarray:
    """LABOR's per-vertex random variate r_t in [0, 1): the same for vertex ``t`` wherever it is drawn with ``key``
    (one key per mini-batch and hop), which is what makes different seeds' picks overlap."""
    x = np.asarray(ids, dtype=np.int64).astype(_U64) ^ _mix64(np.array([key], dtype=np.int64).astype(_U64))
    return (_mix64(x) >> _U64(11)).astype(np.float64) / float(1 << 53)


def pick(
    offsets: np.ndarray,
    nbr: np.ndarray,
    local: np.ndarray,
    weight: np.ndarray,
    fanout: int,
    epsilon: float,
    rng: np.random.Generator,
    base: str = "uniform",
    labor_key: int = 0,
) -> np.ndarray:
    """Which candidates one hop keeps (a boolean mask over the candidates).

    Quotas come from :func:`quota_split`. ``base="uniform"``: inside each quota, weighted sampling without replacement
    (Efraimidis-Spirakis keys ``log(u) / w``: one pick has probability ∝ w, as DGL's ``sample_neighbors(prob=)``).
    ``base="labor"``: LABOR-0 inside each quota: candidate ``t`` is kept iff ``r_t <= π_t = min(1, c_s · w_t)`` with
    ``c_s`` solved so that ``Σ π_t`` is the quota (:func:`labor_inclusion`), so the expected count is the quota (the
    total stays the fanout in expectation) and seeds sharing a neighbour share its decision.
    """
    offsets = np.asarray(offsets, dtype=np.int64)
    local = np.asarray(local, dtype=bool)
    weight = np.asarray(weight, dtype=np.float64)
    n_cand = int(offsets[-1]) if offsets.size else 0
    if local.size != n_cand or weight.size != n_cand or np.asarray(nbr).size != n_cand:
        raise ValueError(
            f"candidate arrays must all have offsets[-1]={n_cand} entries; got local={local.size}, "
            f"weight={weight.size}, nbr={np.asarray(nbr).size}"
        )
    if n_cand and (weight.min() < 0 or not np.isfinite(weight).all()):
        raise ValueError("candidate weights must be finite and >= 0")
    if base not in ("uniform", "labor"):
        raise ValueError(f"base={base!r}: choose 'uniform' or 'labor'")
    seg = np.repeat(np.arange(offsets.size - 1), np.diff(offsets))
    n_loc = np.bincount(seg, weights=local, minlength=offsets.size - 1).astype(np.int64)
    n_rmt = np.diff(offsets) - n_loc
    q_loc, q_rmt = quota_split(n_loc, n_rmt, fanout, epsilon)
    group = seg * 2 + (~local)  # (frontier node, side)
    quota = np.stack([q_loc, q_rmt], axis=1).reshape(-1)
    if base == "labor":
        size = np.bincount(group, minlength=quota.size)
        full = quota >= size  # take the whole side
        pi = labor_inclusion(group, weight, quota)
        return full[group] | (shared_uniform(nbr, labor_key) <= pi)
    u = rng.random(n_cand)
    key = np.where(weight > 0, np.log(np.maximum(u, 1e-300)) / np.maximum(weight, 1e-300), -np.inf)
    order = np.lexsort((-key, group))
    g_sorted = group[order]
    start = np.searchsorted(g_sorted, np.arange(quota.size))
    rank = np.arange(n_cand) - start[g_sorted]
    keep = np.zeros(n_cand, dtype=bool)
    keep[order] = rank < quota[g_sorted]
    return keep


def top_columns(sf: np.ndarray, n_f: float) -> np.ndarray:
    """Algorithm 1 l. 9: the ``ceil(n_f · f)`` feature dimensions with the largest 𝒮ℱ (ties: lower index), sorted."""
    sf = np.asarray(sf, dtype=np.float64).reshape(-1)
    if sf.size == 0:
        raise ValueError("feature mask is empty")
    if not 0.0 < n_f <= 1.0:
        raise ValueError(f"n_f={n_f!r} must be in (0, 1]")
    k = max(1, math.ceil(n_f * sf.size - 1e-9))
    return np.sort(np.argsort(-sf, kind="stable")[:k]).astype(np.int64)


ID_BYTES = 8  # int64 node / column ids on the wire


def pull_bytes(rows: int, cols: int, itemsize: int, total_cols: int) -> tuple[int, int]:
    """Payload (request, response) bytes of one feature pull of ``rows`` rows and ``cols`` of ``total_cols`` columns:
    the ids, the column list when it is a subset, and the rows. Headers are not counted (A5.1: payload, not NIC)."""
    req = rows * ID_BYTES + (cols * ID_BYTES if cols < total_cols else 0)
    return req, rows * cols * itemsize


def sampling_bytes(n_frontier: int, n_edges: int) -> tuple[int, int]:
    """Payload (request, response) bytes of one sampling RPC: the frontier ids, and (src, dst) per sampled edge."""
    return n_frontier * ID_BYTES, n_edges * 2 * ID_BYTES


@dataclass
class ByteLedger:
    """Bytes by kind, counted where flowlane sends them (A2.14): remote feature pulls, sampling RPCs to other
    partitions, the once-per-T_ex probability update, and setup pulls (the explanation graph's halo rows, A6 #4)."""

    counts: dict[str, int] = field(default_factory=dict)

    KINDS = ("feature_remote", "sampling_rpc", "prob_update", "setup")

    def add(self, kind: str, n: int) -> None:
        if kind not in self.KINDS:
            raise ValueError(f"byte kind {kind!r} is not one of {list(self.KINDS)}")
        self.counts[kind] = self.counts.get(kind, 0) + int(n)

    def get(self, kind: str) -> int:
        return self.counts.get(kind, 0)

    def as_dict(self) -> dict[str, int]:
        return {k: self.counts.get(k, 0) for k in self.KINDS}
