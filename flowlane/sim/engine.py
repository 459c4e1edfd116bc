"""Event-driven flow-level simulator (seed 000 §5.5.1 uses FlexFlow's task graph + htsim; this is a fluid,
flow-level stand-in: no packets, rates recomputed whenever the set of active flows changes).

Semantics:
* A node starts when all its dependencies have completed. Compute tasks run one at a time per executor: a ready
  task starts at once if its executor is idle, else it queues, and the queue runs in program order (smallest node
  id first), not in the order the tasks became ready. Coflows on the same ``stream`` run one at a time; the next
  one is the ready coflow with the smallest ``policy.order(meta)`` (FIFO: issue order).
* A started coflow's flows all become active at once. Rates: :func:`flowlane.sim.network.allocate` with the
  policy's priority keys ranked into strict classes. Events at the same instant are processed together and rates
  are recomputed once per instant.
* A flow completes when its last byte has drained plus ``steps`` x its route latency (+ ``launch_overhead`` per
  coflow); a coflow completes when all its flows have.
* A :class:`~flowlane.sim.graph.PhasedAllToAll` (Hermod's incast-free phases) starts its flows one by one: each as
  soon as the flows it waits for (its two ranks' previous phase) have completed, each paying ``launch_overhead``
  like a coflow of its own; the node completes with its last flow. Its coflow record spans the whole all-to-all.
  Where :class:`SimConfig` charges the runtime's costs (issue 30), its ranks first plan it (``plan_time``, or
  ``plan_hit_time`` on a hit in the group's LRU plan cache) and then issue one phase after another
  (``phase_issue_time`` each): a flow starts once its waits are met and both its ranks have issued its phase.
"""

from __future__ import annotations

import bisect
import heapq
import math
import time
from collections import OrderedDict, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from flowlane.policy import FifoPolicy, SchedulingPolicy
from flowlane.sim.graph import Coflow, ComputeTask, PhasedAllToAll, SimSpecError, Workload
from flowlane.sim.network import SHARING, IncastModel, allocate
from flowlane.topology import Topology, TopologyError

ROUTING = ("ecmp", "spray", "first")


def _last_finish(t: float, ttf: np.ndarray, win: float, tf: float) -> float:
    """The latest finish time ``t + ttf[k]`` within the window ending at ``win``, given the earliest, ``tf = t +
    min(ttf) <= win``. In floating point ``t + x <= win`` does not imply ``x <= win - t``: where rounding leaves no
    ``ttf`` under ``win - t``, the earliest finish is the window's only one."""
    inside = ttf[ttf <= win - t]
    return t + float(inside.max()) if inside.size else tf


@dataclass(frozen=True)
class SimConfig:
    """Simulator knobs. ``routing``: ecmp (hash each flow onto one of the equal-cost routes), spray (split every
    flow evenly over all of them) or first (always the first route). ``sharing``: strict or weighted priority
    across classes. ``compute_jitter``: relative std-dev of compute durations (seeded, 0 = deterministic)."""

    routing: str = "ecmp"
    sharing: str = "strict"
    weight_ratio: float = 0.5
    incast: IncastModel | None = None
    launch_overhead: float = 0.0
    compute_jitter: float = 0.0
    seed: int = 0
    # batch events within this window (s); 0 = exact. Each event may be delayed by < quantum, and the delays add up
    # along chains of dependent short flows (a phased all-to-all's ~180 steps), so keep it well below a step's length
    time_quantum: float = 0.0
    progress: bool = False
    # What Hermod's matched all-to-all costs on the runtime (issue 30), charged to PhasedAllToAll nodes only (plain,
    # matched-fluid and other coflows never plan or issue phases); all 0 = free, the figures before these existed.
    # plan_time: host seconds to plan one phased all-to-all on a plan-cache miss (every rank of the group plans the
    # same matrix at once, flowlane.hermod.matching.plan_all_to_all), so its first phases start this much later
    plan_time: float = 0.0
    plan_hit_time: float = 0.0  # host seconds for a plan-cache hit instead
    # plans each rank keeps (LRU keyed by algorithm + matrix, PhasedAllToAll.plan_key; the runtime's default is 16,
    # FLOWLANE_HERMOD_PLAN_CACHE); 0 = no cache, every phased all-to-all pays plan_time
    plan_cache_entries: int = 0
    # host seconds to issue one phase's grouped send/receive on a rank (matched_all_to_all issues its phases one after
    # another and does not wait on the host): a rank's k-th phase (1-based, counting the phases it takes part in) can
    # start no earlier than k x this after its plan is ready; the flow also waits for its peer's issue
    phase_issue_time: float = 0.0

    def __post_init__(self) -> None:
        if self.routing not in ROUTING:
            raise SimSpecError(f"SimConfig.routing {self.routing!r} is not one of {ROUTING}")
        if self.sharing not in SHARING:
            raise SimSpecError(f"SimConfig.sharing {self.sharing!r} is not one of {SHARING}")
        if not (0 < self.weight_ratio <= 1):
            raise SimSpecError(f"SimConfig.weight_ratio must be in (0, 1], got {self.weight_ratio!r}")
        if not (self.launch_overhead >= 0 and math.isfinite(self.launch_overhead)):
            raise SimSpecError(
                f"SimConfig.launch_overhead must be a finite number >= 0 s, got {self.launch_overhead!r}"
            )
        if not (self.time_quantum >= 0 and math.isfinite(self.time_quantum)):
            raise SimSpecError(
                f"SimConfig.time_quantum must be a finite number >= 0 s, got {self.time_quantum!r}"
            )
        if not (0 <= self.compute_jitter < 1):
            raise SimSpecError(f"SimConfig.compute_jitter must be in [0, 1), got {self.compute_jitter!r}")
        for name in ("plan_time", "plan_hit_time", "phase_issue_time"):
            v = getattr(self, name)
            if not (isinstance(v, int | float) and v >= 0 and math.isfinite(v)):
                raise SimSpecError(f"SimConfig.{name} must be a finite number >= 0 s, got {v!r}")
        if not (isinstance(self.plan_cache_entries, int) and self.plan_cache_entries >= 0):
            raise SimSpecError(
                f"SimConfig.plan_cache_entries must be an integer >= 0, got {self.plan_cache_entries!r}"
            )


