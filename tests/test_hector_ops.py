"""Hector's core operators (issue 40, torch only): each equal to a plain reference in forward and backward, exact
row counts for compact materialization, the reordering cost model, and clear refusals of bad input.

Runs in both lanes: the DGL plugin (gnn lane, torch 2.2.1: segment loop) uses this core, and the llm lane's torch has
``torch._grouped_mm`` (its path is checked against the loop there).
"""

from __future__ import annotations

import pytest
import torch

from flowlane.hector import (
    EdgeAggregator,
    HectorConfig,
    TypedGraphSpec,
    compact_rows,
    edge_softmax,
    fold_attention,
    gather_dot,
    gather_rows,
    grouped_mm_available,
    materialize,
    plan_fold,
    plan_side,
    replicated_typed_linear,
    segment_mm,
    segment_ptr,
    typed_graph,
    typed_linear,
    vanilla_rows,
)
from tests.hector_probes import LowPrecisionSums

F64 = torch.float64


def _close(a: torch.Tensor, b: torch.Tensor, tol: float = 1e-12) -> None:
    torch.testing.assert_close(a, b, rtol=tol, atol=tol)


def _grads(out: torch.Tensor, inputs: list[torch.Tensor], seed: int = 1) -> list[torch.Tensor]:
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=out.dtype)
    return list(torch.autograd.grad(out, inputs, g))


def _graph(n: int = 60, e: int = 700, r: int = 5, seed: int = 0) -> dict[str, torch.Tensor]:
    return typed_graph(num_nodes=n, num_edges=e, num_etypes=r, num_ntypes=3, hub_alpha=2.0, seed=seed)


def _leaf(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=F64).requires_grad_()


# ---------------------------------------------------------------------------------------------------- segment GEMM


def test_segment_mm_equals_one_matmul_per_type_forward_bitwise_and_backward():
    types = torch.tensor([0, 0, 0, 2, 2, 3, 3, 3, 3])  # type 1 empty
    ptr = segment_ptr(types, 4)
    assert ptr.tolist() == [0, 3, 3, 5, 9]
    x, w = _leaf(9, 6), _leaf(4, 6, 5, seed=1)
    y = segment_mm(x, w, ptr, gemm="loop")
    ref = torch.cat(
        [x[a:b] @ w[t] for t, (a, b) in enumerate(zip(ptr[:-1].tolist(), ptr[1:].tolist(), strict=True))]
    )
    assert torch.equal(y, ref)
    got, want = _grads(y, [x, w]), _grads(ref, [x, w])
    for a, b in zip(got, want, strict=True):
        _close(a, b)
    assert torch.equal(got[1][1], torch.zeros(6, 5, dtype=F64))  # no rows of type 1: no gradient


def test_typed_linear_in_any_row_order_equals_replicated_weights():
    x, w = _leaf(40, 7), _leaf(3, 7, 4, seed=2)
    types = torch.randint(0, 3, (40,), generator=torch.Generator().manual_seed(3))
    y, ref = typed_linear(x, types, w, gemm="loop"), replicated_typed_linear(x, types, w)
    _close(y, ref)
    for got, want in zip(_grads(y, [x, w]), _grads(ref, [x, w]), strict=True):
        _close(got, want)


