"""SYNDICATE's enforcer on Megatron-core's own data-parallel path (megatron_plugin.syndicate over
megatron_plugin.dp_collective): a tiny GPT, DP 2 on 2 gloo ranks, Megatron-core's DistributedDataParallel
(overlap_grad_reduce, several bucket groups), against the same run without flowlane. One launch: FIFO mode (the
baseline, recording the buckets' signatures), a plan given by the Megatron-LM flags that cuts every bucket into up
to 3 motifs and launches the last bucket first (an order across ops, which Megatron's overlapped reductions allow),
and a rank holding another plan."""

from __future__ import annotations

import argparse
import dataclasses
import tempfile

import pytest

pytestmark = pytest.mark.llm
pytest.importorskip("megatron.core")


def test_syndicate_on_megatron_core_ddp_is_bitwise_its_own_run_in_one_launch_order() -> None:
    from flowlane.launch import launch
    from tests.megatron_dp_workers import syndicate_runs

    with tempfile.TemporaryDirectory() as tmp:
        res = launch(syndicate_runs, 2, args=(tmp,), timeout=600)
    for rank, r in enumerate(res):
        # 2 ranks: a sum of two has one order, so motifs change nothing in the results
        assert r["fifo"]["bitwise"] and r["fifo_events"] == [], (rank, r["fifo"])
        p = r["plan"]
        assert p["bitwise"], (rank, p["maxdiff"])
        assert p["iterations"] == 3 and p["restored"], (rank, p)
        assert r["ops"] >= 2 and p["calls"] == p["bucket_groups"] * 3, (rank, r["ops"], p)
        # --syndicate-profile-out: the FIFO run is unchanged and its profile holds the steady iteration's ops
        assert r["profile_run"] and r["profile_ops"] == r["ops"], (rank, r["profile_run"], r["profile_ops"])
        # from iteration 1 on, Megatron starts every bucket group before it waits for any: the plan's order holds
        # (iteration 0 starts and waits for each bucket group in turn inside finish_grad_sync: FIFO fallback there)
        assert {e[0] for e in p["events"] if e[1] == "fallback"} <= {0}, (rank, p["events"])
        for it in (1, 2):
            launched = [[op, m] for i, _, op, m in p["log"] if i == it]
            assert launched == r["plan_order"], (rank, it, launched)
        assert "plan mismatch at install" in r["mismatch"] and "rank" in r["mismatch"], r["mismatch"]
    # one launch sequence on both ranks, every iteration
    assert res[0]["plan"]["log"] == res[1]["plan"]["log"]


def test_syndicate_flags_parse_and_bad_values_are_named(tmp_path) -> None:
    from flowlane.syndicate.cost import Option
    from flowlane.syndicate.plan import PlanError, PlanOp, SyndicatePlan
    from megatron_plugin.args import add_flowlane_args
    from megatron_plugin.syndicate import check_plan_for_megatron, config_from_args

    parser = add_flowlane_args(argparse.ArgumentParser())
    assert config_from_args(parser.parse_args([])) is None
    with pytest.raises(ValueError, match='plan is required with mode "plan"'):
        config_from_args(parser.parse_args(["--syndicate"]))
    with pytest.raises(ValueError, match="no plan file at"):
        config_from_args(parser.parse_args(["--syndicate", "--syndicate-plan", str(tmp_path / "none.json")]))
    cfg = config_from_args(parser.parse_args(["--syndicate", "--syndicate-mode", "fifo"]))
    assert cfg is not None and cfg.mode == "fifo"
    with pytest.raises(ValueError, match="check_every must be an integer >= 0"):
        config_from_args(
            parser.parse_args(["--syndicate", "--syndicate-mode", "fifo", "--syndicate-check-every", "-1"])
        )
    ops = (
        PlanOp("a", "all_reduce", 100, "float32", 2, Option("F", "ring", 2)),
        PlanOp("b", "all_reduce", 100, "float32", 2, Option("F", "ring", 1)),
    )
    across = SyndicatePlan(1, ops, ((1, 0), (0, 1), (0, 0)))
    check_plan_for_megatron(across, 2, overlap_grad_reduce=True)
    with pytest.raises(PlanError, match="overlap_grad_reduce=False"):
        check_plan_for_megatron(across, 2, overlap_grad_reduce=False)
    with pytest.raises(PlanError, match="spans 2 ranks; Megatron's data-parallel group has 4"):
        check_plan_for_megatron(across, 4, overlap_grad_reduce=True)
    tree = SyndicatePlan(1, (PlanOp("t", "all_reduce", 100, "float32", 2, Option("F", "tree")),), ((0, 0),))
    with pytest.raises(PlanError, match="algorithm 'tree' cannot be forced"):
        check_plan_for_megatron(tree, 2, overlap_grad_reduce=True)


