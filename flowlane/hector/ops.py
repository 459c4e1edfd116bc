"""Hector's operators in plain torch (seed 003 ch. 3; digest research/003 §4.2): typed linear as a segment GEMM over
type-sorted rows, compact materialization, and the aggregation / softmax traversals around them. All have autograd.

Contracts (choices where the thesis is silent, digest §4.6):

* A typed linear ``Y[i] = X[i] @ W[T[i]]`` never materialises per-row weights ``W[T]`` (thesis §3.2 challenge 2):
  rows are grouped by type (``seg_ptr``, CSR-like offsets, Fig. 3.5's ``etype_ptr``) and each group is one GEMM,
  with ``torch._grouped_mm`` (one call) or one ``torch.mm`` per type (the "segment loop").
* Materialization (Fig. 3.7): a :class:`RowIndex` says which rows an edgewise operator computes and which row each
  edge reads. ``vanilla`` has one row per edge (in edge-type order), ``compact`` one per unique (source, edge type)
  pair (``unique_row_idx`` / ``unique_etype_ptr``). The backward of the gather from rows to edges is a scatter-add
  (:func:`gather_rows`, or the transposed sparse product in :class:`EdgeAggregator`).
* fp16/bf16: every sum of many terms runs in fp32 and is rounded once (the gathers' scatter-adds, the bf16
  aggregation, :func:`gather_dot`'s backward, :func:`edge_softmax`): a hub row feeds thousands of edges, and CUDA's
  bf16 ``index_add`` over them put dx 0.16-0.22 from an fp32 reference on an H200 (results/hector/README.md).
* Aggregation of edge messages into destination nodes ``out[v] = sum_e a[e] * Y[row[e]]`` is a sparse-times-dense
  product (the traversal template with partial aggregation, §3.3.4), so no (#edges, hidden) message tensor is built.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
from torch import Tensor

from flowlane.hector.config import GEMMS


def _check_index(name: str, t: Tensor, bound: int) -> None:
    if not isinstance(t, Tensor) or t.dim() != 1 or t.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"{name} must be a 1-D int32/int64 tensor, got "
            f"{type(t).__name__ if not isinstance(t, Tensor) else f'{t.dtype} shape {tuple(t.shape)}'}"
        )
    if t.numel():
        lo, hi = int(t.min()), int(t.max())
        if lo < 0 or hi >= bound:
            bad = lo if lo < 0 else hi
            raise ValueError(f"{name} holds {bad}, outside the allowed range [0, {bound})")


# --------------------------------------------------------------------------------------------------------------------
# Segments: rows grouped by type


def segment_ptr(types: Tensor, num_types: int) -> Tensor:
    """CSR-like offsets (``num_types + 1``, int64, on the CPU) of rows already sorted by type (Fig. 3.5 ``etype_ptr``).

    Refuses types out of ``[0, num_types)`` and types that are not sorted (sort them, e.g. with :func:`type_order`).
    """
    if not isinstance(num_types, int) or isinstance(num_types, bool) or num_types < 1:
        raise ValueError(f"num_types={num_types!r} must be an int >= 1")
    _check_index("types", types, num_types)
    if types.numel() > 1 and bool((types[1:] < types[:-1]).any()):
        first = int(torch.nonzero(types[1:] < types[:-1])[0, 0]) + 1
        raise ValueError(
            f"types are not sorted: row {first} has type {int(types[first])} after type "
            f"{int(types[first - 1])}; sort the rows by type first (type_order)"
        )
    counts = torch.bincount(types.to("cpu", torch.int64), minlength=num_types)
    return torch.cat([counts.new_zeros(1), counts.cumsum(0)])


def type_order(types: Tensor, num_types: int) -> tuple[Tensor, Tensor]:
    """``(order, ptr)``: a stable permutation that sorts rows by type, and the offsets of the sorted rows."""
    _check_index("types", types, num_types)
    order = torch.sort(types, stable=True).indices
    return order, segment_ptr(types[order], num_types)


def _check_ptr(seg_ptr: Tensor, rows: int, num_types: int) -> list[int]:
    if not isinstance(seg_ptr, Tensor) or seg_ptr.dim() != 1 or seg_ptr.numel() != num_types + 1:
        raise ValueError(
            f"seg_ptr must be a 1-D tensor of num_types + 1 = {num_types + 1} offsets, got "
            f"{tuple(seg_ptr.shape) if isinstance(seg_ptr, Tensor) else type(seg_ptr).__name__}"
        )
    p = seg_ptr.tolist()
    if p[0] != 0 or p[-1] != rows or any(b < a for a, b in zip(p[:-1], p[1:], strict=True)):
        raise ValueError(
            f"seg_ptr must rise from 0 to the row count {rows} without decreasing, got {p[:8]}"
            f"{'...' if len(p) > 8 else ''}"
        )
    return p


# --------------------------------------------------------------------------------------------------------------------
# Typed linear (segment GEMM)


class _SegmentMM(torch.autograd.Function):
    """Y[a:b] = X[a:b] @ W[t] per segment t; backward: dX[a:b] = dY[a:b] W[t]^T, dW[t] = X[a:b]^T dY[a:b]."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bounds: tuple[int, ...]) -> Tensor:  # type: ignore[override]
        y = x.new_empty(x.shape[0], weight.shape[2])
        for t, (a, b) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
            if b > a:
                torch.mm(x[a:b], weight[t], out=y[a:b])
        ctx.save_for_backward(x, weight)
        ctx.bounds = bounds
        return y

    @staticmethod
    def backward(ctx, gy: Tensor):  # type: ignore[override]
        x, weight = ctx.saved_tensors
        gy = gy.contiguous()
        gx = gw = None
        if ctx.needs_input_grad[0]:
            gx = x.new_empty(x.shape)
        if ctx.needs_input_grad[1]:
            gw = torch.zeros_like(weight)
        for t, (a, b) in enumerate(zip(ctx.bounds[:-1], ctx.bounds[1:], strict=True)):
            if b == a:
                continue
            if gx is not None:
                torch.mm(gy[a:b], weight[t].t(), out=gx[a:b])
            if gw is not None:
                torch.mm(x[a:b].t(), gy[a:b], out=gw[t])
        return gx, gw, None