def test_grouped_mm_path_equals_loop_or_is_refused_where_torch_lacks_it():
    types = torch.tensor([0] * 16 + [1] * 8 + [2] * 24)
    ptr = segment_ptr(types, 3)
    x32 = torch.randn(48, 16, generator=torch.Generator().manual_seed(4))
    w32 = torch.randn(3, 16, 8, generator=torch.Generator().manual_seed(5))
    if not grouped_mm_available():  # torch 2.2.1 (gnn lane): asked for explicitly, it is refused by name
        with pytest.raises(ValueError, match="no torch._grouped_mm.*gemm='loop'"):
            segment_mm(x32, w32, ptr, gemm="grouped_mm")
        return
    x1, w1 = x32.clone().requires_grad_(), w32.clone().requires_grad_()
    x2, w2 = x32.clone().requires_grad_(), w32.clone().requires_grad_()
    y1, y2 = segment_mm(x1, w1, ptr, gemm="grouped_mm"), segment_mm(x2, w2, ptr, gemm="loop")
    torch.testing.assert_close(y1, y2, rtol=1e-5, atol=1e-5)
    for a, b in zip(_grads(y1, [x1, w1]), _grads(y2, [x2, w2]), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    # an expanded incoming gradient (zero strides), as y.sum() gives: _grouped_mm's backward refused it on the CPU
    segment_mm(x1, w1, ptr, gemm="grouped_mm").sum().backward()
    segment_mm(x2, w2, ptr, gemm="loop").sum().backward()
    torch.testing.assert_close(x1.grad, x2.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(w1.grad, w2.grad, rtol=1e-5, atol=1e-5)
    # operands it cannot take are refused by name, not left to fail inside torch
    with pytest.raises(
        ValueError, match=r"16-byte-aligned feature sizes \(multiples of 4 torch.float32\), got in=16 out=3"
    ):
        segment_mm(x32, w32[:, :, :3].contiguous(), ptr, gemm="grouped_mm")
    with pytest.raises(ValueError, match="float32, bf16 or fp16 operands, got torch.float64"):
        segment_mm(x32.double(), w32.double(), ptr, gemm="grouped_mm")


def test_segment_ops_refuse_unsorted_types_types_out_of_range_and_shape_mismatches():
    with pytest.raises(ValueError, match="not sorted: row 2 has type 0 after type 1"):
        segment_ptr(torch.tensor([0, 1, 0]), 2)
    with pytest.raises(ValueError, match=r"types holds 3, outside the allowed range \[0, 3\)"):
        segment_ptr(torch.tensor([0, 1, 3]), 3)
    with pytest.raises(ValueError, match=r"types holds -1"):
        typed_linear(torch.zeros(2, 3), torch.tensor([-1, 0]), torch.zeros(2, 3, 4))
    with pytest.raises(ValueError, match="1-D int32/int64"):
        segment_ptr(torch.tensor([0.0, 1.0]), 2)
    ptr = segment_ptr(torch.tensor([0, 1]), 2)
    with pytest.raises(ValueError, match=r"weight must be \(types, in=3, out\), got shape \(2, 4, 5\)"):
        segment_mm(torch.zeros(2, 3), torch.zeros(2, 4, 5), ptr)
    with pytest.raises(ValueError, match="num_types \\+ 1 = 4 offsets"):
        segment_mm(torch.zeros(2, 3), torch.zeros(3, 3, 5), ptr)
    with pytest.raises(ValueError, match="from 0 to the row count 5"):
        segment_mm(torch.zeros(5, 3), torch.zeros(2, 3, 5), ptr)
    with pytest.raises(ValueError, match="gemm='tiled' is not one of"):
        segment_mm(torch.zeros(2, 3), torch.zeros(2, 3, 5), ptr, gemm="tiled")
    with pytest.raises(ValueError, match="share dtype"):
        segment_mm(torch.zeros(2, 3), torch.zeros(2, 3, 5, dtype=F64), ptr)


# ------------------------------------------------------------------------------------------------- materialization


def test_compact_rows_counts_unique_source_type_pairs_exactly():
    # thesis Fig. 3.7's shape: 7 edges, 5 unique (source, type) pairs
    src = torch.tensor([0, 0, 1, 1, 2, 0, 2])
    et = torch.tensor([0, 0, 1, 1, 1, 2, 2])
    rows = compact_rows(src, et, 3, 3)
    assert rows.num_rows == 5 and rows.num_edges == 7 and rows.ratio == pytest.approx(5 / 7)
    assert rows.node.tolist() == [0, 1, 2, 0, 2] and rows.etype.tolist() == [0, 1, 1, 2, 2]
    assert rows.ptr.tolist() == [0, 1, 3, 5]
    assert rows.edge_row.tolist() == [0, 0, 1, 1, 2, 3, 4]
    g = _graph()
    rows = compact_rows(g["src"], g["etype"], 60, 5)
    assert rows.num_rows == len(set(zip(g["src"].tolist(), g["etype"].tolist(), strict=True)))
    assert torch.equal(rows.node[rows.edge_row], g["src"]) and torch.equal(
        rows.etype[rows.edge_row], g["etype"]
    )
    van = vanilla_rows(g["src"], g["etype"], 60, 5)
    assert van.num_rows == 700 and van.ratio == 1.0 and not van.compact
    assert torch.equal(van.node[van.edge_row], g["src"]) and torch.equal(van.etype[van.edge_row], g["etype"])


def test_compact_and_vanilla_messages_equal_the_replicated_weight_reference():
    g = _graph()
    x, w = _leaf(60, 8), _leaf(5, 8, 6, seed=1)
    ref = replicated_typed_linear(x.index_select(0, g["src"]), g["etype"], w)
    ref_grads = _grads(ref, [x, w])
    for rows in (compact_rows(g["src"], g["etype"], 60, 5), vanilla_rows(g["src"], g["etype"], 60, 5)):
        y = materialize(x, w, rows, gemm="loop").index_select(0, rows.edge_row)
        _close(y, ref)
        for got, want in zip(_grads(y, [x, w]), ref_grads, strict=True):
            _close(got, want)


# ----------------------------------------------------------------------------------------------------- traversals


@pytest.mark.parametrize("heads", [0, 2], ids=["2d", "heads"])
def test_edge_aggregator_equals_gather_and_index_add_forward_and_backward(heads):
    g = _graph()
    rows = compact_rows(g["src"], g["etype"], 60, 5)
    shape = (rows.num_rows, heads, 3) if heads else (rows.num_rows, 3)
    y = _leaf(*shape, seed=3)
    v = torch.rand((700, heads) if heads else (700,), dtype=F64, generator=torch.Generator().manual_seed(4))
    v.requires_grad_()
    out = EdgeAggregator(g["dst"], rows.edge_row, 60, rows.num_rows)(y, v)
    m = y.index_select(0, rows.edge_row) * v.unsqueeze(-1)
    ref = torch.zeros((60,) + shape[1:], dtype=F64).index_add(0, g["dst"], m)
    _close(out, ref)
    for got, want in zip(_grads(out, [y, v]), _grads(ref, [y, v]), strict=True):
        _close(got, want)


def test_edge_aggregator_without_values_sums_and_bf16_takes_the_index_add_path():
    dst, col = torch.tensor([0, 0, 2, 2, 2]), torch.tensor([1, 1, 0, 2, 2])  # duplicate (dst, col) pairs sum
    agg = EdgeAggregator(dst, col, 3, 3)
    y = torch.arange(6, dtype=torch.float32).view(3, 2)
    want = torch.tensor([[4.0, 6.0], [0.0, 0.0], [8.0, 11.0]])
    assert torch.equal(agg(y), want)
    assert torch.equal(agg(y.bfloat16()), want.bfloat16())
    with pytest.raises(ValueError, match="y has 2 rows; this aggregator reads 3"):
        agg(y[:2])
    with pytest.raises(ValueError, match=r"values must have shape \(5,\)"):
        agg(y, torch.ones(4))
    with pytest.raises(ValueError, match=r"col holds 3, outside the allowed range \[0, 3\)"):
        EdgeAggregator(dst, torch.tensor([0, 1, 2, 3, 0]), 3, 3)


def test_gather_dot_equals_gathered_products_forward_and_backward():
    a, b = _leaf(7, 2, 4), _leaf(5, 2, 4, seed=1)
    ia = torch.randint(0, 7, (50,), generator=torch.Generator().manual_seed(2))
    ib = torch.randint(0, 5, (50,), generator=torch.Generator().manual_seed(3))
    out = gather_dot(a, ia, b, ib)
    ref = (a[ia] * b[ib]).sum(-1)
    _close(out, ref)
    for got, want in zip(_grads(out, [a, b]), _grads(ref, [a, b]), strict=True):
        _close(got, want)
    with pytest.raises(ValueError, match="same row shape"):
        gather_dot(a, ia, b[:, :1], ib)


def test_edge_softmax_equals_a_softmax_per_group_forward_and_backward():
    grp = torch.tensor([2, 0, 2, 2, 0, 3])  # group 1 has no edges
    s = _leaf(6, 2)
    out = edge_softmax(s, grp, 4)
    ref = torch.empty_like(s)
    for k in range(4):
        m = grp == k
        if m.any():
            ref = ref.index_put((m.nonzero()[:, 0],), torch.softmax(s[m], 0))
    _close(out, ref)
    _close(_grads(out, [s])[0], _grads(ref, [s])[0])
    with pytest.raises(ValueError, match="scores has 5 rows for 6 edges"):
        edge_softmax(s[:5], grp, 4)


# ---------------------------------------------------------------------------------------------------- reordering


def test_fold_attention_reorders_without_changing_the_score():
    w, att = _leaf(3, 5, 2 * 4), _leaf(3, 2, 4, seed=1)
    x = _leaf(9, 5, seed=2)
    folded = fold_attention(w, att)  # (types, in, heads)
    for t in range(3):
        _close(x @ folded[t], ((x @ w[t]).view(9, 2, 4) * att[t]).sum(-1))


def test_plan_fold_counts_multiply_adds_and_picks_the_cheaper_order():
    # destination term (no product reused): unfolded rows*in*out + rows*out, folded types*in*out + rows*in*heads
    p = plan_fold(rows=1000, num_types=4, d_in=64, d_out=64, heads=1)
    assert (p.macs_unfolded, p.macs_folded) == (
        1000 * 64 * 64 + 1000 * 64,
        4 * 64 * 64 + 1000 * 64,
    ) and p.fold
    # source term whose message h W_r is computed anyway: only the dot product is extra, so folding loses
    p = plan_fold(rows=1000, num_types=4, d_in=64, d_out=64, heads=1, product_available=True)
    assert p.macs_unfolded == 1000 * 64 and not p.fold
    # a few rows and many types: the weight x weight products cost more than they save
    assert not plan_fold(rows=2, num_types=100, d_in=64, d_out=64).fold
    assert plan_fold(rows=2, num_types=100, d_in=64, d_out=64, reorder="always").fold
    assert not plan_fold(rows=10**6, num_types=1, d_in=64, d_out=64, reorder="never").fold
    with pytest.raises(ValueError, match="d_out=10 must be a multiple of heads=3"):
        plan_fold(rows=1, num_types=1, d_in=4, d_out=10, heads=3)
    with pytest.raises(ValueError, match="reorder='sometimes' is not one of"):
        plan_fold(rows=1, num_types=1, d_in=4, d_out=4, reorder="sometimes")


def test_plan_side_runs_the_relation_gemm_over_the_side_with_fewer_rows():
    assert plan_side(100, 60).side == "dst" and plan_side(60, 100).side == "src"
    assert plan_side(60, 100, "always").side == "dst" and plan_side(100, 60, "never").side == "src"


# ------------------------------------------------------------------------------------------------ config and data


def test_hector_config_refuses_unknown_keys_and_bad_values_by_name():
    assert HectorConfig.from_dict({"materialization": "compact", "gemm": "loop"}).reorder == "auto"
    with pytest.raises(ValueError, match=r"unknown hector key\(s\) \['tile'\]; allowed: \['enabled'"):
        HectorConfig.from_dict({"tile": 16})
    with pytest.raises(ValueError, match="hector.materialization='dense' is not one of"):
        HectorConfig(materialization="dense")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"hector.compact_max_ratio=1.5 must be a number in \[0, 1\]"):
        HectorConfig(compact_max_ratio=1.5)


def test_typed_graph_is_seeded_skewed_and_validated():
    a, b = (
        typed_graph(num_nodes=500, num_edges=5000, num_etypes=8),
        typed_graph(num_nodes=500, num_edges=5000, num_etypes=8),
    )
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert a["src"].shape == a["dst"].shape == a["etype"].shape == (5000,) and a["ntype"].shape == (500,)
    counts = torch.bincount(a["etype"], minlength=8)
    assert int(counts.argmax()) == 0 and counts[0] > 2 * counts[7]  # Zipf relations: a dominant one
    deg = torch.bincount(a["src"], minlength=500).sort(descending=True).values
    assert deg[:5].sum() > 0.05 * 5000  # hub sources: 1 % of the nodes hold > 5 % of the edges
    assert torch.equal(a["ntype"], a["ntype"].sort().values) and int(a["ntype"].max()) == 3
    heavy = typed_graph(num_nodes=500, num_edges=5000, num_etypes=8, hub_alpha=2.0)
    assert (
        compact_rows(heavy["src"], heavy["etype"], 500, 8).ratio
        < compact_rows(a["src"], a["etype"], 500, 8).ratio
    )
    with pytest.raises(ValueError, match="bad hub_alpha=1.0"):
        typed_graph(TypedGraphSpec(hub_alpha=1.0))


def test_gather_rows_sums_a_hub_rows_edge_gradients_in_fp32_for_bf16():
    """A compact row feeds every edge of its (source, type) pair: 4,096 edges of one hub row in bf16.

    Constructed so that summing in bf16 provably loses it: 4,096 gradients of 1.0 (bf16 has 8 significant bits, so a
    running bf16 sum stops at 256, where 256 + 1 rounds back to 256). gather_rows must give 4,096 exactly. torch's own
    CPU index_add happens to sum bf16 accurately, so this cannot tell it from gather_rows on the CPU; the sum in bf16
    is CUDA's problem (tests/gpu/hector_ops.py asserts the same case on the GPU, and the probe below checks the dtype
    every sum runs in)."""
    index = torch.tensor([0] * 4096 + [1, 2, 2])
    ones = torch.ones(index.numel(), 8, dtype=torch.bfloat16)
    running = torch.zeros((), dtype=torch.bfloat16)
    for _ in range(4096):  # what a bf16 accumulator holds after each term
        running = running + torch.ones((), dtype=torch.bfloat16)
    assert running.item() == 256.0  # the case discriminates
    y = torch.randn(3, 8, dtype=torch.bfloat16, requires_grad=True)
    out = gather_rows(y, index)
    assert torch.equal(out, y.detach().index_select(0, index))
    with LowPrecisionSums() as probe:
        out.backward(ones)
    assert probe.found == []
    assert y.grad[0].eq(4096).all() and y.grad[1].eq(1).all() and y.grad[2].eq(2).all()
    # random gradients: one rounding of the fp32 sum, at the end
    y.grad = None
    g = torch.randn(index.numel(), 8, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    gather_rows(y, index).backward(g)
    assert torch.equal(y.grad, torch.zeros(3, 8).index_add_(0, index, g.float()).to(torch.bfloat16))
    with pytest.raises(ValueError, match=r"index holds 3, outside the allowed range \[0, 3\)"):
        gather_rows(y, torch.tensor([3]))


def test_bf16_ops_sum_in_fp32_and_take_values_of_another_dtype():
    """The layers' bf16 path: vanilla rows (one per edge: a hub source's gradient sums thousands), the aggregation
    (gather + index_add: its backward sums every edge of a compact row), gather_dot and edge_softmax."""
    g = _graph()
    rows_v = vanilla_rows(g["src"], g["etype"], 60, 5)
    rows_c = compact_rows(g["src"], g["etype"], 60, 5)
    x = torch.randn(60, 8, generator=torch.Generator().manual_seed(0)).bfloat16().requires_grad_()
    w = torch.randn(5, 8, 6, generator=torch.Generator().manual_seed(1)).bfloat16().requires_grad_()
    v = torch.rand(700, generator=torch.Generator().manual_seed(2))  # float32 values, bf16 rows
    agg = EdgeAggregator(g["dst"], rows_c.edge_row, 60, rows_c.num_rows)
    with LowPrecisionSums() as probe:
        mv = materialize(x, w, rows_v, gemm="loop")
        mc = materialize(x, w, rows_c, gemm="loop")
        out = agg(mc, v)
        s = gather_dot(mc, rows_c.edge_row, x[:, :6], g["dst"])
        a = edge_softmax(s, g["dst"], 60)
        (out.float().square().sum() + mv.float().sum() + a.float().square().sum()).backward()
    assert probe.found == []
    assert out.dtype == torch.bfloat16 and a.dtype == torch.bfloat16
    # values of another dtype are cast to the rows' dtype, as the CSR path does (crashed in index_add_)
    assert torch.equal(out, agg(mc, v.bfloat16()))
    ref = EdgeAggregator(g["dst"], rows_c.edge_row, 60, rows_c.num_rows)(mc.detach().double(), v.double())
    torch.testing.assert_close(out.double(), ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item())
