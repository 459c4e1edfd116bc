"""ALEPH tier 0 with q >= 1 PSs (seed 002 Sec. 7, digest §2.9): every aggregator sends PS j the fraction split[j] of
its partial sums; sums equal all_reduce (ints exactly), in the tree's fixed order of additions (bitwise); the
reduce-scatter's blocks, sent down the same tree, equal all_reduce's (ints exactly)."""

import pytest

from flowlane.aleph import Plan
from flowlane.aleph.hook import _CONNECT_TAG, _check_multi_ps
from flowlane.launch import launch
from tests import aleph_multips_workers

pytestmark = pytest.mark.once  # torch-only core code, like tests/test_aleph_hook.py

# 5 ranks: heads 0, 1, 2 (with member 3) and 4
CLUSTERS_5 = [[0], [1], [2, 3], [4]]
CASES_5 = [
    {},  # one PS (the first head): the single tree
    {"ps": (0, 1), "split": (0.6, 0.4)},  # uneven split
    {"ps": (0, 1, 4), "ps_bandwidths": (300.0, 150.0, 100.0)},  # proportional: 6/11, 3/11, 2/11
    {"ps": (2, 1), "split": "equal"},  # a PS with a member of its own
    {"ps": (0, 4), "split": (1.0, 0.0)},  # an empty part
    {"ps": (0, 1), "split": (0.7, 0.3), "dedicated_ps": True},  # PS ranks outside the sum
]


def _check_p2p_order(logs: list[list]) -> None:
    """What a backend that runs a pair's messages in order on one stream per pair and group (NCCL, which ignores
    tags) needs of the tree: on each group, messages between two ranks go one way only (a receive posted before a send
    the other side waits for would block that stream), and a pair's sends are issued in the order its receives were
    posted. The H200 run of the Megatron check hung with the first broken (a member's result receive before its
    partial's send, both on the default group), which is the likely cause. The connection greeting before the first
    all-reduce is the exception: each pair's one send and one receive come first on the group, in paired order."""
    greet: dict = {}
    # the connection greeting (HierarchicalAllReduce._connect) is checked apart
    for rank, log in enumerate(logs):
        seen: set = set()
        for op, group, peer, tag in log:
            if tag == _CONNECT_TAG:
                assert (group, peer) not in seen, (
                    f"rank {rank}: greeting of {peer} after tree traffic with it"
                )
                greet.setdefault((group, rank, peer), []).append(op)
            else:
                seen.add((group, peer))
    for (group, a, b), ops in greet.items():  # one send and one receive each way, paired in order
        assert sorted(ops) == ["recv", "send"], (group, a, b, ops)
        assert greet.get((group, b, a)) == ops[::-1], (group, a, b, ops, greet.get((group, b, a)))
    logs = [[e for e in log if e[3] != _CONNECT_TAG] for log in logs]
    sends: dict = {}
    recvs: dict = {}
    for rank, log in enumerate(logs):
        ways: dict = {}
        for op, group, peer, tag in log:
            ways.setdefault((group, peer), set()).add(op)
            (sends if op == "send" else recvs).setdefault(
                (group, rank, peer) if op == "send" else (group, peer, rank), []
            ).append(tag)
        both = [k for k, v in ways.items() if len(v) > 1]
        assert not both, f"rank {rank} both sends to and receives from a peer on one group: {both}"
    assert sends.keys() == recvs.keys(), (sorted(sends), sorted(recvs))
    for k, tags in sends.items():
        assert tags == recvs[k], (
            f"group {k[0]}: rank {k[1]} sends to {k[2]} in tag order {tags}, received {recvs[k]}"
        )


def _check(res: list[list[dict]], ncases: int) -> None:
    for rank, r in enumerate(res):
        assert len(r) == ncases
        for i, c in enumerate(r):
            assert c["int_exact"], (rank, i, c)
            assert c["float_bitwise_tree_order"], (rank, i, c)
            assert c["rs_block_exact"], (rank, i, c)
            assert c["float_maxdiff"] < 1e-4, (rank, i, c)
            assert c["split"] == res[0][i]["split"] and c["parts"] == res[0][i]["parts"]
    for i in range(ncases):
        _check_p2p_order([r[i]["p2p"] for r in res])


def test_multi_ps_sums_match_all_reduce_and_the_tree_order_on_5_ranks():
    res = launch(aleph_multips_workers.multi_ps_cases, 5, args=(CLUSTERS_5, CASES_5), timeout=120)
    _check(res, len(CASES_5))
    # a member (position 3, below aggregator 2) gets back only its block of 1001 in the reduce-scatter, all 5005 in
    # the all-reduce; the aggregator gets its cluster's span
    for c in res[3][:-1]:  # (the dedicated-PS case runs no reduce-scatter)
        assert c["received"] == (1001, 5005), c["received"]
    parts = [c["parts"] for c in res[0]]
    assert parts[0] == [5003]
    assert parts[1] == [3002, 2001]  # 0.6 / 0.4 of 5003
    assert res[0][2]["split"] == pytest.approx([6 / 11, 3 / 11, 2 / 11])
    assert parts[4] == [5003, 0]


