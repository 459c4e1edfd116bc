"""ALEPH tier 1 with several PSs (seed Sec. 7, digest §2.9) behind the comm-hook entry point: part j of every
aggregator's sum goes to PS j, integer sums equal all_reduce exactly (under injected loss too), floats within the
fixed-point bound; bad PS choices are refused by name."""

import pytest

from flowlane.aleph import Plan
from flowlane.aleph.udp_allreduce import _check_ps
from flowlane.launch import launch
from tests import aleph_udp_workers

pytestmark = pytest.mark.once

CLUSTERS = [[0, 3], [1], [2]]  # heads 0, 1, 2 (|D| = 3); rank 3 is aggregator 0's member


def test_udp_tier_with_several_ps_sums_exactly_on_4_ranks():
    cases = [
        ((0, 1, 2), None, (300, 150, 100), 0.0),  # proportional: 6/11, 3/11, 2/11 of the values
        ((2, 0), (0.6, 0.4), None, 0.01),  # uneven, 1 % of received datagrams dropped in every process
    ]
    res = launch(aleph_udp_workers.udp_multips_cases, 4, args=(CLUSTERS, cases), timeout=400)
    for rank, r in enumerate(res):
        for case, got in zip(cases, r, strict=True):
            assert got["exact"], (rank, case, got)
            assert got["float_maxdiff"] < 1e-5, (rank, case, got)
    assert res[0][0]["split"] == pytest.approx([6 / 11, 3 / 11, 2 / 11])
    # PS j added |D| = 3 flows of its part only, once each: 3000 values cut 1636 / 818 / 546 -> 13 / 7 / 5 segments;
    # 0.6 / 0.4 -> 1800 / 1200 values -> 15 / 10 segments (PS 0 on rank 2, PS 1 on rank 0)
    assert [res[r][0]["ps_added"] for r in range(4)] == [[3 * 13], [3 * 7], [3 * 5], []]
    assert [res[r][1]["ps_added"] for r in range(4)] == [[3 * 10], [], [3 * 15], []]
    assert sum(r[1]["injected"] for r in res) > 0  # the lossy case did lose datagrams (repaired)


def test_bad_ps_choices_are_refused_by_name():
    plan = Plan.from_clusters(4, CLUSTERS)
    assert _check_ps(plan, None, None, None) == ((0,), (1.0,))
    assert _check_ps(plan, (0, 1), "equal", None) == ((0, 1), (0.5, 0.5))
    with pytest.raises(ValueError, match=r"ps=\[3\] must be distinct aggregator positions \(cluster heads"):
        _check_ps(plan, (3,), None, None)
    with pytest.raises(ValueError, match=r"ps=\[0, 0\] must be distinct"):
        _check_ps(plan, (0, 0), "equal", None)
    with pytest.raises(ValueError, match="give split= .* or ps_bandwidths="):
        _check_ps(plan, (0, 1), None, None)
    with pytest.raises(ValueError, match="not both"):
        _check_ps(plan, (0, 1), (0.5, 0.5), (1, 1))
    with pytest.raises(ValueError, match=r"split=\[0.5, 0.25, 0.25\] has 3 fractions for 2 PSs"):
        _check_ps(plan, (0, 1), (0.5, 0.25, 0.25), None)
    with pytest.raises(ValueError, match=r"must have one fraction in \[0, 1\] per PS, summing to 1"):
        _check_ps(plan, (0, 1), (0.7, 0.7), None)
    with pytest.raises(ValueError, match="has 1 values for 2 PSs"):
        _check_ps(plan, (0, 1), None, (100,))
    with pytest.raises(ValueError, match="split='half'"):
        _check_ps(plan, (0, 1), "half", None)
