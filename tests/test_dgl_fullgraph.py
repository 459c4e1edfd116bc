"""G3 hybrid-parallel full-graph training on DGL (gnn lane): exactness against single-process training, from a whole
graph in memory and from ``dgl.distributed.partition_graph`` output loaded rank by rank; one rank; DGL-style models."""

import numpy as np
import pytest

pytestmark = pytest.mark.gnn
# the llm lane collects this file without DGL; tests/test_dgl_lane.py guards the lane
dgl = pytest.importorskip("dgl")
torch = pytest.importorskip("torch")

import torch.nn.functional as F  # noqa: E402
from dgl.nn import GraphConv, SAGEConv  # noqa: E402
from torch import nn  # noqa: E402

from dgl_plugin.fullgraph import FullGraphConfig, FullGraphRuntime, load_local_partition  # noqa: E402
from dgl_plugin.g3_model_check import ModelContractError, layer_widths  # noqa: E402
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
    ("dglsage", "pipelined", "spst", 11, False),  # DGL-style: layers + activation in the user's own forward
    (
        "resgcn",
        "pipelined",
        "spst",
        9,
        False,
    ),  # forward_layer + GraphConv: a residual on h_dst after the layer
]
FROZEN = ("layers.1.bias",)
DISK_CASES = [("gcn", "pipelined"), ("dglsage", "sequential")]  # from partition_graph output on disk
#: features="host" (PyTorch-Direct gathers per bin, layer 0 recomputed in backward): (model, schedule, bin_size,
#: cache_halo_inputs, the CASES entry with the same bins to equal bitwise, or None)
HOST_CASES = [
    ("sage", "pipelined", 7, False, 0),
    ("gcn", "sequential", None, True, None),
    ("dglsage", "pipelined", 11, False, 4),
]
#: mem_budget_bytes (bins of at most budget / 2 by g3_bins' estimate, every bin recomputed in backward):
#: (model, schedule, budget, features)
BUDGET = 20_000
BUDGET_CASES = [
    ("sage", "pipelined", BUDGET, "device"),
    ("gcn", "sequential", BUDGET, "device"),
    ("dglsage", "pipelined", BUDGET, "device"),
    ("sage", "sequential", BUDGET, "host"),
    ("gat", "pipelined", 5 * BUDGET, "device"),
]


class DGLStyleSAGE(nn.Module):
    """Written like DGL's full-graph GraphSAGE example: activation and dropout inline in ``forward``, no
    ``forward_layer``, and a head outside ``layers``."""

    def __init__(self, in_feats, hidden, n_classes):
        super().__init__()
        self.layers = nn.ModuleList([SAGEConv(in_feats, hidden, "mean"), SAGEConv(hidden, hidden, "gcn")])
        self.head = nn.Linear(hidden, n_classes)
        self.dropout = nn.Dropout(0.0)

    def forward(self, graph, x):
        h = self.dropout(x)
        for k, layer in enumerate(self.layers):
            h = layer(graph, h)
            if k != len(self.layers) - 1:
                h = F.relu(h)
                h = self.dropout(h)
        return self.head(torch.tanh(h))


class ResidualGCN(nn.Module):
    """A ``forward_layer`` model whose layers are GraphConvs (global-degree edge weights in the runtime) and whose
    rest uses the destination rows: a projected residual after layer 0."""

    def __init__(self, in_feats, hidden, n_classes):
        super().__init__()
        dims = [(in_feats, hidden), (hidden, n_classes)]
        self.layers = nn.ModuleList(GraphConv(a, b, allow_zero_in_degree=True) for a, b in dims)
        self.proj = nn.Linear(in_feats, hidden)

    def forward(self, graph, x):
        h = x
        for k in range(len(self.layers)):
            h = self.forward_layer(k, graph, h, h)
        return h

    def forward_layer(self, k, block, h_src, h_dst):
        h = self.layers[k](block, (h_src, h_dst))
        return F.relu(h + self.proj(h_dst)) if k == 0 else h


def _model(name, frozen=()):
    if name in ("dglsage", "resgcn"):
        torch.manual_seed(0)
        model = (DGLStyleSAGE if name == "dglsage" else ResidualGCN)(6, 8, 4).double()
    else:
        model = build_model(name, 6, 8, 4, num_layers=2, seed=0).double()
    for k, p in model.named_parameters():
        p.requires_grad_(k not in frozen)
    return model


def _graph():
    g = synthetic_graph(num_nodes=400, avg_degree=6, num_classes=4, num_communities=8, feat_dim=6, seed=2)
    g.ndata["feat"] = g.ndata["feat"].double()
    return g


def _reference(name, frozen=()):
    g = _graph()
    model = _model(name, frozen)
    logits = model(g, g.ndata["feat"])
    m = g.ndata["train_mask"]
    loss = torch.nn.functional.cross_entropy(logits[m], g.ndata["label"][m], reduction="sum") / int(m.sum())
    loss.backward()
    return logits.detach().numpy(), _grads(model)


