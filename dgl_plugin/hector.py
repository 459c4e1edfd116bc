"""Hector layers for DGL (seed 003 ch. 3; issue 40): RGCN, RGAT and HGT on :mod:`flowlane.hector`'s operators.

* :class:`HectorRelGraphConv` is a :class:`dgl.nn.RelGraphConv` (same constructor, parameters, ``state_dict`` and
  call ``conv(g, feat, etypes, norm)``) whose forward computes messages per unique (source, relation) row with a
  segment GEMM (compact materialization, thesis §3.3.2) and sums them into destinations with one sparse product; DGL's
  own forward copies a weight-multiplied source row per edge (``gather_mm`` / ``segment_mm`` over edges).
* :class:`HectorHGTConv` is a :class:`dgl.nn.HGTConv` the same way: the relation attention and message GEMMs run over
  unique (source, relation) rows (or, for the attention, unique (destination, relation) rows when fewer: linear
  reordering ``(k W_r) . q = k . (q W_r^T)``).
* :class:`HectorRGAT` is relational GAT (thesis Listing 3.1) as DGL writes it, ``HeteroGraphConv({r: GATConv})`` with
  ``aggregate="sum"``, as one layer over a homogeneous graph with edge types; :meth:`HectorRGAT.from_dgl` loads that
  module's weights. The attention vectors fold into the relation weights (``h (W_r a_r)``) where the cost model of
  :func:`flowlane.hector.plan_fold` says it pays.
* :func:`install_hector` swaps the two DGL modules inside a model for their Hector versions (same parameter objects,
  so an optimizer built before still applies); a model holding none is refused.

Graph preprocessing (sorting by type, unique (node, relation) rows, the sparse structure) is cached per graph object
and edge-type tensor, as Hector emits it once per dataset (§3.3.6). DGL attributes used (``linear_r``,
``relation_att``, ...) are checked on DGL 2.0-2.1 (:data:`DGL_RANGE`).
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass, field
from functools import partial

import dgl
import torch
import torch.nn.functional as F
from dgl.nn import GATConv, HeteroGraphConv, HGTConv, RelGraphConv
from dgl.nn.pytorch.hetero import _agg_func, _sum_reduce_func
from torch import Tensor, nn

from flowlane.hector import (
    EdgeAggregator,
    HectorConfig,
    RowIndex,
    compact_rows,
    edge_softmax,
    fold_attention,
    gather_dot,
    gather_rows,
    materialize,
    plan_fold,
    plan_side,
    segment_mm,
    type_order,
    vanilla_rows,
)
from flowlane.versions import check_version_range

logger = logging.getLogger(__name__)

#: (major, minor) range [first, last) of DGL whose module attributes these layers read
DGL_RANGE = ((2, 0), (2, 2))


# --------------------------------------------------------------------------------------------------------------------
# Per-graph layout (cached)


@dataclass
class GraphLayout:
    """Edges of one graph grouped for Hector: rows by (source, relation) and (destination, relation), aggregators."""

    src: Tensor
    dst: Tensor
    etype: Tensor
    num_src: int
    num_dst: int
    num_types: int
    config: HectorConfig
    _cache: dict = field(default_factory=dict, repr=False)

    def _rows(self, side: str) -> RowIndex:
        key = ("rows", side)
        if key not in self._cache:
            node, n = (self.src, self.num_src) if side == "src" else (self.dst, self.num_dst)
            mat = self.config.materialization
            rows = (
                vanilla_rows(node, self.etype, n, self.num_types)
                if mat == "vanilla"
                else compact_rows(node, self.etype, n, self.num_types)
            )
            if mat == "auto" and rows.ratio > self.config.compact_max_ratio:
                rows = vanilla_rows(node, self.etype, n, self.num_types)
            self._cache[key] = rows
        return self._cache[key]

    @property
    def src_rows(self) -> RowIndex:
        """Rows of tensors that depend on (source, relation): RGCN/RGAT messages, HGT keys and values."""
        return self._rows("src")

    @property
    def dst_rows(self) -> RowIndex:
        """Rows of tensors that depend on (destination, relation): RGAT's destination score, HGT's reordered query."""
        return self._rows("dst")

    @property
    def groups(self) -> RowIndex:
        """Unique (destination, relation) pairs, always compact: the per-relation softmax groups of RGAT."""
        if "groups" not in self._cache:
            self._cache["groups"] = compact_rows(self.dst, self.etype, self.num_dst, self.num_types)
        return self._cache["groups"]

    @property
    def aggregator(self) -> EdgeAggregator:
        """Sums edge messages read from :attr:`src_rows` into destination nodes."""
        if "agg" not in self._cache:
            r = self.src_rows
            self._cache["agg"] = EdgeAggregator(self.dst, r.edge_row, self.num_dst, r.num_rows)
        return self._cache["agg"]


class _LayoutCache:
    """The layout of the last (graph, edge-type tensor) a layer saw; recomputed when either object or size changes."""

    def __init__(self) -> None:
        self._key: tuple | None = None
        self._layout: GraphLayout | None = None

    def get(self, g: dgl.DGLGraph, etypes: Tensor, num_types: int, config: HectorConfig) -> GraphLayout:
        if not isinstance(etypes, Tensor) or etypes.dim() != 1 or etypes.numel() != g.num_edges():
            raise ValueError(
                f"etypes must be a 1-D tensor with one type per edge ({g.num_edges()} edges), got "
                f"{tuple(etypes.shape) if isinstance(etypes, Tensor) else type(etypes).__name__}"
            )
        key = (
            g.num_edges(),
            g.num_src_nodes(),
            g.num_dst_nodes(),
            etypes._version,
            num_types,
            id(config),
            config.materialization,
            config.compact_max_ratio,
        )
        if (
            self._key is not None
            and self._key[0]() is g
            and self._key[1]() is etypes
            and self._key[2:] == key
        ):
            return self._layout  # type: ignore[return-value]
        src, dst = g.edges(order="eid")
        self._layout = GraphLayout(
            src.to(torch.int64),
            dst.to(torch.int64),
            etypes.to(torch.int64),
            g.num_src_nodes(),
            g.num_dst_nodes(),
            num_types,
            config,
        )
        self._key = (weakref.ref(g), weakref.ref(etypes), *key)
        return self._layout


def _eye(n: int, like: Tensor) -> Tensor:
    """Identity in ``like``'s dtype and device: ``torch.eye`` has no bf16 CPU kernel in torch 2.2.1 (gnn lane)."""
    return torch.diag_embed(like.new_ones(n))


