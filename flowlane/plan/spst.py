"""SPST communication planning (DGCL seed 001 §5.2) and the peer-to-peer baseline.

Per vertex ``u`` (vertices in a seeded random order, §5.2 "randomly shuffled"), a tree rooted at the owner ``s_u`` is
grown one destination at a time: a multi-source shortest path from every rank already holding ``u`` to the nearest
uncovered destination, with edge weights equal to the *marginal* increase of the staged cost model (Algorithm 2,
evaluated on demand). Choices where the seed is silent (digest §5):

- item 5: Dijkstra runs over layered states (rank, depth) because an edge's weight depends on its stage; a path may
  not revisit a rank (without this, zero-cost edges form cycles) nor enter a rank already in the tree;
- item 6: ties broken by the key (cost, hops, uncontended link time, rank, depth), so plans are deterministic and
  short; item 7: loop until every destination is covered (a path may pass through several);
- item 8: stages are capped at ``max_depth`` (default ``num_ranks - 1``, the paper's bound), optional latency ``alpha``;
- item 12: ``method="auto"`` also evaluates the peer-to-peer plan under the same model and keeps the cheaper one;
  on a tie (equal within float rounding, relative 1e-9) it keeps peer-to-peer: one stage, fewer transfers, no relay
  rows (a uniform mesh often ties exactly).

Two implementations with identical results: a C kernel (``_spst.c``, compiled on first use with the system C compiler,
``-O3`` and no CPU-specific flags, cached in ``~/.cache/flowlane`` under a hash of source + flags, loaded with ctypes;
single-threaded) and the pure-Python reference below, used when no compiler is available or when
``FLOWLANE_SPST=python``. ``build_plan`` computes the SPST and peer-to-peer costs from hop loads (the kernel's own load
matrix, and pair counts for P2P) instead of re-walking every transfer; the result equals ``cost.evaluate`` bit for bit.
"""

from __future__ import annotations

import ctypes
import hashlib
import heapq
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .._cbuild import CKernel
from .cost import LinkModel, evaluate, stage_hop_loads
from .relation import CommRelation, PlanError

METHODS = ("spst", "p2p", "auto")
#: ``method="auto"``: SPST must be cheaper than P2P by more than this relative margin (float rounding) to be kept
_TIE_RTOL = 1e-9


@dataclass(frozen=True)
class Plan:
    """A communication plan: transfer ``i`` sends vertex ``u[i]`` from rank ``src[i]`` to ``dst[i]`` in ``stage[i]``.

    The union of one tree per vertex (DGCL's ``S = ∪_u T_u``). ``cost`` is ``t(S)`` under the model in seconds per byte
    of embedding; ``info`` records the method, seed, the baseline cost and the planning time.
    """

    u: np.ndarray
    stage: np.ndarray
    src: np.ndarray
    dst: np.ndarray
    num_ranks: int
    cost: float
    method: str
    info: dict = field(default_factory=dict)

    @property
    def num_stages(self) -> int:
        return int(self.stage.max()) if self.stage.size else 0

    @property
    def num_transfers(self) -> int:
        return int(self.u.size)

    def digest(self) -> str:
        """Hash of the transfers; equal on every rank that planned the same relation with the same seed."""
        h = hashlib.sha256()
        for a in (self.u, self.stage, self.src, self.dst):
            h.update(np.ascontiguousarray(a, dtype=np.int64).tobytes())
        return h.hexdigest()[:16]


def p2p_plan(rel: CommRelation, lm: LinkModel | None = None) -> Plan:
    """Peer-to-peer baseline: every (``s_u``, ``d ∈ D_u``) on the direct link in stage 1 (digest §5 item 20).
    With ``lm``, a pair that has no link is refused (:class:`PlanError` naming it)."""
    dest = rel.destinations()
    u, stage, src, dst = _p2p_arrays(rel, dest)
    if lm is not None and (pair := _p2p_missing_link(rel, lm, dest)) is not None:
        raise PlanError(pair)
    cost = evaluate(stage, src, dst, lm) if lm is not None else float("nan")
    return Plan(u, stage, src, dst, rel.num_ranks, cost, "p2p")


