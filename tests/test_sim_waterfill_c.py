"""The C rate-allocation kernel (flowlane/sim/_waterfill.c) against the numpy reference: bit-identical rates and
remaining capacities on random and degenerate instances, identical simulations, input errors, and the fallback."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest

from flowlane.policies import make_policy
from flowlane.sim import IncastModel, SimConfig, Simulator, allocate, waterfill
from flowlane.sim import network as N
from flowlane.sim.models import LLMJob, ModelConfig, ParallelConfig, preset
from flowlane.sim.workloads import build_llm

HAVE_CC = shutil.which(os.environ.get("CC", "cc")) is not None
needs_cc = pytest.mark.skipif(
    not HAVE_CC, reason="no C compiler ($CC or cc) on PATH: only the numpy path exists"
)


def _both(monkeypatch: pytest.MonkeyPatch, fn, *args, **kw):
    """fn(*args) on the C path and on the numpy path (FLOWLANE_SIM_NO_C=1); arrays are copied for each call."""
    out = []
    for no_c in ("", "1"):
        monkeypatch.setenv("FLOWLANE_SIM_NO_C", no_c)
        a = [x.copy() if isinstance(x, np.ndarray) else x for x in args]
        out.append((fn(*a, **kw), a))
    monkeypatch.delenv("FLOWLANE_SIM_NO_C")
    return out


def _instance(seed: int):
    rng = np.random.default_rng(seed)
    nl = int(rng.integers(1, 40))
    n = int(rng.integers(1, 300))
    h = int(rng.integers(1, 7))
    hops = rng.integers(0, nl, size=(n, h))
    hops[rng.random((n, h)) < 0.3] = nl  # pad entries, anywhere in the row
    cls = rng.integers(0, int(rng.integers(1, 5)), size=n)
    cap = rng.uniform(1.0, 100.0, nl)
    if seed % 3 == 0:  # equal capacities: many exact ties in the levels
        cap[:] = 10.0
    return hops, cls, cap, rng


@needs_cc
@pytest.mark.parametrize("seed", range(16))
@pytest.mark.parametrize("sharing", ["strict", "weighted"])
@pytest.mark.parametrize("with_incast", [None, "port", "class"])
def test_random_instances_give_bit_identical_rates(
    monkeypatch: pytest.MonkeyPatch, seed: int, sharing: str, with_incast: str | None
) -> None:
    hops, cls, cap, rng = _instance(seed)
    kw: dict = {"sharing": sharing, "weight_ratio": 0.3}
    if with_incast:
        kw["incast"] = IncastModel(threshold=2, alpha=0.25, count=with_incast)
        kw["incast_links"] = (rng.random(cap.size) < 0.6).astype(np.int64)
        kw["incast_group"] = np.where(rng.random(len(hops)) < 0.4, rng.integers(0, 3, len(hops)), -1)
    (c, _), (ref, _) = _both(monkeypatch, allocate, hops, cls, cap, **kw)
    # only all-pad flows are unlimited
    np.testing.assert_array_equal(np.isinf(ref), (hops == cap.size).all(axis=1))
    np.testing.assert_array_equal(c, ref)


@needs_cc
@pytest.mark.parametrize("seed", range(8))
def test_waterfill_gives_identical_rates_and_remaining_capacity(
    monkeypatch: pytest.MonkeyPatch, seed: int
) -> None:
    hops, _, cap, rng = _instance(seed)
    w = rng.uniform(0.1, 2.0, len(hops))
    capp = np.append(cap, np.inf)
    for rtol in (0.0, 1e-9, 1e-3):
        (c, (_, _, cap_c)), (ref, (_, _, cap_ref)) = _both(monkeypatch, waterfill, hops, w, capp, rtol=rtol)
        np.testing.assert_array_equal(c, ref)
        # the in-place decrease too (strict classes chain on it)
        np.testing.assert_array_equal(cap_c, cap_ref)


@needs_cc
@pytest.mark.parametrize(
    "case",
    [
        "no flows",
        "one flow",
        "one link",
        "only pad",
        "zero capacity",
        "int32 hops",
        "float classes",
        "uint64 classes",
    ],
)
def test_degenerate_instances(monkeypatch: pytest.MonkeyPatch, case: str) -> None:
    nl = 5
    cap = np.arange(1.0, nl + 1)
    rng = np.random.default_rng(7)
    hops = rng.integers(0, nl + 1, size=(20, 3))
    cls = rng.integers(0, 3, 20)
    if case == "no flows":
        hops, cls = np.zeros((0, 3), np.int64), np.zeros(0, np.int64)
    elif case == "one flow":
        hops, cls = np.array([[2, nl, 4]]), np.array([1])
    elif case == "one link":
        hops = np.full((20, 3), nl)
        hops[:, 1] = 3
    elif case == "only pad":
        hops[::2] = nl
    elif case == "zero capacity":
        cap[1] = 0.0
    elif case == "int32 hops":
        hops = hops.astype(np.int32)
    elif case == "float classes":
        cls = cls * 0.5 - 0.25
    elif case == "uint64 classes":
        cls = cls.astype(np.uint64) + np.uint64(2**63)
    for sharing in ("strict", "weighted"):
        (c, _), (ref, _) = _both(monkeypatch, allocate, hops, cls, cap, sharing=sharing)
        np.testing.assert_array_equal(c, ref)
    if case == "one link":
        assert c.sum() == pytest.approx(cap[3]) and len(set(c.tolist())) == len(set(cls.tolist()))  # weighted
    if case == "only pad":
        assert np.isinf(c[::2]).all() and np.isfinite(c[1::2]).all()
    if case == "no flows":
        assert c.shape == (0,)


def test_strict_classes_chain_on_the_remaining_capacity() -> None:
    # link 0 (cap 10) shared by class 0 flow a and class 1 flows b, c; c also crosses link 1 (cap 2)
    hops = np.array([[0, 2], [0, 2], [0, 1]])
    r = allocate(hops, np.array([0, 1, 1]), np.array([10.0, 2.0]))
    np.testing.assert_array_equal(r, [10.0, 0.0, 0.0])
    r = allocate(hops, np.array([5, 0, 0]), np.array([10.0, 2.0]))
    np.testing.assert_array_equal(r, [0.0, 8.0, 2.0])


@pytest.mark.parametrize("no_c", ["", "1"])
def test_weighted_sharing_refuses_more_classes_than_its_weights_can_hold(
    monkeypatch: pytest.MonkeyPatch, no_c: str
) -> None:
    # weights 0.5**rank: up to 665 classes every rate stays finite (a flow alone on its link gets all of it);
    # beyond, the smallest weights overflowed the filling to infinite rates (1,100 classes: 105 of them)
    monkeypatch.setenv("FLOWLANE_SIM_NO_C", no_c)
    k = N.max_weighted_classes(0.5)
    assert k == 665 and N.max_weighted_classes(1.0) > 10**9
    r = allocate(np.arange(k).reshape(k, 1), np.arange(k), np.full(k, 1e12), "weighted", 0.5)
    np.testing.assert_array_equal(r, np.full(k, 1e12))
    with pytest.raises(
        ValueError, match=r"weight_ratio=0.5 handles at most 665 priority classes .* got 1100"
    ):
        allocate(np.arange(1100).reshape(1100, 1), np.arange(1100), np.full(1100, 1e9), "weighted", 0.5)
    # strict sharing has no such limit
    assert np.isfinite(allocate(np.arange(1100).reshape(1100, 1), np.arange(1100), np.full(1100, 1e9))).all()


def _tiny() -> LLMJob:
    m = ModelConfig("tiny", layers=8, hidden=1024, heads=8, vocab=1, seq_len=512)
    return LLMJob(m, ParallelConfig(tp=2, pp=4, micro_batch=1, num_microbatches=4, iterations=2))


@needs_cc
@pytest.mark.parametrize(
    "what",
    [
        "llm-priority",
        "moe-weighted-incast",
        "moe-matched-incast",
        "moe-matched-class-incast",
        "moe-phases-class-incast",
    ],
)
def test_engine_gives_identical_results_with_and_without_c(
    monkeypatch: pytest.MonkeyPatch, what: str
) -> None:
    if what == "llm-priority":
        topo, w = build_llm(_tiny(), 16)
        cfg, pol = SimConfig(), "priority"
    else:
        mode = "matched" if "matched" in what else "phases" if "phases" in what else "plain"
        job = preset("qwen-moe-12l", num_microbatches=1, ep=4, ep_a2a=mode)
        topo, w = build_llm(job, 16)
        cfg = SimConfig(
            incast=IncastModel(threshold=2, alpha=0.2, count="class" if "class" in what else "port"),
            sharing="weighted" if "weighted" in what else "strict",
        )
        pol = "ep-first"
    (rc, _), (rn, _) = _both(monkeypatch, lambda: Simulator(topo, cfg).run(w, make_policy(pol)))
    assert rc.rate_updates > 10
    assert rc.iteration_time == rn.iteration_time and rc.makespan == rn.makespan
    np.testing.assert_array_equal(rc.coflow_nodes, rn.coflow_nodes)
    np.testing.assert_array_equal(rc.coflow_end, rn.coflow_end)


@needs_cc
def test_the_c_kernel_is_built_and_really_used(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setattr(N._KERNEL, "lib", False)
    monkeypatch.setenv("FLOWLANE_CACHE", str(tmp_path))  # a fresh build from the source, not a cached library
    monkeypatch.delenv("FLOWLANE_SIM_NO_C", raising=False)

    def boom(*a, **k):
        raise AssertionError("the numpy path ran although the C kernel is available")

    monkeypatch.setattr(N, "_allocate_numpy", boom)
    monkeypatch.setattr(N, "_waterfill_numpy", boom)
    hops = np.array([[0, 1], [1, 2]])
    np.testing.assert_array_equal(allocate(hops, np.array([0, 0]), np.array([4.0, 2.0])), [1.0, 1.0])
    np.testing.assert_array_equal(waterfill(hops, np.ones(2), np.array([4.0, 2.0, np.inf])), [1.0, 1.0])
    assert N._KERNEL.lib is not None and list(tmp_path.glob("waterfill_*.so"))
    topo, w = build_llm(_tiny(), 16)
    assert Simulator(topo).run(w, make_policy("priority")).iteration_time > 0
    monkeypatch.setenv("FLOWLANE_SIM_NO_C", "1")  # and the switch really selects numpy
    with pytest.raises(AssertionError, match="numpy path ran"):
        allocate(hops, np.array([0, 0]), np.array([4.0, 2.0]))


def test_no_compiler_falls_back_to_numpy_with_a_warning(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setattr(N._KERNEL, "lib", False)
    monkeypatch.setenv("FLOWLANE_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.delenv("FLOWLANE_SIM_NO_C", raising=False)
    hops = np.array([[0, 1], [1, 2]])
    with pytest.warns(UserWarning, match="C rate-allocation kernel unavailable"):
        r = allocate(hops, np.array([0, 0]), np.array([4.0, 2.0]))
    np.testing.assert_array_equal(r, [1.0, 1.0])
    assert N._KERNEL.lib is None and not list(tmp_path.iterdir())  # no stray temporary file left behind


@pytest.mark.parametrize("no_c", ["", "1"])
@pytest.mark.parametrize(
    "call, match",
    [
        (
            lambda: allocate(np.array([[0, 1], [1, 7]]), np.zeros(2, int), np.ones(3)),
            r"hops\[1, 1\] = 7 is not a link index: it must be in \[0, 3\]",
        ),
        (
            lambda: allocate(np.array([[0, -1]]), np.zeros(1, int), np.ones(3)),
            r"hops\[0, 1\] = -1 is not a link index",
        ),
        (
            lambda: allocate(np.array([[0.0, 1.0]]), np.zeros(1, int), np.ones(3)),
            r"hops must be a 2-D integer array",
        ),
        (
            lambda: allocate(np.array([0, 1]), np.zeros(2, int), np.ones(3)),
            r"hops must be a 2-D integer .* shape \(2,\)",
        ),
        (
            lambda: allocate(np.array([[0, 1]]), np.zeros(2, int), np.ones(3)),
            r"cls must have shape \(1,\).* got \(2,\)",
        ),
        (
            lambda: allocate(np.array([[0, 1]]), np.zeros(1, int), np.ones((3, 1))),
            r"capacity must be a 1-D real array",
        ),
        (
            lambda: allocate(np.array([[0, 1]]), np.zeros(1, int), np.ones(3), sharing="fair"),
            r"sharing 'fair' is not one of",
        ),
        (
            lambda: allocate(
                np.array([[0, 1]]),
                np.zeros(1, int),
                np.ones(3),
                incast=IncastModel(),
                incast_links=np.ones(2, int),
            ),
            r"incast_links must have shape \(3,\).* got \(2,\)",
        ),
        (
            lambda: allocate(
                np.array([[0, 1]]),
                np.zeros(1, int),
                np.ones(3),
                incast=IncastModel(),
                incast_links=np.ones(3, int),
                incast_group=np.zeros(3, int),
            ),
            r"incast_group must have shape \(1,\).* got \(3,\)",
        ),
        (
            lambda: waterfill(np.array([[0, 1]]), np.ones(2), np.ones(3)),
            r"weights must be .* shape \(1,\).* got shape \(2,\)",
        ),
        (
            lambda: waterfill(np.array([[0, 3]]), np.ones(1), np.ones(3)),
            r"hops\[0, 1\] = 3 is not a link index",
        ),
        (
            lambda: waterfill(np.array([[0, 1]]), np.ones(1), np.ones(3), rtol=-1.0),
            r"rtol must be a finite number >= 0",
        ),
    ],
)
def test_bad_input_raises_a_clear_value_error_on_both_paths(
    monkeypatch: pytest.MonkeyPatch, no_c: str, call, match: str
) -> None:
    monkeypatch.setenv("FLOWLANE_SIM_NO_C", no_c)
    with pytest.raises(ValueError, match=match):
        call()