@dataclass
class SimResult:
    workload: str
    policy: str
    makespan: float
    iteration_ends: list[float]
    coflow_nodes: np.ndarray
    coflow_ready: np.ndarray
    coflow_start: np.ndarray
    coflow_end: np.ndarray
    coflow_bytes: np.ndarray
    compute_nodes: np.ndarray
    compute_start: np.ndarray
    compute_end: np.ndarray
    link_names: list[str]
    link_capacity: np.ndarray
    link_bytes: np.ndarray  # offered: sum over flows of bytes x links on their routes
    # integrated: sum over time of rate x dt (equals link_bytes: byte conservation)
    link_bytes_moved: np.ndarray
    num_flows: int
    events: int
    rate_updates: int
    wall_s: float
    cpu_s: (
        float  # process CPU time of run() (robust to other load on the machine; the sim is single-threaded)
    )
    workload_ref: Workload = field(repr=False)
    plan_hits: int = 0  # phased all-to-alls planned from the plan cache (SimConfig.plan_cache_entries)
    plan_misses: int = 0  # ... and planned afresh (counted only where planning is charged)

    @property
    def iteration_time(self) -> float:
        """Steady-state iteration time: the gap between the last two iteration ends (one iteration: makespan)."""
        e = self.iteration_ends
        return e[-1] - e[-2] if len(e) >= 2 else (e[-1] if e else self.makespan)

    @property
    def link_utilisation(self) -> np.ndarray:
        """Mean utilisation of each link over the makespan (bytes carried / (capacity * makespan))."""
        return self.link_bytes_moved / (self.link_capacity * max(self.makespan, 1e-30))

    def cct_by_ctype(self) -> dict[str, dict[str, float]]:
        out: dict[str, dict[str, float]] = {}
        nodes = self.workload_ref.nodes
        ct = (
            np.array([nodes[i].meta.ctype for i in self.coflow_nodes])
            if len(self.coflow_nodes)
            else np.array([])
        )
        cct = self.coflow_end - self.coflow_start
        for c in sorted(set(ct.tolist())):
            sel = cct[ct == c]
            out[c] = {
                "count": int(sel.size),
                "mean_s": float(sel.mean()),
                "max_s": float(sel.max()),
                "total_bytes": float(self.coflow_bytes[ct == c].sum()),
            }
        return out


@dataclass(slots=True)
class _PhasedRun:
    """A running :class:`PhasedAllToAll`: flows not yet completed, unmet waits per flow, and who waits on whom."""

    left: int
    waits: np.ndarray  # flow -> predecessors not yet completed
    succ_ptr: np.ndarray  # CSR: flow f's successors are succ_idx[succ_ptr[f]:succ_ptr[f + 1]]
    succ_idx: np.ndarray
    # flow -> earliest start (plan and issue costs), None = as soon as ready
    earliest: np.ndarray | None = None
    # every flow routed once at the start (hops, latency), so starting a few flows is indexing; None = route per start
    hops: np.ndarray | None = None
    lat: np.ndarray | None = None


