"""PyTorch-Direct in DGL's own DataLoader (issue 39, gnn lane): features fetched through ``dgl_plugin.direct`` equal
DGL's own prefetched features bit for bit on the same sampled mini-batches, and training on them gives DGL's losses.

Each batch carries both: the wrapped ``NeighborSampler`` asks DGL to prefetch ``feat`` itself (``blocks[0].srcdata``)
and ``DirectSampler`` asks the attached flowlane storage for it (the batch's last item).
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.gnn
dgl = pytest.importorskip("dgl")

import torch  # noqa: E402

from dgl_plugin.direct import DirectFeatureStorage, DirectSampler, attach_direct_features  # noqa: E402


def _graph(dtype=torch.float32):
    g = dgl.rand_graph(300, 3000, idtype=torch.int64)
    gen = torch.Generator().manual_seed(0)
    g.ndata["feat"] = torch.randn(300, 16, generator=gen).to(dtype)
    g.ndata["label"] = torch.randint(0, 4, (300,), generator=gen)
    return g


def _batches(g, config=None):
    sampler = DirectSampler(
        dgl.dataloading.NeighborSampler([4, 3], prefetch_node_feats=["feat"]), name="direct_feat"
    )
    loader = dgl.dataloading.DataLoader(
        g, torch.arange(0, 300, 2), sampler, batch_size=32, shuffle=True, device="cpu"
    )
    storage = attach_direct_features(loader, g.ndata["feat"], config, name="direct_feat")
    return storage, list(loader)


def _bits(t):
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_direct_features_equal_dgls_own_prefetched_features_batch_by_batch(dtype):
    g = _graph(dtype)
    storage, batches = _batches(g, {"path": "auto"})
    assert storage.store.path == "cpu-gather" and len(batches) == 5
    for input_nodes, _, blocks, x in batches:
        stock = blocks[0].srcdata["feat"]  # DGL's own feature prefetch for the same sample
        assert x.dtype == dtype and x.shape == (input_nodes.numel(), 16)
        assert torch.equal(_bits(x), _bits(stock)) and torch.equal(x, g.ndata["feat"][input_nodes])


def test_training_on_direct_features_gives_dgls_losses():
    from dgl.nn import SAGEConv

    g = _graph()
    _, batches = _batches(g)

    def train(direct: bool) -> list[float]:
        torch.manual_seed(1)
        convs = torch.nn.ModuleList([SAGEConv(16, 8, "mean"), SAGEConv(8, 4, "mean")])
        opt = torch.optim.SGD(convs.parameters(), lr=0.1)
        losses = []
        for _, output_nodes, blocks, x in batches:
            h = torch.relu(convs[0](blocks[0], x if direct else blocks[0].srcdata["feat"]))
            loss = torch.nn.functional.cross_entropy(convs[1](blocks[1], h), g.ndata["label"][output_nodes])
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return losses

    stock, ours = train(False), train(True)
    assert len(stock) == 5 and stock == ours


def test_the_adapter_refuses_what_cannot_apply():
    g = _graph()
    plain = dgl.dataloading.DataLoader(g, torch.arange(4), dgl.dataloading.NeighborSampler([2]), batch_size=2)
    with pytest.raises(ValueError, match="must be DirectSampler"):
        attach_direct_features(plain, g.ndata["feat"])
    loader = dgl.dataloading.DataLoader(
        g, torch.arange(4), DirectSampler(dgl.dataloading.NeighborSampler([2]), "x"), batch_size=2
    )
    with pytest.raises(ValueError, match=r"unknown direct key\(s\) \['mode'\]"):
        attach_direct_features(loader, g.ndata["feat"], {"mode": "uva"}, name="x")
    storage = DirectFeatureStorage(g.ndata["feat"], device="cpu")
    with pytest.raises(ValueError, match="homogeneous"):
        storage.fetch({"user": torch.tensor([0])}, "cpu")
    with pytest.raises(IndexError, match="index 300 at position 0"):
        storage.fetch(torch.tensor([300]), "cpu")
    not_blocks = type("S", (dgl.dataloading.Sampler,), {"sample": lambda self, g, i: g})()
    with pytest.raises(TypeError, match="DirectSampler wraps samplers returning"):
        DirectSampler(not_blocks).sample(g, None)


def _hetero_graph():
    gen = torch.Generator().manual_seed(2)
    n = {"user": 120, "item": 80, "tag": 30}

    def edges(src, dst, m):
        return torch.randint(0, n[src], (m,), generator=gen), torch.randint(0, n[dst], (m,), generator=gen)

    g = dgl.heterograph(
        {
            ("user", "buys", "item"): edges("user", "item", 600),
            ("item", "bought-by", "user"): edges("item", "user", 600),
            ("tag", "tags", "item"): edges("tag", "item", 200),
        },
        num_nodes_dict=n,
        idtype=torch.int64,
    )
    g.nodes["user"].data["feat"] = torch.randn(120, 12, generator=gen)
    g.nodes["item"].data["feat"] = torch.randn(80, 12, generator=gen).to(torch.bfloat16)
    return g  # "tag" nodes have no features, as in many relational graphs


def test_heterogeneous_graphs_get_dgls_own_features_per_node_type():
    g = _hetero_graph()
    stock_prefetch = {"user": ["feat"], "item": ["feat"]}  # DGL's own per-type prefetch, for comparison
    sampler = DirectSampler(dgl.dataloading.NeighborSampler([3, 2], prefetch_node_feats=stock_prefetch), "d")
    loader = dgl.dataloading.DataLoader(
        g, {"item": torch.arange(80)}, sampler, batch_size=16, shuffle=True, device="cpu"
    )
    tables = {nt: g.nodes[nt].data["feat"] for nt in ("user", "item")}
    storage = attach_direct_features(loader, tables, {"path": "auto"}, name="d")
    assert set(storage.stores) == {"user", "item"}
    seen = set()
    for input_nodes, _, blocks, x in loader:
        # DGL's own prefetch: {ntype: features} for the types that have them
        stock = blocks[0].srcdata["feat"]
        assert set(x) == set(stock) and "tag" not in x
        for nt, feats in x.items():
            assert feats.dtype == tables[nt].dtype and torch.equal(_bits(feats), _bits(stock[nt]))
            assert torch.equal(feats, tables[nt][input_nodes[nt]])
        seen |= set(x)
    assert seen == {"user", "item"}
    with pytest.raises(ValueError, match="untyped"):
        storage.fetch(torch.tensor([0]), "cpu")
    storage.close()


def test_heterogeneous_tables_are_checked_against_the_graph():
    g = _hetero_graph()
    loader = dgl.dataloading.DataLoader(
        g, {"item": torch.arange(8)}, DirectSampler(dgl.dataloading.NeighborSampler([2]), "d"), batch_size=4
    )
    with pytest.raises(ValueError, match=r"node types \['movie'\] the graph does not have"):
        attach_direct_features(loader, {"movie": torch.zeros(5, 2)}, name="d")
    with pytest.raises(ValueError, match=r"got \{'user': 7\} rows for \{'user': 120\} nodes"):
        attach_direct_features(loader, {"user": torch.zeros(7, 2)}, name="d")
    with pytest.raises(TypeError, match="must map node types to tensors"):
        DirectFeatureStorage({"user": [1.0]}, device="cpu")


def test_a_homogeneous_table_is_checked_against_the_graph():
    g = _graph()
    loader = dgl.dataloading.DataLoader(
        g, torch.arange(8), DirectSampler(dgl.dataloading.NeighborSampler([2]), "d"), batch_size=4
    )
    with pytest.raises(ValueError, match=r"one row per node: got 299 rows for 300 nodes"):
        attach_direct_features(loader, g.ndata["feat"][:299], name="d")


def test_a_cuda_loader_is_refused_where_dgl_has_no_cuda(monkeypatch):
    """A GPU host with PyPI's CPU-only DGL (the lane's pin): the store would pin the table and pick zero-copy, then
    DGL would fail moving the first batch's blocks to the GPU ("Device API cuda is not enabled"). Refused at attach,
    naming the DGL build, before anything is pinned."""
    g = _graph()
    loader = dgl.dataloading.DataLoader(
        g, torch.arange(8), DirectSampler(dgl.dataloading.NeighborSampler([2]), "d"), batch_size=4
    )
    loader.device = torch.device(
        "cuda", 0
    )  # as DGL's own DataLoader(..., device="cuda") sets it on a GPU host
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert not dgl.ndarray.gpu(0).exist  # the gnn lane's DGL: no CUDA device API
    with pytest.raises(
        ValueError,
        match=rf"device=cuda:0 needs a CUDA build of DGL, and this DGL build \({dgl.__version__}\) has no CUDA",
    ):
        attach_direct_features(loader, g.ndata["feat"], name="d")
    assert "d" not in loader.other_storages


def test_a_refused_first_table_of_several_reports_its_own_error():
    # close() on the way out used to raise AttributeError ('store'), hiding the table's own error
    with pytest.raises(ValueError, match="contiguous") as e:
        DirectFeatureStorage({"user": torch.zeros(4, 3).t(), "item": torch.zeros(5, 2)}, device="cpu")
    assert e.value.__context__ is None
