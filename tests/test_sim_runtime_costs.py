"""flowlane.sim charging Hermod's runtime costs of a phased all-to-all (issue 30): planning (with the runtime's LRU
plan cache) and the host's per-phase issue time (SimConfig.plan_time, plan_hit_time, plan_cache_entries,
phase_issue_time)."""

from __future__ import annotations

import numpy as np
import pytest

from flowlane.policy import CoflowMeta
from flowlane.sim import PhasedAllToAll, SimConfig, SimSpecError, Simulator, Workload
from flowlane.sim import collectives as C
from flowlane.sim.engine import issue_ordinals
from flowlane.topology import gBps, star

B = gBps(1)
UNIT = 1e6
T = np.array([[0, 2, 1, 3], [6, 0, 2, 1], [5, 1, 0, 2], [3, 4, 1, 0]])


def _work(matrices: list[np.ndarray], mode: str = "phases_bottleneck") -> tuple[object, Workload]:
    """The all-to-alls one after another on one 4-rank star (each depends on the previous)."""
    topo = star([B] * 4, latency=0.0)
    w = Workload(topo.gpus)
    prev: list[int] = []
    for m in matrices:
        prev = [
            C.all_to_all(w, range(4), m, CoflowMeta("ep", op="dispatch"), prev, mode=mode, unit_bytes=UNIT)
        ]
    return topo, w


def _phased(w: Workload) -> list[PhasedAllToAll]:
    return [x for x in w.nodes if isinstance(x, PhasedAllToAll)]


def test_zero_costs_change_nothing_bit_for_bit() -> None:
    topo, w = _work([T, T.T])
    a = Simulator(topo).run(w)
    b = Simulator(topo, SimConfig(plan_cache_entries=16)).run(w)
    assert a.makespan == b.makespan and np.array_equal(a.coflow_end, b.coflow_end)
    assert (b.plan_hits, b.plan_misses) == (0, 0)  # nothing charged, nothing counted


def test_planning_delays_each_phased_all_to_all_by_the_plan_time() -> None:
    # two dependent all-to-alls, nothing else: each starts its phases plan_time later, so the makespan grows by 2x
    topo, w = _work([T, T.T])
    base = Simulator(topo).run(w)
    r = Simulator(topo, SimConfig(plan_time=3e-3)).run(w)
    assert r.makespan == pytest.approx(base.makespan + 2 * 3e-3, rel=1e-12)
    assert (r.plan_hits, r.plan_misses) == (0, 2)


def test_a_repeated_matrix_is_a_plan_cache_hit_within_the_cache_and_a_miss_beyond_it() -> None:
    other = T.T.copy()
    topo, w = _work([T, other, T])  # T again after one other plan
    base = Simulator(topo).run(w).makespan
    hit = Simulator(topo, SimConfig(plan_time=3e-3, plan_hit_time=1e-4, plan_cache_entries=2)).run(w)
    assert (hit.plan_hits, hit.plan_misses) == (1, 2)
    assert hit.makespan == pytest.approx(base + 2 * 3e-3 + 1e-4, rel=1e-12)
    lru1 = Simulator(topo, SimConfig(plan_time=3e-3, plan_hit_time=1e-4, plan_cache_entries=1)).run(w)
    assert (lru1.plan_hits, lru1.plan_misses) == (0, 3)  # the other plan evicted T's
    nocache = Simulator(topo, SimConfig(plan_time=3e-3, plan_hit_time=1e-4)).run(w)
    assert (nocache.plan_hits, nocache.plan_misses) == (0, 3)


def test_the_cache_key_is_the_matrix_and_the_mode() -> None:
    _, w1 = _work([T, T])
    a, b = _phased(w1)
    assert a.plan_key == b.plan_key and a.group == b.group == (0, 1, 2, 3)
    _, w2 = _work([T], mode="phases")
    assert _phased(w2)[0].plan_key != a.plan_key  # another planner, another plan
    _, w3 = _work([T + np.eye(4, dtype=int)])
    assert _phased(w3)[0].plan_key == a.plan_key  # the diagonal never enters the plan


def test_issue_slots_count_the_phases_each_rank_takes_part_in() -> None:
    w = Workload(["a", "b", "c", "d"])
    # phase 0: 0->1, 2->3; phase 1: 0->2; phase 2: 3->1
    w.phased_all_to_all(
        [0, 2, 0, 3], [1, 3, 2, 1], [1.0] * 4, [0, 0, 1, 2], [[], [], [0], [1, 0]], CoflowMeta("ep")
    )
    x = _phased(w)[0]
    # flow 2 (phase 1, ranks 0 and 2): both in their 2nd phase; flow 3 (phase 2): rank 3's 2nd, rank 1's 2nd
    assert issue_ordinals(x).tolist() == [1, 1, 2, 2]


def test_issue_time_paces_the_phases_when_it_exceeds_their_transfer() -> None:
    # 1 s per issued phase dwarfs every transfer (<= 6 MB at 1 GB/s): the all-to-all ends about when its last phase
    # is issued plus that phase's transfer, i.e. after (max issue slot) seconds
    topo, w = _work([T])
    x = _phased(w)[0]
    k = int(issue_ordinals(x).max())
    r = Simulator(topo, SimConfig(phase_issue_time=1.0)).run(w)
    last = x.nbytes[issue_ordinals(x) == k].max() / B
    assert k <= r.makespan <= k + last + 1e-9
    assert r.makespan >= Simulator(topo).run(w).makespan


def test_plain_all_to_alls_and_collectives_are_never_charged() -> None:
    topo, w = _work([T, T.T], mode="plain")
    C.all_reduce(w, range(4), 8e6, CoflowMeta("dp"))
    cfg = SimConfig(plan_time=1.0, plan_hit_time=1.0, plan_cache_entries=4, phase_issue_time=1.0)
    a, b = Simulator(topo).run(w), Simulator(topo, cfg).run(w)
    assert a.makespan == b.makespan and np.array_equal(a.coflow_end, b.coflow_end)


@pytest.mark.parametrize(
    "field,value,match",
    [
        ("plan_time", -1.0, r"SimConfig.plan_time must be a finite number >= 0 s, got -1.0"),
        ("plan_hit_time", float("inf"), r"SimConfig.plan_hit_time must be a finite number >= 0 s, got inf"),
        ("phase_issue_time", "1", r"SimConfig.phase_issue_time must be a finite number >= 0 s, got '1'"),
        ("plan_cache_entries", -2, r"SimConfig.plan_cache_entries must be an integer >= 0, got -2"),
    ],
)
def test_bad_cost_settings_are_refused_by_name(field: str, value: object, match: str) -> None:
    with pytest.raises(SimSpecError, match=match):
        SimConfig(**{field: value})  # type: ignore[arg-type]