def grouped_mm_available() -> bool:
    return hasattr(torch, "_grouped_mm")


def _grouped_mm_ok(x: Tensor, weight: Tensor) -> str | None:
    """None where ``torch._grouped_mm`` can run these operands, else why not."""
    if not grouped_mm_available():
        return f"torch {torch.__version__} has no torch._grouped_mm"
    if x.is_cuda and (x.dtype != torch.bfloat16 or weight.dtype != torch.bfloat16):
        return f"on CUDA torch._grouped_mm takes bf16 operands, got {x.dtype} x {weight.dtype}"
    cpu = (torch.float32, torch.bfloat16, torch.float16)
    if not x.is_cuda and x.dtype not in cpu:
        return f"on the CPU torch._grouped_mm takes float32, bf16 or fp16 operands, got {x.dtype}"
    es = x.element_size()
    if (x.shape[1] * es) % 16 or (weight.shape[2] * es) % 16:
        return (
            f"torch._grouped_mm needs 16-byte-aligned feature sizes (multiples of {16 // es} {x.dtype}), got "
            f"in={x.shape[1]} out={weight.shape[2]}"
        )
    return None


def choose_gemm(x: Tensor, weight: Tensor, gemm: str = "auto") -> str:
    """The segment-GEMM path for these operands: ``grouped_mm`` or ``loop`` (``auto``: grouped_mm on CUDA)."""
    if gemm not in GEMMS:
        raise ValueError(f"gemm={gemm!r} is not one of {GEMMS}")
    if gemm == "auto":
        return "grouped_mm" if x.is_cuda and _grouped_mm_ok(x, weight) is None else "loop"
    if gemm == "grouped_mm" and (why := _grouped_mm_ok(x, weight)) is not None:
        raise ValueError(f"gemm='grouped_mm' cannot run here: {why}; use gemm='loop' or 'auto'")
    return gemm


