"""ALEPH (seed 002): heterogeneity-aware worker clustering and hierarchical gradient aggregation.

=================  ==============================================================================================
``config``         :class:`AlephConfig`: variant, seed, b, c, re-planning, PS check
``cluster``        capacities (Eq. 1), M-WCHA (Alg. 1, paper-literal and fill), adjacency plug-ins, exact optima
``model``          flow-time model (Table 1), PS feasibility (digest §5.1 #12), multi-PS split (Sec. 7)
``treesim``        aggregation trees on a star / leaf-spine fabric (Sec. 6.4, simulated)
``replan``         re-planning every K iterations with hysteresis (digest §5.1 #13)
``wire``           the data plane's wire header and int32 fixed-point codec (shared with ``aleph_dataplane/``)
``hook``           tier 0: hierarchical all-reduce over torch.distributed subgroups, DDP comm hook (torch)
``probe``          start-up bandwidth probing with timed transfers (torch)
``udp``            tier 1: the userspace UDP aggregator (C) started and driven from Python
=================  ==============================================================================================

This package's ``__init__`` imports only the pure modules; ``hook`` and ``probe`` (torch) and ``udp`` are imported
by name.

Example: eight workers (Gbit/s), two fast ones; capacities, clusters, and one iteration's time against a PS and a
ring::

    >>> from flowlane.aleph import adjacency_complete, aleph_time, capacities, mwcha, plan_clusters, ps_time, ring_time
    >>> bw = [10, 10, 40, 40, 10, 10, 25, 10]
    >>> g = capacities(bw)  # Eq. 1 with b = min(bw): how many members each worker can aggregate
    >>> g
    [0, 0, 3, 3, 0, 0, 1, 0]
    >>> plan = mwcha(g, adjacency_complete(len(bw)), seed=0)  # M-WCHA (Alg. 1); seeded: the same on every rank
    >>> [list(c.members) for c in plan.clusters]  # head first; one flow into the PS per cluster
    [[2, 0, 6, 7], [3, 1, 4, 5]]
    >>> plan_clusters(bw) == plan  # the same in one call (options: AlephConfig)
    True
    >>> [ft.time for ft in (aleph_time(8, plan, bw, ps=40), ps_time(8, bw, ps=40), ring_time(8, bw))]  # 8 Gbit
    [0.8, 1.6, 1.4]
"""

from flowlane.aleph.cluster import (
    Cluster,
    Plan,
    adjacency_complete,
    adjacency_rtt,
    adjacency_same_switch,
    capacities,
    greedy_by_capacity,
    mwcha,
    optimum_brute_force,
    optimum_cliques,
    optimum_complete,
    plan_clusters,
)
from flowlane.aleph.config import AlephConfig
from flowlane.aleph.model import aleph_time, ps_feasibility, ps_time, ring_time
from flowlane.aleph.replan import Replanner

__all__ = [
    "AlephConfig",
    "Cluster",
    "Plan",
    "Replanner",
    "adjacency_complete",
    "adjacency_rtt",
    "adjacency_same_switch",
    "aleph_time",
    "capacities",
    "greedy_by_capacity",
    "mwcha",
    "optimum_brute_force",
    "optimum_cliques",
    "optimum_complete",
    "plan_clusters",
    "ps_feasibility",
    "ps_time",
    "ring_time",
]
