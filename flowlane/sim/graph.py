"""The workload DAG: compute tasks on executors and communication coflows made of flows between devices.

A *coflow* is one communication operation (a collective, a p2p send, an all-to-all) with its flows stored as
arrays (source device, destination device, bytes), so that builders for thousands of GPUs stay cheap. Each coflow
carries a :class:`flowlane.policy.CoflowMeta` for scheduling policies and may name a *stream*: coflows on the same
stream run one at a time (one NCCL communicator / CUDA stream), the next one chosen by the policy's order key.
Compute tasks run one at a time per *executor* (a GPU, or a TP group that computes in lockstep).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from flowlane.policy import CTYPES, CoflowMeta


class SimSpecError(ValueError):
    """A workload, simulator or model specification that cannot be simulated; the message names the bad value."""


@dataclass(slots=True)
class ComputeTask:
    executor: str
    duration: float
    name: str
    cat: str = "compute"


@dataclass(slots=True)
class Coflow:
    src: np.ndarray  # int device indices (Workload.devices)
    dst: np.ndarray
    nbytes: np.ndarray  # float64 bytes per flow
    meta: CoflowMeta
    name: str
    stream: str | None = None
    steps: int = 1  # sequential algorithm steps: each adds one route latency (ring all-reduce: 2(n-1))
    # flow index (into src/dst/nbytes) -> [(device path, fraction)]
    paths: dict[int, list[tuple[tuple[str, ...], float]]] | None = None
    # incast-free (Hermod's matching all-to-all): one flow per link for the incast model
    matched: bool = False

    @property
    def total_bytes(self) -> float:
        return float(self.nbytes.sum())


@dataclass(slots=True)
class PhasedAllToAll:
    """An all-to-all sent as incast-free phases (Hermod's intra-coflow schedule, seed 000 §5.3.2), held as one node
    however many phases it has: flow ``f`` (plan order) moves ``nbytes[f]`` from device ``src[f]`` to ``dst[f]`` in
    phase ``phase[f]`` and starts once the flows ``pred_idx[pred_ptr[f]:pred_ptr[f + 1]]`` (its two ranks' latest
    earlier phase flows) have completed, or when the node starts if it has none; the node completes when every flow
    has. The engine steps the flows itself (:meth:`flowlane.sim.Simulator.run`): each is an op of its own (it pays
    ``launch_overhead`` and its route latency), as when every phase flow was a :class:`Coflow` node, but in ~60
    bytes of arrays a flow instead of ~2 KB of objects, so that Qwen-MoE's ~20M phase flows at 1,024 GPUs fit."""

    src: np.ndarray  # int64 device indices, one per phase flow
    dst: np.ndarray
    nbytes: np.ndarray  # float64, > 0
    phase: np.ndarray  # int32 phase index of each flow (non-decreasing)
    pred_ptr: np.ndarray  # int64, len(src) + 1: CSR offsets into pred_idx
    pred_idx: np.ndarray  # int32 flow indices, each < the flow that waits on it
    meta: CoflowMeta
    name: str
    # the phase flows are not serialised on a stream (each waits on its own ranks instead)
    stream: None = None
    # the plan's identity for the runtime's plan cache (flowlane.hermod.matching.plan_all_to_all: algorithm + the
    # matrix, diagonal ignored); b"" = never a cache hit. Read only where SimConfig charges planning (issue 30)
    plan_key: bytes = b""
    # the EP group's device indices: whose plan cache it is (each rank keeps its own)
    group: tuple[int, ...] = ()

    @property
    def total_bytes(self) -> float:
        return float(self.nbytes.sum())

    @property
    def num_phases(self) -> int:
        """Phases that carry at least one flow."""
        return len(np.unique(self.phase))


@dataclass
class Workload:
    """A DAG of tasks. Node ids are ints in insertion order; ``deps`` lists predecessor ids."""

    devices: list[str]
    name: str = "workload"
    # None = join (no-op) node
    nodes: list[ComputeTask | Coflow | PhasedAllToAll | None] = field(default_factory=list)
    deps: list[tuple[int, ...]] = field(default_factory=list)
    info: dict = field(default_factory=dict)
    _dev_index: dict[str, int] = field(default_factory=dict, repr=False)
    _seq: int = 0

    def __post_init__(self) -> None:
        if len(set(self.devices)) != len(self.devices):
            raise SimSpecError("Workload.devices has duplicate names")
        self._dev_index = {d: i for i, d in enumerate(self.devices)}

    # -- construction -------------------------------------------------------------------------------------
    def dev(self, name: str) -> int:
        try:
            return self._dev_index[name]
        except KeyError:
            raise SimSpecError(
                f"unknown device {name!r}; the workload has {len(self.devices)} devices, "
                f"e.g. {self.devices[:4]}"
            ) from None

    def _check_deps(self, deps: Iterable[int | None]) -> tuple[int, ...]:
        out = tuple(d for d in deps if d is not None)
        n = len(self.nodes)
        for d in out:
            if not isinstance(d, int | np.integer) or not 0 <= d < n:
                raise SimSpecError(
                    f"dependency {d!r} is not an existing node id (0..{n - 1}); add nodes in "
                    f"topological order"
                )
        return tuple(int(d) for d in out)

    def compute(
        self,
        executor: str,
        duration: float,
        deps: Iterable[int | None] = (),
        name: str = "compute",
        cat: str = "compute",
    ) -> int:
        if not (isinstance(duration, int | float) and math.isfinite(duration) and duration >= 0):
            raise SimSpecError(
                f"compute task {name!r}: duration must be a finite number >= 0 s, got {duration!r}"
            )
        if not executor:
            raise SimSpecError(
                f"compute task {name!r}: executor must be a non-empty string, got {executor!r}"
            )
        d = self._check_deps(deps)
        self.nodes.append(ComputeTask(executor, float(duration), name, cat))
        self.deps.append(d)
        return len(self.nodes) - 1

    def join(self, deps: Iterable[int | None]) -> int:
        d = self._check_deps(deps)
        self.nodes.append(None)
        self.deps.append(d)
        return len(self.nodes) - 1

    def coflow(
        self,
        flows: tuple[Sequence[int] | np.ndarray, Sequence[int] | np.ndarray, Sequence[float] | np.ndarray],
        meta: CoflowMeta | str,
        deps: Iterable[int | None] = (),
        name: str | None = None,
        stream: str | None = None,
        steps: int = 1,
        paths: dict[int, list[tuple[tuple[str, ...], float]]] | None = None,
        matched: bool = False,
    ) -> int:
        """Add a coflow. ``flows`` = (src indices, dst indices, bytes); use :meth:`dev` to map names. Zero-byte flows
        are dropped; ``paths`` (flow index -> [(device path, fraction)]) is keyed by the index in ``flows`` as
        given and renumbered to the flows kept."""
        if isinstance(meta, str):
            if meta not in CTYPES:
                raise SimSpecError(f"coflow type {meta!r} is not one of {CTYPES}")
            meta = CoflowMeta(meta)
        if meta.seq == 0:
            self._seq += 1
            meta = CoflowMeta(
                meta.ctype, meta.iteration, meta.microbatch, meta.layer, meta.stage, meta.op, self._seq
            )
        src = np.asarray(flows[0], dtype=np.int64).ravel()
        dst = np.asarray(flows[1], dtype=np.int64).ravel()
        nb = np.asarray(flows[2], dtype=np.float64).ravel()
        nm = name or f"{meta.ctype}:{meta.op}"
        if not (len(src) == len(dst) == len(nb)):
            raise SimSpecError(
                f"coflow {nm!r}: src/dst/bytes lengths differ ({len(src)}, {len(dst)}, {len(nb)})"
            )
        nd = len(self.devices)
        if len(src) and (src.min() < 0 or dst.min() < 0 or src.max() >= nd or dst.max() >= nd):
            bad = (
                int(src[(src < 0) | (src >= nd)][0])
                if ((src < 0) | (src >= nd)).any()
                else int(dst[(dst < 0) | (dst >= nd)][0])
            )
            raise SimSpecError(f"coflow {nm!r}: device index {bad} out of range 0..{nd - 1}")
        if (src == dst).any():
            i = int(np.flatnonzero(src == dst)[0])
            raise SimSpecError(f"coflow {nm!r}: flow {i} goes from device {self.devices[src[i]]!r} to itself")
        if len(nb) and (not np.isfinite(nb).all() or nb.min() < 0):
            bad_size = float(nb[~np.isfinite(nb) | (nb < 0)][0])
            raise SimSpecError(
                f"coflow {nm!r}: flow size must be a finite number >= 0 bytes, got {bad_size!r}"
            )
        if not isinstance(steps, int) or steps < 1:
            raise SimSpecError(f"coflow {nm!r}: steps must be an integer >= 1, got {steps!r}")
        for fi in paths or ():
            if not (isinstance(fi, int | np.integer) and 0 <= fi < len(src)):
                raise SimSpecError(
                    f"coflow {nm!r}: paths refers to flow {fi!r}, which does not exist (flows 0..{len(src) - 1})"
                )
        keep = nb > 0
        if not keep.all():
            if paths:  # the kept flows' new indices; a dropped flow's paths go with it
                new = np.cumsum(keep) - 1
                paths = {int(new[fi]): sp for fi, sp in paths.items() if keep[fi]} or None
            src, dst, nb = src[keep], dst[keep], nb[keep]
        d = self._check_deps(deps)
        self.nodes.append(Coflow(src, dst, nb, meta, nm, stream, steps, paths, matched))
        self.deps.append(d)
        return len(self.nodes) - 1

    def phased_all_to_all(
        self,
        src: np.ndarray,
        dst: np.ndarray,
        nbytes: np.ndarray,
        phase: np.ndarray,
        preds: Sequence[Sequence[int]],
        meta: CoflowMeta,
        deps: Iterable[int | None] = (),
        name: str | None = None,
        plan_key: bytes = b"",
        group: Sequence[int] = (),
    ) -> int:
        """Add a :class:`PhasedAllToAll`: ``preds[f]`` lists the earlier flows flow ``f`` waits for; ``plan_key`` and
        ``group`` as in the class (the plan cache's key and owner)."""
        nm = name or f"{meta.ctype}:{meta.op}"
        src = np.asarray(src, dtype=np.int64).ravel()
        dst = np.asarray(dst, dtype=np.int64).ravel()
        nb = np.asarray(nbytes, dtype=np.float64).ravel()
        ph = np.asarray(phase, dtype=np.int32).ravel()
        nf, nd = len(src), len(self.devices)
        if not (len(dst) == len(nb) == len(ph) == len(preds) == nf):
            raise SimSpecError(
                f"phased all-to-all {nm!r}: src/dst/bytes/phase/preds lengths differ "
                f"({nf}, {len(dst)}, {len(nb)}, {len(ph)}, {len(preds)})"
            )
        if nf and (min(src.min(), dst.min()) < 0 or max(src.max(), dst.max()) >= nd):
            raise SimSpecError(f"phased all-to-all {nm!r}: a device index is outside 0..{nd - 1}")
        if (src == dst).any():
            raise SimSpecError(
                f"phased all-to-all {nm!r}: flow {int(np.flatnonzero(src == dst)[0])} goes from a "
                f"device to itself"
            )
        if nf and (not np.isfinite(nb).all() or nb.min() <= 0):
            raise SimSpecError(
                f"phased all-to-all {nm!r}: flow sizes must be finite numbers > 0 bytes, got "
                f"{float(nb[~np.isfinite(nb) | (nb <= 0)][0])!r}"
            )
        if nf and (ph.min() < 0 or (np.diff(ph) < 0).any()):
            raise SimSpecError(f"phased all-to-all {nm!r}: phase indices must be >= 0 and non-decreasing")
        ptr = np.zeros(nf + 1, np.int64)
        ptr[1:] = np.cumsum([len(p) for p in preds])
        idx = np.fromiter((q for p in preds for q in p), dtype=np.int64, count=int(ptr[-1]))
        own = np.repeat(np.arange(nf), np.diff(ptr))
        if len(idx) and ((idx < 0) | (idx >= own)).any():
            f = int(own[(idx < 0) | (idx >= own)][0])
            raise SimSpecError(
                f"phased all-to-all {nm!r}: flow {f} waits for {list(preds[f])}; a flow may only wait "
                f"for earlier flows (0..{f - 1})"
            )
        if meta.seq == 0:
            self._seq += 1
            meta = CoflowMeta(
                meta.ctype, meta.iteration, meta.microbatch, meta.layer, meta.stage, meta.op, self._seq
            )
        d = self._check_deps(deps)
        grp = tuple(int(x) for x in group)
        if any(not 0 <= x < nd for x in grp):
            raise SimSpecError(
                f"phased all-to-all {nm!r}: group {grp} has a device index outside 0..{nd - 1}"
            )
        self.nodes.append(
            PhasedAllToAll(src, dst, nb, ph, ptr, idx.astype(np.int32), meta, nm, None, bytes(plan_key), grp)
        )
        self.deps.append(d)
        return len(self.nodes) - 1

    # -- queries ------------------------------------------------------------------------------------------
    @property
    def coflows(self) -> list[Coflow | PhasedAllToAll]:
        """The communication nodes (both carry src, dst, nbytes, meta and name)."""
        return [n for n in self.nodes if isinstance(n, Coflow | PhasedAllToAll)]

    @property
    def num_flows(self) -> int:
        return sum(len(n.src) for n in self.coflows)

    def total_bytes(self) -> float:
        return float(sum(n.total_bytes for n in self.coflows))
