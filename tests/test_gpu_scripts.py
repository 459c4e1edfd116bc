"""The prepared GPU checks' logic on CPU: tests/gpu/harness.py (flags, rank launch, result envelope) through the
cheapest multi-rank check, SYNDICATE's, in its gloo dry run, and the offload bench's CPU smoke mode. The GPU runs
themselves happen on a lent machine."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.llm

ROOT = Path(__file__).resolve().parent.parent


def _run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """A GPU check's script, run from the repository root as run_all.sh runs it."""
    return subprocess.run(
        [sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=240, env=env
    )


def test_a_multi_rank_gpu_check_runs_its_logic_on_cpu_and_writes_its_envelope(tmp_path: Path) -> None:
    out = tmp_path / "syn.json"
    r = _run("tests/gpu/syndicate_nccl.py", "--backend", "gloo", "--device", "cpu", "--out", str(out))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    doc = json.loads(out.read_text())
    assert doc["ok"] is True and doc["world"] == 2 and doc["backend"] == "gloo"
    assert doc["label"].startswith("dry run on CPU") and doc["provenance"]["command"]
    assert all(r["mismatch"] is not None for r in doc["ranks"])  # the watchdog named the odd rank on both


def test_nccl_without_a_gpu_says_skip_and_writes_nothing(tmp_path: Path) -> None:
    out = tmp_path / "syn.json"
    r = _run(
        "tests/gpu/syndicate_nccl.py",
        "--out",
        str(out),
        env={"CUDA_VISIBLE_DEVICES": "", "PATH": "/usr/bin:/bin"},
    )
    assert r.returncode == 0 and r.stdout.startswith("SKIP: no CUDA device"), r.stdout + r.stderr
    assert not out.exists()


def test_the_offload_gpu_bench_runs_every_strategy_on_cpu_bitwise(tmp_path: Path) -> None:
    """tests/gpu/offload_bench.py's CPU smoke mode: every column runs, offloads bytes and gives keep's gradients, so a
    lent GPU's few minutes are not spent on a broken script."""
    out = tmp_path / "ob.json"
    r = _run("tests/gpu/offload_bench.py", "--device", "cpu", "--only-hidden", "64", "--out", str(out))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    doc = json.loads(out.read_text())
    assert doc["complete"] is True and doc["failed"] == [] and doc["label"].startswith("CPU smoke test")
    assert doc["provenance"]["command"].endswith(f"--out {out}")
    assert doc["fsdp2"]["grads_equal"] is True and doc["fsdp2"]["stats"]["param_skips"] > 0
    correctness = doc["correctness"]["strategies"]
    assert correctness["keep_repeat"]["grads_equal"] is True
    assert all(s["grads_equal"] is True for name, s in correctness.items() if name != "keep"), correctness
    (size,) = doc["sizes"]
    assert size["hidden"] == 64
    assert all(s["status"] == "ok" for s in size["strategies"].values()), size["strategies"]
    for name in (
        "flowlane",
        "flowlane_all",
        "flowlane_recompute",
        "flowlane_ssd",
        "flowlane_sublayer_recompute",
        "flowlane_sublayer_recompute_ordered",
    ):
        s = size["strategies"][name]
        assert s["grads_equal"] is True and s["stats"]["bytes_written"] > 0, (name, s)
        # the allocator's view at every block's forward end, then at every backward begin in reverse
        n = size["layers"]
        assert [t["at"] for t in s["allocator_timeline"]] == [f"forward end {i}" for i in range(n)] + [
            f"backward begin {i}" for i in reversed(range(n))
        ], (name, s["allocator_timeline"])
    assert (
        doc["megatron_fine_grained"]["ran"] is False
        and "Transformer Engine" in doc["megatron_fine_grained"]["reason"]
    )


def test_the_expandable_segments_offload_check_passes_its_settings_on(tmp_path: Path) -> None:
    """tests/gpu/offload_bench_expandable.py, run_all.sh's second offload check: the bench itself with the allocator
    setting and hidden 8192 only (no CPU size has it, so only the correctness sections run here), both recorded."""
    out = tmp_path / "obe.json"
    r = _run("tests/gpu/offload_bench_expandable.py", "--device", "cpu", "--out", str(out))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    doc = json.loads(out.read_text())
    assert doc["alloc_conf"] == "expandable_segments:True" and doc["complete"] is True and doc["sizes"] == []
    assert "--alloc-conf expandable_segments:True --only-hidden 8192" in doc["provenance"]["command"]
    assert doc["correctness"]["failed"] == [] and doc["fsdp2"]["grads_equal"] is True
