"""Small dgl.nn models that follow the full-graph runtime's layer contract.

Contract (what :class:`dgl_plugin.fullgraph.FullGraphRuntime` needs): ``model.layers`` is an ``nn.ModuleList`` of
dgl.nn graph convolutions callable as ``layer(block, (h_src, h_dst))``, one message-passing round each (the halo is
exchanged once per layer; k-hop modules such as SGConv are refused); ``model.forward_layer(k, block, h_src, h_dst)``
runs layer ``k`` plus what follows it (activation, head reshaping); ``model(g, x)`` is ordinary single-process
full-graph training. A model without ``forward_layer`` (DGL's own style: layers and activations in ``forward``) runs
its own ``forward`` with each layer computed over the partition, if everything between layers acts row by row;
:func:`dgl_plugin.g3_model_check.check_model` verifies this at install and otherwise refuses the model, saying what to add.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from dgl.nn import GATConv, GraphConv, SAGEConv
from torch import nn


class _Stacked(nn.Module):
    def forward(self, g, x):  # noqa: D401 - single-process full graph
        h = x
        for k in range(len(self.layers)):
            h = self.forward_layer(k, g, h, h)
        return h

    def forward_layer(self, k, block, h_src, h_dst):
        h = self.layers[k](block, (h_src, h_dst))
        return F.relu(h) if k < len(self.layers) - 1 else h


class SAGE(_Stacked):
    def __init__(
        self, in_feats: int, hidden: int, n_classes: int, num_layers: int = 2, aggregator: str = "mean"
    ):
        super().__init__()
        dims = [in_feats] + [hidden] * (num_layers - 1) + [n_classes]
        self.layers = nn.ModuleList(
            SAGEConv(a, b, aggregator) for a, b in zip(dims[:-1], dims[1:], strict=True)
        )


class GCN(_Stacked):
    def __init__(self, in_feats: int, hidden: int, n_classes: int, num_layers: int = 2):
        super().__init__()
        dims = [in_feats] + [hidden] * (num_layers - 1) + [n_classes]
        self.layers = nn.ModuleList(
            GraphConv(a, b, norm="both", allow_zero_in_degree=True)
            for a, b in zip(dims[:-1], dims[1:], strict=True)
        )


class GAT(_Stacked):
    def __init__(self, in_feats: int, hidden: int, n_classes: int, num_layers: int = 2, heads: int = 4):
        super().__init__()
        self.layers = nn.ModuleList()
        d = in_feats
        for k in range(num_layers):
            last = k == num_layers - 1
            self.layers.append(
                GATConv(d, n_classes if last else hidden, 1 if last else heads, allow_zero_in_degree=True)
            )
            d = hidden * heads

    def forward_layer(self, k, block, h_src, h_dst):
        h = self.layers[k](block, (h_src, h_dst))
        return F.elu(h.flatten(1)) if k < len(self.layers) - 1 else h.mean(1)


MODELS = {"sage": SAGE, "gcn": GCN, "gat": GAT}


def build_model(name: str, in_feats: int, hidden: int, n_classes: int, num_layers: int = 2, seed: int = 0):
    if name not in MODELS:
        raise ValueError(f"model must be one of {sorted(MODELS)}, got {name!r}")
    if num_layers < 1:
        raise ValueError(f"num_layers must be >= 1, got {num_layers}")
    torch.manual_seed(seed)
    return MODELS[name](in_feats, hidden, n_classes, num_layers)
