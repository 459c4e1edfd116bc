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
    paths: dict[int, list[tuple[tuple[str, ...], float]]] | None = None  # flow index -> [(device path, fraction)]
    matched: bool = False  # incast-free (Hermod's matching all-to-all): one flow per link for the incast model

    @property
    def total_bytes(self) -> float:
        return float(self.nbytes.sum())


@dataclass
class Workload:
    """A DAG of tasks. Node ids are ints in insertion order; ``deps`` lists predecessor ids."""

    devices: list[str]
    name: str = "workload"
    nodes: list[ComputeTask | Coflow | None] = field(default_factory=list)  # None = join (no-op) node
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
            raise SimSpecError(f"unknown device {name!r}; the workload has {len(self.devices)} devices, "
                               f"e.g. {self.devices[:4]}") from None

    def _check_deps(self, deps: Iterable[int | None]) -> tuple[int, ...]:
        out = tuple(d for d in deps if d is not None)
        n = len(self.nodes)
        for d in out:
            if not isinstance(d, int | np.integer) or not 0 <= d < n:
                raise SimSpecError(f"dependency {d!r} is not an existing node id (0..{n - 1}); add nodes in "
                                   f"topological order")
        return tuple(int(d) for d in out)

    def compute(self, executor: str, duration: float, deps: Iterable[int | None] = (), name: str = "compute",
                cat: str = "compute") -> int:
        if not (isinstance(duration, int | float) and math.isfinite(duration) and duration >= 0):
            raise SimSpecError(f"compute task {name!r}: duration must be a finite number >= 0 s, got {duration!r}")
        if not executor:
            raise SimSpecError(f"compute task {name!r}: executor must be a non-empty string, got {executor!r}")
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
        """Add a coflow. ``flows`` = (src indices, dst indices, bytes); use :meth:`dev` to map names."""
        if isinstance(meta, str):
            if meta not in CTYPES:
                raise SimSpecError(f"coflow type {meta!r} is not one of {CTYPES}")
            meta = CoflowMeta(meta)
        if meta.seq == 0:
            self._seq += 1
            meta = CoflowMeta(meta.ctype, meta.iteration, meta.microbatch, meta.layer, meta.stage, meta.op, self._seq)
        src = np.asarray(flows[0], dtype=np.int64).ravel()
        dst = np.asarray(flows[1], dtype=np.int64).ravel()
        nb = np.asarray(flows[2], dtype=np.float64).ravel()
        nm = name or f"{meta.ctype}:{meta.op}"
        if not (len(src) == len(dst) == len(nb)):
            raise SimSpecError(f"coflow {nm!r}: src/dst/bytes lengths differ ({len(src)}, {len(dst)}, {len(nb)})")
        nd = len(self.devices)
        if len(src) and (src.min() < 0 or dst.min() < 0 or src.max() >= nd or dst.max() >= nd):
            bad = int(src[(src < 0) | (src >= nd)][0]) if ((src < 0) | (src >= nd)).any() else \
                int(dst[(dst < 0) | (dst >= nd)][0])
            raise SimSpecError(f"coflow {nm!r}: device index {bad} out of range 0..{nd - 1}")
        if (src == dst).any():
            i = int(np.flatnonzero(src == dst)[0])
            raise SimSpecError(f"coflow {nm!r}: flow {i} goes from device {self.devices[src[i]]!r} to itself")
        if len(nb) and (not np.isfinite(nb).all() or nb.min() < 0):
            bad = float(nb[~np.isfinite(nb) | (nb < 0)][0])
            raise SimSpecError(f"coflow {nm!r}: flow size must be a finite number >= 0 bytes, got {bad!r}")
        if not isinstance(steps, int) or steps < 1:
            raise SimSpecError(f"coflow {nm!r}: steps must be an integer >= 1, got {steps!r}")
        keep = nb > 0
        if not keep.all():
            src, dst, nb = src[keep], dst[keep], nb[keep]
        d = self._check_deps(deps)
        self.nodes.append(Coflow(src, dst, nb, meta, nm, stream, steps, paths, matched))
        self.deps.append(d)
        return len(self.nodes) - 1

    # -- queries ------------------------------------------------------------------------------------------
    @property
    def coflows(self) -> list[Coflow]:
        return [n for n in self.nodes if isinstance(n, Coflow)]

    @property
    def num_flows(self) -> int:
        return sum(len(n.src) for n in self.nodes if isinstance(n, Coflow))

    def total_bytes(self) -> float:
        return float(sum(n.total_bytes for n in self.nodes if isinstance(n, Coflow)))
