"""flowlane.sim engine: closed forms, byte conservation, priority, determinism, routing."""

from __future__ import annotations

import numpy as np
import pytest

from flowlane.policies import make_policy
from flowlane.policy import CoflowMeta, CtypeFirstPolicy, FifoPolicy
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
        prev.append(
            w.coflow((src, dst, rng.random(k) * 1e8 + 1), CoflowMeta(ct, microbatch=i % 3, layer=i % 5), [c])
        )
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


def _two_switches() -> Topology:
    t = Topology()
    for d in ("a", "b"):
        t.add_device(d, "host")
    for m in ("m1", "m2"):
        t.add_device(m, "switch")
        t.add_link("a", m, B)
        t.add_link(m, "b", B)
    return t


def test_explicit_paths_stay_with_their_flow_when_a_zero_byte_flow_is_dropped() -> None:
    t = _two_switches()
    w = Workload(t.gpus)
    # flow 0 (0 bytes) is dropped; the path given for flow 1 must stay with it, not move to the 3x larger flow 2
    c = w.coflow(([0, 0, 0], [1, 1, 1], [0.0, S, 3 * S]), "dp", paths={1: [(("a", "m2", "b"), 1.0)]})
    assert w.nodes[c].paths is not None and set(w.nodes[c].paths) == {0}
    r = Simulator(t, SimConfig(routing="first")).run(w)
    moved = dict(zip(r.link_names, r.link_bytes, strict=True))
    assert moved["a->m2"] == pytest.approx(S) and moved["a->m1"] == pytest.approx(3 * S)
    # a path for a dropped flow goes with it; one for a flow that does not exist is refused
    c = w.coflow(([0, 0], [1, 1], [0.0, S]), "dp", paths={0: [(("a", "m2", "b"), 1.0)]})
    assert not w.nodes[c].paths
    with pytest.raises(SimSpecError, match="paths refers to flow 5, which does not exist"):
        w.coflow(([0], [1], [S]), "dp", paths={5: [(("a", "m2", "b"), 1.0)]})


@pytest.mark.timeout(60)  # before the check, a NaN or inf fraction spun run() forever
@pytest.mark.parametrize("fracs", [(float("nan"), 1.0), (float("inf"), 1.0), (2.0, -1.0)])
def test_path_fractions_must_be_finite_and_non_negative(fracs: tuple[float, float]) -> None:
    t = _two_switches()
    w = Workload(t.gpus)
    w.coflow(([0], [1], [S]), "dp", paths={0: [(("a", "m1", "b"), fracs[0]), (("a", "m2", "b"), fracs[1])]})
    with pytest.raises(SimSpecError, match=r"flow 0 path fraction must be a finite number >= 0, got"):
        Simulator(t).run(w)


@pytest.mark.timeout(60)
def test_a_nan_time_fails_instead_of_spinning() -> None:
    from flowlane.sim import Coflow

    topo = _star(2)
    w = Workload(topo.gpus)
    # bypasses Workload.coflow's checks, as a builder of its own could: NaN bytes make every finish time NaN
    w.nodes.append(Coflow(np.array([0]), np.array([1]), np.array([np.nan]), CoflowMeta("dp"), "nan"))
    w.deps.append(())
    with pytest.raises(SimSpecError, match="simulation time became NaN"):
        Simulator(topo).run(w)


def test_bytes_carried_equal_bytes_offered_with_a_time_quantum() -> None:
    # two flows on their own links end 0.2 s apart, inside one 0.5 s batching window: the first carries its 1 GB, not
    # rate x the window's 1.2 s
    topo = _star(4)
    w = Workload(topo.gpus)
    w.coflow(([0], [1], [1e9]), "dp")
    w.coflow(([2], [3], [1.2e9]), "dp")
    r = Simulator(topo, SimConfig(time_quantum=0.5)).run(w)
    np.testing.assert_allclose(r.link_bytes_moved, r.link_bytes, rtol=1e-9, atol=1e3)
    topo = leaf_spine(servers=4, gpus_per_server=2, servers_per_leaf=2)
    w = _random_workload(topo, 1)
    r = Simulator(topo, SimConfig(time_quantum=1e-2)).run(w, make_policy("priority"))
    np.testing.assert_allclose(r.link_bytes_moved, r.link_bytes, rtol=1e-6, atol=1e3)
    assert r.link_utilisation.max() <= 1 + 1e-9


def test_an_executor_runs_its_queued_tasks_in_program_order_not_ready_order() -> None:
    topo = _star(2)
    w = Workload(topo.gpus)
    w.compute("x", 1.0, name="busy")
    late = w.compute("y", 0.7)
    early = w.compute("z", 0.5)
    c = w.compute("x", 1.0, [late])  # ready at 0.7, but added first
    d = w.compute("x", 1.0, [early])  # ready at 0.5
    r = Simulator(topo).run(w)
    start = dict(zip(r.compute_nodes.tolist(), r.compute_start.tolist(), strict=True))
    assert (start[c], start[d]) == (1.0, 2.0)


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


