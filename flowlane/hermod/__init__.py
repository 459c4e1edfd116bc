"""Hermod (seed 000 ch.5): the coflow model, pure Python, no torch.

=================  ==============================================================================================
``order``          :class:`CoflowKey` (MID, CType, LID, iteration) and the cluster-wide order (§5.3.1)
``keys``           how an adapter keys its PP, DP and EP operations (decisions.md A6.1 #6)
``wire``           what DSCP bits and NCCL traffic classes carry of a key (§5.4)
``policy``         the order as a :class:`flowlane.policy.SchedulingPolicy` for the simulator and the runtime
``matching``       incast-free phases of an all-to-all: BvN and the seed's Algorithm 3 (§5.3.2)
=================  ==============================================================================================

The runtime that enforces the order on real communicators is :mod:`flowlane.sched` (torch).
"""

from flowlane.hermod.keys import P2P_DIRECTIONS, HermodKeys
from flowlane.hermod.order import CoflowKey, HermodOrder, HermodOrderConfig
from flowlane.hermod.policy import HermodPolicy, QuantisationConfig, QuantisedHermodPolicy
from flowlane.hermod.wire import NCCL_NUM_CLASSES, WireConfig, WireEncoder, nccl_traffic_class

__all__ = [
    "P2P_DIRECTIONS",
    "NCCL_NUM_CLASSES",
    "CoflowKey",
    "HermodKeys",
    "HermodOrder",
    "HermodOrderConfig",
    "HermodPolicy",
    "QuantisationConfig",
    "QuantisedHermodPolicy",
    "WireConfig",
    "WireEncoder",
    "nccl_traffic_class",
]
