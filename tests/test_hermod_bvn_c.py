"""The compiled phase planner (flowlane/hermod/bvn.c) against the pure-Python reference in matching.py: the same
phases in the same order on random and adversarial matrices, the fallback when it cannot be built, input checks, and
the plan cache. No timing assertions (benchmarks/a2a_plan_speed.py measures speed)."""

from __future__ import annotations

import os
import random
import shutil

import numpy as np
import pytest

from flowlane.hermod import matching as M
from flowlane.hermod.matching import (
    algorithm3_phases,
    bvn_phases,
    check_phases,
    lower_bound,
    phases_total,
    plan_all_to_all,
    plan_cache_clear,
    plan_cache_info,
)
from flowlane.sim.workloads import zipf_token_matrix

HAVE_CC = shutil.which(os.environ.get("CC", "cc")) is not None
needs_cc = pytest.mark.skipif(
    not HAVE_CC, reason="no C compiler ($CC or cc) on PATH: only the Python planner exists"
)


def _random(r: random.Random, n: int) -> list[list[int]]:
    skew = r.random() * 2
    dens = r.choice((0.1, 0.5, 0.8, 1.0))
    return [
        [int(r.paretovariate(1 + skew) * 5) if r.random() < dens else 0 for _ in range(n)] for _ in range(n)
    ]


def _adversarial(n: int) -> list[tuple[str, list[list[int]]]]:
    one_row = [[7] * n] + [[0] * n for _ in range(n - 1)]
    one_col = [[5 if j == 0 else 0 for j in range(n)] for _ in range(n)]
    return [
        ("zeros", [[0] * n for _ in range(n)]),
        ("one hot row", one_row),
        ("one hot column", one_col),
        ("all equal", [[3] * n for _ in range(n)]),
        ("skewed", [[(i * 7 + j * 3) % 11 * 10 ** ((i + j) % 4) for j in range(n)] for i in range(n)]),
        ("single entry", [[9 if (i, j) == (n - 1, 0) else 0 for j in range(n)] for i in range(n)]),
        ("diagonal only", [[4 if i == j else 0 for j in range(n)] for i in range(n)]),
        ("permutation", [[2**20 if j == (i + 1) % n else 0 for j in range(n)] for i in range(n)]),
        ("big values", [[(i + 1) * (j + 2) * 10**9 for j in range(n)] for i in range(n)]),
    ]


def _same(T, algorithms=("bvn", "bvn_bottleneck", "alg3")) -> None:
    for alg in algorithms:
        if alg == "alg3":
            c, p = algorithm3_phases(T, impl="c"), algorithm3_phases(T, impl="python")
        else:
            m = "bottleneck" if alg == "bvn_bottleneck" else "first"
            c, p = bvn_phases(T, m, impl="c"), bvn_phases(T, m, impl="python")
        assert c == p, (alg, T)
        check_phases(T, c)
        if alg != "alg3":
            assert phases_total(c) == lower_bound(T)


@needs_cc
def test_compiled_planner_equals_python_phase_for_phase_on_random_matrices():
    r = random.Random(30)
    for n in list(range(1, 13)) + [16, 17, 24]:
        for _ in range(12 if n <= 8 else 3):
            _same(_random(r, n), ("bvn", "bvn_bottleneck", "alg3") if n <= 12 else ("bvn", "bvn_bottleneck"))


@needs_cc
@pytest.mark.parametrize("n", [1, 2, 3, 5, 8, 31, 63, 64, 65])
def test_compiled_planner_equals_python_on_adversarial_matrices(n):
    algs = ("bvn", "bvn_bottleneck", "alg3") if n <= 8 else ("bvn",)
    for _, T in _adversarial(n):
        _same(T, algs)


@needs_cc
@pytest.mark.parametrize("ep", [8, 32])
def test_compiled_planner_equals_python_on_zipf_dispatch_matrices(ep):
    rng = np.random.default_rng(ep)
    for skew in (0.0, 1.2):
        m = zipf_token_matrix(rng, ep, 4 * ep, 512 if ep > 8 else 4096, 2, skew).tolist()
        for alg in ("bvn", "bvn_bottleneck"):
            assert plan_all_to_all(m, 1, alg, impl="c", cache=False) == plan_all_to_all(
                m, 1, alg, impl="python", cache=False
            )
        assert plan_all_to_all(m, 16, "bvn", impl="c", cache=False) == plan_all_to_all(
            m, 16, "bvn", impl="python", cache=False
        )


@needs_cc
def test_inputs_of_other_types_give_the_same_plan():
    T = [[0, 5, 2], [3, 0, 1], [4, 4, 0]]
    ref = bvn_phases(T, impl="python")
    assert bvn_phases(np.array(T), impl="c") == ref
    assert bvn_phases([[float(v) for v in r] for r in T], impl="c") == ref  # 2.0 was always accepted
    assert bvn_phases([tuple(r) for r in T], impl="c") == ref
    assert bvn_phases([[9, 5, 2], [3, 7, 1], [4, 4, 100]], impl="c") == ref  # the diagonal is ignored


def test_fallback_when_the_kernel_is_unavailable(monkeypatch):
    T = [[0, 5, 2, 9], [3, 0, 1, 0], [4, 4, 0, 6], [1, 0, 8, 0]]
    ref = bvn_phases(T, impl="python")
    monkeypatch.setattr(M, "_kernel", lambda: None)
    assert M.planner_impl() == "python"
    assert bvn_phases(T) == ref
    assert plan_all_to_all(T, cache=False) == ref
    with pytest.raises(ValueError, match="impl='c' requested"):
        bvn_phases(T, impl="c")


