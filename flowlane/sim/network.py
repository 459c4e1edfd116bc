"""Bandwidth sharing among active flows: max-min fairness by progressive filling (a C kernel; numpy reference).

Flows are rows of a padded link-index matrix ``hops`` (n_flows x max_hops); the pad index equals ``n_links`` and
has unlimited capacity. Within one priority class, rates are (weighted) max-min fair: every unfrozen flow grows at
the same (weight-proportional) rate until a link saturates, flows crossing a saturated link freeze, and filling goes
on with the rest. Across classes, sharing is strict (class 0 fills first, the next class gets what is left: a lower
class gets nothing on a link a higher class saturates) or weighted (one filling pass, class weight ratio**rank;
refused beyond :func:`max_weighted_classes` classes at once, where the smallest weights would overflow the filling).

Optional incast penalty (:class:`IncastModel`): the seeds report that many-to-one traffic loses goodput (Hermod
§5.1.3: imbalanced EP all-to-all causes incast and long CCTs; SYNDICATE Fig. 17: incast grows with fan-in, which
splined all-to-all reduces). A fluid model has no buffers, so we model it phenomenologically: a switch egress port
(a link whose source device is a switch, of one of ``kinds``) carrying k concurrent flows delivers only
capacity / (1 + alpha * max(0, k - threshold)). Not from the seeds' numbers; off by default.
What k counts is ``IncastModel.count``: ``port`` (default) counts every flow on the port, as one shared queue does
(the fabric the penalty was fitted on: one class); ``class`` counts only the flows of the same priority class, as a
switch with a strict-priority queue per class does (Hermod's premise: keys on the wire select switch queues, seed 000
§5.4), where an EP phase flow alone in its queue does not lose goodput to the DP and PP flows queued behind it. In
``class`` mode a flow of class c on port l delivers r but occupies r * (1 + alpha * max(0, k_c(l) - threshold)) of
the wire (the lost bytes are resent), so classes filled later get what the earlier ones left of the wire; with one
class it is the ``port`` model (equal up to rounding).
A *matched* coflow (Hermod's incast-free all-to-all, seed 000 §5.3.2: its phases are partial permutations, so each
receiver hears from at most one of its senders at a time) counts as one flow per link, however many of its flows
cross the link: ``allocate(..., incast_group=...)`` gives each such flow its coflow id, -1 for ordinary flows.

Two implementations with identical results (bit for bit: the same floating-point operations in the same order): a C
kernel (``_waterfill.c``; the engine calls :func:`allocate` ~10^5 times per iteration on small arrays, where numpy's
per-call overhead dominated), compiled on first use with the system C compiler (``-O3 -ffp-contract=off``, no
CPU-specific flags), cached in ``~/.cache/flowlane`` (or ``$FLOWLANE_CACHE``) under a hash of source + flags and
loaded with ctypes; and the numpy reference below (``_waterfill_numpy``, ``_allocate_numpy``), used when no compiler
is available or when the environment sets ``FLOWLANE_SIM_NO_C=1`` (read at every call). The incast capacity
adjustment stays in numpy either way.
"""

from __future__ import annotations

import ctypes
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from flowlane._cbuild import CKernel

SHARING = ("strict", "weighted")
INCAST_COUNTS = ("port", "class")
_RTOL = 1e-9  # allocate's freeze tolerance (waterfill's default)
# weighted sharing's smallest class weight (weight_ratio ** rank): the filling divides a link's capacity by the sum of
# its flows' weights, which overflows to inf (or, once the weight underflows to 0, is never reached) for smaller ones
_MIN_WEIGHT = 1e-200


def max_weighted_classes(weight_ratio: float) -> int:
    """The most priority classes weighted sharing handles at ``weight_ratio`` (weights ratio**rank >= 1e-200:
    664 + 1 at 0.5); ``sys.maxsize`` at 1."""
    if not 0 < weight_ratio <= 1:
        raise ValueError(f"weight_ratio must be in (0, 1], got {weight_ratio!r}")
    if weight_ratio == 1:
        return sys.maxsize
    return 1 + math.floor(math.log(_MIN_WEIGHT) / math.log(weight_ratio))