# -- the per-class incast count (IncastModel.count="class": a switch queue per priority class) ----------------------
def _two_class_incast(high: int, low: int, count: str, sender_bw: float = B) -> np.ndarray:
    """``high`` class-0 and ``low`` class-1 flows from distinct senders into one receiver of a star (alpha 0.25);
    the senders' links have ``sender_bw``. Returns the rates (high flows first)."""
    topo = star([B] + [sender_bw] * (high + low), latency=0.0)
    sim = Simulator(topo, SimConfig(incast=IncastModel(threshold=1, alpha=0.25, count=count)))
    routes = [
        [sim.link_index[(lk.src, lk.dst)] for lk in topo.route(topo.gpus[s], topo.gpus[0]).links]
        for s in range(1, high + low + 1)
    ]
    hops = np.array(routes, np.int64)
    cls = np.array([0] * high + [1] * low)
    return allocate(hops, cls, sim.capacity, "strict", 0.5, sim.cfg.incast, sim.incast_links)


def test_class_count_lets_a_flow_alone_in_its_class_keep_the_whole_port() -> None:
    # port: three flows on the receiver's port -> capacity / (1 + 2 alpha), all of it to the high class
    port = _two_class_incast(1, 2, "port")
    assert port == pytest.approx([B / 1.5, 0, 0], rel=1e-12)
    # class: the high flow is alone in its queue (no penalty); the low class finds the wire full
    cls = _two_class_incast(1, 2, "class")
    assert cls == pytest.approx([B, 0, 0], rel=1e-12)
    # two high flows share their queue's penalty: (1 + alpha) each, B / 2.5 each
    assert _two_class_incast(2, 1, "class") == pytest.approx([B / 2.5, B / 2.5, 0], rel=1e-12)


def test_class_count_charges_later_classes_their_own_penalty_on_the_wire_left() -> None:
    # the high flow is held to B / 2 by its sender, so B / 2 of the receiver's wire is left; the two low flows
    # share their queue (fan-in 2: cost 1.25 per delivered byte) -> (B / 2) / 1.25 / 2 each
    r = _two_class_incast(1, 2, "class", sender_bw=B / 2)
    assert r == pytest.approx([B / 2, B / 5, B / 5], rel=1e-12)
    # the port count charges everyone fan-in 3: capacity B / 1.5, of which the low flows get what the high left
    r = _two_class_incast(1, 2, "port", sender_bw=B / 2)
    assert r == pytest.approx([B / 2, (B / 1.5 - B / 2) / 2, (B / 1.5 - B / 2) / 2], rel=1e-12)


def test_class_count_with_one_class_is_the_port_count_and_c_equals_numpy(monkeypatch) -> None:  # noqa: ANN001
    rng = np.random.default_rng(7)
    nl = 16
    cap = rng.uniform(1e9, 3e9, nl)
    hops = rng.integers(0, nl + 1, (60, 3))
    links = (rng.random(nl) < 0.6).astype(np.int64)
    grp = np.where(rng.random(60) < 0.3, rng.integers(0, 4, 60), -1)  # matched coflows count once per port
    for cls in (np.zeros(60, np.int64), rng.integers(0, 4, 60)):
        for sharing in ("strict", "weighted"):
            args = (hops, cls, cap, sharing, 0.5, IncastModel(alpha=0.3, count="class"), links, grp)
            c = allocate(*args)
            monkeypatch.setenv("FLOWLANE_SIM_NO_C", "1")
            ref = allocate(*args)
            monkeypatch.delenv("FLOWLANE_SIM_NO_C")
            assert np.array_equal(c, ref), (
                sharing,
                cls[:5],
            )  # bit for bit: the same operations in the same order
            if not cls.any():
                port = allocate(hops, cls, cap, sharing, 0.5, IncastModel(alpha=0.3), links, grp)
                assert c == pytest.approx(port, rel=1e-12)
    with pytest.raises(ValueError, match=r"IncastModel.count 'queue' is not one of \('port', 'class'\)"):
        IncastModel(count="queue")


def test_write_json_leaves_the_old_file_whole_when_the_new_one_cannot_be_written(tmp_path) -> None:  # noqa: ANN001
    from flowlane.sim.output import write_json

    p = write_json(tmp_path / "r.json", {"speedup": 1.5})
    with pytest.raises(TypeError):
        write_json(p, {"speedup": object()})  # not serialisable: fails before anything replaces the old file
    assert p.read_text() == '{\n "speedup": 1.5\n}'
    assert [f.name for f in tmp_path.iterdir()] == ["r.json"]  # and no temporary file left behind


def test_the_batching_window_survives_a_finish_time_that_rounds_inside_it():
    """Found by the Qwen-MoE-24L 256-GPU point with measured costs (2026-11-27): the earliest flow finish ``t + x``
    was within the window ``win`` while ``x <= win - t`` was not, the selection came out empty and ``.max()``
    raised. The window's latest finish is then the earliest one."""
    from flowlane.sim.engine import _last_finish

    t, x, th, q = 8.599796663725433, 0.0007579546449858997, 8.600544618370419, 1e-05
    win, tf = th + q, t + x
    assert tf <= win and not x <= win - t  # the rounding case itself
    assert _last_finish(t, np.array([x, 2 * x]), win, tf) == tf
    # the ordinary case: the latest inside
    assert _last_finish(1.0, np.array([0.5, 0.25, 3.0]), 1.6, 1.25) == 1.5
