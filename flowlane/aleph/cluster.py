"""Worker clustering for hierarchical aggregation: M-WCHA (seed 002 Alg. 1) and exact optima to judge it by.

The HA problem (§4.1, Eq. 1; digest §2.3): choose aggregators D and disjoint clusters V_w (w in D, w in V_w) covering
every worker so that each aggregator's cluster has at most g_w other members, where

    g_w = floor(min(B_w / b - 1, C_w / c)),   clamped at >= 0      (bandwidth: (1+g_w)*b <= B_w; CPU: g_w*c <= C_w)

and a member must be adjacent to its aggregator. Minimise |D|: every cluster is one flow into the PS, and a worker
that sends straight to the PS is a singleton cluster (digest §2.3's reading, which Table 1 and the seed's Sec. 6.4
Fig. 13 confirm: 188 Gbit/s of worker and 12 of PS usage are (2n - |D|) * b and |D| * b with |D| = 12; digest §3.5).

Choices where the paper is silent or off by one (digest §5.1): capacities are floored; N(w) is the *open*
neighbourhood restricted to unclustered workers (#3); the 2-hop comparison is over unclustered workers and ties make
both candidates (#5); m < 1 is clipped (1/m <= 1) and a candidate with no non-candidate neighbour uses m = 1 (#6);
the paper's random assignment is hard-capped at the capacity and selected candidates are processed in a seeded,
capacity-descending order (#7); ``max_empty_rounds`` empty rounds before the rest go direct (#8); with ``ps_gbps``, the
PS check |D|*b <= P, b lowered to P/|D| and the plan re-made where it fails (#12, :func:`plan_with_rate`).

Adjacency is a plug-in (#9): :func:`adjacency_complete`, :func:`adjacency_same_switch`, :func:`adjacency_rtt`, or any
list of neighbour sets. The exact optimum: closed form on a complete graph or disjoint cliques, brute force (subsets
of aggregators + a capacitated matching) for n <= 14 otherwise.
"""

from __future__ import annotations

import itertools
import logging
import math
import random
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from flowlane.aleph.config import AlephConfig
from flowlane.aleph.model import plan_rate, ps_feasibility, ps_head

log = logging.getLogger("flowlane.aleph")

Neighbours = list[frozenset[int]]
"""Open neighbourhoods: ``adj[w]`` is the set of workers w can aggregate or be aggregated by (never w itself)."""

BRUTE_FORCE_MAX_N = 14


@dataclass(frozen=True)
class Cluster:
    """One aggregation cluster: ``head`` (the aggregator, or the worker itself for a singleton) and its members
    (``members[0] == head``)."""

    head: int
    members: tuple[int, ...]


@dataclass(frozen=True)
class Plan:
    """A clustering of workers 0..n-1 (the paper's D and V_w). ``clusters`` are sorted by head."""

    n: int
    clusters: tuple[Cluster, ...]

    @property
    def num_flows(self) -> int:
        """|D|: flows into the PS (aggregators plus workers that send directly)."""
        return len(self.clusters)

    @property
    def heads(self) -> tuple[int, ...]:
        return tuple(c.head for c in self.clusters)

    def cluster_of(self, w: int) -> Cluster:
        for c in self.clusters:
            if w in c.members:
                return c
        raise ValueError(f"worker {w} is in no cluster of this plan (n={self.n})")

    def to_dict(self) -> dict[str, object]:
        return {
            "n": self.n,
            "num_flows": self.num_flows,
            "clusters": [{"head": c.head, "members": list(c.members)} for c in self.clusters],
        }

    @classmethod
    def from_clusters(cls, n: int, clusters: Mapping[int, Sequence[int]] | Sequence[Sequence[int]]) -> Plan:
        """From ``{head: members}`` or a list of member lists (the first is the head); checks it partitions 0..n-1."""
        items = clusters.items() if isinstance(clusters, Mapping) else [(ms[0], ms) for ms in clusters]
        out = []
        for head, ms in items:
            rest = sorted(set(ms) - {head})
            out.append(Cluster(int(head), (int(head), *rest)))
        seen = [w for c in out for w in c.members]
        if sorted(seen) != list(range(n)):
            raise ValueError(
                f"clusters {[list(c.members) for c in out]} do not partition workers 0..{n - 1} "
                f"exactly once each"
            )
        return cls(n, tuple(sorted(out, key=lambda c: c.head)))

    def violations(self, capacity: Sequence[int], adj: Neighbours | None = None) -> list[str]:
        """Why this plan breaks Eq. 1 under ``capacity`` (and ``adj``): an empty list when it is feasible."""
        bad = []
        for c in self.clusters:
            if len(c.members) - 1 > capacity[c.head]:
                bad.append(
                    f"aggregator {c.head} has {len(c.members) - 1} members > capacity {capacity[c.head]}"
                )
            if adj is not None:
                bad += [
                    f"member {m} is not adjacent to aggregator {c.head}"
                    for m in c.members[1:]
                    if m not in adj[c.head]
                ]
        return bad