def _typed_weight(linear: nn.Module) -> Tensor:
    """(types, in, out) weights of a ``dgl.nn.TypedLinear``; ``bdd`` blocks become block-diagonal matrices."""
    if linear.regularizer == "bdd":
        t, b = linear.num_types, linear.num_bases
        w = linear.W.view(t, b, linear.submat_in, linear.submat_out)
        eye = _eye(b, w)
        return torch.einsum("tbio,bc->tbico", w, eye).reshape(t, linear.in_size, linear.out_size)
    return linear.get_weight()


def _node_typed_linear(linear: nn.Module, x: Tensor, ntype: Tensor, presorted: bool, gemm: str) -> Tensor:
    """A node-level ``TypedLinear`` as a segment GEMM (nodes sorted by type when ``presorted``)."""
    w = _typed_weight(linear)
    if presorted:
        from flowlane.hector import segment_ptr

        return segment_mm(x, w, segment_ptr(ntype, w.shape[0]), gemm)
    order, ptr = type_order(ntype, w.shape[0])
    return segment_mm(x.index_select(0, order), w, ptr, gemm).index_select(0, torch.argsort(order))


# --------------------------------------------------------------------------------------------------------------------
# RGCN


class HectorRelGraphConv(RelGraphConv):
    """``dgl.nn.RelGraphConv`` with Hector's forward (see the module docstring). Extra keyword: ``hector``."""

    def __init__(self, *args, hector: HectorConfig | None = None, **kw) -> None:
        check_version_range("dgl", DGL_RANGE, "HectorRelGraphConv")
        super().__init__(*args, **kw)
        self.hector = hector or HectorConfig()
        self._layouts = _LayoutCache()

    def forward(self, g, feat, etypes, norm=None, *, presorted=False):  # noqa: D401 - DGL's signature
        lay = self._layouts.get(g, etypes, self.linear_r.num_types, self.hector)
        rows = lay.src_rows
        msg = materialize(feat, _typed_weight(self.linear_r), rows, self.hector.gemm)
        if norm is not None:
            if norm.numel() != g.num_edges():
                raise ValueError(
                    f"norm must hold one value per edge ({g.num_edges()}), got shape {tuple(norm.shape)}"
                )
            norm = norm.reshape(-1)
            # DGL multiplies each message by its norm before the sum, which promotes (bf16 messages x an fp32 norm
            # sum and return fp32): the same here, rather than rounding the norm to the messages' dtype
            dt = torch.promote_types(msg.dtype, norm.dtype)
            msg, norm = msg.to(dt), norm.to(dt)
        h = lay.aggregator(msg, norm)
        if self.layer_norm:
            h = self.layer_norm_weight(h)
        if self.bias:
            h = h + self.h_bias
        if self.self_loop:
            h = h + feat[: g.num_dst_nodes()] @ self.loop_weight
        if self.activation:
            h = self.activation(h)
        return self.dropout(h)