def _grads(model):
    return {k: p.grad.numpy() for k, p in model.named_parameters() if p.grad is not None}


def _run(rt, model):
    logits = rt.forward()
    rt.backward(rt.loss(logits))
    return {
        "ids": rt.local_ids,
        "logits": logits.detach().numpy(),
        "grads": _grads(model),
        "summary": rt.summary(),
    }


def _dgx1_run(name, frozen=(), **cfg):
    """One 3-rank run on the DGX-1 topology's planner, with the halo bytes it sent, the layer-wise all-reduces
    (keys, in issue order) and every parameter's gradient accumulation with how many of them were issued before."""
    model = _model(name, frozen)
    cfg = FullGraphConfig(topology="dgx1", devices=["gpu0", "gpu5", "gpu6"], device="cpu", **cfg)
    with comm.recording() as rec, FullGraphRuntime(_graph(), model, cfg) as rt:
        ready = []
        for k, p in model.named_parameters():
            if p.requires_grad:  # registered before the runtime's hooks, so it runs first
                p.register_post_accumulate_grad_hook(
                    lambda _p, k=k: ready.append((k, sum(op.kind == "dp" for op in rec.ops)))
                )
        res = _run(rt, model)
    res["graph_bytes"] = rec.bytes_by_kind().get("graph", 0)
    res["allreduce_keys"] = [op.key for op in rec.ops if op.kind == "dp"]
    res["grad_ready"] = ready
    res["bin_rows"] = {k: [int(b.numel()) for b, _ in v] for k, v in rt.bins.items()}
    return res


def _process_groups() -> int:
    from torch.distributed import distributed_c10d as c10d

    return len(c10d._world.pg_map)  # torch keeps no public list of groups


def _worker(rank, world, part_config):
    groups = _process_groups()
    out = [
        _dgx1_run(name, comm_plan=plan, schedule=schedule, bin_size=bins, cache_halo_inputs=cache)
        for name, schedule, plan, bins, cache in CASES
    ]
    host = [
        _dgx1_run(
            name,
            comm_plan="spst",
            schedule=schedule,
            bin_size=bins,
            cache_halo_inputs=cache,
            features="host",
            direct={"path": "cpu-gather"},
        )
        for name, schedule, bins, cache, _ in HOST_CASES
    ]
    budget = [
        _dgx1_run(
            name,
            comm_plan="spst",
            schedule=schedule,
            mem_budget_bytes=bytes_,
            features=feats,
            direct={"path": "cpu-gather"} if feats == "host" else {},
        )
        for name, schedule, bytes_, feats in BUDGET_CASES
    ]
    disk = []
    for name, schedule in DISK_CASES:
        model = _model(name)
        lp = load_local_partition(part_config, rank, world)
        with FullGraphRuntime(lp, model, FullGraphConfig(schedule=schedule, bin_size=17, device="cpu")) as rt:
            res = _run(rt, model)
        res["n_inner_loaded"], res["n_halo"] = int(lp.inner_ids.size), int(lp.halo_ids.size)
        disk.append(res)
    groups_left = _process_groups() - groups  # every runtime above closed its exchange group
    # a budget one rank cannot honour (here: only rank 1's is too small, as a hub in one partition would make it):
    # every rank refuses at install, naming that rank, instead of the others waiting for it in the first exchange
    try:
        FullGraphRuntime(
            _graph(), _model("sage"), FullGraphConfig(mem_budget_bytes=500 if rank == 1 else 1e9)
        )
        refused = None
    except ValueError as e:
        refused = str(e)
    # a constructor that fails after making its exchange group (the refusal above, in _build_bins; no train node,
    # in _load_rows after the host feature store) destroys it: none is left behind
    g = _graph()
    g.ndata["train_mask"][:] = False
    try:
        FullGraphRuntime(g, _model("sage"), FullGraphConfig(features="host", direct={"path": "cpu-gather"}))
        no_train = None
    except ValueError as e:
        no_train = str(e)
    # a frozen parameter (the last layer's bias): neither hooked nor all-reduced
    frozen = _dgx1_run("resgcn", frozen=FROZEN, comm_plan="spst", schedule="pipelined", bin_size=9)
    return out, disk, host, budget, refused, groups_left, (no_train, _process_groups() - groups), frozen


@pytest.fixture(scope="module")
def partitioned(tmp_path_factory):
    d = tmp_path_factory.mktemp("parts")
    orig, _ = dgl.distributed.partition_graph(
        _graph(), "g", RANKS, str(d), num_hops=1, part_method="metis", return_mapping=True
    )
    return str(d / "g.json"), orig.numpy()


