"""PyTorch-Direct feature store, CPU path (issue 39): exact gathers, index checks, path choice, config errors.

Runs in both lanes: the DGL plugin (gnn lane) uses this core.
"""

from __future__ import annotations

import pytest
import torch

from flowlane.direct import (
    DirectConfig,
    FeatureStore,
    check_indices,
    choose_path,
    cpu_gather,
    default_choice,
    group_columns_,
)

DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.uint8)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}[t.element_size()])


def _table(dtype: torch.dtype, rows: int = 23, cols: int = 5, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(rows, cols, generator=g).to(dtype)
    return torch.randint(0, 200, (rows, cols), generator=g).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cpu_gather_is_bitwise_table_indexing_for_every_dtype_with_repeated_indices(dtype):
    t = _table(dtype)
    idx = torch.tensor([3, 0, 22, 3, 3, 7, 0])
    with FeatureStore(t, DirectConfig(path="cpu-gather"), device="cpu") as store:
        out = store.gather(idx)
    with pytest.raises(RuntimeError, match="closed"):
        store.gather(idx)
    assert out.dtype == dtype and out.shape == (7, 5)
    assert torch.equal(_bits(out), _bits(t[idx]))


def test_nan_payloads_and_signed_zeros_survive_the_gather():
    t = torch.tensor([[float("nan"), -0.0], [1.0, float("-inf")]])
    t.view(torch.int32)[0, 0] = 0x7FC00123  # a NaN with a payload
    out = cpu_gather(t, torch.tensor([0, 1, 0]), "cpu")
    assert torch.equal(_bits(out), _bits(t[torch.tensor([0, 1, 0])]))


def test_gather_of_no_indices_is_an_empty_tensor_with_the_row_shape():
    t = torch.zeros(4, 3, 2, dtype=torch.bfloat16)
    out = FeatureStore(t, device="cpu").gather(torch.empty(0, dtype=torch.int64))
    assert out.shape == (0, 3, 2) and out.dtype == torch.bfloat16


def test_multi_dimensional_rows_keep_their_shape():
    t = torch.arange(60.0).reshape(5, 3, 4)
    idx = torch.tensor([4, 1, 1])
    assert torch.equal(FeatureStore(t, device="cpu").gather(idx), t[idx])


def test_one_dimensional_table_gathers_scalars():
    t = torch.arange(10, dtype=torch.float16)
    assert torch.equal(FeatureStore(t, device="cpu").gather(torch.tensor([9, 0])), t[torch.tensor([9, 0])])


def test_int32_indices_give_the_same_rows_as_int64():
    t = _table(torch.float32)
    a = FeatureStore(t, device="cpu").gather(torch.tensor([1, 2, 2], dtype=torch.int32))
    assert torch.equal(a, t[torch.tensor([1, 2, 2])])


@pytest.mark.parametrize(
    ("idx", "bad", "pos"), [([0, 5, 23, 3], 23, 2), ([4, -1], -1, 1), ([10**12], 10**12, 0)]
)
def test_an_out_of_range_index_is_refused_naming_it_and_its_position(idx, bad, pos):
    store = FeatureStore(_table(torch.float32), device="cpu")
    with pytest.raises(IndexError) as e:
        store.gather(torch.tensor(idx))
    assert f"index {bad} at position {pos}" in str(e.value) and "allowed: 0..22" in str(e.value)


def test_indices_of_another_dtype_or_shape_are_refused():
    with pytest.raises(TypeError, match="torch.float32 is not allowed"):
        check_indices(torch.tensor([1.0]), 4)
    with pytest.raises(ValueError, match=r"1-D, got shape \(1, 2\)"):
        check_indices(torch.tensor([[1, 2]]), 4)
    with pytest.raises(TypeError, match="list"):
        check_indices([1, 2], 4)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "cols",
    [slice(1, 4), range(0, 5), range(2, 2), torch.tensor([4, 0, 2]), torch.tensor([1, 2, 3])],
    ids=["slice", "all", "empty", "list", "contiguous-list"],
)
def test_column_selection_equals_indexing_the_gathered_rows(cols):
    t = _table(torch.float16)
    idx = torch.tensor([5, 5, 0, 22])
    want = t[idx][
        :, cols if isinstance(cols, slice | torch.Tensor) else torch.tensor(list(cols), dtype=torch.int64)
    ]
    assert torch.equal(FeatureStore(t, device="cpu").gather(idx, cols=cols), want)


def test_a_bad_column_selection_is_refused_naming_it():
    store = FeatureStore(_table(torch.float32), device="cpu")
    with pytest.raises(IndexError, match="column 5 at position 1 is out of range for 5 columns"):
        store.gather(torch.tensor([0]), cols=torch.tensor([0, 5]))
    with pytest.raises(IndexError, match="column range 3..5"):
        store.gather(torch.tensor([0]), cols=range(3, 6))
    with pytest.raises(ValueError, match="step 1"):
        store.gather(torch.tensor([0]), cols=slice(0, 4, 2))
    with pytest.raises(ValueError, match="needs a 2-D table"):
        FeatureStore(torch.zeros(3, 2, 2), device="cpu").gather(torch.tensor([0]), cols=range(1))


