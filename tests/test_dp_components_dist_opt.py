"""ALEPH and SYNDICATE under Megatron-core's distributed optimizer (megatron_plugin.dp_collective): a tiny GPT, DP 2 on
2 gloo ranks, Megatron-core's DistributedDataParallel with ``use_distributed_optimizer`` (each bucket group
reduce-scatters its gradients and all-gathers its parameters on one group attribute), with and without
``overlap_param_gather``, against the same runs without flowlane, in one launch. DP 2: a sum of two has one order,
and a gather moves bytes, so the runs are bitwise Megatron's."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.llm
pytest.importorskip("megatron.core")

ITERATIONS = 3


def test_aleph_and_syndicate_carry_the_distributed_optimizers_collectives_bitwise(tmp_path) -> None:
    from flowlane.launch import launch
    from tests.megatron_dp_workers import dist_opt_runs

    res = launch(dist_opt_runs, 2, args=(str(tmp_path),), timeout=600)
    for rank, r in enumerate(res):
        assert r["losses"] == ITERATIONS, (rank, r)
        for name in ("aleph", "plan", "sync"):
            x = r[name]
            # every bucket group's reduce-scatter in every iteration went through the component, and its parameters'
            # all-gathers (ALEPH: passed through to Megatron's group; SYNDICATE: through the enforcer): one per
            # bucket group and iteration with overlap_param_gather (the first forward gathers too), after each
            # optimizer step without it
            assert x["bucket_groups"] >= 2 and x["calls"] == x["bucket_groups"] * ITERATIONS, (rank, name, x)
            assert x["gathers"] == x["bucket_groups"] * ITERATIONS, (rank, name, x)
            assert x["restored"], (rank, name, x)
            assert x["bitwise"], (rank, name, x)
        # FIFO records the steady state's signatures: the gathers (forward) then the reduce-scatters (backward)
        g = r["plan_gathers"]
        kinds = r["fifo"]["kinds"]
        assert r["fifo"]["bitwise"] and r["fifo"]["events"] == [], (rank, r["fifo"])
        assert g == r["plan"]["bucket_groups"] and kinds == ["all_gather"] * g + ["reduce_scatter"] * g, kinds
        assert len(r["plan_order"]) > 2 * g, r["plan_order"]  # gathers and blocks were cut into motifs
        # overlap_param_gather: the steady state follows the plan's order, the gathers first (each last motif first);
        # iteration 0 gathers in the plan's order too, then falls back to FIFO at the reduce-scatters (Megatron waits
        # for each bucket group in turn in the first iteration), at one program point on every rank
        p = r["plan"]
        assert p["steady"] == r["plan_order"], (rank, p["steady"], r["plan_order"])
        n_gather_motifs = sum(1 for op, _ in r["plan_order"] if op < g)
        assert p["first"][:n_gather_motifs] == r["plan_order"][:n_gather_motifs], (rank, p["first"])
        assert [e[0] for e in p["events"]] == [0] and p["events"][0][1] == "fallback", p["events"]
        # without it: the gathers come after the optimizer step, so iteration 0 (no gathers) falls back and the
        # plan holds from iteration 1 on
        s = r["sync"]
        assert s["steady"] == r["sync_order"], (rank, s["steady"], r["sync_order"])
        assert [e[:2] for e in s["events"]] == [(0, "fallback")], s["events"]
        assert "submission 0 is (reduce_scatter" in s["events"][0][2], s["events"]
        assert "plan has ('all_gather'" in s["events"][0][2], s["events"]
        # the fallback is logged, not only recorded
        assert (
            len(s["warnings"]) == 1
            and "iteration 0 runs as FIFO, not the plan: submission 0" in s["warnings"][0]
        )
        assert (
            "is 'reduce_scatter': Megatron submits only its gradient buckets' all-reduces"
            in r["refused_rs_plan"]
        ), r["refused_rs_plan"]
        assert "has no 'all_gather' op" in r["refused_no_gathers"], r["refused_no_gathers"]
        assert "--syndicate-param-gather passthrough" in r["refused_no_gathers"], r["refused_no_gathers"]
        assert r["passthrough"] == "", r["passthrough"]
        assert "parameter buckets' blocks" in r["refused_short"], r["refused_short"]
        assert "buckets (numel, dtype) without an op [(" in r["refused_short"], r["refused_short"]
        assert (
            "is 'all_reduce': Megatron with the distributed optimizer submits only its gradient buckets' "
            "reduce-scatters and its parameters' all-gathers" in r["refused_ar_plan"]
        ), r["refused_ar_plan"]
        # a plan with a gather no bucket has, given by the flags: refused once the chunk is attached
        assert "buckets' blocks" in r["refused_extra_flags"], r["refused_extra_flags"]
        assert "ops without a bucket [(" in r["refused_extra_flags"], r["refused_extra_flags"]
        # Megatron's fp32-accumulating reduce-scatter (an all-to-all of its own) is refused by both, naming it
        for msg, feature in zip(r["refused_fp32acc"], ("aleph", "syndicate"), strict=True):
            assert (
                f"flowlane.{feature}: reduce_scatter_with_fp32_accumulation=True is not supported" in msg
            ), msg
    assert (
        res[0]["plan"]["steady"] == res[1]["plan"]["steady"]
        and res[0]["sync"]["steady"] == res[1]["sync"]["steady"]
    )