@dataclass(frozen=True)
class IncastModel:
    threshold: int = 1
    alpha: float = 0.1
    kinds: tuple[str, ...] = ("eth",)
    count: str = "port"
    """Who adds to a port's fan-in: ``port`` every flow on it (one shared queue), ``class`` only the flows of the
    same priority class (a queue per class; see the module docstring)."""

    def __post_init__(self) -> None:
        if self.count not in INCAST_COUNTS:
            raise ValueError(f"IncastModel.count {self.count!r} is not one of {INCAST_COUNTS}")
        if not isinstance(self.threshold, int) or self.threshold < 1:
            raise ValueError(f"IncastModel.threshold must be an integer >= 1, got {self.threshold!r}")
        if not (self.alpha >= 0 and np.isfinite(self.alpha)):
            raise ValueError(f"IncastModel.alpha must be a finite number >= 0, got {self.alpha!r}")


def waterfill(hops: np.ndarray, weights: np.ndarray, cap: np.ndarray, rtol: float = _RTOL) -> np.ndarray:
    """Weighted max-min fair rates for flows ``hops`` given remaining capacities ``cap`` (length n_links + 1, the
    last entry is the pad). ``cap`` is decreased in place by the allocated rates. Returns rates (bytes/s)."""
    hops = _check_hops(hops)
    n = hops.shape[0]
    if not isinstance(cap, np.ndarray) or cap.ndim != 1 or cap.size == 0:
        raise ValueError(
            f"cap must be a 1-D array of n_links + 1 capacities (the pad last), got {np.shape(cap)}"
        )
    weights = np.asarray(weights)
    if weights.shape != (n,) or weights.dtype.kind not in "biuf":
        raise ValueError(
            f"weights must be a real array of shape ({n},) (one per flow), got shape {weights.shape} "
            f"dtype {weights.dtype}"
        )
    if not (rtol >= 0 and np.isfinite(rtol)):
        raise ValueError(f"rtol must be a finite number >= 0, got {rtol!r}")
    lib = _kernel()
    if lib is None or cap.dtype != np.float64 or not (cap.flags.c_contiguous and cap.flags.writeable):
        _check_range(hops, cap.shape[0])
        return _waterfill_numpy(hops, weights, cap, rtol)
    return _run_c(lib, hops, None, np.ascontiguousarray(weights, dtype=np.float64), cap, rtol)


def _waterfill_numpy(
    hops: np.ndarray, weights: np.ndarray, cap: np.ndarray, rtol: float = _RTOL, pen: np.ndarray | None = None
) -> np.ndarray:
    """The numpy reference of :func:`waterfill` (no input checks); ``pen``: wire cost per (flow, hop) or None (1)."""
    n, h = hops.shape
    nl = cap.shape[0]
    rates = np.zeros(n)
    if n == 0:
        return rates
    idx = np.arange(n)
    cur_h = hops
    cur_w = weights
    cur_p = pen
    while idx.size:
        wh = np.repeat(cur_w, h) if cur_p is None else (cur_w[:, None] * cur_p).ravel()
        wsum = np.bincount(cur_h.ravel(), weights=wh, minlength=nl)
        wsum[-1] = 0.0
        used = wsum > 0
        share = np.full(nl, np.inf)
        share[used] = np.maximum(cap[used], 0.0) / wsum[used]
        lvl = share.min()
        if not np.isfinite(lvl):  # flows that cross no finite link (cannot happen with real routes)
            rates[idx] = np.inf
            break
        sat = share <= lvl * (1 + rtol) + 1e-300
        sat[-1] = False
        fz = sat[cur_h].any(axis=1)
        r = cur_w[fz] * lvl
        rates[idx[fz]] = r
        rh = np.repeat(r, h) if cur_p is None else (r[:, None] * cur_p[fz]).ravel()
        cap -= np.bincount(cur_h[fz].ravel(), weights=rh, minlength=nl)
        cap[-1] = np.inf
        keep = ~fz
        idx = idx[keep]
        cur_h = cur_h[keep]
        cur_w = cur_w[keep]
        if cur_p is not None:
            cur_p = cur_p[keep]
    return rates


def incast_fan_in(
    hops: np.ndarray, n_links_padded: int, incast_group: np.ndarray | None = None
) -> np.ndarray:
    """Concurrent flows per link (length ``n_links_padded``); the flows of one matched coflow count once."""
    if incast_group is None or not (incast_group >= 0).any():
        return np.bincount(hops.ravel(), minlength=n_links_padded)
    solo = incast_group < 0
    k = np.bincount(hops[solo].ravel(), minlength=n_links_padded)
    h = hops[~solo]
    pair = np.repeat(incast_group[~solo], h.shape[1]) * n_links_padded + h.ravel()
    return k + np.bincount(np.unique(pair) % n_links_padded, minlength=n_links_padded)


