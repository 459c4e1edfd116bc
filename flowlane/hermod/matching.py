"""Intra-coflow scheduling for imbalanced all-to-all: incast-free phases (seed 000 §5.3.2).

A token matrix ``T[i][j]`` (units sent from EP rank i to EP rank j, e.g. tokens; diagonal = local, ignored) is split
into phases; in each phase the senders and receivers form a (partial) matching, so no receiver has two senders
(no incast) and every flow runs at line rate. With unit port rate the coflow cannot finish before the bottleneck
``L = max(max row sum, max column sum)`` (the Varys bound).

* :func:`bvn_phases` (default): Birkhoff-von Neumann on the matrix padded with idle "dummy" traffic until every row
  and column sums to L; every phase is a perfect matching on the support, weight = its smallest entry. Total phase
  time = L exactly (digest A2.6 [check]); each phase zeroes at least one entry, so at most n^2 phases.
  Which perfect matching each step takes does not change the total but sets the number of phases and their shape.
  ``matching="first"`` (default) is the textbook construction with padding in index order and a matching kept from
  phase to phase: the previous phase's perfect matching minus the pairs it emptied, completed by Kuhn's augmenting
  paths from the rows left unmatched (the first phase: Kuhn's first perfect matching) -- many short phases. A phase
  empties one or a few entries, so it costs one or a few searches instead of n. ``matching="bottleneck"`` takes the
  perfect matching whose smallest entry is largest -- the greedy BvN heuristic (Brualdi; Dufosse & Ucar, "Notes on
  Birkhoff-von Neumann decomposition of doubly stochastic matrices", LAA 2016) -- and pads the largest real entries
  first: ~20-25 % fewer phases at n = 4, ~35 % at n = 8, ~4x fewer at n = 16, but long ones. Minimising the count
  exactly is NP-hard (ibid.). Measured on gloo (``benchmarks.hermod_intra_real``, 8 ranks) the long phases were
  7-24 % *slower* in 8 of 9 settings: gloo completes a send once the kernel has buffered it, so a rank starts phase
  k+1 while its phase-k data still drains and the two share its uplink; capping the socket send buffer
  (``--tcp-wmem``) removes the difference. Hence ``first`` stays the default; ``bottleneck`` is for transports
  whose sends complete on delivery and whose per-phase cost dominates (not timed on a real NCCL fabric yet).
* :func:`algorithm3_phases`: the seed's Algorithm 3 (repeated max-weight matching, weight = min matched positive
  entry -- the digest's reading of lines 9-10). Not optimal: 1.5 L on ``[[0,5,0],[5,0,0],[5,5,0]]`` (digest A2.6).

Both are pure-integer and deterministic (fixed iteration order, no floating point, no library tie-breaking), so every
rank computes the identical plan from the identical matrix -- no synchronisation needed (decisions.md A6.1 #11).

Planning speed (issue 30 item 5): the functions above run a compiled planner (``bvn.c``, built with the system C
compiler on first use, never at import; :func:`planner_impl`) that reproduces the Python reference below phase for
phase, and fall back to that reference where no compiler is available (``impl="python"`` or
``FLOWLANE_HERMOD_NO_C=1`` force it). :func:`plan_all_to_all` also keeps a small LRU cache of plans keyed by the
quantised matrix (diagonal ignored; :func:`plan_cache_info`, ``FLOWLANE_HERMOD_PLAN_CACHE`` entries, default 16).
Measured (``benchmarks/a2a_plan_speed.py``, results/hermod/plan_speed/plan_speed.json): see that file for EP 8-64.
"""

from __future__ import annotations

import ctypes
import os
import threading
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain
from pathlib import Path
from typing import Literal

from .._cbuild import CKernel

Matrix = list[list[int]]
BvnMatching = Literal["first", "bottleneck"]
BVN_MATCHINGS = ("first", "bottleneck")
# which planner runs: the compiled one (bvn.c), the pure-Python reference, or the compiled one where it can be built
Impl = Literal["auto", "c", "python"]
IMPLS = ("auto", "c", "python")


