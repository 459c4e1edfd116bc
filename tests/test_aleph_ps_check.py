"""ALEPH's PS check (digest §5.1 #12): with ``ps_gbps`` = P, planning and re-planning check |D|*b <= P and, where it
fails, lower b to P/|D| and re-make the plan at that b (bigger clusters, fewer flows into the PS)."""

from __future__ import annotations

import logging

import pytest

from flowlane.aleph import AlephConfig, Plan, Replanner, plan_clusters
from flowlane.aleph.cluster import flow_rate, plan_with_rate
from flowlane.aleph.model import aleph_time, ps_feasibility

pytestmark = pytest.mark.once

TESTBED = [
    30,
    20,
    20,
    10,
    10,
    10,
    10,
    10,
]  # Sec. 6.3: 1x30, 2x20, 5x10 Gbps; b = 10, |D| = 4 without a PS budget


def test_a_tiny_ps_budget_replans_the_testbed_into_one_cluster_at_p_over_d() -> None:
    default = plan_clusters(TESTBED)
    assert default.num_flows == 4 and not ps_feasibility(default, 10, 1e-6).feasible
    plan = plan_clusters(TESTBED, config=AlephConfig(ps_gbps=1e-6))
    # b lowered to P/4 makes every capacity huge: the 30 Gbit/s worker aggregates everyone, one flow into the PS
    assert plan != default and [list(c.members) for c in plan.clusters] == [list(range(8))]
    replanner = Replanner(TESTBED, AlephConfig(ps_gbps=1e-6))
    assert replanner.plan == plan and replanner.rate == pytest.approx(1e-6)  # P / |D| with |D| = 1
    assert ps_feasibility(plan, replanner.rate, 1e-6).feasible
    assert Replanner(TESTBED).plan == default and Replanner(TESTBED).rate == 10


@pytest.mark.parametrize(
    ("ps", "flows", "rate"),
    [(None, 4, 10), (40, 4, 10), (30, 3, 7.5), (20, 3, 20 / 3), (10, 2, 5)],
)
def test_the_plan_and_its_rate_follow_the_ps_budget(ps: float | None, flows: int, rate: float) -> None:

    default = plan_clusters(TESTBED)
    plan, b = plan_with_rate(TESTBED, config=AlephConfig(ps_gbps=ps))
    assert (plan.num_flows, b) == (flows, pytest.approx(rate))
    assert plan_clusters(TESTBED, config=AlephConfig(ps_gbps=ps)) == plan
    if ps is None or ps >= 40:  # |D| * b = 40 fits: nothing changes
        assert plan == default
        return
    # the check holds at the plan's rate, which is the flow model's, and never below the first plan's at P/|D|
    assert ps_feasibility(plan, b, ps).feasible
    assert aleph_time(1.0, plan, TESTBED, ps).rate == pytest.approx(b)
    assert b >= ps / default.num_flows
    # every b = P/k below the paper's b was planned: none gives a faster plan (one step to P/|D| overshot: at P = 20
    # it gave |D| = 2 at 5, at P = 10 |D| = 1 at 3.75)
    for k in range(1, len(TESTBED) + 1):
        if ps / k < 10:
            other = plan_clusters(TESTBED, config=AlephConfig(b_gbps=ps / k))
            assert flow_rate(other, TESTBED, AlephConfig(ps_gbps=ps)) <= b + 1e-12


def test_the_ps_check_and_the_rate_are_logged(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="flowlane.aleph"):
        plan_clusters(TESTBED, config=AlephConfig(ps_gbps=20))
        plan_clusters(TESTBED, config=AlephConfig(ps_gbps=40))
        plan_clusters(TESTBED)
    got = [r.getMessage() for r in caplog.records if r.name == "flowlane.aleph"]
    assert got == [
        "flowlane.aleph: PS check |D|*b = 4 x 10 = 40 > ps_gbps=20 Gbit/s: re-planned at b = P/k (7 plans made); "
        "|D| 4 -> 3, rate per flow 6.667 Gbit/s",
        "flowlane.aleph: PS check |D|*b = 4 x 10 = 40 <= ps_gbps=40 Gbit/s: plan kept, rate per flow 10 Gbit/s",
    ]


