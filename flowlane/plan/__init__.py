"""Communication planning for irregular embedding exchange (DGCL, seed 001).

``CommRelation`` (who owns what, who needs what) + ``LinkModel`` (ranks, logical links as physical-hop lists from a
:class:`flowlane.topology.Topology`) -> ``build_plan`` (SPST or peer-to-peer under the staged cost model) ->
``compile_tables`` (per-rank, per-stage send/receive index tables) -> ``GraphExchange`` / ``graph_allgather``
(executor over :mod:`flowlane.comm`, with autograd backward). Pure Python + numpy (+ torch for the executor).

Example: rank 2 needs four embeddings of rank 0, whose direct link to it is 100x slower than 0 -> 1 -> 2::

    >>> import numpy as np
    >>> from flowlane.plan import CommRelation, LinkModel, build_plan, compile_tables, mesh_from_matrix
    >>> bw = np.full((3, 3), 100e9)  # bytes/s per directed link
    >>> bw[0, 2] = 1e9
    >>> lm = LinkModel.from_topology(mesh_from_matrix(bw))
    >>> rel = CommRelation.from_edges(src=np.arange(4), dst=np.full(4, 5), owner=np.array([0, 0, 0, 0, 1, 2]))
    >>> [ids.tolist() for ids in rel.needs]  # per rank: the remote vertices it aggregates from
    [[], [], [0, 1, 2, 3]]
    >>> plan = build_plan(rel, lm, impl="python")  # method="auto"; the default impl builds _spst.c on first use
    >>> plan.method, plan.num_stages, round(plan.info["p2p_cost"] / plan.cost)  # SPST is 50x faster than P2P
    ('spst', 2, 50)
    >>> sorted(set(zip(plan.stage.tolist(), plan.src.tolist(), plan.dst.tolist())))  # (stage, src, dst)
    [(1, 0, 1), (2, 1, 2)]
    >>> relay = compile_tables(plan, rel)[1]  # rank 1's tables: it only relays
    >>> relay.relay_ids.tolist(), [(st.stage, [peer for peer, _ in st.sends]) for st in relay.stages]
    ([0, 1, 2, 3], [(1, []), (2, [2])])
"""

from .cost import LinkModel, evaluate, full_mesh, mesh_from_matrix, stage_hop_loads
from .relation import CommRelation, PlanError
from .spst import METHODS, Plan, build_plan, link_class_breakdown, p2p_plan
from .tables import RankTables, StageTable, compile_tables

__all__ = [
    "METHODS",
    "CommRelation",
    "LinkModel",
    "Plan",
    "PlanError",
    "RankTables",
    "StageTable",
    "build_plan",
    "compile_tables",
    "evaluate",
    "full_mesh",
    "link_class_breakdown",
    "mesh_from_matrix",
    "p2p_plan",
    "stage_hop_loads",
]

from .executor import (  # noqa: E402 - torch-dependent part last
    GradSlot,
    GraphExchange,
    PendingExchange,
    add_deferred_grad,
    attach,
    graph_allgather,
)

__all__ += ["GradSlot", "GraphExchange", "PendingExchange", "add_deferred_grad", "attach", "graph_allgather"]
