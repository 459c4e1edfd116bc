"""Hector's DGL layers (issue 40, gnn lane): RGCN, HGT and RGAT with the same weights as DGL's own modules give the
same outputs and gradients (float64, so only float rounding differs: the GEMMs run per (source, relation) row instead
of per edge); install_hector swaps them into a model; bad input is refused with a clear error.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.gnn
dgl = pytest.importorskip("dgl")

import torch  # noqa: E402
from torch import nn  # noqa: E402

from dgl_plugin.hector import (  # noqa: E402
    HectorConfig,
    HectorHGTConv,
    HectorRelGraphConv,
    HectorRGAT,
    hetero_rgat_reference,
    install_hector,
    to_relation_graph,
)
from flowlane.hector import typed_graph  # noqa: E402
from tests.hector_probes import LowPrecisionSums  # noqa: E402

F64 = torch.float64
N, E, R, NT = 80, 900, 5, 3


def _close(a, b, tol=1e-10):
    torch.testing.assert_close(a, b, rtol=tol, atol=tol)


@pytest.fixture(scope="module")
def graph():
    gd = typed_graph(num_nodes=N, num_edges=E, num_etypes=R, num_ntypes=NT, hub_alpha=2.0, seed=1)
    g = dgl.graph((gd["src"], gd["dst"]), num_nodes=N)
    return g, gd


def _x(dim=12, seed=0):
    return torch.randn(N, dim, dtype=F64, generator=torch.Generator().manual_seed(seed)).requires_grad_()


def _grads(out, inputs, seed=7):
    g = torch.randn(out.shape, dtype=out.dtype, generator=torch.Generator().manual_seed(seed))
    return torch.autograd.grad(out, inputs, g)


def _same_step(ref_out, hec_out, ref_inputs, hec_inputs):
    _close(hec_out, ref_out)
    for a, b in zip(_grads(hec_out, hec_inputs), _grads(ref_out, ref_inputs), strict=True):
        _close(a, b)


@pytest.mark.parametrize("reg", [None, "basis", "bdd"], ids=["plain", "basis", "bdd"])
@pytest.mark.parametrize("materialization", ["compact", "vanilla"])
def test_rgcn_equals_dgl_relgraphconv_forward_and_backward(graph, reg, materialization):
    g, gd = graph
    torch.manual_seed(0)
    ref = dgl.nn.RelGraphConv(
        12, 6, R, regularizer=reg, num_bases=2 if reg else None, layer_norm=True
    ).double()
    hec = HectorRelGraphConv(
        12,
        6,
        R,
        regularizer=reg,
        num_bases=2 if reg else None,
        layer_norm=True,
        hector=HectorConfig(materialization=materialization, gemm="loop"),
    ).double()
    hec.load_state_dict(ref.state_dict())
    x, x2 = _x(), _x()
    norm = torch.rand(E, 1, dtype=F64, generator=torch.Generator().manual_seed(3))
    out_ref, out_hec = ref(g, x, gd["etype"], norm), hec(g, x2, gd["etype"], norm)
    _same_step(out_ref, out_hec, [x, *ref.parameters()], [x2, *hec.parameters()])
    rows = hec._layouts._layout.src_rows
    assert rows.compact == (materialization == "compact")
    assert rows.num_rows == (
        len(set(zip(gd["src"].tolist(), gd["etype"].tolist(), strict=True)))
        if materialization == "compact"
        else E
    )


def test_rgcn_equals_dgl_on_edges_presorted_by_type(graph):
    g, gd = graph
    order = torch.sort(gd["etype"], stable=True).indices
    gs = dgl.graph((gd["src"][order], gd["dst"][order]), num_nodes=N)
    ref = dgl.nn.RelGraphConv(12, 6, R).double()
    hec = HectorRelGraphConv(12, 6, R).double()
    hec.load_state_dict(ref.state_dict())
    x, x2 = _x(), _x()
    et = gd["etype"][order]
    _same_step(
        ref(gs, x, et, presorted=True),
        hec(gs, x2, et, presorted=True),
        [x, *ref.parameters()],
        [x2, *hec.parameters()],
    )


@pytest.mark.parametrize("reorder", ["never", "always", "auto"])
def test_hgt_equals_dgl_hgtconv_forward_and_backward(graph, reorder):
    g, gd = graph
    torch.manual_seed(0)
    ref = dgl.nn.HGTConv(12, 4, 2, NT, R, dropout=0.0, use_norm=True).double()
    hec = HectorHGTConv(
        12, 4, 2, NT, R, dropout=0.0, use_norm=True, hector=HectorConfig(reorder=reorder)
    ).double()
    hec.load_state_dict(ref.state_dict())
    x, x2 = _x(), _x()
    _same_step(
        ref(g, x, gd["ntype"], gd["etype"]),
        hec(g, x2, gd["ntype"], gd["etype"]),
        [x, *ref.parameters()],
        [x2, *hec.parameters()],
    )
    # presorted: nodes (already) and edges sorted by type
    order = torch.sort(gd["etype"], stable=True).indices
    gs = dgl.graph((gd["src"][order], gd["dst"][order]), num_nodes=N)
    x, x2 = _x(), _x()
    _same_step(
        ref(gs, x, gd["ntype"], gd["etype"][order], presorted=True),
        hec(gs, x2, gd["ntype"], gd["etype"][order], presorted=True),
        [x, *ref.parameters()],
        [x2, *hec.parameters()],
    )


def _stacked_dgl_grads(conv, names, grads):
    """DGL's per-relation GATConv gradients in HectorRGAT's stacked layout (W, attn_l, attn_r, bias)."""
    by = dict(zip([n for n, _ in conv.named_parameters()], grads, strict=True))
    return [
        torch.stack([by[f"mods.{r}.fc.weight"].t() for r in names]),
        torch.stack([by[f"mods.{r}.attn_l"][0] for r in names]),
        torch.stack([by[f"mods.{r}.attn_r"][0] for r in names]),
        torch.stack([by[f"mods.{r}.bias"] for r in names]),
    ]


def _rgat_reference_with_random_biases(seed=0):
    """DGL's relational GAT in float64 with non-zero biases (GATConv initialises them to 0, which hides bias bugs)."""
    torch.manual_seed(seed)
    conv, names = hetero_rgat_reference(12, 4, 2, R)
    conv = conv.double()
    with torch.no_grad():
        for n in names:
            conv.mods[n].bias.normal_()
    return conv, names


