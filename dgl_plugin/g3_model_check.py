"""G3's model contract, checked at install (seed 000 ch.4 §4.4.3; digest B2.8, B6 #8, #12, #14).

G3's runtime (:mod:`dgl_plugin.fullgraph`) never runs a user's model on the whole graph: a rank holds one partition,
exchanges the halo rows once before each ``model.layers[k]`` (one planned graph_allgather per layer), and computes
the layer bin by bin, on each bin's DGL block as ``layer(block, (h_src, h_dst))`` (§4.4.3 step 2). That equals
single-process training only if the model keeps its graph layers in ``model.layers``; each layer does one
message-passing round and reads nothing else of the graph (a second hop would need the halo's neighbours, a cache or
a Laplacian's lambda_max would be the bin's); everything outside the layers acts row by row and uses the graph only
to pass it to the layers (no BatchNorm: per-partition statistics); and out-degree normalisation happens only in a
``GraphConv`` that is itself ``model.layers[k]``, whose global degrees the runtime folds into edge weights (B6 #14).
:func:`check_model` proves this on a small probe graph, on deep copies of the model, or raises
:class:`ModelContractError` saying what to add; :func:`check_layer0_takes_features` checks what ``features="host"``
needs; :func:`layer_widths` sizes the bins of ``mem_budget_bytes`` (B6 #8) and :func:`grad_ready_order` orders the
layer-wise all-reduce (B6 #12).

The bin computation itself (:func:`bin_block`, :func:`gcn_norms`, :func:`layer_on_block`) and the stand-ins that
run the user's own ``forward`` (:class:`NoGraph`, :func:`swap_layers`) live here and the runtime imports them, so
the probe checks exactly what the runtime runs. This module imports nothing of the runtime; nothing runs on import.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import logging
from collections.abc import Callable, Iterator
from typing import Any

import dgl
import numpy as np
import torch
from dgl.nn import EdgeWeightNorm, GraphConv

log = logging.getLogger("flowlane.g3")


_NODE_MIXING = (torch.nn.modules.batchnorm._BatchNorm, torch.nn.InstanceNorm1d)


class NoGraph:
    """Stands in for the graph in ``model.forward`` when the runtime runs it: the graph may only be passed on to
    ``model.layers``; any other use is refused (the runtime holds only a partition)."""

    def __getattr__(self, name: str) -> Any:
        raise ModelContractError(
            f"model.forward uses graph.{name} outside model.layers; full-graph training holds only a partition, so "
            f"a forward may only pass the graph to its layers. Add forward_layer(k, block, h_src, h_dst) (layer k plus "
            f"what follows it) to the model instead"
        )


class ModelContractError(ValueError):
    """The model cannot be run partition by partition as written; the message says what to add."""


class _LayerCall(torch.nn.Module):
    """Replaces ``model.layers[k]`` while the runtime runs the user's own ``forward``."""

    def __init__(self, k: int, fn: Any) -> None:
        super().__init__()
        self.k, self.fn = k, fn

    def forward(self, graph: Any, h: Any, *args: Any, **kw: Any) -> torch.Tensor:
        if args or kw:
            raise ModelContractError(
                f"model.forward calls layers[{self.k}] with extra arguments {args or kw}; the "
                f"runtime supports layer(graph, h) only. Add forward_layer(k, block, h_src, h_dst)"
            )
        if not isinstance(h, torch.Tensor):
            raise ModelContractError(
                f"model.forward calls layers[{self.k}] with {type(h).__name__}, not one tensor of "
                f"node rows. Add forward_layer(k, block, h_src, h_dst)"
            )
        return self.fn(self.k, h)


def swap_layers(model: torch.nn.Module, fn: Any) -> list:
    saved = list(model.layers)
    for k in range(len(saved)):
        model.layers[k] = _LayerCall(k, fn)
    return saved