def incast_wire_cost(
    hops: np.ndarray,
    cls: np.ndarray,
    n_links_padded: int,
    incast: IncastModel,
    incast_links: np.ndarray,
    incast_group: np.ndarray | None = None,
) -> np.ndarray:
    """The ``class`` count's wire cost per (flow, hop), shaped like ``hops``: 1 + alpha * max(0, k - threshold) on
    incast links, where k = the flows of the flow's own class on that link (a matched coflow's flows count once);
    1 elsewhere and on the pad."""
    n, h = hops.shape
    rank = np.unique(cls, return_inverse=True)[1].astype(np.int64)
    ukey, inv = np.unique((rank[:, None] * n_links_padded + hops).ravel(), return_inverse=True)
    if incast_group is None or not (incast_group >= 0).any():
        k = np.bincount(inv, minlength=ukey.size)
    else:
        solo = np.repeat(incast_group < 0, h)
        k = np.bincount(inv[solo], minlength=ukey.size)
        pair = np.unique(np.repeat(incast_group, h)[~solo] * ukey.size + inv[~solo])
        k += np.bincount(pair % ukey.size, minlength=ukey.size)
    on = np.append(incast_links != 0, False)[hops.ravel()]  # the pad is never an incast link
    return (1.0 + incast.alpha * (np.maximum(0, k[inv] - incast.threshold) * on)).reshape(n, h)


def allocate(
    hops: np.ndarray,
    cls: np.ndarray,
    capacity: np.ndarray,
    sharing: str = "strict",
    weight_ratio: float = 0.5,
    incast: IncastModel | None = None,
    incast_links: np.ndarray | None = None,
    incast_group: np.ndarray | None = None,
) -> np.ndarray:
    """Rates for all active flows. ``cls`` = dense class rank per flow (0 = most urgent); ``capacity`` has
    length n_links (the pad is added here). ``incast_group``: per flow, -1 or the id of a matched coflow (counted
    once per link by the incast model)."""
    hops = _check_hops(hops)
    n = hops.shape[0]
    cls = np.asarray(cls)
    if cls.shape != (n,):
        raise ValueError(f"cls must have shape ({n},) (one class per flow), got {cls.shape}")
    capacity = np.asarray(capacity)
    if capacity.ndim != 1 or capacity.dtype.kind not in "biuf":
        raise ValueError(
            f"capacity must be a 1-D real array (one entry per link), got shape {capacity.shape} "
            f"dtype {capacity.dtype}"
        )
    if sharing not in SHARING:
        raise ValueError(f"sharing {sharing!r} is not one of {SHARING}")
    if incast_group is not None and np.shape(incast_group) != (n,):
        raise ValueError(
            f"incast_group must have shape ({n},) (one entry per flow), got {np.shape(incast_group)}"
        )
    if incast_links is not None and np.shape(incast_links) != capacity.shape:
        raise ValueError(
            f"incast_links must have shape {capacity.shape} (one entry per link), "
            f"got {np.shape(incast_links)}"
        )
    if n == 0:
        return np.zeros(0)
    if sharing == "weighted":
        n_cls, n_max = np.unique(cls).size, max_weighted_classes(weight_ratio)
        if n_cls > n_max:
            raise ValueError(
                f"weighted sharing with weight_ratio={weight_ratio!r} handles at most {n_max} priority classes at "
                f"once (class weights ratio**rank below {_MIN_WEIGHT:g} overflow the filling), got {n_cls}: use "
                "sharing='strict' or a weight_ratio closer to 1"
            )
    cap = np.empty(capacity.shape[0] + 1)
    cap[:-1] = capacity
    cap[-1] = np.inf
    lib = _kernel()
    per_class = (
        incast is not None and incast_links is not None and incast_links.any() and incast.count == "class"
    )
    pen = None  # the numpy path's per-class wire costs (the kernel computes its own from `counting`)
    counting: _ClassCounting | None = None
    if per_class:
        assert incast is not None and incast_links is not None  # per_class says so (for the type checker)
        if lib is None:
            _check_range(hops, cap.shape[0])  # before the fan-in counts index with them
            pen = incast_wire_cost(hops, cls, cap.shape[0], incast, incast_links, incast_group)
        else:
            counting = _class_counting(hops, cls, cap.shape[0], incast, incast_links, incast_group)
    elif incast is not None and incast_links is not None and incast_links.any():
        _check_range(hops, cap.shape[0])
        k = incast_fan_in(hops, cap.shape[0], incast_group)[:-1]
        over = np.maximum(0, k - incast.threshold) * incast_links
        cap[:-1] = capacity / (1.0 + incast.alpha * over)
    elif lib is None:
        _check_range(hops, cap.shape[0])
    if lib is None:
        return _allocate_numpy(hops, cls, cap, sharing, weight_ratio, pen)
    if sharing == "weighted":
        classes = np.unique(cls)
        if classes.size > 1:  # the reference's weights, computed by numpy so that the powers are the same
            w = weight_ratio ** np.searchsorted(classes, cls).astype(np.float64)
            return _run_c(lib, hops, None, w, cap, _RTOL, counting)
    cls = counting.cls if counting is not None else _int64_classes(cls)
    return _run_c(lib, hops, cls, None, cap, _RTOL, counting)


