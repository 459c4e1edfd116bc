"""PyTorch-Direct's pure models (issue 39): the 128-B request count (thesis Figs. 4.4-4.5), Table 4.2 placement, the
kernel launch shape. Framework-free: run once (llm lane)."""

from __future__ import annotations

import numpy as np
import pytest

from flowlane.direct import launch_shape, mean_requests, place, request_counts

pytestmark = pytest.mark.once

# the thesis' scaled example: warp = 4 threads, 16-B lines, 4-B features, 11 features per node, nodes 0, 2, 4 gathered
SCALED = dict(row_elems=11, elem_bytes=4, warp=4, line_bytes=16)


def test_request_model_reproduces_the_thesis_scaled_example_7_to_5():
    naive = request_counts([0, 2, 4], scheme="flat", **SCALED)
    shifted = request_counts([0, 2, 4], scheme="flat_shift", **SCALED)
    assert naive[1] == 7 and shifted[1] == 5  # node 2 (thesis §4.4.5)
    assert naive.sum() == 16 and shifted.sum() == 13  # all three nodes, counted by hand (digest §3.2.5)
    assert list(naive) == [3, 7, 6] and list(shifted) == [3, 5, 5]


def test_per_row_schemes_against_a_hand_count():
    # one fp32 row of 33 elements starting 4 B into line 1 (row 1 at base 0): lines 1 and 2
    # lanes 0-31 straddle lines 1-2, lane 32 reads line 2 again
    assert request_counts([1], 33, 4, "row")[0] == 3
    # lane 0 idles; lanes 1-31 line 1; lanes 32-33 line 2
    assert request_counts([1], 33, 4, "row_aligned")[0] == 2
    assert request_counts([1], 33, 4, "min")[0] == 2


def test_request_model_matches_the_digest_table_for_2048_to_2076_byte_rows():
    # digest research/003 §3.2.5 ([proto], 2,000 random rows): naive flattened / thesis shift / DGL aligned / minimum
    table = {
        2048: (16.0, 16.0, 16.0, 16.0),
        2052: (32.45, 18.39, 17.0, 17.0),
        2060: (32.58, 18.46, 17.07, 17.07),
        2076: (32.82, 18.57, 17.19, 17.19),
    }
    for row_bytes, want in table.items():
        got = mean_requests(row_bytes, 4, n_rows=2000, seed=0)  # as many random rows as the digest drew
        for scheme, w in zip(("flat", "flat_shift", "row_aligned", "min"), want, strict=True):
            assert got[scheme] == pytest.approx(w, abs=0.1), (row_bytes, scheme, got[scheme], w)
        if row_bytes == 2052:  # a misaligned row costs ~1.9x the requests of the aligned mapping
            assert got["flat"] / got["row_aligned"] == pytest.approx(1.9, abs=0.05)


@pytest.mark.parametrize("row_bytes", [128, 256, 260, 1000, 2052, 4100])
@pytest.mark.parametrize("base_bytes", [0, 4, 124])
def test_the_aligned_per_row_scheme_reaches_the_minimum_for_fp32(row_bytes, base_bytes):
    rows = np.arange(40)
    aligned = request_counts(rows, row_bytes // 4, 4, "row_aligned", base_bytes=base_bytes)
    assert np.array_equal(aligned, request_counts(rows, row_bytes // 4, 4, "min", base_bytes=base_bytes))
    assert (request_counts(rows, row_bytes // 4, 4, "row", base_bytes=base_bytes) >= aligned).all()


def test_column_windows_and_lists_count_only_the_lines_they_touch():
    # 2048-B rows start on a line: columns 64..191 are bytes 256..767 of the row, exactly 4 lines
    assert list(request_counts([3, 9], 512, 4, "row_aligned", cols=(64, 128))) == [4, 4]
    assert list(request_counts([3, 9], 512, 4, "row", cols=(1, 128))) == [
        8,
        8,
    ]  # 4 B off: each of 4 warps reads 2 lines
    assert list(request_counts([3, 9], 512, 4, "row_aligned", cols=(1, 128))) == [
        5,
        5,
    ]  # the 5 lines it overlaps
    assert list(request_counts([0], 512, 4, "min", cols=[0, 1, 40])) == [2]
    assert list(request_counts([0], 512, 4, "row", cols=[0, 1, 40])) == [2]
    assert list(request_counts([], 512, 4, "row")) == []


def test_request_model_refuses_bad_arguments_naming_them():
    with pytest.raises(ValueError, match="scheme='fast' is not one of"):
        request_counts([0], 8, 4, "fast")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="row_elems=0 must be an integer >= 1"):
        request_counts([0], 0, 4, "row")
    with pytest.raises(ValueError, match="a column list is gathered by the 'row' lane mapping only"):
        request_counts([0], 8, 4, "flat", cols=[1, 2])
    with pytest.raises(ValueError, match=r"cols=\(start=6, count=4\)"):
        request_counts([0], 8, 4, "row", cols=(6, 4))
    with pytest.raises(ValueError, match="row_bytes=2050 must be a multiple of elem_bytes=4"):
        mean_requests(2050, 4)


# Table 4.2 (digest §3.2.3), one case per row and per compute branch
PLACEMENT = [
    (["unified_gpu", "cpu"], "gpu", "unified_host", "A1"),
    (["unified_gpu", "cuda", "cpu_scalar"], "gpu", "cuda", "A2"),
    (["unified_gpu", "cpu_scalar"], "gpu", "cuda", "A3"),
    (["unified_gpu", "unified_gpu"], "gpu", "cuda", "A3"),
    (["unified_host", "cpu"], "cpu", "unified_host", "B1"),
    (["unified_host", "unified_gpu", "cpu"], "gpu", "unified_host", "B1"),
    (["unified_host", "cpu", "cuda"], "gpu", "unified_host", "B1"),
    (["unified_host", "cuda"], "gpu", "unified_host", "B2"),
    (["unified_host", "cpu_scalar"], "cpu", "unified_host", "B3"),
    (["unified_host", "unified_gpu"], "gpu", "unified_host", "B3"),
]


@pytest.mark.parametrize(
    ("ops", "compute", "output", "rule"), PLACEMENT, ids=[f"{p[3]}-{'+'.join(p[0])}" for p in PLACEMENT]
)
def test_placement_follows_table_4_2(ops, compute, output, rule):
    p = place(ops)
    assert (p.compute, p.output, p.rule) == (compute, output, rule)


def test_placement_refuses_operators_without_a_unified_operand_and_unknown_kinds():
    with pytest.raises(ValueError, match="at least one unified operand"):
        place(["cpu", "cuda"])
    with pytest.raises(ValueError, match=r"operand kind\(s\) \['unified'\] not allowed"):
        place(["unified"])  # type: ignore[list-item]


@pytest.mark.parametrize("n_cols", [1, 31, 64, 95, 513, 1025, 4096])
@pytest.mark.parametrize("elem", [2, 4])
def test_launch_shape_covers_every_lane_with_power_of_two_tiles(n_cols, elem):
    for aligned in (True, False):
        block, chunks, rows = launch_shape(n_cols, elem, aligned)
        span = n_cols + (128 // elem - 1 if aligned else 0)
        assert block & (block - 1) == 0 and rows & (rows - 1) == 0 and 64 <= block <= 1024
        assert (chunks - 1) * block < span <= chunks * block
    assert launch_shape(513, 4, True, rows_per_program=4)[2] == 4
