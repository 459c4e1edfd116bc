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


@pytest.mark.parametrize("reorder", ["never", "always", "auto"])
def test_rgat_equals_dgl_heterographconv_of_gatconv_forward_and_backward(graph, reorder):
    g, gd = graph
    torch.manual_seed(0)
    conv, names = hetero_rgat_reference(12, 4, 2, R)
    conv = conv.double()
    hg = to_relation_graph(gd["src"], gd["dst"], gd["etype"], N, R)
    hec = HectorRGAT.from_dgl(conv, names, hector=HectorConfig(reorder=reorder))
    x, x2 = _x(), _x()
    out_ref, out_hec = conv(hg, {"n": x})["n"], hec(g, x2, gd["etype"])
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
    assert isinstance(net.rgcn, HectorRelGraphConv) and isinstance(net.hgt, dgl.nn.HGTConv)
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
