"""SYNDICATE's enforcer on DeepSpeed ZeRO 0 and ZeRO 2 (2 gloo ranks, one spawn): DeepSpeed's own run and the same
run with a plan that segments each gradient all-reduce and launches its motifs last-first on a path clone give bitwise equal
losses and parameters, every rank launches one order (the plan's), and what cannot apply is refused at install."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.llm
pytest.importorskip("deepspeed")

from deepspeed_plugin.syndicate import (  # noqa: E402
    check_plan_for_deepspeed,
    install,
    parse_syndicate_section,
)
from flowlane.launch import launch  # noqa: E402
from flowlane.syndicate.cost import Option  # noqa: E402
from flowlane.syndicate.plan import PlanError, PlanOp, SyndicatePlan  # noqa: E402
from tests import syndicate_fw_workers as W  # noqa: E402


@pytest.fixture(scope="module")
def runs() -> list[dict]:
    return launch(W.deepspeed_with_and_without, 2, timeout=600, env={"DS_ACCELERATOR": "cpu"})


def test_deepspeed_with_the_enforcer_matches_its_own_run_bitwise(runs: list[dict]) -> None:
    for r in runs:
        assert r["moved"] > 1e-3  # the run trains: the comparison is not between untouched parameters
        for name in ("plan", "plan2"):  # ZeRO 0 and ZeRO 2
            assert r[name]["bitwise"] and r[name]["same_losses"], (name, r[name])
            assert r[name]["events"] == [], (name, r[name]["events"])  # no FIFO fallback, no mismatch


def test_every_rank_launches_the_plans_motif_order_each_iteration(runs: list[dict]) -> None:
    assert runs[0]["plan"]["log"] == runs[1]["plan"]["log"]
    order = [tuple(e) for e in runs[0]["plan_order"]]
    assert len(order) >= 3 and order != sorted(order)
    n = runs[0]["plan"]["iterations"]
    assert n == 2  # 4 micro-steps, 2 per optimizer step
    for it in range(n):
        assert [(i, j) for (i2, _, i, j) in runs[0]["plan"]["log"] if i2 == it] == order
    # what went through the enforcer is what DeepSpeed's own run submitted, each iteration
    sig = [s[1:] for s in runs[0]["plan"]["submitted"]]
    assert len(sig) == n * len({i for i, _ in order}) and all(s[0] == "all_reduce" for s in sig)
    # ZeRO 2: its buckets of gradient slices (and the norm's partial sums) each iteration, in the plan's order
    order2 = [tuple(e) for e in runs[0]["plan_order2"]]
    assert runs[0]["plan2"]["log"] == runs[1]["plan2"]["log"] and len(order2) >= 3
    for it in range(runs[0]["plan2"]["iterations"]):
        assert [(i, j) for (i2, _, i, j) in runs[0]["plan2"]["log"] if i2 == it] == order2


def test_fifo_mode_writes_the_profile_of_iteration_1_and_keeps_the_signatures_bounded(
    runs: list[dict],
) -> None:
    # 3 iterations in FIFO mode: the losses of the first two are DeepSpeed's own, the signatures are kept for
    # iterations 0 and 1 only (before: a row per all-reduce per step, for as long as the job ran), and the file holds
    # iteration 1's all-reduces, in DeepSpeed's order, each waited for before the iteration's end
    for r in runs:
        fifo, recorded = r["fifo"], [tuple(x) for x in r["recorded"]]
        assert fifo["same_losses"] and fifo["events"] == [] and fifo["iterations"] == 3, fifo
        assert [s[0] for s in fifo["submitted"]] == [0] * len(recorded) + [1] * len(recorded)
        prof = fifo["profile"]
        assert prof["format"] == "flowlane.syndicate.profile/1" and prof["iteration"] == 1, prof
        assert prof["ranks"] == [0, 1] and "commit" in prof["provenance"]
        assert [(o["kind"], o["numel"], o["dtype"]) for o in prof["ops"]] == [
            ("all_reduce", *x) for x in recorded
        ]
        for o in prof["ops"]:
            assert o["ranks"] == [0, 1]
            assert 0 <= o["submit_s"] <= o["done_s"] <= prof["iteration_s"], prof
        # profile_out: written by rank 0 alone, at the step that ended iteration 1, the same profile
        if r is runs[0]:
            auto = fifo["profile_out"]
            assert auto["iteration"] == 1 and auto["ops"] == prof["ops"], auto
        else:
            assert "profile_out" not in fifo
        assert "data-parallel rank 0: cannot make its folder" in r["refused"]["profile_out_bad"], r["refused"]
        # a write that fails later (a full disk) does not stop rank 0 alone: both ranks train the 3 iterations
        full = r["disk_full"]
        assert full["same_losses"] and full["iterations"] == 3 and full["profile_failed"] == (r is runs[0]), (
            full
        )
        # plan mode has no profile: refused, naming why
        assert (
            "no profile to write" in r["plan"]["profile"]
            and "only FIFO mode records a profile" in r["plan"]["profile"]
        )


def test_what_cannot_apply_is_refused_at_install(runs: list[dict]) -> None:
    for r in runs:
        assert "supports ZeRO stages 0-2" in r["refused"]["zero3"], r["refused"]


def test_the_section_is_checked_by_name() -> None:
    assert parse_syndicate_section({"flowlane": {}}) is None
    assert parse_syndicate_section({"flowlane": {"syndicate": {"enabled": False}}}) is None
    assert parse_syndicate_section({"flowlane": {"syndicate": {"mode": "fifo"}}}).mode == "fifo"
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['plans'\] in flowlane.syndicate"):
        parse_syndicate_section({"flowlane": {"syndicate": {"plans": "p.json"}}})
    with pytest.raises(ValueError, match='plan is required with mode "plan"'):
        parse_syndicate_section({"flowlane": {"syndicate": {}}})
    with pytest.raises(ValueError, match="mode 'lifo' is not one of"):
        parse_syndicate_section({"flowlane": {"syndicate": {"mode": "lifo"}}})
    plan = SyndicatePlan.fifo([PlanOp("b", "all_reduce", 64, "float32", 2, Option("F", "ring"))]).to_dict()
    for bad, match in (
        ({"plan": plan, "profile_out": "p.json"}, "only FIFO mode records a profile"),
        ({"mode": "fifo", "profile_iteration": -1, "profile_out": "p.json"}, "records nothing"),
        ({"mode": "fifo", "profile_out": ""}, "must be a file path"),
    ):
        with pytest.raises(ValueError, match=match):
            parse_syndicate_section({"flowlane": {"syndicate": bad}})
    # install checks the other sub-sections too, before it touches the engine
    with pytest.raises(ValueError, match=r"\['gate_timout_s'\]"):
        install(None, {"flowlane": {"hermod": {"gate_timout_s": 1}, "syndicate": {"mode": "fifo"}}})


def test_plans_deepspeeds_all_reduce_cannot_run_are_refused() -> None:
    ops = [PlanOp(f"b{i}", "all_reduce", 64, "float32", 2, Option("F", "ring", 2)) for i in range(2)]
    check_plan_for_deepspeed(SyndicatePlan(1, tuple(ops), ((0, 1), (0, 0), (1, 0), (1, 1))), 2)
    # DeepSpeed waits for each all-reduce before the next: ops cannot interleave
    with pytest.raises(PlanError, match="launches op 0 after op 1 has started"):
        check_plan_for_deepspeed(SyndicatePlan(1, tuple(ops), ((0, 0), (1, 0), (0, 1), (1, 1))), 2)
    with pytest.raises(PlanError, match="spans 2 ranks; DeepSpeed's data-parallel group has 4"):
        check_plan_for_deepspeed(SyndicatePlan.fifo(ops), 4)
    tree = [PlanOp("b", "all_reduce", 64, "float32", 2, Option("F", "tree"))]
    with pytest.raises(PlanError, match="algorithm 'tree' cannot be forced per call"):
        check_plan_for_deepspeed(SyndicatePlan.fifo(tree), 2)
    a2a = [PlanOp("x", "all_to_all", 64, "float32", 2, Option("F", "direct"))]
    with pytest.raises(PlanError, match="is 'all_to_all': DeepSpeed submits only"):
        check_plan_for_deepspeed(SyndicatePlan.fifo(a2a), 2)