# --- adjacency plug-ins (digest §5.1 #9) ---------------------------------------------------------------------------


def adjacency_complete(n: int) -> Neighbours:
    """Every worker can reach every other (one datacentre switch fabric)."""
    _check_n(n)
    everyone = frozenset(range(n))
    return [everyone - {w} for w in range(n)]


def adjacency_same_switch(switch_of: Sequence[int]) -> Neighbours:
    """Workers are adjacent when they hang off the same switch (ToR/leaf): "one gradient hop" (Sec. 6.4)."""
    _check_n(len(switch_of))
    by: dict[int, set[int]] = {}
    for w, s in enumerate(switch_of):
        by.setdefault(s, set()).add(w)
    return [frozenset(by[s] - {w}) for w, s in enumerate(switch_of)]


def adjacency_rtt(rtt_ms: Sequence[Sequence[float]], threshold_ms: float) -> Neighbours:
    """Workers are adjacent when their measured round-trip time is at most ``threshold_ms`` (both directions)."""
    n = len(rtt_ms)
    _check_n(n)
    if any(len(row) != n for row in rtt_ms):
        raise ValueError(
            f"rtt_ms must be an n x n matrix (n={n}); got row lengths {[len(r) for r in rtt_ms]}"
        )
    if not threshold_ms > 0:
        raise ValueError(f"threshold_ms={threshold_ms!r} must be > 0")
    return [
        frozenset(j for j in range(n) if j != i and max(rtt_ms[i][j], rtt_ms[j][i]) <= threshold_ms)
        for i in range(n)
    ]


def _check_n(n: int) -> None:
    if not (isinstance(n, int) and n >= 1):
        raise ValueError(f"number of workers must be an integer >= 1, got {n!r}")


def _check_adj(adj: Neighbours, n: int) -> None:
    if len(adj) != n:
        raise ValueError(f"adjacency has {len(adj)} entries, expected one per worker (n={n})")
    for w, nb in enumerate(adj):
        if w in nb:
            raise ValueError(f"adjacency of worker {w} contains itself; neighbourhoods are open")
        for x in nb:
            if not 0 <= x < n:
                raise ValueError(f"adjacency of worker {w} names worker {x}, outside 0..{n - 1}")
            if w not in adj[x]:
                raise ValueError(f"adjacency is not symmetric: {x} in adj[{w}] but {w} not in adj[{x}]")


# --- capacity (Eq. 1) ---------------------------------------------------------------------------------------------


def capacities(
    bandwidth: Sequence[float], b: float | None = None, cpu: Sequence[float] | None = None, c: float = 0.0
) -> list[int]:
    """g_w = floor(min(B_w/b - 1, C_w/c)) clamped at 0; ``b`` defaults to min B (§4.1); c = 0 ignores CPU, c > 0
    needs ``cpu`` (C_w, one per worker)."""
    if c > 0 and cpu is None:  # C_w/c cannot be formed: refused, not planned as if CPU were free
        raise ValueError(
            f"cpu_per_member={c!r} needs the workers' CPU figures (cpu=[C_w, ...], one per worker) to limit capacity; "
            "give them or set cpu_per_member=0"
        )
    if not bandwidth:
        raise ValueError("bandwidth must name at least one worker")
    if any(not x > 0 for x in bandwidth):
        raise ValueError(f"every worker bandwidth must be > 0, got {list(bandwidth)}")
    b = min(bandwidth) if b is None else b
    if not b > 0:
        raise ValueError(f"b={b!r} must be > 0")
    if cpu is not None and len(cpu) != len(bandwidth):
        raise ValueError(f"cpu has {len(cpu)} entries, bandwidth {len(bandwidth)}: one per worker")
    out = []
    for i, bw in enumerate(bandwidth):
        g = bw / b - 1
        if c > 0 and cpu is not None:  # (cpu is given whenever c > 0, checked above)
            g = min(g, cpu[i] / c)
        out.append(max(0, math.floor(g + 1e-9)))  # 1e-9: 30/10 - 1 must floor to 2, not 1.999...
    return out


