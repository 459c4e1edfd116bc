"""The joint search over execution plans and orders: Metropolis-Hastings MCMC (seed 004 §5.1, Pseudocode 1).

State: one :class:`~flowlane.syndicate.cost.Option` per comm-op (the execution plan), one integer *boost* per
comm-op (the order knob: ``optSched``'s critical-path rule ranks boosted ops first) and the list-scheduling rule
(``optSched``'s ``pick``). Each step changes one comm-op's option or boost, or toggles the rule, at random and
scores the result with ``optSched``; a worse state is accepted with probability ``exp(beta * (C - C_new))``.

The rule is our extension of the seed's order space. The seed's (digest §2.4.4, ``pick="priority"``: the released
motif of highest priority next) is the start state; ``pick="earliest"`` (the ready motif that can start first,
priority breaking ties) is the other. Both only generate a launch order, which the enforcer replays whatever rule
produced it. On DP bucket chains the priority rule holds the path for the next bucket's more critical
reduce-scatter while the previous bucket's all-gather is ready; a boost ranks both of an op's motifs, so boosts
cannot fully undo that, and there the earliest rule wins (gpt3-13b's buckets, results/syndicate/flowsim.json). ``SearchConfig.picks=("priority",)`` searches the seed's space alone.

Choices the paper leaves open (digest §5 items 3-4):

* ``beta = ln 2 / (0.01 * C0)``: a plan 1 % worse than the greedy start is accepted half the time;
* the **best state seen** is returned (the pseudocode returns the last accepted one);
* it stops at ``max_iters``, at the time budget, or when nothing better was found in the second half of the
  elapsed time, but never before ``min_iters``. With ``max_iters`` set and a generous budget the result depends
  only on the seed.

:func:`exhaustive` enumerates the same space (where it is small enough) as the reference.
"""

from __future__ import annotations

import itertools
import math
import random
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from flowlane.syndicate.cost import CostModel, Option
from flowlane.syndicate.optsched import Comm, Schedule, TrainingDAG, opt_sched

#: optSched's list-scheduling rules for the ``critical_path`` order (``opt_sched(pick=...)``): the seed's first
PICKS: tuple[str, ...] = ("priority", "earliest")


@dataclass(frozen=True)
class SearchConfig:
    """Knobs of :func:`mcmc_search`."""

    seed: int = 0
    """Seeds the proposal and acceptance draws (same seed and ``max_iters``: same answer)."""
    time_budget_s: float = 10.0
    """Hard wall-clock limit of the search."""
    max_iters: int | None = None
    """Stop after this many proposals (None: only time and the half-elapsed rule stop it)."""
    min_iters: int = 500
    """The half-elapsed-time rule does not stop the search before this many proposals ..."""
    min_time_s: float = 1.0
    """... nor before this many seconds (digest §5 item 4: it would fire at once early on)."""
    search_plan: bool = True
    """Propose changes of execution plan (False: the start plan stays: SYNDICATE-Sched)."""
    search_order: bool = True
    """Propose changes of order boosts (False: plain critical path, or ``order``: SYNDICATE-Exec)."""
    order: str = "critical_path"
    """optSched's order rule while searching (``fifo`` with search_order=False is SYNDICATE-Exec)."""
    boost_levels: int = 3
    """Boost values 0..boost_levels-1."""
    picks: tuple[str, ...] = PICKS
    """The list-scheduling rules the order search toggles between (optSched's ``pick``); the first is the start
    state, and the only rule when ``search_order`` is False. ``("priority",)``: the seed's order space alone."""
    beta: float | None = None
    """Inverse temperature; None: ln 2 / (0.01 * start cost)."""

    def __post_init__(self) -> None:
        if not self.time_budget_s > 0:
            raise ValueError(f"SearchConfig.time_budget_s must be > 0, got {self.time_budget_s!r}")
        if self.max_iters is not None and (not isinstance(self.max_iters, int) or self.max_iters < 0):
            raise ValueError(
                f"SearchConfig.max_iters must be an integer >= 0 or None, got {self.max_iters!r}"
            )
        if not isinstance(self.boost_levels, int) or self.boost_levels < 1:
            raise ValueError(f"SearchConfig.boost_levels must be an integer >= 1, got {self.boost_levels!r}")
        if self.order not in ("critical_path", "fifo", "lifo"):
            raise ValueError(
                f"SearchConfig.order {self.order!r} is not one of ['critical_path', 'fifo', 'lifo']"
            )
        if not self.picks or len(set(self.picks)) != len(self.picks) or not set(self.picks) <= set(PICKS):
            raise ValueError(
                f"SearchConfig.picks {self.picks!r} must be distinct values of {list(PICKS)}, at least one"
            )
        if self.search_order and self.order != "critical_path":
            raise ValueError(
                "SearchConfig.search_order needs order='critical_path' (boosts act on that rule)"
            )


