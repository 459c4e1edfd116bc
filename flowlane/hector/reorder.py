"""Linear-operator reordering with a cost model (thesis §3.3.2; digest research/003 §4.2.2, §4.6).

An attention score of the form ``s = (h W_r) . w_r`` can be computed as ``h . (W_r w_r)``: the weight x weight
product ``W_r w_r`` is formed once per type and every row then costs ``d_in`` multiply-adds per head instead of the
full GEMM row (Hector's example ``atts = (h_src W_r) w_r^T``). Hector always applies it when a weight x weight product
appears; here :func:`plan_fold` counts forward multiply-adds of both orders for each term of each layer and picks the
cheaper (backward work scales the same way: roughly twice the forward for either order). Where the product ``h W_r``
is needed anyway (an RGAT message), the unfolded order costs only the dot product.

:func:`plan_side` covers the other reordering HGT allows: ``(k W_r) . q`` equals ``k . (q W_r^T)``, so the relation
GEMM can run over unique (source, type) rows or over unique (destination, type) rows, whichever are fewer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from flowlane.hector.config import REORDERS


@dataclass(frozen=True)
class FoldPlan:
    """The choice for one attention term and the multiply-adds (forward) that decided it."""

    fold: bool
    """True: compute ``h . (W_r w_r)`` (reordered); False: ``(h W_r) . w_r``."""
    macs_unfolded: int
    """Multiply-adds of ``(h W_r) . w_r`` over the term's rows (0 for the GEMM when its product is reused)."""
    macs_folded: int
    """Multiply-adds of ``W_r w_r`` for every type plus ``h . (W_r w_r)`` over the rows."""
    reason: str


def plan_fold(
    rows: int,
    num_types: int,
    d_in: int,
    d_out: int,
    heads: int = 1,
    product_available: bool = False,
    reorder: str = "auto",
) -> FoldPlan:
    """Decide reordering for one attention term over ``rows`` (node, type) rows.

    ``d_out`` is the full output width (heads x head size). ``product_available``: ``h W_r`` is computed for these
    rows anyway (so the unfolded order only adds the dot product).
    """
    if reorder not in REORDERS:
        raise ValueError(f"reorder={reorder!r} is not one of {REORDERS}")
    for name, v in (
        ("rows", rows),
        ("num_types", num_types),
        ("d_in", d_in),
        ("d_out", d_out),
        ("heads", heads),
    ):
        if not isinstance(v, int) or isinstance(v, bool) or v < (0 if name == "rows" else 1):
            raise ValueError(f"{name}={v!r} must be an int >= {0 if name == 'rows' else 1}")
    if d_out % heads:
        raise ValueError(f"d_out={d_out} must be a multiple of heads={heads}")
    unfolded = (0 if product_available else rows * d_in * d_out) + rows * d_out
    folded = num_types * d_in * d_out + rows * d_in * heads
    if reorder != "auto":
        return FoldPlan(reorder == "always", unfolded, folded, f"reorder={reorder!r}")
    fold = folded < unfolded
    return FoldPlan(
        fold,
        unfolded,
        folded,
        f"{'folded' if fold else 'unfolded'} is cheaper: folded {folded:,} vs "
        f"unfolded {unfolded:,} multiply-adds",
    )


def fold_attention(weight: Tensor, attn: Tensor) -> Tensor:
    """``W_r w_r`` per type and head: ``weight`` (types, in, heads*D), ``attn`` (types, heads, D) -> (types, in, heads).

    One batched matmul over types (the thesis rewrites weight products with BMM)."""
    t, d_in, d_out = weight.shape
    if attn.dim() != 3 or attn.shape[0] != t or attn.shape[1] * attn.shape[2] != d_out:
        raise ValueError(
            f"attn must be (types={t}, heads, D) with heads*D = {d_out}, got {tuple(attn.shape)}"
        )
    h, d = attn.shape[1], attn.shape[2]
    return torch.einsum("tihd,thd->tih", weight.view(t, d_in, h, d), attn)


@dataclass(frozen=True)
class SidePlan:
    """Which side's unique (node, type) rows the relation GEMM of ``(k W_r) . q`` runs over."""

    side: str
    """``src``: ``(k W_r) . q``; ``dst``: ``k . (q W_r^T)``."""
    src_rows: int
    dst_rows: int
    reason: str


def plan_side(src_rows: int, dst_rows: int, reorder: str = "auto") -> SidePlan:
    """``auto``: the side with fewer rows (the GEMM's cost is rows x D x D on either side); ``always``: dst;
    ``never``: src (DGL's order)."""
    if reorder not in REORDERS:
        raise ValueError(f"reorder={reorder!r} is not one of {REORDERS}")
    if reorder != "auto":
        return SidePlan("dst" if reorder == "always" else "src", src_rows, dst_rows, f"reorder={reorder!r}")
    side = "dst" if dst_rows < src_rows else "src"
    return SidePlan(
        side, src_rows, dst_rows, f"{side} has fewer rows: {src_rows:,} (src) vs {dst_rows:,} (dst)"
    )
