"""Matching-based all-to-all planning: BvN phases are incast-free and reach the lower bound; the seed's
Algorithm 3 is kept for comparison and is not optimal (seed 000 §5.3.2, Algorithm 3; digest A2.6)."""

import itertools
import random

import numpy as np
import pytest

from flowlane.hermod.matching import algorithm3_phases, bvn_phases, check_phases, lower_bound, phases_total


def _random_matrix(r: random.Random) -> list[list[int]]:
    n = r.randint(2, 7)
    skew = r.random() * 2
    return [
        [int(r.paretovariate(1 + skew) * 5) if r.random() < 0.8 else 0 for _ in range(n)] for _ in range(n)
    ]


@pytest.mark.parametrize("matching", ["bottleneck", "first"])
def test_bvn_phases_are_incast_free_deliver_everything_and_reach_the_lower_bound(matching):
    r = random.Random(0)
    for _ in range(400):
        T = _random_matrix(r)
        ph = bvn_phases(T, matching)
        check_phases(T, ph)
        assert phases_total(ph) == lower_bound(T)
        assert len(ph) <= len(T) ** 2


def test_bottleneck_bvn_takes_the_matching_with_the_largest_smallest_entry():
    """Brute force over every permutation of the padded matrix: the first phase's weight is the largest smallest
    entry any perfect matching has (the greedy BvN step)."""
    from flowlane.hermod.matching import _pad

    r = random.Random(2)
    for _ in range(150):
        T = _random_matrix(r)
        L = lower_bound(T)
        if L == 0:
            continue
        real = [[0 if i == j else v for j, v in enumerate(row)] for i, row in enumerate(T)]
        dummy = _pad(real, L, largest_first=True)
        tot = [[a + b for a, b in zip(ra, rb, strict=True)] for ra, rb in zip(real, dummy, strict=True)]
        best = max(min(tot[i][p[i]] for i in range(len(T))) for p in itertools.permutations(range(len(T))))
        assert bvn_phases(T, "bottleneck")[0].weight == best


def test_bottleneck_bvn_needs_fewer_phases_than_the_first_matching_on_dispatch_matrices():
    """What the choice is for: every phase costs a fixed overhead at run time. On Zipf dispatch matrices (as the
    benchmarks draw them) the bottleneck choice needs at most as many phases as the first matching found on every
    matrix drawn here, and clearly fewer on average."""
    from flowlane.sim.workloads import zipf_token_matrix

    rng = np.random.default_rng(0)
    for n, factor in ((4, 0.9), (8, 0.8), (16, 0.5)):
        first, bottleneck = [], []
        for skew in (0.0, 0.5, 1.0):
            for _ in range(3):
                T = zipf_token_matrix(rng, n, 4 * n, 1024, 2, skew).tolist()
                a, b = bvn_phases(T), bvn_phases(T, "bottleneck")
                assert phases_total(a) == phases_total(b) == lower_bound(T)
                first.append(len(a))
                bottleneck.append(len(b))
        assert all(b <= a for a, b in zip(first, bottleneck, strict=True)), (n, first, bottleneck)
        assert sum(bottleneck) <= factor * sum(first), (n, first, bottleneck)


def test_algorithm3_is_valid_but_not_optimal_on_the_digest_example():
    T = [[0, 5, 0], [5, 0, 0], [5, 5, 0]]
    a3 = algorithm3_phases(T)
    check_phases(T, a3)
    assert lower_bound(T) == 10
    assert phases_total(a3) == 15  # 1.5 x the bound (digest A2.6 [check])
    assert phases_total(bvn_phases(T)) == 10
    r = random.Random(1)
    for _ in range(200):
        T = _random_matrix(r)
        a3 = algorithm3_phases(T)
        check_phases(T, a3)
        assert phases_total(a3) >= lower_bound(T)


