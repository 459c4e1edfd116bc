"""flowlane.sim routes a phased all-to-all's flows once when it starts (``_EventLoop.route_phases_once``, a speed-up
for the Qwen-MoE-24L 1,024-GPU point, issue 30) instead of once per started batch of flows: the results must be
bit for bit those of routing per start."""

from __future__ import annotations

import numpy as np
import pytest

from flowlane.policies import make_policy
from flowlane.policy import CoflowMeta
from flowlane.sim import IncastModel, SimConfig, Simulator, Workload, engine
from flowlane.sim import collectives as C
from flowlane.sim.workloads import build_workload, zipf_token_matrix
from flowlane.topology import leaf_spine

FIELDS = (
    "makespan",
    "iteration_ends",
    "coflow_ready",
    "coflow_start",
    "coflow_end",
    "compute_start",
    "compute_end",
    "link_bytes",
    "link_bytes_moved",
    "num_flows",
    "events",
    "rate_updates",
    "plan_hits",
    "plan_misses",
)


def _run(monkeypatch: pytest.MonkeyPatch, once: bool, cfg: SimConfig, w, topo) -> tuple[object, int]:
    monkeypatch.setattr(engine._EventLoop, "route_phases_once", once)
    calls = 0
    route = engine._EventLoop.route

    def counted(self, *a, **k):
        nonlocal calls
        calls += 1
        return route(self, *a, **k)

    monkeypatch.setattr(engine._EventLoop, "route", counted)
    r = Simulator(topo, cfg).run(w, make_policy("hermod"))
    monkeypatch.setattr(engine._EventLoop, "route", route)
    return r, calls


COSTS = dict(plan_time=2e-3, plan_hit_time=1e-4, plan_cache_entries=4, phase_issue_time=1.2e-4)


def _same(fast, ref) -> None:
    for f in FIELDS:
        a, b = getattr(fast, f), getattr(ref, f)
        assert np.array_equal(np.asarray(a), np.asarray(b)), f


@pytest.mark.parametrize("charged", [False, True])
def test_ecmp_routes_of_phase_flows_are_the_per_start_ones(
    monkeypatch: pytest.MonkeyPatch, charged: bool
) -> None:
    # 8 ranks on 4 servers under 2 leaves and 2 spines: cross-leaf phase flows hash onto one of 2 equal-cost routes
    topo = leaf_spine(servers=4, gpus_per_server=4, servers_per_leaf=2)
    g = topo.gpus
    assert len(topo.routes(g[0], g[8])) == 2
    w = Workload(g)
    ranks = [0, 1, 4, 5, 8, 9, 12, 13]
    prev = [w.compute(g[0], 1e-4)]
    for k in range(3):
        t = zipf_token_matrix(np.random.default_rng(k), 8, 32, 4096, 2, 0.5)
        prev = [
            C.all_to_all(
                w, ranks, t, CoflowMeta("ep", op="dispatch"), prev, mode="phases_bottleneck", unit_bytes=4096
            )
        ]
    cfg = SimConfig(incast=IncastModel(alpha=0.13), time_quantum=1e-6, **(COSTS if charged else {}))
    fast, n_fast = _run(monkeypatch, True, cfg, w, topo)
    ref, n_ref = _run(monkeypatch, False, cfg, w, topo)
    assert n_fast == 3 < n_ref
    _same(fast, ref)


def test_a_moe_iteration_is_bitwise_the_same_with_phase_flows_routed_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # a whole MoE iteration (compute, PP, DP, bottleneck-phased EP all-to-alls) under ECMP, incast and a quantum;
    # with the runtime's planning and per-phase issue costs, which defer phase flows through the heap
    topo, w = build_workload(
        "qwen-moe-12l", 32, 100.0, num_microbatches=2, iterations=1, ep_a2a="phases_bottleneck"
    )
    cfg = SimConfig(incast=IncastModel(alpha=0.13), time_quantum=1e-5, **COSTS)
    fast, n_fast = _run(monkeypatch, True, cfg, w, topo)
    ref, n_ref = _run(monkeypatch, False, cfg, w, topo)
    assert n_fast < n_ref  # the fast path did route once per all-to-all, not per start
    assert ref.num_flows > 0 and ref.plan_misses > 0
    _same(fast, ref)