def test_fallback_when_the_compiler_is_missing(monkeypatch, tmp_path):
    """A fresh kernel whose build fails (no compiler): one warning, then the Python planner, same plans."""
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("FLOWLANE_CACHE", str(tmp_path))
    k = M.CKernel(
        M._KERNEL.src,
        "bvn_test",
        M._CFLAGS,
        M._declare,
        "flowlane.hermod: C phase planner",
        "using the pure-Python planner",
    )
    monkeypatch.setattr(M, "_KERNEL", k)
    T = [[0, 1, 2], [2, 0, 1], [1, 2, 0]]
    with pytest.warns(UserWarning, match="C phase planner unavailable"):
        got = bvn_phases(T)
    assert got == bvn_phases(T, impl="python")
    assert algorithm3_phases(T) == algorithm3_phases(T, impl="python")


def test_env_switch_disables_the_kernel(monkeypatch):
    monkeypatch.setenv("FLOWLANE_HERMOD_NO_C", "1")
    assert M.planner_impl() == "python"


@pytest.mark.parametrize("impl", ["auto", "python"])
def test_bad_input_is_refused_naming_the_value(impl):
    with pytest.raises(ValueError, match=r"T\[1\]\[0\] = -3"):
        bvn_phases([[0, 1], [-3, 0]], impl=impl)
    with pytest.raises(ValueError, match=r"T\[0\]\[1\] = 1.5"):
        bvn_phases([[0, 1.5], [2, 0]], impl=impl)
    with pytest.raises(ValueError, match="row 1 has 1 entries, expected 2"):
        algorithm3_phases([[0, 1], [2]], impl=impl)
    with pytest.raises(ValueError, match=r"T\[0\]\[1\] = 'x'"):
        bvn_phases([[0, "x"], [2, 0]], impl=impl)
    with pytest.raises(ValueError, match="T\\[1\\]\\[0\\] = -1"):
        plan_all_to_all([[0, 1], [-1, 0]], impl=impl)
    with pytest.raises(ValueError, match="impl 'fortran'"):
        plan_all_to_all([[0, 1], [1, 0]], impl="fortran")  # type: ignore[arg-type]


def test_values_beyond_the_kernels_range_use_the_python_planner():
    T = [[0, 2**62], [5, 0]]
    assert bvn_phases(T) == bvn_phases(T, impl="python")
    T = [[0, 2**70], [5, 0]]  # beyond int64
    ph = bvn_phases(T)
    check_phases(T, ph)
    with pytest.raises(ValueError, match="impl='c' requested"):
        bvn_phases([[0, 2**62], [5, 0]], impl="c")


def test_plan_cache_hits_return_the_same_plan_and_stay_bounded():
    plan_cache_clear(3)
    try:
        T = [[0, 5, 2], [3, 0, 1], [4, 4, 0]]
        a = plan_all_to_all(T)
        assert plan_cache_info() == {"hits": 0, "misses": 1, "size": 1, "maxsize": 3}
        b = plan_all_to_all([[9, 5, 2], [3, 0, 1], [4, 4, 0]])  # same off-diagonal matrix: a hit
        assert b == a and b is not a
        b.clear()  # the caller owns the list it got
        assert plan_all_to_all(T) == a
        assert plan_cache_info()["hits"] == 2
        # keyed by algorithm
        assert plan_all_to_all(T, algorithm="bvn_bottleneck") == bvn_phases(T, "bottleneck")
        # and by quantum
        assert plan_all_to_all(T, quantum=2) == bvn_phases([[0, 3, 1], [2, 0, 1], [2, 2, 0]])
        for k in range(5):
            plan_all_to_all([[0, k + 1], [1, 0]])
        assert plan_cache_info()["size"] == 3
        assert plan_all_to_all(T, cache=False) == a
        plan_cache_clear(0)
        plan_all_to_all(T)
        assert plan_cache_info() == {"hits": 0, "misses": 0, "size": 0, "maxsize": 0}
        with pytest.raises(ValueError, match="maxsize"):
            plan_cache_clear(-1)
    finally:
        plan_cache_clear(16)


def test_capped_plans_equal_python_keep_every_unit_and_end_in_one_residual_phase():
    """``max_phases``: after max_phases - 1 matched phases, one residual phase sends what is left (may incast)."""
    rng = random.Random(7)
    for n in (3, 5, 8, 16):
        for _ in range(4):
            T = [[0 if i == j else rng.randint(0, 50) for j in range(n)] for i in range(n)]
            for alg in ("bvn", "bvn_bottleneck"):
                for cap in (1, 2, 5, 17):
                    c = plan_all_to_all(T, algorithm=alg, impl="c", cache=False, max_phases=cap)
                    assert c == plan_all_to_all(T, algorithm=alg, impl="python", cache=False, max_phases=cap)
                    got = [[0] * n for _ in range(n)]
                    for ph in c:
                        for s, d, a in ph.sends:
                            got[s][d] += a
                    assert got == T and len(c) <= cap
                    assert not any(ph.residual for ph in c[:-1])
                    full = plan_all_to_all(T, algorithm=alg, impl="c", cache=False)
                    if len(full) < cap:  # a plan shorter than the cap is the uncapped plan
                        assert c == full
    with pytest.raises(ValueError, match="max_phases must be an integer >= 0"):
        plan_all_to_all([[0, 1], [1, 0]], max_phases=-1)
    with pytest.raises(ValueError, match="not alg3"):
        plan_all_to_all([[0, 1], [1, 0]], algorithm="alg3", max_phases=3, cache=False)