def segment_mm(x: Tensor, weight: Tensor, seg_ptr: Tensor, gemm: str = "auto") -> Tensor:
    """Typed linear over type-sorted rows: ``Y[a:b] = X[a:b] @ weight[t]`` for each segment ``[a, b)`` of type t.

    ``x``: (rows, in); ``weight``: (types, in, out); ``seg_ptr``: (types + 1,) offsets from :func:`segment_ptr`.
    No per-row weight copy is made. Differentiable in ``x`` and ``weight``.
    """
    if not isinstance(x, Tensor) or x.dim() != 2:
        raise ValueError(
            f"x must be a 2-D (rows, in) tensor, got shape "
            f"{tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__}"
        )
    if not isinstance(weight, Tensor) or weight.dim() != 3 or weight.shape[1] != x.shape[1]:
        raise ValueError(
            f"weight must be (types, in={x.shape[1]}, out), got shape "
            f"{tuple(weight.shape) if isinstance(weight, Tensor) else type(weight).__name__}"
        )
    if weight.dtype != x.dtype or weight.device != x.device:
        raise ValueError(
            f"x ({x.dtype}, {x.device}) and weight ({weight.dtype}, {weight.device}) must share dtype "
            f"and device"
        )
    bounds = _check_ptr(seg_ptr, x.shape[0], weight.shape[0])
    path = choose_gemm(x, weight, gemm)
    if path == "grouped_mm":
        offs = torch.tensor(bounds[1:], dtype=torch.int32, device=x.device)
        y = torch._grouped_mm(x.contiguous(), weight, offs=offs)
        if y.requires_grad:
            # its backward refuses a gradient with zero strides ("Invalid strides/sizes"), which is what an expanded
            # gradient, e.g. of y.sum(), has (torch 2.15, CPU): hand it a dense one
            y.register_hook(lambda g: g.contiguous())
        return y
    return _SegmentMM.apply(x.contiguous(), weight, tuple(bounds))


def typed_linear(x: Tensor, types: Tensor, weight: Tensor, gemm: str = "auto") -> Tensor:
    """``Y[i] = x[i] @ weight[types[i]]`` for rows in any order (sorted internally, then put back)."""
    if (
        not isinstance(x, Tensor)
        or x.dim() != 2
        or not isinstance(types, Tensor)
        or types.shape != x.shape[:1]
    ):
        raise ValueError(
            f"x must be (rows, in) and types (rows,), got "
            f"{tuple(getattr(x, 'shape', ()))} and {tuple(getattr(types, 'shape', ()))}"
        )
    order, ptr = type_order(types, weight.shape[0] if isinstance(weight, Tensor) and weight.dim() == 3 else 1)
    y_sorted = segment_mm(x.index_select(0, order), weight, ptr, gemm)
    return y_sorted.index_select(0, torch.argsort(order))


def replicated_typed_linear(x: Tensor, types: Tensor, weight: Tensor) -> Tensor:
    """The baseline Hector removes: copy ``weight[types]`` per row, then ``bmm`` (PyG FastRGCNConv, DGL bdd)."""
    return torch.bmm(x.unsqueeze(1), weight.index_select(0, types)).squeeze(1)


# --------------------------------------------------------------------------------------------------------------------
# Materialization: which rows an edgewise operator computes


@dataclass(frozen=True)
class RowIndex:
    """Rows of an edgewise tensor that depends only on (node, edge type), and the row each edge reads.

    ``node[i]``, ``etype[i]``: the (node, type) of row i; rows are sorted by type (then node), with offsets ``ptr``
    (Fig. 3.7 ``unique_etype_ptr``); ``edge_row[e]``: the row of edge e. ``compact`` rows are the unique
    (node, type) pairs; vanilla rows are the edges themselves, in type order.
    """

    node: Tensor
    etype: Tensor
    ptr: Tensor
    edge_row: Tensor
    compact: bool

    @property
    def num_rows(self) -> int:
        return int(self.node.numel())

    @property
    def num_edges(self) -> int:
        return int(self.edge_row.numel())

    @property
    def ratio(self) -> float:
        """Rows per edge: the compaction ratio for compact rows (thesis §3.4: AM 57 %, FB15k 26 %), 1 for vanilla."""
        return self.num_rows / max(self.num_edges, 1)


def compact_rows(node: Tensor, etype: Tensor, num_nodes: int, num_types: int) -> RowIndex:
    """One row per unique (node, edge type) pair of the edges (``node`` is each edge's source, or destination)."""
    _check_index("node", node, num_nodes)
    _check_index("etype", etype, num_types)
    if node.shape != etype.shape:
        raise ValueError(
            f"node and etype must have one entry per edge, got {tuple(node.shape)} and {tuple(etype.shape)}"
        )
    key = etype.to(torch.int64) * num_nodes + node.to(torch.int64)
    uniq, edge_row = torch.unique(key, sorted=True, return_inverse=True)
    ut = uniq // num_nodes
    return RowIndex(
        node=uniq - ut * num_nodes, etype=ut, ptr=segment_ptr(ut, num_types), edge_row=edge_row, compact=True
    )


