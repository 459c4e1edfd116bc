"""Bandwidth sharing among active flows: max-min fairness by progressive filling, vectorised with numpy.

Flows are rows of a padded link-index matrix ``hops`` (n_flows x max_hops); the pad index equals ``n_links`` and
has unlimited capacity. Within one priority class, rates are (weighted) max-min fair: every unfrozen flow grows at
the same (weight-proportional) rate until a link saturates, flows crossing a saturated link freeze, and filling goes
on with the rest. Across classes, sharing is strict (class 0 fills first, the next class gets what is left: a lower
class gets nothing on a link a higher class saturates) or weighted (one filling pass, class weight ratio**rank).

Optional incast penalty (:class:`IncastModel`): the seeds report that many-to-one traffic loses goodput (Hermod
§5.1.3: imbalanced EP all-to-all causes incast and long CCTs; SYNDICATE Fig. 17: incast grows with fan-in, which
splined all-to-all reduces). A fluid model has no buffers, so we model it phenomenologically: a switch egress port
(a link whose source device is a switch, of one of ``kinds``) carrying k concurrent flows delivers only
capacity / (1 + alpha * max(0, k - threshold)). Not from the seeds' numbers; off by default.
A *matched* coflow (Hermod's incast-free all-to-all, seed 000 §5.3.2: its phases are partial permutations, so each
receiver hears from at most one of its senders at a time) counts as one flow per link, however many of its flows
cross the link: ``allocate(..., incast_group=...)`` gives each such flow its coflow id, -1 for ordinary flows.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

SHARING = ("strict", "weighted")


@dataclass(frozen=True)
class IncastModel:
    threshold: int = 1
    alpha: float = 0.1
    kinds: tuple[str, ...] = ("eth",)

    def __post_init__(self) -> None:
        if not isinstance(self.threshold, int) or self.threshold < 1:
            raise ValueError(f"IncastModel.threshold must be an integer >= 1, got {self.threshold!r}")
        if not (self.alpha >= 0 and np.isfinite(self.alpha)):
            raise ValueError(f"IncastModel.alpha must be a finite number >= 0, got {self.alpha!r}")


def waterfill(hops: np.ndarray, weights: np.ndarray, cap: np.ndarray, rtol: float = 1e-9) -> np.ndarray:
    """Weighted max-min fair rates for flows ``hops`` given remaining capacities ``cap`` (length n_links + 1, the
    last entry is the pad). ``cap`` is decreased in place by the allocated rates. Returns rates (bytes/s)."""
    n, h = hops.shape
    nl = cap.shape[0]
    rates = np.zeros(n)
    if n == 0:
        return rates
    idx = np.arange(n)
    cur_h = hops
    cur_w = weights
    while idx.size:
        wsum = np.bincount(cur_h.ravel(), weights=np.repeat(cur_w, h), minlength=nl)
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
        cap -= np.bincount(cur_h[fz].ravel(), weights=np.repeat(r, h), minlength=nl)
        cap[-1] = np.inf
        keep = ~fz
        idx = idx[keep]
        cur_h = cur_h[keep]
        cur_w = cur_w[keep]
    return rates


def incast_fan_in(hops: np.ndarray, n_links_padded: int, incast_group: np.ndarray | None = None) -> np.ndarray:
    """Concurrent flows per link (length ``n_links_padded``); the flows of one matched coflow count once."""
    if incast_group is None or not (incast_group >= 0).any():
        return np.bincount(hops.ravel(), minlength=n_links_padded)
    solo = incast_group < 0
    k = np.bincount(hops[solo].ravel(), minlength=n_links_padded)
    h = hops[~solo]
    pair = np.repeat(incast_group[~solo], h.shape[1]) * n_links_padded + h.ravel()
    return k + np.bincount(np.unique(pair) % n_links_padded, minlength=n_links_padded)


def allocate(hops: np.ndarray, cls: np.ndarray, capacity: np.ndarray, sharing: str = "strict",
             weight_ratio: float = 0.5, incast: IncastModel | None = None,
             incast_links: np.ndarray | None = None, incast_group: np.ndarray | None = None) -> np.ndarray:
    """Rates for all active flows. ``cls`` = dense class rank per flow (0 = most urgent); ``capacity`` has
    length n_links (the pad is added here). ``incast_group``: per flow, -1 or the id of a matched coflow (counted
    once per link by the incast model)."""
    n = hops.shape[0]
    if n == 0:
        return np.zeros(0)
    cap = np.empty(capacity.shape[0] + 1)
    cap[:-1] = capacity
    cap[-1] = np.inf
    if incast is not None and incast_links is not None and incast_links.any():
        k = incast_fan_in(hops, cap.shape[0], incast_group)[:-1]
        over = np.maximum(0, k - incast.threshold) * incast_links
        cap[:-1] = capacity / (1.0 + incast.alpha * over)
    classes = np.unique(cls)
    if classes.size == 1 or sharing == "weighted":
        if classes.size == 1:
            w = np.ones(n)
        else:
            rank = np.searchsorted(classes, cls)
            w = weight_ratio ** rank.astype(np.float64)
        return waterfill(hops, w, cap)
    if sharing != "strict":
        raise ValueError(f"sharing {sharing!r} is not one of {SHARING}")
    rates = np.zeros(n)
    order = np.argsort(cls, kind="stable")
    bounds = np.searchsorted(cls[order], classes, side="left").tolist() + [n]
    for a, b in zip(bounds[:-1], bounds[1:], strict=True):
        sel = order[a:b]
        rates[sel] = waterfill(hops[sel], np.ones(b - a), cap)
    return rates