def restore_layers(model: torch.nn.Module, saved: list) -> None:
    for k, m in enumerate(saved):
        model.layers[k] = m


class _Layer0Input(Exception):
    pass


def check_layer0_takes_features(model: torch.nn.Module, in_feats: int, dtype: torch.dtype) -> None:
    """Install-time check for ``features="host"`` with a model run through its own ``forward``: ``layers[0]`` must get
    the features object itself (they stay in host memory), in training mode. Raises :class:`ModelContractError`."""
    dev = next((p.device for p in model.parameters()), torch.device("cpu"))
    x = torch.zeros(2, in_feats, dtype=dtype, device=dev)

    def first(k: int, h: Any) -> None:
        raise _Layer0Input(h is x)

    saved, was = swap_layers(model, first), model.training
    model.train()
    same = False
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):  # input dropout must not move the user's RNG
            model(NoGraph(), x)
    except _Layer0Input as e:
        same = bool(e.args[0])
    finally:
        restore_layers(model, saved)
        model.train(was)
    if not same:
        raise ModelContractError(
            "features='host' needs model.layers[0] to receive the node features unchanged (they stay in host "
            "memory and each bin gathers its rows); this model's forward computes on them first (e.g. input "
            "dropout in training). Move that into forward_layer(k, block, h_src, h_dst), or use features='device'"
        )


def _probe_graph(
    model: torch.nn.Module, n: int, in_feats: int, dtype: torch.dtype
) -> tuple[Any, torch.Tensor]:
    """A small random graph (every node has an in-edge) and features, on the model's device."""
    gen = torch.Generator().manual_seed(0)
    src = torch.cat([torch.arange(n), torch.randint(0, n, (3 * n,), generator=gen)])
    dst = torch.cat([(torch.arange(n) + 1) % n, torch.randint(0, n, (3 * n,), generator=gen)])
    dev = next((p.device for p in model.parameters()), torch.device("cpu"))
    return dgl.graph((src, dst), num_nodes=n).to(dev), torch.randn(n, in_feats, generator=gen).to(dev, dtype)


