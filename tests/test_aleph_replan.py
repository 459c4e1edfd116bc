"""E10's claims on the Replanner itself (digest §4.4 row E10, §5.1 #13), on the rates of
benchmarks/aleph_replan.py (Mbit/s, b = 75): no torch, no processes; the measured run is results/aleph/e10_replan.json.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from flowlane.aleph import AlephConfig, Replanner, capacities

START = [368.0, 368.0, 100.0, 100.0, 99.0, 100.0]  # 400/400/100x4 as the start-up probe read them
CFG = AlephConfig(b_gbps=75.0, replan_every=4, top="ps")


def _bench():
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "aleph_replan.py"
    spec = importlib.util.spec_from_file_location("aleph_replan_bench", path)
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_a_move_within_a_capacity_class_updates_the_figures_but_keeps_the_plan() -> None:
    rp = Replanner(START, CFG)
    plan = rp.plan
    assert capacities(START, 75.0) == [3, 3, 0, 0, 0, 0] and plan.num_flows == 2
    d = rp.observe([392.0, 371.0, 99.0, 135.0, 131.0, 100.0])  # two slow links +35 %: g stays 0
    assert not d.changed and "still feasible" in d.reason
    assert rp.bandwidth[3:5] == [135.0, 131.0] and rp.plan == plan


def test_the_busiest_aggregator_turning_slow_is_a_class_change_and_replans() -> None:
    rp = Replanner(START, CFG)
    assert 1 in rp.plan.heads and len(rp.plan.cluster_of(1).members) > 1
    d = rp.observe([380.0, 98.0, 385.0, 135.0, 131.0, 100.0])
    assert d.changed and "infeasible" in d.reason
    assert d.plan.violations(capacities(rp.bandwidth, 75.0)) == []
    assert set(d.plan.heads) == {0, 2} and d.plan.num_flows == 2


def test_a_full_aggregator_replans_when_its_capacity_drops_inside_its_class() -> None:
    """The digest expects plan changes only when classes (powers of two) change; feasibility is about g itself,
    so an aggregator filled to g = 4 must give up a member at g = 3, though both round to class 4."""
    rp = Replanner([5.0, 1.0, 1.0, 1.0, 1.0], AlephConfig(b_gbps=1.0))
    assert rp.plan.num_flows == 1
    d = rp.observe([3.9, 1.0, 1.0, 1.0, 1.0])  # g 4 -> 2: class 4 -> 2
    assert d.changed
    rp = Replanner([5.0, 1.0, 1.0, 1.0, 1.0], AlephConfig(b_gbps=1.0, hysteresis=0.1))
    d = rp.observe([4.4, 1.0, 1.0, 1.0, 1.0])  # g 4 -> 3, both class 4
    assert d.changed and "infeasible" in d.reason and d.plan.num_flows == 2


def test_the_benchmarks_change_schedule_is_parsed_strictly() -> None:
    b = _bench()
    assert b.parse_changes("10:3=135,4=135;21:1=100,2=400", 6) == {
        10: {3: 135.0, 4: 135.0},
        21: {1: 100.0, 2: 400.0},
    }
    assert [b.rounded(g) for g in (0, 1, 2, 3, 4, 5, 8)] == [0, 1, 2, 4, 4, 8, 8]
    for bad in ("10:6=100", "0:1=100", "10:1=0", "10-1=100"):
        with pytest.raises(SystemExit, match="--changes piece"):
            b.parse_changes(bad, 6)


def test_a_single_slow_probe_does_not_replan_but_a_confirmed_change_does() -> None:
    """confirm_figures (the DDP hook's default probe): e10_replan_root.json saw one probe read two unchanged 400
    Mbit/s links as 229, and the Replanner swapped in a worse plan; a second reading filters such a dip."""
    from flowlane.aleph.replan import confirm_figures

    def probe(*readings: list[float]):
        calls: list[int] = []

        def sample() -> list[float]:
            calls.append(1)
            return readings[len(calls) - 1]

        return sample, calls

    rp = Replanner(START, CFG)
    steady, calls = probe([371.0, 380.0, 99.0, 100.0, 100.0, 98.0])
    assert confirm_figures(steady, rp) == [371.0, 380.0, 99.0, 100.0, 100.0, 98.0] and len(calls) == 1
    dip, calls = probe([229.0, 229.0, 97.0, 100.0, 100.0, 100.0], [366.0, 366.0, 100.0, 99.0, 98.0, 100.0])
    fig = confirm_figures(dip, rp)
    assert len(calls) == 2 and fig[:2] == [366.0, 366.0]
    assert not rp.observe(fig).changed and rp.plan.num_flows == 2
    real, calls = probe([380.0, 98.0, 385.0, 100.0, 100.0, 100.0], [371.0, 101.0, 379.0, 99.0, 100.0, 100.0])
    fig = confirm_figures(real, rp)
    assert len(calls) == 2 and fig[1] == 101.0
    assert rp.observe(fig).changed
    one, calls = probe([229.0, 229.0, 97.0, 100.0, 100.0, 100.0])
    assert confirm_figures(one, rp, samples=1)[0] == 229.0 and len(calls) == 1
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match="samples="):
            confirm_figures(one, rp, samples=bad)


@pytest.mark.parametrize("top", ["ps", "allreduce"])
@pytest.mark.parametrize(
    "run", ["e10_replan", "e10_replan_1probe", "e10_replan_root", "e10_replan_root_1probe"]
)
def test_the_recorded_e10_decisions_replay_identically(run: str, top: str) -> None:
    """Every decision, plan and PS head of the measured E10 runs, replayed from their figures in use. With top="ps"
    the fresh plan's rate is lowered by its PS head's flows; Eq. 1 must still be checked at the paper's b: at
    root_1probe's iteration 16 aggregator 1 holds 3 members at capacity 1, which passed at the lowered rate (57.17
    Mbit/s, capacity 3) and kept an overloaded plan whose rate was reported as b = 90."""
    import json

    from flowlane.aleph.model import ps_head

    rec = json.loads((Path(__file__).resolve().parents[1] / "results" / "aleph" / f"{run}.json").read_text())
    cfg, replan = rec["config"], rec["replan"]
    rp = Replanner(
        replan["startup"]["probed_mbit"],
        AlephConfig(b_gbps=cfg["b_mbit"], replan_every=cfg["replan_every"], top=top),  # type: ignore[arg-type]
    )
    assert [list(c.members) for c in rp.plan.clusters] == replan["startup"]["plan"]
    assert ps_head(rp.plan, rp.bandwidth) == replan["startup"]["root"]
    for p in replan["points"]:
        d = rp.observe(p["in_use_mbit"])
        assert (p["iteration"], d.changed) == (p["iteration"], p["plan_changed"]), d.reason
        assert [list(c.members) for c in d.plan.clusters] == p["plan"]
        if d.changed:
            assert ps_head(d.plan, rp.bandwidth) == p["root"]
        if run == "e10_replan_root_1probe" and p["iteration"] == 16:
            assert "aggregator 1 has 3 members > capacity 1" in d.reason
            # the fresh plan's PS head 0 carries 1 member and 3 other heads' flows: 228.7 / 4
            assert rp.rate == (pytest.approx(228.7 / 4, rel=1e-3) if top == "ps" else 90.0)