@dataclass(frozen=True)
class Phase:
    """One incast-free sub-phase: ``sends[i] = (j, amount)`` means rank i sends ``amount`` units to rank j.
    ``weight`` is the phase duration in units (>= every amount; dummy padding is idle time)."""

    weight: int
    sends: tuple[tuple[int, int, int], ...]  # (src, dst, amount), amount > 0
    residual: bool = False
    """The last phase of a plan capped at ``max_phases``: every send still left, several per rank (may incast);
    its weight is the residual's own bound (max row or column sum)."""

    def partner_of(self, rank: int) -> tuple[int | None, int, int | None, int]:
        """(dst, amount_sent, src, amount_received) for ``rank`` in this phase (None = idle)."""
        dst = src = None
        a_out = a_in = 0
        for s, d, a in self.sends:
            if s == rank:
                dst, a_out = d, a
            if d == rank:
                src, a_in = s, a
        return dst, a_out, src, a_in


def _check(T: Sequence[Sequence[int]]) -> Matrix:
    n = len(T)
    out: Matrix = []
    for i, row in enumerate(T):
        if len(row) != n:
            raise ValueError(f"token matrix must be square: row {i} has {len(row)} entries, expected {n}")
        r = []
        for j, v in enumerate(row):
            try:
                iv = int(v)
            except (TypeError, ValueError, OverflowError):
                iv = -1  # not a number (or nan/inf): refused below, naming it
            if iv != v or iv < 0:
                raise ValueError(f"token matrix entries must be integers >= 0, got T[{i}][{j}] = {v!r}")
            r.append(0 if i == j else iv)  # diagonal is a local copy (digest A2.6 [rec])
        out.append(r)
    return out


def lower_bound(T: Sequence[Sequence[int]]) -> int:
    """CCT lower bound with unit port rate: max row / column sum, diagonal excluded."""
    M = _check(T)
    n = len(M)
    if n == 0:
        return 0
    return max(max(sum(r) for r in M), max(sum(M[i][j] for i in range(n)) for j in range(n)))


def _perfect_matching(support: list[list[bool]]) -> list[int] | None:
    """Deterministic perfect matching (Kuhn's augmenting paths, rows and columns in index order).
    Returns match[row] = col, or None if the support has none."""
    n = len(support)
    col_of_row, row_of_col = [-1] * n, [-1] * n
    return col_of_row if _complete_matching(support, col_of_row, row_of_col) else None


def _complete_matching(support: list[list[bool]], col_of_row: list[int], row_of_col: list[int]) -> bool:
    """Complete a partial matching in place (Kuhn's augmenting paths from every unmatched row, rows and columns in
    index order, a fresh ``seen`` per row); False if some row has no augmenting path (no perfect matching)."""
    n = len(support)

    def augment(i: int, seen: list[bool]) -> bool:
        for j in range(n):
            if support[i][j] and not seen[j]:
                seen[j] = True
                if row_of_col[j] < 0 or augment(row_of_col[j], seen):
                    row_of_col[j] = i
                    col_of_row[i] = j
                    return True
        return False

    return all(col_of_row[i] >= 0 or augment(i, [False] * n) for i in range(n))


def _bottleneck_matching(M: Matrix) -> list[int] | None:
    """The perfect matching on the positive entries of ``M`` whose smallest entry is largest: binary search over the
    distinct entry values for the highest threshold whose entries still hold a perfect matching."""
    values = sorted({v for row in M for v in row if v > 0})
    best = None
    lo, hi = 0, len(values) - 1
    while lo <= hi:
        mid = (lo + hi) // 2
        match = _perfect_matching([[v >= values[mid] for v in row] for row in M])
        if match is None:
            hi = mid - 1
        else:
            best, lo = match, mid + 1
    return best


def _pad(real: Matrix, L: int, largest_first: bool) -> Matrix:
    """Dummy (idle) traffic that brings every row and column sum of ``real`` to ``L``. Row and column deficits are
    equal in total, so one greedy pass over the cells fills all of them; ``largest_first`` visits the cells by
    decreasing real entry (ties in index order), else in index order."""
    n = len(real)
    rows = [sum(r) for r in real]
    cols = [sum(real[i][j] for i in range(n)) for j in range(n)]
    cells = [(i, j) for i in range(n) for j in range(n)]
    if largest_first:
        cells.sort(key=lambda c: -real[c[0]][c[1]])  # stable: ties stay in index order
    dummy = [[0] * n for _ in range(n)]
    for i, j in cells:
        add = min(L - rows[i], L - cols[j])
        if add > 0:
            dummy[i][j] += add
            rows[i] += add
            cols[j] += add
    return dummy


