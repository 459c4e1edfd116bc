"""The G3 runtime's halo-exchange group (gnn lane): made with the op timeout of the runtime's group (the launch's),
not torch's 30-minute default, so a dead peer in the exchange is an error as soon as in any other collective."""

import pytest

pytestmark = pytest.mark.gnn
dgl = pytest.importorskip("dgl")
torch = pytest.importorskip("torch")

from dgl_plugin.fullgraph import FullGraphConfig, FullGraphRuntime, group_timeout  # noqa: E402
from dgl_plugin.models import build_model  # noqa: E402
from dgl_plugin.synthetic import synthetic_graph  # noqa: E402
from flowlane.launch import launch  # noqa: E402

OP_TIMEOUT_S = 47.0


def _worker(rank, world):
    g = synthetic_graph(num_nodes=120, avg_degree=4, num_classes=3, num_communities=4, feat_dim=4, seed=1)
    model = build_model("sage", 4, 8, 3, num_layers=2, seed=0)
    with FullGraphRuntime(g, model, FullGraphConfig(partition="random", device="cpu")) as rt:
        logits = rt.forward()  # the exchange works on that group
        return group_timeout(None).total_seconds(), group_timeout(rt._xgroup).total_seconds(), logits.shape[1]


def test_halo_exchange_group_inherits_the_launch_op_timeout():
    res = launch(_worker, 2, timeout=300, op_timeout=OP_TIMEOUT_S)
    assert [r[:2] for r in res] == [(OP_TIMEOUT_S, OP_TIMEOUT_S)] * 2 and res[0][2] == 3
