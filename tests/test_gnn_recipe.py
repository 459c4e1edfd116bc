"""`flowlane-train --config-name gnn_fullgraph`: the G3 + DGCL recipe end to end (gnn lane)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gnn
pytest.importorskip("dgl")


def test_gnn_fullgraph_recipe_trains_across_two_ranks_and_learns(tmp_path):
    exe = Path(sys.executable).parent / "flowlane-train"
    r = subprocess.run(
        [
            str(exe),
            "--config-name",
            "gnn_fullgraph",
            "epochs=4",
            f"output_dir={tmp_path}",
            f"hydra.run.dir={tmp_path}/hydra",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "gnn_fullgraph summary" in r.stdout
    s = json.loads((tmp_path / "summary.json").read_text())
    assert s["world_size"] == 2 and len(s["history"]) == 4
    assert s["graph_bytes_total"] > 0 and s["dp_bytes_total"] > 0
    # 8 classes: chance is 0.125; class-correlated features make a few full-graph epochs enough to beat it clearly
    assert s["test_acc"] > 0.3
    assert s["history"][-1]["loss"] < s["history"][0]["loss"]


def test_gnn_fullgraph_recipe_trains_from_distdgl_partitions(tmp_path):
    # data.part_config: the output of dgl.distributed.partition_graph; each rank loads only its own partition
    import dgl

    from dgl_plugin.datasets import load_graph

    g = load_graph(
        "synthetic", seed=0, num_nodes=2000, avg_degree=10, num_classes=8, num_communities=16, feat_dim=16
    )
    dgl.distributed.partition_graph(g, "syn", 2, str(tmp_path / "parts"), num_hops=1, part_method="metis")
    exe = Path(sys.executable).parent / "flowlane-train"
    r = subprocess.run(
        [
            str(exe),
            "--config-name",
            "gnn_fullgraph",
            "epochs=3",
            f"output_dir={tmp_path}/out",
            f"+data.part_config={tmp_path}/parts/syn.json",
            f"hydra.run.dir={tmp_path}/hydra",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    s = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert s["world_size"] == 2 and len(s["history"]) == 3 and s["graph_bytes_total"] > 0
    n_local = [x["summary"]["n_local"] for x in s["ranks"]]
    assert sum(n_local) == 2000 and max(n_local) < 2000  # each rank holds its partition only
    assert all(x["summary"]["partition"]["part_config"].endswith("syn.json") for x in s["ranks"])
    assert s["history"][-1]["loss"] < s["history"][0]["loss"]


@pytest.mark.parametrize(
    "override, match",
    [
        ({"world_size": 0}, r"world_size=0 must be an integer >= 1"),
        ({"data": {"part_config": "{tmp}/none.json"}}, r"data.part_config='.*none.json' is not a file"),
        ({"epochs": 0}, r"epochs=0 must be an integer >= 1"),
        ({"epoch": 3}, r"unknown gnn_fullgraph key\(s\) \['epoch'\]; allowed:"),
        ({"lr": "abc"}, r"lr='abc' must be a number > 0"),
        # datetime.timedelta overflowed in every rank (OverflowError) after start-up
        ({"timeout_s": 1e14}, r"timeout_s=100000000000000.0 must be > 0 and at most 31536000 seconds"),
        ({"model": {"name": "mlp"}}, r"model.name='mlp' is not one of \['gat', 'gcn', 'sage'\]"),
        (
            {"flowlane": {"fullgraph": {"partition": "foo"}}},
            r"flowlane.fullgraph.partition='foo' must be one of",
        ),
        ({"output_dir": "{tmp}/a_file/out"}, r"output_dir='.*a_file/out' is not a writable folder"),
    ],
)
def test_a_bad_gnn_config_is_refused_before_any_rank_starts(tmp_path, monkeypatch, override, match):
    from recipes.train import run_job
    from recipes.validate import ConfigError

    def no_ranks(*a, **kw):
        raise AssertionError("ranks were started before the config was checked")

    monkeypatch.setattr("dgl_plugin.train.launch", no_ranks)
    (tmp_path / "a_file").write_text("")
    override = {
        k: v.format(tmp=tmp_path)
        if isinstance(v, str)
        else {kk: vv.format(tmp=tmp_path) if isinstance(vv, str) else vv for kk, vv in v.items()}
        if isinstance(v, dict)
        else v
        for k, v in override.items()
    }
    with pytest.raises(ConfigError, match=match):
        run_job({"job": "gnn_fullgraph", "output_dir": str(tmp_path / "out"), **override})
