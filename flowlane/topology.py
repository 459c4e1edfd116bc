"""Network topology: devices, directed links (the physical hops), and routes.

A *link* is one directed physical hop with a bandwidth and a latency (an NVLink lane, a PCIe x16 port in one
direction, a QPI link, a NIC port, a switch port). Several routes that cross the same link contend for it; this is
the contention model shared by the simulator (flowlane.sim) and the DGCL planner (flowlane.plan), which both need
"physical hops that several logical transfers share" (DGCL, seed 001 §4; Hermod, seed 000 §5.4).

Units: bandwidth in bytes per second, latency in seconds. Use :func:`gbps` / :func:`gBps` to convert.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

DEVICE_KINDS = ("gpu", "cpu", "pcie_switch", "nic", "switch", "host")


def gbps(x: float) -> float:
    """Gigabits per second -> bytes per second."""
    return x * 1e9 / 8


def gBps(x: float) -> float:  # noqa: N802 - GB/s is the conventional spelling
    """Gigabytes per second -> bytes per second."""
    return x * 1e9


class TopologyError(ValueError):
    """An invalid topology specification or query."""


@dataclass(frozen=True)
class Device:
    name: str
    kind: str
    server: int = 0

    @property
    def is_endpoint(self) -> bool:
        """GPUs (and hosts of star topologies) run work; the rest only forward."""
        return self.kind in ("gpu", "host")


@dataclass(frozen=True)
class Link:
    """One directed physical hop."""

    src: str
    dst: str
    bandwidth: float
    latency: float
    kind: str = "generic"  # nvlink, pcie, qpi, nic, eth, ...

    @property
    def name(self) -> str:
        return f"{self.src}->{self.dst}"


@dataclass(frozen=True)
class Route:
    """An ordered path of links from src to dst."""

    links: tuple[Link, ...]

    @property
    def src(self) -> str:
        return self.links[0].src

    @property
    def dst(self) -> str:
        return self.links[-1].dst

    @property
    def bandwidth(self) -> float:
        """Bottleneck bandwidth, bytes/s."""
        return min(link.bandwidth for link in self.links)

    @property
    def latency(self) -> float:
        return sum(link.latency for link in self.links)

    def time(self, nbytes: float) -> float:
        """Uncontended transfer time (cut-through: latency + size / bottleneck bandwidth)."""
        return self.latency + nbytes / self.bandwidth

    def __len__(self) -> int:
        return len(self.links)


@dataclass
class Topology:
    """A directed multigraph of devices and links with deterministic shortest-path routing."""

    name: str = "custom"
    devices: dict[str, Device] = field(default_factory=dict)
    links: dict[tuple[str, str], Link] = field(default_factory=dict)
    _out: dict[str, list[Link]] = field(default_factory=dict, repr=False)
    _route_cache: dict[tuple[str, str], tuple[Route, ...]] = field(default_factory=dict, repr=False)
    # Optional analytic router for regular fabrics (same answer as Dijkstra, without a graph search per pair);
    # returns None for pairs it does not handle. Presets set it; add_link() clears it (the fabric changed).
    _router: Callable[[Topology, str, str], tuple[Route, ...] | None] | None = field(default=None, repr=False)

    # -- construction -------------------------------------------------------------------------------------------
    def add_device(self, name: str, kind: str, server: int = 0) -> Device:
        if not name or not isinstance(name, str):
            raise TopologyError(f"device name must be a non-empty string, got {name!r}")
        if kind not in DEVICE_KINDS:
            raise TopologyError(f"device {name!r}: kind {kind!r} is not one of {DEVICE_KINDS}")
        if name in self.devices:
            raise TopologyError(f"device {name!r} is defined twice")
        if server < 0:
            raise TopologyError(f"device {name!r}: server index must be >= 0, got {server}")
        dev = Device(name, kind, server)
        self.devices[name] = dev
        self._out[name] = []
        return dev

    def add_link(
        self,
        src: str,
        dst: str,
        bandwidth: float,
        latency: float = 0.0,
        kind: str = "generic",
        bidirectional: bool = True,
    ) -> None:
        """Add a link (both directions by default; each direction is its own hop with full bandwidth)."""
        for end in (src, dst):
            if end not in self.devices:
                raise TopologyError(
                    f"link {src}->{dst}: unknown device {end!r}; known: {sorted(self.devices)[:8]}..."
                )
        if src == dst:
            raise TopologyError(f"link {src}->{dst}: a link must join two different devices")
        if not (isinstance(bandwidth, int | float) and math.isfinite(bandwidth) and bandwidth > 0):
            raise TopologyError(
                f"link {src}->{dst}: bandwidth must be a finite number > 0 bytes/s, got {bandwidth!r}"
            )
        if not (isinstance(latency, int | float) and math.isfinite(latency) and latency >= 0):
            raise TopologyError(f"link {src}->{dst}: latency must be a finite number >= 0 s, got {latency!r}")
        pairs = [(src, dst), (dst, src)] if bidirectional else [(src, dst)]
        for a, b in pairs:
            if (a, b) in self.links:
                raise TopologyError(f"link {a}->{b} is defined twice")
            link = Link(a, b, float(bandwidth), float(latency), kind)
            self.links[(a, b)] = link
            self._out[a].append(link)
        self._route_cache.clear()
        self._router = None

    # -- queries ------------------------------------------------------------------------------------------------
    @property
    def gpus(self) -> list[str]:
        """Endpoint devices in insertion order (rank order)."""
        return [d.name for d in self.devices.values() if d.is_endpoint]

    def link(self, src: str, dst: str) -> Link:
        try:
            return self.links[(src, dst)]
        except KeyError:
            raise TopologyError(f"no link {src}->{dst}") from None

    def out_links(self, name: str) -> Sequence[Link]:
        self._check(name)
        return self._out[name]

    def _check(self, name: str) -> None:
        if name not in self.devices:
            raise TopologyError(f"unknown device {name!r}")

    def routes(self, src: str, dst: str) -> tuple[Route, ...]:
        """All equal-cost shortest routes (ECMP set), in a deterministic order.

        Cost of a route = sum over links of (latency + 1 / bandwidth) scaled so that the per-byte term dominates
        for large messages; ties (e.g. the spines of a leaf-spine fabric) are all returned.
        """
        self._check(src)
        self._check(dst)
        if src == dst:
            raise TopologyError(f"route from {src!r} to itself is not defined")
        key = (src, dst)
        if key not in self._route_cache:
            rs = self._router(self, src, dst) if self._router is not None else None
            self._route_cache[key] = rs if rs is not None else self._equal_cost_paths(src, dst)
        return self._route_cache[key]

    def route(self, src: str, dst: str, flow_hash: int = 0) -> Route:
        """One route; ``flow_hash`` picks among equal-cost routes (ECMP-style)."""
        rs = self.routes(src, dst)
        return rs[flow_hash % len(rs)]

    @staticmethod
    def _cost(link: Link) -> float:
        # time for a 1 MiB transfer over this hop: per-byte term dominates, latency breaks ties
        return link.latency + (1 << 20) / link.bandwidth

    def _equal_cost_paths(self, src: str, dst: str) -> tuple[Route, ...]:
        # Dijkstra keeping every predecessor on an equal-cost shortest path; only endpoints may not be relayed
        # through (a GPU does not forward traffic in hardware), so non-endpoint devices are the only transit.
        dist: dict[str, float] = {src: 0.0}
        preds: dict[str, list[Link]] = {src: []}
        heap: list[tuple[float, str]] = [(0.0, src)]
        done: set[str] = set()
        eps = 1e-12
        while heap:
            d, u = heapq.heappop(heap)
            if u in done:
                continue
            done.add(u)
            if u == dst:
                continue
            if u != src and self.devices[u].is_endpoint:
                continue
            for link in self._out[u]:
                nd = d + self._cost(link)
                old = dist.get(link.dst)
                if old is None or nd < old - eps * max(1.0, old):
                    dist[link.dst] = nd
                    preds[link.dst] = [link]
                    heapq.heappush(heap, (nd, link.dst))
                elif abs(nd - old) <= eps * max(1.0, old):
                    preds[link.dst].append(link)
        if dst not in dist:
            raise TopologyError(f"no route from {src!r} to {dst!r} in topology {self.name!r}")
        paths: list[tuple[Link, ...]] = []

        def walk(node: str, suffix: tuple[Link, ...]) -> None:
            if node == src:
                paths.append(suffix)
                return
            for link in sorted(preds[node], key=lambda lk: lk.src):
                walk(link.src, (link, *suffix))

        walk(dst, ())
        return tuple(Route(p) for p in sorted(paths, key=lambda p: tuple(lk.name for lk in p)))

    def validate(self) -> None:
        """Every pair of endpoints must be connected."""
        gpus = self.gpus
        if not gpus:
            raise TopologyError(f"topology {self.name!r} has no endpoint devices (gpu or host)")
        for a in gpus[:1]:
            for b in gpus[1:]:
                self.routes(a, b)
                self.routes(b, a)


# ---------------------------------------------------------------------------------------------------------------
# Presets
# ---------------------------------------------------------------------------------------------------------------
# Defaults are per direction. NVLink 1.0 on DGX-1 (P100): ~20 GB/s per link per direction; V100 doubles some pairs.
NVLINK_BW = gBps(20)
PCIE3_X16_BW = gBps(12)  # effective, of the 15.75 GB/s raw
QPI_BW = gBps(9.6)
NIC_100G = gbps(100)

# DGX-1 hybrid cube-mesh: two quads (0-3, 4-7) fully connected inside, plus i <-> i+4 (DGCL seed 001 fig. 1).
DGX1_NVLINK_PAIRS = [(a, b) for q in (0, 4) for a in range(q, q + 4) for b in range(a + 1, q + 4)] + [
    (i, i + 4) for i in range(4)
]


def dgx1(
    nvlink_bw: float = NVLINK_BW,
    pcie_bw: float = PCIE3_X16_BW,
    qpi_bw: float = QPI_BW,
    server: int = 0,
    topo: Topology | None = None,
    prefix: str = "",
) -> Topology:
    """DGX-1-like server: 8 GPUs, NVLink hybrid cube-mesh, 4 PCIe switches (2 GPUs each), 2 CPUs joined by QPI,
    one NIC on the first PCIe switch."""
    t = topo or Topology(name="dgx1")
    p = prefix
    for i in range(8):
        t.add_device(f"{p}gpu{i}", "gpu", server)
    for s in range(4):
        t.add_device(f"{p}pcie{s}", "pcie_switch", server)
    for c in range(2):
        t.add_device(f"{p}cpu{c}", "cpu", server)
    for a, b in DGX1_NVLINK_PAIRS:
        t.add_link(f"{p}gpu{a}", f"{p}gpu{b}", nvlink_bw, 1e-6, "nvlink")
    for i in range(8):
        t.add_link(f"{p}gpu{i}", f"{p}pcie{i // 2}", pcie_bw, 1e-6, "pcie")
    for s in range(4):
        t.add_link(f"{p}pcie{s}", f"{p}cpu{s // 2}", pcie_bw, 1e-6, "pcie")
    t.add_link(f"{p}cpu0", f"{p}cpu1", qpi_bw, 1e-6, "qpi")
    t.add_device(f"{p}nic0", "nic", server)
    t.add_link(f"{p}nic0", f"{p}pcie0", pcie_bw, 1e-6, "pcie")
    return t


def pcie_server(
    num_gpus: int = 8,
    pcie_bw: float = PCIE3_X16_BW,
    qpi_bw: float = QPI_BW,
    gpus_per_switch: int = 2,
    nic_bw: float = NIC_100G,
) -> Topology:
    """8-GPU PCIe-only server: GPUs behind PCIe switches, switches on two CPU sockets joined by QPI."""
    if num_gpus < 1 or num_gpus % gpus_per_switch:
        raise TopologyError(
            f"num_gpus={num_gpus} must be a positive multiple of gpus_per_switch={gpus_per_switch}"
        )
    t = Topology(name="pcie")
    nsw = num_gpus // gpus_per_switch
    for i in range(num_gpus):
        t.add_device(f"gpu{i}", "gpu")
    for s in range(nsw):
        t.add_device(f"pcie{s}", "pcie_switch")
    ncpu = 2 if nsw >= 2 else 1
    for c in range(ncpu):
        t.add_device(f"cpu{c}", "cpu")
    for i in range(num_gpus):
        t.add_link(f"gpu{i}", f"pcie{i // gpus_per_switch}", pcie_bw, 1e-6, "pcie")
    for s in range(nsw):
        t.add_link(f"pcie{s}", f"cpu{s * ncpu // nsw}", pcie_bw, 1e-6, "pcie")
    if ncpu == 2:
        t.add_link("cpu0", "cpu1", qpi_bw, 1e-6, "qpi")
    t.add_device("nic0", "nic")
    t.add_link("nic0", "pcie0", pcie_bw, 1e-6, "pcie")
    return t


def leaf_spine(
    servers: int,
    gpus_per_server: int = 8,
    nic_bw: float = NIC_100G,
    oversubscription: float = 1.0,
    servers_per_leaf: int = 4,
    intra_bw: float = gBps(150),
    latency: float = 1e-6,
    nics_per_server: int = 0,
) -> Topology:
    """Leaf-spine cluster. Each server: GPUs on an intra-server fabric (NVSwitch-like, ``intra_bw`` per GPU) and
    ``nics_per_server`` NICs (``nic_bw`` each; 0 = one per GPU, rail-style) to its leaf; GPU g sends through NIC
    ``g * nics_per_server // gpus_per_server`` over its own PCIe link. Spine count is chosen so that leaf uplink
    capacity equals downlink capacity / ``oversubscription``."""
    for nm, v in (
        ("servers", servers),
        ("gpus_per_server", gpus_per_server),
        ("servers_per_leaf", servers_per_leaf),
    ):
        if not isinstance(v, int) or v < 1:
            raise TopologyError(f"leaf_spine: {nm} must be an integer >= 1, got {v!r}")
    nics = nics_per_server or gpus_per_server
    if not isinstance(nics, int) or nics < 1 or gpus_per_server % nics:
        raise TopologyError(
            f"leaf_spine: nics_per_server must be 0 (one per GPU) or an integer >= 1 dividing "
            f"gpus_per_server={gpus_per_server}, got {nics_per_server!r}"
        )
    if not (oversubscription >= 1.0 and math.isfinite(oversubscription)):
        raise TopologyError(
            f"leaf_spine: oversubscription must be >= 1 (1 = non-blocking), got {oversubscription!r}"
        )
    t = Topology(name=f"leaf_spine_{servers}x{gpus_per_server}")
    nleaf = math.ceil(servers / servers_per_leaf)
    down = servers_per_leaf * nics * nic_bw
    nspine = max(1, min(8, servers_per_leaf * nics // 4)) if nleaf > 1 else 0
    for s in range(servers):
        t.add_device(f"s{s}/nvsw", "switch", s)
        for g in range(gpus_per_server):
            t.add_device(f"s{s}/gpu{g}", "gpu", s)
            t.add_link(f"s{s}/gpu{g}", f"s{s}/nvsw", intra_bw, latency, "nvlink")
    for leaf in range(nleaf):
        t.add_device(f"leaf{leaf}", "switch")
    for sp in range(nspine):
        t.add_device(f"spine{sp}", "switch")
    for s in range(servers):
        leaf = s // servers_per_leaf
        for n in range(nics):
            t.add_device(f"s{s}/nic{n}", "nic", s)
            t.add_link(f"s{s}/nic{n}", f"leaf{leaf}", nic_bw, latency, "eth")
        for g in range(gpus_per_server):
            t.add_link(f"s{s}/gpu{g}", f"s{s}/nic{g * nics // gpus_per_server}", gBps(25), latency, "pcie")
    for leaf in range(nleaf):
        for sp in range(nspine):
            t.add_link(f"leaf{leaf}", f"spine{sp}", down / oversubscription / nspine, latency, "eth")
    t._router = _leaf_spine_router(servers_per_leaf, nspine, gpus_per_server // nics)
    return t


def _leaf_spine_router(
    servers_per_leaf: int, nspine: int, gpus_per_nic: int = 1
) -> Callable[[Topology, str, str], tuple[Route, ...] | None]:
    """Analytic ECMP routes between GPUs of :func:`leaf_spine` (equal to the Dijkstra answer, which is too slow for
    thousands of GPUs): candidate path families are costed with :meth:`Topology._cost` and the cheapest kept."""

    def parse(name: str) -> tuple[int, int] | None:
        sv, _, g = name.partition("/gpu")
        if not sv.startswith("s") or not g.isdigit() or not sv[1:].isdigit():
            return None
        return int(sv[1:]), int(g)

    def router(t: Topology, src: str, dst: str) -> tuple[Route, ...] | None:
        a, b = parse(src), parse(dst)
        if a is None or b is None:
            return None
        (sa, ga), (sb, gb) = a, b
        la, lb = sa // servers_per_leaf, sb // servers_per_leaf
        lk = t.links
        na, nb = ga // gpus_per_nic, gb // gpus_per_nic
        up = [lk[(src, f"s{sa}/nic{na}")], lk[(f"s{sa}/nic{na}", f"leaf{la}")]]
        down = [lk[(f"leaf{lb}", f"s{sb}/nic{nb}")], lk[(f"s{sb}/nic{nb}", dst)]]
        cands: list[tuple[Link, ...]] = []
        if sa == sb:
            cands.append((lk[(src, f"s{sa}/nvsw")], lk[(f"s{sa}/nvsw", dst)]))
        if la == lb:
            cands.append((*up, *down))
        else:
            cands += [
                (*up, lk[(f"leaf{la}", f"spine{p}")], lk[(f"spine{p}", f"leaf{lb}")], *down)
                for p in range(nspine)
            ]
        costs = [sum(t._cost(x) for x in c) for c in cands]
        best = min(costs)
        keep = [c for c, k in zip(cands, costs, strict=True) if abs(k - best) <= 1e-12 * max(1.0, best)]
        return tuple(Route(p) for p in sorted(keep, key=lambda p: tuple(x.name for x in p)))

    return router


def star(
    access_bandwidths: Iterable[float], latency: float = 5e-6, names: Sequence[str] | None = None
) -> Topology:
    """Hosts on one switch with heterogeneous access links (ALEPH seed 002's heterogeneous-bandwidth setting)."""
    bws = list(access_bandwidths)
    if len(bws) < 2:
        raise TopologyError(f"star needs at least 2 hosts, got {len(bws)}")
    if names is not None and len(names) != len(bws):
        raise TopologyError(f"star: {len(names)} names for {len(bws)} hosts")
    t = Topology(name="star")
    t.add_device("switch", "switch")
    for i, bw in enumerate(bws):
        n = names[i] if names else f"host{i}"
        t.add_device(n, "host", i)
        t.add_link(n, "switch", bw, latency, "eth")
    return t


def two_servers(nic_bw: float = NIC_100G, **kw: float) -> Topology:
    """Two DGX-1-like servers joined through their NICs by one switch (DGCL's multi-machine setting)."""
    t = Topology(name="two_dgx1")
    dgx1(topo=t, prefix="s0/", server=0, **kw)
    dgx1(topo=t, prefix="s1/", server=1, **kw)
    t.add_device("tor", "switch")
    for s in (0, 1):
        t.add_link(f"s{s}/nic0", "tor", nic_bw, 2e-6, "eth")
    return t


PRESETS = {
    "dgx1": dgx1,
    "pcie": pcie_server,
    "leaf_spine": leaf_spine,
    "star": star,
    "two_servers": two_servers,
}


def preset(name: str, **kwargs: object) -> Topology:
    """Build a preset topology by name."""
    if name not in PRESETS:
        raise TopologyError(f"unknown topology preset {name!r}; choose one of {sorted(PRESETS)}")
    return PRESETS[name](**kwargs)  # type: ignore[arg-type]
