"""Intra-coflow scheduling for imbalanced all-to-all: incast-free phases (seed 000 §5.3.2).

A token matrix ``T[i][j]`` (units sent from EP rank i to EP rank j, e.g. tokens; diagonal = local, ignored) is split
into phases; in each phase the senders and receivers form a (partial) matching, so no receiver has two senders
(no incast) and every flow runs at line rate. With unit port rate the coflow cannot finish before the bottleneck
``L = max(max row sum, max column sum)`` (the Varys bound).

* :func:`bvn_phases` (default): Birkhoff-von Neumann on the matrix padded with idle "dummy" traffic until every row
  and column sums to L; every phase is a perfect matching on the support, weight = its smallest entry. Total phase
  time = L exactly (digest A2.6 [check]); each phase zeroes at least one entry, so at most n^2 phases.
  Which perfect matching each step takes does not change the total but sets the number of phases and their shape.
  ``matching="first"`` (default) is the textbook construction: the first perfect matching Kuhn's algorithm finds,
  padding in index order -- many short phases (~48 on an 8x8 dispatch matrix). ``matching="bottleneck"`` takes the
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
rank computes the identical plan from the identical matrix -- no synchronisation needed (digest A6.1 #11).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

Matrix = list[list[int]]
BvnMatching = Literal["first", "bottleneck"]
BVN_MATCHINGS = ("first", "bottleneck")


@dataclass(frozen=True)
class Phase:
    """One incast-free sub-phase: ``sends[i] = (j, amount)`` means rank i sends ``amount`` units to rank j.
    ``weight`` is the phase duration in units (>= every amount; dummy padding is idle time)."""

    weight: int
    sends: tuple[tuple[int, int, int], ...]  # (src, dst, amount), amount > 0

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
            iv = int(v)
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
    col_of_row = [-1] * n
    row_of_col = [-1] * n

    def augment(i: int, seen: list[bool]) -> bool:
        for j in range(n):
            if support[i][j] and not seen[j]:
                seen[j] = True
                if row_of_col[j] < 0 or augment(row_of_col[j], seen):
                    row_of_col[j] = i
                    col_of_row[i] = j
                    return True
        return False

    for i in range(n):
        if not augment(i, [False] * n):
            return None
    return col_of_row


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


def bvn_phases(T: Sequence[Sequence[int]], matching: BvnMatching = "first") -> list[Phase]:
    """Birkhoff-von Neumann decomposition of the padded matrix; sum of weights == :func:`lower_bound`.
    ``matching``: which perfect matching each step takes (module docstring): ``first`` (the first one found) or
    ``bottleneck`` (the largest smallest entry: fewer, longer phases)."""
    if matching not in BVN_MATCHINGS:
        raise ValueError(f"matching {matching!r} is not one of {list(BVN_MATCHINGS)}")
    real = _check(T)
    n = len(real)
    L = lower_bound(real)
    if L == 0:
        return []
    dummy = _pad(real, L, largest_first=matching == "bottleneck")
    phases: list[Phase] = []
    while True:
        tot = [[real[i][j] + dummy[i][j] for j in range(n)] for i in range(n)]
        if not any(v for r in tot for v in r):
            break
        match = _bottleneck_matching(tot) if matching == "bottleneck" else \
            _perfect_matching([[v > 0 for v in r] for r in tot])
        if match is None:  # cannot happen: a padded matrix is L times a doubly stochastic one (Birkhoff)
            raise RuntimeError("no perfect matching on the support (matrix is not balanced)")
        w = min(tot[i][match[i]] for i in range(n))
        sends = []
        for i in range(n):
            j = match[i]
            a = min(w, real[i][j])  # real traffic first; the rest of the slot is dummy (idle)
            real[i][j] -= a
            dummy[i][j] -= w - a
            if a > 0:
                sends.append((i, j, a))
        phases.append(Phase(w, tuple(sends)))
    return phases


def _max_weight_assignment(W: Matrix) -> list[int]:
    """Hungarian algorithm (Kuhn-Munkres, O(n^3), integer, deterministic): match[row] = col maximising sum W."""
    n = len(W)
    INF = float("inf")
    cost = [[-W[i][j] for j in range(n)] for i in range(n)]
    u = [0] * (n + 1)
    v = [0] * (n + 1)
    p = [0] * (n + 1)  # p[col] = row (1-based)
    way = [0] * (n + 1)
    for i in range(1, n + 1):
        p[0] = i
        j0 = 0
        minv = [INF] * (n + 1)
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


def algorithm3_phases(T: Sequence[Sequence[int]]) -> list[Phase]:
    """Seed 000 Algorithm 3: repeatedly take a maximum-weight matching of the residual matrix and send
    w = min over its matched positive entries on every matched pair (digest A2.6 "matched-min" reading)."""
    M = _check(T)
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
    names = tuple(c.strip() for c in candidates.split(",")) if isinstance(candidates, str) else tuple(candidates)
    allowed = (*ALGORITHMS, "plain")
    bad = [c for c in names if c not in allowed]
    if bad or len(names) < 2 or len(set(names)) != len(names):
        raise ValueError(f"auto candidates {list(names)} must be two or more distinct names of {list(allowed)}")
    return names


def plan_all_to_all(matrix: Sequence[Sequence[int]], quantum: int = 1, algorithm: Algorithm = "bvn") -> list[Phase]:
    """Phases for ``matrix[i][j]`` rows from group rank i to j, planned in units of ``quantum`` rows (ceil), which
    bounds the number of phases (digest A2.6 "Units")."""
    if not isinstance(quantum, int) or quantum < 1:
        raise ValueError(f"quantum must be an integer >= 1, got {quantum!r}")
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm {algorithm!r} is not one of {list(ALGORITHMS)}")
    q = [[-(-int(v) // quantum) for v in row] for row in matrix]
    if algorithm == "alg3":
        return algorithm3_phases(q)
    return bvn_phases(q, "bottleneck" if algorithm == "bvn_bottleneck" else "first")
