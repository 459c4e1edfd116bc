"""SYNDICATE (seed 004): motifs, a joint search of execution plan and order, and the enforcer that runs it.

Example: the two-path toy (E1): all-reduces b, c, d run on path F only, the all-to-all a on F or S::

    >>> from flowlane.syndicate import SearchConfig, mcmc_search, opt_sched
    >>> from flowlane.syndicate.replan import plan_from_search
    >>> from flowlane.syndicate.workloads import two_path_toy
    >>> dag, cost = two_path_toy()  # TrainingDAG, CostModel; durations in units
    >>> [c.name for c in dag.comms]  # submission order
    ['b', 'c', 'd', 'a']
    >>> opt_sched(dag, dag.greedy_plan(cost), cost, order="fifo").per_iteration  # greedy plan + FIFO: all on F
    11.0
    >>> best = mcmc_search(dag, cost, SearchConfig(seed=0, max_iters=200))  # seeded, 200 proposals: repeatable
    >>> best.cost, best.plan["a"].path  # a on S beside the all-reduces
    (9.5, 'S')
    >>> plan = plan_from_search(dag, best, {c.name: "float32" for c in dag.comms}, version=1)  # SyndicatePlan
    >>> [(plan.ops[i].name, motif) for i, motif in plan.order]  # the launch order every rank follows
    [('d', 0), ('a', 0), ('b', 0), ('c', 0)]

Per rank (torch): ``flowlane.syndicate.enforcer.Enforcer(paths, store, rank, world).install(plan)``.

``motif``: the IR (segmentation, splining, validity). ``cost``: options and the alpha-beta-delta model.
``optsched``: the training DAG and greedy critical-path list scheduling. ``search``: MCMC and exhaustive search.
``plan``: plan versioning, hashing and two-phase distribution. ``replan``: the search re-run when the enforcer's
trigger fires. ``profile``: a recorded FIFO iteration -> its DAG, a fitted cost model and a plan (``flowlane
syndicate-plan``). ``flowsim``: plans (several paths included) replayed in flowlane.sim. ``enforcer`` (imports torch):
one launch order on every rank. Nothing here runs on import, and only ``enforcer`` imports torch.
"""

from flowlane.syndicate.cost import CostModel, Option, PathCost, fit_path_cost, option_space
from flowlane.syndicate.motif import CommOp, Motif, MotifError, decompose, validate
from flowlane.syndicate.optsched import Comm, Compute, OrderError, Schedule, TrainingDAG, opt_sched
from flowlane.syndicate.profile import (
    ProfileError,
    dag_from_profile,
    fit_cost,
    load_profile,
    plan_from_profile,
)
from flowlane.syndicate.search import SearchConfig, SearchResult, exhaustive, mcmc_search

__all__ = [
    "Comm",
    "CommOp",
    "Compute",
    "CostModel",
    "Motif",
    "MotifError",
    "Option",
    "OrderError",
    "PathCost",
    "ProfileError",
    "Schedule",
    "SearchConfig",
    "SearchResult",
    "TrainingDAG",
    "dag_from_profile",
    "decompose",
    "exhaustive",
    "fit_cost",
    "fit_path_cost",
    "load_profile",
    "mcmc_search",
    "opt_sched",
    "option_space",
    "plan_from_profile",
    "validate",
]
