"""ALEPH tier 0: the hierarchical all-reduce over gloo subgroups equals all_reduce; the DDP hook equals DDP's own."""

import pytest

from flowlane.launch import launch
from tests import aleph_workers

# torch-only core code: runs in the llm lane (the gnn lane's torch 2.2.1 was checked by hand, see docs/aleph.md)
pytestmark = pytest.mark.once

CASES_4 = [
    ([[3, 1, 2], [0]], "allreduce"),  # Table 1's plan: w3 aggregates w1, w2; w0 direct
    ([[3, 1, 2], [0]], "ps"),
    ([[0, 1, 2, 3]], "allreduce"),  # one cluster: no top tier
    ([[1, 0], [2, 3]], "ps"),
]


def _check(res: list[dict], ncases: int) -> None:
    for rank, r in enumerate(res):
        assert r["int_equal"] == [True] * ncases, (rank, r["int_equal"])
        assert r["rs_equal"] == [True] * ncases, (rank, r["rs_equal"])
        assert max(r["float_maxdiff"]) < 1e-4, (rank, r["float_maxdiff"])
        # DDP's own reducer: x (1/size), then one all-reduce: bit for bit
        assert r["ddp_singletons_bitwise"], rank
        assert r["ddp_hier_maxdiff"] < 1e-5, (rank, r["ddp_hier_maxdiff"])
        assert r["ddp_moved"] > 1e-3  # training changed the parameters: the comparison is not vacuous
        assert r["probe"] == res[0]["probe"] and all(f > 0 for f in r["probe"])
        assert "disagree on the ALEPH plan" in r["mismatch"], (
            rank,
            r["mismatch"],
        )  # raised everywhere, no hang


def test_hierarchical_allreduce_and_ddp_hook_match_all_reduce_and_plans_must_agree_on_4_ranks():
    res = launch(aleph_workers.hierarchical_cases, 4, args=(CASES_4,), timeout=120)
    _check(res, len(CASES_4))
    # the DDP hook re-planning after each iteration's last bucket: the plan changed at iteration 2
    for r in res:
        assert r["replan_decisions"] == [(1, False), (2, True), (3, False)], r["replan_decisions"]
        assert r["replan_maxdiff"] < 1e-5, r["replan_maxdiff"]
        # the default (real, confirmed) probe: three re-planning points, the same decisions on every rank
        assert [d[0] for d in r["real_probe_decisions"]] == [1, 2, 3], r["real_probe_decisions"]
        assert r["real_probe_decisions"] == res[0]["real_probe_decisions"]
        assert r["real_probe_maxdiff"] < 1e-5, r["real_probe_maxdiff"]


@pytest.mark.slow
def test_hierarchical_allreduce_on_7_ranks_with_singletons_and_two_tiers():
    cases = [([[6, 0, 1, 2], [3, 4], [5]], "allreduce"), ([[6, 0, 1, 2], [3, 4], [5]], "ps")]
    res = launch(aleph_workers.hierarchical_cases, 7, args=(cases,), timeout=240)
    _check(res, len(cases))