@pytest.mark.parametrize("reorder", ["never", "always", "auto"])
@pytest.mark.parametrize("empty", [None, 2], ids=["all-relations", "relation-2-empty"])
def test_rgat_equals_dgl_heterographconv_of_gatconv_forward_and_backward(graph, reorder, empty):
    g, gd = graph
    et = gd["etype"].clone()
    if (
        empty is not None
    ):  # a relation without edges, as sampled blocks often have: DGL still adds its GATConv's bias
        et[et == empty] = (empty + 1) % R
    conv, names = _rgat_reference_with_random_biases()
    hg = to_relation_graph(gd["src"], gd["dst"], et, N, R)
    assert empty is None or hg.num_edges(names[empty]) == 0
    hec = HectorRGAT.from_dgl(conv, names, hector=HectorConfig(reorder=reorder))
    x, x2 = _x(), _x()
    out_ref, out_hec = conv(hg, {"n": x})["n"], hec(g, x2, et)
    _close(out_hec, out_ref)
    ref_params = list(conv.parameters())
    gr = _grads(out_ref, [x, *ref_params])
    gh = _grads(out_hec, [x2, hec.W, hec.attn_l, hec.attn_r, hec.bias])
    _close(gh[0], gr[0])
    for a, b in zip(gh[1:], _stacked_dgl_grads(conv, names, gr[1:]), strict=True):
        _close(a, b)
    if reorder != "auto":
        assert hec.last_plan["src"].fold == hec.last_plan["dst"].fold == (reorder == "always")


def test_rgat_node_softmax_equals_listing_3_1_in_plain_torch(graph):
    g, gd = graph
    hec = HectorRGAT(12, 4, 2, R, softmax="node", bias=False).double()
    x = _x()
    out = hec(g, x, gd["etype"])
    src, dst, et = gd["src"], gd["dst"], gd["etype"]
    hs = torch.einsum("ei,eio->eo", x[src], hec.W[et]).view(E, 2, 4)  # e.src.feature * W[e.etype]
    ht = torch.einsum("ei,eio->eo", x[dst], hec.W[et]).view(E, 2, 4)
    att = torch.nn.functional.leaky_relu((hs * hec.attn_l[et]).sum(-1) + (ht * hec.attn_r[et]).sum(-1), 0.2)
    att = att.exp()
    att = att / torch.zeros(N, 2, dtype=F64).index_add(0, dst, att)[dst]  # softmax over all in-edges of dst
    ref = torch.zeros(N, 2, 4, dtype=F64).index_add(0, dst, hs * att.unsqueeze(-1))
    _close(out, ref)