@pytest.fixture(scope="module")
def results(partitioned):
    # generous: the shared box is often loaded
    res = launch(_worker, RANKS, args=(partitioned[0],), timeout=600)
    # (device, disk, host, budget, refused, groups_left, failed constructors, frozen) by rank
    return tuple(list(part) for part in zip(*res, strict=True))


def _check_exact(per_rank, name, ids_to_orig=None, frozen=()):
    ref_logits, ref_grads = _reference(name, frozen)
    seen = np.zeros(ref_logits.shape[0], int)
    for res in per_rank:
        ids = res["ids"] if ids_to_orig is None else ids_to_orig[res["ids"]]
        np.testing.assert_allclose(res["logits"], ref_logits[ids], rtol=1e-9, atol=1e-11)
        seen[ids] += 1
        for k, gr in ref_grads.items():
            np.testing.assert_allclose(res["grads"][k], gr, rtol=1e-8, atol=1e-11, err_msg=k)
        assert res["grads"].keys() == ref_grads.keys()
    assert (seen == 1).all()  # every node computed by exactly one rank


@pytest.mark.parametrize("case", range(len(CASES)))
def test_distributed_logits_and_gradients_equal_single_process(results, case):
    per_rank = [results[0][r][case] for r in range(RANKS)]
    _check_exact(per_rank, CASES[case][0])
    assert sum(r["graph_bytes"] for r in per_rank) > 0
    back = [r["summary"]["backward"] for r in per_rank]
    # pipelined backward: layer 1's halo gradients returned in the background
    if CASES[case][1] == "pipelined":
        assert all(b["deferred_exchanges"] == 1 for b in back)
        assert all(b["applied_where_needed"] == 1 for b in back)  # every rank here has boundary rows
    else:
        assert all(b["deferred_exchanges"] == 0 for b in back)


@pytest.mark.parametrize("case", range(len(HOST_CASES)))
def test_host_features_give_single_process_results_and_the_same_halo_bytes(results, case):
    """features='host': the table stays in host memory, each bin gathers its rows and layer 0 is recomputed in
    backward; bitwise the device-resident run where the bins are the same, and the same halo bytes."""
    name, _, _, _, same = HOST_CASES[case]
    per_rank = [results[2][r][case] for r in range(RANKS)]
    _check_exact(per_rank, name)
    if same is not None:
        for r in range(RANKS):
            dev, host = results[0][r][same], per_rank[r]
            assert np.array_equal(dev["logits"], host["logits"])
            assert all(np.array_equal(dev["grads"][k], g) for k, g in host["grads"].items())
            assert dev["graph_bytes"] == host["graph_bytes"]
    t = per_rank[0]["summary"]["plan_transfers"]
    # layer-0 features sent once (from the host table; at set-up when cached), the hidden layer forward + backward
    assert sum(r["graph_bytes"] for r in per_rank) == t * (6 + 8 + 8) * 8


@pytest.mark.parametrize("case", range(len(BUDGET_CASES)))
def test_memory_budget_gives_single_process_results_with_bins_within_half_the_budget(results, case):
    """mem_budget_bytes: every bin's estimate <= budget / 2 (so groups split into many bins), every bin recomputed
    in backward, and logits and gradients still equal single-process training."""
    name, _, budget, _ = BUDGET_CASES[case]
    per_rank = [results[3][r][case] for r in range(RANKS)]
    _check_exact(per_rank, name)
    for r in per_rank:
        assert r["summary"]["bin_bytes_max"] <= budget / 2
        bins = r["summary"]["bins"]  # groups split by the budget
        assert sum(bins.values()) >= 2 * sum(1 for n in bins.values() if n), bins


def _allreduce_group(param):
    """The layer-wise all-reduce group of a parameter of these models."""
    return f"layer{param.split('.')[1]}" if param.startswith("layers.") else "rest"


@pytest.mark.parametrize("case", [*range(len(CASES)), "frozen"])
def test_layer_allreduces_run_in_one_order_each_as_soon_as_its_gradients_are_ready(results, case):
    """B6 #12: every rank issues the groups' all-reduces in the same order (gloo matches them by order), and each
    group's is issued when its last gradient is accumulated, before any later gradient: an input projection used in
    layer 0 (resgcn) is issued after layer 1 instead of holding it back, a head (dglsage) before the last layer."""
    per_rank = [results[7][r] if case == "frozen" else results[0][r][case] for r in range(RANKS)]
    keys = per_rank[0]["allreduce_keys"]
    assert all(r["allreduce_keys"] == keys for r in per_rank)
    name = "resgcn" if case == "frozen" else CASES[case][0]
    groups = {_allreduce_group(k) for k in per_rank[0]["grads"]}
    assert sorted(keys) == sorted(groups)  # one all-reduce per group
    if name == "resgcn":
        assert keys == ["layer1", "rest", "layer0"]
    if name == "dglsage":
        assert keys == ["rest", "layer1", "layer0"]
    for r in per_rank:
        for i, key in enumerate(keys):
            issued_before = [n for p, n in r["grad_ready"] if _allreduce_group(p) == key][-1]
            assert issued_before == i, (key, r["grad_ready"])