@contextlib.contextmanager
def _probe_copy(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """A deep copy of ``model``, in eval mode, for an install-time probe; torch's RNG state is restored after it. The
    probes run the model on a small graph, and nothing of that may stay in the user's model (a layer's cache, e.g.
    ``SGConv(cached=True)``'s, would keep the probe graph's rows and serve them on the real graph) or move its random
    streams."""
    try:
        probe = copy.deepcopy(model)
    except Exception as e:
        raise ModelContractError(
            f"the install check runs the model on a small probe graph, on a deep copy so that nothing of the probe "
            f"stays in the model; copy.deepcopy(model) raised {_first_line(e)}. Make the model deep-copyable"
        ) from e
    cuda = sorted({t.get_device() for t in itertools.chain(probe.parameters(), probe.buffers()) if t.is_cuda})
    with torch.random.fork_rng(devices=cuda):
        yield probe.eval()


def layer_widths(model: torch.nn.Module, in_feats: int, dtype: torch.dtype) -> list[tuple[int, int, int]]:
    """(input, output, per-edge) width of every ``model.layers[k]``: its row widths (heads flattened), from one
    eval-mode run of ``model(g, x)`` on a small graph, and its attention values per edge (B6 #8: the number of
    heads of a DGL attention layer in it, which keeps it in ``_num_heads`` (GATConv, GATv2Conv, DotGatConv, EGATConv,
    EdgeGATConv); 0 for the others). Sizes the bins of ``mem_budget_bytes``."""
    widths: dict[int, tuple[int, int, int]] = {}

    def row(t: Any) -> int:
        t = t[0] if isinstance(t, tuple) else t
        return int(t[0].numel()) if t.shape[0] else int(np.prod(t.shape[1:]))

    def hook(k: int) -> Any:
        def record(_m: Any, args: tuple, out: Any) -> None:  # returns None: the output is left unchanged
            widths.setdefault(k, (row(args[1]), row(out), heads[k]))

        return record

    heads = [
        max((int(getattr(m, "_num_heads", 0)) for m in layer.modules()), default=0) for layer in model.layers
    ]
    with _probe_copy(model) as probe, torch.no_grad():
        g, x = _probe_graph(probe, 8, in_feats, dtype)
        for k, layer in enumerate(probe.layers):
            layer.register_forward_hook(hook(k))
        probe(g, x)
    missing = [k for k in range(len(model.layers)) if k not in widths]
    if missing:
        raise ModelContractError(f"model(g, x) did not call layers {missing}; every layer must run once")
    return [widths[k] for k in range(len(model.layers))]


def grad_ready_order(model: torch.nn.Module, in_feats: int) -> dict[str, int]:
    """Position of every parameter (by name; frozen ones included) in the order one backward of ``model(g, x)`` on
    a small probe graph accumulates their gradients: autograd accumulates a parameter's gradient as soon as its
    last contribution exists, so a head comes before the last layer and an input projection used in layer 0 after
    it. The same on every rank (the same model and probe, on CPU: one autograd thread); it orders the layer-wise
    all-reduce (B6 #12). In float32 whatever the model's dtype (DGL's CPU kernels refuse fp16, and the order does
    not depend on the dtype). A model that cannot run on the CPU (a CUDA-only op, a CUDA tensor kept as a plain
    attribute) gets ``{}``, with a warning: the all-reduces then go in the fixed order used before this probe
    existed (the same on every rank: every rank holds the same model)."""
    order: dict[str, int] = {}
    try:
        _grad_ready_probe(model, in_feats, order)
    except Exception as e:  # noqa: BLE001 - any failure of the user's model on the CPU probe
        log.warning(
            "G3: the gradient-ready probe could not run the model on the CPU (%s: %s); the layer-wise all-reduces "
            "go in the fixed order (the group outside the layers, then the last layer first)",
            type(e).__name__,
            e,
        )
        return {}
    return order


def _grad_ready_probe(model: torch.nn.Module, in_feats: int, order: dict[str, int]) -> None:
    with _probe_copy(model) as probe, torch.enable_grad():
        probe.to("cpu", torch.float32)

        def ready(name: str) -> Callable[[torch.Tensor], None]:
            def hook(_p: torch.Tensor) -> None:  # a hook returns None
                order.setdefault(name, len(order))

            return hook

        for name, p in probe.named_parameters():
            p.requires_grad_(True)
            p.register_post_accumulate_grad_hook(ready(name))
        g, x = _probe_graph(probe, 8, in_feats, torch.float32)
        probe(g, x).sum().backward()


def check_model(model: torch.nn.Module, in_feats: int, dtype: torch.dtype = torch.float32) -> str:
    """Install-time check that the runtime computes exactly ``model(g, x)`` (DGL's full-graph convention).

    Returns the mode: ``"forward_layer"`` (the model has ``forward_layer``; chaining it must equal ``forward``) or
    ``"forward"`` (the user's own ``forward`` runs with each ``model.layers[k]`` computed distributedly; every other
    operation must act row by row). Both are verified on a small random graph, in eval mode: the forward is run on
    two disjoint halves of the nodes, fed the layer outputs of a full run, and each half must reproduce the full run.
    Each layer must also give the full run's rows when computed as the runtime computes it, on bins' blocks
    (:func:`_check_layers_on_blocks`: one halo exchange, one message-passing round per ``model.layers[k]``; in
    float64, so that rounding cannot decide). Every probe runs on deep copies of the model and torch's RNG state is
    restored after them: the user's model and random streams are left as they were (:func:`_probe_copy`). A module
    normalising by out-degrees other than a ``GraphConv`` that is ``model.layers[k]`` is refused (it would count a
    bin's degrees; :func:`_check_degree_norms`). Anything else raises :class:`ModelContractError` saying what to
    add."""
    layers = getattr(model, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList) or len(layers) == 0:
        raise ModelContractError(
            "model must keep its graph layers in `self.layers` (a non-empty nn.ModuleList of dgl.nn convolutions), as "
            "DGL's full-graph examples do; found "
            + (type(layers).__name__ if layers is not None else "no `layers`")
        )
    in_layers = {id(m) for layer in layers for m in layer.modules()}
    for name, m in model.named_modules():
        if id(m) not in in_layers and isinstance(m, _NODE_MIXING):
            raise ModelContractError(
                f"model.{name} ({type(m).__name__}) normalises across all nodes; per-partition "
                f"statistics would differ from single-process training. Remove it, or use "
                f"LayerNorm (row by row)"
            )
    _check_degree_norms(model)
    mode = "forward_layer" if callable(getattr(model, "forward_layer", None)) else "forward"
    with _probe_copy(model) as probe, _probe_copy(model) as exact, torch.no_grad():
        g, x = _probe_graph(probe, 24, in_feats, dtype)
        try:
            ref = probe(g, x)
        except Exception as e:
            raise ModelContractError(
                f"model(g, x) failed on a full graph ({type(e).__name__}: {e}); the runtime "
                f"needs DGL's full-graph convention forward(graph, features)"
            ) from e
        if mode == "forward_layer":
            hs = _check_forward_layer(probe, g, x, ref)
        else:
            hs = _check_row_by_row(probe, g, x, ref)
        _check_layers_on_blocks(exact.double(), probe, mode, g, hs)
    return mode


def _check_degree_norms(model: torch.nn.Module) -> None:
    """A module that normalises by source out-degrees computes them from the graph it is given: on a bin's block that
    is the bin's share of the edges, not the graph's (named here by its module path; the block probe of
    :func:`_check_layers_on_blocks` would see only different rows). Global degrees are folded into edge weights for
    a ``GraphConv`` that is ``model.layers[k]`` itself (B6 #14); any other such module is refused, naming it.
    In-degree normalisation (``norm="right"``) is exact: a bin's block holds every in-edge of its destination rows."""
    layers = {id(layer) for layer in model.layers}
    for name, m in model.named_modules():
        norm = getattr(m, "_norm", None)
        if not isinstance(m, GraphConv | EdgeWeightNorm) or norm not in ("left", "both"):
            continue
        if isinstance(m, GraphConv) and id(m) in layers:
            continue
        raise ModelContractError(
            f"model.{name} ({type(m).__name__}, norm={norm!r}) normalises by out-degrees, which it would count on "
            f"each bin's block, not on the graph. The runtime uses global degrees only for a GraphConv that is "
            f"itself model.layers[k]: put the GraphConv there (what wraps it goes into forward or forward_layer), "
            f"or use norm='right' or 'none'"
        )


def _matches(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.allclose(a, b, rtol=1e-5, atol=1e-6)


def _check_forward_layer(
    model: torch.nn.Module, g: Any, x: torch.Tensor, ref: torch.Tensor
) -> list[torch.Tensor]:
    """Chaining ``forward_layer(k, g, h, h)`` over the layers must give ``model(g, x)``. Returns each layer's input."""
    h, hs = x, []
    for k, layer in enumerate(model.layers):
        hs.append(h)
        try:
            h = model.forward_layer(k, g, h, h)
        except Exception as e:
            raise ModelContractError(
                _not_one_round(
                    k, layer, "forward_layer", f"forward_layer({k}, graph, h, h) raised {_first_line(e)}"
                )
            ) from e
    if not _matches(h, ref):
        raise ModelContractError(
            "chaining model.forward_layer(k, ...) over model.layers does not give "
            "model(g, x); make forward_layer run layer k plus exactly what follows it"
        )
    return hs


def _check_row_by_row(
    model: torch.nn.Module, g: Any, x: torch.Tensor, ref: torch.Tensor
) -> list[torch.Tensor]:
    """The user's ``forward`` with each graph layer swapped for a call the runtime makes: run once on the whole graph
    (recording each layer's input and output), then on each half of the nodes, fed the recorded outputs; a half's
    inputs to the layers and its result must be the full run's rows. Returns each layer's input."""
    inputs: list[tuple[torch.Tensor, torch.Tensor]] = []

    def full(k: int, h: torch.Tensor) -> torch.Tensor:
        if len(inputs) != k:
            raise ModelContractError(
                f"model.forward calls layers[{k}] out of order (after {len(inputs)} "
                f"layer calls); layers must run once each, in order"
            )
        out = layers_saved[k](g, h)
        inputs.append((h, out))
        return out

    layers_saved = swap_layers(model, full)
    try:
        out_full = model(NoGraph(), x)
        if len(inputs) != len(layers_saved):
            raise ModelContractError(
                f"model.forward called {len(inputs)} of its {len(layers_saved)} layers; each must run once, in order"
            )
        if not _matches(out_full, ref):
            raise ModelContractError(
                "model.forward gives different results when its layers are called "
                "through the runtime; add forward_layer(k, block, h_src, h_dst)"
            )
        n = x.shape[0]
        for half in (torch.arange(0, n, 2, device=x.device), torch.arange(1, n, 2, device=x.device)):
            _check_half(model, inputs, x, ref, half)
    finally:
        restore_layers(model, layers_saved)
    return [h for h, _ in inputs]


def _check_half(
    model: torch.nn.Module,
    inputs: list[tuple[torch.Tensor, torch.Tensor]],
    x: torch.Tensor,
    ref: torch.Tensor,
    half,
) -> None:
    """``forward`` on the rows ``half`` alone, each layer returning the full run's output rows: what reaches a layer
    must be the full run's input rows (nothing mixed nodes before it), and the result the full run's rows (nothing
    after the last layer did)."""

    def part(k: int, h: torch.Tensor) -> torch.Tensor:
        hin, hout = inputs[k]
        if h.shape[0] != half.numel() or not torch.allclose(h, hin[half], rtol=1e-5, atol=1e-6):
            raise ModelContractError(
                f"model.forward mixes nodes outside its graph layers (the input of layers[{k}] "
                f"depends on other nodes' rows); the runtime would compute a different function. "
                f"Add forward_layer(k, block, h_src, h_dst) to the model"
            )
        return hout[half]

    for k in range(len(inputs)):
        model.layers[k] = _LayerCall(k, part)
    if not _matches(model(NoGraph(), x[half]), ref[half]):
        raise ModelContractError(
            "model.forward mixes nodes after its last graph layer; the runtime "
            "would compute a different function. Add forward_layer(k, block, "
            "h_src, h_dst)"
        )


def _first_line(e: Exception) -> str:
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0].rstrip(':') if lines else ''}"


