"""ALEPH and SYNDICATE on a MoE model's expert bucket groups (megatron_plugin.dp_collective with ``expert=True``): a
tiny GPT with 4 experts, EP 2 on 4 gloo ranks, so the experts' gradients reduce over two expert-data-parallel
groups ({0, 2}, {1, 3}) and the dense ones over DP 4; Megatron-core's own DDP, optimizer and finalize_model_grads,
against the same run without flowlane, in one launch."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.llm
pytest.importorskip("megatron.core")

ITERATIONS = 3


def test_aleph_and_syndicate_carry_the_expert_bucket_groups_bitwise(tmp_path) -> None:
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