def test_frozen_parameters_are_not_all_reduced_and_the_rest_equal_single_process(results):
    """A parameter with requires_grad=False (here the last layer's bias) is neither hooked nor all-reduced (torch
    refuses a hook on it): it gets no gradient, as in single-process training, and every other gradient equals
    single-process training's."""
    per_rank = [results[7][r] for r in range(RANKS)]
    _check_exact(per_rank, "resgcn", frozen=FROZEN)
    for r in per_rank:
        assert FROZEN[0] not in r["grads"] and r["grad_ready"]
        assert FROZEN[0] not in {p for p, _ in r["grad_ready"]}


def test_a_budget_one_rank_cannot_honour_is_refused_on_every_rank(results):
    for msg in results[4]:
        assert msg is not None and "bad mem_budget_bytes" in msg and "rank 1: destination row" in msg, msg


def test_closed_runtimes_leave_no_process_group_behind(results):
    """Each runtime's halo exchange has its own gloo group (threads and a socket per peer); close() (the context
    manager's exit) destroys it, so a rank that built a runtime per case holds no more groups than before."""
    assert results[5] == [0] * RANKS


def test_failed_constructors_leave_no_process_group_behind(results):
    """Two constructors fail after their exchange group exists (a refused budget; no train node, after the host
    feature store): each destroys the group before raising, so the ranks hold no more groups than at the start."""
    for no_train, groups_left in results[6]:
        assert no_train is not None and "train_mask selects no node" in no_train, no_train
        assert groups_left == 0


def _step_allocations(rt):
    """Bytes the CPU allocator holds when the forward ends (kept for backward) and at the step's peak."""
    from flowlane.testing.memory import cpu_allocation_peak

    with cpu_allocation_peak() as p:
        loss = rt.loss(rt.forward())
        p.mark("forward_end")
        rt.backward(loss)
        del loss
    return p.at_marks["forward_end"], p.peak_bytes


def test_memory_budget_keeps_only_layer_tensors_for_backward():
    """Without a budget the forward keeps every bin's activations for backward; with one it keeps the layer tensors
    only (each bin is recomputed), measured by the allocator: less held after the forward and a lower step peak."""
    g = synthetic_graph(num_nodes=4000, avg_degree=10, num_classes=4, num_communities=8, feat_dim=64, seed=0)
    held, grads = {}, {}
    for budget in (None, 2e6):
        model = build_model("sage", 64, 64, 4, num_layers=3, seed=0)
        rt = FullGraphRuntime(g, model, FullGraphConfig(device="cpu", mem_budget_bytes=budget))
        rt.backward(rt.loss(rt.forward()))  # first-call set-up out of the measured step
        held[budget] = _step_allocations(rt)
        grads[budget] = {k: p.grad for k, p in model.named_parameters()}
    assert held[2e6][0] < 0.6 * held[None][0], held
    assert held[2e6][1] < held[None][1], held
    for k, gr in grads[None].items():
        torch.testing.assert_close(grads[2e6][k], gr, rtol=1e-4, atol=1e-6)


def test_layer_widths_count_attention_values_per_edge():
    """B6 #8: the bins' memory estimate sees each layer's attention values per edge (a GATConv's heads), 0 for
    layers without attention."""
    assert layer_widths(_model("gat"), 6, torch.float64) == [(6, 32, 4), (32, 4, 1)]
    assert layer_widths(_model("sage"), 6, torch.float64) == [(6, 8, 0), (8, 4, 0)]


def test_a_budget_too_small_for_one_node_is_refused_at_install():
    with pytest.raises(
        ValueError, match=r"bad mem_budget_bytes=500: rank 0: destination row \d+ \(in-degree"
    ):
        FullGraphRuntime(_graph(), _model("sage"), FullGraphConfig(device="cpu", mem_budget_bytes=500))


def _held_for_backward(rt):
    """Peak bytes of saved activations alive in one step (flowlane.offload's tracker; parameters excluded)."""
    from flowlane.offload import track_saved_tensors

    with track_saved_tensors(0, list(rt.model.parameters())) as res:
        rt.backward(rt.loss(rt.forward()))
    return res.peak


@pytest.mark.parametrize("name,bins", [("sage", None), ("gcn", 16)])
def test_host_features_are_not_held_for_backward(name, bins):
    """The device-resident table (and layer 0's gathered inputs) are saved for backward; with host features layer
    0 is recomputed from a second gather, so at least the table's bytes less are held."""
    held, grads = {}, {}
    for feats in ("device", "host"):
        model = _model(name)
        rt = FullGraphRuntime(_graph(), model, FullGraphConfig(bin_size=bins, device="cpu", features=feats))
        held[feats] = _held_for_backward(rt)
        grads[feats] = {k: p.grad for k, p in model.named_parameters()}
    table = _graph().ndata["feat"].nbytes
    assert held["device"] - held["host"] >= table, held
    if bins is not None:  # same bins: the recomputation gives the same gradients, bitwise
        assert all(torch.equal(grads["device"][k], g) for k, g in grads["host"].items())


