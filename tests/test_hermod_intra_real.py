"""benchmarks.hermod_intra_real without a network: the matrices, the lower bound, the simulator calibration (alpha fit)
and argument checks. The measured part needs root and network namespaces (run the benchmark; README "Hermod")."""

from __future__ import annotations

import json

import numpy as np
import pytest

from benchmarks.hermod_intra_real import (
    draw_matrices,
    fit_alpha,
    lower_bound_s,
    main,
    simulate_cct,
    summarise,
)
from flowlane.sim.graph import SimSpecError
from flowlane.sim.workloads import zipf_token_matrix

pytestmark = pytest.mark.timeout(120)

CFG = {
    "ranks": 4,
    "rate_mbit": 100.0,
    "matrices": 2,
    "rounds": 3,
    "tokens": 64,
    "top_k": 2,
    "experts_per_rank": 2,
    "skew": 1.0,
    "hidden": 256,
    "quantum": 1,
    "algorithms": ["plain", "bvn"],
    "seed": 3,
    "timeout_s": 60,
}


def test_zipf_token_matrix_routes_every_token_and_skews_with_the_exponent() -> None:
    m = zipf_token_matrix(np.random.default_rng(0), 4, 8, 100, 2, 0.0)
    assert m.shape == (4, 4) and m.dtype.kind == "i"
    assert (m.sum(1) == 200).all()  # dropless: tokens * top_k per rank
    again = zipf_token_matrix(np.random.default_rng(0), 4, 8, 100, 2, 0.0)
    assert (m == again).all()  # seeded: every rank draws the same matrix
    flat = zipf_token_matrix(np.random.default_rng(1), 8, 64, 4096, 2, 0.0).sum(0)
    steep = zipf_token_matrix(np.random.default_rng(1), 8, 64, 4096, 2, 1.5).sum(0)
    assert steep.max() / steep.mean() > 1.5 > flat.max() / flat.mean()  # a hot receiver appears with the skew
    with pytest.raises(SimSpecError, match="num_experts=6"):
        zipf_token_matrix(np.random.default_rng(0), 4, 6, 10, 1, 0.5)
    with pytest.raises(SimSpecError, match="skew=-1"):
        zipf_token_matrix(np.random.default_rng(0), 4, 8, 10, 1, -1)


def test_lower_bound_is_the_busiest_port_without_local_rows() -> None:
    m = [[100, 1, 2], [3, 100, 4], [20, 5, 100]]  # column 0 receives 23 rows, row 2 sends 25: the bound is 25
    assert lower_bound_s(m, 1000, 8.0) == pytest.approx(25 * 1000 * 8 / 8e6)


def test_fit_alpha_recovers_the_penalty_the_simulator_was_run_with() -> None:
    m = draw_matrices(CFG)[0]
    for alpha in (0.0, 0.3, 1.2):
        t = simulate_cct(m, 1024, 100.0, "plain", alpha)
        assert fit_alpha(m, 1024, 100.0, t) == pytest.approx(alpha, abs=1e-3)
    assert fit_alpha(m, 1024, 100.0, 1e-9) == 0.0  # faster than incast-free: no penalty
    assert fit_alpha(m, 1024, 100.0, 1e9, hi=2.0) == 2.0  # slower than the search range: its end


def test_phases_avoid_the_simulated_penalty_that_slows_the_plain_all_to_all() -> None:
    m = draw_matrices(CFG)[0]
    plain0, phases0 = (simulate_cct(m, 1024, 100.0, k, 0.0) for k in ("plain", "phases"))
    plain, phases = (simulate_cct(m, 1024, 100.0, k, 0.5) for k in ("plain", "phases"))
    assert plain > 1.3 * plain0  # 3 senders into a port lose capacity
    assert phases < plain and phases == pytest.approx(phases0, rel=0.05)  # incast-free: (almost) no penalty
    assert simulate_cct(m, 1024, 100.0, "phases", 0.0, quantum=8) >= phases0  # coarser units only pad


