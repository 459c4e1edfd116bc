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
