"""Hector (seed 003 ch. 3): relational-GNN operators without per-edge weight copies, in plain torch.

A typed linear over rows sorted by type, one weight per type::

    >>> import torch
    >>> from flowlane.hector import compact_rows, materialize, replicated_typed_linear, segment_mm, segment_ptr
    >>> _ = torch.manual_seed(0)
    >>> types, x, W = torch.tensor([0, 0, 1, 2, 2, 2]), torch.randn(6, 4), torch.randn(3, 4, 5)  # one W per type
    >>> ptr = segment_ptr(types, 3)  # CSR-like offsets of the type-sorted rows (refuses unsorted types)
    >>> ptr.tolist()
    [0, 2, 3, 6]
    >>> y = segment_mm(x, W, ptr)  # y[a:b] = x[a:b] @ W[t]: torch._grouped_mm (CUDA) or one matmul per type
    >>> tuple(y.shape), torch.allclose(y, replicated_typed_linear(x, types, W), atol=1e-6)  # vs W[types] per row
    ((6, 5), True)

Messages that depend only on an edge's (source, edge type) are computed once per distinct pair, here 5 rows for 8
edges::

    >>> src, etype = torch.tensor([0, 0, 1, 1, 2, 0, 0, 3]), torch.tensor([0, 0, 1, 1, 0, 1, 1, 0])
    >>> rows = compact_rows(src, etype, num_nodes=4, num_types=2)
    >>> rows.num_rows, rows.ratio
    (5, 0.625)
    >>> h, Wr = torch.randn(4, 4), torch.randn(2, 4, 5)
    >>> msg = materialize(h, Wr, rows)  # h[rows.node] @ Wr[rows.etype], never Wr[etype] copied per edge
    >>> per_edge = torch.stack([h[s] @ Wr[t] for s, t in zip(src.tolist(), etype.tolist())])
    >>> tuple(msg.shape), torch.allclose(msg[rows.edge_row], per_edge, atol=1e-6)  # edge e reads row edge_row[e]
    ((5, 5), True)

:class:`EdgeAggregator` then sums the messages over each node's in-edges (SpMM:
``EdgeAggregator(dst, rows.edge_row, num_nodes, rows.num_rows)(msg, values)``), and :func:`plan_fold` chooses the
linear-operator reordering of an attention term by a cost model.

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
