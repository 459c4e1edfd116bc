"""ALEPH's control plane (seed 002): capacities, M-WCHA against exact optima, the flow model, re-planning."""

import random

import pytest

from flowlane.aleph import (
    AlephConfig,
    Plan,
    Replanner,
    adjacency_complete,
    adjacency_rtt,
    adjacency_same_switch,
    capacities,
    greedy_by_capacity,
    mwcha,
    optimum_brute_force,
    optimum_cliques,
    optimum_complete,
    plan_clusters,
)
from flowlane.aleph.model import (
    aleph_time,
    bandwidth_usage,
    multi_ps_split,
    multi_ps_time,
    ps_feasibility,
    ps_time,
    ring_time,
)
from flowlane.aleph.treesim import Fabric, simulate

pytestmark = pytest.mark.once

TESTBED = [30, 20, 20, 10, 10, 10, 10, 10]  # Sec. 6.3: 1x30, 2x20, 5x10 Gbps


def test_capacity_is_floored_bandwidth_over_b_minus_one_and_cpu_bound():
    assert capacities(TESTBED) == [2, 1, 1, 0, 0, 0, 0, 0]
    assert capacities([10, 25, 40], b=10) == [0, 1, 3]
    assert capacities([40, 40], b=10, cpu=[0.25, 1.0], c=0.1) == [2, 3]


def test_testbed_plan_has_four_flows_like_the_paper_for_every_seed():
    for seed in range(10):
        plan = plan_clusters(TESTBED, config=AlephConfig(seed=seed))
        assert plan.num_flows == 4
        sizes = {c.head: len(c.members) for c in plan.clusters}
        assert sizes[0] == 3 and sizes[1] == 2 and sizes[2] == 2  # Agg2 takes two, each Agg1 one, one direct
        assert plan.violations(capacities(TESTBED)) == []


def test_table1_times_follow_exactly_from_the_flow_model():
    bw, S, P = [10, 10, 10, 30], 4.2, 20
    plan = Plan.from_clusters(4, {3: [3, 1, 2], 0: [0]})  # Fig. 1: w3 aggregates w1, w2; w0 goes direct
    assert mwcha(capacities(bw), adjacency_complete(4)).num_flows == 2
    for ft, (traffic, rate, t) in (
        (ps_time(S, bw, P), (4.2, 5, 0.84)),
        (ring_time(S, bw), (6.3, 10, 0.63)),
        (aleph_time(S, plan, bw, P), (4.2, 10, 0.42)),
    ):
        assert (ft.traffic, ft.rate, ft.time) == pytest.approx((traffic, rate, t), rel=1e-12)


def _random_case(rng: random.Random, n: int, kind: str):
    bw = [rng.choice([1, 2, 3, 4, 5]) for _ in range(n)]
    if kind == "complete":
        adj = adjacency_complete(n)
    elif kind == "switch":
        adj = adjacency_same_switch([rng.randrange(3) for _ in range(n)])
    else:
        rtt = [[0.0] * n for _ in range(n)]
        for i in range(n):
            for j in range(i + 1, n):
                rtt[i][j] = rtt[j][i] = rng.uniform(0, 2)
        adj = adjacency_rtt(rtt, 1.0)
    return capacities(bw, b=1), adj


@pytest.mark.parametrize("kind", ["complete", "switch", "rtt"])
def test_mwcha_is_feasible_and_never_beats_brute_force_for_n_up_to_10(kind):
    rng = random.Random(7)
    ratios = []
    for trial in range(12):
        n = rng.randint(2, 10)
        g, adj = _random_case(rng, n, kind)
        opt = optimum_brute_force(g, adj)
        assert opt.violations(g, adj) == []
        if kind == "complete":
            assert opt.num_flows == optimum_complete(g)
        if kind in ("complete", "switch"):
            assert optimum_cliques(g, adj) == opt.num_flows
        for variant in ("fill", "paper"):
            p = mwcha(g, adj, variant, seed=trial)
            assert p.violations(g, adj) == [], (variant, g)
            assert p.num_flows >= opt.num_flows
        fill = mwcha(g, adj, "fill", seed=trial).num_flows
        ratios.append(fill / opt.num_flows)
        assert greedy_by_capacity(g, adj).num_flows >= opt.num_flows
    assert sum(ratios) / len(ratios) < 1.5  # well inside the paper's 8 H_Delta bound


def test_brute_force_on_hand_cases():
    star = [frozenset({1, 2, 3}), frozenset({0}), frozenset({0}), frozenset({0})]
    assert optimum_brute_force([3, 0, 0, 0], star).num_flows == 1
    assert optimum_brute_force([2, 0, 0, 0], star).num_flows == 2  # the hub takes two, one leaf goes direct
    assert optimum_brute_force([0, 5, 5, 5], star).num_flows == 3  # leaves can take only the hub
    path = adjacency_rtt([[0, 1, 9], [1, 0, 1], [9, 1, 0]], 1.5)  # 0 - 1 - 2
    assert optimum_brute_force([1, 2, 1], path).clusters[0].members == (1, 0, 2)


