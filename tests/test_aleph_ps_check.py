"""ALEPH's PS check (digest §5.1 #12): with ``ps_gbps`` = P, planning and re-planning check |D|*b <= P and, where it
fails, lower b to P/|D| and re-make the plan at that b (bigger clusters, fewer flows into the PS)."""

from __future__ import annotations

import logging

import pytest

from flowlane.aleph import AlephConfig, Replanner, plan_clusters
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
    [(None, 4, 10), (40, 4, 10), (30, 3, 7.5), (20, 2, 5), (10, 1, 3.75)],
)
def test_the_plan_and_its_rate_follow_the_ps_budget(ps: float | None, flows: int, rate: float) -> None:
    from flowlane.aleph.cluster import plan_with_rate

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


def test_the_ps_check_and_the_rate_are_logged(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="flowlane.aleph"):
        plan_clusters(TESTBED, config=AlephConfig(ps_gbps=20))
        plan_clusters(TESTBED, config=AlephConfig(ps_gbps=40))
        plan_clusters(TESTBED)
    got = [r.getMessage() for r in caplog.records if r.name == "flowlane.aleph"]
    assert got == [
        "flowlane.aleph: PS check |D|*b = 4 x 10 = 40 > ps_gbps=20 Gbit/s: b lowered to P/|D| and re-planned "
        "(2 plans made); |D| 4 -> 2, rate per flow 5 Gbit/s",
        "flowlane.aleph: PS check |D|*b = 4 x 10 = 40 <= ps_gbps=40 Gbit/s: plan kept, rate per flow 10 Gbit/s",
    ]


def test_replanning_under_a_ps_budget_keeps_a_faster_plan_and_checks_the_ps() -> None:
    cfg = AlephConfig(ps_gbps=20, replan_every=1)
    r = Replanner(TESTBED, cfg)
    assert (r.plan.num_flows, r.rate) == (2, 5)
    start = r.plan
    # the fast worker doubles its rate: the plan in force now runs at 10 = P/|D|; a fresh one is no faster
    d = r.observe([60, *TESTBED[1:]])
    assert not d.changed and d.plan == start and r.rate == 10 and d.reason.endswith("rate per flow 10 Gbit/s")
    # the aggregators 1 and 2 (20 Gbit/s) slow to 10: the fresh plan (|D| = 1) has fewer flows but is slower
    # (3.75 against the plan in force's 5), so the plan in force stays; without ps_gbps fewer flows would win
    r = Replanner(TESTBED, cfg)
    slow = [30, 10, 10, *TESTBED[3:]]
    d = r.observe(slow)
    assert not d.changed and d.plan == start and r.rate == 5
    # the aggregator of 5 members slows to 15: 15/6 = 2.5 < the fresh plan's 3.33: infeasible, replaced
    r = Replanner(TESTBED, cfg)
    d = r.observe([15, *TESTBED[1:]])
    assert d.changed and "aggregator 0 has 5 members > capacity 3" in d.reason
    assert r.rate == pytest.approx(20 / 6) and ps_feasibility(d.plan, r.rate, 20).feasible
