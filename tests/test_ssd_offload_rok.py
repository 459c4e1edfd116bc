"""The ROK curve benchmark (benchmarks/ssd_offload_rok.py): its frontier and budget arithmetic, and one tiny run of
it (which runs benchmarks/ssd_offload_bench.py's measurement per micro-batch) writing its JSON and plot."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import ssd_offload_rok as rok  # noqa: E402

pytestmark = pytest.mark.llm


def _p(strategy: str, b: int, mem: float, thr: float) -> dict:
    return {"strategy": strategy, "micro_batch": b, "peak_bytes": mem, "throughput": thr}


def test_the_frontier_keeps_only_undominated_points_sorted_by_memory() -> None:
    pts = [
        _p("keep", 1, 10, 5.0),
        _p("offload", 1, 4, 5.0),  # dominates keep B=1: less memory, same throughput
        _p("recompute", 1, 2, 3.0),
        _p("keep", 2, 20, 8.0),
        _p("recompute", 2, 4, 4.0),  # dominated by offload B=1
    ]
    front = rok.pareto_front(pts)
    assert [(p["strategy"], p["micro_batch"]) for p in front] == [
        ("recompute", 1),
        ("offload", 1),
        ("keep", 2),
    ]
    assert rok.largest_batch_within(pts, "recompute", 4) == 2
    assert rok.largest_batch_within(pts, "keep", 9) is None


def test_micro_batches_are_checked_by_name() -> None:
    assert rok._batches("4,1,2,2") == [1, 2, 4]
    for bad in ("0,1", "a", ""):
        with pytest.raises(Exception, match="--micro-batches"):
            rok._batches(bad)


def test_a_tiny_rok_run_writes_points_frontier_and_plot(tmp_path: Path) -> None:
    cmd = [sys.executable, "benchmarks/ssd_offload_rok.py", "--micro-batches", "1,2", "--layers", "3", "--hidden",
           "64", "--heads", "4", "--seq", "32", "--steps", "1", "--min-bytes", "1024", "--out", str(tmp_path),
           "--tag", "t"]  # fmt: skip
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    doc = json.loads((tmp_path / "rok_t.json").read_text())
    assert (tmp_path / "rok_t.png").stat().st_size > 0
    assert {(p["strategy"], p["micro_batch"]) for p in doc["points"]} == {
        (s, b) for s in ("keep", "offload", "recompute") for b in (1, 2)
    }
    by = {(p["strategy"], p["micro_batch"]): p for p in doc["points"]}
    # the same model FLOPs for every strategy at one B (recomputation does not count), twice as many at B=2
    assert (
        by["keep", 2]["model_flops"]
        == by["recompute", 2]["model_flops"]
        == 2 * by["offload", 1]["model_flops"]
    )
    assert by["offload", 2]["peak_bytes"] < by["keep", 2]["peak_bytes"]
    assert all(run["offload"]["grads_bitwise_equal_to_keep"] for run in doc["runs"])
    assert all(isinstance(p["minor_page_faults"], int | float) for p in doc["points"])
    assert doc["frontier"] and doc["provenance"]["command"]