def bvn_phases(
    T: Sequence[Sequence[int]], matching: BvnMatching = "first", impl: Impl = "auto", max_phases: int = 0
) -> list[Phase]:
    """Birkhoff-von Neumann decomposition of the padded matrix; sum of weights == :func:`lower_bound`.
    ``matching``: which perfect matching each step takes (module docstring): ``first`` (the previous one, repaired) or
    ``bottleneck`` (the largest smallest entry: fewer, longer phases). ``impl``: the compiled planner (``c``), the
    pure-Python one (``python``) or the compiled one where it can be built (``auto``); all give the same phases."""
    if matching not in BVN_MATCHINGS:
        raise ValueError(f"matching {matching!r} is not one of {list(BVN_MATCHINGS)}")
    return _plan(_validated(T), "bvn_bottleneck" if matching == "bottleneck" else "bvn", impl, max_phases)


def _bvn_python(real: Matrix, matching: BvnMatching, max_phases: int = 0) -> list[Phase]:
    """The reference implementation (``real`` checked by :func:`_check`; consumed)."""
    n = len(real)
    L = lower_bound(real)
    if L == 0:
        return []
    dummy = _pad(real, L, largest_first=matching == "bottleneck")
    phases: list[Phase] = []
    # "first": the previous phase's matching minus the pairs it emptied, completed by augmenting paths (bvn.c)
    col_of_row, row_of_col = [-1] * n, [-1] * n
    while True:
        tot = [[real[i][j] + dummy[i][j] for j in range(n)] for i in range(n)]
        if not any(v for r in tot for v in r):
            break
        if max_phases > 0 and len(phases) == max_phases - 1:  # the cap: one residual phase sends what is left
            w_res = lower_bound(real)
            if w_res:
                phases.append(
                    Phase(
                        w_res,
                        tuple((i, j, real[i][j]) for i in range(n) for j in range(n) if real[i][j] > 0),
                        residual=True,
                    )
                )
            break
        if matching == "bottleneck":
            match = _bottleneck_matching(tot)
        else:
            match = (
                col_of_row
                if _complete_matching([[v > 0 for v in r] for r in tot], col_of_row, row_of_col)
                else None
            )
        if match is None:  # cannot happen: a padded matrix is L times a doubly stochastic one (Birkhoff)
            raise RuntimeError("no perfect matching on the support (matrix is not balanced)")
        w = min(tot[i][match[i]] for i in range(n))
        sends = []
        for i, j in enumerate(list(match)):
            a = min(w, real[i][j])  # real traffic first; the rest of the slot is dummy (idle)
            real[i][j] -= a
            dummy[i][j] -= w - a
            if a > 0:
                sends.append((i, j, a))
            if matching != "bottleneck" and real[i][j] + dummy[i][j] == 0:
                col_of_row[i] = row_of_col[j] = -1  # the pair is gone: row i is searched again next phase
        phases.append(Phase(w, tuple(sends)))
    return phases