def test_plans_are_deterministic_and_ignore_the_diagonal():
    T = [[9, 3, 1, 0], [2, 9, 0, 4], [0, 6, 9, 1], [5, 0, 2, 9]]
    assert bvn_phases(T) == bvn_phases([row[:] for row in T])
    assert bvn_phases(T, "bottleneck") == bvn_phases([row[:] for row in T], "bottleneck")
    assert algorithm3_phases(T) == algorithm3_phases(T)
    T0 = [[0 if i == j else v for j, v in enumerate(row)] for i, row in enumerate(T)]
    assert bvn_phases(T) == bvn_phases(T0)


def test_bad_matrices_are_rejected_with_the_offending_entry():
    with pytest.raises(ValueError, match="square"):
        bvn_phases([[0, 1], [1]])
    with pytest.raises(ValueError, match=r"T\[0\]\[1\] = -1"):
        bvn_phases([[0, -1], [1, 0]])
    with pytest.raises(ValueError, match=r"matching 'best' is not one of \['first', 'bottleneck'\]"):
        bvn_phases([[0, 1], [1, 0]], "best")  # type: ignore[arg-type]


@pytest.mark.parametrize("quantum", [1, 4])
def test_planned_all_to_alls_check_entries_before_quantising(quantum):
    """plan_all_to_all quantised with int(x) before the check, so 2.5 rows planned as 2 (or 1 unit of 4) and -1 with a
    quantum of 4 as 0, silently."""
    from flowlane.hermod.matching import plan_all_to_all, plan_for_rank

    for bad, shown in ((2.5, "2.5"), (-1, "-1"), (float("nan"), "nan")):
        T = [[0, 8, 1], [bad, 0, 4], [3, 5, 0]]
        with pytest.raises(ValueError, match=rf"T\[1\]\[0\] = {shown}"):
            plan_all_to_all(T, quantum=quantum, cache=False)
        with pytest.raises(ValueError, match=rf"T\[1\]\[0\] = {shown}"):
            plan_for_rank(T, 1, quantum=quantum, cache=False)
    ints = [[0, 8, 1], [2, 0, 4], [3, 5, 0]]
    floats = [[float(x) for x in row] for row in ints]  # integral floats were always accepted
    assert plan_all_to_all(floats, quantum=quantum, cache=False) == plan_all_to_all(ints, quantum=quantum)
    big = [[0, 2**70], [2**70 + 1, 0]]  # beyond int64: quantised on the Python planner's lists
    assert phases_total(plan_all_to_all(big, quantum=quantum)) == -(-(2**70 + 1) // quantum)


def test_groups_of_two_skip_matching_because_every_2x2_plan_is_the_one_exchange():
    """flowlane.sched.alltoall.needs_matching: with two ranks nobody receives from two peers at once, so the plan of
    any 2x2 matrix is a single phase, the exchange all_to_all_single makes; from three ranks on incast exists."""
    from flowlane.hermod.matching import needs_matching, plan_all_to_all

    rng = random.Random(7)
    for _ in range(200):
        m = [[rng.randint(0, 50) for _ in range(2)] for _ in range(2)]
        assert len(plan_all_to_all(m)) <= 1, m
    assert not needs_matching(1) and not needs_matching(2) and needs_matching(3)
    assert len(plan_all_to_all([[0, 4, 4], [0, 0, 4], [4, 0, 0]])) > 1  # rank 2 would be an incast target


def test_all_to_all_runner_refuses_bad_settings_by_name():
    from flowlane.hermod.matching import RUN_ALGORITHMS
    from flowlane.sched.alltoall import AllToAllRunner

    assert RUN_ALGORITHMS == ("bvn", "bvn_bottleneck", "alg3", "plain", "auto")
    with pytest.raises(ValueError, match=r"all-to-all algorithm 'fastest' is not one of \['bvn', .*'auto'\]"):
        AllToAllRunner("fastest")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="probe_iterations must be an integer >= 1, got 0"):
        AllToAllRunner("auto", probe_iterations=0)
    with pytest.raises(ValueError, match="quantum must be an integer >= 1, got 1.5"):
        AllToAllRunner("bvn", quantum=1.5)  # type: ignore[arg-type]
    assert AllToAllRunner("auto").choice is None and AllToAllRunner("plain").current == "plain"
    assert AllToAllRunner("auto").current == "bvn"  # iteration 0 warms up with the seed's matching


