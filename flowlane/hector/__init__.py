"""Hector (seed 003 ch. 3): relational-GNN operators without per-edge weight copies, in plain torch.

Public API::

    from flowlane.hector import segment_ptr, segment_mm, compact_rows, materialize, EdgeAggregator
    ptr = segment_ptr(types_sorted, num_types)        # CSR-like offsets of type-sorted rows (refuses unsorted)
    y = segment_mm(x_sorted, W, ptr)                  # typed linear: torch._grouped_mm or one matmul per type
    rows = compact_rows(src, etype, num_nodes, R)     # one row per unique (source, edge type); rows.ratio
    msg = materialize(h, W, rows)                     # h[rows.node] @ W[rows.etype], never W[etype] per edge
    out = EdgeAggregator(dst, rows.edge_row, N, rows.num_rows)(msg, values)   # sum over in-edges (SpMM)
    plan = plan_fold(rows.num_rows, R, d_in, d_out, heads)   # linear-operator reordering, by a cost model

Also: :func:`typed_linear` (rows in any order), :func:`vanilla_rows`, :func:`edge_softmax`, :func:`gather_dot`,
:func:`gather_rows` (compact rows to edges, fp32 gradient sums), :func:`fold_attention`,
:func:`plan_side`, :class:`HectorConfig`, and synthetic skewed typed graphs (:func:`typed_graph`). Nothing happens on
import. The DGL layers (RelGraphConv-compatible RGCN, RGAT, HGT) are in ``dgl_plugin.hector``.
"""

from flowlane.hector.config import GEMMS, MATERIALIZATIONS, REORDERS, HectorConfig
from flowlane.hector.ops import (
    EdgeAggregator,
    RowIndex,
    choose_gemm,
    compact_rows,
    edge_softmax,
    gather_dot,
    gather_rows,
    grouped_mm_available,
    materialize,
    replicated_typed_linear,
    segment_mm,
    segment_ptr,
    type_order,
    typed_linear,
    vanilla_rows,
)
from flowlane.hector.reorder import FoldPlan, SidePlan, fold_attention, plan_fold, plan_side
from flowlane.hector.synthetic import TypedGraphSpec, typed_graph

__all__ = [
    "GEMMS",
    "MATERIALIZATIONS",
    "REORDERS",
    "EdgeAggregator",
    "FoldPlan",
    "HectorConfig",
    "RowIndex",
    "SidePlan",
    "TypedGraphSpec",
    "choose_gemm",
    "compact_rows",
    "edge_softmax",
    "fold_attention",
    "gather_dot",
    "gather_rows",
    "grouped_mm_available",
    "materialize",
    "plan_fold",
    "plan_side",
    "replicated_typed_linear",
    "segment_mm",
    "segment_ptr",
    "type_order",
    "typed_graph",
    "typed_linear",
    "vanilla_rows",
]