def _max_weight_assignment(W: Matrix) -> list[int]:
    """Hungarian algorithm (Kuhn-Munkres, O(n^3), integer, deterministic): match[row] = col maximising sum W."""
    n = len(W)
    INF = float("inf")
    cost = [[-W[i][j] for j in range(n)] for i in range(n)]
    # potentials and slacks hold integers; only an initial INF is a float (replaced before any arithmetic)
    u: list[float] = [0] * (n + 1)
    v: list[float] = [0] * (n + 1)
    p = [0] * (n + 1)  # p[col] = row (1-based)
    way = [0] * (n + 1)
    for i in range(1, n + 1):
        p[0] = i
        j0 = 0
        minv: list[float] = [INF] * (n + 1)
        used = [False] * (n + 1)
        while True:
            used[j0] = True
            i0, delta, j1 = p[j0], INF, 0
            for j in range(1, n + 1):
                if not used[j]:
                    cur = cost[i0 - 1][j - 1] - u[i0] - v[j]
                    if cur < minv[j]:
                        minv[j], way[j] = cur, j0
                    if minv[j] < delta:
                        delta, j1 = minv[j], j
            for j in range(n + 1):
                if used[j]:
                    u[p[j]] += delta
                    v[j] -= delta
                else:
                    minv[j] -= delta
            j0 = j1
            if p[j0] == 0:
                break
        while True:
            j1 = way[j0]
            p[j0] = p[j1]
            j0 = j1
            if j0 == 0:
                break
    match = [0] * n
    for j in range(1, n + 1):
        match[p[j] - 1] = j - 1
    return match


def algorithm3_phases(T: Sequence[Sequence[int]], impl: Impl = "auto") -> list[Phase]:
    """Seed 000 Algorithm 3: repeatedly take a maximum-weight matching of the residual matrix and send
    w = min over its matched positive entries on every matched pair (digest A2.6 "matched-min" reading).
    ``impl`` as for :func:`bvn_phases`."""
    return _plan(_validated(T), "alg3", impl)


def _alg3_python(M: Matrix) -> list[Phase]:
    """The reference implementation (``M`` checked by :func:`_check`; consumed)."""
    n = len(M)
    phases: list[Phase] = []
    while any(v for r in M for v in r):
        match = _max_weight_assignment(M)
        w = min(M[i][match[i]] for i in range(n) if M[i][match[i]] > 0)
        sends = []
        for i in range(n):
            j = match[i]
            a = min(w, M[i][j])
            if a > 0:
                M[i][j] -= a
                sends.append((i, j, a))
        phases.append(Phase(w, tuple(sends)))
    return phases


def phases_total(phases: Sequence[Phase]) -> int:
    return sum(p.weight for p in phases)


def check_phases(T: Sequence[Sequence[int]], phases: Sequence[Phase]) -> None:
    """Raise if the phases do not deliver exactly T (off-diagonal) or if any phase has incast / multi-send."""
    M = _check(T)
    n = len(M)
    got = [[0] * n for _ in range(n)]
    for k, ph in enumerate(phases):
        srcs = [s for s, _, _ in ph.sends]
        dsts = [d for _, d, _ in ph.sends]
        if len(set(srcs)) != len(srcs) or len(set(dsts)) != len(dsts):
            raise AssertionError(f"phase {k} is not a matching (incast or multi-send): {ph.sends}")
        for s, d, a in ph.sends:
            if a > ph.weight:
                raise AssertionError(f"phase {k}: amount {a} exceeds the phase weight {ph.weight}")
            got[s][d] += a
    if got != M:
        raise AssertionError(f"phases deliver {got}, expected {M}")


# -- planning an all-to-all (the runtime in flowlane.sched.alltoall runs what these decide) ----------------------------
Algorithm = Literal["bvn", "bvn_bottleneck", "alg3"]
# bvn_bottleneck: BvN with the max-min matching each step (fewer, longer phases; see the module docstring)
ALGORITHMS = ("bvn", "bvn_bottleneck", "alg3")
# what a caller may ask :class:`AllToAllRunner` for: a planner, one all_to_all_single, or measure and keep one
RunAlgorithm = Literal["bvn", "bvn_bottleneck", "alg3", "plain", "auto"]
RUN_ALGORITHMS = (*ALGORITHMS, "plain", "auto")
# what ``auto`` compares by default: one all_to_all_single against the optimal decomposition
AUTO_CANDIDATES = ("plain", "bvn")
PhaseSync = Literal["pairwise", "barrier"]
PHASE_SYNCS = ("pairwise", "barrier")


def needs_matching(group_size: int) -> bool:
    """Whether phases can beat one ``all_to_all_single`` in a group of ``group_size`` ranks. In a group of two every
    rank receives from one peer only, so there is no incast to avoid: the plan of any 2x2 matrix is the single
    exchange ``all_to_all_single`` makes, and gathering the matrix to find that out is a collective round spent for
    nothing (on the real Megatron MoE benchmark, EP 2 at 800 Mbit/s, it cost ~11 % of the iteration). Decided from
    the group size alone, so every rank of the group decides alike."""
    return group_size > 2