def _p2p_arrays(rel: CommRelation, dest) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    verts, ptr, dests = dest
    u = np.repeat(verts, np.diff(ptr)).astype(np.int64)
    src = np.asarray(rel.owner)[u].astype(np.int32)
    return u, np.ones(u.size, np.int32), src, dests.astype(np.int32)


def _p2p_missing_link(rel: CommRelation, lm: LinkModel, dest) -> str | None:
    """Why peer-to-peer cannot run (an owner and a destination of one of its vertices have no link), or None."""
    verts, ptr, dests = dest
    R = rel.num_ranks
    src = np.repeat(np.asarray(rel.owner)[verts], np.diff(ptr))
    pairs = np.unique(src * R + dests)
    miss = pairs[lm.link_hops[pairs // R, pairs % R, 0] < 0]
    if not miss.size:
        return None
    a, b = int(miss[0] // R), int(miss[0] % R)
    return (
        f"peer-to-peer needs a link from rank {a} ({lm.devices[a]}) to rank {b} ({lm.devices[b]}), which the "
        f"topology lacks ({miss.size} such pairs); use method='spst' or 'auto', which relay around it"
    )


def _cost_from_loads(load: np.ndarray, lm: LinkModel, unit_bytes: float, alpha: float) -> float:
    """:func:`flowlane.plan.cost.evaluate` from the loads ``c_h^k`` (rows: stages 1..max used stage) instead of from
    the transfers, with the same floating-point operations: the result is bit-identical (the loads are exact integer
    counts either way) and costs O(stages x hops) instead of a pass over every transfer and hop."""
    if load.shape[0] == 0:
        load = np.zeros((1, lm.hop_bw.size))
    per_stage = (load * (unit_bytes * lm.hop_inv_bw)[None, :]).max(axis=1)
    return float(per_stage.sum() + alpha * np.count_nonzero(load.sum(axis=1)))


def _p2p_loads(rel: CommRelation, lm: LinkModel, dest) -> np.ndarray:
    """Stage-1 hop loads of the peer-to-peer plan from the (owner, destination) pair counts: [1, H]."""
    verts, ptr, dests = dest
    R = rel.num_ranks
    src = np.repeat(np.asarray(rel.owner)[verts], np.diff(ptr))
    pairs = np.bincount(src * R + dests, minlength=R * R).astype(np.float64)  # exact integer counts
    lh = lm.link_hops.reshape(R * R, -1)
    ok = lh >= 0
    w = np.broadcast_to(pairs[:, None], lh.shape)[ok]
    return np.bincount(lh[ok], weights=w, minlength=lm.hop_bw.size)[None, :]


def build_plan(
    rel: CommRelation,
    lm: LinkModel,
    method: str = "auto",
    seed: int = 0,
    max_depth: int | None = None,
    alpha: float = 0.0,
    unit_bytes: float = 1.0,
    impl: str | None = None,
) -> Plan:
    """Plan the embedding exchange of ``rel`` over ``lm``.

    ``method``: "spst", "p2p", or "auto" (SPST, falling back to P2P where P2P costs as much or less under the model).
    A pair of ranks without a link (see :meth:`LinkModel.from_topology`) is relayed around by SPST; "p2p" refuses a
    relation that needs it, and "auto" then keeps SPST (``info["p2p_cost"]`` is inf).
    ``alpha``/``unit_bytes``: optional per-stage latency (s) and embedding size (bytes) that make costs seconds.
    ``impl``: "c" or "python" (default: C when it builds and there are at most 64 ranks, else Python; env
    ``FLOWLANE_SPST`` overrides). "c" is refused past 64 ranks.
    """
    if method not in METHODS:
        raise PlanError(f"method must be one of {METHODS}, got {method!r}")
    if lm.num_ranks != rel.num_ranks:
        raise PlanError(f"the link model has {lm.num_ranks} ranks but the relation has {rel.num_ranks}")
    if not (alpha >= 0 and np.isfinite(alpha)):
        raise PlanError(f"alpha must be a finite number >= 0 seconds, got {alpha!r}")
    if not (unit_bytes > 0 and np.isfinite(unit_bytes)):
        raise PlanError(f"unit_bytes must be > 0, got {unit_bytes!r}")
    R = rel.num_ranks
    S = max(R - 1, 1) if max_depth is None else int(max_depth)  # one rank: nothing to send, depth 1 is moot
    if not 1 <= S <= max(R - 1, 1):
        raise PlanError(f"max_depth must be in [1, {max(R - 1, 1)}] for {R} ranks, got {max_depth!r}")
    dest = rel.destinations()
    if rel.num_pairs == 0:  # e.g. one rank: nothing to exchange, the empty plan (cost 0) under any method
        return Plan(
            *_p2p_arrays(rel, dest),
            R,
            0.0,
            "p2p" if method == "p2p" else "spst",
            {"p2p_cost": 0.0, "seed": seed, "plan_seconds": 0.0, "max_depth": S, "pairs": 0},
        )
    missing = _p2p_missing_link(rel, lm, dest)
    if missing is not None and method == "p2p":
        raise PlanError(missing)
    # a pair without a link: peer-to-peer is impossible (cost inf), so "auto" keeps SPST, which relays around it
    p2p_cost = (
        _cost_from_loads(_p2p_loads(rel, lm, dest), lm, unit_bytes, alpha) if missing is None else np.inf
    )
    if method == "p2p":
        return Plan(
            *_p2p_arrays(rel, dest),
            R,
            p2p_cost,
            "p2p",
            {"p2p_cost": p2p_cost, "seed": seed, "plan_seconds": 0.0},
        )
    t0 = time.perf_counter()
    # plan in per-byte units (alpha rescaled): the plan is then exactly independent of the embedding size, as the
    # dimension-invariance property (§5.1) says it should be, not only up to floating-point rounding of ties
    u, st, a, b, load, impl_used = _spst(rel, lm, S, seed, alpha / unit_bytes, 1.0, impl, dest)
    secs = time.perf_counter() - t0
    cost = _cost_from_loads(load[1 : 1 + (int(st.max()) if st.size else 0)], lm, unit_bytes, alpha)
    info = {
        "p2p_cost": p2p_cost,
        "spst_cost": cost,
        "seed": seed,
        "plan_seconds": secs,
        "impl": impl_used,
        "max_depth": S,
        "pairs": rel.num_pairs,
    }
    # ties go to P2P (module docstring, item 12)
    if method == "auto" and p2p_cost <= cost * (1.0 + _TIE_RTOL):
        return Plan(*_p2p_arrays(rel, dest), R, p2p_cost, "p2p", {**info, "fallback": True})
    return Plan(u, st, a, b, R, cost, "spst", {**info, "fallback": False})


# -- implementations ----------------------------------------------------------------------------------------------
def _inputs(rel: CommRelation, lm: LinkModel, seed: int, unit_bytes: float, dest=None):
    verts, ptr, dests = rel.destinations() if dest is None else dest
    srcs = np.asarray(rel.owner)[verts].astype(np.int32)
    order = np.random.default_rng(seed).permutation(verts.size).astype(np.int64)
    inv = (unit_bytes * lm.hop_inv_bw).astype(np.float64)
    raw = lm.link_raw() * unit_bytes
    raw[~np.isfinite(raw)] = 0.0
    return verts.astype(np.int64), ptr.astype(np.int64), dests.astype(np.int32), srcs, order, inv, raw


#: ranks the C kernel plans (its rank sets are 64-bit masks)
_C_MAX_RANKS = 64


def _spst(rel, lm, S, seed, alpha, unit_bytes, impl, dest=None):
    """(u, stage, src, dst, load, impl): the transfers and ``load[k, h] = c_h^k`` (row 0 unused)."""
    impl = impl or os.environ.get("FLOWLANE_SPST") or "auto"
    if impl not in ("auto", "c", "python"):
        raise PlanError(f"impl must be 'c', 'python' or unset, got {impl!r}")
    if impl == "c" and rel.num_ranks > _C_MAX_RANKS:  # asked for by name: refused, not run in Python instead
        raise PlanError(
            f"impl='c' (argument or FLOWLANE_SPST) cannot plan {rel.num_ranks} ranks: the C SPST kernel takes at most "
            f"{_C_MAX_RANKS}; use impl='python' or leave it unset (the Python planner is used past {_C_MAX_RANKS})"
        )
    args = _inputs(rel, lm, seed, unit_bytes, dest)
    if impl in ("auto", "c") and rel.num_ranks <= _C_MAX_RANKS:
        lib = _KERNEL.load()
        if lib is not None:
            return (*_spst_c(lib, lm, S, alpha, *args), "c")
        if impl == "c":
            raise PlanError("impl='c' requested but the C SPST kernel could not be built (no C compiler?)")
    return (*_spst_python(lm, S, alpha, *args), "python")


def _spst_python(lm: LinkModel, S: int, alpha: float, verts, ptr, dests, srcs, order, inv, raw):
    R = lm.num_ranks
    H = inv.size
    inv_l = inv.tolist()
    raw_l = raw.ravel().tolist()
    lh = [[int(h) for h in lm.link_hops[a, b] if h >= 0] for a in range(R) for b in range(R)]
    load = [[0.0] * H for _ in range(S + 1)]  # row k = stage k (row 0 unused)
    T = [0.0] * (S + 1)
    used = [False] * (S + 1)
    out_u: list[int] = []
    out_k: list[int] = []
    out_a: list[int] = []
    out_b: list[int] = []
    verts_l, ptr_l, dests_l, srcs_l = verts.tolist(), ptr.tolist(), dests.tolist(), srcs.tolist()
    for i in order.tolist():
        u = verts_l[i]
        D = set(dests_l[ptr_l[i] : ptr_l[i + 1]])
        depth = {srcs_l[i]: 0}
        remaining = len(D)
        while remaining:
            best: dict = {}
            pred: dict = {}
            fin: set = set()
            heap: list = []
            for g, dg in depth.items():
                best[(g, dg)] = (0.0, 0, 0.0)
                pred[(g, dg)] = None
                heapq.heappush(heap, (0.0, 0, 0.0, g, dg))
            target = None
            while heap:
                c, h, rw, g, dl = heapq.heappop(heap)
                st = (g, dl)
                if st in fin or best[st] != (c, h, rw):
                    continue
                fin.add(st)
                if g in D and g not in depth:
                    target = st
                    break
                k = dl + 1
                if k > S:
                    continue
                onpath = set()
                p = st
                while p is not None:
                    onpath.add(p[0])
                    p = pred[p]
                lk, Tk = load[k], T[k]
                for g2 in range(R):
                    if g2 in depth or g2 in onpath:
                        continue
                    hops = lh[g * R + g2]
                    if not hops:
                        continue
                    m = max((lk[x] + 1.0) * inv_l[x] for x in hops) - Tk
                    if m < 0:
                        m = 0.0
                    if alpha != 0.0 and not used[k]:
                        m += alpha
                    nk = (c + m, h + 1, rw + raw_l[g * R + g2])
                    s2 = (g2, k)
                    if s2 in fin:
                        continue
                    ob = best.get(s2)
                    if ob is None or nk < ob:
                        best[s2] = nk
                        pred[s2] = st
                        heapq.heappush(heap, (nk[0], nk[1], nk[2], g2, k))
            if target is None:
                raise PlanError(
                    f"vertex {u}: no path from the ranks holding it {sorted(depth)} to "
                    f"{sorted(D - set(depth))} within max_depth={S}"
                )
            chain = []
            p = target
            while p is not None:
                chain.append(p)
                p = pred[p]
            for q in range(len(chain) - 1, 0, -1):
                (ga, _), (gb, k) = chain[q], chain[q - 1]
                lk = load[k]
                for x in lh[ga * R + gb]:
                    lk[x] += 1.0
                    v = lk[x] * inv_l[x]
                    if v > T[k]:
                        T[k] = v
                used[k] = True
                depth[gb] = k
                out_u.append(u)
                out_k.append(k)
                out_a.append(ga)
                out_b.append(gb)
                if gb in D:
                    remaining -= 1
    return (
        np.array(out_u, np.int64),
        np.array(out_k, np.int32),
        np.array(out_a, np.int32),
        np.array(out_b, np.int32),
        np.array(load, np.float64).reshape(S + 1, H),
    )


# portable flags only (no -march=native: the cached .so is keyed by source + flags, not by the CPU it was built on)
_CFLAGS = ("-O3", "-shared", "-fPIC")


def _declare(lib: ctypes.CDLL) -> None:
    P = ctypes.c_void_p
    lib.flowlane_spst.restype = ctypes.c_long
    lib.flowlane_spst.argtypes = [
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        P,
        P,
        P,
        ctypes.c_double,
        ctypes.c_long,
        P,
        P,
        P,
        P,
        P,
        P,
        P,
        P,
        P,
        ctypes.c_long,
        P,
    ]


_KERNEL = CKernel(
    Path(__file__).with_name("_spst.c"),
    "spst",
    _CFLAGS,
    _declare,
    "flowlane.plan: C SPST kernel",
    "using the pure-Python planner",
)


def _spst_c(lib, lm: LinkModel, S: int, alpha: float, verts, ptr, dests, srcs, order, inv, raw):
    R = lm.num_ranks
    H = inv.size
    lh = np.ascontiguousarray(lm.link_hops, dtype=np.int32)
    maxh = lh.shape[2]
    raw = np.ascontiguousarray(raw, dtype=np.float64)
    cap = max(1, verts.size * max(R - 1, 1))
    out_u = np.empty(cap, np.int64)
    out_k, out_a, out_b = (np.empty(cap, np.int32) for _ in range(3))
    load = np.zeros((S + 1, H), np.float64)
    p = lambda a: a.ctypes.data_as(ctypes.c_void_p)  # noqa: E731
    n = lib.flowlane_spst(
        R,
        S,
        H,
        maxh,
        p(inv),
        p(lh),
        p(raw),
        float(alpha),
        verts.size,
        p(order),
        p(verts),
        p(srcs),
        p(ptr),
        p(dests),
        p(out_u),
        p(out_k),
        p(out_a),
        p(out_b),
        cap,
        p(load),
    )
    if n == -1:
        raise PlanError(f"some destination is unreachable within max_depth={S} (check the topology's links)")
    if n < 0:
        raise PlanError(f"C SPST kernel failed with code {n}")
    return out_u[:n].copy(), out_k[:n].copy(), out_a[:n].copy(), out_b[:n].copy(), load


def link_class_breakdown(plan: Plan, lm: LinkModel, unit_bytes: float = 1.0) -> dict[str, float]:
    """Per physical hop kind ("nvlink", "pcie", "qpi", "eth", ...): Σ_k max over the hops of that kind of
    load/bandwidth (Table 7 analogue, seed 001 E3: NVLink time vs the other links' time). Grouped by hop, not by
    logical link: a transfer over a multi-hop route (gpu0 -> gpu5 on a DGX-1: PCIe, QPI, PCIe) counts under each of
    its hops' kinds; :meth:`LinkModel.link_class` names a route by its slowest hop instead."""
    load = stage_hop_loads(plan.stage, plan.src, plan.dst, lm)
    t = load * (unit_bytes * lm.hop_inv_bw)[None, :]
    kinds = np.array(lm.hop_kinds)
    return {k: float(t[:, kinds == k].max(axis=1).sum()) for k in sorted(set(lm.hop_kinds))}