def _not_one_round(k: int, layer: torch.nn.Module, mode: str, why: str) -> str:
    """The refusal of a ``model.layers[k]`` the runtime cannot compute bin by bin: what failed, what is supported."""
    call = f"model.forward_layer({k}, ...) with " if mode == "forward_layer" else ""
    return (
        f"{call}model.layers[{k}] ({type(layer).__name__}) cannot run bin by bin: {why}. The runtime exchanges the "
        f"halo once per model.layers[k] and then computes the layer on each bin's block as "
        f"layer(block, (h_src, h_dst)), so a layer may do one message-passing round (source rows to destination "
        f"rows) and read nothing else of the graph: single-round convolutions such as GraphConv, SAGEConv, GATConv, "
        f"GINConv or EdgeConv. A module propagating k hops in one call (SGConv, TAGConv, APPNPConv, ChebConv, "
        f"GatedGraphConv, TWIRLSConv) would need k halo exchanges, and graph-wide state (a cache, a Laplacian's "
        f"lambda_max) would be the bin's: express the k hops as k entries of model.layers (e.g. k GraphConv "
        f"layers), each one round"
    )


def _check_layers_on_blocks(
    exact: torch.nn.Module, model: torch.nn.Module, mode: str, g: Any, hs: list[torch.Tensor]
) -> None:
    """Each ``model.layers[k]`` computed as the runtime computes it (:func:`layer_on_block` on :func:`bin_block`
    blocks, GCN weights from the probe graph's degrees) must give the rows of its full-graph run on input ``hs[k]``:
    each half of the probe's nodes as a bin, compacted and over every source row. This catches, by the property
    rather than by name, what one halo exchange per layer cannot compute: several message-passing rounds in one
    module (SGConv, TAGConv, APPNPConv; their second hop would need the halo's neighbours), graph-wide state
    (ChebConv's lambda_max, SGConv's cache) and modules that do not take a block with ``(h_src, h_dst)``.

    Both runs use ``exact``, a float64 copy of the model, on ``hs[k]`` in float64: the two runs round differently
    (GraphConv folds its normalisation into edge weights on blocks), and in the model's own dtype a correct
    GraphConv with large weights, or any in bfloat16, was refused for the difference. A layer whose
    whole-graph run fails in float64 (DGL's APPNPConv) is compared in the model's dtype, on ``model``. Rows match
    within ``rtol`` of each value or of the layer output's largest magnitude (:func:`_close`); a block run that
    raises is a refusal."""
    src, dst = (t.cpu().numpy().astype(np.int64) for t in g.edges())
    n = g.num_nodes()
    eo = np.argsort(dst, kind="stable")
    src, dst = src[eo], dst[eo]
    eptr = np.searchsorted(dst, np.arange(n + 1))
    deg_in, deg_out = (np.bincount(a, minlength=n).clip(min=1).astype(np.float64) for a in (dst, src))
    # float64: layer_on_block casts them to the dtype of the run
    norms = {k: torch.from_numpy(v) for k, v in gcn_norms(deg_in, deg_out, src, dst).items()}
    dev = hs[0].device
    bins = []
    for rows in (np.arange(0, n, 2), np.arange(1, n, 2)):
        for n_src in (None, n):
            ids, blk = bin_block(rows, eptr, src, norms, n_src)
            src_ids = None if ids is None else torch.from_numpy(ids).to(dev)
            bins.append((torch.from_numpy(rows).to(dev), src_ids, blk.to(dev)))

    def whole(m: torch.nn.Module, k: int, h: torch.Tensor) -> torch.Tensor:
        return m.forward_layer(k, g, h, h) if mode == "forward_layer" else m.layers[k](g, h)

    for k in range(len(model.layers)):
        m, h, rtol = exact, hs[k].double(), 1e-5
        try:
            want = whole(m, k, h)
        except Exception:  # not runnable in float64: compare in the model's dtype, to its rounding
            m, h, rtol = model, hs[k], max(1e-5, 4 * torch.finfo(hs[k].dtype).eps)
            want = whole(m, k, h)
        layer = m.layers[k]
        for rows, src_ids, blk in bins:
            try:
                got = layer_on_block(m, mode, k, layer, blk, h if src_ids is None else h[src_ids], h[rows])
            except Exception as e:
                raise ModelContractError(
                    _not_one_round(k, layer, mode, f"on a bin's block it raised {_first_line(e)}")
                ) from e
            if not _close(got, want[rows], want, rtol):
                raise ModelContractError(
                    _not_one_round(
                        k, layer, mode, "on a bin's block it gives other rows than on the whole graph"
                    )
                )


