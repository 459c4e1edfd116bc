"""The install-time probe of G3 full-graph training (``dgl_plugin.g3_model_check.check_model``): its block check
decides by the property, not by rounding, and it leaves the user's model and random streams as they were."""

import pytest

pytestmark = pytest.mark.gnn
# the llm lane collects this file without DGL; tests/test_dgl_lane.py guards the lane
dgl = pytest.importorskip("dgl")
torch = pytest.importorskip("torch")

import torch.nn.functional as F  # noqa: E402
from dgl.nn import GraphConv, SAGEConv  # noqa: E402
from torch import nn  # noqa: E402

from dgl_plugin.g3_model_check import ModelContractError, check_model  # noqa: E402


class _Stack(nn.Module):
    """DGL-style: ``layers`` with ReLU between them in the user's own forward."""

    def __init__(self, *layers):
        super().__init__()
        self.layers = nn.ModuleList(layers)

    def forward(self, graph, x):
        h = x
        for k, layer in enumerate(self.layers):
            h = layer(graph, h)
            if k < len(self.layers) - 1:
                h = F.relu(h)
        return h


def _gcn(in_feats, scale, dtype, seed):
    torch.manual_seed(seed)
    model = _Stack(GraphConv(in_feats, 128), GraphConv(128, 8)).to(dtype)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(scale)
    return model


@pytest.mark.parametrize(
    "in_feats,scale,dtype,seed",
    [(500, 3.0, torch.float32, 0), (1000, 2.0, torch.float32, 1), (16, 1.0, torch.bfloat16, 0)],
    ids=["500feats-weights-x3", "1000feats-weights-x2", "bfloat16"],
)
def test_a_correct_graphconv_is_accepted_whatever_its_rounding(in_feats, scale, dtype, seed):
    """A GraphConv on blocks folds its normalisation into edge weights, so it rounds differently from its
    whole-graph run: compared in the model's dtype, these correct models were refused (500 features with weights x3:
    10 of 10 seeds; 1000 x2: 8 of 10; bfloat16 always). The block probe runs on a float64 copy."""
    assert check_model(_gcn(in_feats, scale, dtype, seed), in_feats, dtype) == "forward"


class _Float32Only(SAGEConv):
    """A correct single-round layer that only runs in float32 (it casts its input): the float64 probe cannot run it,
    so the probe compares it in the model's dtype."""

    def forward(self, graph, feat):
        f = tuple(t.float() for t in feat) if isinstance(feat, tuple) else feat.float()
        return super().forward(graph, f)


def test_a_layer_that_cannot_run_in_float64_is_checked_in_its_own_dtype():
    torch.manual_seed(0)
    assert check_model(_Stack(_Float32Only(16, 8, "mean"), SAGEConv(8, 4, "mean")), 16) == "forward"


NOT_ONE_ROUND = {
    "SGConv": lambda: dgl.nn.SGConv(16, 4, k=2, allow_zero_in_degree=True),
    "TAGConv": lambda: dgl.nn.TAGConv(16, 4, k=2),
    "APPNPConv": lambda: dgl.nn.APPNPConv(k=3, alpha=0.1),  # fails in float64: compared in float32
    "ChebConv": lambda: dgl.nn.ChebConv(16, 4, k=2),
}


@pytest.mark.parametrize("name", list(NOT_ONE_ROUND))
def test_several_rounds_in_one_layer_are_still_refused(name):
    torch.manual_seed(0)
    with pytest.raises(ModelContractError, match=rf"model.layers\[0\] \({name}\) cannot run bin by bin"):
        check_model(_Stack(NOT_ONE_ROUND[name]()), 16)


class _DrawsRandom(nn.Module):
    """Draws from torch's RNG in eval mode too (e.g. a sampler); its output does not depend on the draw."""

    def __init__(self, a, b):
        super().__init__()
        self.conv = SAGEConv(a, b, "mean")
        self.norm = nn.BatchNorm1d(b)  # inside a layer: running statistics, a buffer

    def forward(self, graph, h):
        return self.norm(self.conv(graph, h)) + 0 * torch.rand(())


def _accepted():
    torch.manual_seed(0)
    model = _Stack(_DrawsRandom(16, 8), GraphConv(8, 4))
    model.train()
    model(
        dgl.add_self_loop(dgl.rand_graph(30, 90)), torch.randn(30, 16)
    ).sum().backward()  # grads and running stats to keep
    return model


def _refused():
    torch.manual_seed(0)
    return _Stack(dgl.nn.SGConv(16, 4, k=2, cached=True, allow_zero_in_degree=True))


@pytest.mark.parametrize("make,refused", [(_accepted, False), (_refused, True)], ids=["accepted", "refused"])
def test_check_model_leaves_the_model_and_the_rng_as_they_were(make, refused):
    """The probes run on copies: SGConv(cached=True) kept the 24-node probe graph's propagated features, and then
    ``model(real_graph, x)`` silently returned 24 rows; a model drawing random numbers moved the user's stream."""
    model = make()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    grads = {k: None if p.grad is None else p.grad.clone() for k, p in model.named_parameters()}
    training, rng = model.training, torch.get_rng_state()
    if refused:
        with pytest.raises(ModelContractError, match=r"\(SGConv\) cannot run bin by bin"):
            check_model(model, 16)
    else:
        assert check_model(model, 16) == "forward"
    assert torch.equal(torch.get_rng_state(), rng)
    assert model.training == training
    after = model.state_dict()
    assert after.keys() == state.keys() and all(torch.equal(after[k], v) for k, v in state.items())
    for k, p in model.named_parameters():
        assert (p.grad is None) == (grads[k] is None) and (p.grad is None or torch.equal(p.grad, grads[k])), k
    if refused:
        assert model.layers[0]._cached_h is None
        g = dgl.add_self_loop(dgl.rand_graph(100, 400))
        assert model(g, torch.randn(100, 16)).shape == (100, 4)
