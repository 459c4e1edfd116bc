"""The SYNDICATE enforcer on gloo (3 ranks, one spawn for every scenario): one launch order on every rank under
jitter, results equal to plain torch.distributed collectives, plan mismatches named, FIFO fallback, two-phase plan
switch, motifs shaped inside Hermod's CommScheduler, and replanning: when the trigger fires, rank 0 re-runs the joint
search out of band, the new plan is committed with the two-phase protocol and every rank switches at one iteration
(ranks 0 and 1; the E1 toy is a 2-rank instance)."""

from __future__ import annotations

import pytest

from flowlane import launch as L
from tests import syndicate_workers as W

pytestmark = pytest.mark.once


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    store = tmp_path_factory.mktemp("syndicate") / "store"
    return L.launch(W.enforcer_scenarios, 3, args=(str(store),), timeout=120)


def test_every_rank_launches_the_plans_order_under_jitter(runs: list[dict]) -> None:
    logs = [r["jitter"]["log"] for r in runs]
    assert logs[0] == logs[1] == logs[2]
    order = [tuple(e) for e in runs[0]["jitter"]["order"]]
    for it in (0, 1):
        assert [(i, j) for (i2, _, i, j) in logs[0] if i2 == it] == order
    assert order != sorted(order)  # the plan really reorders motifs across ops
    assert all(r["jitter"]["events"] == [] for r in runs)
    for r in runs:  # the feedback the optimizer pulls: one (iteration, held, wall) row per iteration
        assert [row[0] for row in r["jitter"]["stats"]] == [0, 1]
        assert all(0 <= held <= r["jitter"]["held_s"] and wall > 0 for _, held, wall in r["jitter"]["stats"])


def test_motif_results_equal_plain_collectives(runs: list[dict]) -> None:
    for r in runs:
        for c in r["jitter"]["checks"]:
            assert c == {"a2a_bitwise": True, "ag_bitwise": True, "ar64_close": True, "ar32_close": True}


def test_reduce_scatter_motifs_equal_the_plain_collective_in_the_plans_order(runs: list[dict]) -> None:
    for r in runs:
        x = r["reduce_scatter"]
        assert x["bitwise"] and x["events"] == [], x
        assert x["log"] == [[1, 1], [0, 2], [1, 0], [0, 0], [0, 1]], x["log"]
        assert "input has 16 elements, needs 3 x 5" in x["bad"], x["bad"]


def test_a_rank_with_another_plan_is_named_at_install(runs: list[dict]) -> None:
    for r in runs:
        msg = r["install_mismatch"]
        assert msg is not None and "ranks [1, 2] hold" in msg and "ranks [0] hold" in msg


def test_a_silently_different_launch_order_is_named_at_the_iteration_boundary(runs: list[dict]) -> None:
    for r in runs:
        msg = r["step_mismatch"]
        assert msg is not None and "iteration 0" in msg and "ranks [0] hold" in msg


def test_unexpected_waits_and_shapes_fall_back_to_fifo_on_every_rank_alike(runs: list[dict]) -> None:
    evs = [[(it, ev) for it, ev, _ in r["fallback"]["events"]] for r in runs]
    assert evs[0] == evs[1] == evs[2] == [(0, "fallback"), (1, "fallback")]
    assert runs[0]["fallback"]["log"] == runs[1]["fallback"]["log"] == runs[2]["fallback"]["log"]
    for r in runs:
        for c in r["fallback"]["checks"]:
            assert all(c.values()), c


def test_a_two_phase_plan_switch_lands_on_the_same_iteration_everywhere(runs: list[dict]) -> None:
    for r in runs:
        assert r["switch"]["events"] == [[3, "switch", "v2"]] or r["switch"]["events"] == [
            (3, "switch", "v2")
        ]
        assert r["switch"]["version"] == 2


def test_hermod_orders_the_coflow_and_syndicate_shapes_it(runs: list[dict]) -> None:
    for r in runs:
        assert r["hermod_a2a_bitwise"] is True
        assert r["hermod_chunks"] == 2 * 3  # 2 segments x 3-way spline


