"""Hermod coflow scheduling (seed 000 ch.5): policy, runtime comm scheduler, class communicators, matched
all-to-all. Importing this package registers the ``hermod`` policies with :mod:`flowlane.policy`."""

from flowlane.sched.alltoall import matched_all_to_all, needs_matching, plan_all_to_all
from flowlane.sched.groups import ClassGroups, build_class_groups
from flowlane.sched.hermod import HermodPolicy, QuantisationConfig, QuantisedHermodPolicy
from flowlane.sched.matching import Phase, algorithm3_phases, bvn_phases, check_phases, lower_bound
from flowlane.sched.scheduler import CommScheduler, DeferredHandle, SchedulerConfig

__all__ = [
    "ClassGroups", "CommScheduler", "DeferredHandle", "HermodPolicy", "Phase", "QuantisationConfig",
    "QuantisedHermodPolicy", "SchedulerConfig", "algorithm3_phases", "build_class_groups", "bvn_phases",
    "check_phases", "lower_bound", "matched_all_to_all", "needs_matching", "plan_all_to_all",
]
