"""The G3 memory-budget benchmark (benchmarks/g3_mem_budget.py, issue 34 item 4) on a small graph, and the allocator
peak it measures with (flowlane.testing.memory)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gnn
pytest.importorskip("dgl")
torch = pytest.importorskip("torch")

from flowlane.testing.memory import cpu_allocation_peak  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def test_allocation_peak_counts_what_the_block_allocates_and_marks():
    before = torch.ones(1 << 20)  # allocated before the block: not counted
    with cpu_allocation_peak() as p:
        a = torch.ones(1 << 20)  # 4 MiB
        p.mark("one")
        b = torch.ones(1 << 21)  # 8 MiB more: the peak
        del b
        p.mark("freed")
        del a, before  # a free of a block from before the block is not subtracted
    assert 12 << 20 <= p.peak_bytes < (12 << 20) + (1 << 20), p.peak_bytes
    assert (4 << 20) <= p.at_marks["one"] < (5 << 20), p.at_marks
    assert (4 << 20) <= p.at_marks["freed"] < (5 << 20), p.at_marks


def test_benchmark_records_bins_within_half_the_budget_and_a_refusal(tmp_path):
    out = tmp_path / "mb.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "g3_mem_budget.py"), "--nodes", "2000", "--repeats", "1"]
    cmd += ["--budgets", "none,4e6,1e4", "--out", str(out)]
    subprocess.run(cmd, check=True, cwd=ROOT, capture_output=True, timeout=300)
    doc = json.loads(out.read_text())
    none, budget, tiny = doc["points"]
    assert none["mem_budget_bytes"] is None and none["bins"] == 1
    assert budget["bins_within_half_budget"] and budget["bin_bytes_max"] <= 2e6 and budget["bins"] > 1
    assert budget["held_after_forward_bytes"] < none["held_after_forward_bytes"]
    assert "destination row" in tiny["refused"]
    assert "g3_mem_budget.py" in doc["provenance"]["command"]
