"""Adaptive offloading: choose the last module to offload from one profiled micro-batch (thesis §5.3.5, Fig. 5.9).

The thesis profiles, per block, the bytes to transfer and the compute time, and for the whole forward pass the
compute time, I/O time and total bytes. With m the last module offloaded, the bandwidth needed is whatever finishes
(a) offloading every module before m and (b) offloading *and* reloading m by the time m's backward begins, with
backward estimated as 2x forward. It must not exceed the write bandwidth measured in the profiled forward. The thesis
prints no formula; this is the digest's formalisation (research/003 §2.2.8):

    B_req(m) = (sum_{i<=m} s_i + s_m) / (T_F + 2 * sum_{j>m} f_j)   <=   B_w

Choose the largest such m; modules after m are kept. B_req grows with m, so a scan from the end suffices.

The tensor cache no longer uses this selector: one bandwidth against one window ignores that copies queue on FIFO
streams and that reloads are issued a layer ahead, and on a GPU the host clock it was fed measured kernel enqueue.
``budget.py`` replays the step instead; this module keeps the thesis' formula for reference and its tests.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class ProfileResult:
    """Per-group (transformer layer) bytes ``sizes`` and forward times ``fwd_times`` plus measured write bandwidth."""

    sizes: tuple[int, ...]
    fwd_times: tuple[float, ...]
    write_bandwidth: float  # bytes/s measured while storing during the profiled forward
    last_offloaded: int  # m; -1 = offload nothing
    keep_last_k: int


def required_bandwidth(sizes: Sequence[int], fwd_times: Sequence[float], m: int) -> float:
    """B_req(m) in bytes/s (digest §2.2.8)."""
    if not 0 <= m < len(sizes):
        raise ValueError(f"m={m} out of range for {len(sizes)} modules")
    t_f = sum(fwd_times)
    window = t_f + 2.0 * sum(fwd_times[m + 1 :])
    if window <= 0:
        return float("inf")
    return (sum(sizes[: m + 1]) + sizes[m]) / window


def choose_last_offloaded(sizes: Sequence[int], fwd_times: Sequence[float], write_bandwidth: float) -> int:
    """Largest m with B_req(m) <= write_bandwidth; -1 when even the first module cannot be hidden."""
    if len(sizes) != len(fwd_times):
        raise ValueError(f"sizes ({len(sizes)}) and fwd_times ({len(fwd_times)}) differ in length")
    if write_bandwidth < 0:
        raise ValueError(f"write_bandwidth={write_bandwidth} must be >= 0")
    for m in range(len(sizes) - 1, -1, -1):
        if required_bandwidth(sizes, fwd_times, m) <= write_bandwidth:
            return m
    return -1


def keep_last_k_from_profile(
    sizes: Sequence[int], fwd_times: Sequence[float], write_bandwidth: float, min_keep: int = 1
) -> ProfileResult:
    """keep_last_k = modules after the chosen m (at least ``min_keep``: the last module's backward follows its forward
    immediately, so offloading it only delays frees; thesis §5.3.4)."""
    m = choose_last_offloaded(sizes, fwd_times, write_bandwidth)
    n = len(sizes)
    k = max(min(min_keep, n), n - 1 - m)
    return ProfileResult(tuple(sizes), tuple(fwd_times), write_bandwidth, n - 1 - k, k)
