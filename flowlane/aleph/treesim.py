"""A flow-level simulator of aggregation trees on a star or a leaf-spine fabric (seed 002 Sec. 6.4, Figs. 13-14).

Hosts are workers 0..n-1 and one PS (index n). Every host has an access link (one budget per direction); on a
leaf-spine, each leaf also has an uplink and a downlink to the spines (``leaf_uplink``, one figure per direction),
and a flow between leaves crosses both. A scheme is a set of flows, each carrying ``size`` per iteration:

- ``ps``: every worker to the PS and back (BytePS-like);
- ``ring``: worker i to i+1 in the given order, 2(n-1)/n * size per flow (Horovod's ring);
- ``aleph``: a :class:`flowlane.aleph.Plan`'s members to their aggregator and back, aggregators (and singletons) to
  the PS and back.

Flows of one scheme advance in lockstep (pipelined segments), so the rate is the tightest link's capacity divided by
the flows crossing it, and the iteration takes volume / rate. Reported: the time, the rate, the bytes summed over
every link crossed (the paper's "communication overhead"), the mean number of switches a worker's gradient crosses
before another node sums it ("gradient hops": a member's to its aggregator, an aggregator's own to the PS; a ring
chunk's through all n - 1 steps), and the senders' summed rate (Fig. 13's worker bandwidth usage).
Figures from this module are simulated.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from flowlane.aleph.cluster import Plan

SCHEMES = ("ps", "ring", "aleph")


@dataclass(frozen=True)
class Fabric:
    """Access budgets of the workers and the PS; ``leaf_of`` (one leaf per worker, the PS on ``ps_leaf``) makes it a
    leaf-spine with ``leaf_uplink`` per leaf and direction; None is a single switch (star)."""

    bandwidth: tuple[float, ...]
    ps_bandwidth: float
    leaf_of: tuple[int, ...] | None = None
    ps_leaf: int = -1
    leaf_uplink: float = float("inf")

    def __post_init__(self) -> None:
        if not self.bandwidth or any(not b > 0 for b in self.bandwidth) or not self.ps_bandwidth > 0:
            raise ValueError(
                f"bandwidths must be > 0: workers {list(self.bandwidth)}, PS {self.ps_bandwidth}"
            )
        if self.leaf_of is not None and len(self.leaf_of) != len(self.bandwidth):
            raise ValueError(f"leaf_of names {len(self.leaf_of)} workers, bandwidth {len(self.bandwidth)}")
        if not self.leaf_uplink > 0:
            raise ValueError(f"leaf_uplink={self.leaf_uplink!r} must be > 0")

    @classmethod
    def star(cls, bandwidth: Sequence[float], ps_bandwidth: float) -> Fabric:
        return cls(tuple(bandwidth), ps_bandwidth)

    @classmethod
    def leaf_spine(
        cls, bandwidth: Sequence[float], ps_bandwidth: float, hosts_per_leaf: int, leaf_uplink: float
    ) -> Fabric:
        """Workers fill leaves in index order, ``hosts_per_leaf`` each; the PS sits on a leaf of its own."""
        if not (isinstance(hosts_per_leaf, int) and hosts_per_leaf >= 1):
            raise ValueError(f"hosts_per_leaf={hosts_per_leaf!r} must be an integer >= 1")
        leaf_of = tuple(w // hosts_per_leaf for w in range(len(bandwidth)))
        return cls(tuple(bandwidth), ps_bandwidth, leaf_of, max(leaf_of) + 1, leaf_uplink)

    def leaf(self, host: int) -> int:
        assert self.leaf_of is not None
        return self.ps_leaf if host == len(self.bandwidth) else self.leaf_of[host]

    def links(self, src: int, dst: int) -> list[tuple[str, int]]:
        out = [("up", src), ("down", dst)]
        if self.leaf_of is not None and self.leaf(src) != self.leaf(dst):
            out += [("leafup", self.leaf(src)), ("leafdown", self.leaf(dst))]
        return out

    def capacity(self, link: tuple[str, int]) -> float:
        kind, i = link
        if kind in ("leafup", "leafdown"):
            return self.leaf_uplink
        return self.ps_bandwidth if i == len(self.bandwidth) else self.bandwidth[i]

    def switches(self, src: int, dst: int) -> int:
        return 1 if self.leaf_of is None or self.leaf(src) == self.leaf(dst) else 3


@dataclass(frozen=True)
class TreeResult:
    """One scheme on one fabric (simulated)."""

    scheme: str
    time: float
    rate: float
    link_bytes: float
    mean_hops: float
    worker_send_rate: float


def flows(
    scheme: str, n: int, plan: Plan | None = None, ring_order: Sequence[int] | None = None
) -> list[tuple[int, int]]:
    """(src, dst) pairs of ``scheme`` on n workers; the PS is host n."""
    ps = n
    if scheme == "ps":
        return [f for w in range(n) for f in ((w, ps), (ps, w))]
    if scheme == "ring":
        order = list(range(n)) if ring_order is None else list(ring_order)
        if sorted(order) != list(range(n)):
            raise ValueError(f"ring_order {order} is not a permutation of 0..{n - 1}")
        return [(order[i], order[(i + 1) % n]) for i in range(n)] if n > 1 else []
    if scheme == "aleph":
        if plan is None or plan.n != n:
            raise ValueError(f"scheme 'aleph' needs a plan of {n} workers, got {plan!r}")
        out = []
        for c in plan.clusters:
            out += [f for m in c.members[1:] for f in ((m, c.head), (c.head, m))]
            out += [(c.head, ps), (ps, c.head)]
        return out
    raise ValueError(f"scheme={scheme!r} is not one of {SCHEMES}")


def simulate(
    scheme: str,
    fabric: Fabric,
    size: float,
    plan: Plan | None = None,
    ring_order: Sequence[int] | None = None,
) -> TreeResult:
    """One iteration of ``scheme`` on ``fabric`` with ``size`` per worker gradient."""
    n = len(fabric.bandwidth)
    fl = flows(scheme, n, plan, ring_order)
    per_flow = 2 * (n - 1) / n * size if scheme == "ring" else size
    if not fl:
        return TreeResult(scheme, 0.0, float("inf"), 0.0, 0.0, 0.0)
    load: Counter[tuple[str, int]] = Counter(link for s, d in fl for link in fabric.links(s, d))
    rate = min(fabric.capacity(link) / k for link, k in load.items())
    link_bytes = sum(len(fabric.links(s, d)) for s, d in fl) * per_flow  # host-switch and leaf-spine links
    ps = n
    if scheme == "ring":
        hops = sum(fabric.switches(s, d) for s, d in fl) / n * (n - 1)
    elif scheme == "ps":
        hops = sum(fabric.switches(w, ps) for w in range(n)) / n
    else:
        assert plan is not None
        hops = (
            sum(
                fabric.switches(c.head, ps) + sum(fabric.switches(m, c.head) for m in c.members[1:])
                for c in plan.clusters
            )
            / n
        )
    send = sum(rate for s, _ in fl if s < n)
    return TreeResult(scheme, per_flow / rate, rate, link_bytes, hops, send)