def test_the_trigger_reruns_the_search_and_every_rank_switches_at_one_iteration(runs: list[dict]) -> None:
    r0, r1 = (r["replan"] for r in runs[:2])
    assert r0["searches"] == 1 and r1["searches"] == 0  # only the coordinator searches, once
    assert r0["switched_at"] is not None and r0["switched_at"] == r1["switched_at"]
    assert r0["version"] == r1["version"] == 2
    for r in (r0, r1):
        switches = [(it, ev, d) for it, ev, d in (tuple(e) for e in r["events"]) if ev == "switch"]
        assert switches == [(r0["switched_at"], "switch", "v2")]
        assert [e[0] for e in r["events"] if e[1] == "replan"] == [1]
    assert r0["log_tail"] == r1["log_tail"]


def test_the_replanned_plan_is_the_searchs_answer(runs: list[dict]) -> None:
    r0 = runs[0]["replan"]
    # E1's closed form: greedy + FIFO runs the all-to-all on F (11 units); the joint plan puts it on S (9.5)
    assert r0["start_a_path"] == "F" and r0["a_path"] == "S"
    assert r0["search_cost"] == pytest.approx(9.5) and r0["start_cost"] == pytest.approx(11.0)


def test_replanned_results_equal_plain_collectives_before_and_after_the_switch(runs: list[dict]) -> None:
    for r in (x["replan"] for x in runs[:2]):
        assert r["equal"] and all(r["equal"]), r["equal"]


def test_a_long_run_keeps_the_launch_log_stats_and_the_store_bounded(runs: list[dict]) -> None:
    # 40 iterations of 2 motifs: the log keeps its last 8 launches, the stats their last 5 iterations' rows, and the
    # store as many keys after 40 steps as after 10 (before: every launch and every row kept, world fingerprint keys
    # more per step)
    for r in (x["long_run"] for x in runs):
        assert r["log"] == [(it, pos, 0, pos) for it in range(36, 40) for pos in (0, 1)], r["log"]
        assert [row[0] for row in r["rows"]] == list(range(40))
        assert r["stats"] == r["rows"][-5:], r["stats"]
        # the totals still cover every iteration, not only the rows kept
        assert r["iteration"] == 40
        assert r["held_s"] == pytest.approx(sum(held for _, held, _ in r["rows"]), rel=1e-9, abs=1e-12)
        assert r["keys"][0] == r["keys"][1], r["keys"]
        assert not r["fp0"] and r["fp39"]


def test_the_log_and_stats_bounds_must_be_integers_at_least_zero() -> None:
    from flowlane.syndicate.enforcer import EnforcerConfig

    for key in ("log_entries", "stats_entries"):
        with pytest.raises(ValueError, match=f"EnforcerConfig.{key} must be an integer >= 0, got -1"):
            EnforcerConfig(**{key: -1})


def test_fifo_mode_profiles_one_iteration_without_changing_what_runs(runs: list[dict]) -> None:
    # the ops of iteration 1 in submission order, their signatures as the plan keys them (all-gather: the input
    # block), on the group of ranks 0-2; before iteration 1 ends there is no profile, after it the same one stays
    world = len(runs)
    for r in (x["profile"] for x in runs):
        assert r["bitwise"] and r["same_log"], r
        assert r["off"] == [None, None, None]  # profile_iteration=-1: none
        first, prof, later = r["seen"]
        assert first is None and prof == later
        assert prof["format"] == "flowlane.syndicate.profile/1" and prof["iteration"] == 1, prof
        assert prof["ranks"] == list(range(world))
        sigs = [(o["kind"], o["numel"], o["dtype"], o["ranks"]) for o in prof["ops"]]
        assert sigs == [(op.kind, op.numel, op.dtype, list(range(world))) for op in W.plan_ops(world)], sigs
        for o in prof["ops"]:  # every op was waited for before step(): done_s is known
            assert 0 <= o["submit_s"] <= o["done_s"] <= prof["iteration_s"], prof
        assert [o["submit_s"] for o in prof["ops"]] == sorted(o["submit_s"] for o in prof["ops"])


def test_the_profiled_iteration_must_be_an_integer_at_least_minus_one() -> None:
    from flowlane.syndicate.enforcer import EnforcerConfig

    for bad in (-2, 1.5, True):
        with pytest.raises(ValueError, match="profile_iteration must be an integer >= -1"):
            EnforcerConfig("fifo", profile_iteration=bad)  # type: ignore[arg-type]
    assert EnforcerConfig("fifo").profiled_iteration == 1
    assert EnforcerConfig("fifo", profile_iteration=None).profiled_iteration is None
    assert EnforcerConfig("plan").profiled_iteration is None  # a plan-mode iteration is not the FIFO baseline
