"""The `flowlane` command: help without importing torch, --version, and `flowlane sim` refusing bad input with the
flag, the value and what is allowed (issue 33, items 4, 5 and 7)."""

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from flowlane.cli import main

ROOT = Path(__file__).resolve().parent.parent


def _help_in_fresh_process(*argv: str) -> tuple[str, bool]:
    code = (
        "import sys\nfrom flowlane.cli import main\n"
        f"try:\n    main({list(argv)!r})\nexcept SystemExit:\n    pass\n"
        "print('TORCH', 'torch' in sys.modules)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    return r.stdout, "TORCH True" in r.stdout


def test_flowlane_help_lists_every_command_without_importing_torch():
    out, torch_loaded = _help_in_fresh_process("--help")
    assert not torch_loaded
    for cmd in ("doctor", "sim", "ssd-estimate", "--version"):
        assert cmd in out
    assert "sub-command lives in its own module" not in out  # a user's description, not the developer's


def test_sim_help_shows_defaults_and_policy_names_without_importing_torch():
    out, torch_loaded = _help_in_fresh_process("sim", "--help")
    assert not torch_loaded
    assert "(default: gpt3-13b)" in out and "(default: 32)" in out
    assert "hermod" in out and "fifo" in out
    # every option says its default (README): --routing, --sharing and --seed said none, --iterations "(default: None)"
    options = re.split(r"\n  (?=-)", out.split("options:", 1)[1])[1:]
    assert options and all("default" in o for o in options if not o.startswith("-h")), options
    assert "(default: None)" not in out


def test_ssd_estimate_help_shows_every_default_without_importing_torch():
    out, torch_loaded = _help_in_fresh_process("ssd-estimate", "--help")
    assert not torch_loaded
    assert (
        "hidden size h (default: 8192)" in out and "(default: D7-P5620)" in out and "(default: 55.0)" in out
    )
    assert "Korthikanti" in out  # the description: the formula the estimate follows


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert re.fullmatch(r"flowlane \S+.*\n", capsys.readouterr().out)


def _no_simulation(*a, **kw):
    raise AssertionError("simulated before the input was checked")


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--policy", ","], r"--policy ',' names no policy; choose from .*fifo"),
        (["--policy", "fifo,nosuch"], r"nosuch"),
        (["--microbatches", "0"], r"argument --microbatches: must be an integer >= 1, got '0'"),
        (["--iterations", "0"], r"argument --iterations: must be an integer >= 1, got '0'"),
        (["--incast-alpha", "-1"], r"argument --incast-alpha: must be a finite number >= 0, got '-1'"),
        (["--gpus", "1048576"], r"argument --gpus: must be an integer in \[1, 16384\], got '1048576'"),
        (["--gpus", "abc"], r"argument --gpus: must be an integer in \[1, 16384\], got 'abc'"),
        (["--bandwidth", "nan"], r"argument --bandwidth: must be a finite number > 0, got 'nan'"),
        (["--bandwidth", "0"], r"argument --bandwidth: must be a finite number > 0, got '0'"),
        (["--nics-per-server", "9"], r"argument --nics-per-server: must be an integer in \[0, 8\], got '9'"),
        (["--workload", "gpt5"], r"argument --workload: invalid choice: 'gpt5'"),
        (["--out", "{tmp}/a_file/out"], r"--out='.*a_file/out' is not a writable folder"),
        # a dense model has no all-to-all: the flag changed nothing but was recorded in sim.json
        (
            ["--ep-a2a", "matched"],
            r"--ep-a2a matched applies to MoE presets \(mixtral-8x7b.*\), not the dense 'gpt3-13b'",
        ),
    ],
)
def test_sim_refuses_bad_input_before_simulating(argv, match, capsys, monkeypatch, tmp_path):
    monkeypatch.setattr("flowlane.sim.cli.Simulator", _no_simulation)
    (tmp_path / "a_file").write_text("")
    argv = [a.format(tmp=tmp_path) for a in argv]
    try:
        code = main(["sim", "--no-plot", "--out", str(tmp_path / "out"), *argv])
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err
    assert code == 2, err
    assert re.search(match, err), err
    assert "Traceback" not in err


def test_sim_plot_labels_show_a_tenth_of_a_percent_and_zoom_when_bars_are_close():
    from flowlane.sim.output import speedup_label, time_axis

    assert speedup_label(1.001, 1.0) == "1.001x" and speedup_label(2.5, 1.0) == "2.50x"
    bottom, top, zoomed = time_axis([1.001, 1.0])
    assert zoomed and 0 < bottom < 1.0 and top > 1.001  # a 0.1 % difference is visible
    assert time_axis([2.0, 1.0]) == (0.0, 2.0 * 1.18, False)  # clear differences keep bars from 0