@dataclass
class SearchResult:
    """The best plan and order found, with how the search went."""

    plan: dict[str, Option]
    boosts: dict[str, int]
    cost: float
    schedule: Schedule
    start_cost: float
    pick: str = "priority"
    """The list-scheduling rule that produced ``schedule`` (optSched's ``pick`` for ``critical_path``; the
    ablation's LIFO and hand orders run ``earliest``; a static order such as FIFO has none and keeps the default).
    ``schedule.order()`` is the launch order it generated, which :func:`~flowlane.syndicate.replan.plan_from_search`
    turns into the plan."""
    iters: int = 0
    accepted: int = 0
    evaluations: int = 0
    elapsed_s: float = 0.0
    stopped_by: str = ""
    trace: list[tuple[int, float]] = field(default_factory=list)
    """(proposal number, best cost) at every improvement."""


def _score(
    dag: TrainingDAG,
    plan: Mapping[str, Option],
    boosts: Mapping[str, int],
    pick: str,
    cost: CostModel,
    order: str,
    cache: dict,
) -> Schedule:
    cp = order == "critical_path"
    return opt_sched(
        dag, plan, cost, order=order, boosts=boosts if cp else None, cache=cache, pick=pick if cp else None
    )


def mcmc_search(
    dag: TrainingDAG,
    cost: CostModel,
    config: SearchConfig | None = None,
    start: Mapping[str, Option] | None = None,
) -> SearchResult:
    """MCMC over plans, boosts and the list-scheduling rule from ``start`` (default: the greedy plan), no boosts and
    the rule ``config.picks[0]`` (the seed's ``priority``)."""
    cfg = config or SearchConfig()
    rng = random.Random(cfg.seed)
    cache: dict = {}
    t0 = time.perf_counter()
    plan = dict(start or dag.greedy_plan(cost))
    boosts = {c.name: 0 for c in dag.comms}
    pick = cfg.picks[0]
    cur = _score(dag, plan, boosts, pick, cost, cfg.order, cache)
    best = SearchResult(dict(plan), dict(boosts), cur.per_iteration, cur, cur.per_iteration, pick)
    beta = cfg.beta if cfg.beta is not None else math.log(2) / (0.01 * max(cur.per_iteration, 1e-30))
    plan_ops = [c for c in dag.comms if len(c.options) > 1] if cfg.search_plan else []
    order_ops = list(dag.comms) if cfg.search_order and cfg.boost_levels > 1 else []
    moves: list[tuple[str, Comm | None]] = [("plan", c) for c in plan_ops]
    moves += [("order", c) for c in order_ops]
    if cfg.search_order and len(cfg.picks) > 1:
        moves.append(("pick", None))  # one move among the per-op ones: toggle the rule
    c_cur = cur.per_iteration
    last_improve_t = 0.0
    it = 0
    stopped = "no moves"
    while moves:
        el = time.perf_counter() - t0
        if cfg.max_iters is not None and it >= cfg.max_iters:
            stopped = "max_iters"
            break
        if el >= cfg.time_budget_s:
            stopped = "time budget"
            break
        if (
            cfg.max_iters is None
            and it >= cfg.min_iters
            and el >= cfg.min_time_s
            and el - last_improve_t > el / 2
        ):
            stopped = "no improvement in the second half"
            break
        it += 1
        kind, c = rng.choice(moves)
        new_plan, new_boosts, new_pick = plan, boosts, pick
        if c is None:
            new_pick = rng.choice([p for p in cfg.picks if p != pick])
        elif kind == "plan":
            o = rng.choice([o for o in c.options if o != plan[c.name]])
            new_plan = {**plan, c.name: o}
        else:
            b = rng.choice([b for b in range(cfg.boost_levels) if b != boosts[c.name]])
            new_boosts = {**boosts, c.name: b}
        s = _score(dag, new_plan, new_boosts, new_pick, cost, cfg.order, cache)
        c_new = s.per_iteration
        if c_new <= c_cur or rng.random() < math.exp(beta * (c_cur - c_new)):
            plan, boosts, pick, c_cur = new_plan, new_boosts, new_pick, c_new
            best.accepted += 1
            if c_new < best.cost - 1e-15:
                best.plan, best.boosts, best.pick = dict(plan), dict(boosts), pick
                best.cost, best.schedule = c_new, s
                last_improve_t = time.perf_counter() - t0
                best.trace.append((it, c_new))
    best.iters = best.evaluations = it
    best.elapsed_s = time.perf_counter() - t0
    best.stopped_by = stopped
    return best


