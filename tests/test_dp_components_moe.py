"""ALEPH and SYNDICATE on a MoE model's expert bucket groups (megatron_plugin.dp_collective with ``expert=True``): a
tiny GPT with 4 experts, EP 2 on 4 gloo ranks, so the experts' gradients reduce over two expert-data-parallel
groups ({0, 2}, {1, 3}) and the dense ones over DP 4; Megatron-core's own DDP, optimizer and finalize_model_grads,
against the same run without flowlane, in one launch; then SYNDICATE under Megatron's distributed optimizer, where each
lane's parameter all-gathers are plan ops too. A gather moves bytes; a reduce-scatter over DP 4 cut into motifs may
round differently from the whole one (gloo's summation order depends on an element's place in the buffer), so that
case is checked to rounding, the rest bitwise."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.llm
pytest.importorskip("megatron.core")

ITERATIONS = 3


def test_aleph_and_syndicate_carry_the_expert_bucket_groups(tmp_path) -> None:
    from flowlane.launch import launch
    from tests.megatron_dp_workers import moe_runs

    res = launch(moe_runs, 4, args=(str(tmp_path),), timeout=600)
    for rank, r in enumerate(res):
        for name in ("aleph", "plan"):
            x = r[name]
            # every dense and every expert bucket group went through the component each iteration, and came back
            assert x["expert_bucket_groups"] >= 1, (rank, name, x)
            assert x["expert_calls"] == x["expert_bucket_groups"] * ITERATIONS, (rank, name, x)
            assert x["calls"] == x["bucket_groups"] * ITERATIONS, (rank, name, x)
            assert x["restored"] and x["bitwise"], (rank, name, x)
        assert r["fifo"]["bitwise"], (rank, r["fifo"])
        # the expert enforcer holds its plan's order (last bucket first, last motif first), the dense one FIFO's
        p = r["plan"]
        assert [p["steady"], p["expert_steady"]] == r["orders"], (rank, p, r["orders"])
        assert len(r["orders"][1]) > p["expert_bucket_groups"], r["orders"]  # expert buckets were cut
        assert "give expert_bandwidth_gbps or expert_clusters" in r["aleph_no_expert_plan"], r
        assert "syndicate expert_plan is required" in r["syndicate_no_expert_plan"], r
        # the distributed optimizer (overlap_param_gather): FIFO records each lane's gathers then reduce-scatters (and
        # is bitwise Megatron's own run); a dense plan (DP 4) and an expert plan (each expert-data-parallel group)
        # cutting every parameter all-gather and every reduce-scatter block into up to 3 motifs match Megatron's own
        # run with the distributed optimizer to rounding, every gather through its lane's enforcer. Not bitwise: gloo
        # sums a reduce-scatter over 4 ranks in an order that depends on where an element sits in the buffer (ring),
        # so cutting a block into motifs may round differently (measured on an AMD EPYC host: 4 x 300k floats cut in
        # three, up to 2.4e-7 apart; the run above ends up to 7.5e-9 apart with equal losses). Over 2 ranks a sum has
        # one order: the NCCL check (tests/gpu/megatron_dp_nccl.py, DP 2) is bitwise.
        d = r["do_plan"]
        assert r["do_fifo"]["bitwise"], (rank, r["do_fifo"])
        assert d["maxdiff"] <= 1e-6, (
            rank,
            d["maxdiff"],
        )  # rounding only: a lost or doubled block is >= 1e-3 here
        assert d["restored"], (rank, d)
        for lane, kinds in zip(("", "expert_"), r["do_kinds"], strict=True):
            g = d[f"{lane}bucket_groups"]
            assert kinds == ["all_gather"] * g + ["reduce_scatter"] * g, (rank, lane, kinds)
            assert d[f"{lane}gathers"] == d[f"{lane}calls"] == g * ITERATIONS, (rank, lane, d)
        assert d["expert_bucket_groups"] >= 2 and d["bucket_groups"] >= 2, d
        # each enforcer's steady state is its plan's order (gathers first, in submission order, last motif first;
        # then the blocks, last bucket first), and iteration 0 falls back once, at its first reduce-scatter's wait
        assert [d["steady"], d["expert_steady"]] == r["do_orders"], (rank, d, r["do_orders"])
        for lane, order in zip(("", "expert_"), r["do_orders"], strict=True):
            assert len(order) > 2 * d[f"{lane}bucket_groups"], order  # gathers and blocks were cut
            assert [e[:2] for e in d[f"{lane}events"]] == [(0, "fallback")], (rank, lane, d)
    # one launch sequence per group: dense over all 4 ranks, the experts' within {0, 2} and {1, 3}
    assert all(r["do_plan"]["steady"] == res[0]["do_plan"]["steady"] for r in res)
    assert res[0]["do_plan"]["expert_steady"] == res[2]["do_plan"]["expert_steady"]
    assert res[1]["do_plan"]["expert_steady"] == res[3]["do_plan"]["expert_steady"]


@pytest.mark.slow  # 2 ranks x 3 Megatron trainings: ~1.5 min on a busy 2-core machine
def test_moe_at_expert_parallel_size_1_goes_through_the_dense_lane_with_the_flags() -> None:
    """megatron-core marks expert parameters ``allreduce=False`` (their own bucket groups, reduced over the
    expert-data-parallel group) only at EP > 1: at EP 1 the flags set up no expert lane and take no expert plan."""
    from flowlane.launch import launch
    from tests.megatron_dp_workers import moe_ep1_runs

    res = launch(moe_ep1_runs, 2, timeout=600)
    for rank, r in enumerate(res):
        for name in ("aleph", "syndicate"):
            x = r[name]
            assert x["expert_bucket_groups"] == 0 and x["expert_calls"] == 0, (rank, name, x)
            assert x["bucket_groups"] >= 2 and x["calls"] == x["bucket_groups"] * ITERATIONS, (rank, name, x)
            assert x["restored"] and x["bitwise"], (rank, name, x)
        msg = r["expert_flags"]
        assert "expert_clusters are set but the model has no expert bucket groups" in msg, msg
        assert "expert-model-parallel size 1" in msg, msg


def test_the_expert_lane_follows_the_expert_parallel_size_and_a_dense_stage_has_none(tmp_path) -> None:
    """The flags ask for an expert plan only at EP > 1; a chunk without expert bucket groups (a pipeline stage or
    virtual chunk of dense layers only, ``moe_layer_freq``) attaches to an expert lane, carrying nothing of it, and
    its expert plan may be empty; a chunk with them is refused without one."""
    import argparse
    from types import SimpleNamespace

    from flowlane.syndicate.plan import SyndicatePlan
    from megatron_plugin.args import add_flowlane_args
    from megatron_plugin.dp_collective import check_expert_setup, expert_parallel
    from megatron_plugin.syndicate import check_plan_for_megatron, config_from_args

    parser = add_flowlane_args(argparse.ArgumentParser())
    dense = tmp_path / "dense.json"
    dense.write_text(SyndicatePlan(1, (), ()).to_json())
    args = parser.parse_args(["--syndicate", "--syndicate-plan", str(dense)])
    args.num_experts, args.expert_model_parallel_size = 4, 1
    assert not expert_parallel(args) and config_from_args(args) is not None  # no expert plan at EP 1
    args.expert_model_parallel_size = 2
    assert expert_parallel(args)
    with pytest.raises(ValueError, match="expert_plan is required .* at expert-model-parallel size > 1"):
        config_from_args(args)
    args.num_experts = None
    assert not expert_parallel(args)
    stage = [SimpleNamespace(expert_parallel_bucket_groups=[])]  # dense layers only
    check_expert_setup(stage, True, "test")
    check_expert_setup(stage, False, "test")
    moe = [SimpleNamespace(expert_parallel_bucket_groups=[object()])]
    check_expert_setup(moe, True, "test")
    with pytest.raises(
        ValueError, match="test: the chunks have expert bucket groups .* without the expert-data"
    ):
        check_expert_setup(moe, False, "test")
    # a dense stage's expert plan under the distributed optimizer: no ops, so no gathers either
    check_plan_for_megatron(SyndicatePlan(1, (), ()), 2, True, distributed_optimizer=True)
