"""`flowlane-train` refuses a bad config in the launching process, before any rank starts, naming the key as written
on the command line (issue 33, items 4-6)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.llm
pytest.importorskip("megatron.core")

from recipes.train import run_job  # noqa: E402
from recipes.validate import ConfigError  # noqa: E402


def _no_ranks(*a, **kw):
    raise AssertionError("ranks were started before the config was checked")


@pytest.fixture
def no_launch(monkeypatch):
    monkeypatch.setattr("flowlane.launch.launch", _no_ranks)


def _cases(tmp: Path):
    (tmp / "a_file").write_text("")
    ssd = {"enabled": True, "backend": "posix"}
    return [
        ({"output_dir": str(tmp / "a_file" / "out")}, r"output_dir='.*a_file/out' is not a writable folder"),
        ({"offload": {**ssd, "backend": "foo"}}, r"offload.backend='foo' must be one of \['posix'"),
        ({"offload": {"enabled": "no"}}, r"offload.enabled='no' must be true or false"),
        (
            {"offload": {**ssd, "dirs": [str(tmp / "nvme0-typo")]}},
            r"offload.dirs entry '.*nvme0-typo' is not an "
            r"existing folder",
        ),
        ({"offload": {**ssd, "min_bytes": 1.5}}, r"offload.min_bytes=1.5 must be an integer"),
        (
            {"scheduler": {"name": "hermod", "max_inflight_buckets": "two"}},
            r"scheduler.max_inflight_buckets='two' must be an integer",
        ),
        ({"scheduler": {"name": "fifo"}}, r"scheduler.name='fifo' must be one of \['none', 'hermod'\]"),
        ({"lr": "abc"}, r"lr='abc' must be a finite number"),
        ({"iterations": True}, r"iterations=True must be an integer"),
        ({"timeout_s": 0}, r"timeout_s=0 must be > 0 and at most 31536000 seconds"),
        # Megatron-core's and ALEPH's checks, which failed in every rank after start-up (exit 1, not 2)
        (
            {"world_size": 6, "tensor_parallel": 3},
            r"num_attention_heads=4 must be divisible by tensor_parallel=3",
        ),
        ({"vocab_size": 255, "tensor_parallel": 2}, r"vocab_size=255 must be divisible by tensor_parallel=2"),
        (
            {"num_moe_experts": 4, "tensor_parallel": 2},
            r"num_moe_experts=4 needs tensor_parallel=1, got 2: .*expert tensor-parallel size 1",
        ),
        ({"dp_bucket_bytes": 0}, r"dp_bucket_bytes=0 must be an integer >= 4"),
        ({"dp_bucket_bytes": -5}, r"dp_bucket_bytes=-5 must be an integer >= 4"),
        ({"timeout_s": 1e14}, r"timeout_s=100000000000000.0 must be > 0 and at most 31536000 seconds"),
        (
            {"dp_collective": {"name": "aleph", "top": "ps", "clusters": "0,1,2"}},
            r"dp_collective.clusters='0,1,2' cover 3 ranks; the data-parallel group has 2 \(world_size=4 / "
            r"\(pipeline_parallel=2 x tensor_parallel=1\)\)",
        ),
        (
            {"dp_collective": {"name": "aleph", "top": "ps", "bandwidth_gbps": "10,20,30"}},
            r"dp_collective.bandwidth_gbps='10,20,30' has 3 figures; the data-parallel group has 2 ranks",
        ),
        (
            {"dp_collective": {"name": "aleph", "top": "allreduce", "clusters": "0;1"}},
            r"dp_collective.top='allreduce' with a hierarchical plan needs a single data-parallel group, but the "
            r"recipe has 2 groups of 2 ranks",
        ),
        (
            {
                "dp_collective": {"name": "aleph", "top": "ps", "clusters": "0,1"},
                "num_moe_experts": 4,
                "expert_parallel": 2,
            },
            r"dp_collective=aleph on a MoE model \(num_moe_experts=4\) needs dp_collective.expert_bandwidth_gbps",
        ),
        (
            {
                "dp_collective": {"name": "aleph", "top": "ps", "clusters": "0,1", "expert_clusters": "0,1"},
                "num_moe_experts": 4,
                "expert_parallel": 2,
            },
            r"dp_collective.expert_clusters='0,1' cover 2 ranks; the expert-data-parallel group has 1 \(2 / "
            r"expert_parallel=2\)",
        ),
    ]


@pytest.mark.parametrize("i", range(21))
def test_a_bad_gpt_config_is_refused_before_any_rank_starts(tmp_path, no_launch, i):
    override, match = _cases(tmp_path)[i]
    with pytest.raises(ConfigError, match=match):
        run_job({"job": "gpt", "output_dir": str(tmp_path / "out"), **override})
    assert not (tmp_path / "nvme0-typo").exists()  # a mistyped offload dir is not created


def test_the_recipes_timeout_errors_name_timeout_s(tmp_path, monkeypatch):
    """The launcher's timeout errors told a recipe's user to raise startup_timeout (no recipe key) and never named
    timeout_s: the recipe names its key to the launcher (tests/test_launch_faults.py checks the messages)."""
    seen: dict = {}

    def capture(fn, nprocs, **kw):
        seen.update(kw)
        raise RuntimeError("captured")

    monkeypatch.setattr("flowlane.launch.launch", capture)
    with pytest.raises(RuntimeError, match="captured"):
        run_job({"job": "gpt", "output_dir": str(tmp_path / "out"), "timeout_s": 42.0})
    assert seen["timeout"] == 42.0 and seen["timeout_key"] == "timeout_s", seen


def test_flowlane_train_prints_one_clear_error_and_exits_2(tmp_path):
    exe = Path(sys.executable).parent / "flowlane-train"
    r = subprocess.run(
        [
            str(exe),
            "offload=ssd",
            "offload.backend=foo",
            f"output_dir={tmp_path}/out",
            f"hydra.run.dir={tmp_path}/hydra",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 2, r.stderr[-3000:]
    assert "flowlane-train: error: offload.backend='foo' must be one of" in r.stderr
    assert "Traceback" not in r.stderr and "rank" not in r.stderr


def test_known_third_party_noise_is_filtered_in_the_ranks_unless_verbose():
    from recipes.train import quiet_known_warnings

    code = (
        "import warnings\n"
        "warnings.warn('Apex is not installed. Falling back to Torch Norm')\n"
        "warnings.warn('Transformer Engine and Apex are not installed. Falling back to Torch optimizers.')\n"
        "warnings.warn('a warning of our own')\n"
    )
    for verbose, hidden in (("", True), ("1", False)):
        env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}
        env["FLOWLANE_VERBOSE"] = verbose
        quiet_known_warnings(env)  # what flowlane-train does before its ranks are spawned
        r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
        assert "a warning of our own" in r.stderr
        assert ("Apex is not installed" not in r.stderr) == hidden, r.stderr


def test_flowlane_train_exit_codes(capsys):
    from flowlane.launch import LaunchInterrupted, RankFailedError
    from recipes.train import _exit_code

    assert _exit_code(LaunchInterrupted(15, 4)) == 143 and _exit_code(LaunchInterrupted(2, 4)) == 130
    assert _exit_code(ConfigError("lr='abc' must be a finite number")) == 2
    assert _exit_code(RankFailedError(3, "boom")) == 1
    err = capsys.readouterr().err
    assert "flowlane-train: interrupted by SIGTERM: all 4 ranks were stopped" in err
    assert "flowlane-train: error: lr='abc'" in err and "flowlane-train: rank 3 failed:\nboom" in err


def test_the_summary_says_which_features_were_on_and_what_fell_back():
    from recipes.train import feature_lines

    assert feature_lines({"scheduler": {"name": "none"}, "offload": {"enabled": False}}, {}) == [
        "features: none"
    ]
    per_rank = [{"feature_stats": {"SSDOffload": {"fallbacks": 147, "io_errors": 147}}}] * 2
    lines = feature_lines(
        {"scheduler": {"name": "hermod"}, "offload": {"enabled": True, "backend": "posix"}},
        {"per_rank": per_rank},
    )
    assert lines[0] == "features: scheduler=hermod (ep_algorithm=bvn); offload=posix (system temp folder)"
    assert lines[1].startswith("warning: 294 offload writes fell back to memory (294 I/O errors")
