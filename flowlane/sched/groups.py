"""One communicator per coflow class (seed 000 §5.4 via digest A6.2 options 1-2).

``build_class_groups`` clones every given process group once per Hermod class. Deferred (paced) traffic then runs
on its own communicators, so its launch sequence never interleaves with ops the framework issues on the original
group, and on NCCL each clone carries ``ncclConfig_t.trafficClass`` (NCCL >= 2.24, torch's
``ProcessGroupNCCL.Options().config.traffic_class``) so that switches and the project's NCCL net plugin can enforce
the priority. On gloo there is no wire class: one clone is made (host-side ordering only) and every class maps to it.

The NCCL path cannot be exercised on a CPU-only machine; it is guarded (clear errors when the torch build lacks the
field) and untested here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch.distributed as dist

from flowlane.coflow import NCCL_NUM_CLASSES, nccl_traffic_class


@dataclass
class ClassGroups:
    """This rank's clones: ``groups[ranks][hermod_class] -> ProcessGroup`` for every group it belongs to."""

    groups: dict[tuple[int, ...], list[dist.ProcessGroup]]
    backend: str

    def get(self, group: dist.ProcessGroup | None, hermod_class: int) -> dist.ProcessGroup | None:
        """The clone of ``group`` for a class; falls back to ``group`` itself when it was not cloned."""
        ranks = tuple(range(dist.get_world_size())) if group is None or group is dist.GroupMember.WORLD \
            else tuple(dist.get_process_group_ranks(group))
        clones = self.groups.get(ranks)
        if clones is None:
            return group
        return clones[min(hermod_class, len(clones) - 1)]


def _nccl_options(hermod_class: int) -> object:
    opts = dist.ProcessGroupNCCL.Options()
    if not hasattr(opts, "config") or not hasattr(opts.config, "traffic_class"):
        raise RuntimeError("this torch build's ProcessGroupNCCL.Options().config has no 'traffic_class' "
                           "(needs NCCL >= 2.24 and a torch that exposes ncclConfig_t.trafficClass)")
    opts.config.traffic_class = nccl_traffic_class(hermod_class)
    return opts


def build_class_groups(my_groups: Sequence[Sequence[int]], backend: str | None = None) -> ClassGroups:
    """Collective over the world: every rank passes the rank lists of the groups *it* wants cloned; the union is
    created on every rank in a fixed (sorted) order, as ``new_group`` requires."""
    backend = backend or dist.get_backend()
    mine = sorted({tuple(sorted(g)) for g in my_groups})
    everyone: list[list[tuple[int, ...]]] = [[] for _ in range(dist.get_world_size())]
    dist.all_gather_object(everyone, mine)
    union = sorted({g for lst in everyone for g in lst})
    n_classes = NCCL_NUM_CLASSES if backend == "nccl" else 1
    out: dict[tuple[int, ...], list[dist.ProcessGroup]] = {}
    me = dist.get_rank()
    for ranks in union:
        clones = []
        for c in range(n_classes):
            if backend == "nccl":
                pg = dist.new_group(list(ranks), backend="nccl", pg_options=_nccl_options(c))
            else:
                pg = dist.new_group(list(ranks), backend=backend)
            clones.append(pg)
        if me in ranks:
            out[ranks] = clones
    return ClassGroups(out, backend)
