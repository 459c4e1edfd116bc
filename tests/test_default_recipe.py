"""The main job: `flowlane-train` with the default recipe (tiny Megatron-core GPT, PP2 x DP2 on 4 CPU ranks)."""

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.llm
pytest.importorskip("megatron.core")

from hydra import compose, initialize_config_dir  # noqa: E402

from recipes.gpt import GPTRecipe  # noqa: E402
from recipes.train import run_job  # noqa: E402

CONF = Path(__file__).resolve().parent.parent / "recipes" / "conf"


def test_default_yaml_mirrors_the_recipe_dataclass():
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name="default")
    fields = {f.name for f in dataclasses.fields(GPTRecipe)} - {"features"}
    assert set(cfg) - {"job", "scheduler", "offload", "dp_collective"} == fields
    for f in dataclasses.fields(GPTRecipe):
        if f.name != "features" and f.default is not dataclasses.MISSING:
            assert cfg[f.name] == f.default, f.name


def test_hermod_yaml_mirrors_hermod_config_defaults():
    from megatron_plugin.hermod import HermodConfig

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name="default", overrides=["scheduler=hermod"])
    assert dict(cfg.scheduler) == dataclasses.asdict(HermodConfig())


def test_bad_recipe_values_are_rejected_with_the_value_named():
    with pytest.raises(ValueError, match="num_layers=5 must be divisible by pipeline_parallel=2"):
        run_job({"job": "gpt", "num_layers": 5})
    with pytest.raises(ValueError, match=r"unknown recipe field\(s\) \['hiden_size'\]"):
        run_job({"job": "gpt", "hiden_size": 8})
    with pytest.raises(ValueError, match="recipe job 'bert' is not one of"):
        run_job({"job": "bert"})
    with pytest.raises(ValueError, match=r"dp_collective=aleph needs dp_collective.bandwidth_gbps"):
        run_job({"job": "gpt", "dp_collective": {"name": "aleph"}})
    with pytest.raises(ValueError, match=r"dp_collective=syndicate and scheduler=hermod both take"):
        run_job(
            {
                "job": "gpt",
                "dp_collective": {"name": "syndicate", "mode": "fifo"},
                "scheduler": {"name": "hermod"},
            }
        )
    with pytest.raises(ValueError, match=r"dp_collective=aleph: unknown key\(s\) \['cluster'\]"):
        run_job({"job": "gpt", "dp_collective": {"name": "aleph", "cluster": "0,1"}})
    with pytest.raises(ValueError, match=r"dp_collective.replan_every=.* must be an integer"):
        run_job({"job": "gpt", "dp_collective": {"name": "aleph", "clusters": "0,1", "replan_every": "x"}})


def _train(out: Path, *overrides: str) -> tuple[subprocess.CompletedProcess, dict]:
    exe = Path(sys.executable).parent / "flowlane-train"
    r = subprocess.run(
        [
            str(exe),
            "iterations=3",
            f"output_dir={out}",
            "progress=false",
            f"hydra.run.dir={out}/hydra",
            *overrides,
        ],
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return r, json.loads((out / "metrics.json").read_text())


@pytest.fixture(scope="module")
def default_run(tmp_path_factory):
    """The default recipe's run, shared: the first test checks it, the second compares the features with it."""
    return _train(tmp_path_factory.mktemp("default"))


def test_flowlane_train_runs_four_ranks_and_writes_metrics_and_trace(default_run):
    r, m = default_run
    assert "flowlane-train summary" in r.stdout
    rec = GPTRecipe()
    steady = 3 - 1
    # pipeline p2p: per microbatch, stage 0 sends activations and stage 1 sends their gradients back (fp32)
    act = rec.seq_length * rec.micro_batch_size * rec.hidden_size * 4
    assert m["bytes_by_kind"]["pp"] == steady * rec.data_parallel * rec.num_microbatches * 2 * act
    # data parallel: Megatron's DDP reduces each rank's fp32 gradient buffer once per iteration (every parameter,
    # plus Megatron's padding of each bucket: a few hundred elements at most)
    for r_ in m["per_rank"]:
        n_params = r_["num_params"]
        assert steady * n_params * 4 <= r_["bytes_by_kind"]["dp"] <= steady * (n_params + 1024) * 4
    # the two data-parallel replicas of each stage end with identical parameters
    by_stage = {}
    for r_ in m["per_rank"]:
        by_stage.setdefault(r_["pp_stage"], []).append(r_["param_digest"])
    assert all(len(set(d)) == 1 for d in by_stage.values()) and len(by_stage) == 2
    assert len(m["loss"]) == 3 and all(x > 0 for x in m["loss"])
    trace = json.loads(Path(m["trace"]).read_text())
    pids = {e["pid"] for e in trace["traceEvents"] if e["ph"] == "X"}
    assert pids == {0, 1, 2, 3}


def test_hermod_and_ssd_offload_recipe_options_do_not_change_the_math(tmp_path, default_run):
    _, base = default_run
    r, both = _train(tmp_path / "both", "scheduler=hermod", "offload=ssd", "offload.min_bytes=16384")
    assert both["loss"] == base["loss"]  # bitwise: same float values
    assert [x["param_digest"] for x in both["per_rank"]] == [x["param_digest"] for x in base["per_rank"]]
    assert all(x["feature_stats"]["SSDOffload"]["bytes_written"] > 0 for x in both["per_rank"])
    assert "activations offloaded" in r.stdout
    assert "features: scheduler=hermod (ep_algorithm=bvn); offload=posix" in r.stdout


def test_pinned_offload_preset_budgets_from_a_profile_and_keeps_the_math(tmp_path, default_run):
    """offload=pinned (the H200-measured configuration: pinned host memory, the byte budget, recompute within 5 %)
    composes onto offload=ssd's fields and, on this CPU run, offloads what each stage's profile allows, bitwise."""
    _, base = default_run
    # a link given, not measured: the budget then offloads the same layers however loaded this machine is
    r, pinned = _train(
        tmp_path / "pinned", "offload=pinned", "offload.min_bytes=16384", "offload.link_GBps=1000"
    )
    assert pinned["loss"] == base["loss"]
    assert [x["param_digest"] for x in pinned["per_rank"]] == [x["param_digest"] for x in base["per_rank"]]
    for x in pinned["per_rank"]:
        s = x["feature_stats"]["SSDOffload"]
        assert s["bytes_written"] > 0 and len(s["profile"]["allow_bytes"]) == 2  # two layers per stage
        assert s["profile"]["allow_bytes"][0] > 0  # the first layer's copies hide behind the second's compute
    assert "features: offload=pinned_cpu" in r.stdout


def test_aleph_recipe_option_does_not_change_the_math(tmp_path, default_run):
    """dp_collective=aleph: each stage's two data-parallel ranks reduce through a PS tree of two (a sum of two has
    one order), so the run is bitwise the default one."""
    _, base = default_run
    r, aleph = _train(tmp_path / "aleph", "dp_collective=aleph", 'dp_collective.clusters="0,1"')
    assert aleph["loss"] == base["loss"]
    assert [x["param_digest"] for x in aleph["per_rank"]] == [x["param_digest"] for x in base["per_rank"]]
    assert "features: dp_collective=aleph" in r.stdout
