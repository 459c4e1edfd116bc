"""Hermod coflow keys: the priority order is a strict total order, follows tables 5.3/5.4, and encodes to wire
classes as the seed's 6-bit DSCP layout (seed 000 §5.3.1, §5.4; digest A2.4, A6.1)."""

import itertools
import random

import pytest

from flowlane.hermod.order import CoflowKey, HermodOrder, HermodOrderConfig, thesis_conditional_before
from flowlane.hermod.wire import WireConfig, WireEncoder, nccl_traffic_class
from flowlane.policies import make_policy
from flowlane.policy import CTYPES


def _random_keys(n: int, seed: int) -> list[CoflowKey]:
    r = random.Random(seed)
    ops = ["all_gather", "reduce_scatter", "dispatch", "send_fwd"]
    return [
        CoflowKey(r.randint(0, 2), r.randint(0, 5), r.choice(CTYPES), r.randint(0, 7), r.choice(ops))
        for _ in range(n)
    ]


@pytest.mark.parametrize(
    "cfg",
    [
        HermodOrderConfig(6, "1f1b", "last"),
        HermodOrderConfig(6, "interleaved", "consumer"),
        HermodOrderConfig(None, "1f1b", "consumer"),
    ],
)
def test_order_is_transitive_antisymmetric_and_total_on_random_keys(cfg):
    order = HermodOrder(cfg)
    keys = list(set(_random_keys(60, 7)))
    for a, b in itertools.permutations(keys, 2):
        assert order.before(a, b) != order.before(b, a), (a, b)  # total + antisymmetric on distinct keys
    for a, b, c in itertools.permutations(keys[:30], 3):
        if order.before(a, b) and order.before(b, c):
            assert order.before(a, c), (a, b, c)


def test_printed_conditional_rule_has_a_cycle_but_lexicographic_order_does_not():
    a = CoflowKey(0, 1, "ep", 3)
    b = CoflowKey(0, 0, "dp", 2)
    c = CoflowKey(0, 2, "ep", 1)
    # digest A2.4: A > C by MID, C > B by LID, B > A by LID
    assert (
        thesis_conditional_before(a, c)
        and thesis_conditional_before(c, b)
        and thesis_conditional_before(b, a)
    )
    order = HermodOrder(HermodOrderConfig(4))
    ranked = sorted([a, b, c], key=order.sort_key)
    assert ranked == [a, c, b]


def test_table_5_3_cases():
    o = HermodOrder(HermodOrderConfig(4))
    # Case I: lower microbatch first, whatever the type
    assert o.before(CoflowKey(0, 0, "pp", 1), CoflowKey(0, 1, "ep", 0))
    # Case II: EP & PP before DP
    assert o.before(CoflowKey(0, 3, "ep", 5), CoflowKey(0, 3, "dp", 0))
    assert o.before(CoflowKey(0, 3, "pp", 5), CoflowKey(0, 0, "dp", 0))  # DP carries MID = M-1
    # Case III: lower layer first among DP coflows
    assert o.before(CoflowKey(1, 0, "dp", 0, "all_gather"), CoflowKey(1, 0, "dp", 3, "all_gather"))
    # 1F1B: EP and PP share a rank; interleaved: EP > PP > DP
    oi = HermodOrder(HermodOrderConfig(4, "interleaved"))
    assert oi.before(CoflowKey(0, 1, "ep", 4), CoflowKey(0, 1, "pp", 0))
    assert o.before(CoflowKey(0, 1, "pp", 0), CoflowKey(0, 1, "ep", 4))
    # older iteration only breaks ties
    assert o.before(CoflowKey(0, 3, "dp", 2), CoflowKey(1, 3, "dp", 2))
    assert o.before(CoflowKey(1, 0, "pp", 0), CoflowKey(0, 3, "dp", 0))


def test_dp_mid_knob_moves_parameter_gathers_to_the_first_consumer():
    gather = CoflowKey(1, 0, "dp", 2, "all_gather")
    ep_mb1 = CoflowKey(1, 1, "ep", 0)
    assert HermodOrder(HermodOrderConfig(4, dp_mid="last")).before(ep_mb1, gather)
    assert HermodOrder(HermodOrderConfig(4, dp_mid="consumer")).before(gather, ep_mb1)
    # reductions keep M-1 under both settings
    rs = CoflowKey(0, 0, "dp", 0, "reduce_scatter")
    assert HermodOrder(HermodOrderConfig(4, dp_mid="consumer")).before(CoflowKey(0, 3, "pp", 9), rs)


