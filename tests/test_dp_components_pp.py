"""ALEPH and SYNDICATE on Megatron-core's data-parallel path with several data-parallel groups: PP 2 x DP 2, then
TP 2 x DP 2, on 4 gloo ranks (a tiny GPT, Megatron-core's DistributedDataParallel with overlap_grad_reduce, its
optimizer, finalize_model_grads and schedule), against the same run without flowlane, in one launch. Each DP group
gets its own ALEPH tree (its groups made on every rank) or its own SYNDICATE enforcer; with PP each stage has its own
plan (``{pp_rank}`` in the Megatron-LM flag's path). DP 2: a sum of two has one order, so every run must be
Megatron's bit for bit."""

from __future__ import annotations

import tempfile

import pytest

pytestmark = pytest.mark.llm
pytest.importorskip("megatron.core")

ITERATIONS = 3


def test_aleph_and_syndicate_on_each_data_parallel_group_of_pp2_and_tp2_are_bitwise_stock() -> None:
    from flowlane.launch import launch
    from tests.megatron_dp_workers import pp_runs

    with tempfile.TemporaryDirectory() as tmp:
        res = launch(pp_runs, 4, args=(tmp,), timeout=600)
    for rank, r in enumerate(res):
        a = r["aleph"]
        assert a["bitwise"] and a["restored"], (rank, a)
        assert a["bucket_groups"] >= 1 and a["calls"] == a["bucket_groups"] * ITERATIONS, (rank, a)
        assert a["losses"] == (ITERATIONS if r["stage"] == 1 else 0), (rank, a)
        assert r["fifo"]["bitwise"], (rank, r["fifo"])
        p = r["plan"]
        assert p["bitwise"] and p["restored"], (rank, p)
        assert p["calls"] == p["bucket_groups"] * ITERATIONS, (rank, p)
        assert p["steady"] == r["plan_order"], (rank, p["steady"], r["plan_order"])  # the stage's own plan
        for name in ("tp_aleph", "tp_plan"):  # TP 2 x DP 2: DP groups {0, 2} and {1, 3}
            x = r[name]
            assert x["bitwise"] and x["restored"], (rank, name, x)
            assert x["calls"] == x["bucket_groups"] * ITERATIONS, (rank, name, x)
        assert r["tp_plan"]["steady"] == r["tp_plan_order"], (rank, r["tp_plan"]["steady"])
    # the two ranks of a stage launched one sequence; the stages had plans of their own
    assert res[0]["plan"]["log"] == res[1]["plan"]["log"] and res[2]["plan"]["log"] == res[3]["plan"]["log"]
    assert res[0]["stage"] == res[1]["stage"] == 0 and res[2]["stage"] == res[3]["stage"] == 1


def test_a_plan_path_without_the_stage_is_refused_with_several_stages() -> None:
    from megatron_plugin.syndicate import SyndicateMegatronConfig

    with pytest.raises(ValueError, match=r"with 2 pipeline stages .* put \{pp_rank\} in the path"):
        SyndicateMegatronConfig(plan="plan.json").load_plan(pp_rank=1, pp_size=2)
