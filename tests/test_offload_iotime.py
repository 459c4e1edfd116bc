"""The link rates the adaptive budget is planned from are bytes over I/O time: the union of the I/O calls' busy
intervals, not the span from the first store to the last (thesis §5.3.5; digest §2.2.8: B_w = bytes written in
forward / forward I/O time). Deterministic: the cache's clock is a counter that only the fake disk and the model's
compute advance, and the I/O pools run their jobs inline."""

from __future__ import annotations

from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn

import flowlane.offload.cache as cache_mod
from flowlane.offload import OffloadConfig, PosixBackend, TensorCache
from flowlane.offload.record import busy_rate

WRITE_BPS, READ_BPS = 2.0e9, 4.0e9
FWD_S, BWD_S = 1.0, 2.0  # compute per layer: idle time of the disk between its calls
N = 1024  # 1024 x 1024 fp32 activations: 4 MiB per saved tensor


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class _Tick(torch.autograd.Function):
    """A layer's compute: advances the fake clock (forward and backward), saves nothing."""

    clock: _Clock

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        _Tick.clock.now += FWD_S
        return x.clone()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        _Tick.clock.now += BWD_S
        return g


class TickBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(N, N)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.lin(_Tick.apply(x)))


class _TimedDisk(PosixBackend):
    """posix with known call durations: each write/read advances the clock by its bytes at the disk's rate."""

    clock: _Clock

    def write(self, key: str, data: torch.Tensor) -> Any:
        h = super().write(key, data)
        self.clock.now += data.numel() / WRITE_BPS
        return h

    def read(self, handle: Any, nbytes: int, device: torch.device) -> torch.Tensor:
        out = super().read(handle, nbytes, device)
        self.clock.now += nbytes / READ_BPS
        return out

    def write_block(self, key: str, buf: torch.Tensor, nbytes: int) -> Any:
        h = super().write_block(key, buf, nbytes)
        self.clock.now += nbytes / WRITE_BPS
        return h

    def read_block(self, handle: Any, buf: torch.Tensor, nbytes: int) -> None:
        super().read_block(handle, buf, nbytes)
        self.clock.now += nbytes / READ_BPS


class _Inline:
    """An executor that runs each job at submit: the clock then sees one call at a time, in a fixed order."""

    def submit(self, fn: Any, *args: Any, **kw: Any) -> Future:
        fut: Future = Future()
        try:
            fut.set_result(fn(*args, **kw))
        except BaseException as e:  # noqa: BLE001 - handed to the future, as a pool would
            fut.set_exception(e)
        return fut

    def shutdown(self, wait: bool = True) -> None:
        pass


def test_busy_rate_counts_idle_gaps_out_and_overlapping_calls_once() -> None:
    # two workers overlap on [1, 2]; a 7 s idle gap follows: busy 3 + 1 = 4 s for 300 bytes
    assert busy_rate([(0.0, 2.0, 100), (1.0, 3.0, 100), (10.0, 11.0, 100)]) == pytest.approx(75.0)
    assert busy_rate([(5.0, 6.0, 10), (0.0, 9.0, 10)]) == pytest.approx(20 / 9)  # one call inside another
    assert busy_rate([]) == 0.0 and busy_rate([(1.0, 1.0, 10)]) == 0.0


@pytest.mark.parametrize("bulk", [False, True], ids=["per_storage", "layer_blocks"])
def test_profiled_rates_are_the_disk_rates_not_bytes_over_the_forward(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, bulk: bool
) -> None:
    """4 layers, 1 s of compute each between the disk's calls: the profile reads 2 GB/s written and 4 GB/s read,
    the fake disk's rates (the span from the first store to the last measured ~bytes / forward time: 8 MiB/s)."""
    clock = _Clock()
    monkeypatch.setattr(cache_mod, "_clock", clock)
    _Tick.clock = clock
    torch.manual_seed(0)
    model = nn.Sequential(*[TickBlock() for _ in range(4)])
    cfg = OffloadConfig(
        dirs=(str(tmp_path),),
        min_bytes=1 << 20,
        offload_cpu_tensors=True,
        adaptive=True,
        profile_step=0,
        o_direct="off",
    )
    disk = _TimedDisk((str(tmp_path),), o_direct="off")
    disk.clock = clock
    cache = TensorCache(cfg, backend=disk, bulk_on_cpu=bulk)
    for pool in (cache._store_pool, cache._load_pool):
        pool.shutdown(wait=True)
    cache._store_pool = cache._load_pool = _Inline()  # type: ignore[assignment]
    cache.register_parameters(model.parameters())
    for blk in model:
        cache.add_scope(blk)
    with cache.activate():
        model(torch.randn(N, N)).sum().backward()
        s = cache.stats_snapshot()
    prof = s.profile
    assert prof is not None and "error" not in prof and prof["timer"] == "clock"
    assert s.bytes_written > 0 and s.bytes_read > 0
    assert prof["write_bandwidth_Bps"] == pytest.approx(WRITE_BPS, rel=1e-6)
    assert prof["read_bandwidth_Bps"] == pytest.approx(READ_BPS, rel=1e-6)
