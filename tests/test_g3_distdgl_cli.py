"""The G3-vs-DistDGL benchmark's sweep options (benchmarks/g3_distdgl.py, issue 34 item 5): configs and errors."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gnn

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("g3_distdgl", ROOT / "benchmarks" / "g3_distdgl.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def test_sweep_crosses_layers_with_uniform_fanouts():
    assert bench.sweep_configs("2,4", "5,25", "10,10") == [
        (2, [5, 5]),
        (2, [25, 25]),
        (4, [5, 5, 5, 5]),
        (4, [25, 25, 25, 25]),
    ]


def test_explicit_fanout_sets_the_layer_count():
    assert bench.sweep_configs("", "", "25,10") == [(2, [25, 10])]
    assert bench.sweep_configs("3", "", "15,10,5") == [(3, [15, 10, 5])]


@pytest.mark.parametrize(
    ("layers", "fanouts", "fanout", "match"),
    [
        ("3", "", "10,10", "has 2 layers but --layers='3'"),
        ("2,x", "5", "", "--layers='2,x': expected comma-separated integers"),
        ("0,2", "5", "", r"--layers='0,2': every value must be in \[1, 6\], got \[0\]"),
        ("2", "5,0", "", r"--fanouts='5,0': every value must be in \[1, 1000\], got \[0\]"),
        ("2", "5,5", "", "--fanouts='5,5': repeated values"),
        ("", "", "10,-3", "--fanout='10,-3': each value must be >= 1"),
    ],
)
def test_bad_sweeps_are_refused_naming_the_value(layers, fanouts, fanout, match):
    with pytest.raises(ValueError, match=match):
        bench.sweep_configs(layers, fanouts, fanout)


def test_cli_refuses_a_bad_sweep_before_any_work():
    cmd = [sys.executable, str(ROOT / "benchmarks" / "g3_distdgl.py"), "--layers", "2,9", "--fanouts", "10"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "--layers='2,9': every value must be in [1, 6], got [9]" in out.stderr