def test_auto_candidates_are_checked_and_the_warm_up_uses_the_first_matched_one():
    from flowlane.hermod.matching import AUTO_CANDIDATES, check_candidates
    from flowlane.sched.alltoall import AllToAllRunner

    assert AUTO_CANDIDATES == ("plain", "bvn") and AllToAllRunner("auto").candidates == AUTO_CANDIDATES
    assert check_candidates("plain, alg3,bvn") == ("plain", "alg3", "bvn")
    assert check_candidates(["bvn_bottleneck", "bvn"]) == ("bvn_bottleneck", "bvn")
    for bad in ("plain", "plain,plain", "plain,auto", "bvn,fastest", ""):
        with pytest.raises(
            ValueError,
            match=r"auto candidates \[.*\] must be two or more distinct names of "
            r"\['bvn', 'bvn_bottleneck', 'alg3', 'plain'\]",
        ):
            check_candidates(bad)
    runner = AllToAllRunner("auto", candidates=("plain", "alg3", "bvn"))
    assert runner.current == "alg3" and list(runner.probe_seconds) == ["plain", "alg3", "bvn"]


def _rank_view(phases, me):
    """A rank's part of a Phase list, as plan_for_rank must give it."""
    sends = [(k, d, a) for k, ph in enumerate(phases) for s, d, a in ph.sends if s == me]
    recvs = [(k, s, a) for k, ph in enumerate(phases) for s, d, a in ph.sends if d == me]
    return tuple(zip(*sends, strict=True)) or ((), (), ()), tuple(zip(*recvs, strict=True)) or ((), (), ())


@pytest.mark.parametrize("impl", ["auto", "python"])
def test_plan_for_rank_is_each_ranks_part_of_the_whole_plan(impl):
    from flowlane.hermod.matching import plan_all_to_all, plan_cache_clear, plan_for_rank

    r = random.Random(3)
    plan_cache_clear()
    for _ in range(60):
        T = _random_matrix(r)
        for alg, q, cap in (("bvn", 1, 0), ("bvn_bottleneck", 2, 0), ("alg3", 1, 0), ("bvn", 1, 2)):
            phases = plan_all_to_all(T, q, alg, impl=impl, max_phases=cap)
            for me in range(len(T)):
                rp = plan_for_rank(T, me, q, alg, impl=impl, max_phases=cap)
                (sp, sd, sa), (rp_, rs, ra) = _rank_view(phases, me)
                assert len(rp) == len(phases) and rp.residual == (bool(phases) and phases[-1].residual)
                assert (rp.send_phase, rp.send_peer, rp.send_units) == (sp, sd, sa), (alg, me)
                assert (rp.recv_phase, rp.recv_peer, rp.recv_units) == (rp_, rs, ra), (alg, me)
                steps = rp.steps()
                assert [k for k, _, _ in steps] == sorted({*sp, *rp_})
                assert all(
                    len(s) <= 1 and len(rv) <= 1 for k, s, rv in steps if k < len(phases) - 1 or not cap
                )


def test_plan_for_rank_takes_entries_beyond_int64_and_refuses_a_bad_rank():
    from flowlane.hermod.matching import plan_all_to_all, plan_for_rank

    big = 1 << 70
    T = [[0, big, 1], [2, 0, big], [big, 3, 0]]
    phases = plan_all_to_all(T)
    rp = plan_for_rank(T, 1)
    assert (rp.send_phase, rp.send_peer, rp.send_units) == _rank_view(phases, 1)[0]
    assert sum(rp.send_units) == big + 2
    for bad in (-1, 3, True, 1.0):
        with pytest.raises(ValueError, match="is not a rank of the 3x3 matrix"):
            plan_for_rank(T, bad)