def vanilla_rows(node: Tensor, etype: Tensor, num_nodes: int, num_types: int) -> RowIndex:
    """One row per edge, edges taken in edge-type order (stable)."""
    _check_index("node", node, num_nodes)
    if node.shape != etype.shape:
        raise ValueError(
            f"node and etype must have one entry per edge, got {tuple(node.shape)} and {tuple(etype.shape)}"
        )
    order, ptr = type_order(etype, num_types)
    return RowIndex(
        node=node[order].to(torch.int64),
        etype=etype[order].to(torch.int64),
        ptr=ptr,
        edge_row=torch.argsort(order),
        compact=False,
    )


def materialize(x: Tensor, weight: Tensor, rows: RowIndex, gemm: str = "auto") -> Tensor:
    """``Y[i] = x[rows.node[i]] @ weight[rows.etype[i]]`` for each row: the GEMM template's gather + segment GEMM."""
    if not isinstance(weight, Tensor) or weight.dim() != 3 or weight.shape[0] != rows.ptr.numel() - 1:
        raise ValueError(
            f"weight must be (types={rows.ptr.numel() - 1}, in, out), got "
            f"{tuple(getattr(weight, 'shape', ()))}"
        )
    # as gather_rows: with vanilla rows a hub source feeds thousands of rows, whose gradients sum in fp32 (bf16/fp16)
    return segment_mm(_GatherRows.apply(x, rows.node), weight, rows.ptr, gemm)


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype of long sums: fp32 for fp16/bf16 (a bf16 sum of thousands of terms loses the gradient)."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


class _GatherRows(torch.autograd.Function):
    """``y.index_select(0, index)`` (which bounds-checks ``index``) whose backward sums in fp32 for fp16/bf16."""

    @staticmethod
    def forward(ctx, y: Tensor, index: Tensor) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(index)
        ctx.num_rows = y.shape[0]
        return y.index_select(0, index)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        (index,) = ctx.saved_tensors
        acc = _acc_dtype(grad.dtype)
        out = torch.zeros((ctx.num_rows, *grad.shape[1:]), dtype=acc, device=grad.device)
        return out.index_add_(0, index, grad.to(acc)).to(grad.dtype), None


def gather_rows(y: Tensor, index: Tensor, check: bool = True) -> Tensor:
    """``y[index]`` (compact rows to edges) whose backward sums the edges of a row in fp32 for fp16/bf16: one compact
    row feeds every edge of its (source, type) pair, thousands for a hub, and a bf16 sum that long loses the
    gradient (on an H200, bf16 index_add put the weight gradient 3.7e-2 from an fp32 reference). ``check=False``
    skips the bounds check (two device-to-host syncs) for indices checked once already, e.g. a cached layout's;
    ``index_select`` still refuses an out-of-range index."""
    if check:
        _check_index("index", index, y.shape[0])
    return _GatherRows.apply(y, index)


# --------------------------------------------------------------------------------------------------------------------
# Traversals: edge dot products, aggregation into destination nodes, edge softmax

#: edges per chunk of an edgewise traversal: bounds its (chunk, hidden) temporaries (Hector's fused kernels keep them
#: in registers; thesis §3.3.4 "temporaries used only inside a fused operator are not materialised")
EDGE_CHUNK = 1 << 16


def _gather_dot_chunked(a: Tensor, ia: Tensor, b: Tensor, ib: Tensor) -> Tensor:
    out = a.new_empty((ia.numel(),) + tuple(a.shape[1:-1]))
    for s in range(0, ia.numel(), EDGE_CHUNK):
        e = slice(s, s + EDGE_CHUNK)
        out[e] = (a.index_select(0, ia[e]) * b.index_select(0, ib[e])).sum(-1)
    return out