def _close(got: Any, want: torch.Tensor, whole: torch.Tensor, rtol: float) -> bool:
    """``got`` equals ``want`` within ``rtol`` of each value or of the largest magnitude in ``whole`` (the layer's
    output): an absolute floor scaled to the output, so that a layer's rounding on large outputs cannot decide."""
    if not isinstance(got, torch.Tensor) or got.shape != want.shape:
        return False
    scale = float(whole.abs().max()) if whole.numel() else 0.0
    return torch.allclose(got.double(), want.double(), rtol=rtol, atol=rtol * scale)


def gcn_norms(
    in_deg: np.ndarray, out_deg: np.ndarray, e_src: np.ndarray, e_dst: np.ndarray
) -> dict[str, np.ndarray]:
    """Per-edge GraphConv weights of each ``norm`` from (global, clipped) degrees (B6 #14)."""
    return {
        "both": out_deg[e_src] ** -0.5 * in_deg[e_dst] ** -0.5,
        "left": 1.0 / out_deg[e_src],
        "right": 1.0 / in_deg[e_dst],
    }


def layer_on_block(
    model: torch.nn.Module,
    mode: str,
    k: int,
    layer: torch.nn.Module,
    blk: Any,
    x_src: torch.Tensor,
    x_dst: torch.Tensor,
) -> torch.Tensor:
    """Layer ``k`` on one bin's block; with ``forward_layer`` also what follows the layer."""
    fl = model.forward_layer if mode == "forward_layer" else None
    if isinstance(layer, GraphConv) and layer._norm != "none":
        saved = layer._norm
        layer._norm = "none"  # B6 #14: global-degree normalisation folded into edge weights
        try:
            h = layer(blk, (x_src, x_dst), edge_weight=blk.edata[f"norm_{saved}"].to(x_src.dtype))
        finally:
            layer._norm = saved
        return _post(model, k, h, blk, x_src, x_dst) if fl is not None else h
    if fl is not None:
        return fl(k, blk, x_src, x_dst)
    return layer(blk, (x_src, x_dst))


