"""One communicator per coflow class (seed 000 §5.4 via digest A6.2 options 1-2).

``build_class_groups`` clones every given process group once per Hermod class. Deferred (paced) traffic then runs
on its own communicators, so its launch sequence never interleaves with ops the framework issues on the original
group, and on NCCL each clone carries ``ncclConfig_t.trafficClass`` (NCCL >= 2.24, torch's
``ProcessGroupNCCL.Options().config.traffic_class``) so that switches and the project's NCCL net plugin can enforce
the priority. gloo has no traffic-class field: by default one clone is made (host-side ordering only) and every class
maps to it. Given one network interface per class (``gloo_class_ifnames`` or ``FLOWLANE_GLOO_CLASS_IFNAMES``), each
class's clone binds its gloo device to that interface instead (``GLOO_SOCKET_IFNAME`` is read when a gloo group is
created), so a class's traffic leaves from its own source address and a switch or ``tc`` filter can queue it by class
-- the gloo stand-in for DSCP marking (seed 000 §5.4: the switch enforces what the host marks). The interfaces are
the operator's to set up (e.g. a macvlan per class on the NIC); benchmarks/hermod_real.py builds them in netns.

The NCCL path cannot be exercised on a CPU-only machine; it is guarded (clear errors when the torch build lacks the
field) and was checked on one GPU (benchmarks/nccl_gpu_check.py, results/gpu/README.md): the clones carry traffic
classes 0 / 1 / 3 and the project's NCCL net plugin receives them.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch.distributed as dist

from flowlane.hermod.wire import NCCL_NUM_CLASSES, nccl_traffic_class


@dataclass
class ClassGroups:
    """This rank's clones: ``groups[ranks][hermod_class] -> ProcessGroup`` for every group it belongs to."""

    groups: dict[tuple[int, ...], list[dist.ProcessGroup]]
    backend: str

    def get(self, group: dist.ProcessGroup | None, hermod_class: int) -> dist.ProcessGroup | None:
        """The clone of ``group`` for a class; falls back to ``group`` itself when it was not cloned."""
        ranks = (
            tuple(range(dist.get_world_size()))
            if group is None or group is dist.GroupMember.WORLD
            else tuple(dist.get_process_group_ranks(group))
        )
        clones = self.groups.get(ranks)
        if clones is None:
            return group
        return clones[min(hermod_class, len(clones) - 1)]


def _nccl_options(hermod_class: int) -> object:
    opts = dist.ProcessGroupNCCL.Options()
    if not hasattr(opts, "config") or not hasattr(opts.config, "traffic_class"):
        raise RuntimeError(
            "this torch build's ProcessGroupNCCL.Options().config has no 'traffic_class' "
            "(needs NCCL >= 2.24 and a torch that exposes ncclConfig_t.trafficClass)"
        )
    opts.config.traffic_class = nccl_traffic_class(hermod_class)
    # the critical and pipeline classes' kernels go on high-priority CUDA streams, so the GPU schedules them
    # ahead of the bulk class's (seed 000 §5.4: PP/EP before DP, on the device as on the wire)
    opts.is_high_priority_stream = hermod_class < NCCL_NUM_CLASSES - 1
    return opts


GLOO_CLASS_IFNAMES_ENV = "FLOWLANE_GLOO_CLASS_IFNAMES"


def parse_class_ifnames(value: str | Sequence[str] | None) -> list[str] | None:
    """``"eth0,eth0,bulk0"`` (or a list) -> one interface per Hermod class; fewer than NCCL_NUM_CLASSES names repeat
    the last one for the remaining classes. Every name must be an interface of this host (network namespace)."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    names = [n.strip() for n in value.split(",")] if isinstance(value, str) else [str(n) for n in value]
    if not 1 <= len(names) <= NCCL_NUM_CLASSES or any(not n for n in names):
        raise ValueError(
            f"gloo class interfaces {value!r}: need 1..{NCCL_NUM_CLASSES} non-empty interface names, "
            f"one per Hermod class (critical, pipeline, bulk)"
        )
    known = [n for _, n in socket.if_nameindex()]
    for n in names:
        if n not in known:
            raise ValueError(f"gloo class interface {n!r} does not exist here; interfaces: {known}")
    return names + [names[-1]] * (NCCL_NUM_CLASSES - len(names))


@contextmanager
def _gloo_interface(ifname: str) -> Iterator[None]:
    old = os.environ.get("GLOO_SOCKET_IFNAME")
    os.environ["GLOO_SOCKET_IFNAME"] = ifname
    try:
        yield
    finally:
        if old is None:
            del os.environ["GLOO_SOCKET_IFNAME"]
        else:
            os.environ["GLOO_SOCKET_IFNAME"] = old


def build_class_groups(
    my_groups: Sequence[Sequence[int]],
    backend: str | None = None,
    gloo_class_ifnames: str | Sequence[str] | None = None,
) -> ClassGroups:
    """Collective over the world: every rank passes the rank lists of the groups *it* wants cloned; the union is
    created on every rank in a fixed (sorted) order, as ``new_group`` requires. ``gloo_class_ifnames`` (default:
    ``$FLOWLANE_GLOO_CLASS_IFNAMES``) gives gloo one clone per class, each on its class's interface."""
    backend = backend or dist.get_backend()
    ifnames, error = None, ""
    if backend == "gloo":
        try:
            ifnames = parse_class_ifnames(
                gloo_class_ifnames
                if gloo_class_ifnames is not None
                else os.environ.get(GLOO_CLASS_IFNAMES_ENV)
            )
        except ValueError as e:  # raised on every rank below, so no peer is left waiting in a collective
            error = str(e)
    mine = sorted({tuple(sorted(g)) for g in my_groups})
    everyone: list[tuple[list[tuple[int, ...]], bool, str]] = [([], False, "")] * dist.get_world_size()
    dist.all_gather_object(everyone, (mine, bool(ifnames), error))
    errors = {r: e for r, (_, _, e) in enumerate(everyone) if e}
    if errors:
        raise ValueError(f"build_class_groups: {errors}")
    # every rank must create the same number of groups, or new_group would hang: agree on wire classes first
    with_classes = [r for r, (_, has, _) in enumerate(everyone) if has]
    if with_classes and len(with_classes) != len(everyone):
        raise ValueError(
            f"gloo class interfaces are set on ranks {with_classes} only; set "
            f"{GLOO_CLASS_IFNAMES_ENV} (or gloo_class_ifnames) on every rank or on none"
        )
    union = sorted({g for lst, _, _ in everyone for g in lst})
    n_classes = NCCL_NUM_CLASSES if backend == "nccl" or ifnames else 1
    out: dict[tuple[int, ...], list[dist.ProcessGroup]] = {}
    me = dist.get_rank()
    for ranks in union:
        clones = []
        for c in range(n_classes):
            if backend == "nccl":
                pg = dist.new_group(list(ranks), backend="nccl", pg_options=_nccl_options(c))
            elif ifnames:
                with _gloo_interface(ifnames[c]):
                    pg = dist.new_group(list(ranks), backend="gloo")
            else:
                pg = dist.new_group(list(ranks), backend=backend)
            clones.append(pg)
        if me in ranks:
            out[ranks] = clones
    return ClassGroups(out, backend)
