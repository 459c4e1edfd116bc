"""Replanning (2 gloo ranks): when the trigger fires, rank 0 re-runs the joint search out of band, the new plan is
committed with the two-phase protocol, and every rank switches at the same iteration; results stay equal to plain
torch.distributed collectives before and after the switch."""

from __future__ import annotations

import pytest

from flowlane import launch as L
from tests import syndicate_fw_workers as W

pytestmark = pytest.mark.once


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    store = tmp_path_factory.mktemp("syndicate-replan") / "store"
    return L.launch(W.replan_scenario, 2, args=(str(store),), timeout=180)


def test_the_trigger_reruns_the_search_and_every_rank_switches_at_one_iteration(runs: list[dict]) -> None:
    r0, r1 = runs
    assert r0["searches"] == 1 and r1["searches"] == 0  # the coordinator searched, once (then cooldown: none)
    assert r0["switched_at"] is not None and r0["switched_at"] == r1["switched_at"]
    assert r0["version"] == r1["version"] == 2
    for r in runs:
        switches = [(it, ev, d) for it, ev, d in (tuple(e) for e in r["events"]) if ev == "switch"]
        assert switches == [(r0["switched_at"], "switch", "v2")]
        assert [e[0] for e in r["events"] if e[1] == "replan"] == [1]
    assert r0["log_tail"] == r1["log_tail"]


def test_the_new_plan_is_the_searchs_answer(runs: list[dict]) -> None:
    r0 = runs[0]
    # E1's closed form: greedy + FIFO runs the all-to-all on F (11 units); the joint plan puts it on S (9.5)
    assert r0["start_a_path"] == "F" and r0["a_path"] == "S"
    assert r0["search_cost"] == pytest.approx(9.5) and r0["start_cost"] == pytest.approx(11.0)


def test_results_equal_plain_collectives_before_and_after_the_switch(runs: list[dict]) -> None:
    for r in runs:
        assert r["equal"] and all(r["equal"]), r["equal"]
