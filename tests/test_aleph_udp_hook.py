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
