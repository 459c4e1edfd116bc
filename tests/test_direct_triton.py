"""PyTorch-Direct's Triton zero-copy kernels under TRITON_INTERPRET=1 (issue 39): the index arithmetic, alignment
shift, masks and dtypes, checked bitwise against ``table[idx]`` on CPU tensors (the interpreter reads a CPU tensor where
the GPU reads the pinned table's UVA address). Speed needs the GPU script tests/gpu/direct_gather.py.

Runs once (llm lane, whose torch brings a working Triton); a Triton that does not import there fails these tests.
"""

from __future__ import annotations

import importlib

import pytest
import torch

from flowlane.direct import DirectConfig, FeatureStore, zero_copy_gather
from flowlane.direct.store import word_bytes

pytestmark = pytest.mark.once


@pytest.fixture(autouse=True)
def interpreted(monkeypatch):
    """Kernels decorated while TRITON_INTERPRET=1 run in Triton's CPU interpreter."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    import flowlane.direct.kernels as k

    if type(k.gather_rows_kernel).__name__ != "InterpretedFunction":
        importlib.reload(k)
    assert type(k.gather_rows_kernel).__name__ == "InterpretedFunction"


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32 if t.element_size() == 4 else torch.int16)


def _table(dtype, rows, cols, seed=0):
    return torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("cols", [1, 31, 64, 65, 97])
@pytest.mark.parametrize("aligned", [True, False], ids=["aligned", "naive"])
def test_zero_copy_kernel_is_bitwise_table_indexing(dtype, cols, aligned):
    t = _table(dtype, 40, cols)
    idx = torch.tensor([39, 0, 7, 7, 13, 0, 25, 38, 1])
    out = zero_copy_gather(t, idx, "cpu", aligned=aligned)
    assert out.shape == (9, cols) and torch.equal(_bits(out), _bits(t[idx]))


def test_row_windows_move_as_the_widest_word_that_divides_them_and_stay_bitwise():
    t = _table(torch.bfloat16, 40, 64)  # 128-B rows
    assert word_bytes(t, 0, 64) == 8 and word_bytes(t, 2, 60) == 4 and word_bytes(t, 1, 62) == 2
    assert word_bytes(t[:, 1:], 0, 63) == 2  # a view starting 2 B into its row: the address decides
    assert word_bytes(_table(torch.float32, 4, 3), 0, 3) == 4  # 12-B rows: no word wider than an element
    idx = torch.tensor([39, 0, 7, 7, 13])
    for cols in (None, range(2, 62), range(1, 64), range(4, 8)):
        want = t[idx] if cols is None else t[idx][:, cols.start : cols.stop]
        for widen in (True, False):
            for aligned in (True, False):
                out = zero_copy_gather(t, idx, "cpu", cols=cols, aligned=aligned, widen=widen)
                assert out.dtype == t.dtype and torch.equal(_bits(out), _bits(want)), (cols, widen, aligned)


@pytest.mark.parametrize("offset_rows", [1, 3])
def test_a_table_that_starts_off_a_128_byte_line_is_gathered_exactly(offset_rows):
    # 132-B rows: a view from row 1 starts 4 B past the allocation's alignment
    big = _table(torch.float32, 30, 33)
    t = big[offset_rows:]
    assert (t.data_ptr() % 128) != 0
    idx = torch.arange(t.shape[0]).flip(0)
    for aligned in (True, False):
        assert torch.equal(zero_copy_gather(t, idx, "cpu", aligned=aligned), t[idx])


def test_many_rows_span_several_programs_and_a_partial_last_tile():
    t = _table(torch.bfloat16, 300, 20, seed=1)
    idx = torch.randint(0, 300, (131,), generator=torch.Generator().manual_seed(2))
    out = zero_copy_gather(t, idx, "cpu", rows_per_program=8)
    assert torch.equal(_bits(out), _bits(t[idx]))


@pytest.mark.parametrize(
    "cols", [None, range(3, 17), torch.tensor([19, 0, 7])], ids=["rows", "range", "list"]
)
def test_sorted_index_order_writes_every_row_to_its_own_place(cols):
    t = _table(torch.float16, 200, 20, seed=3)
    idx = torch.randint(0, 200, (77,), generator=torch.Generator().manual_seed(4))
    idx[5] = idx[60]  # a repeated index: both output rows get it
    want = (
        t[idx]
        if cols is None
        else t[idx][:, torch.as_tensor(list(cols)) if isinstance(cols, range) else cols]
    )
    out = zero_copy_gather(t, idx, "cpu", cols=cols, sort_indices=True, rows_per_program=8)
    assert torch.equal(_bits(out), _bits(want))
    store = FeatureStore(t, DirectConfig(path="zero-copy", sort_indices=True, num_warps=8), device="cpu")
    assert torch.equal(_bits(store.gather(idx, cols=cols)), _bits(want))


@pytest.mark.parametrize(
    "cols",
    [range(1, 40), range(32, 64), torch.tensor([0, 5, 6, 63, 2]), torch.tensor([10, 11, 12])],
    ids=["misaligned-range", "aligned-range", "list", "contiguous-list"],
)
def test_column_masked_kernels_equal_indexing_the_gathered_rows(cols):
    t = _table(torch.float16, 50, 64)
    idx = torch.tensor([49, 3, 3, 20])
    want = t[idx][:, torch.as_tensor(list(cols)) if isinstance(cols, range) else cols]
    assert torch.equal(_bits(zero_copy_gather(t, idx, "cpu", cols=cols)), _bits(want))


def test_feature_store_takes_the_zero_copy_path_and_keeps_its_contract():
    t = _table(torch.float32, 12, 6)
    store = FeatureStore(t, DirectConfig(path="zero-copy"), device="cpu")
    assert store.path == "zero-copy" and "interpreted" in store.choice.reason
    assert FeatureStore(t, device="cpu").path == "zero-copy"  # auto picks it when the kernel can run
    idx = torch.tensor([11, 11, 0], dtype=torch.int32)
    assert torch.equal(store.gather(idx), t[idx.long()])
    assert store.gather(torch.empty(0, dtype=torch.int64)).shape == (0, 6)
    with pytest.raises(IndexError, match="index 12 at position 1"):
        store.gather(torch.tensor([0, 12]))
    assert torch.equal(store.gather(idx, cols=range(2, 5)), t[idx.long()][:, 2:5])


def test_the_zero_copy_and_cpu_paths_agree_on_a_3d_table():
    t = _table(torch.float32, 9, 8).reshape(9, 2, 4)
    idx = torch.tensor([8, 2, 2])
    zc = FeatureStore(t, DirectConfig(path="zero-copy"), device="cpu").gather(idx)
    cpu = FeatureStore(t, DirectConfig(path="cpu-gather"), device="cpu").gather(idx)
    assert zc.shape == (3, 2, 4) and torch.equal(zc, cpu) and torch.equal(zc, t[idx])