def test_bad_values_are_named():
    with pytest.raises(ValueError, match="ctype 'xx'"):
        CoflowKey(0, 0, "xx", 0)
    with pytest.raises(ValueError, match="microbatch must be"):
        CoflowKey(0, -1, "dp", 0)
    with pytest.raises(ValueError, match="dp_mid 'first'"):
        HermodOrderConfig(4, dp_mid="first")
    with pytest.raises(ValueError, match="6 bits"):
        WireConfig(3, 2, 2)


def test_dscp_layout_matches_the_seed_golden_table():
    enc = WireEncoder(HermodOrder(HermodOrderConfig(16)), WireConfig(layers_per_stage=8))
    assert enc.dscp(CoflowKey(0, 0, "pp", 0)) == 0b000_0_00
    assert enc.dscp(CoflowKey(0, 1, "ep", 2)) == 0b001_0_01
    assert enc.dscp(CoflowKey(0, 3, "ep", 7)) == 0b011_0_11
    assert enc.dscp(CoflowKey(0, 12, "ep", 0)) == 0b111_0_00  # MID clamped to 7
    assert enc.dscp(CoflowKey(0, 5, "ep", 0), oldest_mid=4) == 0b001_0_00  # relative MID
    assert enc.dscp(CoflowKey(0, 0, "dp", 9)) == 0b111_1_00  # DP: MID M-1 (clamped), ctype bit, local layer 1
    # below the MID clamp the encoding never inverts the exact order (it only merges keys) ...
    order = enc.order
    keys = [CoflowKey(0, m, c, lid) for m in range(7) for c in ("ep", "pp") for lid in range(8)]
    for a, b in itertools.combinations(keys, 2):
        if order.before(a, b):
            assert enc.dscp(a) <= enc.dscp(b), (a, b)
    # ... beyond it, clamped microbatches fall back to LID order: a quantisation inversion (measured in the sim)
    assert order.before(CoflowKey(0, 7, "ep", 2), CoflowKey(0, 8, "ep", 0))
    assert enc.dscp(CoflowKey(0, 7, "ep", 2)) > enc.dscp(CoflowKey(0, 8, "ep", 0))


def test_nccl_classes_are_few_and_ordered():
    enc = WireEncoder(HermodOrder(HermodOrderConfig(4)))
    assert enc.nccl_class(CoflowKey(0, 0, "pp", 3)) == 0
    assert enc.nccl_class(CoflowKey(0, 2, "ep", 0)) == 1
    assert enc.nccl_class(CoflowKey(0, 0, "dp", 0)) == 2
    tcs = [nccl_traffic_class(c) for c in range(3)]
    assert tcs == sorted(tcs) and len(set(tcs)) == 3 and all(0 <= t < 256 for t in tcs)
    with pytest.raises(ValueError, match="hermod_class"):
        nccl_traffic_class(3)


@pytest.mark.parametrize("m", [1, 2, 4, None])
@pytest.mark.parametrize("dp_mid", ["last", "consumer"])
@pytest.mark.parametrize("schedule", ["1f1b", "interleaved"])
def test_nccl_classes_never_reverse_the_exact_order(m, dp_mid, schedule):
    """Three classes merge keys but never serve a later key's class first, whatever dp_mid (random pairs)."""
    enc = WireEncoder(HermodOrder(HermodOrderConfig(m, schedule, dp_mid)))
    r = random.Random(11)
    mbs = m or 6
    ops = ["all_gather", "reduce_scatter", "all_reduce", "dispatch", "send_fwd"]
    for _ in range(4000):
        oldest = r.randrange(mbs)
        a, b = (
            CoflowKey(r.randint(0, 2), r.randrange(mbs), r.choice(CTYPES), r.randint(0, 7), r.choice(ops))
            for _ in range(2)
        )
        if enc.order.before(a, b):
            assert enc.nccl_class(a, oldest) <= enc.nccl_class(b, oldest), (a, b, oldest)
    # the reviewer's pair: a gather for iteration 1's first microbatch goes before EP of its microbatch 1
    if m == 4 and dp_mid == "consumer":
        gather, ep = CoflowKey(1, 0, "dp", 0, "all_gather"), CoflowKey(1, 1, "ep", 5, "all_to_all")
        assert enc.order.before(gather, ep)
        assert (enc.nccl_class(gather), enc.nccl_class(ep)) == (0, 1)
        assert enc.nccl_class(CoflowKey(0, 3, "dp", 7, "reduce_scatter")) == 2  # reductions stay bulk


def test_hermod_policies_are_named_for_the_simulator():
    p = make_policy("hermod")
    from flowlane.policy import CoflowMeta

    assert p.priority(CoflowMeta("pp", microbatch=0)) < p.priority(CoflowMeta("dp", microbatch=0))
    assert make_policy("hermod-nccl").priority(CoflowMeta("dp")) == (2,)
