"""Every scheduling policy by name: what ``flowlane sim --policy``, the benchmarks and the recipes accept.

A plain table, so that a reader sees all of them in one place and nothing registers itself on import. Each entry
builds a fresh policy (``hermod-dscp`` only through :func:`make_policy`, which needs the workload's layers per
stage); none needs torch.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

from flowlane.hermod.order import HermodOrderConfig
from flowlane.hermod.policy import HermodPolicy, QuantisationConfig, QuantisedHermodPolicy
from flowlane.policy import CtypeFirstPolicy, FifoPolicy, PriorityByKeyPolicy, SchedulingPolicy


def _dscp(cfg: HermodOrderConfig, layers_per_stage: int | None) -> SchedulingPolicy:
    if layers_per_stage is None:
        raise ValueError(
            "policy 'hermod-dscp' buckets each pipeline stage's layers into the DSCP's two LID bits (digest "
            "A6.1 #3) and needs the workload's layers per stage: make_policy('hermod-dscp', ..., "
            "layers_per_stage=layers // pp) (benchmarks/hermod_sim.py passes it); with a guessed 1 the LID bits "
            "would always be 0"
        )
    return QuantisedHermodPolicy(cfg, QuantisationConfig("dscp", layers_per_stage=layers_per_stage))


#: The Hermod policies, built from the order's config: its CType ranks depend on the pipeline schedule (1F1B:
#: EP & PP > DP; interleaved: EP > PP > DP, seed 000 §5.3.1) and its DP MID on the microbatches per iteration; and
#: from the workload's layers per pipeline stage, which only the DSCP variant reads (and requires).
HERMOD: dict[str, Callable[[HermodOrderConfig, int | None], SchedulingPolicy]] = {
    "hermod": lambda cfg, _: HermodPolicy(cfg),  # the exact Hermod order (seed 000 §5.3.1)
    "hermod-dscp": _dscp,  # what 6 DSCP bits carry (§5.4)
    # three NCCL traffic classes
    "hermod-nccl": lambda cfg, _: QuantisedHermodPolicy(cfg, QuantisationConfig("nccl")),
}

POLICIES: dict[str, Callable[[], SchedulingPolicy]] = {
    "fifo": FifoPolicy,  # Megatron-LM's default: issue order, fair sharing (seed 000 §5.2.2)
    "priority": PriorityByKeyPolicy,  # plain lexicographic (MID, CType, LID), then iteration
    "dp-first": lambda: CtypeFirstPolicy("dp"),  # the heuristics of seed 000 table 5.2
    "pp-first": lambda: CtypeFirstPolicy("pp"),
    "ep-first": lambda: CtypeFirstPolicy("ep"),
    # the Hermod ones for 1F1B, M and layers per stage unknown (make_policy takes the workload's)
    **{name: partial(build, HermodOrderConfig(), None) for name, build in HERMOD.items()},
}


def policy_names() -> list[str]:
    return sorted(POLICIES)


def make_policy(
    name: str,
    schedule: str | None = None,
    num_microbatches: int | None = None,
    layers_per_stage: int | None = None,
) -> SchedulingPolicy:
    """Build the policy called ``name`` (one of :data:`POLICIES`) for a workload with pipeline ``schedule``
    (``1f1b`` or ``interleaved``; None = 1f1b) and ``num_microbatches`` per iteration (None = unknown): a simulated
    LLM workload's ``Workload.info["schedule"]`` and ``["microbatches"]``. The Hermod policies order by them (and
    :meth:`flowlane.sim.Simulator.run` refuses one built for another schedule or M); the others do not use them.
    ``layers_per_stage`` (the model's layers over its pipeline stages) sets ``hermod-dscp``'s LID buckets; that
    policy is refused without it."""
    if name not in POLICIES:
        raise ValueError(f"unknown scheduling policy {name!r}; choose one of {policy_names()}")
    if layers_per_stage is not None and (
        isinstance(layers_per_stage, bool) or not isinstance(layers_per_stage, int) or layers_per_stage < 1
    ):
        raise ValueError(f"layers_per_stage must be an integer >= 1, got {layers_per_stage!r}")
    cfg = HermodOrderConfig(num_microbatches, schedule or "1f1b")  # type: ignore[arg-type]  # checked there
    if name in HERMOD:
        return HERMOD[name](cfg, layers_per_stage)
    return POLICIES[name]()
