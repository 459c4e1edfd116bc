"""PyTorch-Direct feature store, CPU path (issue 39): exact gathers, index checks, path choice, config errors.

Runs in both lanes: the DGL plugin (gnn lane) uses this core.
"""

from __future__ import annotations

import contextlib

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


class _Cuda:
    """CUDA simulated on the CPU, as the driver behaves: cudaHostRegister pins byte ranges and refuses one overlapping
    a registered range (error 712); ``is_pinned`` is true for any address inside a pinned range (so for views)."""

    def __init__(self) -> None:
        self.ranges: dict[int, int] = {}  # registered start -> bytes
        self.caller_pinned: dict[
            int, int
        ] = {}  # the caller's own pinned memory (cudaHostAlloc / pin_memory_)
        self.log: list[str] = []
        self.entered: list[torch.device] = []  # torch.cuda.device contexts open now
        self.registered_on: list[torch.device | None] = []

    def register(self, t: torch.Tensor) -> None:
        lo, n = t.data_ptr(), t.numel() * t.element_size()
        for q, m in (self.ranges | self.caller_pinned).items():
            assert not (lo < q + m and q < lo + n), "cudaError 712: part of the range is registered already"
        self.ranges[lo] = n
        self.log.append(f"register {n}")
        self.registered_on.append(self.entered[-1] if self.entered else None)

    def unregister(self, ptr: int) -> None:
        self.log.append(f"unregister {self.ranges.pop(ptr)}")

    def is_pinned(self, t: torch.Tensor) -> bool:
        p = t.data_ptr()
        return any(q <= p < q + m for q, m in (self.ranges | self.caller_pinned).items())


@pytest.fixture
def cuda(monkeypatch):
    """Two simulated CUDA devices (current: 0), registration simulated, zero-copy chosen, gathers and events faked
    (each kernel launch and event call is logged)."""
    import flowlane.direct.store as S

    sim = _Cuda()

    class Event:
        def record(self, stream: str) -> None:
            sim.log.append(f"record on {stream}")

        def synchronize(self) -> None:
            sim.log.append("synchronize")

    @contextlib.contextmanager
    def device(d):
        sim.entered.append(torch.device(d))
        yield
        sim.entered.pop()

    def gather(table, idx, device, *a, **k):
        sim.log.append(f"kernel on {device}")
        return table[idx]

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "device", device)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda d: f"the current stream of {d}")
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda t: sim.is_pinned(t))
    monkeypatch.setattr(S, "choose_path", lambda *a, **k: S.PathChoice("zero-copy", "simulated"))
    monkeypatch.setattr(S, "zero_copy_gather", gather)
    monkeypatch.setattr(S, "_register", sim.register)
    monkeypatch.setattr(S, "_unregister", sim.unregister)
    monkeypatch.setattr(S, "_PINS", {})  # this test's registrations only
    return sim


def test_two_stores_on_one_table_keep_it_pinned_until_the_last_closes(cuda):
    # closing the first store used to unpin the table under the second's zero-copy reads
    table, own = torch.zeros(4, 8), torch.zeros(4, 8)
    a, b = FeatureStore(table, device="cuda"), FeatureStore(table, device="cuda")
    assert cuda.ranges == {table.data_ptr(): 128}
    a.close()
    assert cuda.ranges == {table.data_ptr(): 128}  # b still reads it
    b.close()
    b.close()  # idempotent
    assert cuda.ranges == {}
    cuda.caller_pinned[own.data_ptr()] = (
        128  # the caller's own pinned table: used as is, never unpinned by a store
    )
    FeatureStore(own, device="cuda").close()
    assert cuda.ranges == {} and cuda.log == ["register 128", "unregister 128"]


def test_a_store_on_a_view_shares_the_pin_of_the_table_it_lies_in(cuda):
    # the pin used to be counted by exact address: a view was taken for the caller's own pinned memory (no reference)
    # and closing the table's store unpinned it under the view's reads
    t = torch.zeros(100, 8)
    a = FeatureStore(t, device="cuda")
    b, c = FeatureStore(t[10:], device="cuda"), FeatureStore(t[:10], device="cuda")
    a.close()
    c.close()
    assert cuda.ranges == {t.data_ptr(): 3200}  # b still reads rows 10..99
    b.close()
    assert cuda.ranges == {} and cuda.log == ["register 3200", "unregister 3200"]


