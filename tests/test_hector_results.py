"""Hector's CPU benchmark summaries (benchmarks/hector_cpu.py, results/hector/cpu_*.json; both lanes, no DGL): the
speedup is the median of the per-rep paired ratios, and every stored result file agrees with its own per-rep times.
"""

from __future__ import annotations

import importlib.util
import json
import statistics
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RESULTS = sorted((ROOT / "results" / "hector").glob("cpu_*.json"))


def _bench():
    spec = importlib.util.spec_from_file_location("hector_cpu_bench", ROOT / "benchmarks" / "hector_cpu.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_speedup_is_the_median_of_paired_ratios_not_a_ratio_of_separate_medians():
    # rep 2: DGL slowed by load while Hector's rep ran fast at another moment; each rep's own ratio is ~1
    row = {
        "model": "hgt",
        "edges": 10,
        "dgl_steps_s": [1.0, 9.0, 10.0],
        "hector_steps_s": [1.0, 1.0, 9.0],
        "hector_first_step_s": 3.0,
    }
    r = _bench().summarise(row)
    assert r["speedup"] == pytest.approx(10.0 / 9.0)  # median of 1, 9, 1.11
    assert r["speedup_of_medians"] == pytest.approx(9.0 / 1.0)
    assert r["speedup_min_vs_min"] == pytest.approx(1.0)
    assert (r["dgl_step_s"], r["hector_step_s"], r["hector_preprocess_s_est"]) == (9.0, 1.0, 2.0)
    with pytest.raises(ValueError, match="unequal length 3 / 2"):
        _bench().summarise({**row, "hector_steps_s": [1.0, 1.0]})


@pytest.mark.parametrize("path", RESULTS, ids=[p.name for p in RESULTS])
def test_stored_results_report_the_median_paired_speedup_of_their_own_reps(path):
    doc = json.loads(path.read_text())
    assert "median over reps of dgl_steps_s[i] / hector_steps_s[i]" in doc["speedup_method"]
    for r in doc["rows"]:
        td, th = r["dgl_steps_s"], r["hector_steps_s"]
        assert r["speedup"] == pytest.approx(statistics.median(d / h for d, h in zip(td, th, strict=True)))
        assert r["speedup_of_medians"] == pytest.approx(statistics.median(td) / statistics.median(th))
