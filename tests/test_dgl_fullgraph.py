"""G3 hybrid-parallel full-graph training on DGL (gnn lane): exactness against single-process training."""

import numpy as np
import pytest

pytestmark = pytest.mark.gnn
dgl = pytest.importorskip("dgl")
torch = pytest.importorskip("torch")

from dgl_plugin.fullgraph import FullGraphConfig, FullGraphRuntime  # noqa: E402
from dgl_plugin.models import build_model  # noqa: E402
from dgl_plugin.synthetic import synthetic_graph  # noqa: E402
from flowlane import comm  # noqa: E402
from flowlane.launch import launch  # noqa: E402

RANKS = 3
CASES = [  # (model, schedule, comm_plan, bin_size, cache_halo_inputs)
    ("sage", "pipelined", "spst", 7, False),
    ("sage", "sequential", "p2p", 1000, False),
    ("gcn", "pipelined", "spst", 50, True),
    ("gat", "sequential", "spst", 13, False),
]


def _graph():
    return synthetic_graph(num_nodes=400, avg_degree=6, num_classes=4, num_communities=8, feat_dim=6, seed=2)


def _reference(name):
    g = _graph()
    model = build_model(name, 6, 8, 4, num_layers=2, seed=0).double()
    x = g.ndata["feat"].double()
    logits = model(g, x)
    m = g.ndata["train_mask"]
    loss = torch.nn.functional.cross_entropy(logits[m], g.ndata["label"][m], reduction="sum") / int(m.sum())
    loss.backward()
    return logits.detach().numpy(), {k: p.grad.numpy() for k, p in model.named_parameters()}


def _worker(rank, world):
    out = []
    for name, schedule, plan, bins, cache in CASES:
        g = _graph()
        g.ndata["feat"] = g.ndata["feat"].double()
        model = build_model(name, 6, 8, 4, num_layers=2, seed=0).double()
        cfg = FullGraphConfig(partition="g3", comm_plan=plan, topology="dgx1", devices=["gpu0", "gpu5", "gpu6"],
                              schedule=schedule, bin_size=bins, cache_halo_inputs=cache)
        with comm.recording() as rec:
            rt = FullGraphRuntime(g, model, cfg)
            logits = rt.forward()
            rt.backward(rt.loss(logits))
        out.append({"ids": rt.local_ids, "logits": logits.detach().numpy(),
                    "grads": {k: p.grad.numpy() for k, p in model.named_parameters()},
                    "graph_bytes": rec.bytes_by_kind().get("graph", 0), "summary": rt.summary()})
    return out


@pytest.fixture(scope="module")
def results():
    return launch(_worker, RANKS, timeout=480)  # generous: the shared 2-core box is often loaded


@pytest.mark.parametrize("case", range(len(CASES)))
def test_distributed_logits_and_gradients_equal_single_process(results, case):
    name = CASES[case][0]
    ref_logits, ref_grads = _reference(name)
    seen = np.zeros(ref_logits.shape[0], int)
    for r in range(RANKS):
        res = results[r][case]
        np.testing.assert_allclose(res["logits"], ref_logits[res["ids"]], rtol=1e-9, atol=1e-11)
        seen[res["ids"]] += 1
        for k, gr in ref_grads.items():
            np.testing.assert_allclose(res["grads"][k], gr, rtol=1e-8, atol=1e-11, err_msg=k)
    assert (seen == 1).all()                      # every node computed by exactly one rank
    assert sum(results[r][case]["graph_bytes"] for r in range(RANKS)) > 0


def test_spst_plan_uses_relays_and_bins_respect_limit(results):
    s = results[0][0]["summary"]
    assert s["bin_limit"] == 7 and sum(s["bins"].values()) >= s["n_local"] // 7
    assert any(results[r][0]["summary"]["plan_stages"] >= 2 for r in range(RANKS))
    assert results[0][0]["summary"]["partition"]["remote_spread"] <= 0.005 + 1e-12 or \
        results[0][0]["summary"]["partition"]["stop_reason"] != "gamma"


@pytest.mark.parametrize("case", [1, 2])
def test_halo_bytes_are_one_transfer_per_plan_edge_and_no_feature_backward(results, case):
    # per epoch: layer-0 features (6 wide, forward only: inputs need no gradient, digest §5 item 21) + hidden
    # layer (8 wide) forward + backward, fp64; case 2 caches layer-0 halo features at setup (sent once, B6 #4)
    t = results[0][case]["summary"]["plan_transfers"]
    total = sum(results[r][case]["graph_bytes"] for r in range(RANKS))
    assert total == t * (6 + 8 + 8) * 8


@pytest.mark.parametrize("bad,match", [
    (dict(partition="kahip"), "bad partition='kahip'"),
    (dict(gamma=1.5), "bad gamma=1.5"),
    (dict(comm_plan="ring"), "bad comm_plan='ring'"),
    (dict(bin_size=0), "bad bin_size=0"),
    (dict(topology="torus"), "bad topology='torus'"),
    (dict(schedule="async"), "bad schedule='async'"),
])
def test_bad_configs_are_rejected_naming_the_value(bad, match):
    with pytest.raises(ValueError, match=match):
        FullGraphConfig(**bad).validate(2)
    with pytest.raises(ValueError, match="unknown option"):
        FullGraphConfig.from_dict({"bin_sise": 3})


def test_bad_graphs_are_rejected():
    from dgl_plugin.fullgraph import check_graph

    g = _graph()
    with pytest.raises(TypeError, match="dgl.DGLGraph"):
        check_graph("not a graph")
    g2 = _graph()
    del g2.ndata["label"]
    with pytest.raises(ValueError, match="lacks ndata\\['label'\\]"):
        check_graph(g2)
    g3 = _graph()
    g3.ndata["feat"][0, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        check_graph(g3)
    g4 = _graph()
    g4.ndata["label"] = g4.ndata["label"].float()
    with pytest.raises(ValueError, match="integer"):
        check_graph(g4)
    check_graph(g)