def _int64_classes(cls: np.ndarray) -> np.ndarray:
    """Classes as the kernel orders them (C-contiguous int64); other dtypes (floats, uint64) become their dense
    ranks, same order."""
    if cls.dtype != np.int64 or not cls.flags.c_contiguous:
        if not np.can_cast(cls.dtype, np.int64):
            cls = np.unique(cls, return_inverse=True)[1]
        cls = np.ascontiguousarray(cls, dtype=np.int64)
    return cls


@dataclass(frozen=True)
class _ClassCounting:
    """What the kernel needs to compute :func:`incast_wire_cost` itself (bit for bit: the same operations)."""

    cls: np.ndarray  # int64 classes
    link: np.ndarray  # uint8 per link, pad included (0): an incast link
    # uint8 per (flow, hop): 0 where a matched coflow's (link) pair repeats; None: all count
    count: np.ndarray | None
    alpha: float
    threshold: int


def _class_counting(
    hops: np.ndarray,
    cls: np.ndarray,
    n_links_padded: int,
    incast: IncastModel,
    incast_links: np.ndarray,
    incast_group: np.ndarray | None,
) -> _ClassCounting:
    cls = _int64_classes(cls)
    count = None
    if incast_group is not None and (incast_group >= 0).any():
        # a matched coflow counts once per link and class: only the first of its hops on each link counts
        n, h = hops.shape
        flat_g = np.repeat(incast_group, h)
        m = np.flatnonzero(flat_g >= 0)
        trip = np.column_stack([flat_g[m], np.repeat(cls, h)[m], hops.ravel()[m]])
        first = np.unique(trip, axis=0, return_index=True)[1]
        count = np.ones(n * h, np.uint8)
        count[m] = 0
        count[m[first]] = 1
    link = np.zeros(n_links_padded, np.uint8)
    link[:-1] = incast_links != 0
    return _ClassCounting(cls, link, count, float(incast.alpha), int(incast.threshold))


def _allocate_numpy(
    hops: np.ndarray,
    cls: np.ndarray,
    cap: np.ndarray,
    sharing: str,
    weight_ratio: float,
    pen: np.ndarray | None = None,
) -> np.ndarray:
    """The numpy reference of :func:`allocate` after the incast adjustment (``cap``: n_links + 1, pad last; it is
    decreased in place; ``pen``: the ``class`` count's wire costs or None)."""
    n = hops.shape[0]
    classes = np.unique(cls)
    if classes.size == 1 or sharing == "weighted":
        if classes.size == 1:
            w = np.ones(n)
        else:
            rank = np.searchsorted(classes, cls)
            w = weight_ratio ** rank.astype(np.float64)
        return _waterfill_numpy(hops, w, cap, pen=pen)
    rates = np.zeros(n)
    order = np.argsort(cls, kind="stable")
    bounds = np.searchsorted(cls[order], classes, side="left").tolist() + [n]
    for a, b in zip(bounds[:-1], bounds[1:], strict=True):
        sel = order[a:b]
        rates[sel] = _waterfill_numpy(hops[sel], np.ones(b - a), cap, pen=None if pen is None else pen[sel])
    return rates


