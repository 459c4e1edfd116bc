"""Graph loaders: the synthetic generator, and real datasets only if they are already on disk (nothing downloads).

Names: ``synthetic`` (see :mod:`dgl_plugin.synthetic`), ``dgl-bin:<path>`` (a graph saved with ``dgl.save_graphs``,
with ndata feat/label/train_mask[/val_mask/test_mask]), ``ogbn-<name>`` (OGB node-property dataset already under
``root``; needs the ``ogb`` package), and DGL's offline generated datasets ``karate``, ``bacommunity``, ``bashape``,
``treecycle`` (labels, random features when the dataset has none, random split).
"""

from __future__ import annotations

import os

import dgl
import numpy as np
import torch

from .synthetic import SyntheticSpec, synthetic_graph


def _split(g: dgl.DGLGraph, seed: int, train: float = 0.6, val: float = 0.2) -> dgl.DGLGraph:
    n = g.num_nodes()
    perm = np.random.default_rng(seed).permutation(n)
    a, b = int(train * n), int((train + val) * n)
    for k, sel in (("train_mask", perm[:a]), ("val_mask", perm[a:b]), ("test_mask", perm[b:])):
        m = torch.zeros(n, dtype=torch.bool)
        m[torch.from_numpy(sel)] = True
        if k not in g.ndata:
            g.ndata[k] = m
    return g


def load_graph(
    name: str = "synthetic",
    root: str | None = None,
    seed: int = 0,
    feat_dim: int | None = None,
    **synthetic: object,
) -> dgl.DGLGraph:
    """``feat_dim``: the synthetic graph's feature width (None: SyntheticSpec's, 32), or the width of the random
    features of an offline dataset that has none (None: 16); datasets with features keep theirs."""
    if name == "synthetic":
        if feat_dim is not None:
            synthetic["feat_dim"] = feat_dim
        return synthetic_graph(SyntheticSpec(seed=seed, **synthetic))  # type: ignore[arg-type]
    if name.startswith("dgl-bin:"):
        path = name.split(":", 1)[1]
        if not os.path.exists(path):
            raise FileNotFoundError(f"dataset {name!r}: no file at {path!r} (nothing is downloaded)")
        return _split(dgl.load_graphs(path)[0][0], seed)
    if name.startswith("ogbn-"):
        root = root or os.environ.get("OGB_ROOT", "dataset")
        folder = os.path.join(root, name.replace("-", "_"))
        if not os.path.isdir(folder):
            raise FileNotFoundError(
                f"dataset {name!r}: not on disk under {folder!r}; no network here, so it "
                f"cannot be downloaded; use name='synthetic'"
            )
        from ogb.nodeproppred import DglNodePropPredDataset  # type: ignore[import-not-found]

        ds = DglNodePropPredDataset(name, root=root)
        g, y = ds[0]
        g = dgl.to_bidirected(g, copy_ndata=True)
        g.ndata["label"] = y.view(-1).long()
        idx = ds.get_idx_split()
        for k, part in (("train_mask", "train"), ("val_mask", "valid"), ("test_mask", "test")):
            m = torch.zeros(g.num_nodes(), dtype=torch.bool)
            m[idx[part]] = True
            g.ndata[k] = m
        return g
    offline = {
        "karate": "KarateClubDataset",
        "bacommunity": "BACommunityDataset",
        "bashape": "BAShapeDataset",
        "treecycle": "TreeCycleDataset",
    }
    if name in offline:
        g = getattr(dgl.data, offline[name])()[0]
        if "feat" not in g.ndata:
            g.ndata["feat"] = torch.randn(
                g.num_nodes(),
                16 if feat_dim is None else feat_dim,
                generator=torch.Generator().manual_seed(seed),
            )
        g.ndata["label"] = g.ndata["label"].long()
        g = dgl.to_bidirected(dgl.remove_self_loop(g), copy_ndata=True)
        return _split(g, seed)
    raise ValueError(
        f"unknown dataset {name!r}: use 'synthetic', 'dgl-bin:<path>', 'ogbn-<name>' (on disk) or "
        f"one of {sorted(offline)}"
    )