def _gather_scale_add(like: Tensor, io: Tensor, g: Tensor, b: Tensor, ib: Tensor) -> Tensor:
    """zeros_like(like) with out[io[e]] += g[e] * b[ib[e]], in edge chunks, summed in fp32 for fp16/bf16 (a hub row
    gathers the terms of all its edges)."""
    acc = _acc_dtype(like.dtype)
    out = torch.zeros(like.shape, dtype=acc, device=like.device)
    for s in range(0, io.numel(), EDGE_CHUNK):
        e = slice(s, s + EDGE_CHUNK)
        out.index_add_(0, io[e], (g[e].unsqueeze(-1) * b.index_select(0, ib[e])).to(acc))
    return out.to(like.dtype)


class _GatherDot(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a: Tensor, ia: Tensor, b: Tensor, ib: Tensor) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(a, ia, b, ib)
        return _gather_dot_chunked(a, ia, b, ib)

    @staticmethod
    def backward(ctx, g: Tensor):  # type: ignore[override]
        a, ia, b, ib = ctx.saved_tensors
        ga = _gather_scale_add(a, ia, g, b, ib) if ctx.needs_input_grad[0] else None
        gb = _gather_scale_add(b, ib, g, a, ia) if ctx.needs_input_grad[2] else None
        return ga, None, gb, None


def gather_dot(a: Tensor, ia: Tensor, b: Tensor, ib: Tensor) -> Tensor:
    """``out[e] = <a[ia[e]], b[ib[e]]>`` over the last dimension (SDDMM over row-indexed operands), e.g. HGT's
    ``(k W_r)[src-row] . q[dst]``. Only the row tensors are kept for the backward, never (#edges, hidden) copies."""
    if a.shape[1:] != b.shape[1:]:
        raise ValueError(
            f"a and b must have the same row shape, got {tuple(a.shape[1:])} and {tuple(b.shape[1:])}"
        )
    if ia.shape != ib.shape or ia.dim() != 1:
        raise ValueError(
            f"ia and ib must be 1-D with one entry per edge, got {tuple(ia.shape)} and {tuple(ib.shape)}"
        )
    _check_index("ia", ia, a.shape[0])
    _check_index("ib", ib, b.shape[0])
    return _GatherDot.apply(a, ia.to(torch.int64), b, ib.to(torch.int64))


class _SpMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, agg: EdgeAggregator, values: Tensor | None, y: Tensor) -> Tensor:  # type: ignore[override]
        ctx.agg = agg
        ctx.save_for_backward(values, y)
        return agg._apply(values, y, transpose=False)

    @staticmethod
    def backward(ctx, g: Tensor):  # type: ignore[override]
        values, y = ctx.saved_tensors
        agg: EdgeAggregator = ctx.agg
        g = g.contiguous()
        gy = agg._apply(values, g, transpose=True) if ctx.needs_input_grad[2] else None
        gv = None
        if ctx.needs_input_grad[1]:  # SDDMM: dvalue[e] = <g[dst[e]], y[col[e]]> (per head), in edge chunks
            gv = _gather_dot_chunked(g, agg.dst, y, agg.col).reshape(values.shape)
        return None, gv, gy


