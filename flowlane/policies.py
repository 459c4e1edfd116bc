"""Every scheduling policy by name: what ``flowlane sim --policy``, the benchmarks and the recipes accept.

A plain table, so that a reader sees all of them in one place and nothing registers itself on import. Each entry
builds a fresh policy; none needs torch.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

from flowlane.hermod.order import HermodOrderConfig
from flowlane.hermod.policy import HermodPolicy, QuantisationConfig, QuantisedHermodPolicy
from flowlane.policy import CtypeFirstPolicy, FifoPolicy, PriorityByKeyPolicy, SchedulingPolicy

#: The Hermod policies, built from the order's config: its CType ranks depend on the pipeline schedule (1F1B:
#: EP & PP > DP; interleaved: EP > PP > DP, seed 000 §5.3.1) and its DP MID on the microbatches per iteration.
HERMOD: dict[str, Callable[[HermodOrderConfig], SchedulingPolicy]] = {
    "hermod": HermodPolicy,  # the exact Hermod order (seed 000 §5.3.1)
    # what 6 DSCP bits carry (§5.4)
    "hermod-dscp": lambda cfg: QuantisedHermodPolicy(cfg, QuantisationConfig("dscp")),
    # three NCCL traffic classes
    "hermod-nccl": lambda cfg: QuantisedHermodPolicy(cfg, QuantisationConfig("nccl")),
}

POLICIES: dict[str, Callable[[], SchedulingPolicy]] = {
    "fifo": FifoPolicy,  # Megatron-LM's default: issue order, fair sharing (seed 000 §5.2.2)
    "priority": PriorityByKeyPolicy,  # plain lexicographic (iteration, MID, CType, LID)
    "dp-first": lambda: CtypeFirstPolicy("dp"),  # the heuristics of seed 000 table 5.2
    "pp-first": lambda: CtypeFirstPolicy("pp"),
    "ep-first": lambda: CtypeFirstPolicy("ep"),
    # the Hermod ones for 1F1B, M unknown (make_policy takes the workload's)
    **{name: partial(build, HermodOrderConfig()) for name, build in HERMOD.items()},
}


def policy_names() -> list[str]:
    return sorted(POLICIES)


def make_policy(
    name: str, schedule: str | None = None, num_microbatches: int | None = None
) -> SchedulingPolicy:
    """Build the policy called ``name`` (one of :data:`POLICIES`) for a workload with pipeline ``schedule``
    (``1f1b`` or ``interleaved``; None = 1f1b) and ``num_microbatches`` per iteration (None = unknown): a simulated
    LLM workload's ``Workload.info["schedule"]`` and ``["microbatches"]``. The Hermod policies order by them (and
    :meth:`flowlane.sim.Simulator.run` refuses one built for another schedule or M); the others do not use them."""
    if name not in POLICIES:
        raise ValueError(f"unknown scheduling policy {name!r}; choose one of {policy_names()}")
    cfg = HermodOrderConfig(num_microbatches, schedule or "1f1b")  # type: ignore[arg-type]  # checked there
    if name in HERMOD:
        return HERMOD[name](cfg)
    return POLICIES[name]()