# --------------------------------------------------------------------------------------------------------------------
# HGT


class HectorHGTConv(HGTConv):
    """``dgl.nn.HGTConv`` with Hector's forward (see the module docstring). Extra keyword: ``hector``."""

    def __init__(self, *args, hector: HectorConfig | None = None, **kw) -> None:
        check_version_range("dgl", DGL_RANGE, "HectorHGTConv")
        super().__init__(*args, **kw)
        self.hector = hector or HectorConfig()
        self._layouts = _LayoutCache()

    def forward(self, g, x, ntype, etype, *, presorted=False):  # noqa: D401 - DGL's signature
        cfg = self.hector
        nd = g.num_dst_nodes()
        x_src, x_dst = x, (x[:nd] if g.is_block else x)
        srcntype, dstntype = ntype, (ntype[:nd] if g.is_block else ntype)
        lay = self._layouts.get(g, etype, self.relation_att[0].num_types, cfg)
        H, D = self.num_heads, self.head_size
        k = _node_typed_linear(self.linear_k, x_src, srcntype, presorted, cfg.gemm).view(-1, H, D)
        q = _node_typed_linear(self.linear_q, x_dst, dstntype, presorted, cfg.gemm).view(-1, H, D)
        v = _node_typed_linear(self.linear_v, x_src, srcntype, presorted, cfg.gemm).view(-1, H, D)
        rows = lay.src_rows
        side = plan_side(rows.num_rows, lay.dst_rows.num_rows, cfg.reorder).side
        scores, msgs = [], []
        for i in range(H):
            w_att = _typed_weight(self.relation_att[i])
            if side == "src":  # (k W_r) . q over unique (source, relation) rows
                kw = materialize(k[:, i], w_att, rows, cfg.gemm)
                a = gather_dot(kw, rows.edge_row, q[:, i], lay.dst)
            else:  # k . (q W_r^T) over unique (destination, relation) rows
                dr = lay.dst_rows
                qw = materialize(q[:, i], w_att.transpose(1, 2), dr, cfg.gemm)
                a = gather_dot(k[:, i], lay.src, qw, dr.edge_row)
            # gather_rows: the relation's gradient sums over all its edges, in fp32 for bf16/fp16
            scores.append(a * gather_rows(self.relation_pri[i], lay.etype, check=False) / self.sqrt_d)
            msgs.append(materialize(v[:, i], _typed_weight(self.relation_msg[i]), rows, cfg.gemm))
        att = edge_softmax(torch.stack(scores, 1), lay.dst, lay.num_dst)
        h = lay.aggregator(torch.stack(msgs, 1), att).view(-1, H * D)
        h = self.drop(_node_typed_linear(self.linear_a, h, dstntype, presorted, cfg.gemm))
        alpha = torch.sigmoid(gather_rows(self.skip, dstntype, check=False)).unsqueeze(-1)
        if x_dst.shape != h.shape:
            h = h * alpha + (x_dst @ self.residual_w) * (1 - alpha)
        else:
            h = h * alpha + x_dst * (1 - alpha)
        if self.use_norm:
            h = self.norm(h)
        return h


# --------------------------------------------------------------------------------------------------------------------
# RGAT


def _head_dot_weight(attn: Tensor) -> Tensor:
    """(types, heads, D) attention vectors as (types, heads*D, heads) matrices: ``y @ M[t]`` is the per-head dot
    product of a (heads*D) row with ``attn[t]`` (block-diagonal: head h reads only its own D columns)."""
    t, h, d = attn.shape
    return torch.einsum("thd,hk->thdk", attn, _eye(h, attn)).reshape(t, h * d, h)