class EdgeAggregator:
    """``out[v] = sum over edges e into v of value[e] * Y[col[e]]``, as a CSR sparse x dense product.

    Built once per graph and row index (``dst``: destination of each edge, ``col``: the row each edge reads); the
    sparse structure and its transpose (for the backward) are kept, and only the values change per call. ``Y`` is
    (rows, D) with values (E,) or None (all ones), or (rows, H, D) with values (E, H).
    """

    def __init__(self, dst: Tensor, col: Tensor, num_dst: int, num_cols: int) -> None:
        _check_index("dst", dst, num_dst)
        _check_index("col", col, num_cols)
        if dst.shape != col.shape:
            raise ValueError(
                f"dst and col must have one entry per edge, got {tuple(dst.shape)} and {tuple(col.shape)}"
            )
        self.dst, self.col = dst.to(torch.int64), col.to(torch.int64)
        self.num_dst, self.num_cols = num_dst, num_cols
        self.perm = torch.argsort(self.dst * num_cols + self.col)
        self.perm_t = torch.argsort(self.col * num_dst + self.dst)
        self.crow = torch.cat([self.dst.new_zeros(1), torch.bincount(self.dst, minlength=num_dst).cumsum(0)])
        self.crow_t = torch.cat(
            [self.dst.new_zeros(1), torch.bincount(self.col, minlength=num_cols).cumsum(0)]
        )
        self.col_sorted = self.col[self.perm]
        self.dst_sorted_t = self.dst[self.perm_t]

    def _matrix(self, v: Tensor, transpose: bool) -> Tensor:
        with warnings.catch_warnings():  # torch warns on every CSR construction that CSR support is "beta"
            warnings.simplefilter("ignore", UserWarning)
            return self._csr(v, transpose)

    def _csr(self, v: Tensor, transpose: bool) -> Tensor:
        if transpose:
            return torch.sparse_csr_tensor(
                self.crow_t, self.dst_sorted_t, v[self.perm_t], (self.num_cols, self.num_dst)
            )
        return torch.sparse_csr_tensor(
            self.crow, self.col_sorted, v[self.perm], (self.num_dst, self.num_cols)
        )

    def _apply(self, values: Tensor | None, y: Tensor, transpose: bool) -> Tensor:
        if y.dim() == 2:
            v = values if values is not None else y.new_ones(self.dst.numel())
            return self._matrix(v.reshape(-1).to(y.dtype), transpose) @ y
        heads = [
            self._matrix(
                (values[:, h] if values is not None else y.new_ones(self.dst.numel())).to(y.dtype), transpose
            )
            @ y[:, h].contiguous()
            for h in range(y.shape[1])
        ]
        return torch.stack(heads, 1)

    def __call__(self, y: Tensor, values: Tensor | None = None) -> Tensor:
        if y.shape[0] != self.num_cols:
            raise ValueError(f"y has {y.shape[0]} rows; this aggregator reads {self.num_cols}")
        if values is not None:
            want = (self.dst.numel(),) if y.dim() == 2 else (self.dst.numel(), y.shape[1])
            if values.reshape(-1).numel() != self.dst.numel() * (1 if y.dim() == 2 else y.shape[1]):
                raise ValueError(
                    f"values must have shape {want} (one per edge{' and head' if y.dim() > 2 else ''}),"
                    f" got {tuple(values.shape)}"
                )
            if y.dim() > 2:
                values = values.reshape(want)
        # no sparse CSR product for this dtype (bf16/fp16): gather + index_add, both summed in fp32 (gather_rows in
        # the backward: a compact row feeds every edge of its (source, type) pair, thousands for a hub); values are
        # cast to y's dtype as the CSR path does, so the result has y's dtype
        if y.dtype not in (torch.float32, torch.float64):
            m = _GatherRows.apply(y, self.col)  # col checked at construction
            if values is not None:
                m = m * values.to(y.dtype).reshape(values.shape + (1,) * (m.dim() - values.dim()))
            acc = _acc_dtype(y.dtype)
            out = torch.zeros((self.num_dst,) + tuple(y.shape[1:]), dtype=acc, device=y.device)
            return out.index_add_(0, self.dst, m.to(acc)).to(y.dtype)
        return _SpMM.apply(self, values, y)


def edge_softmax(scores: Tensor, group: Tensor, num_groups: int) -> Tensor:
    """Softmax of edge ``scores`` (E,) or (E, H) over the edges of each group (a destination node, or a
    (destination, type) pair): Listing 3.1's ``edge_softmax`` (subtract the group max, exp, divide by the sum)."""
    _check_index("group", group, num_groups)
    if scores.shape[0] != group.numel():
        raise ValueError(f"scores has {scores.shape[0]} rows for {group.numel()} edges")
    if (acc := _acc_dtype(scores.dtype)) != scores.dtype:  # the group sums (a hub's in-edges) in fp32
        return edge_softmax(scores.to(acc), group, num_groups).to(scores.dtype)
    idx = group.to(torch.int64).view(-1, *([1] * (scores.dim() - 1))).expand_as(scores)
    shape = (num_groups,) + tuple(scores.shape[1:])
    # the max only shifts for stability; softmax's value and gradient do not depend on it
    with torch.no_grad():
        top = scores.new_full(shape, float("-inf")).scatter_reduce(0, idx, scores, "amax", include_self=True)
    e = torch.exp(scores - top.gather(0, idx))
    z = scores.new_zeros(shape).index_add(0, group.to(torch.int64), e)
    return e / z.gather(0, idx)