def test_summarise_calibrates_goodput_overhead_and_alpha_from_the_measurements() -> None:
    """Fabrics made from the simulator itself: goodput 80 %, 2 ms per phase flow, no incast at 1024 KiB and alpha 0.4
    at 64 KiB (phases unaffected: they are incast-free). The summary must find exactly that."""
    mats = draw_matrices(CFG)
    row = CFG["hidden"] * 4
    phases = [simulate_cct(m, row, 80.0, "phases", 0.0, 1, 0.002) for m in mats]

    def fabric(kb: float, alpha: float) -> dict:
        plain = [simulate_cct(m, row, 80.0, "plain", alpha) for m in mats]
        return {
            "buffer_kb": kb,
            "cct_s": {"plain": [[t] * 3 for t in plain], "bvn": [[t] * 3 for t in phases]},
        }

    s = summarise(CFG, [fabric(64, 0.4), fabric(1024, 0.0)])
    assert s["goodput_fraction"] == pytest.approx(0.8, rel=1e-3)  # not exact: link latency is not scaled
    assert s["phase_overhead_s"] == pytest.approx(0.002, rel=0.02)
    deep, shallow = s["rows"]
    assert deep["buffer_kb"] == 1024 and deep["fitted_incast_alpha"] == pytest.approx(0.0, abs=1e-3)
    assert shallow["fitted_incast_alpha"] == pytest.approx(0.4, abs=1e-3)
    assert shallow["simulated_at_fitted_alpha_s"]["phases"] == pytest.approx(
        sorted(phases)[len(phases) // 2], rel=0.02
    )
    assert shallow["speedup_vs_plain"]["bvn"] > deep["speedup_vs_plain"]["bvn"]
    assert shallow["cct_over_lower_bound"]["plain"] > deep["cct_over_lower_bound"]["plain"]


def test_a_given_goodput_recovers_the_penalty_where_even_the_deepest_buffer_has_incast(tmp_path) -> None:  # noqa: ANN001
    """Wide fan-in: every buffer loses (alpha 0.2 and 0.5). Fitting goodput on the deepest one would absorb its
    penalty (alpha 0 there); the goodput given from elsewhere (--goodput) recovers both alphas."""
    mats = draw_matrices(CFG)
    row = CFG["hidden"] * 4

    def fabric(kb: float, alpha: float) -> dict:
        return {
            "buffer_kb": kb,
            "cct_s": {
                "plain": [[simulate_cct(m, row, 80.0, "plain", alpha)] * 3 for m in mats],
                "bvn": [[simulate_cct(m, row, 80.0, "phases", 0.0)] * 3 for m in mats],
            },
        }

    fabrics = [fabric(8192, 0.2), fabric(64, 0.5)]
    fitted = summarise(CFG, fabrics)
    assert fitted["goodput_source"] == "fitted on the deepest buffer"
    assert fitted["goodput_fraction"] < 0.75 and fitted["rows"][0]["fitted_incast_alpha"] == pytest.approx(
        0, abs=0.01
    )
    given = summarise({**CFG, "goodput": 0.8}, fabrics)
    assert given["goodput_source"] == "given (--goodput)" and given["goodput_fraction"] == 0.8
    assert [r["fitted_incast_alpha"] for r in given["rows"]] == pytest.approx([0.2, 0.5], abs=0.01)
    out = tmp_path / "r.json"
    out.write_text(json.dumps({"config": CFG, "fabrics": fabrics}))
    assert main(["--summarise-only", "--goodput", "0.8", "--out", str(out)]) == 0
    got = json.loads(out.read_text())
    assert got["config"]["goodput"] == 0.8 and got["summary"]["goodput_source"] == "given (--goodput)"


def test_summarise_only_rewrites_the_summary_from_stored_times(tmp_path) -> None:  # noqa: ANN001
    mats = draw_matrices(CFG)
    t = [simulate_cct(m, 1024, 100.0, "plain", 0.0) for m in mats]
    doc = {
        "config": CFG,
        "fabrics": [
            {"buffer_kb": 1024, "cct_s": {"plain": [[x] * 3 for x in t], "bvn": [[2 * x] * 3 for x in t]}}
        ],
    }
    out = tmp_path / "r.json"
    out.write_text(json.dumps(doc))
    assert main(["--summarise-only", "--out", str(out)]) == 0
    got = json.loads(out.read_text())
    assert got["summary"]["rows"][0]["speedup_vs_plain"]["bvn"] == pytest.approx(0.5)
    assert (tmp_path / "r.png").stat().st_size > 0
    with pytest.raises(SystemExit, match="does not exist"):
        main(["--summarise-only", "--out", str(tmp_path / "missing.json")])


@pytest.mark.parametrize(
    ("args", "msg"),
    [
        (["--algorithms", "bvn,plain"], "--algorithms must start with plain"),
        (["--algorithms", "plain,ring"], "--algorithms must start with plain"),
        (["--ranks", "2"], "--ranks must be >= 3"),
        (["--quantum", "0"], "--quantum must be >= 1"),
        (["--buffers-kb", "64,x"], "--buffers-kb must be comma-separated numbers, got '64,x'"),
        (["--buffers-kb", "0"], "--buffers-kb must be numbers > 0"),
        (["--skew", "-0.5"], "--skew must be >= 0, got -0.5"),
        (["--tcp-wmem", "64k"], "--tcp-wmem must be three byte counts 'min default max', got '64k'"),
        (["--goodput", "1.5"], r"--goodput must be a fraction of the link rate in \(0, 1\], got 1.5"),
        (["--goodput", "0"], r"--goodput must be a fraction of the link rate in \(0, 1\], got 0.0"),
    ],
)
def test_bad_arguments_are_refused_before_any_network_is_built(args: list[str], msg: str) -> None:
    with pytest.raises(SystemExit, match=msg):
        main(args)