def test_host_features_refuse_a_forward_that_changes_them_first():
    model = DGLStyleSAGE(6, 8, 4).double()
    model.dropout.p = 0.5  # input dropout in training: layers[0] would not get the features
    rng = torch.random.get_rng_state()
    with pytest.raises(ModelContractError, match="features='host' needs model.layers\\[0\\] to receive"):
        FullGraphRuntime(_graph(), model, FullGraphConfig(device="cpu", features="host"))
    assert torch.equal(rng, torch.random.get_rng_state())  # the install check draws no random numbers


@pytest.mark.parametrize("case", range(len(DISK_CASES)))
def test_partitions_loaded_from_disk_give_single_process_logits_and_gradients(results, partitioned, case):
    per_rank = [results[1][r][case] for r in range(RANKS)]
    _check_exact(per_rank, DISK_CASES[case][0], ids_to_orig=partitioned[1])
    # each rank held its partition plus halo, not the graph
    assert all(r["n_inner_loaded"] + r["n_halo"] < 400 for r in per_rank)
    assert sum(r["n_inner_loaded"] for r in per_rank) == 400


def test_spst_plan_uses_relays_and_bins_respect_limit(results):
    for r in range(RANKS):
        rows = results[0][r][0]["bin_rows"]
        assert sum(map(sum, rows.values())) == results[0][r][0]["summary"]["n_local"]
        for sizes in rows.values():  # every bin of a group is full (7 nodes) except the group's last one
            assert all(s == 7 for s in sizes[:-1]) and all(1 <= s <= 7 for s in sizes)
    assert any(results[0][r][0]["summary"]["plan_stages"] >= 2 for r in range(RANKS))
    assert any(results[0][r][0]["summary"]["n_relay"] > 0 for r in range(RANKS))


@pytest.mark.parametrize("case", [1, 2])
def test_halo_bytes_are_one_transfer_per_plan_edge_and_no_feature_backward(results, case):
    # per epoch: layer-0 features (6 wide, forward only: inputs need no gradient, digest §5 item 21) + hidden
    # layer (8 wide) forward + backward, fp64; case 2 caches layer-0 halo features at setup (sent once, B6 #4)
    t = results[0][0][case]["summary"]["plan_transfers"]
    total = sum(results[0][r][case]["graph_bytes"] for r in range(RANKS))
    assert total == t * (6 + 8 + 8) * 8


@pytest.mark.parametrize("name", ["gcn", "dglsage", "resgcn"])
def test_one_rank_trains_the_whole_graph_exactly(name):
    ref_logits, ref_grads = _reference(name)
    model = _model(name)
    res = _run(FullGraphRuntime(_graph(), model, FullGraphConfig(bin_size=64, device="cpu")), model)
    assert res["summary"]["plan_transfers"] == 0 and res["summary"]["n_remote"] == 0
    np.testing.assert_allclose(res["logits"], ref_logits[res["ids"]], rtol=1e-9, atol=1e-11)
    for k, gr in ref_grads.items():
        np.testing.assert_allclose(res["grads"][k], gr, rtol=1e-8, atol=1e-11, err_msg=k)


def test_bins_read_only_their_own_source_rows():
    """A group of several bins: each bin's block spans only the source rows its edges read (a block over every row
    made each bin cost O(partition)); one bin per group by default, over every row (no gather)."""
    model = _model("gcn")
    rt = FullGraphRuntime(_graph(), model, FullGraphConfig(bin_size=16, device="cpu"))
    several = [name for name, bins in rt.bins.items() if len(bins) > 1]
    assert several
    for name in several:
        src_ids, sizes, rows = rt._gather[name]
        assert sizes == [blk.num_src_nodes() for _, blk in rt.bins[name]]
        assert torch.equal(rows, torch.cat([r for r, _ in rt.bins[name]]))
        for (_, blk), ids in zip(rt.bins[name], src_ids.split(sizes), strict=True):
            src, _ = blk.edges()
            assert torch.equal(torch.unique(src), torch.arange(blk.num_src_nodes()))  # every row read
            assert ids.unique().numel() == ids.numel() < rt.n_local
    one = FullGraphRuntime(_graph(), _model("gcn"), FullGraphConfig(device="cpu"))
    assert all(len(b) <= 1 for b in one.bins.values()) and all(v is None for v in one._gather.values())
    assert {blk.num_src_nodes() for b in one.bins.values() for _, blk in b} == {one.n_local}


class _MixesNodes(DGLStyleSAGE):
    def forward(self, graph, x):
        h = F.relu(self.layers[0](graph, x))
        return self.head(self.layers[1](graph, h - h.mean(0)))