def issue_ordinals(x: PhasedAllToAll) -> np.ndarray:
    """Per phase flow: the later of its two ranks' issue slots, where a rank's slot for phase k is the number of
    phases up to and including k in which it sends or receives (1-based): the runtime's ranks issue one grouped
    send/receive per phase they take part in, in phase order (flowlane.sched.alltoall.matched_all_to_all)."""
    if len(x.src) == 0:
        return np.zeros(0, np.int64)
    span = int(x.phase.max()) + 1
    ph = x.phase.astype(np.int64)
    ks, kd = x.src * span + ph, x.dst * span + ph
    u = np.unique(np.concatenate([ks, kd]))  # (device, phase) pairs, sorted by device then phase
    dev = u // span
    slot = np.arange(len(u)) - np.searchsorted(dev, dev, side="left") + 1
    return np.maximum(slot[np.searchsorted(u, ks)], slot[np.searchsorted(u, kd)])


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser: a deterministic hash for ECMP (independent of PYTHONHASHSEED)."""
    x = x.astype(np.uint64)
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        x = x ^ (x >> np.uint64(31))
    return x


class Simulator:
    """Runs a :class:`Workload` over a :class:`Topology` under a :class:`SchedulingPolicy`."""

    def __init__(self, topology: Topology, config: SimConfig | None = None) -> None:
        self.topo = topology
        self.cfg = config or SimConfig()
        self.link_keys = list(topology.links)
        self.link_index = {k: i for i, k in enumerate(self.link_keys)}
        self.capacity = np.array([topology.links[k].bandwidth for k in self.link_keys])
        self.latency = np.array([topology.links[k].latency for k in self.link_keys])
        inc = self.cfg.incast
        self.incast_links = None
        if inc is not None:
            self.incast_links = np.array(
                [
                    topology.links[k].kind in inc.kinds and topology.devices[k[0]].kind == "switch"
                    for k in self.link_keys
                ],
                dtype=np.int64,
            )

    # -- routes ---------------------------------------------------------------------------------------------
    def _route_table(
        self, w: Workload
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, int]:
        """Unique (src, dst) pairs -> rows of a padded link-index matrix (all ECMP routes of each pair)."""
        nd = len(w.devices)
        codes = [c.src * nd + c.dst for c in w.coflows if len(c.src)]
        pairs = np.unique(np.concatenate(codes)) if codes else np.zeros(0, np.int64)
        rows: list[list[int]] = []
        lat: list[float] = []
        first = np.zeros(len(pairs), np.int64)
        count = np.zeros(len(pairs), np.int64)
        for k, code in enumerate(pairs.tolist()):
            s, d = w.devices[code // nd], w.devices[code % nd]
            try:
                rs = self.topo.routes(s, d)
            except TopologyError as e:
                raise SimSpecError(f"cannot route flow {s!r} -> {d!r}: {e}") from None
            first[k] = len(rows)
            count[k] = len(rs)
            for rt in rs:
                rows.append([self.link_index[(lk.src, lk.dst)] for lk in rt.links])
                lat.append(rt.latency)
        hmax = max((len(r) for r in rows), default=1)
        pad = len(self.link_keys)
        table = np.full((max(len(rows), 1), hmax), pad, dtype=np.intp)
        for i, r in enumerate(rows):
            table[i, : len(r)] = r
        return pairs, first, count, table, np.array(lat + [0.0]), hmax

    def _path_row(self, path: tuple[str, ...], hmax: int) -> tuple[np.ndarray, float]:
        if len(path) < 2 or len(path) - 1 > hmax:
            raise SimSpecError(f"explicit path {path!r} must have 2..{hmax + 1} devices")
        idx = []
        for a, b in zip(path[:-1], path[1:], strict=True):
            if (a, b) not in self.link_index:
                raise SimSpecError(f"explicit path {path!r}: no link {a}->{b}")
            idx.append(self.link_index[(a, b)])
        row = np.full(hmax, len(self.link_keys), dtype=np.intp)
        row[: len(idx)] = idx
        return row, float(self.latency[idx].sum())

    # -- main loop ------------------------------------------------------------------------------------------
    def run(
        self,
        w: Workload,
        policy: SchedulingPolicy | None = None,
        on_progress: Callable[[int, int], None] | None = None,
    ) -> SimResult:
        """Simulate ``w`` under ``policy`` (default FIFO) until every node has completed."""
        policy = policy or FifoPolicy()
        t_wall = time.perf_counter()
        t_cpu = time.process_time()
        for d in w.devices:
            if d not in self.topo.devices:
                raise SimSpecError(f"workload device {d!r} is not in topology {self.topo.name!r}")
        _check_policy_fits(policy, w)
        loop = _EventLoop(self, w, policy)
        loop.run(on_progress)
        return loop.result(time.perf_counter() - t_wall, time.process_time() - t_cpu)


def _check_policy_fits(policy: SchedulingPolicy, w: Workload) -> None:
    """A Hermod policy's order depends on the pipeline schedule (CType ranks) and on M (the DP coflows' MID): refuse
    one built for another schedule or M than the workload's (``Workload.info``, set by the LLM builder)."""
    from flowlane.hermod.order import HermodOrder

    order = getattr(policy, "hermod_order", None)
    if not isinstance(order, HermodOrder):
        return
    cfg, sched, m = order.config, w.info.get("schedule"), w.info.get("microbatches")
    fix = (
        f"build it with flowlane.policies.make_policy({policy.name!r}, schedule={sched or '1f1b'!r}, "
        f"num_microbatches={m!r})"
    )
    if sched is not None and cfg.schedule != sched:
        raise SimSpecError(
            f"policy {policy.name!r} orders coflows for the {cfg.schedule!r} pipeline schedule but workload "
            f"{w.name!r} runs {sched!r}: {fix}"
        )
    if m is not None and cfg.num_microbatches is not None and cfg.num_microbatches != m:
        raise SimSpecError(
            f"policy {policy.name!r} orders coflows for {cfg.num_microbatches} microbatches but workload {w.name!r} "
            f"runs {m}: {fix}"
        )