# --- M-WCHA (Alg. 1) ----------------------------------------------------------------------------------------------


def _rounded(g: int) -> int:
    """Eq. 3: the smallest power of two >= g; 0 stays 0 (a worker that can aggregate nobody is never a CA)."""
    return 0 if g <= 0 else 1 << (g - 1).bit_length()


def mwcha(
    capacity: Sequence[int],
    adj: Neighbours,
    variant: Literal["paper", "fill"] = "fill",
    seed: int = 0,
    max_empty_rounds: int = 5,
) -> Plan:
    """M-WCHA (Alg. 1) on capacities g_w and open neighbourhoods ``adj``; seeded, so the same inputs give the same
    plan on every rank."""
    n = len(capacity)
    _check_adj(adj, n)
    AlephConfig(variant=variant, max_empty_rounds=max_empty_rounds)  # validates the two
    rng = random.Random(seed)
    heads: dict[int, set[int]] = {}
    clustered: set[int] = set()
    empty = 0
    while len(clustered) < n:
        U = set(range(n)) - clustered
        nbU = {w: adj[w] & U for w in U}
        # Step 1 (Eqs. 2-3)
        gbar = {w: min(capacity[w], len(nbU[w])) for w in U}
        ghat = {w: _rounded(gbar[w]) for w in U}
        # Step 2: candidates have the largest rounded capacity among unclustered workers within 2 hops (ties allowed)
        # (max over 1 hop, then over 1 hop of that = max over 2 hops: O(edges), not O(n * edges))
        one = {x: max([ghat[x], *(ghat[y] for y in nbU[x])]) for x in U}
        cas = [w for w in sorted(U) if ghat[w] > 0 and ghat[w] >= max([one[w], *(one[x] for x in nbU[w])])]
        if not cas:  # nobody can aggregate anyone any more: the rest send straight to the PS
            break
        ca_set = set(cas)
        # Step 3 (Eqs. 5-6)
        alpha = {w: gbar[w] / len(nbU[w]) for w in cas}
        beta = {x: sum(alpha[w] for w in adj[x] & ca_set) for x in U - ca_set}
        selected = []
        for w in cas:
            bs = [beta[x] for x in sorted(nbU[w]) if x in beta]
            m = statistics.median(bs) if bs else 1.0
            if rng.random() < (min(1.0, 1.0 / m) if m > 0 else 1.0):  # line 19, 1/m clipped (digest §5.1 #6)
                selected.append(w)
        if not selected:
            empty += 1
            if empty >= max_empty_rounds:
                break
            continue
        empty = 0
        order = sorted(selected, key=lambda w: (-capacity[w], rng.random()))
        for w in order:
            if w in clustered:  # absorbed by an aggregator processed earlier in this round
                continue
            heads[w] = {w}
            clustered.add(w)
            cand = sorted(x for x in nbU[w] if x not in clustered)
            if variant == "paper":
                rng.shuffle(cand)
                members = [x for x in cand if rng.random() < alpha[w]][: gbar[w]]
            else:
                members = sorted(cand, key=lambda x: (capacity[x], rng.random()))[: gbar[w]]
            heads[w] |= set(members)
            clustered |= set(members)
    for w in set(range(n)) - clustered:
        heads[w] = {w}
    return Plan.from_clusters(n, {h: sorted(ms) for h, ms in heads.items()})