def space_size(
    dag: TrainingDAG,
    search_plan: bool = True,
    search_order: bool = False,
    boost_levels: int = 3,
    picks: int = len(PICKS),
) -> int:
    """States of plans x boosts x rules (``picks`` rules, with the order searched)."""
    n = picks if search_order else 1
    for c in dag.comms:
        n *= (len(c.options) if search_plan else 1) * (boost_levels if search_order else 1)
    return n


def exhaustive(
    dag: TrainingDAG,
    cost: CostModel,
    search_plan: bool = True,
    search_order: bool = False,
    order: str = "critical_path",
    boost_levels: int = 3,
    limit: int = 2_000_000,
    start: Mapping[str, Option] | None = None,
    picks: tuple[str, ...] = PICKS,
) -> SearchResult:
    """The best state by enumeration (plans x boosts x rules, the rules only with ``search_order``; the first of
    ``picks`` otherwise); refuses spaces above ``limit`` states. Ties keep the first found (``picks[0]`` first)."""
    pick_set = picks if search_order and order == "critical_path" else picks[:1]
    n = space_size(dag, search_plan, search_order, boost_levels, len(pick_set))
    if n > limit:
        raise ValueError(f"exhaustive search over {n} states exceeds limit={limit}; shrink the option sets")
    base = dict(start or dag.greedy_plan(cost))
    names = [c.name for c in dag.comms]
    opt_sets = [c.options if search_plan else (base[c.name],) for c in dag.comms]
    boost_sets = [range(boost_levels) if search_order else (0,) for _ in dag.comms]
    cache: dict = {}
    t0 = time.perf_counter()
    best: SearchResult | None = None
    count = 0
    for pick in pick_set:
        for opts in itertools.product(*opt_sets):
            plan = dict(zip(names, opts, strict=True))
            for bs in itertools.product(*boost_sets):
                boosts = dict(zip(names, bs, strict=True))
                s = _score(dag, plan, boosts, pick, cost, order, cache)
                count += 1
                if best is None or s.per_iteration < best.cost - 1e-15:
                    best = SearchResult(plan, boosts, s.per_iteration, s, s.per_iteration, pick)
    assert best is not None
    zero = {c.name: 0 for c in dag.comms}
    best.start_cost = _score(dag, base, zero, picks[0], cost, order, cache).per_iteration
    best.evaluations = best.iters = count
    best.elapsed_s = time.perf_counter() - t0
    best.stopped_by = "exhaustive"
    return best


