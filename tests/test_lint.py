"""The code base stays ruff-clean, and the pure core mypy-clean (configuration in pyproject.toml)."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_ruff_reports_no_problems():
    ruff = Path(sys.executable).parent / "ruff"
    if not ruff.exists():
        ruff = shutil.which("ruff")
    if ruff is None:
        pytest.fail("ruff is not installed in this lane (it is in the dev dependency group)")
    paths = [
        "flowlane",
        "megatron_plugin",
        "deepspeed_plugin",
        "dgl_plugin",
        "recipes",
        "benchmarks",
        "tests",
    ]
    r = subprocess.run([str(ruff), "check", *paths], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout[-4000:]
    # formatted once with `ruff format` (the commit is in .git-blame-ignore-revs) and kept so
    r = subprocess.run([str(ruff), "format", "--check", "."], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, "run `ruff format .`:\n" + r.stdout[-4000:]


@pytest.mark.once
def test_mypy_reports_no_problems_on_the_pure_core():
    """mypy on the torch-free core (issue 29 item 5): the files and settings are pyproject.toml's [tool.mypy]."""
    mypy = Path(sys.executable).parent / "mypy"
    if not mypy.exists():
        pytest.fail("mypy is not installed in this lane (it is in the dev dependency group)")
    r = subprocess.run([str(mypy)], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
