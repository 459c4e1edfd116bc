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
#: the offload benches' own time budget and stack-dump deadline off: on a loaded machine they would skip columns or
#: exit; the subprocess timeout still catches a hang
NO_TIME_LIMITS = ("--budget-s", "1e9", "--hard-s", "1e9")


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
    r = _run(
        "tests/gpu/offload_bench.py",
        "--device",
        "cpu",
        "--only-hidden",
        "64",
        *NO_TIME_LIMITS,
        "--out",
        str(out),
    )
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
    # release="stream_order" did drop layers in stream order (a miss would fall back to record_stream)
    ordered = size["strategies"]["flowlane_sublayer_recompute_ordered"]["stats"]
    assert ordered["ordered_releases"] > 0 and ordered["ordered_release_misses"] == 0, ordered


def test_the_expandable_segments_offload_check_passes_its_settings_on(tmp_path: Path) -> None:
    """tests/gpu/offload_bench_expandable.py, run_all.sh's second offload check: the bench itself with the allocator
    setting and hidden 8192 only (no CPU size has it, so only the correctness sections run here), both recorded."""
    out = tmp_path / "obe.json"
    r = _run("tests/gpu/offload_bench_expandable.py", "--device", "cpu", *NO_TIME_LIMITS, "--out", str(out))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    doc = json.loads(out.read_text())
    assert doc["alloc_conf"] == "expandable_segments:True" and doc["complete"] is True and doc["sizes"] == []
    assert "--alloc-conf expandable_segments:True --only-hidden 8192" in doc["provenance"]["command"]
    assert doc["correctness"]["failed"] == [] and doc["fsdp2"]["grads_equal"] is True


def test_the_megatron_offload_bench_runs_megatrons_and_flowlanes_offload_on_cpu_bitwise(
    tmp_path: Path,
) -> None:
    """tests/gpu/megatron_offload_bench.py's CPU smoke mode: Megatron-core's GPT under its own schedule, with its own
    fine-grained offloading (through the bench's stand-in for TE's flag) and with flowlane's, every column's gradients
    equal to stock Megatron-core's and both offloads moving bytes."""
    out = tmp_path / "mob.json"
    r = _run("tests/gpu/megatron_offload_bench.py", "--device", "cpu", *NO_TIME_LIMITS, "--out", str(out))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    doc = json.loads(out.read_text())
    assert doc["complete"] is True and doc["failed"] == [] and doc["label"].startswith("CPU smoke test")
    assert doc["te_offload_flag_stand_in"] is True  # no Transformer Engine in this lane
    assert doc["correctness"]["keep_bitwise_reproducible"] is True  # so a difference below would be a failure
    (size,) = doc["sizes"]
    for section in (doc["correctness"], size):
        st = section["strategies"]
        assert list(st) == [
            "keep",
            "keep_repeat",
            "mcore_recompute",
            "mcore_offload",
            "mcore_offload_recompute_mlp",
            "flowlane",
            "flowlane_recompute",
            "flowlane_sublayer_recompute",
            "mcore_offload_flowlane",
        ]
        assert all(s["status"] == "ok" for s in st.values()), st
        assert all(s["grads_equal"] is True for n, s in st.items() if n != "keep"), st
        for name in ("mcore_offload", "mcore_offload_recompute_mlp", "mcore_offload_flowlane"):
            moved = st[name]["stats"]["offload_summary_bytes"]
            assert set(moved) == {"attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm"}, moved
            assert all(b > 0 for b in moved.values()), moved
        for name in (
            "flowlane",
            "flowlane_recompute",
            "flowlane_sublayer_recompute",
            "mcore_offload_flowlane",
        ):
            assert st[name]["stats"]["bytes_written"] > 0, (name, st[name])
        assert st["flowlane_sublayer_recompute"]["config"]["flowlane"]["scope_classes"] == [
            "SelfAttention",
            "MLP",
        ]
        # on top of Megatron's offloading flowlane stores only what Megatron's groups leave: fewer bytes than alone
        both, alone = st["mcore_offload_flowlane"]["stats"], st["flowlane"]["stats"]
        assert 0 < both["bytes_written"] < alone["bytes_written"], (both, alone)


def test_the_megatron_offload_bench_judges_flowlane_at_no_more_memory_than_megatron() -> None:
    """The bench's verdict per Megatron offloading column: the fastest flowlane column whose allocated *and* reserved
    peaks are both no higher, and whether it is faster; the issue's goals on both peaks at <= 5 % step time."""
    sys.path.insert(0, str(ROOT / "tests" / "gpu"))
    try:
        import megatron_offload_bench as mob
    finally:
        sys.path.remove(str(ROOT / "tests" / "gpu"))

    def col(step: float, alloc: float, reserved: float) -> dict:
        return {
            "step_s": step,
            "time_ratio_vs_keep": step,
            "act_mem_ratio_vs_keep": alloc,
            "reserved_ratio_vs_keep": reserved,
        }

    size = {
        "hidden": 8192,
        "strategies": {
            "mcore_offload": col(1.10, 0.60, 0.70),
            "mcore_offload_recompute_mlp": col(1.20, 0.25, 0.30),
            "flowlane": col(1.00, 0.40, 0.90),  # less allocated, more reserved: not at equal memory
            "flowlane_recompute": col(1.03, 0.35, 0.65),
            "flowlane_sublayer_recompute": col(1.04, 0.20, 0.25),
        },
    }
    mob._judge(size)
    vs = size["vs_megatron_offload"]
    assert vs["mcore_offload"]["flowlane_at_no_more_memory"] == "flowlane_recompute"
    assert vs["mcore_offload"]["faster_at_equal_memory"] is True
    assert vs["mcore_offload_recompute_mlp"]["flowlane_at_no_more_memory"] == "flowlane_sublayer_recompute"
    assert vs["mcore_offload_recompute_mlp"]["faster_at_equal_memory"] is True
    goal = size["goal"]
    assert goal["flowlane_sublayer_recompute"]["met"] is True  # 80 % and 75 % less at 1.04x
    assert goal["flowlane_recompute"]["met"] is False and goal["flowlane"]["met"] is False
    # slower than Megatron's: no longer faster
    size["strategies"]["flowlane_sublayer_recompute"]["step_s"] = 1.30
    mob._judge(size)
    assert size["vs_megatron_offload"]["mcore_offload_recompute_mlp"]["faster_at_equal_memory"] is False