def plan_clusters(
    bandwidth: Sequence[float],
    adj: Neighbours | None = None,
    config: AlephConfig | None = None,
    cpu: Sequence[float] | None = None,
) -> Plan:
    """The control plane's entry point: capacities from ``bandwidth`` (Gbit/s, one per worker) and ``config``, then
    M-WCHA over ``adj`` (default: complete); with ``config.ps_gbps``, re-planned at a lower b while |D|*b exceeds the
    PS (:func:`plan_with_rate`)."""
    return plan_with_rate(bandwidth, adj, config, cpu)[0]


def planned_rate(plan: Plan, bandwidth: Sequence[float], config: AlephConfig | None = None) -> float:
    """The b that Eq. 1's capacities are checked at for ``plan``: the paper's b (``b_gbps``, or min B), or with
    ``ps_gbps`` min(b, the flow model's lockstep rate: members B_m, aggregators B_h/(k+1), the PS P/|D|)
    (:func:`flowlane.aleph.model.plan_rate`; digest §5.1 #12). Never lowered by ``top="ps"``'s PS head: the
    capacities grow as b falls, so a plan overloaded at b would pass at that lower rate."""
    config = config or AlephConfig()
    b = min(bandwidth) if config.b_gbps is None else config.b_gbps
    return b if config.ps_gbps is None else min(b, plan_rate(plan, bandwidth, config.ps_gbps))


def flow_rate(plan: Plan, bandwidth: Sequence[float], config: AlephConfig | None = None) -> float:
    """The rate b every flow of ``plan`` gets under ``bandwidth``: :func:`planned_rate` (without ``top="ps"`` the
    capacities guarantee it at every aggregator of a plan made at that b). With ``top="ps"`` it is at most the
    plan's full lockstep rate with one PS on :func:`flowlane.aleph.model.ps_head` (members B_m, aggregators
    B_h/(k+1), and B_h/(k_h + |D| - 1) on that head, whose links also carry the PS's |D| - 1 other flows, which the
    capacities do not count), the same for the plan in force and a fresh one. It models that one head only: not
    several PSes, an explicit ``ps=`` position, nor the UDP tier (whose PS is the first head)."""
    config = config or AlephConfig()
    rate = planned_rate(plan, bandwidth, config)
    if config.top == "ps":
        rate = min(rate, plan_rate(plan, bandwidth, math.inf, ps_head=ps_head(plan, bandwidth)))
    return rate


def plan_with_rate(
    bandwidth: Sequence[float],
    adj: Neighbours | None = None,
    config: AlephConfig | None = None,
    cpu: Sequence[float] | None = None,
) -> tuple[Plan, float]:
    """:func:`plan_clusters`'s plan and its rate per flow (:func:`flow_rate`).

    With ``config.ps_gbps`` = P, the PS check of digest §5.1 #12 (Eq. 1 has no PS budget): when the plan's |D| flows
    at b exceed P, b is lowered to P/|D| as the digest says, and the plan re-made (capacities B_w/b - 1 grow, so
    aggregators take more members and |D| falls). One step to P/|D| can overshoot: from a large |D| the capacities
    balloon into one cluster while a b = P/k in between keeps more, faster flows (measured: 14 of 400 random cases,
    down to 0.55x of the best rate). So every b = P/k below the paper's b, k = 1..n, is planned (at most n M-WCHA
    runs), and the plan with the highest rate is kept, fewest flows on a tie. The outcome is logged (logger
    ``flowlane.aleph``)."""
    config = config or AlephConfig()

    def make(b: float | None) -> Plan:
        g = capacities(bandwidth, b, cpu, config.cpu_per_member)
        neighbours = adjacency_complete(len(g)) if adj is None else adj
        return mwcha(g, neighbours, config.variant, config.seed, config.max_empty_rounds)

    plan = make(config.b_gbps)  # validates the figures first
    ps = config.ps_gbps
    if ps is None:
        return plan, flow_rate(plan, bandwidth, config)
    b0 = min(bandwidth) if config.b_gbps is None else config.b_gbps
    made = [plan]
    if not ps_feasibility(plan, b0, ps).feasible:  # |D| * b > P: every b = P/k below b (P/|D| among them)
        made += [make(ps / k) for k in range(1, len(bandwidth) + 1) if ps / k < b0]
    best = max(made, key=lambda p: (flow_rate(p, bandwidth, config), -p.num_flows))
    rate = flow_rate(best, bandwidth, config)
    d0 = made[0].num_flows
    if len(made) == 1:
        log.info(
            "flowlane.aleph: PS check |D|*b = %d x %.4g = %.4g <= ps_gbps=%.4g Gbit/s: plan kept, rate per flow "
            "%.4g Gbit/s",
            *(d0, b0, d0 * b0, ps, rate),
        )
    else:
        log.info(
            "flowlane.aleph: PS check |D|*b = %d x %.4g = %.4g > ps_gbps=%.4g Gbit/s: re-planned at b = P/k "
            "(%d plans made); |D| %d -> %d, rate per flow %.4g Gbit/s",
            *(d0, b0, d0 * b0, ps, len(made), d0, best.num_flows, rate),
        )
    return best, rate