def test_no_heterogeneity_means_pure_ps_and_plans_are_seeded():
    assert plan_clusters([5.0] * 12).num_flows == 12
    rng = random.Random(3)
    bw = [10 * min(0.9, max(0.1, rng.gauss(0.5, 0.3))) for _ in range(60)]
    for variant in ("fill", "paper"):
        cfg = AlephConfig(variant=variant, seed=11)
        assert plan_clusters(bw, config=cfg) == plan_clusters(bw, config=cfg)


def test_fill_is_within_1_1x_of_optimal_at_sigma_0_3_n_100():
    flows, opt = 0, 0
    for seed in range(10):
        rng = random.Random(seed)
        bw = [10 * min(0.9, max(0.1, rng.gauss(0.5, 0.3))) for _ in range(100)]
        g = capacities(bw)
        flows += mwcha(g, adjacency_complete(100), "fill", seed).num_flows
        opt += optimum_complete(g)
    assert flows / opt <= 1.1


def test_bad_inputs_are_refused_naming_the_value():
    with pytest.raises(ValueError, match="variant='greedy'"):
        AlephConfig(variant="greedy")
    with pytest.raises(ValueError, match="unknown aleph config key"):
        AlephConfig.from_dict({"seeed": 1})
    with pytest.raises(ValueError, match="bandwidth must be > 0"):
        capacities([10, 0])
    # CPU limits capacity only with C_w figures: without them the key used to be ignored silently
    with pytest.raises(ValueError, match=r"cpu_per_member=0.1 needs the workers' CPU figures \(cpu="):
        capacities([40, 40], b=10, c=0.1)
    with pytest.raises(ValueError, match="cpu_per_member=0.5 needs the workers' CPU figures"):
        plan_clusters([30, 20, 10], config=AlephConfig(cpu_per_member=0.5))
    with pytest.raises(ValueError, match="not symmetric"):
        mwcha([1, 1], [frozenset({1}), frozenset()])
    with pytest.raises(ValueError, match="brute force is exponential"):
        optimum_brute_force([0] * 15, adjacency_complete(15))
    with pytest.raises(ValueError, match="do not partition"):
        Plan.from_clusters(3, {0: [0, 1]})


def test_ps_check_and_proportional_multi_ps_split():
    plan = plan_clusters(TESTBED)
    assert ps_feasibility(plan, 10, 40).feasible
    check = ps_feasibility(plan, 10, 20)
    assert not check.feasible and check.ps_load == 40 and check.rate == 5
    assert multi_ps_split([30, 10]) == [0.75, 0.25]
    prop = multi_ps_time(1.0, 4, [30, 10])
    assert prop == pytest.approx(4 / 40) and prop < multi_ps_time(1.0, 4, [30, 10], split=[0.5, 0.5])


def test_fig13_worker_usage_is_two_n_minus_d_and_ps_usage_is_d():
    rng = random.Random(0)
    bw = [10 * min(0.9, max(0.1, rng.gauss(0.5, 0.3))) for _ in range(100)]
    plan = plan_clusters(bw)
    workers, ps = bandwidth_usage(plan, 1.0)
    assert workers == 200 - plan.num_flows and ps == plan.num_flows


def test_treesim_orders_aleph_before_ring_before_ps_on_the_testbed_star():
    plan = plan_clusters(TESTBED)
    fab = Fabric.star(TESTBED, 40)
    t = {s: simulate(s, fab, 1.0, plan).time for s in ("ps", "ring", "aleph")}
    assert t["aleph"] == pytest.approx(1 / 10) and t["ps"] == pytest.approx(1 / 5)
    assert t["ring"] == pytest.approx(2 * 7 / 8 / 10)
    ls = Fabric.leaf_spine(TESTBED, 40, hosts_per_leaf=4, leaf_uplink=20)
    assert ls.leaf_of is not None
    # members one switch hop from their aggregator
    rack = plan_clusters(TESTBED, adjacency_same_switch(ls.leaf_of))
    r = {s: simulate(s, ls, 1.0, rack) for s in ("ps", "ring", "aleph")}
    assert r["aleph"].link_bytes < r["ps"].link_bytes
    assert r["aleph"].mean_hops <= r["ps"].mean_hops < r["ring"].mean_hops


def test_replanning_ignores_jitter_and_reacts_to_real_drift():
    rp = Replanner(TESTBED, AlephConfig(replan_every=10, hysteresis=0.2))
    assert rp.due(10) and not rp.due(5) and not rp.due(0)
    d = rp.observe([31, 19, 21, 10.5, 10, 9.6, 10, 10])
    assert not d.changed and "no worker moved" in d.reason
    # the 30 Gbit/s aggregator falls to 10: it cannot keep two members
    d = rp.observe([10, 20, 20, 10, 10, 10, 10, 10])
    assert d.changed and "infeasible" in d.reason
    assert d.plan.violations(capacities([10, 20, 20, 10, 10, 10, 10, 10])) == []
    # two workers speed up: a plan with fewer flows exists
    d = rp.observe([10, 20, 20, 40, 40, 10, 10, 10])
    assert d.changed and d.plan.num_flows < 5