def restrict(dag: TrainingDAG, keep: Callable[[Comm, Option], bool]) -> TrainingDAG:
    """A copy of ``dag`` whose comm-ops keep only the options ``keep`` accepts (at least one each)."""
    steps = []
    for st in dag.steps:
        if isinstance(st, Comm):
            opts = tuple(o for o in st.options if keep(st, o))
            if not opts:
                raise ValueError(f"restrict() left comm-op {st.name!r} with no option")
            st = Comm(st.op, st.deps, opts)
        steps.append(st)
    return TrainingDAG(dag.name, steps, dag.carry, dag.iterations)


def segment_oracle(
    dag: TrainingDAG, cost: CostModel, order: str, hand: Mapping[str, int] | None = None, limit: int = 20_000
) -> tuple[dict[str, Option], Schedule]:
    """ByteScheduler+'s oracle (seed 004 §6.3): the greedy plan's path, algorithm and splining per op, with the
    best segment counts for ``order`` found by enumeration."""
    greedy = dag.greedy_plan(cost)
    sets = []
    for c in dag.comms:
        g = greedy[c.name]
        sets.append([o for o in c.options if (o.path, o.algo, o.spline) == (g.path, g.algo, g.spline)])
    n = math.prod(len(x) for x in sets)
    if n > limit:
        raise ValueError(f"segment oracle over {n} plans exceeds limit={limit}")
    cache: dict = {}
    best: tuple[float, dict[str, Option], Schedule] | None = None
    for opts in itertools.product(*sets):
        plan = {c.name: o for c, o in zip(dag.comms, opts, strict=True)}
        s = opt_sched(dag, plan, cost, order=order, hand=hand, cache=cache)
        if best is None or s.per_iteration < best[0] - 1e-15:
            best = (s.per_iteration, plan, s)
    assert best is not None
    return best[1], best[2]


#: The ablation's systems, seed 004 §6.3 / Fig. 15 (digest §4.2 E2).
SYSTEMS: tuple[str, ...] = (
    "fifo_greedy",
    "bs_lifo_seg",
    "hand_order",
    "plan_search",
    "order_search",
    "joint",
)


def ablation(
    dag: TrainingDAG,
    cost: CostModel,
    hand: Mapping[str, int],
    seed: int = 0,
    time_budget_s: float = 10.0,
    max_iters: int | None = None,
) -> dict[str, SearchResult]:
    """Per-iteration time of each system in :data:`SYSTEMS`: FIFO + greedy plan (PyTorch + NCCL), LIFO + segment
    oracle (ByteScheduler+), ``hand`` order + segment oracle (HO), plan search under FIFO (SYNDICATE-Exec),
    order search + segmentation with the greedy path/algorithm (SYNDICATE-Sched), and the joint search."""
    out: dict[str, SearchResult] = {}
    greedy = dag.greedy_plan(cost)
    s = opt_sched(dag, greedy, cost, order="fifo")
    out["fifo_greedy"] = SearchResult(greedy, {}, s.per_iteration, s, s.per_iteration, stopped_by="fixed")
    for name, order in (("bs_lifo_seg", "lifo"), ("hand_order", "hand")):
        plan, s = segment_oracle(dag, cost, order, hand=hand)
        out[name] = SearchResult(
            plan, {}, s.per_iteration, s, s.per_iteration, "earliest", stopped_by="segment oracle"
        )
    cfg = SearchConfig(seed=seed, time_budget_s=time_budget_s, max_iters=max_iters)
    out["plan_search"] = mcmc_search(
        dag, cost, SearchConfig(**{**cfg.__dict__, "search_order": False, "order": "fifo"})
    )
    seg_only = restrict(
        dag,
        lambda c, o: (
            (o.path, o.algo, o.spline) == (greedy[c.name].path, greedy[c.name].algo, greedy[c.name].spline)
        ),
    )
    out["order_search"] = mcmc_search(seg_only, cost, cfg)
    out["joint"] = mcmc_search(dag, cost, cfg)
    return out