def test_replanning_under_a_ps_budget_keeps_a_faster_plan_and_checks_the_ps() -> None:
    cfg = AlephConfig(ps_gbps=20, replan_every=1)
    r = Replanner(TESTBED, cfg)
    assert (r.plan.num_flows, r.rate) == (3, pytest.approx(20 / 3))
    start = r.plan
    # the fast worker doubles its rate: a fresh plan runs at 10 (|D| = 2), faster than the plan in force: replaced
    d = r.observe([60, *TESTBED[1:]])
    assert (
        d.changed and (d.plan.num_flows, r.rate) == (2, 10) and d.reason.endswith("rate per flow 10 Gbit/s")
    )
    # five workers move: the fresh plan (|D| = 1) has fewer flows but is slower (3.75 against the plan in force's
    # 5), so the plan in force stays (the rule without ps_gbps, fewer flows wins, would have switched to it)
    r = Replanner(TESTBED, cfg)
    moved = [30, 30, 20, 60, 40, 5, 10, 30]
    fresh, fresh_rate = plan_with_rate(moved, config=cfg)
    assert (fresh.num_flows, fresh_rate) == (1, 3.75)
    d = r.observe(moved)
    assert not d.changed and d.plan == start and r.rate == 5
    # the aggregator of 4 slows to 15: at the fresh plan's rate it may take 1 member: infeasible, replaced
    r = Replanner(TESTBED, cfg)
    d = r.observe([15, *TESTBED[1:]])
    assert d.changed and "aggregator 0 has 3 members > capacity 1" in d.reason
    assert r.rate == pytest.approx(20 / 3) and ps_feasibility(d.plan, r.rate, 20).feasible


def test_top_ps_puts_the_ps_on_the_head_with_the_most_spare_bandwidth_and_counts_its_flows() -> None:
    """flowlane's PS is one of the heads (the seed's is a separate machine): it also carries the other |D| - 1 heads'
    flows, which Eq. 1's capacities do not count, so the PS goes on the head with max B_h / (k_h + |D| - 1) and the
    flow model counts those flows with top="ps"."""
    from flowlane.aleph.model import plan_rate, ps_head, ps_head_rate

    bw = [30.0, 20.0, 20.0, 10.0, 10.0, 10.0, 10.0, 10.0]  # the testbed: [(0, 4, 6), (1, 7), (2, 5), (3,)]
    plan = plan_clusters(bw)
    assert plan.num_flows == 4 and len(plan.cluster_of(0).members) == 3
    # head 0: 2 members + 3 other heads = 5 flows each way -> 30/5 = 6; heads 1, 2: 20/4 = 5; head 3: 10/3
    assert [ps_head_rate(plan, bw, h) for h in plan.heads] == pytest.approx([6.0, 5.0, 5.0, 10 / 3])
    assert ps_head(plan, bw) == 0
    assert flow_rate(plan, bw, AlephConfig()) == 10.0  # the aggregators' all-reduce: the paper's b
    assert flow_rate(plan, bw, AlephConfig(top="ps")) == pytest.approx(
        6.0
    )  # was 10: the PS's flows uncounted
    assert plan_rate(plan, bw, 40.0, ps_head=0) == pytest.approx(6.0) and plan_rate(plan, bw, 40.0) == 10.0
    # the lowest head is not always the best: a slow singleton at 0 would carry 3 flows at 15 Gbit/s
    bw = [15.0, 40.0, 10.0, 10.0, 10.0, 10.0]
    plan = Plan.from_clusters(6, [[0], [1, 2, 3, 4], [5]])
    assert ps_head(plan, bw) == 1 and ps_head_rate(plan, bw, 1) == 8.0 and ps_head_rate(plan, bw, 0) == 7.5
    assert flow_rate(plan, bw, AlephConfig(top="ps")) == 8.0
    # ties: the lowest position; a plan of one cluster: the head serves its k members alone
    assert ps_head(Plan.from_clusters(4, [[0, 1], [2, 3]]), [20.0, 10.0, 20.0, 10.0]) == 0
    assert ps_head_rate(Plan.from_clusters(3, [[1, 0, 2]]), [10.0, 30.0, 10.0], 1) == 15.0
    with pytest.raises(ValueError, match=r"PS position 2 is not a cluster head"):
        ps_head_rate(plan, bw, 2)