class HectorRGAT(nn.Module):
    """Relational GAT: per relation r, GAT attention ``leaky_relu(a_l,r . h_u W_r + a_r,r . h_v W_r)``, softmax over
    the in-edges of each destination within r (``softmax="relation"``, DGL's ``HeteroGraphConv`` of ``GATConv``) or
    over all its in-edges (``softmax="node"``, thesis Listing 3.1), messages ``h_u W_r`` summed over relations.

    Parameters: ``W`` (relations, in, heads*out), ``attn_l``/``attn_r`` (relations, heads, out), ``bias``
    (relations, heads*out). Every relation's bias is added to every destination node, with or without edges of that
    relation: ``HeteroGraphConv`` calls the ``GATConv`` of every relation its heterograph holds
    (:func:`to_relation_graph` builds all of them, and a sampled block keeps them), and a ``GATConv`` allowed zero
    in-degrees (``HeteroGraphConv`` sets that) returns 0 + its bias for a node without in-edges.
    ``forward(g, feat, etypes)`` returns (dst nodes, heads, out).
    """

    def __init__(
        self,
        in_feats: int,
        out_feats: int,
        num_heads: int,
        num_rels: int,
        negative_slope: float = 0.2,
        bias: bool = True,
        softmax: str = "relation",
        hector: HectorConfig | None = None,
    ) -> None:
        super().__init__()
        for name, val in (
            ("in_feats", in_feats),
            ("out_feats", out_feats),
            ("num_heads", num_heads),
            ("num_rels", num_rels),
        ):
            if not isinstance(val, int) or isinstance(val, bool) or val < 1:
                raise ValueError(f"HectorRGAT: {name}={val!r} must be an int >= 1")
        if softmax not in ("relation", "node"):
            raise ValueError(f"HectorRGAT: softmax={softmax!r} is not one of ('relation', 'node')")
        self.in_feats = in_feats
        self.out_feats = out_feats
        self.num_heads = num_heads
        self.num_rels = num_rels
        self.negative_slope, self.softmax = negative_slope, softmax
        self.hector = hector or HectorConfig()
        hd = out_feats * num_heads
        self.W = nn.Parameter(torch.empty(num_rels, in_feats, hd))
        self.attn_l = nn.Parameter(torch.empty(num_rels, num_heads, out_feats))
        self.attn_r = nn.Parameter(torch.empty(num_rels, num_heads, out_feats))
        self.bias = nn.Parameter(torch.zeros(num_rels, hd)) if bias else None
        gain = nn.init.calculate_gain("relu")
        for p in (self.W, self.attn_l, self.attn_r):
            nn.init.xavier_normal_(p, gain=gain)
        self._layouts = _LayoutCache()
        self.last_plan: dict = {}

    @staticmethod
    def _dgl_relations(conv: HeteroGraphConv, rel_names: list[str]) -> list[GATConv]:
        """The ``GATConv`` of each relation name, after checking what every later read relies on (refused by name)."""
        if not isinstance(conv, HeteroGraphConv):
            raise ValueError(
                f"HectorRGAT loads a dgl.nn.HeteroGraphConv of GATConv, got {type(conv).__name__}"
            )
        if not isinstance(rel_names, (list, tuple)) or not rel_names:
            raise ValueError(f"rel_names must be a non-empty list of relation names, got {rel_names!r}")
        missing = [n for n in rel_names if n not in conv.mods]
        repeated = sorted({n for n in rel_names if list(rel_names).count(n) > 1})
        if missing or repeated:
            # a module may hold relations the graph lacks (DGL calls only those the graph holds): they are not read
            raise ValueError(
                f"rel_names must name relations of the HeteroGraphConv, each once (edge type i reads relation i): "
                f"missing from the module {missing}, repeated {repeated}; its relations are {sorted(conv.mods)}"
            )
        agg = conv.agg_fn
        if not (
            isinstance(agg, partial) and agg.func is _agg_func and agg.keywords.get("fn") is _sum_reduce_func
        ):
            raise ValueError(
                f"HectorRGAT sums the relations (HeteroGraphConv aggregate='sum'); this module aggregates with "
                f"{getattr(getattr(agg, 'keywords', {}).get('fn', agg), '__name__', agg)}: build it with "
                f"aggregate='sum'"
            )
        mods = []
        for name in rel_names:
            mod = conv.mods[name]
            if not isinstance(mod, GATConv):
                raise ValueError(f"relation {name!r}: expected a dgl.nn.GATConv, got {type(mod).__name__}")
            if not hasattr(mod, "fc"):
                raise ValueError(
                    f"relation {name!r}: GATConv settings ['fc_src/fc_dst'] differ from what HectorRGAT computes "
                    f"(one fc shared by sources and destinations: build GATConv with an int in_feats)"
                )
            mods.append(mod)
        return mods

    @torch.no_grad()
    def load_dgl(self, conv: HeteroGraphConv, rel_names: list[str]) -> HectorRGAT:
        """Copy the weights of ``HeteroGraphConv({rel_names[r]: GATConv})``; relation r is ``rel_names[r]``."""
        mods = self._dgl_relations(conv, rel_names)
        if len(rel_names) != self.num_rels:
            raise ValueError(f"load_dgl needs {self.num_rels} relation names, got {len(rel_names)}")
        for r, (name, mod) in enumerate(zip(rel_names, mods, strict=True)):
            bad = [
                k
                for k, ok in (
                    ("in_feats", mod.fc.in_features == self.in_feats),
                    ("residual", mod.res_fc is None),
                    ("activation", mod.activation is None),
                    ("feat_drop", mod.feat_drop.p == 0),
                    ("attn_drop", mod.attn_drop.p == 0),
                    ("heads", mod._num_heads == self.num_heads),
                    ("out_feats", mod._out_feats == self.out_feats),
                    ("negative_slope", mod.leaky_relu.negative_slope == self.negative_slope),
                    ("bias", mod.has_explicit_bias == (self.bias is not None)),
                )
                if not ok
            ]
            if bad:
                raise ValueError(
                    f"relation {name!r}: GATConv settings {bad} differ from what HectorRGAT computes "
                    f"(one fc, no residual, activation or dropout; same in/heads/out/slope/bias)"
                )
            self.W[r].copy_(mod.fc.weight.t())
            self.attn_l[r].copy_(mod.attn_l[0])
            self.attn_r[r].copy_(mod.attn_r[0])
            if self.bias is not None:
                self.bias[r].copy_(mod.bias)
        return self

    @classmethod
    def from_dgl(
        cls,
        conv: HeteroGraphConv,
        rel_names: list[str],
        softmax: str = "relation",
        hector: HectorConfig | None = None,
    ) -> HectorRGAT:
        """A HectorRGAT holding the weights of ``HeteroGraphConv({name: GATConv})`` (``aggregate="sum"``)."""
        first = cls._dgl_relations(conv, rel_names)[0]
        layer = cls(
            first.fc.in_features,
            first._out_feats,
            first._num_heads,
            len(rel_names),
            first.leaky_relu.negative_slope,
            first.has_explicit_bias,
            softmax,
            hector,
        )
        return layer.to(first.fc.weight.device, first.fc.weight.dtype).load_dgl(conv, rel_names)

    def forward(self, g: dgl.DGLGraph, feat: Tensor, etypes: Tensor) -> Tensor:
        cfg = self.hector
        lay = self._layouts.get(g, etypes, self.num_rels, cfg)
        H, D, hd = self.num_heads, self.out_feats, self.num_heads * self.out_feats
        rows, drows = lay.src_rows, lay.dst_rows
        msg = materialize(feat, self.W, rows, cfg.gemm)  # h_u W_r per (source, relation)
        pl = plan_fold(rows.num_rows, self.num_rels, self.in_feats, hd, H, True, cfg.reorder)
        pr = plan_fold(drows.num_rows, self.num_rels, self.in_feats, hd, H, False, cfg.reorder)
        self.last_plan = {"src": pl, "dst": pr}
        if pl.fold:
            el = materialize(feat, fold_attention(self.W, self.attn_l), rows, cfg.gemm)
        else:  # (h W_r) . a_r as a typed linear of the message rows: no per-row copy of the attention vectors
            el = segment_mm(msg, _head_dot_weight(self.attn_l), rows.ptr, cfg.gemm)
        x_dst = feat[: g.num_dst_nodes()]
        if pr.fold:
            er = materialize(x_dst, fold_attention(self.W, self.attn_r), drows, cfg.gemm)
        else:
            er = segment_mm(
                materialize(x_dst, self.W, drows, cfg.gemm),
                _head_dot_weight(self.attn_r),
                drows.ptr,
                cfg.gemm,
            )
        # rows -> edges with fp32 gradient sums in bf16/fp16 (a hub row feeds thousands of edges; gather_rows)
        e = F.leaky_relu(
            gather_rows(el, rows.edge_row, check=False) + gather_rows(er, drows.edge_row, check=False),
            self.negative_slope,
        )
        if self.softmax == "relation":
            grp = lay.groups
            a = edge_softmax(e, grp.edge_row, grp.num_rows)
        else:
            a = edge_softmax(e, lay.dst, lay.num_dst)
        out = lay.aggregator(msg.view(-1, H, D), a)
        if self.bias is not None:  # every relation's GATConv adds its bias to every node (class docstring)
            out = out + self.bias.sum(0).view(H, D)
        return out


