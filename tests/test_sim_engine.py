"""flowlane.sim engine: closed forms, byte conservation, priority, determinism, routing."""

from __future__ import annotations

import numpy as np
import pytest

from flowlane.policy import CoflowMeta, CtypeFirstPolicy, FifoPolicy, make_policy
from flowlane.sim import IncastModel, SimConfig, SimSpecError, Simulator, Workload, allocate, waterfill
from flowlane.sim import collectives as C
from flowlane.topology import Topology, gBps, leaf_spine, star

B = gBps(1)
S = 64e6


def _star(n: int, lat: float = 0.0) -> Topology:
    return star([B] * n, latency=lat)


@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_ring_all_reduce_matches_closed_form_2_n_minus_1_over_n_s_over_b(n: int) -> None:
    topo = _star(n)
    w = Workload(topo.gpus)
    C.all_reduce(w, range(n), S, CoflowMeta("dp"))
    r = Simulator(topo).run(w)
    assert r.makespan == pytest.approx(2 * (n - 1) / n * S / B, rel=1e-9)


def test_ring_all_reduce_adds_two_n_minus_1_step_latencies() -> None:
    n, lat = 4, 5e-6
    topo = _star(n, lat)
    w = Workload(topo.gpus)
    C.all_reduce(w, range(n), S, CoflowMeta("dp"))
    r = Simulator(topo).run(w)
    assert r.makespan == pytest.approx(2 * (n - 1) / n * S / B + 2 * (n - 1) * 2 * lat, rel=1e-9)


@pytest.mark.parametrize("k", [1, 2, 5, 7])
def test_k_to_1_incast_takes_k_s_over_b_and_penalty_scales_it(k: int) -> None:
    topo = _star(k + 1)
    w = Workload(topo.gpus)
    C.p2p(w, list(range(1, k + 1)), [0] * k, S, CoflowMeta("pp"))
    assert Simulator(topo).run(w).makespan == pytest.approx(k * S / B, rel=1e-9)
    inc = IncastModel(threshold=1, alpha=0.25)
    r = Simulator(topo, SimConfig(incast=inc)).run(w)
    assert r.makespan == pytest.approx(k * S / B * (1 + 0.25 * (k - 1)), rel=1e-9)


def test_reduce_scatter_all_gather_and_tree_times() -> None:
    n = 4
    topo = _star(n)
    for fn, expect in ((C.reduce_scatter, (n - 1) / n * S / B), (C.all_gather, (n - 1) / n * S / B)):
        w = Workload(topo.gpus)
        fn(w, range(n), S, CoflowMeta("dp"))
        assert Simulator(topo).run(w).makespan == pytest.approx(expect, rel=1e-9)
    w = Workload(topo.gpus)
    C.all_reduce(w, range(n), S, CoflowMeta("dp"), algo="tree")
    t_tree = Simulator(topo).run(w).makespan
    assert S / B * 0.9 < t_tree < 3 * S / B  # double binary tree: at least ~S/B at the busiest port


def test_chunked_collective_takes_the_same_time_as_unchunked_without_contention() -> None:
    topo = _star(4)
    w = Workload(topo.gpus)
    last = C.all_reduce(w, range(4), S, CoflowMeta("dp"), chunks=4, stream="dp")
    assert len(w.coflows) == 4 and w.deps[last]
    assert Simulator(topo).run(w).makespan == pytest.approx(1.5 * S / B, rel=1e-9)


def _random_workload(topo: Topology, seed: int, ncof: int = 30) -> Workload:
    rng = np.random.default_rng(seed)
    w = Workload(topo.gpus)
    n = len(topo.gpus)
    prev: list[int] = []
    for i in range(ncof):
        k = int(rng.integers(1, 6))
        src = rng.integers(0, n, k)
        dst = (src + rng.integers(1, n, k)) % n
        ct = ["dp", "pp", "ep", "cp"][i % 4]
        deps = [int(rng.choice(prev))] if prev and rng.random() < 0.5 else []
        c = w.compute(f"g{int(src[0])}", float(rng.random() * 0.05), deps)
        prev.append(w.coflow((src, dst, rng.random(k) * 1e8 + 1), CoflowMeta(ct, microbatch=i % 3, layer=i % 5),
                             [c]))
    return w


@pytest.mark.parametrize("routing", ["ecmp", "spray", "first"])
@pytest.mark.parametrize("policy", ["fifo", "priority", "ep-first"])
def test_bytes_carried_by_the_fluid_equal_bytes_offered_on_every_link(routing: str, policy: str) -> None:
    topo = leaf_spine(servers=4, gpus_per_server=2, servers_per_leaf=2)
    w = _random_workload(topo, 1)
    r = Simulator(topo, SimConfig(routing=routing)).run(w, make_policy(policy))
    assert r.coflow_bytes.sum() == pytest.approx(w.total_bytes())
    np.testing.assert_allclose(r.link_bytes_moved, r.link_bytes, rtol=1e-6, atol=1e3)
    assert r.link_utilisation.max() <= 1 + 1e-9


def test_waterfill_is_feasible_and_max_min_fair() -> None:
    rng = np.random.default_rng(3)
    nl, n = 12, 40
    hops = np.full((n, 3), nl)
    for i in range(n):
        k = rng.integers(1, 4)
        hops[i, :k] = rng.choice(nl, k, replace=False)
    cap = np.append(rng.random(nl) * 10 + 1, np.inf)
    rates = waterfill(hops, np.ones(n), cap.copy())
    load = np.bincount(hops.ravel(), weights=np.repeat(rates, 3), minlength=nl + 1)[:nl]
    assert (load <= cap[:nl] * (1 + 1e-9)).all()
    # max-min: every flow has a saturated link on which no other flow gets more
    for i in range(n):
        links = [x for x in hops[i] if x < nl]
        ok = False
        for lk in links:
            on = (hops == lk).any(axis=1)
            if load[lk] >= cap[lk] * (1 - 1e-9) and rates[on].max() <= rates[i] * (1 + 1e-9):
                ok = True
        assert ok, f"flow {i} has no bottleneck link"


