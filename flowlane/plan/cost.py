"""DGCL's staged cost model over physical hops with contention (seed 001 §5.1; digest §2.3).

A *logical link* joins two ranks (GPUs) and is the hop list of the best direct route between them in a
:class:`flowlane.topology.Topology` (one link per ordered pair, digest §5 items 1-2; links and hops are directed). A
transfer leaving a tree node at depth ``δ`` runs in stage ``δ+1``. With ``c_h^k`` the number of embeddings crossing
physical hop ``h`` in stage ``k`` (aggregated over *all* logical links that share the hop: this is contention),

    t(S) = Σ_k max_h c_h^k / b_h                                            (digest §2.3, "equivalent form")

which equals the paper's rule (link time = max over its hops, stage time = max over links, total = sum over stages).
Costs are in seconds per byte of one embedding: multiply by the embedding size in bytes for seconds; by the
dimension-invariance property (§5.1) the best plan does not depend on that size.

``alpha`` (seconds, default 0 as in the paper) optionally charges a fixed latency per used stage (digest §5 item 8);
it is only meaningful together with ``unit_bytes`` (bytes of one embedding), which then makes costs seconds.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from flowlane.topology import Topology, TopologyError

from .relation import PlanError


@dataclass(frozen=True)
class LinkModel:
    """Logical links between ``devices`` (rank ``r`` runs on ``devices[r]``) as lists of physical hops."""

    devices: tuple[str, ...]
    hop_names: tuple[str, ...]
    hop_kinds: tuple[str, ...]
    hop_bw: np.ndarray  # [H] bytes/s
    link_hops: np.ndarray  # [R, R, maxh] hop ids, -1 padded; [a, a] and missing links are all -1
    latency: np.ndarray  # [R, R] seconds per direct route

    @property
    def num_ranks(self) -> int:
        return len(self.devices)

    @property
    def hop_inv_bw(self) -> np.ndarray:
        return 1.0 / self.hop_bw

    def hops(self, a: int, b: int) -> np.ndarray:
        h = self.link_hops[a, b]
        return h[h >= 0]

    def link_raw(self) -> np.ndarray:
        """[R, R] uncontended seconds per byte of each logical link (its slowest hop); inf where no link."""
        inv = np.append(self.hop_inv_bw, 0.0)
        raw = inv[self.link_hops].max(axis=2)
        raw[self.link_hops[:, :, 0] < 0] = np.inf
        return raw

    def link_class(self, a: int, b: int) -> str:
        """The kind of a link's slowest hop (e.g. "nvlink" vs "pcie"/"qpi"/"eth")."""
        hs = self.hops(a, b)
        if not hs.size:
            raise PlanError(f"no link between ranks {a} ({self.devices[a]}) and {b} ({self.devices[b]})")
        return self.hop_kinds[int(hs[np.argmin(self.hop_bw[hs])])]

    @classmethod
    def from_topology(
        cls, topo: Topology, devices: Sequence[str] | None = None, num_ranks: int | None = None
    ) -> LinkModel:
        """Links between ``devices`` (default: the topology's first ``num_ranks`` GPUs/hosts, in order). A pair with
        no route (e.g. a zero in :func:`mesh_from_matrix`) has no logical link: SPST relays around it, peer-to-peer
        refuses a relation that needs it."""
        if devices is None:
            eps = topo.gpus
            n = len(eps) if num_ranks is None else num_ranks
            if not 1 <= n <= len(eps):
                raise PlanError(f"num_ranks={num_ranks} but topology {topo.name!r} has {len(eps)} endpoints")
            devices = eps[:n]
        devices = tuple(devices)
        if len(set(devices)) != len(devices):
            raise PlanError(f"devices must be distinct, got {list(devices)}")
        for d in devices:
            if d not in topo.devices or not topo.devices[d].is_endpoint:
                raise PlanError(f"device {d!r} is not an endpoint (gpu/host) of topology {topo.name!r}")
        hop_index: dict[tuple[str, str], int] = {}
        routes = {}
        n = len(devices)
        for a in range(n):
            for b in range(n):
                if a == b:
                    continue
                try:
                    r = topo.route(devices[a], devices[b])
                except TopologyError:  # devices were checked above: no path, so no link (all -1)
                    continue
                routes[a, b] = r
                for lk in r.links:
                    hop_index.setdefault((lk.src, lk.dst), len(hop_index))
        maxh = max((len(r) for r in routes.values()), default=1)
        link_hops = np.full((n, n, maxh), -1, np.int32)
        lat = np.zeros((n, n))
        for (a, b), r in routes.items():
            link_hops[a, b, : len(r)] = [hop_index[(lk.src, lk.dst)] for lk in r.links]
            lat[a, b] = r.latency
        names = sorted(hop_index, key=lambda k: hop_index[k])
        bw = np.array([topo.links[k].bandwidth for k in names], dtype=np.float64)
        kinds = tuple(topo.links[k].kind for k in names)
        return cls(devices, tuple(f"{a}->{b}" for a, b in names), kinds, bw, link_hops, lat)