# --------------------------------------------------------------------------------------------------------------------
# Swapping Hector in


SWAPS = {RelGraphConv: HectorRelGraphConv, HGTConv: HectorHGTConv}


def install_hector(model: nn.Module, config: HectorConfig | dict | None = None) -> dict[str, str]:
    """Replace every ``dgl.nn.RelGraphConv`` / ``dgl.nn.HGTConv`` in ``model`` by its Hector version, in place.

    The new modules share the old ones' parameters and buffers (an optimizer built before keeps working); a module
    held at several places (``nn.ModuleList([conv] * 3)``) is replaced by one new module at all of them. Returns
    ``{module name: new class}`` with every place named. With ``config.enabled`` False nothing changes; with True a
    model holding neither module is refused (Hector would silently not apply). RGAT has no DGL module of the same call signature
    (``HeteroGraphConv`` of ``GATConv`` takes a heterograph): build :meth:`HectorRGAT.from_dgl` explicitly.
    """
    cfg = config if isinstance(config, HectorConfig) else HectorConfig.from_dict(config)
    if not cfg.enabled:
        return {}
    check_version_range("dgl", DGL_RANGE, "install_hector")
    swapped: dict[str, str] = {}
    # remove_duplicate=False: a module held twice (nn.ModuleList([conv] * 3)) is listed at each place, and every
    # place gets the same new module (id(old) -> new), so the layers stay shared
    new_of: dict[int, nn.Module] = {}
    for name, mod in list(model.named_modules(remove_duplicate=False)):
        new_cls = SWAPS.get(type(mod))
        if new_cls is None:
            continue
        new = new_of.get(id(mod))
        if new is None:
            new = new_of[id(mod)] = new_cls.__new__(new_cls)
            new.__dict__.update(mod.__dict__)
            new.hector = cfg
            new._layouts = _LayoutCache()
        if name:
            parent_name, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent_name) if parent_name else model, child, new)
        else:
            raise ValueError(
                "install_hector: pass the model that holds the layer, not the layer itself "
                "(or build HectorRelGraphConv / HectorHGTConv directly)"
            )
        swapped[name] = new_cls.__name__
    if not swapped:
        kinds = sorted({type(m).__name__ for m in model.modules() if type(m).__module__.startswith("dgl.nn")})
        raise ValueError(
            f"install_hector: the model holds no dgl.nn.RelGraphConv or dgl.nn.HGTConv to replace "
            f"(dgl.nn modules found: {kinds or 'none'}); set hector.enabled=false to run without it"
        )
    logger.info("Hector layers swapped in: %s", swapped)
    return swapped