class _ActiveFlows:
    """The flows on the wire, as a structure of arrays (one row per flow): route (link indices, padded), bytes left,
    rate, priority class, the unit it completes (a coflow node or one phase flow), its matched-coflow id for the
    incast model (-1: none) and the latency paid after its last byte. Flows started since the last rate update wait
    in ``new`` until :meth:`admit`."""

    __slots__ = ("h", "rem", "rate", "cls", "unit", "grp", "lat", "new")

    def __init__(self, hmax: int) -> None:
        self.h = np.zeros((0, hmax), np.intp)
        self.rem = np.zeros(0)
        self.rate = np.zeros(0)
        self.cls = np.zeros(0, np.int64)
        self.unit = np.zeros(0, np.int64)
        self.grp = np.zeros(0, np.int64)
        self.lat = np.zeros(0)
        self.new: tuple[list[np.ndarray], ...] = ([], [], [], [], [], [])  # h, rem, cls, unit, grp, lat

    def add(
        self,
        h: np.ndarray,
        nb: np.ndarray,
        cls: np.ndarray,
        unit: np.ndarray,
        grp: np.ndarray,
        lat: np.ndarray,
    ) -> None:
        for lst, x in zip(self.new, (h, nb, cls, unit, grp, lat), strict=True):
            lst.append(x)

    def admit(self) -> bool:
        """Move the started flows onto the wire; True if there were any (the rates must be recomputed)."""
        nh, nrem, ncls, nunit, ngrp, nlat = self.new
        if not nh:
            return False
        self.h = np.concatenate([self.h, *nh])
        self.rem = np.concatenate([self.rem, *nrem])
        self.cls = np.concatenate([self.cls, *ncls])
        self.unit = np.concatenate([self.unit, *nunit])
        self.grp = np.concatenate([self.grp, *ngrp])
        self.lat = np.concatenate([self.lat, *nlat])
        for lst in self.new:
            lst.clear()
        return True

    def keep(self, keep: np.ndarray) -> None:
        """Drop the finished flows (``keep`` False); their rates go with the next rate update."""
        self.h, self.rem, self.cls, self.unit, self.lat = (
            self.h[keep],
            self.rem[keep],
            self.cls[keep],
            self.unit[keep],
            self.lat[keep],
        )
        self.grp = self.grp[keep]


