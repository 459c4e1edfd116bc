"""Hermod's inter-coflow policy on the shared :class:`flowlane.policy.SchedulingPolicy` interface.

The simulator (flowlane.sim) and the runtime scheduler (flowlane.sched.scheduler) both take a policy; this one maps
coflow metadata to the Hermod total order of :mod:`flowlane.hermod.order` (seed 000 §5.3.1, tables 5.3/5.4).
``QuantisedHermodPolicy`` replaces the exact key with what the wire can carry (6-bit DSCP or NCCL classes), for
measuring the quantisation loss in the simulator.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from flowlane.hermod.order import CoflowKey, HermodOrder, HermodOrderConfig
from flowlane.hermod.wire import WireConfig, WireEncoder
from flowlane.policy import CoflowMeta, Key, SchedulingPolicy


class HermodPolicy(SchedulingPolicy):
    """Exact Hermod priority: ``(MID, CType rank, LID, iteration, ...)``, smaller first."""

    name = "hermod"

    def __init__(self, config: HermodOrderConfig | None = None) -> None:
        self.hermod_order = HermodOrder(config)

    def priority(self, meta: CoflowMeta) -> Key:
        return self.hermod_order.sort_key(CoflowKey.from_meta(meta))


@dataclass(frozen=True)
class QuantisationConfig:
    """What the network can see of a key."""

    target: Literal["dscp", "nccl"] = "dscp"
    """``dscp``: the seed's 6-bit code point; ``nccl``: one of NCCL_NUM_CLASSES traffic classes."""
    layers_per_stage: int = 1
    oldest_mid: int = 0
    """Reference microbatch for relative MID (a static approximation of "oldest in flight")."""


class QuantisedHermodPolicy(SchedulingPolicy):
    """Hermod with the key quantised to a wire class (ties inside a class share fairly)."""

    def __init__(
        self, config: HermodOrderConfig | None = None, quant: QuantisationConfig | None = None
    ) -> None:
        self.hermod_order = HermodOrder(config)
        self.quant = quant or QuantisationConfig()
        sched = self.hermod_order.config.schedule
        self.encoder = WireEncoder(
            self.hermod_order,
            WireConfig(
                ctype_bits=2 if sched == "interleaved" else 1,
                lid_bits=1 if sched == "interleaved" else 2,
                layers_per_stage=self.quant.layers_per_stage,
            ),
        )
        self.name = f"hermod-{self.quant.target}"

    def priority(self, meta: CoflowMeta) -> Key:
        key = CoflowKey.from_meta(meta)
        if self.quant.target == "dscp":
            return (self.encoder.dscp(key, self.quant.oldest_mid),)
        return (self.encoder.nccl_class(key, self.quant.oldest_mid),)
