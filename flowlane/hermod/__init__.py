"""Hermod (seed 000 ch.5): the coflow model, pure Python, no torch.

=================  ==============================================================================================
``order``          :class:`CoflowKey` (MID, CType, LID, iteration) and the cluster-wide order (§5.3.1)
``keys``           how an adapter keys its PP, DP and EP operations (decisions.md A6.1 #6)
``wire``           what DSCP bits and NCCL traffic classes carry of a key (§5.4)
``policy``         the order as a :class:`flowlane.policy.SchedulingPolicy` for the simulator and the runtime
``matching``       incast-free phases of an all-to-all: BvN and the seed's Algorithm 3 (§5.3.2)
=================  ==============================================================================================

The runtime that enforces the order on real communicators is :mod:`flowlane.sched` (torch).

Example: four coflows of one iteration (1F1B, M = 4 microbatches) in Hermod order, what the wire carries of
them, and a skewed all-to-all split into incast-free phases::

    >>> from flowlane.hermod import CoflowKey, HermodOrder, HermodOrderConfig, WireEncoder, nccl_traffic_class
    >>> order = HermodOrder(HermodOrderConfig(num_microbatches=4))
    >>> keys = [CoflowKey(0, 0, "dp", 0, "all_reduce"), CoflowKey(0, 1, "ep", 5), CoflowKey(0, 1, "pp", 3),
    ...         CoflowKey(0, 0, "ep", 7)]  # (iteration, microbatch, ctype, layer[, op])
    >>> ranked = sorted(keys, key=order.sort_key)  # MID, then CType (EP & PP > DP), then LID; DP carries MID M-1
    >>> [(k.ctype, k.microbatch, k.layer) for k in ranked]
    [('ep', 0, 7), ('pp', 1, 3), ('ep', 1, 5), ('dp', 0, 0)]
    >>> enc = WireEncoder(order)  # 6-bit DSCP = MID | CType | LID bucket; Hermod class -> NCCL trafficClass
    >>> [(enc.dscp(k), nccl_traffic_class(enc.nccl_class(k))) for k in ranked]
    [(0, 0), (8, 1), (8, 1), (28, 3)]
    >>> from flowlane.hermod.matching import bvn_phases, lower_bound
    >>> T = [[0, 5, 0], [5, 0, 0], [5, 5, 0]]  # T[i][j]: units rank i sends to rank j; ranks 0 and 1 get two each
    >>> phases = bvn_phases(T, impl="python")  # the Python reference; the default builds bvn.c on first use
    >>> [p.sends for p in phases]  # (src, dst, units): one sender per receiver in every phase
    [((0, 1, 5), (2, 0, 5)), ((1, 0, 5), (2, 1, 5))]
    >>> sum(p.weight for p in phases), lower_bound(T)  # BvN meets the bound; Algorithm 3 takes 15 here
    (10, 10)
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
