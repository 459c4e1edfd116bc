"""Communication planning for irregular embedding exchange (DGCL, seed 001).

``CommRelation`` (who owns what, who needs what) + ``LinkModel`` (ranks, logical links as physical-hop lists from a
:class:`flowlane.topology.Topology`) -> ``build_plan`` (SPST or peer-to-peer under the staged cost model) ->
``compile_tables`` (per-rank, per-stage send/receive index tables) -> ``GraphExchange`` / ``graph_allgather``
(executor over :mod:`flowlane.comm`, with autograd backward). Pure Python + numpy (+ torch for the executor).
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
