"""The Hermod runtime (torch): enforces :mod:`flowlane.hermod`'s order on real communicators.

``scheduler``: ops carry keys; deferred ops go out in priority order, chunk by chunk, behind a gate.
``groups``: one communicator per Hermod class (NCCL traffic classes, or a gloo interface per class).
``alltoall``: the matched (incast-free) all-to-all that runs :mod:`flowlane.hermod.matching`'s phases.
"""

from flowlane.sched.alltoall import AllToAllRunner, matched_all_to_all
from flowlane.sched.groups import ClassGroups, build_class_groups
from flowlane.sched.scheduler import CommScheduler, DeferredHandle, SchedulerConfig

__all__ = [
    "AllToAllRunner",
    "ClassGroups",
    "CommScheduler",
    "DeferredHandle",
    "SchedulerConfig",
    "build_class_groups",
    "matched_all_to_all",
]
