"""The CUDA tiers' bulk path of the tensor cache, run on CPU tensors (``bulk_on_cpu``; copies are synchronous there):
one host block per layer from a persistent pool, reloads one layer ahead, the SSD tier writing whole blocks with
O_DIRECT straight from the pool, the byte budget from a profiled micro-batch. Gradients are compared bitwise with
the same model run without offloading."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from flowlane.offload import OffloadConfig, PosixBackend, TensorCache, install, make_backend
from flowlane.offload.pool import ALIGN, PinnedPool, size_class
from tests.test_offload_core import MIN_BYTES, A, B, Block, H, S, _grads, _model, _reference

L = 6


def _bulk(m: nn.Module, cfg: OffloadConfig, backend=None) -> TensorCache:
    cache = TensorCache(cfg, backend=backend, bulk_on_cpu=True)
    cache.register_parameters(m.parameters())
    for blk in m.blocks:
        cache.add_scope(blk)
    return cache.activate()


def _cfg(tmp_path: Path, **kw) -> OffloadConfig:
    base = dict(dirs=(str(tmp_path),), min_bytes=MIN_BYTES, offload_cpu_tensors=True)
    base.update(kw)
    return OffloadConfig(**base)


class _Spy(PosixBackend):
    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.blocks: list[int] = []
        self.small_writes = 0

    def write_block(self, key, buf, nbytes):
        self.blocks.append(nbytes)
        return super().write_block(key, buf, nbytes)

    def write(self, key, data):
        self.small_writes += 1
        return super().write(key, data)


def test_pinned_tier_one_block_per_layer_from_a_persistent_pool_bitwise(tmp_path: Path) -> None:
    m, idx = _model(L)
    ref = _reference(m, idx)
    with _bulk(m, _cfg(tmp_path, backend="pinned_cpu", keep_last_k=1)) as cache:
        pools = []
        for _ in range(3):
            before = cache.stats_snapshot()
            m.zero_grad()
            m(idx).backward()
            s = cache.stats_snapshot()
            assert all(torch.equal(a, b) for a, b in zip(ref, _grads(m), strict=True))
            assert s.bytes_written - before.bytes_written == (L - 1) * A
            assert s.bytes_read - before.bytes_read == (L - 1) * A
            assert s.bulk_stores - before.bulk_stores == L - 1  # one bulk copy per offloaded layer
            assert s.sync_loads == 0 and s.late_loads == 0  # every reload was issued a layer ahead
            assert s.unused_loads == 0
            pools.append(s.pool)
    # first step: layer count unknown, kept layers stored late; from the second step on no new host memory
    assert (
        pools[2]["misses"] == pools[1]["misses"]
        and pools[2]["allocated_bytes"] == pools[1]["allocated_bytes"]
    )
    assert pools[2]["hits"] > pools[1]["hits"]
    assert pools[2]["in_use_bytes"] == 0


def test_ssd_tier_writes_whole_layer_blocks_straight_from_the_pool(tmp_path: Path) -> None:
    m, idx = _model(L)
    ref = _reference(m, idx)
    spy = _Spy((str(tmp_path),))
    with _bulk(m, _cfg(tmp_path, keep_last_k=1), backend=spy) as cache:
        m(idx).backward()  # learn the layer count
        spy.blocks.clear()
        before = cache.stats_snapshot()
        m.zero_grad()
        loss = m(idx)
        cache.wait_io()  # every block on disk before backward: reloads read the files back
        loss.backward()
        cache.wait_io()
        s = cache.stats_snapshot()
        desc = spy.describe()
    assert all(torch.equal(a, b) for a, b in zip(ref, _grads(m), strict=True))
    assert spy.small_writes == 0  # no per-tensor writes and no bounce buffer
    assert len(spy.blocks) == L - 1 and all(b % ALIGN == 0 for b in spy.blocks)
    assert s.bytes_written - before.bytes_written == (L - 1) * A
    assert s.bytes_read - before.bytes_read == (L - 1) * A
    if desc["o_direct"][0]:  # tmpfs on older kernels refuses O_DIRECT: then every write says so
        assert desc["block_writes_o_direct"] >= L - 1 and desc["block_writes_o_direct_refused"] == 0
    assert not [p for p in tmp_path.rglob("*.bin")]  # files removed with the run directory


def test_a_failed_block_write_keeps_the_host_copy_and_exact_gradients(tmp_path: Path) -> None:
    class Full(PosixBackend):
        def write_block(self, key, buf, nbytes):
            raise OSError(errno.ENOSPC, "No space left on device")

    m, idx = _model(L)
    ref = _reference(m, idx)
    with (
        pytest.warns(RuntimeWarning, match="keeping activations in memory"),
        _bulk(m, _cfg(tmp_path, keep_last_k=0), backend=Full((str(tmp_path),))) as cache,
    ):
        loss = m(idx)
        cache.wait_io()
        loss.backward()
        s = cache.stats_snapshot()
    assert s.io_errors == L and s.fallbacks == L and s.bytes_written == 0
    assert all(torch.equal(a, b) for a, b in zip(ref, _grads(m), strict=True))


def test_exhausted_pool_keeps_layers_on_the_device(tmp_path: Path) -> None:
    m, idx = _model(L)
    ref = _reference(m, idx)
    cfg = _cfg(tmp_path, backend="pinned_cpu", keep_last_k=0, pinned_pool_bytes=2 * size_class(A))
    with pytest.warns(RuntimeWarning), _bulk(m, cfg) as cache:
        m(idx).backward()
        s = cache.stats_snapshot()
    assert s.fallbacks > 0 and 0 < s.bytes_written <= 2 * A
    assert all(torch.equal(a, b) for a, b in zip(ref, _grads(m), strict=True))


@pytest.mark.parametrize(("link", "offloaded_layers"), [(1e-6, 0), (1e6, L - 1)])
def test_adaptive_budget_from_the_profiled_step(tmp_path: Path, link: float, offloaded_layers: int) -> None:
    """A link of 1 kB/s hides nothing; 1 PB/s hides all but the last layer (its reload starts its backward)."""
    m, idx = _model(L)
    ref = _reference(m, idx)
    cfg = _cfg(tmp_path, backend="pinned_cpu", adaptive=True, profile_step=0, link_GBps=link)
    with _bulk(m, cfg) as cache:
        for _ in range(2):
            before = cache.stats_snapshot()
            m.zero_grad()
            m(idx).backward()
            assert all(torch.equal(a, b) for a, b in zip(ref, _grads(m), strict=True))
        s = cache.stats_snapshot()
    prof = s.profile
    assert prof is not None and prof["timer"] == "clock" and prof["sizes"] == [A] * L
    assert len(prof["fwd_times_s"]) == L and all(t > 0 for t in prof["bwd_times_s"])
    assert prof["allow_bytes"] == [A] * offloaded_layers + [0] * (L - offloaded_layers)
    assert prof["keep_last_k"] == L - offloaded_layers == s.keep_last_k
    assert s.bytes_written - before.bytes_written == offloaded_layers * A  # the step after profiling
    assert s.budget_kept - before.budget_kept > 0


def test_pool_is_sized_before_the_profiled_step_so_no_pinning_is_timed(tmp_path: Path, monkeypatch) -> None:
    """Pinning host memory inside the profiled step stalled the host for 0.48 s on an H200, which was timed as
    compute and gave a budget that cost 1.20x: the pool is now filled when the profiled record starts."""
    m, idx = _model(L)
    cache = _bulk(m, _cfg(tmp_path, backend="pinned_cpu", adaptive=True, profile_step=1, link_GBps=1e6))
    timed: list[int] = []
    orig = PinnedPool._new

    def spy(pool, cap):
        rec = cache._current
        if rec is not None and rec.profiling and rec.groups:  # a layer of the profiled step already began
            timed.append(cap)
        return orig(pool, cap)

    monkeypatch.setattr(PinnedPool, "_new", spy)
    with cache:
        # step 0: the last layer kept (stored late), so one block fewer than the profile needs
        m(idx).backward()
        misses0 = cache.stats_snapshot().pool["misses"]
        m(idx).backward()  # step 1: profiled, every layer offloaded
        s = cache.stats_snapshot()
    assert s.profile["timer"] == "clock" and s.pool["misses"] > misses0  # the extra block was allocated ...
    assert timed == []  # ... before the profiled step's first layer


def test_adaptive_picks_the_shallowest_prefetch_that_hides_the_most(tmp_path: Path) -> None:
    m, idx = _model(L)
    ref = _reference(m, idx)
    cfg = _cfg(
        tmp_path, backend="pinned_cpu", adaptive=True, profile_step=0, link_GBps=1e6, prefetch_groups=3
    )
    with _bulk(m, cfg) as cache:
        for _ in range(2):
            m.zero_grad()
            m(idx).backward()
            assert all(torch.equal(a, b) for a, b in zip(ref, _grads(m), strict=True))
        s = cache.stats_snapshot()
    assert s.profile["prefetch_groups"] == 1 == cache._prefetch  # an infinitely fast link needs no depth
    assert s.sync_loads == 0


def test_max_slowdown_lets_the_budget_offload_more(tmp_path: Path) -> None:
    """With 50 % of the step allowed as waiting, the cache's budget is at least the fully hidden one of the same
    profile, and its modelled wait stays within the allowance."""
    from flowlane.offload.budget import StepProfile, choose_budget

    m, idx = _model(L)
    ref = _reference(m, idx)
    cfg = _cfg(
        tmp_path, backend="pinned_cpu", adaptive=True, profile_step=0, link_GBps=2e-3, max_slowdown=0.5
    )
    with _bulk(m, cfg) as cache:
        for _ in range(2):
            m.zero_grad()
            m(idx).backward()
            assert all(torch.equal(a, b) for a, b in zip(ref, _grads(m), strict=True))
        prof = cache.stats_snapshot().profile
    p = StepProfile.from_stats(prof)
    hidden = choose_budget(p, prefetch=prof["prefetch_groups"])
    assert prof["total_bytes"] >= hidden.total_bytes
    assert prof["exposed_s"] <= 0.5 * prof["step_s"] + 1e-9


def test_adaptive_budget_on_measured_rates_keeps_gradients(tmp_path: Path) -> None:
    m, idx = _model(L)
    ref = _reference(m, idx)
    with _bulk(m, _cfg(tmp_path, adaptive=True, profile_step=0)) as cache:
        for _ in range(2):
            m.zero_grad()
            m(idx).backward()
            assert all(torch.equal(a, b) for a, b in zip(ref, _grads(m), strict=True))
        prof = cache.stats_snapshot().profile
    assert prof["write_bandwidth_Bps"] > 0 and prof["read_bandwidth_Bps"] > 0
    assert prof["exposed_s"] == 0.0 and prof["keep_last_k"] >= 1


def test_pool_size_classes_reuse_and_capacity() -> None:
    assert size_class(1) == ALIGN and size_class(ALIGN + 1) == 2 * ALIGN
    assert size_class((1 << 20) + 1) == 2 << 20
    with pytest.raises(ValueError, match="size must be > 0"):
        size_class(0)
    pool = PinnedPool(capacity=3 * ALIGN, pin=False)
    a = pool.acquire(100)
    assert a.buf.data_ptr() % ALIGN == 0 and a.capacity == ALIGN
    b = pool.acquire(2 * ALIGN)
    with pytest.raises(OSError, match="host pool full"):
        pool.acquire(1)
    pool.release(a)
    assert pool.acquire(10) is a  # same size class: reused, no new memory
    pool.release(b)
    pool.release(a)
    c = pool.acquire(3 * ALIGN)  # frees the idle blocks of other sizes to make room
    assert c.capacity == 3 * ALIGN and pool.stats()["allocated_bytes"] == 3 * ALIGN


def test_tensor_subclasses_are_refused_with_the_reason(tmp_path: Path) -> None:
    class Sub(torch.Tensor):
        pass

    lin = nn.Linear(64, 64)
    lin.weight = nn.Parameter(lin.weight.detach().as_subclass(Sub))
    with pytest.raises(
        TypeError, match=r"a parameter is a tensor subclass \(.*Sub\) without __tensor_flatten__"
    ):
        install(lin, _cfg(tmp_path), ["Linear"])

    class Scale(nn.Module):
        def forward(self, x):
            return x * x

    mod = Scale()
    with install(mod, _cfg(tmp_path, keep_last_k=0), ["Scale"]):
        x = torch.randn(64, 64, requires_grad=True).as_subclass(Sub)
        with pytest.raises(RuntimeError, match=r"saved activation \(64, 64\) is a tensor subclass"):
            mod(x)


def test_kvikio_and_null_keep_the_thread_path(tmp_path: Path) -> None:
    cache = TensorCache(_cfg(tmp_path, backend="null"), bulk_on_cpu=True)
    assert not cache._is_bulk(torch.device("cpu"))
    cache.close()
    be = make_backend(_cfg(tmp_path, backend="pinned_cpu"))
    cache = TensorCache(_cfg(tmp_path, backend="pinned_cpu"), backend=be)
    assert not cache._is_bulk(torch.device("cpu")) and cache._is_bulk(torch.device("cuda"))
    cache.close()


def test_recompute_runs_the_chosen_layers_under_checkpoint_with_exact_gradients(tmp_path: Path) -> None:
    """A link that hides nothing and 99 % of the step to spend: the budget recomputes kept layers front to back
    (never the last); those layers then save only their input, and gradients stay bitwise the plain model's."""
    from flowlane.offload.budget import StepProfile, choose_recompute

    m, idx = _model(L)
    ref = _reference(m, idx)
    cfg = _cfg(
        tmp_path,
        backend="pinned_cpu",
        adaptive=True,
        profile_step=0,
        link_GBps=1e-6,
        max_slowdown=0.99,
        recompute=True,
    )
    with _bulk(m, cfg) as cache:
        saved = []  # bytes each layer saved through the cache, per step
        for _ in range(3):
            m.zero_grad()
            loss = m(idx)
            (rec,) = cache._records.values()
            saved.append(list(rec.group_bytes))
            loss.backward()
            assert all(torch.equal(a, b) for a, b in zip(ref, _grads(m), strict=True))
        s = cache.stats_snapshot()
    # close() gave the layers their own forward back
    assert all("forward" not in vars(blk) for blk in m.blocks)
    prof = s.profile
    p = StepProfile.from_stats(prof)
    want = choose_recompute(p, prof["allow_bytes"], prof["prefetch_groups"], 0.99 * p.step_s)
    assert prof["allow_bytes"] == [0] * L and prof["recompute"] == list(want)
    r = sum(want)
    assert 1 <= r <= L - 1 and want[-1] is False  # layer 0's forward is far below 99 % of the step
    assert s.recomputed_layers == 2 * r  # the two steps after the profiled one
    assert saved[0] == [A] * L  # the profiled step
    # a recomputed layer saves only its input (checkpoint's, one residual stream: A / 16), which the cache may offload
    assert saved[1] == saved[2] == [A // 16] * r + [A] * (L - r)


def test_recompute_is_refused_without_a_budget_to_pay_for_it(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"offload.recompute=True needs adaptive=true and max_slowdown > 0"):
        _cfg(tmp_path, adaptive=True, recompute=True)
    with pytest.raises(ValueError, match=r"offload.recompute='yes' must be true or false"):
        _cfg(tmp_path, recompute="yes")


def test_the_first_layer_fed_the_batch_itself_has_its_backward_timed(tmp_path: Path) -> None:
    """A layer whose input needs no gradient gets no end-of-backward hook; its backward time comes from the end of
    the engine's backward (it was 0 s in the H200 profiles, whose model takes the batch as its input)."""
    m, _ = _model(L)
    x = torch.randn(B, S, H)  # the batch itself: requires no gradient
    cfg = _cfg(tmp_path, backend="pinned_cpu", adaptive=True, profile_step=0, link_GBps=1e6)
    with _bulk(m, cfg) as cache:
        for _ in range(2):
            y = x
            for blk in m.blocks:
                y = blk(y)
            y.pow(2).mean().backward()
        prof = cache.stats_snapshot().profile
    assert prof["timer"] == "clock" and len(prof["bwd_times_s"]) == L
    assert all(t > 0 for t in prof["bwd_times_s"])


class _CountingTracker:
    """A model-parallel RNG tracker stand-in: every forward draws (and advances) its state."""

    def __init__(self) -> None:
        self.state = 1.0

    def get_states(self) -> dict:
        return {"s": self.state}

    def set_states(self, states: dict) -> None:
        self.state = states["s"]


@pytest.mark.parametrize("restore", [True, False])
def test_recompute_with_an_rng_tracker_replays_the_first_runs_draws(restore: bool) -> None:
    """The second run of a recomputed layer must see the tracker as the first run did (Megatron's and DeepSpeed's
    own checkpointing restore it); the tracker's own state moves on as if there were one run."""
    from flowlane.offload.cache import recompute_forward, recompute_with_rng_tracker

    tracker = _CountingTracker()

    def layer(x: torch.Tensor) -> torch.Tensor:
        draw = tracker.state
        tracker.state += 1.0
        return (x * draw).sin()  # sin: backward needs the saved input times the draw

    x = torch.linspace(0, 1, 8, requires_grad=True)
    expected = torch.autograd.grad(layer(x).sum(), x)[0]
    tracker.state = 1.0
    run = recompute_with_rng_tracker(lambda: tracker) if restore else recompute_forward
    got = torch.autograd.grad(run(layer, x).sum(), x)[0]
    assert torch.equal(got, expected) is restore
    assert tracker.state == (2.0 if restore else 3.0)


class _ProbedBlock(Block):
    """A block that also computes a probe no loss depends on: ``exp`` saves its output, whose autograd node never
    runs, so the layer's reload brings back a storage nobody unpacks."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        torch.exp(x * 0.5)  # dropped at once; the cache holds the saved output until the layer's bulk store
        return super().forward(x)


def test_a_reload_nobody_unpacks_is_counted_and_released_after_its_copy(tmp_path: Path, monkeypatch) -> None:
    """On a GPU such a reload's memory returns to the compute stream's pool while its copy may still be queued, so
    the release makes that stream wait for the copy's event first (``TensorCache._release``). CPU copies have no
    events: each reload here gets a stand-in, and the stand-in stream records what it was made to wait for."""
    waited: list[object] = []
    issued: list[object] = []

    class _Stream:
        def wait_event(self, ev: object) -> None:
            waited.append(ev)

    h2d = TensorCache._h2d

    def h2d_with_events(self, rec, slab, members, compute=None) -> None:
        h2d(self, rec, slab, members, compute)
        for mem in members:
            if mem.state == "loaded" and mem.event is None:
                mem.event = object()
                issued.append(mem.event)

    monkeypatch.setattr(TensorCache, "_h2d", h2d_with_events)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: _Stream())
    m, idx = _model(L)
    for i, blk in enumerate(m.blocks):
        probed = _ProbedBlock()
        probed.load_state_dict(blk.state_dict())
        m.blocks[i] = probed
    ref = _reference(m, idx)
    with _bulk(m, _cfg(tmp_path, backend="pinned_cpu", keep_last_k=1)) as cache:
        for _ in range(2):
            before = cache.stats_snapshot()
            m.zero_grad()
            m(idx).backward()
            s = cache.stats_snapshot()
            assert all(torch.equal(a, b) for a, b in zip(ref, _grads(m), strict=True))
            assert s.unused_loads - before.unused_loads == L - 1  # one probe per offloaded layer
            assert s.sync_loads == 0
    assert len(waited) == 2 * (L - 1) and set(map(id, waited)) <= set(map(id, issued))


def test_stream_order_release_drops_each_layer_where_its_copy_has_ended(tmp_path: Path) -> None:
    """``release="stream_order"``: a stored layer's tensors are held until the hook point where the timeline says
    its copy has ended, then dropped (on a GPU after the compute stream waited for the copy's event). A link of 1 PB/s
    ends each store within the next layer's forward, so layer i goes at layer i + 2's forward start and the last one
    stored at the first backward begin (points on a slow link: ``test_offload_budget``). Gradients stay bitwise."""
    m, idx = _model(L)
    ref = _reference(m, idx)
    cfg = _cfg(
        tmp_path, backend="pinned_cpu", adaptive=True, profile_step=0, link_GBps=1e6, release="stream_order"
    )
    with _bulk(m, cfg) as cache:
        seen: list[int] = []
        for blk in m.blocks:  # after the cache's own pre-hook: what it has released when each forward starts
            blk.register_forward_pre_hook(lambda mod, args: seen.append(cache.stats.ordered_releases))
        for _ in range(2):
            seen.clear()
            before = cache.stats_snapshot()
            m.zero_grad()
            m(idx).backward()
            assert all(torch.equal(a, b) for a, b in zip(ref, _grads(m), strict=True))
        s = cache.stats_snapshot()
    points = [tuple(p) if p else None for p in s.profile["release_at"]]
    assert points == [("forward", i + 2) for i in range(L - 2)] + [("backward", L - 1), None]
    assert [x - before.ordered_releases for x in seen] == [0, 0, *range(1, L - 1)]
    assert s.ordered_releases - before.ordered_releases == L - 1 and s.ordered_release_misses == 0
    assert s.bytes_written - before.bytes_written == (L - 1) * A


def test_stream_order_release_needs_the_budget(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"offload.release='stream_order' needs adaptive=true"):
        _cfg(tmp_path, release="stream_order")
    with pytest.raises(
        ValueError, match=r"offload.release='eventually' must be 'record_stream' or 'stream_order'"
    ):
        _cfg(tmp_path, adaptive=True, release="eventually")
    with pytest.raises(ValueError, match=r"applies to the bulk tiers \(pinned_cpu, posix\), not to the null"):
        TensorCache(_cfg(tmp_path, backend="null", adaptive=True, release="stream_order"))