@pytest.mark.slow  # ~25 s more than the sums alone: install_aleph_hook only passes the options on
def test_ddp_hook_with_three_ps_matches_ddp_own_all_reduce_on_5_ranks():
    kw = {"ps": (0, 1, 4), "split": (0.5, 0.3, 0.2)}
    res = launch(aleph_multips_workers.ddp_multi_ps, 5, args=(CLUSTERS_5, kw), timeout=150)
    assert max(res) < 1e-5, res


@pytest.mark.slow
def test_multi_ps_on_7_ranks_three_ps():
    clusters = [[0], [1], [2], [6, 3, 4], [5]]
    cases = [{"ps": (0, 1, 2), "ps_bandwidths": (3.0, 1.5, 1.0)}, {"ps": (6, 5, 0), "split": "equal"}]
    res = launch(aleph_multips_workers.multi_ps_cases, 7, args=(clusters, cases), timeout=240)
    _check(res, len(cases))


PLAN = Plan.from_clusters(5, CLUSTERS_5)


@pytest.mark.parametrize(
    "kw, msg",
    [
        ({"ps": (0, 9)}, "PS position 9 is outside"),
        ({"ps": (0, 3)}, "PS position 3 is a member of the cluster of 2"),
        ({"ps": (0, 0)}, "names a position twice"),
        ({"ps": (0, 1), "split": (0.5, 0.6)}, "split=[0.5, 0.6] must have one fraction"),
        ({"ps": (0, 1), "split": (1.5, -0.5)}, "split=[1.5, -0.5] must have one fraction"),
        ({"ps": (0, 1), "split": (1.0,)}, "split=[1.0] must have one fraction"),
        ({"ps": (0, 1), "split": "fast"}, "split='fast'"),
        ({"ps": (0, 1)}, "give split="),
        ({"ps": (0, 1), "ps_bandwidths": (1.0,)}, "ps_bandwidths=[1.0] has 1 values for 2 PSs"),
        ({"ps": (0, 1), "ps_bandwidths": (1.0, 0.0)}, "every PS bandwidth must be > 0"),
        ({"ps": (2, 1), "split": "equal", "dedicated": True}, "dedicated_ps: PS position 2 has members [3]"),
    ],
)
def test_bad_multi_ps_input_is_refused_naming_it(kw, msg):
    kw = {"ps": None, "split": None, "ps_bandwidths": None, "dedicated": False, **kw}
    with pytest.raises(ValueError) as e:
        _check_multi_ps(PLAN, **kw)
    assert msg in str(e.value)


def test_multi_ps_split_defaults():
    assert _check_multi_ps(PLAN, None, None, None, False) == ((0,), (1.0,))
    assert _check_multi_ps(PLAN, (1, 0), "equal", None, False) == ((1, 0), (0.5, 0.5))


def test_multi_ps_options_need_top_ps():
    from flowlane.aleph.hook import HierarchicalAllReduce

    with pytest.raises(ValueError, match="apply to top='ps' only, not top='allreduce'"):
        HierarchicalAllReduce(PLAN, top="allreduce", ps=(0, 1), split="equal")


def test_install_aleph_hook_hands_several_ps_to_the_udp_tier(monkeypatch):
    import torch

    import flowlane.aleph.udp_allreduce as udp
    from flowlane.aleph.hook import install_aleph_hook

    seen: dict = {}

    class Built(Exception):
        pass

    def fake(plan, group, **kw):  # the tier itself is tested in test_aleph_udp_multips.py
        seen.update(kw)
        raise Built

    monkeypatch.setattr(udp, "UdpAllReduce", fake)
    ddp = torch.nn.parallel.DistributedDataParallel
    model = ddp.__new__(ddp)
    with pytest.raises(Built):
        install_aleph_hook(model, PLAN, dataplane="udp", ps=(0, 1), split="equal", drop=0.01)
    assert seen == {"ps": (0, 1), "split": "equal", "ps_bandwidths": None, "drop": 0.01}
    with pytest.raises(ValueError, match="replanner applies to dataplane='torch' only"):
        install_aleph_hook(model, PLAN, dataplane="udp", ps=(0, 1), split="equal", replanner=object())


@pytest.mark.parametrize("dataplane", ["torch", "udp"])
def test_install_aleph_hook_refuses_dedicated_ps(dataplane):
    """A dedicated PS is left out of the sum while DDP trains on it and the hook's 1/size counts it: 3 gloo ranks with
    one dedicated PS all ended with 5/3, neither the workers' mean 5/2 nor the all-rank mean 2."""
    import torch

    from flowlane.aleph.hook import install_aleph_hook

    ddp = torch.nn.parallel.DistributedDataParallel
    model = ddp.__new__(ddp)  # refused before the group is touched
    with pytest.raises(ValueError, match="dedicated_ps=True is not allowed"):
        install_aleph_hook(
            model, PLAN, top="ps", dataplane=dataplane, ps=(0, 1), split="equal", dedicated_ps=True
        )
