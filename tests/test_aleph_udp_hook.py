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
    on every rank (a check on one rank alone left the other waiting in a collective: a short op_timeout makes that
    wait a failure), as do floats too big for int32 at the clamped exponent 2^-100 on one rank."""
    res = launch(aleph_udp_workers.udp_guard_cases, 2, timeout=90, op_timeout=15)
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
        assert (
            "floating values up to 1.393796574908164e+42 (the group's max-abs) do not fit int32"
            in r["float_range"]
        ), (rank, r)
        assert r["after"] == 3.0, (rank, r)


def test_encode_refuses_non_finite_values():
    import numpy as np

    from flowlane.aleph import wire as W

    with pytest.raises(ValueError, match=r"2 non-finite value\(s\) \(first nan\)"):
        W.encode(np.array([np.nan, 1.0, np.inf]), 3)
    assert W.encode(np.array([0.5, -1.0]), 3).tolist() == [4, -8]


def test_udp_tier_all_reduces_its_figures_on_the_groups_collective_device(monkeypatch):
    """The max-abs/NaN flag and the overflow count are all-reduced on the group: a pure-NCCL group refuses CPU
    tensors, so they live on the tensor's device, or CUDA for a CPU tensor on NCCL. No GPU here: the device choice
    and the first all-reduce's tensor are checked with torch.distributed stubbed (the overflow count uses the same
    ``device`` after the processes ran; not reached without them)."""
    import torch

    from flowlane.aleph import udp_allreduce as U
    from flowlane.aleph.cluster import Plan

    monkeypatch.setattr(U.torch.cuda, "current_device", lambda: 0)
    for backend, want in (("nccl", torch.device("cuda", 0)), ("gloo", torch.device("cpu"))):
        monkeypatch.setattr(U.dist, "get_backend", lambda group=None, b=backend: b)
        assert U._collective_device(None, torch.ones(2)) == want
    assert U._collective_device(None, torch.ones(2, device="meta")) == torch.device("meta")

    class Stop(Exception):
        pass

    seen = []

    def all_reduce(t, op=None, group=None):
        seen.append(t.device)
        raise Stop

    monkeypatch.setattr(U.dist, "all_reduce", all_reduce)
    monkeypatch.setattr(U, "_collective_device", lambda group, tensor: torch.device("meta"))
    u = object.__new__(
        U.UdpAllReduce
    )  # no process group here: only what __call__ reads before its first collective
    u.ranks, u.me, u.group, u.plan = [0, 1], 0, None, Plan.from_clusters(2, [[0, 1]])
    with pytest.raises(Stop):
        u(torch.ones(3))
    assert seen == [torch.device("meta")]