class _EventLoop:
    """One run of :meth:`Simulator.run`: the DAG's static data (successors, classes, stream order, compute
    durations), its state (node times, executor and stream queues, the completion heap, bytes per link), the active
    flows (:class:`_ActiveFlows`), running phased all-to-alls and the plan caches; :meth:`run` advances time from
    one batch of events to the next (module docstring)."""

    # route a phased all-to-all's flows once when it starts (False: per start, the reference the tests compare with)
    route_phases_once = True

    def __init__(self, sim: Simulator, w: Workload, policy: SchedulingPolicy) -> None:
        cfg = self.cfg = sim.cfg
        self.w = w
        self.policy = policy
        self.capacity = sim.capacity
        self.incast_links = sim.incast_links
        self.link_keys = sim.link_keys
        self.path_row = sim._path_row
        # a node's kind is checked where it matters (isinstance), not typed per use
        nodes: list[Any] = w.nodes
        self.nodes = nodes
        n = self.n = len(nodes)
        self.pairs, self.rfirst, self.rcount, self.table, self.rlat, self.hmax = sim._route_table(w)
        self.nd = len(w.devices)
        pad = self.pad = len(sim.link_keys)

        # static per-node data
        succ: list[list[int]] = [[] for _ in range(n)]
        for i, ds in enumerate(w.deps):
            for d in ds:
                succ[d].append(i)
        self.succ = succ
        self.indeg = [len(ds) for ds in w.deps]
        cof_ids = self.cof_ids = [i for i, x in enumerate(nodes) if isinstance(x, Coflow | PhasedAllToAll)]
        # A phased all-to-all's flows complete one by one: flow f of node i is unit vbase[i] + f (ids >= n), so
        # pending / last_arrival / the heap treat it like a coflow of its own
        vbase: dict[int, int] = {}
        n_units = n
        for i in cof_ids:
            if isinstance(nodes[i], PhasedAllToAll):
                vbase[i] = n_units
                n_units += len(nodes[i].src)
        self.vbase = vbase
        self.v_first = np.array(list(vbase.values()), np.int64)
        # bisect on a list: one flow's lookup without numpy overhead
        self.v_first_list = self.v_first.tolist()
        self.v_node = np.array(list(vbase.keys()), np.int64)
        self.running: dict[int, _PhasedRun] = {}
        # policy keys -> dense ranks (class for the network, order for the streams), computed once: the DAG is fixed
        prio = {i: policy.priority(nodes[i].meta) for i in cof_ids}
        order = {i: policy.order(nodes[i].meta) for i in cof_ids}
        try:
            cls_rank = {k: r for r, k in enumerate(sorted(set(prio.values())))}
            ord_sorted = sorted(cof_ids, key=lambda i: order[i])
        except TypeError as e:
            raise SimSpecError(f"policy {policy.name!r} returned keys that cannot be compared: {e}") from None
        self.node_cls = {i: cls_rank[prio[i]] for i in cof_ids}
        self.node_ord = {i: r for r, i in enumerate(ord_sorted)}
        durations: dict[int, float] = {}
        self.durations = durations
        rng = np.random.default_rng(cfg.seed)
        comp_ids = self.comp_ids = [i for i, x in enumerate(nodes) if isinstance(x, ComputeTask)]
        jit = (1 + cfg.compute_jitter * rng.standard_normal(len(comp_ids))) if cfg.compute_jitter else None
        for k, i in enumerate(comp_ids):
            durations[i] = nodes[i].duration * (max(0.0, jit[k]) if jit is not None else 1.0)

        # state
        self.start_t = np.full(n, np.nan)
        self.end_t = np.full(n, np.nan)
        self.ready_t = np.full(n, np.nan)
        self.heap: list[tuple[float, int]] = []  # (time, node) completions of compute tasks and coflows
        self.exec_busy: dict[str, bool] = defaultdict(bool)
        self.exec_q: dict[str, list[tuple[int, int]]] = defaultdict(list)
        self.stream_busy: dict[str, bool] = defaultdict(bool)
        self.stream_q: dict[str, list[tuple[int, int]]] = defaultdict(list)
        self.pending = np.zeros(n_units, np.int64)
        self.last_arrival = np.zeros(n_units)
        self.link_bytes = np.zeros(pad + 1)
        self.moved = np.zeros(pad + 1)
        self.flows = _ActiveFlows(self.hmax)
        self.events = self.rate_updates = self.num_flows = self.done = 0
        # planning and issue costs (SimConfig.plan_*, phase_issue_time): each group's plan cache, and phase flows
        # whose waits are met but whose issue lies ahead (heap entry -1 - id -> (node, flows))
        self.charge = cfg.plan_time > 0 or cfg.plan_hit_time > 0 or cfg.phase_issue_time > 0
        self.plan_lru: dict[tuple[int, ...], OrderedDict[bytes, None]] = {}
        self.plan_hits = self.plan_misses = 0
        self.deferred: dict[int, tuple[int, np.ndarray]] = {}
        self.n_deferred = 0

    # -- flows ------------------------------------------------------------------------------------------------
    def route(
        self,
        unit: np.ndarray,
        src: np.ndarray,
        dst: np.ndarray,
        nb: np.ndarray,
        hkey: np.ndarray,
        steps: int,
        spray: bool,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Route flows: spread over every equal-cost route (spray), or one route each (an ECMP hash of ``hkey``,
        or the first). Flow k completes unit ``unit[k]`` (a coflow node or one phase flow). Returns the routed
        flows' (hops, bytes, latency, unit)."""
        cfg = self.cfg
        code = src * self.nd + dst
        p = np.searchsorted(self.pairs, code)
        cnt = self.rcount[p]
        if spray:
            base = np.repeat(self.rfirst[p], cnt)
            off = np.arange(cnt.sum()) - np.repeat(np.cumsum(cnt) - cnt, cnt)
            rows = base + off
            nb = np.repeat(nb / cnt, cnt)
            unit = np.repeat(unit, cnt)
        else:
            if cfg.routing != "first":
                hsh = _mix(hkey + np.uint64(cfg.seed) * np.uint64(104_729) + code.astype(np.uint64))
                sel = (hsh % cnt.astype(np.uint64)).astype(np.int64)
            else:
                sel = np.zeros(len(code), np.int64)
            rows = self.rfirst[p] + sel
        return (
            self.table[rows],
            np.asarray(nb, np.float64),
            self.rlat[rows] * steps + cfg.launch_overhead,
            unit,
        )

    def activate(
        self, unit: np.ndarray, h: np.ndarray, nb: np.ndarray, lat: np.ndarray, cls: int, grp: int, now: float
    ) -> None:
        np.add.at(self.pending, unit, 1)
        self.last_arrival[unit] = now
        # offered bytes per link (routes x sizes)
        np.add.at(self.link_bytes, h.ravel(), np.repeat(nb, self.hmax))
        self.flows.add(h, nb, np.full(len(nb), cls, np.int64), unit, np.full(len(nb), grp, np.int64), lat)
        self.num_flows += len(nb)

    def start_coflow(self, i: int, now: float) -> None:
        c: Coflow = self.nodes[i]
        cfg = self.cfg
        self.start_t[i] = now
        if len(c.src) == 0:
            heapq.heappush(self.heap, (now + cfg.launch_overhead, i))
            return
        k = len(c.src)
        hkey = np.uint64(i) * np.uint64(1_000_003) + np.arange(k, dtype=np.uint64) * np.uint64(7919)
        h, nb, lat, unit = self.route(
            np.full(k, i, np.int64),
            c.src,
            c.dst,
            c.nbytes,
            hkey,
            c.steps,
            cfg.routing == "spray" and not c.paths,
        )
        if c.paths:
            # explicit multi-path: replace the listed flows by sub-flows on the given device paths
            devices, hmax = self.w.devices, self.hmax
            keep = np.ones(len(nb), bool)
            xs_h, xs_nb, xs_lat = [], [], []
            for fi, splits in c.paths.items():
                if not 0 <= fi < len(c.src):
                    raise SimSpecError(f"coflow {c.name!r}: paths refers to flow {fi}, which does not exist")
                for _, frac in splits:
                    if not (
                        isinstance(frac, int | float | np.integer | np.floating) and 0 <= frac < math.inf
                    ):
                        raise SimSpecError(
                            f"coflow {c.name!r}: flow {fi} path fraction must be a finite number >= 0, got {frac!r}"
                        )
                tot = sum(f for _, f in splits)
                if not splits or tot <= 0:
                    raise SimSpecError(f"coflow {c.name!r}: flow {fi} path fractions must sum to > 0")
                keep[fi] = False
                for path, frac in splits:
                    if path[0] != devices[c.src[fi]] or path[-1] != devices[c.dst[fi]]:
                        raise SimSpecError(
                            f"coflow {c.name!r}: path {path!r} does not join the ends of flow {fi}"
                        )
                    row, plat = self.path_row(tuple(path), hmax)
                    xs_h.append(row)
                    xs_nb.append(c.nbytes[fi] * frac / tot)
                    xs_lat.append(plat * c.steps + cfg.launch_overhead)
            h = np.concatenate([h[keep], np.array(xs_h, np.intp).reshape(-1, hmax)])
            nb = np.concatenate([nb[keep], xs_nb])
            lat = np.concatenate([lat[keep], xs_lat])
            unit = np.full(len(nb), i, np.int64)
        self.activate(unit, h, nb, lat, self.node_cls[i], i if c.matched else -1, now)

    # -- phased all-to-alls -------------------------------------------------------------------------------------
    def start_phase_flows(self, i: int, fs: np.ndarray, now: float) -> None:
        st = self.running[i]
        v = self.vbase[i] + fs
        if st.hops is not None and st.lat is not None:  # both set together at start_phased
            # the per-start route() below, precomputed element for element at start_phased (identical values)
            x: PhasedAllToAll = self.nodes[i]
            self.activate(v, st.hops[fs], x.nbytes[fs], st.lat[fs], self.node_cls[i], -1, now)
            return
        x = self.nodes[i]
        h, nb, lat, unit = self.route(
            v,
            x.src[fs],
            x.dst[fs],
            x.nbytes[fs],
            v.astype(np.uint64) * np.uint64(1_000_003),
            1,
            self.cfg.routing == "spray",
        )
        self.activate(unit, h, nb, lat, self.node_cls[i], -1, now)

    def plan_cost(self, x: PhasedAllToAll) -> float:
        """Host time to plan ``x`` (SimConfig.plan_time / plan_hit_time), looking its plan up in its group's LRU plan
        cache (as flowlane.hermod.matching.plan_all_to_all does) where one is kept."""
        cfg = self.cfg
        if cfg.plan_cache_entries and x.plan_key:
            lru = self.plan_lru.setdefault(x.group, OrderedDict())
            if x.plan_key in lru:
                lru.move_to_end(x.plan_key)
                self.plan_hits += 1
                return cfg.plan_hit_time
            lru[x.plan_key] = None
            if len(lru) > cfg.plan_cache_entries:
                lru.popitem(last=False)
        self.plan_misses += 1
        return cfg.plan_time

    def launch_phase_flows(self, i: int, fs: np.ndarray, now: float) -> None:
        """Start flows ``fs`` of phased node ``i`` whose waits are met: now, or once their ranks have issued them."""
        e = self.running[i].earliest
        if e is not None and len(fs):
            ef = e[fs]
            late = ef > now
            if late.any():
                for tt in np.unique(ef[late]).tolist():
                    key = self.n_deferred
                    self.n_deferred += 1
                    self.deferred[key] = (i, fs[late & (ef == tt)])
                    heapq.heappush(self.heap, (tt, -1 - key))
                fs = fs[~late]
        if len(fs):
            self.start_phase_flows(i, fs, now)

    def start_phased(self, i: int, now: float) -> bool:
        """Start a phased all-to-all's first flows; False if it has none (it completes at once)."""
        x: PhasedAllToAll = self.nodes[i]
        self.start_t[i] = now
        nf = len(x.src)
        if nf == 0:
            return False
        waits = np.diff(x.pred_ptr).astype(np.int32)
        order = np.argsort(x.pred_idx, kind="stable")  # successor CSR: who waits on flow f
        succ_idx = np.repeat(np.arange(nf, dtype=np.int32), waits)[order]
        succ_ptr = np.searchsorted(x.pred_idx[order], np.arange(nf + 1))
        earliest = None
        if self.charge:
            earliest = now + self.plan_cost(x) + issue_ordinals(x) * self.cfg.phase_issue_time
        run = self.running[i] = _PhasedRun(nf, waits, succ_ptr, succ_idx, earliest)
        if self.route_phases_once and self.cfg.routing != "spray":
            # profiled at Qwen-MoE-24L scale: route() per started flow (1-2 flows a call, ~0.1 ms of numpy overhead)
            # was a fifth of the run; its ECMP hash depends only on the flow's unit id, so route all flows now
            fs = np.arange(nf)
            v = self.vbase[i] + fs
            run.hops, _, run.lat, _ = self.route(
                v, x.src, x.dst, x.nbytes, v.astype(np.uint64) * np.uint64(1_000_003), 1, False
            )
        self.launch_phase_flows(i, np.flatnonzero(waits == 0), now)
        return True

    def finish_phase_flow(self, u: int, now: float, work: list[int]) -> None:
        i = int(self.v_node[bisect.bisect_right(self.v_first_list, u) - 1])
        st = self.running[i]
        f = u - self.vbase[i]
        nxt = st.succ_idx[st.succ_ptr[f] : st.succ_ptr[f + 1]]
        if len(nxt):
            st.waits[nxt] -= 1
            go = nxt[st.waits[nxt] == 0]
            if len(go):
                self.launch_phase_flows(i, go, now)
        st.left -= 1
        if st.left == 0:
            del self.running[i]
            work.append(i)

    # -- the DAG ------------------------------------------------------------------------------------------------
    def start_compute(self, i: int, now: float) -> None:
        self.start_t[i] = now
        self.exec_busy[self.nodes[i].executor] = True
        heapq.heappush(self.heap, (now + self.durations[i], i))

    def release(self, i: int, now: float, work: list[int]) -> None:
        """Node ``i``'s dependencies have completed: start it, queue it, or (a join) complete it."""
        x = self.nodes[i]
        self.ready_t[i] = now
        if x is None:
            self.start_t[i] = now
            work.append(i)
        elif isinstance(x, PhasedAllToAll):
            if not self.start_phased(i, now):
                work.append(i)
        elif isinstance(x, ComputeTask):
            if self.exec_busy[x.executor]:
                heapq.heappush(self.exec_q[x.executor], (i, i))
            else:
                self.start_compute(i, now)
        elif x.stream is None:
            self.start_coflow(i, now)
        elif self.stream_busy[x.stream]:
            heapq.heappush(self.stream_q[x.stream], (self.node_ord[i], i))
        else:
            self.stream_busy[x.stream] = True
            self.start_coflow(i, now)

    def complete(self, i: int, now: float) -> None:
        """Heap entry ``i`` is due: a node (or one phase flow) completes, or deferred phase flows start (``i`` < 0)."""
        if i < 0:  # not a completion: deferred phase flows whose ranks have now issued them
            j, fs = self.deferred.pop(-1 - i)
            self.start_phase_flows(j, fs, now)
            return
        work: list[int] = []
        if i >= self.n:  # one phase flow; its node completes with its last one
            self.finish_phase_flow(i, now, work)
        else:
            work.append(i)
        nodes, succ, indeg, end_t = self.nodes, self.succ, self.indeg, self.end_t
        while work:
            j = work.pop()
            end_t[j] = now
            self.done += 1
            self.events += 1
            x = nodes[j]
            if isinstance(x, ComputeTask):
                q = self.exec_q[x.executor]
                if q:
                    self.start_compute(heapq.heappop(q)[1], now)
                else:
                    self.exec_busy[x.executor] = False
            elif isinstance(x, Coflow) and x.stream is not None:
                q = self.stream_q[x.stream]
                if q:
                    self.start_coflow(heapq.heappop(q)[1], now)
                else:
                    self.stream_busy[x.stream] = False
            for s in succ[j]:
                indeg[s] -= 1
                if indeg[s] == 0:
                    self.release(s, now, work)

    # -- time ---------------------------------------------------------------------------------------------------
    def run(self, on_progress: Callable[[int, int], None] | None) -> None:
        """Release the roots, then advance from one batch of events to the next until nothing is left."""
        cfg, heap, fl, n, pad, hmax = self.cfg, self.heap, self.flows, self.n, self.pad, self.hmax
        roots: list[int] = []
        for i in range(n):
            if self.indeg[i] == 0:
                self.release(i, 0.0, roots)
        for r in roots:
            self.complete(r, 0.0)

        pending, last_arrival, moved = self.pending, self.last_arrival, self.moved
        t = 0.0
        tick = 0
        flows_left_changed = False
        q = cfg.time_quantum
        batch: list[int] = []
        load: np.ndarray = np.zeros(pad + 1)
        t_load = 0.0
        while True:
            # admit newly started flows and recompute rates once for this instant
            if fl.admit() or flows_left_changed:
                moved += load * (t - t_load)  # integrate the previous rates: bytes actually carried per link
                t_load = t
                fl.rate = allocate(
                    fl.h,
                    fl.cls,
                    self.capacity,
                    cfg.sharing,
                    cfg.weight_ratio,
                    cfg.incast,
                    self.incast_links,
                    fl.grp,
                )
                self.rate_updates += 1
                load = np.bincount(fl.h.ravel(), weights=np.repeat(fl.rate, hmax), minlength=pad + 1)
            flows_left_changed = False
            tf = math.inf
            if fl.rem.size:
                pos = fl.rate > 0
                if pos.any():
                    ttf = fl.rem[pos] / fl.rate[pos]
                    tf = t + float(ttf.min())
            th = heap[0][0] if heap else math.inf
            t_next = min(tf, th)
            if t_next == math.inf:
                break
            if math.isnan(tf) or math.isnan(th):  # a NaN time would never reach an event: fail, do not spin
                raise SimSpecError(
                    f"simulation time became NaN at t={t!r} s (a flow's bytes or rate, or an event time, is NaN)"
                )
            # batch every event that falls within [t_next, t_next + q]: fewer rate updates, error < q
            if q > 0:
                win = t_next + q
                cand = [t_next]
                if tf <= win:
                    cand.append(_last_finish(t, ttf, win, tf))
                while heap and heap[0][0] <= win:
                    e, i = heapq.heappop(heap)
                    batch.append(i)
                    cand.append(e)
                t_next = max(cand)
            dt = t_next - t
            t = t_next
            eps_t = 1e-9 * max(t, 1e-6)
            if fl.rem.size:
                fl.rem = fl.rem - fl.rate * dt
                fin = fl.rem <= fl.rate * eps_t + 1e-6
                if fin.any():
                    over = -fl.rem[fin]
                    if q > 0 and (over > 0).any():
                        # a flow that finished inside the batching window carried what it had left, not rate x dt:
                        # take back what `load` integrates past its finish (min(left, rate x dt) per flow)
                        moved -= np.bincount(
                            fl.h[fin].ravel(),
                            weights=np.repeat(np.maximum(over, 0.0), hmax),
                            minlength=pad + 1,
                        )
                    cof_f = fl.unit[fin]
                    arr = t + fl.lat[fin]
                    u, inv, cnt = np.unique(cof_f, return_inverse=True, return_counts=True)
                    mx = np.full(len(u), -np.inf)
                    np.maximum.at(mx, inv, arr)
                    self.events += int(fin.sum())
                    for c, k, m in zip(u.tolist(), cnt.tolist(), mx.tolist(), strict=True):
                        pending[c] -= k
                        if m > last_arrival[c]:
                            last_arrival[c] = m
                        if pending[c] == 0:
                            heapq.heappush(heap, (last_arrival[c], c))
                    fl.keep(~fin)
                    flows_left_changed = True
            for i in batch:
                self.complete(i, t)
            batch.clear()
            while heap and heap[0][0] <= t + eps_t:
                _, i = heapq.heappop(heap)
                self.complete(i, t)
            tick += 1
            if on_progress is not None and tick % 200 == 0:
                on_progress(self.done, n)
        moved += load * (t - t_load)
        if on_progress is not None:
            on_progress(self.done, n)
        if self.done < n:
            stuck = [i for i in range(n) if np.isnan(self.end_t[i])][:5]
            raise SimSpecError(
                f"simulation stalled with {n - self.done} unfinished nodes, e.g. {stuck}: "
                f"a flow has no bandwidth or a dependency is never met"
            )

    def result(self, wall_s: float, cpu_s: float) -> SimResult:
        w, n, nodes = self.w, self.n, self.nodes
        cof = np.array(self.cof_ids, np.int64)
        comp = np.array(self.comp_ids, np.int64)
        start_t, end_t = self.start_t, self.end_t
        ends = [float(end_t[i]) for i in w.info.get("iteration_end", [])]
        return SimResult(
            workload=w.name,
            policy=self.policy.name,
            makespan=float(np.nanmax(end_t)) if n else 0.0,
            iteration_ends=ends,
            coflow_nodes=cof,
            coflow_ready=self.ready_t[cof],
            coflow_start=start_t[cof],
            coflow_end=end_t[cof],
            coflow_bytes=np.array([nodes[i].total_bytes for i in self.cof_ids]),
            compute_nodes=comp,
            compute_start=start_t[comp],
            compute_end=end_t[comp],
            link_names=[f"{a}->{b}" for a, b in self.link_keys],
            link_capacity=self.capacity,
            link_bytes=self.link_bytes[:-1].copy(),
            link_bytes_moved=self.moved[:-1].copy(),
            num_flows=self.num_flows,
            events=self.events,
            rate_updates=self.rate_updates,
            wall_s=wall_s,
            cpu_s=cpu_s,
            workload_ref=w,
            plan_hits=self.plan_hits,
            plan_misses=self.plan_misses,
        )