class _UsesGraph(DGLStyleSAGE):
    def forward(self, graph, x):
        with graph.local_scope():
            return super().forward(graph, x)


class _BatchNorm(DGLStyleSAGE):
    def __init__(self, *a):
        super().__init__(*a)
        self.bn = nn.BatchNorm1d(8)


class _MixesAfter(DGLStyleSAGE):
    def forward(self, graph, x):
        h = self.layers[1](graph, F.relu(self.layers[0](graph, x)))
        return self.head(h - h.mean(0))


class _LayerTwice(DGLStyleSAGE):
    def forward(self, graph, x):
        h = F.relu(self.layers[0](graph, x))
        return self.head(self.layers[1](graph, self.layers[1](graph, h)))


class _SkipsLayer(DGLStyleSAGE):
    def forward(self, graph, x):
        return self.head(F.relu(self.layers[0](graph, x)))


class _ForwardLayerWithoutHead(DGLStyleSAGE):
    def forward_layer(self, k, block, h_src, h_dst):
        h = self.layers[k](block, (h_src, h_dst))
        return F.relu(h) if k == 0 else torch.tanh(h)  # the head is missing


class _Block(nn.Module):
    """A wrapper as many user models have: ``layers[k]`` is this, the GraphConv is below it."""

    def __init__(self, a, b, norm):
        super().__init__()
        self.conv = GraphConv(a, b, norm=norm, allow_zero_in_degree=True)

    def forward(self, graph, h):
        return self.conv(graph, h)


class _WrappedGCN(nn.Module):
    def __init__(self, in_feats, hidden, n_classes, norm="both"):
        super().__init__()
        self.layers = nn.ModuleList([_Block(in_feats, hidden, norm), _Block(hidden, n_classes, norm)])

    def forward(self, graph, x):
        return self.layers[1](graph, F.relu(self.layers[0](graph, x)))


class _EdgeWeightNormInLayer(ResidualGCN):
    def __init__(self, *a):
        super().__init__(*a)
        self.ewn = dgl.nn.EdgeWeightNorm(norm="both")

    def forward_layer(self, k, block, h_src, h_dst):
        w = self.ewn(block, torch.ones(block.num_edges(), dtype=h_src.dtype))
        h = self.layers[k](block, (h_src, h_dst), edge_weight=w)
        return F.relu(h) if k == 0 else h


class _FeaturesOnly(DGLStyleSAGE):
    def forward(self, x):
        return self.head(x)


