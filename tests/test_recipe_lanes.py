"""A recipe run from the lane without its framework is refused before any rank starts, naming the Python and the
lane to use (a gnn recipe in the llm lane was a ModuleNotFoundError in Hydra's traceback; the GPT recipe in the gnn
lane started 4 ranks that each failed on ``import megatron``). Runs in both lanes: each lacks the other's framework."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from recipes.train import run_job
from recipes.validate import ConfigError

# job -> (its framework, the lane that has it)
LANES = {"gpt": ("megatron.core", "llm"), "gnn_fullgraph": ("dgl", "gnn"), "gnn_dgs": ("dgl", "gnn")}


def _has(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:
        return False


# the jobs this lane cannot run (one environment cannot hold both Megatron-core and DGL)
MISSING = [job for job, (module, _) in LANES.items() if not _has(module)]


def _no_ranks(*a, **kw):
    raise AssertionError("ranks were started for a job this lane cannot run")


def test_each_lane_lacks_the_other_lanes_framework():
    assert MISSING and len(MISSING) < len(LANES), MISSING


@pytest.mark.parametrize("job", MISSING)
def test_a_job_from_the_wrong_lane_names_the_lane_to_run_it_from(job, tmp_path, monkeypatch):
    monkeypatch.setattr("flowlane.launch.launch", _no_ranks)
    lane = LANES[job][1]
    with pytest.raises(ConfigError) as e:
        run_job({"job": job, "output_dir": str(tmp_path / "out")})
    assert sys.executable in str(e.value) and f".venv-{lane}/bin/flowlane-train" in str(e.value), e.value
    assert not (tmp_path / "out").exists()


def test_flowlane_train_from_the_wrong_lane_prints_one_line_and_exits_2(tmp_path):
    job = MISSING[0]
    exe = Path(sys.executable).parent / "flowlane-train"
    name = [] if job == "gpt" else ["--config-name", job]
    r = subprocess.run(
        [str(exe), *name, f"output_dir={tmp_path}/out", f"hydra.run.dir={tmp_path}/hydra"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 2, r.stderr[-3000:]
    assert r.stderr.startswith(f"flowlane-train: error: recipe job {job!r} needs "), r.stderr[-3000:]
    assert "Traceback" not in r.stderr and "rank" not in r.stderr