def check_candidates(candidates: Sequence[str] | str) -> tuple[str, ...]:
    """``auto``'s candidates as a tuple (a comma-separated string is split): at least two distinct names of
    :data:`ALGORITHMS` or ``plain``."""
    names = (
        tuple(c.strip() for c in candidates.split(",")) if isinstance(candidates, str) else tuple(candidates)
    )
    allowed = (*ALGORITHMS, "plain")
    bad = [c for c in names if c not in allowed]
    if bad or len(names) < 2 or len(set(names)) != len(names):
        raise ValueError(
            f"auto candidates {list(names)} must be two or more distinct names of {list(allowed)}"
        )
    return names


def plan_all_to_all(
    matrix: Sequence[Sequence[int]],
    quantum: int = 1,
    algorithm: Algorithm = "bvn",
    impl: Impl = "auto",
    cache: bool = True,
    max_phases: int = 0,
) -> list[Phase]:
    """Phases for ``matrix[i][j]`` rows from group rank i to j, planned in units of ``quantum`` rows (ceil), which
    bounds the number of phases (digest A2.6 "Units"). ``impl`` as for :func:`bvn_phases`. ``cache``: look the
    quantised matrix up in the bounded plan cache first (:func:`plan_cache_info`); a hit returns the same phases
    (a new list of the same immutable :class:`Phase` objects)."""
    return list(_planned(matrix, quantum, algorithm, impl, cache, max_phases).phases())


def plan_for_rank(
    matrix: Sequence[Sequence[int]],
    rank: int,
    quantum: int = 1,
    algorithm: Algorithm = "bvn",
    impl: Impl = "auto",
    cache: bool = True,
    max_phases: int = 0,
) -> RankPlan:
    """Group rank ``rank``'s part of :func:`plan_all_to_all`'s plan (same arguments, same cache): what the runtime
    sends and receives. Cut from the planner's flat arrays without a Python object per send, so planning costs the
    compiled planner plus a few array operations (issue 30 item 5: <= 1 ms per all-to-all at EP 32)."""
    n = len(matrix)
    if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < n:
        raise ValueError(f"rank {rank!r} is not a rank of the {n}x{n} matrix (0..{n - 1})")
    return _planned(matrix, quantum, algorithm, impl, cache, max_phases).for_rank(rank)