def test_a_table_that_would_need_a_copy_is_refused():
    t = torch.zeros(6, 4)
    with pytest.raises(ValueError, match="contiguous"):
        FeatureStore(t.t(), device="cpu")
    with pytest.raises(TypeError, match="ndarray"):
        FeatureStore(t.numpy(), device="cpu")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="meta"):
        FeatureStore(torch.zeros(2, 2, device="meta"))


def test_without_cuda_the_auto_path_is_cpu_gather_and_says_why(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert choose_path("cuda").path == "cpu-gather" and "no usable CUDA device" in choose_path("cuda").reason
    c = default_choice()
    assert c.path == "cpu-gather" and c.reason == "no usable CUDA device"
    store = FeatureStore(torch.zeros(3, 2))
    assert store.path == "cpu-gather" and store.device == torch.device("cpu") and not store.table.is_pinned()


def test_two_stores_on_one_table_keep_it_pinned_until_the_last_closes(monkeypatch):
    # CUDA registration simulated: closing the first store used to unpin the table under the second's zero-copy reads
    import flowlane.direct.store as S

    registered: list[int] = []

    def register(t: torch.Tensor) -> None:
        assert t.data_ptr() not in registered, "cudaError 712: already registered"
        registered.append(t.data_ptr())

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda t: t.data_ptr() in registered)
    monkeypatch.setattr(S, "choose_path", lambda *a, **k: S.PathChoice("zero-copy", "simulated"))
    monkeypatch.setattr(S, "_register", register)
    monkeypatch.setattr(S, "_unregister", registered.remove)
    table, own = torch.zeros(4, 8), torch.zeros(4, 8)
    a, b = FeatureStore(table, device="cuda"), FeatureStore(table, device="cuda")
    assert registered == [table.data_ptr()]
    a.close()
    assert registered == [table.data_ptr()]  # b still reads it
    b.close()
    b.close()  # idempotent
    assert registered == [] and S._PINS == {}
    registered.append(own.data_ptr())  # the caller's own pinned table: used as is, never unpinned by a store
    FeatureStore(own, device="cuda").close()
    assert registered == [own.data_ptr()]


def test_zero_copy_is_refused_at_construction_where_it_cannot_run(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(
        RuntimeError, match="direct.path='zero-copy' cannot run here: the target device is the CPU"
    ):
        FeatureStore(torch.zeros(3, 2), DirectConfig(path="zero-copy"), device="cpu")


def test_a_dtype_outside_the_kernel_set_takes_the_cpu_path_with_the_reason(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # zero-copy would otherwise be possible on this CPU
    c = choose_path("cpu", torch.float64)
    assert c.path == "cpu-gather" and "torch.float64" in c.reason
    with pytest.raises(RuntimeError, match="dtype torch.int64"):
        choose_path("cpu", torch.int64, requested="zero-copy")


def test_config_refuses_bad_values_naming_the_key_and_the_allowed_ones():
    with pytest.raises(
        ValueError, match=r"direct.path='gpu' is not one of \('auto', 'zero-copy', 'cpu-gather'\)"
    ):
        DirectConfig(path="gpu")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="direct.aligned='yes' must be true or false"):
        DirectConfig(aligned="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="rows_per_program=3 must be 0"):
        DirectConfig(rows_per_program=3)
    with pytest.raises(ValueError, match="num_warps=3 must be one of"):
        DirectConfig(num_warps=3)
    with pytest.raises(ValueError, match="sort_indices=1 must be true or false"):
        DirectConfig(sort_indices=1)
    with pytest.raises(ValueError, match=r"unknown direct key\(s\) \['algin'\]; allowed: \['path'"):
        DirectConfig.from_dict({"algin": True})
    assert DirectConfig.from_dict({"path": "cpu-gather"}).path == "cpu-gather"


def test_grouping_columns_in_place_makes_a_column_selection_a_range():
    t = _table(torch.float32, rows=7, cols=6)
    old = t.clone()
    ptr = t.data_ptr()
    perm = group_columns_(t, torch.tensor([4, 1]), chunk_rows=3)
    assert perm.tolist() == [4, 1, 0, 2, 3, 5] and t.data_ptr() == ptr
    assert torch.equal(t, old[:, perm])
    idx = torch.tensor([6, 0])
    assert torch.equal(FeatureStore(t, device="cpu").gather(idx, cols=range(0, 2)), old[idx][:, [4, 1]])
    with pytest.raises(ValueError, match="distinct"):
        group_columns_(t, torch.tensor([2, 2]))
    with pytest.raises(IndexError, match="column 6 at position 0"):
        group_columns_(t, torch.tensor([6]))
