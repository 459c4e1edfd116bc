"""Shared set-up of the one-rank G3 benchmarks (g3_host_features, g3_mem_budget): the graph and model options, and
the synthetic graph they describe (power-law degrees, average degree 10, 8 classes, 32 communities, seed 0)."""

from __future__ import annotations

import argparse
from typing import Any


def add_graph_args(ap: argparse.ArgumentParser, feat_dim: int, layers: int) -> None:
    """--nodes, --feat-dim, --hidden, --layers, --model, --repeats, --out."""
    ap.add_argument("--nodes", type=int, default=100_000)
    ap.add_argument("--feat-dim", type=int, default=feat_dim)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=layers)
    ap.add_argument("--model", default="sage", choices=["sage", "gcn", "gat"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", required=True)


def graph_from_args(ap: argparse.ArgumentParser, a: argparse.Namespace) -> Any:
    """The synthetic graph of ``a``; bad sizes are refused by name."""
    from dgl_plugin.synthetic import synthetic_graph

    if a.nodes < 100 or a.feat_dim < 1 or a.repeats < 1 or a.layers < 1:
        ap.error(
            f"--nodes {a.nodes} (>= 100), --feat-dim {a.feat_dim} (>= 1), --repeats {a.repeats} (>= 1), "
            f"--layers {a.layers} (>= 1)"
        )
    return synthetic_graph(
        num_nodes=a.nodes, avg_degree=10, num_classes=8, num_communities=32, feat_dim=a.feat_dim, seed=0
    )