def test_install_hector_swaps_dgl_modules_in_place_sharing_parameters(graph):
    g, gd = graph

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.rgcn = dgl.nn.RelGraphConv(12, 8, R)
            self.hgt = dgl.nn.HGTConv(8, 4, 2, NT, R, dropout=0.0)

        def forward(self, g, x):
            return self.hgt(g, self.rgcn(g, x, gd["etype"]).relu(), gd["ntype"], gd["etype"])

    net = Net().double()
    params = list(net.parameters())
    x = _x()
    before = net(g, x)
    swapped = install_hector(net, {"gemm": "loop"})
    assert swapped == {"rgcn": "HectorRelGraphConv", "hgt": "HectorHGTConv"}
    assert type(net.rgcn) is HectorRelGraphConv and type(net.hgt) is HectorHGTConv
    # an optimizer built before still applies
    assert all(a is b for a, b in zip(params, net.parameters(), strict=True))
    _close(net(g, x), before)
    assert install_hector(nn.Sequential(dgl.nn.GraphConv(4, 4)), {"enabled": False}) == {}
    with pytest.raises(
        ValueError,
        match=r"holds no dgl.nn.RelGraphConv or dgl.nn.HGTConv.*\['GraphConv'\].*"
        r"hector.enabled=false",
    ):
        install_hector(nn.Sequential(dgl.nn.GraphConv(4, 4)))
    with pytest.raises(ValueError, match=r"unknown hector key\(s\) \['tile'\]"):
        install_hector(net, {"tile": 16})


def test_layers_refuse_bad_edge_types_and_mismatched_dgl_modules(graph):
    g, gd = graph
    hec = HectorRelGraphConv(12, 6, R).double()
    with pytest.raises(ValueError, match=f"one type per edge \\({E} edges\\), got \\(5,\\)"):
        hec(g, _x(), gd["etype"][:5])
    with pytest.raises(ValueError, match=rf"etype holds {R}, outside the allowed range \[0, {R}\)"):
        hec(g, _x(), torch.full((E,), R))
    with pytest.raises(ValueError, match=r"norm must hold one value per edge"):
        hec(g, _x(), gd["etype"], torch.ones(E + 1))
    hgt = HectorHGTConv(12, 4, 2, NT, R, dropout=0.0).double()
    with pytest.raises(ValueError, match="types are not sorted"):  # presorted=True promises type-sorted nodes
        hgt(g, _x(), gd["ntype"].flip(0), gd["etype"], presorted=True)
    conv, names = hetero_rgat_reference(12, 4, 2, R, residual=True)
    with pytest.raises(ValueError, match=r"GATConv settings \['residual'"):
        HectorRGAT.from_dgl(conv, names)
    with pytest.raises(ValueError, match="num_heads=0 must be an int >= 1"):
        HectorRGAT(12, 4, 0, R)


def test_rgat_from_dgl_refuses_modules_it_cannot_load_by_name_before_reading_them():
    # separate source/destination fc (GATConv with a pair of in_feats): was an AttributeError on .fc
    conv = dgl.nn.HeteroGraphConv({f"r{i}": dgl.nn.GATConv((12, 6), 4, 2) for i in range(R)}, aggregate="sum")
    with pytest.raises(ValueError, match=r"relation 'r0': GATConv settings \['fc_src/fc_dst'\]"):
        HectorRGAT.from_dgl(conv, [f"r{i}" for i in range(R)])
    conv, names = hetero_rgat_reference(12, 4, 2, R)
    # a relation name the module lacks: was a bare KeyError
    with pytest.raises(ValueError, match=r"missing from the module \['cites'\], repeated \[\]"):
        HectorRGAT.from_dgl(conv, ["cites", *names[1:]])
    # a name twice would give two edge types one relation's weights
    with pytest.raises(ValueError, match=r"missing from the module \[\], repeated \['r0'\]"):
        HectorRGAT.from_dgl(conv, [names[0], *names])
    # a module holding more relations than the graph (DGL calls only the graph's): loaded, equal to DGL's own
    sub = names[:2]
    hg = dgl.heterograph({("n", r, "n"): (torch.tensor([0, 1, 2]), torch.tensor([1, 2, 0])) for r in sub})
    x = torch.randn(3, 12)
    want = conv(hg, {"n": x})["n"]
    g = dgl.graph((torch.tensor([0, 1, 2, 0, 1, 2]), torch.tensor([1, 2, 0, 1, 2, 0])), num_nodes=3)
    got = HectorRGAT.from_dgl(conv, sub)(g, x, torch.tensor([0, 0, 0, 1, 1, 1]))
    torch.testing.assert_close(got, want.reshape(got.shape), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="HectorRGAT loads a dgl.nn.HeteroGraphConv of GATConv, got GATConv"):
        HectorRGAT.from_dgl(conv.mods["r0"], names)
    # HectorRGAT sums the relations; DGL's mean (or max, stack, ...) would give other outputs
    mean = dgl.nn.HeteroGraphConv({n: conv.mods[n] for n in names}, aggregate="mean")
    with pytest.raises(
        ValueError, match=r"sums the relations \(HeteroGraphConv aggregate='sum'\).*_mean_reduce"
    ):
        HectorRGAT.from_dgl(mean, names)
    with pytest.raises(ValueError, match=r"GATConv settings \['in_feats'\]"):
        HectorRGAT(10, 4, 2, R).load_dgl(conv, names)