def test_sim_runs_and_writes_its_results(tmp_path, capsys):
    assert (
        main(
            [
                "sim",
                "--workload",
                "resnet50",
                "--gpus",
                "8",
                "--policy",
                "fifo,priority",
                "--no-plot",
                "--out",
                str(tmp_path),
            ]
        )
        == 0
    )
    assert (tmp_path / "sim.json").exists() and "speedup" in capsys.readouterr().out
    prov = json.loads((tmp_path / "sim.json").read_text())["provenance"]
    assert prov["commit"] and prov["command"]  # what produced the file, as every result JSON records


def test_sim_orders_hermod_by_the_workloads_interleaved_schedule(tmp_path):
    """The Hermod policy is built from the workload ``flowlane sim`` built (EP > PP > DP for interleaved 1F1B);
    made before the workload, it carried 1F1B's order and the simulator refused it."""
    argv = ["sim", "--workload", "gpt3-13b", "--gpus", "32", "--schedule", "interleaved"]
    assert main([*argv, "--policy", "fifo,hermod", "--no-plot", "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "sim.json").read_text())
    assert set(doc["results"]) == {"fifo", "hermod"} and doc["config"]["schedule"] == "interleaved"


def test_doctor_says_which_environment_it_reports_on():
    from flowlane.doctor import environment

    c = environment()
    assert sys.executable in c.detail and "Python 3." in c.detail
    assert ("lane 'llm'" in c.detail or "lane 'gnn'" in c.detail) == (
        Path(sys.prefix).name.startswith(".venv-")
    )


def test_default_output_folders_are_not_tracked_by_git():
    """A run's results must not land in folders git tracks (the gnn recipe wrote into committed benchmark results)."""
    import yaml

    if subprocess.run(["git", "-C", str(ROOT), "rev-parse"], capture_output=True).returncode:
        pytest.skip("not a git checkout")
    conf = ROOT / "recipes" / "conf"
    outs = [
        yaml.safe_load((conf / f"{n}.yaml").read_text()).get(k)
        for n, k in (("default", "output_dir"), ("moe", "output_dir"), ("gnn_fullgraph", "output_dir"))
    ]
    from flowlane.sim import cli as sim_cli

    parser = argparse.ArgumentParser()
    sim_cli.add_parser(parser.add_subparsers())
    outs.append(parser.parse_args(["sim"]).out)
    for out in outs:
        r = subprocess.run(["git", "-C", str(ROOT), "check-ignore", "-q", f"{out}/metrics.json"])
        assert r.returncode == 0, f"{out} is tracked by git"


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--kept-layers", "9", "--step-time", "1"], r"--kept-layers 9 is more than --layers 4"),
        ([], r"give --step-time \(seconds\) or --tflops"),
    ],
)
def test_a_command_that_refuses_its_input_exits_2_like_argparse(argv, match, capsys):
    """Usage errors exit 2 (argparse's code, what scripts test for), also those a command finds after parsing
    (ssd-estimate raised SystemExit with a message: exit 1, as if the estimate itself had failed)."""
    assert main(["ssd-estimate", *argv]) == 2
    err = capsys.readouterr().err
    assert re.search(match, err), err
    assert "Traceback" not in err


def test_doctor_reports_the_offload_tiers_and_transformer_engine(tmp_path: Path) -> None:
    from flowlane.doctor import _offload_tiers, _transformer_engine, checks
    from flowlane.offload.backends import probe_o_direct

    c = _offload_tiers(str(tmp_path))
    assert f"posix in {tmp_path}: " in c.detail
    assert ("O_DIRECT" in c.detail.split("posix in")[1].split(";")[0]) == probe_o_direct(tmp_path)
    assert list(tmp_path.iterdir()) == []  # the probe leaves nothing behind
    assert _transformer_engine().name == "Transformer Engine"
    assert [x.name for x in checks(str(tmp_path))].count("activation offload") == 1

    import flowlane.doctor as doctor

    with pytest.MonkeyPatch.context() as mp:  # a folder this user cannot write (root writes anywhere)
        mp.setattr(doctor.os, "access", lambda path, mode: False)
        assert f"posix in {tmp_path}: not writable by this user" in _offload_tiers(str(tmp_path)).detail


def test_doctor_probes_o_direct_in_a_private_folder_not_through_a_planted_symlink(tmp_path: Path) -> None:
    from flowlane.doctor import _offload_tiers

    shared, victim = tmp_path / "shared", tmp_path / "victim"
    shared.mkdir()
    victim.write_text("keep me")
    (shared / ".o_direct_probe").symlink_to(victim)  # another user's plant in a shared folder such as /tmp
    _offload_tiers(str(shared))
    assert victim.read_text() == "keep me"
    assert sorted(p.name for p in shared.iterdir()) == [".o_direct_probe"]  # and the private folder is gone


def test_doctor_refuses_an_offload_dir_that_is_not_a_directory(tmp_path: Path) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "flowlane.cli", "doctor", "--offload-dir", str(tmp_path / "missing")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    # one prefix, argparse's exit code (it printed "flowlane doctor: error: flowlane doctor: --offload-dir ...")
    assert r.returncode == 2, r.stderr
    assert (
        r.stderr
        == f"flowlane doctor: error: --offload-dir {str(tmp_path / 'missing')!r} is not a directory\n"
    )