def hetero_rgat_reference(in_feats: int, out_feats: int, num_heads: int, num_rels: int, **gat_kw) -> tuple:
    """DGL's relational GAT, ``HeteroGraphConv({"r<i>": GATConv})`` with ``aggregate="sum"``, and its relation
    names: the module :meth:`HectorRGAT.from_dgl` loads (tests and benchmarks)."""
    names = [f"r{i}" for i in range(num_rels)]
    gat_kw.setdefault("allow_zero_in_degree", True)
    conv = HeteroGraphConv(
        {n: GATConv(in_feats, out_feats, num_heads, **gat_kw) for n in names}, aggregate="sum"
    )
    return conv, names


def to_relation_graph(src: Tensor, dst: Tensor, etype: Tensor, num_nodes: int, num_rels: int) -> dgl.DGLGraph:
    """The heterograph (one node type ``n``, relations ``r<i>``) that ``HeteroGraphConv`` needs for the same edges."""
    data = {("n", f"r{r}", "n"): (src[etype == r], dst[etype == r]) for r in range(num_rels)}
    return dgl.heterograph(data, num_nodes_dict={"n": num_nodes})


__all__ = [
    "DGL_RANGE",
    "GraphLayout",
    "HectorConfig",
    "HectorHGTConv",
    "HectorRGAT",
    "HectorRelGraphConv",
    "hetero_rgat_reference",
    "install_hector",
    "to_relation_graph",
]
