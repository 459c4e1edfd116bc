"""Every scheduling policy by name: what ``flowlane sim --policy``, the benchmarks and the recipes accept.

A plain table, so that a reader sees all of them in one place and nothing registers itself on import. Each entry
builds a fresh policy; none needs torch.
"""

from __future__ import annotations

from collections.abc import Callable

from flowlane.hermod.policy import HermodPolicy, QuantisationConfig, QuantisedHermodPolicy
from flowlane.policy import CtypeFirstPolicy, FifoPolicy, PriorityByKeyPolicy, SchedulingPolicy

POLICIES: dict[str, Callable[[], SchedulingPolicy]] = {
    "fifo": FifoPolicy,  # Megatron-LM's default: issue order, fair sharing (seed 000 §5.2.2)
    "priority": PriorityByKeyPolicy,  # plain lexicographic (iteration, MID, CType, LID)
    "dp-first": lambda: CtypeFirstPolicy("dp"),  # the heuristics of seed 000 table 5.2
    "pp-first": lambda: CtypeFirstPolicy("pp"),
    "ep-first": lambda: CtypeFirstPolicy("ep"),
    "hermod": HermodPolicy,  # the exact Hermod order (seed 000 §5.3.1)
    # what 6 DSCP bits carry (§5.4)
    "hermod-dscp": lambda: QuantisedHermodPolicy(quant=QuantisationConfig("dscp")),
    # three NCCL traffic classes
    "hermod-nccl": lambda: QuantisedHermodPolicy(quant=QuantisationConfig("nccl")),
}


def policy_names() -> list[str]:
    return sorted(POLICIES)


def make_policy(name: str) -> SchedulingPolicy:
    """Build the policy called ``name`` (one of :data:`POLICIES`)."""
    if name not in POLICIES:
        raise ValueError(f"unknown scheduling policy {name!r}; choose one of {policy_names()}")
    return POLICIES[name]()
