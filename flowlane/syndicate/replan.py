"""Replanning (seed 004 §5.1 interface C, §5.2): when the enforcer's feedback says the plan no longer fits, the
optimizer runs the joint search again and distributes the new plan with the two-phase commit.

:class:`SearchReplanner` is the optimizer side: it holds the training DAG, the cost model and the search settings,
and each call re-runs :func:`~flowlane.syndicate.search.mcmc_search` (started from the plan in force, so the
search only has to improve on it). ``refit`` may rebuild the cost model from the enforcer's statistics first. The
candidate is judged by what the enforcer would run, not by the search's score: the search scores a dynamic
two-iteration schedule that may mix the iterations' motifs, while the enforcer replays one iteration's order every
iteration (:func:`replayed`). The replanner returns the next plan version only when that replay beats the plan in
force replayed the same way, and None (the enforcer's "keep") otherwise. The enforcer
(:class:`~flowlane.syndicate.enforcer.Enforcer`, ``replanner=``) calls it out of band on its coordinator rank and
proposes the result through :class:`~flowlane.syndicate.plan.PlanChannel`, so every rank switches at one iteration
(or none does).

:func:`plan_from_search` turns a search result into a :class:`~flowlane.syndicate.plan.SyndicatePlan`: the ops in
submission order (the DAG's comm-op order) with the signature the application submits, and optSched's
steady-state launch order under the list-scheduling rule the search chose (``SearchResult.pick``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from flowlane.syndicate.cost import CostModel, Option
from flowlane.syndicate.optsched import OrderError, Schedule, TrainingDAG, opt_sched
from flowlane.syndicate.plan import PlanError, PlanOp, SyndicatePlan, element_size
from flowlane.syndicate.search import SearchConfig, SearchResult, mcmc_search

#: (iteration, held seconds, wall seconds): one row of ``Enforcer.stats``
StatRow = tuple[int, float, float]


def plan_from_search(
    dag: TrainingDAG,
    result: SearchResult,
    dtypes: Mapping[str, str],
    version: int,
) -> SyndicatePlan:
    """The plan of ``result`` for ``dag``: op ``c`` is submitted as ``dtypes[c.name]`` with
    ``c.op.nbytes / element size`` elements; the order is the last (steady-state) iteration of ``result.schedule``,
    the launch order optSched generated under the search's rule (``result.pick``). The plan keeps the order, not
    the rule: the enforcer replays it as a static sequence."""
    ops = []
    for c in dag.comms:
        if c.name not in dtypes:
            raise PlanError(
                f"plan_from_search: no dtype for comm-op {c.name!r}; dtypes name {sorted(dtypes)}"
            )
        es = element_size(dtypes[c.name])
        if c.op.nbytes % es:
            raise PlanError(
                f"comm-op {c.name!r}: {c.op.nbytes} bytes is not a whole number of {dtypes[c.name]}"
            )
        ops.append(
            PlanOp(c.name, c.op.kind, c.op.nbytes // es, dtypes[c.name], c.op.ranks, result.plan[c.name])
        )
    return SyndicatePlan.from_schedule(ops, result.schedule.order(), version=version)


def unrolled_order(dag: TrainingDAG, plan: SyndicatePlan) -> list[tuple[int, str, int]]:
    """The plan's launch order in every unrolled iteration (the enforcer replays it each iteration)."""
    return [(it, plan.ops[i].name, j) for it in range(dag.iterations) for i, j in plan.order]


def replayed(dag: TrainingDAG, plan: SyndicatePlan, cost: CostModel) -> Schedule:
    """optSched replaying ``plan`` as the enforcer runs it: its options, its order in every iteration. Raises
    :class:`~flowlane.syndicate.optsched.OrderError` if that order would deadlock."""
    return opt_sched(dag, {o.name: o.option for o in plan.ops}, cost, order=unrolled_order(dag, plan))


@dataclass
class SearchReplanner:
    """Re-runs the joint search when called (the enforcer calls it when its replan trigger fires)."""

    dag: TrainingDAG
    """The training DAG the plans are for (comm-op order = the application's submission order)."""
    cost: CostModel
    """The cost model the search scores plans with (``refit`` may replace it on each call)."""
    dtypes: Mapping[str, str]
    """Comm-op name -> the dtype the application submits it in (the plan's signature)."""
    config: SearchConfig = field(default_factory=SearchConfig)
    """Search settings (seed, time budget); each call uses ``seed + call number``."""
    refit: Callable[[CostModel, Sequence[StatRow]], CostModel] | None = None
    """Optional: a new cost model from the old one and the enforcer's feedback rows."""
    results: list[SearchResult] = field(default_factory=list)
    """Every search this replanner ran, in order."""
    replays: list[tuple[float, float]] = field(default_factory=list)
    """Per search: (the plan in force, the candidate), each replayed as the enforcer runs it, seconds per
    iteration (no plan in force: FIFO, every op on its first option, whole at submission)."""

    def __call__(self, current: SyndicatePlan | None, stats: Sequence[StatRow]) -> SyndicatePlan | None:
        if self.refit is not None:
            self.cost = self.refit(self.cost, stats)
        start: dict[str, Option] | None = None
        if current is None:
            in_force = opt_sched(self.dag, self.dag.default_plan(), self.cost, order="fifo").per_iteration
        else:
            names = {o.name: o.option for o in current.ops}
            if set(names) != {c.name for c in self.dag.comms}:
                raise PlanError(
                    f"SearchReplanner: the plan in force has ops {sorted(names)}, the DAG's comm-ops are "
                    f"{sorted(c.name for c in self.dag.comms)}; it cannot be compared with a new plan"
                )
            start = names
            in_force = replayed(self.dag, current, self.cost).per_iteration
        cfg = replace(self.config, seed=self.config.seed + len(self.results))
        result = mcmc_search(self.dag, self.cost, cfg, start=start)
        self.results.append(result)
        version = (current.version if current is not None else 0) + 1
        plan = plan_from_search(self.dag, result, self.dtypes, version)
        try:
            candidate = replayed(self.dag, plan, self.cost).per_iteration
        except OrderError:  # each iteration's order respects its own DAG, so not expected; never propose it
            candidate = math.inf
        self.replays.append((in_force, candidate))
        # the search's score may mix two iterations' motifs, which the enforcer cannot run: judge the replay
        return plan if candidate < in_force else None