def bin_block(
    rows: np.ndarray, eptr: np.ndarray, e_src: np.ndarray, norms: dict[str, torch.Tensor], n_src: int | None
) -> tuple[np.ndarray | None, Any]:
    """The DGL block of one bin: the in-edges of its destination ``rows`` (edges sorted by destination, ``eptr`` their
    offsets), each with its normalisations. ``n_src`` None: compacted, the block's sources are only the rows its edges
    read (returned, sorted); else the block spans all ``n_src`` source rows and no sources are returned."""
    eidx = (
        np.concatenate([np.arange(eptr[r], eptr[r + 1]) for r in rows])
        if rows.size
        else np.zeros(0, np.int64)
    )
    dst_pos = np.repeat(np.arange(rows.size), eptr[rows + 1] - eptr[rows])
    src = None
    if n_src is None:
        src, src_pos = np.unique(e_src[eidx], return_inverse=True)
        src_pos, num_src = src_pos.reshape(-1), src.size
    else:
        src_pos, num_src = e_src[eidx], n_src
    blk = dgl.create_block(
        (torch.from_numpy(src_pos), torch.from_numpy(dst_pos)), num_src_nodes=num_src, num_dst_nodes=rows.size
    )
    for k, w in norms.items():
        blk.edata[f"norm_{k}"] = w[torch.from_numpy(eidx)]
    return src, blk


def _post(
    model: torch.nn.Module, k: int, h: torch.Tensor, blk: Any, x_src: torch.Tensor, x_dst: torch.Tensor
) -> torch.Tensor:
    """``model.forward_layer(k, blk, x_src, x_dst)`` with layer ``k``'s output already computed (``h``: a GraphConv
    run with global-degree edge weights): what follows the layer (activation, a residual on ``x_dst``, head
    reshaping) runs on the bin's own block and rows."""

    class _Given(torch.nn.Module):
        def forward(self, blk, feats):
            return h

    saved = model.layers[k]
    model.layers[k] = _Given()
    try:
        return model.forward_layer(k, blk, x_src, x_dst)
    finally:
        model.layers[k] = saved