def test_profile_out_is_refused_where_it_cannot_apply() -> None:
    from megatron_plugin.args import add_flowlane_args
    from megatron_plugin.syndicate import check_profile_out, config_from_args

    parser = add_flowlane_args(argparse.ArgumentParser())
    fifo = config_from_args(parser.parse_args(["--syndicate", "--syndicate-mode", "fifo"]))
    assert fifo is not None
    check_profile_out("out/p.json", fifo, 1)
    check_profile_out("out/p{pp_rank}.json", fifo, 2)
    with pytest.raises(ValueError, match=r"put \{pp_rank\} in the path"):
        check_profile_out("out/p.json", fifo, 2)
    with pytest.raises(ValueError, match="records nothing"):
        check_profile_out("out/p.json", dataclasses.replace(fifo, profile_iteration=-1), 1)
    with pytest.raises(ValueError, match="only FIFO mode records a profile"):
        check_profile_out("out/p.json", dataclasses.replace(fifo, mode="plan", plan="p.json"), 1)
    # without --syndicate: refused by the Megatron-LM hooks at the first model-provider call, before any model
    from megatron_plugin.megatron_lm import FlowlaneHooks

    built: list[int] = []
    hooks = FlowlaneHooks(
        lambda: built.append(1),
        lambda *a: None,
        get_args=lambda: parser.parse_args(["--syndicate-profile-out", "out/p.json"]),
    )
    with pytest.raises(ValueError, match="--syndicate-profile-out is set but --syndicate is not"):
        hooks.model_provider()
    assert built == []


def test_distributed_optimizer_plans_gathers_first_each_whole_before_the_next() -> None:
    from flowlane.syndicate.cost import Option
    from flowlane.syndicate.plan import PlanError, PlanOp, SyndicatePlan
    from megatron_plugin.args import add_flowlane_args
    from megatron_plugin.syndicate import SyndicateMegatronConfig, check_plan_for_megatron, config_from_args

    parser = add_flowlane_args(argparse.ArgumentParser())
    flags = ["--syndicate", "--syndicate-mode", "fifo"]
    assert config_from_args(parser.parse_args(flags)).param_gather == "plan"  # type: ignore[union-attr]
    cfg = config_from_args(parser.parse_args([*flags, "--syndicate-param-gather", "passthrough"]))
    assert cfg is not None and cfg.param_gather == "passthrough"
    with pytest.raises(ValueError, match="param_gather 'none' is not one of"):
        SyndicateMegatronConfig(mode="fifo", param_gather="none")  # type: ignore[arg-type]

    def op(name: str, kind: str, segments: int) -> PlanOp:
        return PlanOp(name, kind, 100, "float32", 2, Option("F", "ring", segments))

    g0, g1 = op("g0", "all_gather", 2), op("g1", "all_gather", 2)
    rs0, rs1 = op("rs0", "reduce_scatter", 2), op("rs1", "reduce_scatter", 1)
    # gathers in submission order (each last motif first), then the reduce-scatters interleaved, last op first
    ok = SyndicatePlan(1, (g0, g1, rs0, rs1), ((0, 1), (0, 0), (1, 1), (1, 0), (3, 0), (2, 1), (2, 0)))
    check_plan_for_megatron(ok, 2, True, distributed_optimizer=True)
    with pytest.raises(PlanError, match="launches op 1 \\('g1'\\) before the last motif of all-gather op 0"):
        check_plan_for_megatron(
            SyndicatePlan(1, (g0, g1), ((0, 0), (1, 0), (0, 1), (1, 1))), 2, True, distributed_optimizer=True
        )
    with pytest.raises(PlanError, match="launches op 2 \\('rs0'\\) before the last motif of all-gather op 1"):
        check_plan_for_megatron(
            SyndicatePlan(1, (g0, g1, rs0), ((0, 0), (0, 1), (1, 0), (2, 0), (2, 1), (1, 1))),
            2,
            True,
            distributed_optimizer=True,
        )
    with pytest.raises(PlanError, match="op 1 \\('g0'\\) is an all-gather after op 0 \\('rs0'"):
        check_plan_for_megatron(
            SyndicatePlan(1, (rs0, g0), ((0, 0), (0, 1), (1, 0), (1, 1))), 2, True, distributed_optimizer=True
        )
    rs_only = SyndicatePlan(1, (rs0, rs1), ((1, 0), (0, 0), (0, 1)))
    with pytest.raises(PlanError, match="has no 'all_gather' op.*--syndicate-param-gather passthrough"):
        check_plan_for_megatron(rs_only, 2, True, distributed_optimizer=True)
    check_plan_for_megatron(rs_only, 2, True, distributed_optimizer=True, param_gather="passthrough")
    with pytest.raises(PlanError, match="op 0 \\('g0'\\) is 'all_gather', but param_gather='passthrough'"):
        check_plan_for_megatron(ok, 2, True, distributed_optimizer=True, param_gather="passthrough")
    with pytest.raises(
        PlanError, match="is 'all_gather': Megatron submits only its gradient buckets' all-reduces"
    ):
        check_plan_for_megatron(ok, 2, True)  # no distributed optimizer: no parameter gathers