# -- input checks and the C kernel -------------------------------------------------------------------------------
def _check_hops(hops: np.ndarray) -> np.ndarray:
    """``hops`` as a C-contiguous 2-D int64 array (a no-op for the engine's arrays); the C kernel checks the range."""
    hops = np.asarray(hops)
    if hops.ndim != 2 or hops.dtype.kind not in "iu":
        raise ValueError(
            f"hops must be a 2-D integer array (n_flows x max_hops), got shape {hops.shape} "
            f"dtype {hops.dtype}"
        )
    if hops.dtype != np.int64 or not hops.flags.c_contiguous:
        hops = np.ascontiguousarray(hops, dtype=np.int64)
    return hops


def _check_range(hops: np.ndarray, n_links_padded: int) -> None:
    # the numpy path's check (the C kernel checks as it must not read out of bounds): the same error either way
    if hops.size and (hops.min() < 0 or hops.max() >= n_links_padded):
        _bad_hop(
            hops,
            n_links_padded,
            int(np.flatnonzero((hops.ravel() < 0) | (hops.ravel() >= n_links_padded))[0]),
        )


def _bad_hop(hops: np.ndarray, n_links_padded: int, k: int) -> None:
    i, j = divmod(k, hops.shape[1])
    raise ValueError(
        f"hops[{i}, {j}] = {int(hops[i, j])} is not a link index: it must be in [0, {n_links_padded - 1}]"
        f" ({n_links_padded - 1} links, index {n_links_padded - 1} is the pad)"
    )


# -ffp-contract=off: no fused multiply-adds, so the C results equal numpy's bit for bit on every target
_CFLAGS = ("-O3", "-shared", "-fPIC", "-ffp-contract=off")


def _declare(lib: ctypes.CDLL) -> None:
    P = ctypes.c_void_p
    lib.flowlane_allocate.restype = ctypes.c_long
    lib.flowlane_allocate.argtypes = [
        ctypes.c_long,
        ctypes.c_int,
        ctypes.c_long,
        P,
        P,
        P,
        P,
        P,
        P,
        ctypes.c_double,
        ctypes.c_long,
        P,
        ctypes.c_double,
        P,
    ]


_KERNEL = CKernel(
    Path(__file__).with_name("_waterfill.c"),
    "waterfill",
    _CFLAGS,
    _declare,
    "flowlane.sim: C rate-allocation kernel",
    "using numpy",
)


def _kernel() -> ctypes.CDLL | None:
    """The C kernel, or None for the numpy path (no compiler, or ``FLOWLANE_SIM_NO_C=1``)."""
    if os.environ.get("FLOWLANE_SIM_NO_C", "") not in ("", "0"):
        return None
    return _KERNEL.load()


def _run_c(
    lib: ctypes.CDLL,
    hops: np.ndarray,
    cls: np.ndarray | None,
    w: np.ndarray | None,
    cap: np.ndarray,
    rtol: float,
    counting: _ClassCounting | None = None,
) -> np.ndarray:
    """Rates from the kernel; ``hops``/``cls`` int64 and ``w``/``cap`` float64, all C-contiguous (``cap`` is
    decreased in place). ``cls`` None: one filling with weights ``w``; else strict priority with unit weights.
    ``counting``: the per-class incast model, or None."""
    n, h = hops.shape
    rates = np.empty(n)
    c = counting
    rc = lib.flowlane_allocate(
        n,
        h,
        cap.shape[0],
        hops.ctypes.data,
        None if cls is None else cls.ctypes.data,
        None if w is None else w.ctypes.data,
        None if c is None else c.cls.ctypes.data,
        None if c is None else c.link.ctypes.data,
        None if c is None or c.count is None else c.count.ctypes.data,
        0.0 if c is None else c.alpha,
        0 if c is None else c.threshold,
        cap.ctypes.data,
        rtol,
        rates.ctypes.data,
    )
    if rc <= -3:
        _bad_hop(hops, cap.shape[0], -rc - 3)
    if rc == -1:
        raise MemoryError("flowlane.sim: the C rate-allocation kernel could not allocate its work arrays")
    if rc != 0:
        raise RuntimeError(
            f"flowlane.sim: the C rate-allocation kernel failed with code {rc} (a filling pass froze "
            "no flow: NaN weights?)"
        )
    return rates
