"""ALEPH and SYNDICATE under Megatron-core's distributed optimizer (megatron_plugin.dp_collective): a tiny GPT, DP 2 on
2 gloo ranks, Megatron-core's DistributedDataParallel with ``use_distributed_optimizer`` and ``overlap_param_gather``
(each bucket group reduce-scatters its gradients and all-gathers its parameters on one group attribute), against the
same run without flowlane, in one launch. DP 2: a sum of two has one order, so the runs are bitwise Megatron's."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.llm
pytest.importorskip("megatron.core")

ITERATIONS = 3


def test_aleph_and_syndicate_carry_the_distributed_optimizers_reduce_scatter_bitwise(tmp_path) -> None:
    from flowlane.launch import launch
    from tests.megatron_dp_workers import dist_opt_runs

    res = launch(dist_opt_runs, 2, args=(str(tmp_path),), timeout=600)
    for rank, r in enumerate(res):
        assert r["losses"] == ITERATIONS, (rank, r)
        for name in ("aleph", "plan"):
            x = r[name]
            # every bucket group's reduce-scatter in every iteration went through the component, the parameters'
            # all-gathers through Megatron's own group (one per bucket group and iteration), and the groups came back
            assert x["bucket_groups"] >= 2 and x["calls"] == x["bucket_groups"] * ITERATIONS, (rank, name, x)
            assert x["gathers"] >= x["bucket_groups"] * (ITERATIONS - 1), (rank, name, x)
            assert x["restored"], (rank, name, x)
            assert x["bitwise"], (rank, name, x)
        assert r["fifo"]["bitwise"] and r["fifo"]["kinds"] == ["reduce_scatter"], (rank, r["fifo"])
        # the steady state follows the plan's order (last bucket first, its last motif first); iteration 0 falls back
        # to FIFO as on the all-reduce path (Megatron waits for each bucket group in turn in the first iteration)
        assert r["plan"]["steady"] == r["plan_order"], (rank, r["plan"]["steady"], r["plan_order"])
        assert len(r["plan_order"]) > r["plan"]["bucket_groups"], r["plan_order"]  # buckets were cut
        assert all(e[0] == 0 for e in r["plan"]["events"] if e[1] == "fallback"), r["plan"]["events"]
        assert (
            "is 'reduce_scatter': Megatron submits only its gradient buckets' all-reduces"
            in r["refused_rs_plan"]
        ), r["refused_rs_plan"]
        assert (
            "is 'all_reduce': Megatron with the distributed optimizer submits only its gradient buckets' "
            "reduce-scatters" in r["refused_ar_plan"]
        ), r["refused_ar_plan"]