def test_rgcn_low_precision_with_an_fp32_norm_promotes_as_dgl_does(graph):
    """DGL multiplies bf16 messages by an fp32 norm before the sum and returns fp32; Hector crashed in index_add_."""
    g, gd = graph
    torch.manual_seed(0)
    ref = dgl.nn.RelGraphConv(12, 6, R)
    norm = torch.rand(E, 1, generator=torch.Generator().manual_seed(3))
    x = torch.randn(N, 12, generator=torch.Generator().manual_seed(0))
    for dt in (torch.bfloat16, torch.float16):
        hec = HectorRelGraphConv(12, 6, R)
        hec.load_state_dict(ref.state_dict())
        hec = hec.to(dt)
        xh = x.to(dt).requires_grad_()
        out = hec(g, xh, gd["etype"], norm)
        assert out.dtype == torch.float32
        if dt == torch.bfloat16:  # DGL has no fp16 kernels on the CPU
            ref_dt = dgl.nn.RelGraphConv(12, 6, R)
            ref_dt.load_state_dict(ref.state_dict())
            ref_dt = ref_dt.to(dt)
            want = ref_dt(g, x.to(dt), gd["etype"], norm)
            assert want.dtype == torch.float32
        else:
            want = ref(g, x, gd["etype"], norm)
        torch.testing.assert_close(out, want, rtol=2e-2, atol=2e-2 * want.abs().max().item())
        out.square().sum().backward()
        assert xh.grad.dtype == dt and bool(xh.grad.isfinite().all())


@pytest.mark.parametrize("layer", ["rgcn-bdd", "rgat", "hgt"])
def test_layers_run_in_bf16_on_the_cpu_close_to_float32(graph, layer):
    """torch 2.2.1 has no bf16 torch.eye on the CPU: RGAT's head-dot weights and the bdd blocks built one."""
    g, gd = graph
    torch.manual_seed(0)
    if layer == "rgcn-bdd":
        mk = lambda: HectorRelGraphConv(12, 6, R, regularizer="bdd", num_bases=2)  # noqa: E731
        call = lambda m, x: m(g, x, gd["etype"])  # noqa: E731
    elif layer == "rgat":
        mk = lambda: HectorRGAT(12, 4, 2, R, hector=HectorConfig(reorder="never"))  # noqa: E731
        call = lambda m, x: m(g, x, gd["etype"])  # noqa: E731
    else:
        mk = lambda: HectorHGTConv(12, 4, 2, NT, R, dropout=0.0)  # noqa: E731
        call = lambda m, x: m(g, x, gd["ntype"], gd["etype"])  # noqa: E731
    ref, low = mk(), mk()
    if layer == "rgat":
        with torch.no_grad():
            ref.bias.normal_()
    low.load_state_dict(ref.state_dict())
    low = low.bfloat16()
    x = torch.randn(N, 12, generator=torch.Generator().manual_seed(0))
    xr, xl = x.clone().requires_grad_(), x.bfloat16().requires_grad_()
    out_r, out_l = call(ref, xr), call(low, xl)
    assert out_l.dtype == torch.bfloat16
    scale = out_r.abs().max().item()
    assert (out_l.float() - out_r).abs().max().item() <= 3e-2 * scale
    gy = torch.randn(out_r.shape, generator=torch.Generator().manual_seed(1))
    out_r.backward(gy)
    out_l.backward(gy.bfloat16())
    assert (xl.grad.float() - xr.grad).abs().max().item() <= 3e-2 * xr.grad.abs().max().item()