def _planned(
    matrix: Sequence[Sequence[int]], quantum: int, algorithm: str, impl: str, cache: bool, max_phases: int
) -> _PlanArrays:
    if not isinstance(quantum, int) or quantum < 1:
        raise ValueError(f"quantum must be an integer >= 1, got {quantum!r}")
    if not isinstance(max_phases, int) or isinstance(max_phases, bool) or max_phases < 0:
        raise ValueError(f"max_phases must be an integer >= 0 (0: no cap), got {max_phases!r}")
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm {algorithm!r} is not one of {list(ALGORITHMS)}")
    if impl not in IMPLS:
        raise ValueError(f"impl {impl!r} is not one of {list(IMPLS)}")
    # checked before quantising: a ceil of int(x) would turn 2.5 into 3 instead of naming it
    v: tuple[int, array] | Matrix = _validated(matrix)
    if quantum > 1:
        if isinstance(v, tuple):
            v = (v[0], array("q", [-(-x // quantum) for x in v[1]]))
        else:  # entries beyond int64: quantising may bring them back into range
            v = _validated([[-(-x // quantum) for x in row] for row in v])
    if not cache or _CACHE.maxsize == 0 or not isinstance(v, tuple):
        return _plan_arrays(v, algorithm, impl, max_phases)  # type: ignore[arg-type]
    key = (algorithm, max_phases, v[0], v[1].tobytes())
    hit = _CACHE.get(key)
    if hit is not None:
        return hit
    plan = _plan_arrays(v, algorithm, impl, max_phases)  # type: ignore[arg-type]
    _CACHE.put(key, plan)
    return plan


@dataclass(frozen=True)
class RankPlan:
    """One rank's part of a plan (:func:`plan_for_rank`), in phase order: it sends ``send_units[k]`` units to
    ``send_peer[k]`` in phase ``send_phase[k]`` and receives ``recv_units[k]`` from ``recv_peer[k]`` in phase
    ``recv_phase[k]``. A matched phase gives a rank at most one of each; a capped plan's residual (its last phase,
    ``residual``) may give several. ``len()`` is the plan's phase count."""

    num_phases: int
    residual: bool
    send_phase: tuple[int, ...]
    send_peer: tuple[int, ...]
    send_units: tuple[int, ...]
    recv_phase: tuple[int, ...]
    recv_peer: tuple[int, ...]
    recv_units: tuple[int, ...]

    def __len__(self) -> int:
        return self.num_phases

    def steps(self) -> list[tuple[int, list[tuple[int, int]], list[tuple[int, int]]]]:
        """(phase, [(peer, units) sent], [(peer, units) received]) for every phase this rank takes part in."""
        out: dict[int, tuple[list[tuple[int, int]], list[tuple[int, int]]]] = {}
        for k, peer, u in zip(self.send_phase, self.send_peer, self.send_units, strict=True):
            out.setdefault(k, ([], []))[0].append((peer, u))
        for k, peer, u in zip(self.recv_phase, self.recv_peer, self.recv_units, strict=True):
            out.setdefault(k, ([], []))[1].append((peer, u))
        return [(k, *out[k]) for k in sorted(out)]


class _PlanArrays:
    """A whole plan as the compiled planner writes it: phase ``k`` has weight ``weights[k]`` and the sends
    ``starts[k]:starts[k+1]`` of the flat ``src``/``dst``/``amt`` arrays. :class:`Phase` objects are built once, on
    first ask (``phases``); a rank's part (``for_rank``) never builds them."""

    def __init__(self, weights, counts, src, dst, amt, residual: bool) -> None:  # noqa: ANN001 - numpy int arrays
        import numpy as np

        self.weights, self.src, self.dst, self.amt, self.residual = weights, src, dst, amt, residual
        self.phase_of = np.repeat(np.arange(len(counts), dtype=np.int32), counts)
        self.starts = np.concatenate(([0], np.cumsum(counts))).tolist()
        self._phases: tuple[Phase, ...] | None = None

    @classmethod
    def of_phases(cls, phases: Sequence[Phase]) -> _PlanArrays:
        import numpy as np

        sends = [x for ph in phases for x in ph.sends]
        try:
            cols, weights = (
                np.array(sends, dtype=np.int64).reshape(-1, 3),
                np.array([ph.weight for ph in phases], dtype=np.int64),
            )
        except OverflowError:  # the Python planner takes entries beyond int64: keep them as Python ints
            cols = np.array(sends, dtype=object).reshape(-1, 3)
            weights = np.array([ph.weight for ph in phases], dtype=object)
        plan = cls(
            weights,
            np.array([len(ph.sends) for ph in phases], dtype=np.int64),
            cols[:, 0],
            cols[:, 1],
            cols[:, 2],
            bool(phases) and phases[-1].residual,
        )
        plan._phases = tuple(phases)  # the Python planner's own objects
        return plan

    def phases(self) -> tuple[Phase, ...]:
        if self._phases is None:
            sends = list(zip(self.src.tolist(), self.dst.tolist(), self.amt.tolist(), strict=True))
            st, last = self.starts, len(self.weights) - 1
            self._phases = tuple(
                Phase(w, tuple(sends[st[k] : st[k + 1]]), residual=self.residual and k == last)
                for k, w in enumerate(self.weights.tolist())
            )
        return self._phases

    def for_rank(self, me: int) -> RankPlan:
        s, d = self.src == me, self.dst == me
        return RankPlan(
            len(self.weights),
            self.residual,
            tuple(self.phase_of[s].tolist()),
            tuple(self.dst[s].tolist()),
            tuple(self.amt[s].tolist()),
            tuple(self.phase_of[d].tolist()),
            tuple(self.src[d].tolist()),
            tuple(self.amt[d].tolist()),
        )


# -- the compiled planner (bvn.c) and the plan cache ----------------------------------------------------------------
# the kernel's input contract (bvn.c header): n * max entry <= 2^50, so no sum or potential overflows int64
_C_LIMIT = 1 << 50
# portable flags only (the cached .so is keyed by source + flags, not by the CPU it was built on)
_CFLAGS = ("-O2", "-shared", "-fPIC")


def _declare(lib: ctypes.CDLL) -> None:
    P, L, N = ctypes.c_void_p, ctypes.c_long, ctypes.c_int
    lib.flowlane_bvn.restype = L
    lib.flowlane_bvn.argtypes = [N, P, N, L, L, P, P, P, P, P, L, P]
    lib.flowlane_alg3.restype = L
    lib.flowlane_alg3.argtypes = [N, P, L, L, P, P, P, P, P]


_KERNEL = CKernel(
    Path(__file__).with_name("bvn.c"),
    "bvn",
    _CFLAGS,
    _declare,
    "flowlane.hermod: C phase planner",
    "using the pure-Python planner (same plans, slower)",
)


def _kernel() -> ctypes.CDLL | None:
    """The compiled planner, built on first use; None where it cannot be built or ``FLOWLANE_HERMOD_NO_C=1``."""
    if os.environ.get("FLOWLANE_HERMOD_NO_C", "") not in ("", "0"):
        return None
    return _KERNEL.load()


def planner_impl() -> str:
    """Which implementation ``impl="auto"`` runs here: ``c`` or ``python`` (builds the kernel on first call)."""
    return "c" if _kernel() is not None else "python"


def _fast_ints(T: Sequence[Sequence[int]]) -> tuple[int, array] | None:
    """(n, row-major int64 array, diagonal zeroed) when ``T`` is square with integer entries in [0, 2^63), in C
    speed; None otherwise (the caller then runs :func:`_check`, which accepts what it always accepted, e.g. 2.0,
    and names the offending entry of anything it refuses)."""
    n = len(T)
    try:
        if any(len(r) != n for r in T):
            return None
        flat = array("q", chain.from_iterable(T))
    except (TypeError, ValueError, OverflowError):
        return None
    if n and min(flat) < 0:
        return None
    for i in range(0, n * n, n + 1):
        flat[i] = 0
    return n, flat


def _validated(T: Sequence[Sequence[int]]) -> tuple[int, array] | Matrix:
    """A checked matrix: the fast form of :func:`_fast_ints`, or :func:`_check`'s lists (raises on bad input)."""
    v = _fast_ints(T)
    if v is not None:
        return v
    M = _check(T)
    try:
        return len(M), array("q", chain.from_iterable(M))
    except OverflowError:  # entries beyond int64: only the Python planner takes them
        return M


def _plan(v: tuple[int, array] | Matrix, algorithm: str, impl: Impl, max_phases: int = 0) -> list[Phase]:
    return list(_plan_arrays(v, algorithm, impl, max_phases).phases())


def _plan_arrays(
    v: tuple[int, array] | Matrix, algorithm: str, impl: Impl, max_phases: int = 0
) -> _PlanArrays:
    if impl not in IMPLS:
        raise ValueError(f"impl {impl!r} is not one of {list(IMPLS)}")
    if max_phases and algorithm == "alg3":
        raise ValueError("max_phases caps Birkhoff-von Neumann plans (bvn, bvn_bottleneck), not alg3")
    if isinstance(v, tuple):
        n, flat = v
        if n == 0:
            return _PlanArrays.of_phases([])
        fits = max(flat) * n <= _C_LIMIT
        lib = _kernel() if impl != "python" and fits else None
        if lib is not None:
            return _plan_c(lib, n, flat, algorithm, max_phases)
        if impl == "c":
            why = (
                "the C planner could not be built (no C compiler, or FLOWLANE_HERMOD_NO_C=1)"
                if fits
                else f"entries up to {max(flat)} exceed the C planner's range (n * max entry <= 2^50)"
            )
            raise ValueError(f"impl='c' requested but {why}")
        M = [flat[i * n : (i + 1) * n].tolist() for i in range(n)]
    else:
        if impl == "c":
            raise ValueError("impl='c' requested but the matrix has entries beyond int64")
        M = v
    if algorithm == "alg3":
        return _PlanArrays.of_phases(_alg3_python(M))
    return _PlanArrays.of_phases(
        _bvn_python(M, "bottleneck" if algorithm == "bvn_bottleneck" else "first", max_phases)
    )


def _plan_c(lib: ctypes.CDLL, n: int, flat: array, algorithm: str, max_phases: int = 0) -> _PlanArrays:
    import numpy as np

    cap_p = n * n + 1  # every phase zeroes an entry of the (padded) matrix: at most n^2 phases
    cap_s = n * n * n if n <= 64 else 16 * n * n
    residual = ctypes.c_int32(0)
    while True:  # uninitialised buffers: the kernel writes what it returns
        wb, ab = np.empty(cap_p, np.int64), np.empty(cap_s, np.int64)
        cb, sb, db = np.empty(cap_p, np.int32), np.empty(cap_s, np.int32), np.empty(cap_s, np.int32)
        outs = (wb.ctypes.data, cb.ctypes.data, sb.ctypes.data, db.ctypes.data, ab.ctypes.data)
        if algorithm == "alg3":
            r = lib.flowlane_alg3(n, flat.buffer_info()[0], cap_p, cap_s, *outs)
        else:
            r = lib.flowlane_bvn(
                n,
                flat.buffer_info()[0],
                int(algorithm == "bvn_bottleneck"),
                cap_p,
                cap_s,
                *outs,
                max_phases,
                ctypes.byref(residual),
            )
        if r == -4 and cap_s < n * n * n:
            cap_s = n * n * n
            continue
        break
    if r < 0:
        why = {-1: "out of memory", -2: "no perfect matching on the support (matrix is not balanced)"}
        raise RuntimeError(
            f"C phase planner failed ({r}: {why.get(r, 'output buffer too small')}) on a {n}x{n} matrix"
        )
    counts = cb[:r].astype(np.int64)
    m = int(counts.sum())
    return _PlanArrays(
        wb[:r].copy(), counts, sb[:m].copy(), db[:m].copy(), ab[:m].copy(), bool(residual.value)
    )


class _PlanCache:
    """Bounded LRU of plans keyed by (algorithm, n, quantised matrix bytes, diagonal zeroed); thread-safe."""

    def __init__(self, maxsize: int) -> None:
        self.maxsize, self.hits, self.misses = maxsize, 0, 0
        self._d: OrderedDict[tuple, _PlanArrays] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: tuple) -> _PlanArrays | None:
        with self._lock:
            hit = self._d.get(key)
            if hit is None:
                self.misses += 1
            else:
                self.hits += 1
                self._d.move_to_end(key)
            return hit

    def put(self, key: tuple, plan: _PlanArrays) -> None:
        with self._lock:
            self._d[key] = plan
            self._d.move_to_end(key)
            while len(self._d) > self.maxsize:
                self._d.popitem(last=False)


# an EP-32 plan of ~900 phases holds ~17k sends (~1.5 MB of Python objects): keep the default small
_CACHE = _PlanCache(int(os.environ.get("FLOWLANE_HERMOD_PLAN_CACHE", "16")))


def plan_cache_info() -> dict[str, int]:
    """``hits``, ``misses``, ``size`` and ``maxsize`` of the plan cache of :func:`plan_all_to_all`."""
    with _CACHE._lock:
        return {
            "hits": _CACHE.hits,
            "misses": _CACHE.misses,
            "size": len(_CACHE._d),
            "maxsize": _CACHE.maxsize,
        }


def plan_cache_clear(maxsize: int | None = None) -> None:
    """Empty the plan cache and zero its counters; ``maxsize`` (>= 0, 0 = no caching) resizes it."""
    if maxsize is not None and (not isinstance(maxsize, int) or maxsize < 0):
        raise ValueError(f"plan cache maxsize must be an integer >= 0, got {maxsize!r}")
    with _CACHE._lock:
        _CACHE._d.clear()
        _CACHE.hits = _CACHE.misses = 0
        if maxsize is not None:
            _CACHE.maxsize = maxsize