class _NoLayers(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = GraphConv(6, 4, allow_zero_in_degree=True)

    def forward(self, g, x):
        return self.conv(g, x)


@pytest.mark.parametrize(
    "cls,match",
    [
        (_MixesNodes, r"mixes nodes outside its graph layers .* Add forward_layer"),
        (_UsesGraph, r"uses graph.local_scope outside model.layers.* Add forward_layer"),
        (_BatchNorm, r"model.bn \(BatchNorm1d\) normalises across all nodes"),
        (_NoLayers, r"keep its graph layers in `self.layers`"),
        (_MixesAfter, r"mixes nodes after its last graph layer"),
        (_LayerTwice, r"calls layers\[1\] out of order \(after 2 layer calls\)"),
        (_SkipsLayer, r"called 1 of its 2 layers"),
        (_ForwardLayerWithoutHead, r"chaining model.forward_layer\(k, ...\) over model.layers does not give"),
        (_FeaturesOnly, r"model\(g, x\) failed on a full graph \(TypeError"),
        (
            _WrappedGCN,
            r"model.layers.0.conv \(GraphConv, norm='both'\) normalises by out-degrees.* norm='right'",
        ),
        (_EdgeWeightNormInLayer, r"model.ewn \(EdgeWeightNorm, norm='both'\) normalises by out-degrees"),
    ],
)
def test_models_the_runtime_cannot_run_exactly_are_refused_at_install(cls, match):
    model = (cls() if cls is _NoLayers else cls(6, 8, 4)).double()
    with pytest.raises(ModelContractError, match=match):
        FullGraphRuntime(_graph(), model, FullGraphConfig(device="cpu"))


def test_a_wrapped_graphconv_normalising_by_in_degree_gives_single_process_results():
    """norm='right' (in-degrees: a bin's block holds every in-edge of its rows) below layers[k] is exact, so it is
    not refused with norm='both' (out-degrees, which a bin's block would count on its own edges)."""
    g = _graph()
    torch.manual_seed(0)
    model = _WrappedGCN(6, 8, 4, norm="right").double()
    ref = model(g, g.ndata["feat"]).detach()
    rt = FullGraphRuntime(g, model, FullGraphConfig(bin_size=16, device="cpu"))
    torch.testing.assert_close(
        rt.forward().detach(), ref[torch.from_numpy(rt.local_ids)], rtol=1e-9, atol=1e-11
    )


class _OneKind(nn.Module):
    """DGL-style, every ``layers[k]`` one dgl.nn module kind (``make(in, out)``), after an optional row-wise
    projection."""

    def __init__(self, make, dims, proj=None):
        super().__init__()
        self.proj = proj
        self.layers = nn.ModuleList(make(a, b) for a, b in dims)

    def forward(self, graph, x):
        h = x if self.proj is None else self.proj(x)
        for k, layer in enumerate(self.layers):
            h = layer(graph, h)
            if k < len(self.layers) - 1:
                h = F.relu(h)
        return h


class _OneKindLayerwise(_OneKind):
    def forward_layer(self, k, block, h_src, h_dst):
        h = self.layers[k](block, (h_src, h_dst))
        return F.relu(h) if k < len(self.layers) - 1 else h


class _EdgeCountScaled(nn.Module):
    """One round, but reads graph-wide state: on a bin's block ``num_edges`` is the bin's."""

    def __init__(self, a, b):
        super().__init__()
        self.conv = SAGEConv(a, b, "mean")

    def forward(self, graph, h):
        return self.conv(graph, h) * graph.num_edges() / 100


_TWO = [(6, 8), (8, 4)]
NOT_ONE_ROUND = {  # module kinds one halo exchange per layer cannot compute
    "SGConv": lambda: _OneKind(lambda a, b: dgl.nn.SGConv(a, b, k=2, allow_zero_in_degree=True), _TWO),
    "TAGConv": lambda: _OneKind(lambda a, b: dgl.nn.TAGConv(a, b, k=2), _TWO),
    "APPNPConv": lambda: _OneKind(lambda a, b: dgl.nn.APPNPConv(k=3, alpha=0.1), [(4, 4)], nn.Linear(6, 4)),
    "ChebConv": lambda: _OneKind(lambda a, b: dgl.nn.ChebConv(a, b, k=2), _TWO),
    "_EdgeCountScaled": lambda: _OneKind(_EdgeCountScaled, _TWO),
    "SGConv in forward_layer": lambda: _OneKindLayerwise(
        lambda a, b: dgl.nn.SGConv(a, b, k=2, allow_zero_in_degree=True), _TWO
    ),
}


@pytest.mark.parametrize("name", list(NOT_ONE_ROUND))
def test_layers_of_several_rounds_or_graph_wide_state_are_refused_at_install(name):
    """k hops in one module need k halo exchanges (the runtime makes one per model.layers[k]); graph-wide state
    would be a bin's. Refused at install naming the module (they passed install and failed at the first forward),
    by running each layer on bins' blocks as the runtime does. fp32: DGL's APPNPConv fails in fp64 by itself."""
    g = _graph()
    g.ndata["feat"] = g.ndata["feat"].float()
    torch.manual_seed(0)
    model = NOT_ONE_ROUND[name]()
    model(g, g.ndata["feat"])  # single-process DGL runs it
    cls = name.split()[0]
    prefix = r"model.forward_layer\(0, ...\) with " if "forward_layer" in name else ""
    why = "other rows than on the whole graph" if cls == "_EdgeCountScaled" else "raised"
    with pytest.raises(
        ModelContractError,
        match=rf"^{prefix}model.layers\[0\] \({cls}\) cannot run bin by bin: .*{why}.* exchanges the halo once "
        r"per model.layers\[k\].* express the k hops as k entries of model.layers",
    ):
        FullGraphRuntime(g, model, FullGraphConfig(device="cpu"))


ONE_ROUND = {
    "GINConv": lambda a, b: dgl.nn.GINConv(nn.Linear(a, b), "sum"),
    "EdgeConv": lambda a, b: dgl.nn.EdgeConv(a, b, allow_zero_in_degree=True),
    "SAGEConv": lambda a, b: SAGEConv(a, b, "pool"),
    "GraphConv": lambda a, b: GraphConv(a, b, norm="both", allow_zero_in_degree=True),
}


@pytest.mark.parametrize("name", list(ONE_ROUND))
def test_single_round_layers_pass_the_block_check_and_train_exactly(name):
    """Single-round dgl.nn convolutions (layer(block, (h_src, h_dst))) pass the install check and give the
    single-process logits and gradients on one rank with several bins per group."""
    g = _graph()
    torch.manual_seed(0)
    model = _OneKind(ONE_ROUND[name], _TWO).double()
    ref_model = _OneKind(ONE_ROUND[name], _TWO).double()
    ref_model.load_state_dict(model.state_dict())
    ref = ref_model(g, g.ndata["feat"])
    m = g.ndata["train_mask"]
    F.cross_entropy(ref[m], g.ndata["label"][m], reduction="sum").div(int(m.sum())).backward()
    res = _run(FullGraphRuntime(g, model, FullGraphConfig(bin_size=16, device="cpu")), model)
    assert sum(res["summary"]["bins"].values()) > 4
    np.testing.assert_allclose(res["logits"], ref.detach().numpy()[res["ids"]], rtol=1e-9, atol=1e-11)
    for k, p in ref_model.named_parameters():
        np.testing.assert_allclose(res["grads"][k], p.grad.numpy(), rtol=1e-8, atol=1e-11, err_msg=k)


@pytest.mark.parametrize(
    "bad,match",
    [
        (dict(partition="kahip"), "bad partition='kahip'"),
        (dict(gamma=1.5), "bad gamma=1.5"),
        (dict(comm_plan="ring"), "bad comm_plan='ring'"),
        (dict(bin_size=0), "bad bin_size=0"),
        (dict(bin_size=True), "bad bin_size=True: must be an integer >= 1, or None"),
        (dict(topology="torus"), "bad topology='torus'"),
        (dict(schedule="async"), "bad schedule='async'"),
        (dict(device="tpu"), "bad device='tpu'"),
        (dict(schedule="sequential", pipeline_backward=True), "bad pipeline_backward=True: needs schedule"),
        (dict(mem_budget_bytes=0), "bad mem_budget_bytes=0: must be a number of bytes > 0"),
        (dict(mem_budget_bytes="1GB"), "bad mem_budget_bytes='1GB': must be a number of bytes"),
        (dict(features="gpu"), "bad features='gpu': choose 'device' or 'host'"),
        (dict(direct={"path": "cpu-gather"}), "applies to features='host' only"),
        (dict(features="host", direct={"pth": 1}), r"unknown direct key\(s\) \['pth'\]"),
        (dict(features="host", direct={"path": "fast"}), "direct.path='fast' is not one of"),
    ],
)
def test_bad_configs_are_rejected_naming_the_value(bad, match):
    with pytest.raises(ValueError, match=match):
        FullGraphConfig(**bad).validate(2)
    with pytest.raises(ValueError, match="unknown option"):
        FullGraphConfig.from_dict({"bin_sise": 3})


def test_auto_picks_cuda_only_where_dgl_can_use_it(monkeypatch):
    """A GPU host with PyPI's CPU-only DGL (the lane's pin): auto is CPU and a launched rank's backend gloo (nccl
    would get the runtime's CPU tensors), and device=cuda is refused naming DGL, not left to fail at the first block
    on CUDA. With a CUDA build of DGL, auto is CUDA on nccl."""
    from types import SimpleNamespace

    from dgl_plugin import fullgraph

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert not dgl.ndarray.gpu(0).exist  # the gnn lane's DGL: no CUDA device API
    assert not fullgraph.dgl_has_cuda()
    assert fullgraph.resolve_device("auto") == torch.device("cpu")
    assert fullgraph.collective_backend("auto") == "gloo"
    for dev in ("cuda", "cuda:0"):
        with pytest.raises(
            ValueError, match=rf"bad device='{dev}': this DGL build \({dgl.__version__}\) has no CUDA"
        ):
            FullGraphConfig(device=dev).validate(2)
    monkeypatch.setattr(dgl.ndarray, "gpu", lambda i=0: SimpleNamespace(exist=True))  # a CUDA build of DGL
    assert fullgraph.resolve_device("auto").type == "cuda"
    assert fullgraph.collective_backend("auto") == "nccl" and fullgraph.collective_backend("cpu") == "gloo"
    FullGraphConfig(device="cuda").validate(2)


def test_bad_part_configs_are_rejected(tmp_path, partitioned):
    with pytest.raises(FileNotFoundError, match="not a file"):
        load_local_partition(str(tmp_path / "none.json"), 0, 3)
    with pytest.raises(ValueError, match="num_parts=3 but world_size=2"):
        load_local_partition(partitioned[0], 0, 2)


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


def test_the_gradient_ready_probe_runs_fp16_models_in_float32_and_falls_back_when_the_cpu_cannot_run_them(
    caplog,
):
    from dgl_plugin.g3_model_check import grad_ready_order

    # DGL's CPU kernels refuse fp16: the probe runs a float32 copy, so an fp16 model gets its order (input projection
    # after the last layer), and the user's model keeps its dtype
    model = ResidualGCN(6, 8, 3).half()
    order = grad_ready_order(model, 6)
    assert order["layers.1.weight"] < order["proj.weight"] < order["layers.0.weight"], order
    assert all(p.dtype == torch.float16 for p in model.parameters())

    class CudaOnly(ResidualGCN):  # a model that cannot run on the CPU: the fixed order, with a warning
        def forward(self, graph, x):
            raise RuntimeError("Device API cuda is not enabled")

    with caplog.at_level("WARNING", logger="flowlane"):
        assert grad_ready_order(CudaOnly(6, 8, 3), 6) == {}
    assert "the layer-wise all-reduces go in the fixed order" in caplog.text