def full_mesh(num_ranks: int, bandwidth: float, latency: float = 0.0, name: str = "full_mesh") -> Topology:
    """Hosts joined pairwise by dedicated links: the uniform fully-connected case (digest §4.1 ``uniform_4``)."""
    if num_ranks < 2:
        raise PlanError(f"full_mesh needs at least 2 ranks, got {num_ranks}")
    t = Topology(name=name)
    for i in range(num_ranks):
        t.add_device(f"host{i}", "host", i)
    for i in range(num_ranks):
        for j in range(i + 1, num_ranks):
            t.add_link(f"host{i}", f"host{j}", bandwidth, latency, "direct")
    return t


def mesh_from_matrix(bw: np.ndarray, latency: float = 0.0, name: str = "mesh") -> Topology:
    """Hosts joined by one directed link per ordered pair with bandwidth ``bw[i, j]`` bytes/s (``<= 0``: no link)."""
    bw = np.asarray(bw, dtype=float)
    if bw.ndim != 2 or bw.shape[0] != bw.shape[1] or bw.shape[0] < 2:
        raise PlanError(f"bandwidth matrix must be square with >= 2 rows, got shape {bw.shape}")
    t = Topology(name=name)
    n = bw.shape[0]
    for i in range(n):
        t.add_device(f"host{i}", "host", i)
    for i in range(n):
        for j in range(n):
            if i != j and bw[i, j] > 0:
                t.add_link(f"host{i}", f"host{j}", float(bw[i, j]), latency, "direct", bidirectional=False)
    return t


def stage_hop_loads(
    plan_stage: np.ndarray,
    plan_src: np.ndarray,
    plan_dst: np.ndarray,
    lm: LinkModel,
    num_stages: int | None = None,
) -> np.ndarray:
    """``c_h^k``: embeddings crossing hop ``h`` in stage ``k`` (row ``k-1``), shape [stages, H]. A transfer in a stage
    below 1 or between ranks without a link is refused (it would count on the wrong row, or on no hop at all)."""
    s = int(num_stages if num_stages is not None else (plan_stage.max() if plan_stage.size else 0))
    load = np.zeros((max(s, 1), lm.hop_bw.size))
    if plan_stage.size == 0:
        return load
    if plan_stage.min() < 1:
        raise PlanError(f"a transfer in stage {int(plan_stage.min())}; stages start at 1")
    hops = lm.link_hops[plan_src, plan_dst]  # [T, maxh]
    if (hops[:, 0] < 0).any():
        i = int(np.nonzero(hops[:, 0] < 0)[0][0])
        a, b = int(plan_src[i]), int(plan_dst[i])
        raise PlanError(
            f"a transfer from rank {a} ({lm.devices[a]}) to {b} ({lm.devices[b]}), which have no link"
        )
    st = np.broadcast_to((plan_stage - 1)[:, None], hops.shape)
    ok = hops >= 0
    np.add.at(load, (st[ok], hops[ok]), 1.0)
    return load


def evaluate(
    plan_stage: np.ndarray,
    plan_src: np.ndarray,
    plan_dst: np.ndarray,
    lm: LinkModel,
    unit_bytes: float = 1.0,
    alpha: float = 0.0,
) -> float:
    """``t(S)`` in seconds for embeddings of ``unit_bytes`` bytes (+ ``alpha`` seconds per used stage)."""
    load = stage_hop_loads(plan_stage, plan_src, plan_dst, lm)
    per_stage = (load * (unit_bytes * lm.hop_inv_bw)[None, :]).max(axis=1)
    return float(per_stage.sum() + alpha * np.count_nonzero(load.sum(axis=1)))
