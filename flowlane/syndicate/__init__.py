"""SYNDICATE (seed 004): motifs, a joint search of execution plan and order, and the enforcer that runs it.

Public API::

    from flowlane.syndicate import CommOp, Option, CostModel, PathCost, TrainingDAG, opt_sched, mcmc_search
    dag, cost = dlrm_dag()                        # flowlane.syndicate.workloads
    best = mcmc_search(dag, cost, SearchConfig(seed=0, time_budget_s=10))
    plan = SyndicatePlan.from_search(dag, best)   # versioned, hashed; flowlane.syndicate.plan
    # per rank (torch): flowlane.syndicate.enforcer.Enforcer(plan, paths, store, rank, world)

``motif``: the IR (segmentation, splining, validity). ``cost``: options and the alpha-beta-delta model.
``optsched``: the training DAG and greedy critical-path list scheduling. ``search``: MCMC and exhaustive search.
``plan``: plan versioning, hashing and two-phase distribution. ``replan``: the search re-run when the enforcer's
trigger fires. ``flowsim``: plans (several paths included) replayed in flowlane.sim. ``enforcer`` (imports torch):
one launch order on every rank. Nothing here runs on import, and only ``enforcer`` imports torch.
"""

from flowlane.syndicate.cost import CostModel, Option, PathCost, fit_path_cost, option_space
from flowlane.syndicate.motif import CommOp, Motif, MotifError, decompose, validate
from flowlane.syndicate.optsched import Comm, Compute, OrderError, Schedule, TrainingDAG, opt_sched
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
    "Schedule",
    "SearchConfig",
    "SearchResult",
    "TrainingDAG",
    "decompose",
    "exhaustive",
    "fit_path_cost",
    "mcmc_search",
    "opt_sched",
    "option_space",
    "validate",
]