def greedy_by_capacity(capacity: Sequence[int], adj: Neighbours) -> Plan:
    """Baseline: repeatedly the unclustered worker that can take the most unclustered neighbours aggregates them
    (lowest capacity first). Deterministic; ties by index."""
    n = len(capacity)
    _check_adj(adj, n)
    clustered: set[int] = set()
    heads: dict[int, list[int]] = {}
    while len(clustered) < n:
        U = [w for w in range(n) if w not in clustered]
        w = max(U, key=lambda x: (min(capacity[x], len(adj[x] - clustered)), -x))
        cand = sorted(adj[w] - clustered, key=lambda x: (capacity[x], x))[: capacity[w]]
        heads[w] = [w, *cand]
        clustered |= {w, *cand}
    return Plan.from_clusters(n, heads)


# --- exact optimum ------------------------------------------------------------------------------------------------


def optimum_complete(capacity: Sequence[int]) -> int:
    """Exact min |D| on a complete graph: the largest (1 + g) first until they cover every worker."""
    n, covered, k = len(capacity), 0, 0
    for g in sorted(capacity, reverse=True):
        if covered >= n:
            break
        covered += 1 + g
        k += 1
    return k


def optimum_cliques(capacity: Sequence[int], adj: Neighbours) -> int | None:
    """Exact min |D| when ``adj`` is a union of disjoint cliques (same-switch adjacency): the sum of each clique's
    closed form. None when ``adj`` is not such a union."""
    seen: set[int] = set()
    total = 0
    for w in range(len(capacity)):
        if w in seen:
            continue
        clique = adj[w] | {w}
        if any(adj[x] | {x} != clique for x in clique):
            return None
        seen |= clique
        total += optimum_complete([capacity[x] for x in clique])
    return total


def _match(
    heads: Sequence[int], rest: Sequence[int], capacity: Sequence[int], adj: Neighbours
) -> dict[int, list[int]] | None:
    """Assign every worker in ``rest`` to an adjacent head without exceeding capacities (Kuhn's matching with each
    head repeated capacity times): ``{head: [head, members...]}``, or None when impossible."""
    slots = [h for h in heads for _ in range(capacity[h])]
    if len(slots) < len(rest):
        return None
    owner: dict[int, int] = {}  # slot index -> worker

    def augment(w: int, seen: set[int]) -> bool:
        for s, h in enumerate(slots):
            if s in seen or w not in adj[h]:
                continue
            seen.add(s)
            if s not in owner or augment(owner[s], seen):
                owner[s] = w
                return True
        return False

    if not all(augment(w, set()) for w in rest):
        return None
    clusters: dict[int, list[int]] = {h: [h] for h in heads}
    for s, w in owner.items():
        clusters[slots[s]].append(w)
    return clusters


def optimum_brute_force(capacity: Sequence[int], adj: Neighbours) -> Plan:
    """An exact optimum of the HA problem by exhaustive search over aggregator sets (n <= 14)."""
    n = len(capacity)
    _check_adj(adj, n)
    if n > BRUTE_FORCE_MAX_N:
        raise ValueError(
            f"brute force is exponential: n={n} > {BRUTE_FORCE_MAX_N}; use optimum_complete / "
            f"optimum_cliques where the adjacency allows"
        )
    for k in range(1, n + 1):
        for heads in itertools.combinations(range(n), k):
            found = _match(heads, [w for w in range(n) if w not in heads], capacity, adj)
            if found is not None:
                return Plan.from_clusters(n, found)
    raise AssertionError("unreachable: D = W is always feasible")