@pytest.mark.parametrize(
    "first", [slice(0, 10), slice(10, 100), slice(5, 20)], ids=["head", "tail", "middle"]
)
def test_a_table_partly_overlapping_a_pinned_range_is_refused_naming_both(cuda, first):
    # FeatureStore(t[:10]) then FeatureStore(t) used to count t as pinned (same address) with 320 of its 3200 bytes
    # registered, and t[10:] then t failed with a bare cudaError 712
    t = torch.zeros(100, 8)
    part = FeatureStore(t[first], device="cuda")
    lo = t.data_ptr()
    p0 = lo + first.start * 32
    with pytest.raises(RuntimeError) as e:
        FeatureStore(t, device="cuda")
    msg = str(e.value)
    assert f"[{lo:#x}, {lo + 3200:#x}) (3,200 B) partly overlap the range [{p0:#x}, " in msg
    assert "build the store on the enclosing table first" in msg
    part.close()
    FeatureStore(t, device="cuda").close()  # alone it pins
    assert cuda.log[-2:] == ["register 3200", "unregister 3200"]


def test_a_store_waits_for_its_last_kernel_before_unpinning(cuda):
    # kernels are asynchronous: close (or the GC, for FeatureStore(t).gather(idx) as one line) used to unpin the table
    # while the last kernel could still read it
    t, idx = torch.arange(32.0).reshape(4, 8), torch.tensor([3, 1])
    store = FeatureStore(t, device="cuda")
    assert torch.equal(store.gather(idx), t[idx]) and torch.equal(store.gather(idx), t[idx])
    store.close()
    kernel, record = "kernel on cuda:0", "record on the current stream of cuda:0"
    assert cuda.log == ["register 128", kernel, record, kernel, record, "synchronize", "unregister 128"]
    cuda.log.clear()
    assert torch.equal(FeatureStore(t, device="cuda").gather(idx), t[idx])  # collected right away
    assert cuda.log == ["register 128", kernel, record, "synchronize", "unregister 128"]


def test_zero_copy_gather_runs_on_its_target_device(monkeypatch):
    # Triton launches on the current device and stream: a gather onto cuda:1 used to run where the caller's thread
    # stood (DGL's prefetch thread: device 0)
    import flowlane.direct.store as S

    entered: list[torch.device] = []
    seen: list[tuple[torch.device, list[torch.device]]] = []

    class Device:  # torch.cuda.device, recorded
        def __init__(self, d: torch.device) -> None:
            self.d = d

        def __enter__(self) -> None:
            entered.append(self.d)

        def __exit__(self, *exc: object) -> None:
            entered.pop()

    monkeypatch.setattr(torch.cuda, "device", Device)
    monkeypatch.setattr(S, "_zero_copy_gather", lambda t, i, d, *a: seen.append((d, list(entered))))
    S.zero_copy_gather(torch.zeros(4, 2), torch.tensor([1]), "cuda:1")
    S.zero_copy_gather(torch.zeros(4, 2), torch.tensor([1]), "cpu")
    cuda1, cpu = torch.device("cuda", 1), torch.device("cpu")
    assert seen == [(cuda1, [cuda1]), (cpu, [])] and entered == []


def test_a_cuda_device_means_a_usable_one_and_cuda_is_the_current_device(monkeypatch, cuda):
    t = torch.zeros(4, 8)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    with FeatureStore(
        t, device="cuda"
    ) as s:  # DGL's DataLoader normalises 'cuda' the same way; fetch compares them
        assert s.device == torch.device("cuda", 1)
    assert cuda.registered_on == [torch.device("cuda", 1)]  # from the device whose kernels read it
    with pytest.raises(RuntimeError, match=r"device='cuda:2': there are 2 CUDA device\(s\) here"):
        FeatureStore(t, device="cuda:2")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for dev in ("cuda", "cuda:0", torch.device("cuda", 0)):
        # used to build, and fail at the first gather with a raw driver error
        with pytest.raises(
            RuntimeError, match=r"device='cuda(:0)?': CUDA is not available here; use device='cpu'"
        ):
            FeatureStore(t, device=dev)


def test_pin_false_never_reads_zero_copy_even_a_pinned_table(monkeypatch):
    import flowlane.direct.store as S

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda t: True)  # pinned by the caller (g.pin_memory_())
    monkeypatch.setattr(S, "triton_status", lambda: (True, "Triton (simulated)"))
    t = torch.zeros(4, 8)
    assert FeatureStore(t, device="cuda").path == "zero-copy"
    store = FeatureStore(t, DirectConfig(pin=False), device="cuda")
    assert store.path == "cpu-gather" and store.choice.reason.startswith("direct.pin=false")
    with pytest.raises(RuntimeError, match="cannot run here: direct.pin=false"):
        FeatureStore(t, DirectConfig(path="zero-copy", pin=False), device="cuda")


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