@pytest.mark.parametrize("layer", ["rgcn-vanilla", "rgcn-compact-norm", "rgat", "hgt"])
def test_layers_sum_in_fp32_in_bf16_forward_and_backward(graph, layer):
    """Every sum of several terms (a hub row's edges, a relation's edges) runs in fp32 (tests/hector_probes.py)."""
    g, gd = graph
    norm = None
    if layer.startswith("rgcn"):
        mat = layer.split("-")[1]
        m = HectorRelGraphConv(12, 6, R, hector=HectorConfig(materialization=mat))
        if layer.endswith("norm"):
            norm = torch.rand(E, 1, generator=torch.Generator().manual_seed(3)).bfloat16()
        call = lambda m, x: m(g, x, gd["etype"], norm)  # noqa: E731
    elif layer == "rgat":
        m = HectorRGAT(12, 4, 2, R, hector=HectorConfig(reorder="never"))
        call = lambda m, x: m(g, x, gd["etype"])  # noqa: E731
    else:
        m = HectorHGTConv(12, 4, 2, NT, R, dropout=0.0)
        call = lambda m, x: m(g, x, gd["ntype"], gd["etype"])  # noqa: E731
    m = m.bfloat16()
    x = torch.randn(N, 12, generator=torch.Generator().manual_seed(0)).bfloat16().requires_grad_()
    call(m, x)  # graph layout built outside the probe
    with LowPrecisionSums() as probe:
        call(m, x).float().square().sum().backward()
    assert probe.found == []


def test_install_hector_replaces_a_module_held_at_several_places_everywhere(graph):
    g, gd = graph
    conv = dgl.nn.RelGraphConv(12, 12, R)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(
                [conv] * 3
            )  # one module, three references (weights shared across layers)
            self.first = conv

        def forward(self, x):
            for layer in self.layers:
                x = layer(g, x, gd["etype"]).tanh()
            return x

    net = Net().double()
    x = _x()
    before = net(x)
    swapped = install_hector(net, {"gemm": "loop"})
    assert swapped == {n: "HectorRelGraphConv" for n in ("layers.0", "layers.1", "layers.2", "first")}
    assert type(net.layers[0]) is HectorRelGraphConv
    assert all(m is net.layers[0] for m in (*net.layers, net.first))  # still one module, so still shared
    _close(net(x), before)


def test_auto_materialization_uses_compact_rows_only_up_to_the_configured_ratio(graph):
    g, gd = graph
    x = _x()
    first = None
    for cap, compact in ((1.0, True), (0.0, False)):
        hec = HectorRelGraphConv(12, 6, R, hector=HectorConfig(compact_max_ratio=cap)).double()
        if first is None:
            first = hec
        else:
            hec.load_state_dict(first.state_dict())
        out = hec(g, x, gd["etype"])
        assert hec._layouts._layout.src_rows.compact is compact
        if hec is first:
            want = out
    _close(out, want)


class _LargestTensor(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the largest element count of any tensor an op returns (forward and backward)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.layout == torch.strided:
                self.largest = max(self.largest, t.numel())
        return out


def test_no_layer_materialises_per_edge_weights(graph):
    g, gd = graph
    d_in, d_out = 12, 8
    per_edge_weights = E * d_in * d_out
    # the detector sees a replicated-weight typed linear (what Hector avoids)
    from flowlane.hector import replicated_typed_linear

    with _LargestTensor() as probe:
        replicated_typed_linear(_x(d_in)[gd["src"]], gd["etype"], torch.randn(R, d_in, d_out, dtype=F64))
    assert probe.largest >= per_edge_weights
    layers = [
        (HectorRelGraphConv(d_in, d_out, R).double(), lambda m, x: m(g, x, gd["etype"])),
        (
            HectorHGTConv(d_in, 4, 2, NT, R, dropout=0.0).double(),
            lambda m, x: m(g, x, gd["ntype"], gd["etype"]),
        ),
        (HectorRGAT(d_in, 4, 2, R).double(), lambda m, x: m(g, x, gd["etype"])),
    ]
    for layer, call in layers:
        x = _x(d_in)
        call(layer, x)  # graph layout built and cached outside the probe
        with _LargestTensor() as probe:
            call(layer, x).square().sum().backward()
        assert probe.largest <= E * max(d_in, d_out), (type(layer).__name__, probe.largest)
