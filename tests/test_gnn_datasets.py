"""``dgl_plugin.datasets.load_graph`` builds the graph the recipe's ``data`` group describes: ``data.feat_dim`` (a
SyntheticSpec field, validated by recipes/validate.py) was taken by load_graph's own parameter and never reached the
synthetic generator, so every synthetic graph had 32 features (benchmarks/g3_distdgl.py --feat-dim then sized its
model and its byte counts for a graph it did not build)."""

from pathlib import Path

import pytest

pytestmark = pytest.mark.gnn
pytest.importorskip("dgl")

from omegaconf import OmegaConf  # noqa: E402

from dgl_plugin.datasets import load_graph  # noqa: E402

CONF = Path(__file__).resolve().parent.parent / "recipes" / "conf"


def test_synthetic_feat_dim_reaches_the_generator():
    g = load_graph("synthetic", seed=0, num_nodes=200, num_classes=4, num_communities=8, feat_dim=8)
    assert g.ndata["feat"].shape == (200, 8)
    assert (
        load_graph("synthetic", seed=0, num_nodes=200, num_classes=4, num_communities=8)
        .ndata["feat"]
        .shape[1]
        == 32
    )


def test_the_recipe_default_data_group_gives_its_feat_dim():
    """As dgl_plugin.train calls it: load_graph(data.name, seed=<the recipe's seed>, **rest of data)."""
    c = OmegaConf.to_container(OmegaConf.load(CONF / "gnn_fullgraph.yaml"))
    data = dict(c["data"])
    assert data["feat_dim"] == 32
    g = load_graph(data.pop("name"), seed=c["seed"], **data)
    assert g.ndata["feat"].shape == (data["num_nodes"], 32)


def test_offline_dataset_without_features_gets_random_ones_of_feat_dim():
    assert load_graph("karate").ndata["feat"].shape[1] == 16
    assert load_graph("karate", feat_dim=5).ndata["feat"].shape[1] == 5
