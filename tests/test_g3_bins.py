"""G3 bins under a memory budget (dgl_plugin.g3_bins; seed 000 §4.4.1, digest B6 #8): pure numpy."""

import numpy as np
import pytest

from dgl_plugin.g3_bins import bin_bytes, pack_bins

pytestmark = pytest.mark.once

WIDTHS = [(6, 8, 0), (8, 4, 0)]
GAT = [(6, 32, 4), (32, 4, 1)]  # (d_in, d_out, d_edge): a 4-head attention layer, then a 1-head one


def _csr(n, seed=0):
    """In-edges of n destination rows: node v reads sources e_src[eptr[v]:eptr[v+1]] (with repeats), some halo."""
    rng = np.random.default_rng(seed)
    deg = rng.integers(0, 12, n)
    eptr = np.concatenate([[0], np.cumsum(deg)])
    return eptr, rng.integers(0, n + n // 4, int(eptr[-1]))


def test_bin_bytes_is_the_widest_layers_forward_and_backward_estimate():
    # 2 * (n_src * d_in + n_dst * (d_in + d_out) + n_edges * d_edge) * itemsize, widest layer
    assert bin_bytes(10, 3, WIDTHS, 4) == max(2 * (10 * 6 + 3 * 14) * 4, 2 * (10 * 8 + 3 * 12) * 4) == 928
    assert bin_bytes(10, 3, WIDTHS, 4, n_edges=50) == 928  # no per-edge term without attention


def test_attention_layers_count_their_per_edge_values():
    """B6 #8: a GAT layer holds an attention value per edge and head (and its gradient)."""
    assert bin_bytes(10, 3, GAT, 4, n_edges=50) == max(
        2 * (10 * 6 + 3 * 38 + 50 * 4) * 4, 2 * (10 * 32 + 3 * 36 + 50 * 1) * 4
    )
    # packing counts the edges: a hub's 40 in-edges at 4 heads alone need more than its rows
    eptr = np.array([0, 1, 41, 42])
    with pytest.raises(ValueError, match=r"destination row 1 \(in-degree 40\) needs 6624 bytes"):
        pack_bins(np.arange(3), eptr, np.arange(42), 100, 5_000, [(6, 8, 4)], 8)
    assert bin_bytes(40, 1, [(6, 8, 0)], 8, 40) == 4_064 <= 5_000  # fits without attention


@pytest.mark.parametrize("widths", [WIDTHS, GAT], ids=["no-attention", "gat"])
@pytest.mark.parametrize("max_bytes,max_nodes", [(2_000, 1000), (8_000, 1000), (1e9, 7), (1e9, 1000)])
def test_bins_cover_the_rows_in_order_and_respect_both_caps(max_bytes, max_nodes, widths):
    eptr, e_src = _csr(300)
    rows = np.random.default_rng(1).permutation(300)
    if widths is GAT and max_bytes < 1e9:
        max_bytes *= 4  # the per-edge term: a bin of one hub must still fit
    bins = pack_bins(rows, eptr, e_src, max_nodes, max_bytes, widths, 8)
    assert np.array_equal(np.concatenate(bins), rows)  # consecutive, in the given order, each row once

    def estimate(b):
        n_src = np.unique(np.concatenate([e_src[eptr[v] : eptr[v + 1]] for v in b])).size
        return bin_bytes(n_src, b.size, widths, 8, int((eptr[b + 1] - eptr[b]).sum()))

    for b in bins:
        assert b.size <= max_nodes
        assert estimate(b) <= max_bytes
    # greedy: a bin closes only when its next row would not fit
    for b, nxt in zip(bins[:-1], bins[1:], strict=True):
        grown = np.concatenate([b, nxt[:1]])
        assert grown.size > max_nodes or estimate(grown) > max_bytes
    if max_bytes == 1e9:
        assert len(bins) == -(-300 // max_nodes)


def test_a_row_that_alone_exceeds_the_cap_is_refused_by_name():
    eptr = np.array([0, 1, 41, 42])
    e_src = np.arange(42)
    with pytest.raises(ValueError, match=r"destination row 1 \(in-degree 40\) needs 5312 bytes"):
        pack_bins(np.arange(3), eptr, e_src, 100, 2_000, WIDTHS, 8)


def test_bad_arguments_are_refused():
    eptr, e_src = _csr(10)
    with pytest.raises(ValueError, match="max_nodes=0"):
        pack_bins(np.arange(10), eptr, e_src, 0, 1e6, WIDTHS, 8)
    with pytest.raises(ValueError, match="widths"):
        pack_bins(np.arange(10), eptr, e_src, 5, 1e6, [], 8)