def test_strict_priority_gives_the_lower_class_nothing_while_a_higher_class_saturates_the_link() -> None:
    hops = np.array([[0], [0], [0]])
    rates = allocate(hops, np.array([0, 1, 1]), np.array([10.0]))
    assert rates.tolist() == [10.0, 0.0, 0.0]
    w_rates = allocate(hops, np.array([0, 1, 1]), np.array([10.0]), sharing="weighted", weight_ratio=0.5)
    assert w_rates == pytest.approx([5.0, 2.5, 2.5])


def test_priority_policy_finishes_high_class_first_in_simulation() -> None:
    topo = _star(2)
    w = Workload(topo.gpus)
    dp = C.p2p(w, 0, 1, S, CoflowMeta("dp"))
    pp = C.p2p(w, 0, 1, S, CoflowMeta("pp"))
    fifo = Simulator(topo).run(w, FifoPolicy())
    assert fifo.coflow_end.tolist() == pytest.approx([2 * S / B, 2 * S / B])
    pri = Simulator(topo).run(w, CtypeFirstPolicy("pp"))
    ends = dict(zip(pri.coflow_nodes.tolist(), pri.coflow_end.tolist(), strict=True))
    assert ends[pp] == pytest.approx(S / B) and ends[dp] == pytest.approx(2 * S / B)


def test_stream_runs_coflows_one_at_a_time_in_policy_order() -> None:
    topo = _star(2)
    w = Workload(topo.gpus)
    a = C.p2p(w, 0, 1, S, CoflowMeta("dp", layer=5), stream="s")
    b = C.p2p(w, 0, 1, S, CoflowMeta("dp", layer=1), stream="s")
    c = C.p2p(w, 0, 1, S, CoflowMeta("dp", layer=0), stream="s")
    r = Simulator(topo).run(w, FifoPolicy())
    end = dict(zip(r.coflow_nodes.tolist(), r.coflow_end.tolist(), strict=True))
    assert end[a] < end[b] < end[c]
    from flowlane.policy import PriorityByKeyPolicy

    r = Simulator(topo).run(w, PriorityByKeyPolicy(fields=("layer",)))
    end = dict(zip(r.coflow_nodes.tolist(), r.coflow_end.tolist(), strict=True))
    assert end[a] < end[c] < end[b]  # a was alone when it started; then layer 0 before layer 1


def test_explicit_multipath_splits_a_flow_over_two_paths() -> None:
    t = Topology()
    for d in ("a", "b"):
        t.add_device(d, "host")
    for m in ("m1", "m2"):
        t.add_device(m, "switch")
        t.add_link("a", m, B)
        t.add_link(m, "b", B)
    w = Workload(t.gpus)
    w.coflow(([0], [1], [S]), CoflowMeta("pp"), paths={0: [(("a", "m1", "b"), 0.5), (("a", "m2", "b"), 0.5)]})
    assert Simulator(t, SimConfig(routing="first")).run(w).makespan == pytest.approx(S / (2 * B))
    assert Simulator(t, SimConfig(routing="spray")).run(Workload(t.gpus)).makespan == 0.0
    w2 = Workload(t.gpus)
    w2.coflow(([0], [1], [S]), CoflowMeta("pp"))
    assert Simulator(t, SimConfig(routing="spray")).run(w2).makespan == pytest.approx(S / (2 * B))
    assert Simulator(t, SimConfig(routing="first")).run(w2).makespan == pytest.approx(S / B)
    with pytest.raises(SimSpecError, match="no link a->b"):
        w3 = Workload(t.gpus)
        w3.coflow(([0], [1], [S]), CoflowMeta("pp"), paths={0: [(("a", "b"), 1.0)]})
        Simulator(t).run(w3)


def test_same_seed_same_result_and_seed_changes_jittered_result() -> None:
    topo = leaf_spine(servers=4, gpus_per_server=2, servers_per_leaf=2)
    w = _random_workload(topo, 7)
    cfg = SimConfig(compute_jitter=0.2, seed=11)
    r1 = Simulator(topo, cfg).run(w, make_policy("priority"))
    r2 = Simulator(topo, cfg).run(w, make_policy("priority"))
    np.testing.assert_array_equal(r1.coflow_end, r2.coflow_end)
    np.testing.assert_array_equal(r1.link_bytes_moved, r2.link_bytes_moved)
    r3 = Simulator(topo, SimConfig(compute_jitter=0.2, seed=12)).run(w, make_policy("priority"))
    assert not np.array_equal(r1.coflow_end, r3.coflow_end)


def test_time_quantum_moves_events_by_less_than_the_quantum() -> None:
    topo = leaf_spine(servers=4, gpus_per_server=2, servers_per_leaf=2)
    w = _random_workload(topo, 5)
    exact = Simulator(topo).run(w)
    q = Simulator(topo, SimConfig(time_quantum=1e-6)).run(w)
    assert abs(q.makespan - exact.makespan) <= 1e-6 * len(w.nodes)


def test_leaf_spine_analytic_routes_equal_dijkstra() -> None:
    t = leaf_spine(servers=6, gpus_per_server=2, servers_per_leaf=2)
    g = t.gpus
    for a in g:
        for b in g:
            if a != b:
                assert t._router(t, a, b) == t._equal_cost_paths(a, b)
