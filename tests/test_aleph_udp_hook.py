"""ALEPH tier 1 behind the DDP comm hook: sums through the C UDP aggregator equal all_reduce (integers exactly, under
injected loss too), and DDP with the UDP hook tracks DDP's own all-reduce within the fixed-point bound."""

import pytest

from flowlane.launch import launch
from tests import aleph_udp_workers

pytestmark = pytest.mark.once


def test_udp_tier_behind_the_hook_sums_exactly_under_loss_on_4_ranks():
    # Table 1's plan (an aggregator with two members, a worker straight to the PS); 1 % of received datagrams
    # dropped in every process (NACK/RETX repair them); processes start per call, so few calls
    res = launch(aleph_udp_workers.udp_cases, 4, args=([[3, 1, 2], [0]], 0.01), timeout=400)
    for rank, r in enumerate(res):
        assert r["int_equal"] == [True, True], (rank, r)
        # fixed point with log2(n) headroom: |error| <= n * 2^-(k+1) with k ~ 26 for |x| <= ~10 and n <= 4
        assert r["float_maxdiff"] < 1e-5, (rank, r["float_maxdiff"])
        assert r["ddp_maxdiff"] < 1e-5 and r["ddp_moved"] > 1e-3, (rank, r)


def test_udp_dataplane_option_is_checked():
    from flowlane.aleph.hook import install_aleph_hook

    with pytest.raises(ValueError, match="dataplane='nccl' is not one of"):
        install_aleph_hook(None, None, dataplane="nccl")  # type: ignore[arg-type]


def test_udp_tier_returns_nan_everywhere_and_raises_everywhere_on_what_it_cannot_sum():
    """A NaN/inf on one rank reaches every rank as NaN (DDP's own all-reduce propagates it, so AMP's GradScaler skips
    the step; fixed point would have made it finite garbage), and an overflow or integers too big on one rank raise
    on every rank (a check on one rank alone left the other waiting in a collective)."""
    res = launch(aleph_udp_workers.udp_guard_cases, 2, timeout=90, op_timeout=60)
    for rank, r in enumerate(res):
        assert r["nan"] is False and r["inf"] is False, (rank, r)
        # DDP's own run: rank 1's NaN input gives non-finite gradients on both ranks (a GradScaler skips the step);
        # the UDP hook agrees
        assert r["ddp_finite_own"] is False and r["ddp_finite_udp"] is False, (rank, r)
        assert "int32 overflow" in r["overflow"] and r["overflow_untouched"], (rank, r)
        assert "integer values up to 1073741824 (the group's max-abs) do not fit int32" in r["int_range"], (
            rank,
            r,
        )
        assert r["after"] == 3.0, (rank, r)


def test_encode_refuses_non_finite_values():
    import numpy as np

    from flowlane.aleph import wire as W

    with pytest.raises(ValueError, match=r"2 non-finite value\(s\) \(first nan\)"):
        W.encode(np.array([np.nan, 1.0, np.inf]), 3)
    assert W.encode(np.array([0.5, -1.0]), 3).tolist() == [4, -8]
