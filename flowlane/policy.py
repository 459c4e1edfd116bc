"""Scheduling-policy interface shared by the simulator (flowlane.sim) and the runtime comm scheduler (flowlane.sched).

A policy answers one question about a communication operation (a *coflow*: one collective, one p2p transfer, one
all-to-all) from its metadata alone: "how urgent is it?". Consumers use the answer twice:

* **ordering** at an end host: among ready coflows on the same communicator/stream, launch the smallest
  :meth:`SchedulingPolicy.priority` first (ties: issue order, i.e. FIFO);
* **network class**: coflows with different priority keys go into strict-priority classes (smaller key = served
  first); coflows with the same key share max-min fairly. A policy whose keys are all equal is plain fair sharing.

The metadata :class:`CoflowMeta` carries Hermod's model factors (seed 000 §5.3.1: microbatch ID, coflow type, layer
ID) plus iteration and pipeline stage; :meth:`CoflowMeta.key` maps it onto ``(iteration, microbatch, ctype, layer)``,
the shape of Hermod's CoflowKey (:mod:`flowlane.hermod.order`). This module is framework-free and tiny on purpose;
Hermod's policies (:mod:`flowlane.hermod.policy`) subclass :class:`SchedulingPolicy`, and :mod:`flowlane.policies`
names every policy for ``flowlane sim --policy``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

#: Coflow types: data, pipeline, expert, tensor and context parallelism (seed 000 table 5.1; CP per decisions.md A6.1 #7).
CTYPES: tuple[str, ...] = ("dp", "pp", "ep", "tp", "cp")

#: Operation names a coflow may carry (informational; policies may key on them).
OPS: tuple[str, ...] = (
    "all_reduce",
    "reduce_scatter",
    "all_gather",
    "all_to_all",
    "dispatch",
    "combine",
    "send_fwd",
    "send_bwd",
    "p2p",
    "ring_attn",
    "other",
)

Key = tuple[float | int | str, ...]


@dataclass(frozen=True, slots=True)
class CoflowMeta:
    """What a scheduler may know about a coflow before it starts (all fields are fixed by the training DAG).

    ``microbatch`` is the 0-based microbatch index within the iteration (DP reductions carry the last one, M-1:
    "DP coflows always carry the highest MID", seed 000 §5.3.1; a parameter gather carries 0 and the iteration that
    consumes it); ``layer`` is the global 0-based layer index (DP bucket: its highest layer for a reduction, its
    lowest for a gather; PP: the last layer before the stage boundary the data crosses, i.e. the sending stage's
    last in forward and the receiving stage's last in backward: :mod:`flowlane.hermod.keys`, decisions.md A6.1 #6);
    ``stage`` is the pipeline stage. ``seq`` is the issue order, used only to break ties (FIFO).
    """

    ctype: str
    iteration: int = 0
    microbatch: int = 0
    layer: int = 0
    stage: int = 0
    op: str = "other"
    seq: int = 0

    def __post_init__(self) -> None:
        if self.ctype not in CTYPES:
            raise ValueError(f"CoflowMeta.ctype {self.ctype!r} is not one of {CTYPES}")
        for name in ("iteration", "microbatch", "layer", "stage", "seq"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 0:
                raise ValueError(f"CoflowMeta.{name} must be an integer >= 0, got {v!r}")

    def key(self) -> tuple[int, int, str, int]:
        """``(iteration, microbatch, ctype, layer)``: the Hermod CoflowKey shape."""
        return (self.iteration, self.microbatch, self.ctype, self.layer)


class SchedulingPolicy(ABC):
    """Maps coflow metadata to a sortable priority key; smaller = more urgent. Keys must be totally ordered
    (tuples of ints are the safe choice) and must depend only on the metadata, so that every rank agrees."""

    name: str = "policy"

    @abstractmethod
    def priority(self, meta: CoflowMeta) -> Key:
        """Sortable key; equal keys share bandwidth fairly, smaller keys pre-empt larger ones."""

    def order(self, meta: CoflowMeta) -> Key:
        """Launch-order key among ready coflows on one stream: priority, then issue order (FIFO tie-break)."""
        return (*self.priority(meta), meta.seq)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


class FifoPolicy(SchedulingPolicy):
    """Megatron-LM's default: ops launch in issue order and the network shares bandwidth fairly (one class).
    Megatron "does not yet support priority scheduling" (seed 000 §5.2.2, footnote 4)."""

    name = "fifo"

    def priority(self, meta: CoflowMeta) -> Key:
        return ()


class PriorityByKeyPolicy(SchedulingPolicy):
    """Lexicographic strict priority over metadata fields.

    ``fields`` names CoflowMeta attributes compared in order (``"ctype"`` is mapped through ``ctype_rank``; a ctype
    missing from the map ranks after all listed ones). The default, microbatch > ctype > layer with EP & PP before
    DP, is the inter-coflow order of Hermod (seed 000 §5.3.1, table 5.3; digest A2.4 recommends this plain
    lexicographic form because the printed conditional rule is not transitive), then the older iteration, which
    only breaks ties (decisions.md A6.1 #2). Unlike :class:`~flowlane.hermod.policy.HermodPolicy` it takes the
    keys' microbatch as is (no ``dp_mid``, no M).
    """

    def __init__(
        self,
        fields: Sequence[str] = ("microbatch", "ctype", "layer", "iteration"),
        ctype_rank: Mapping[str, int] | None = None,
        name: str = "priority",
    ) -> None:
        allowed = ("iteration", "microbatch", "ctype", "layer", "stage", "op")
        for f in fields:
            if f not in allowed:
                raise ValueError(f"PriorityByKeyPolicy: field {f!r} is not one of {allowed}")
        self.fields = tuple(fields)
        self.ctype_rank = dict(
            ctype_rank if ctype_rank is not None else {"ep": 0, "pp": 0, "cp": 0, "tp": 0, "dp": 1}
        )
        for c in self.ctype_rank:
            if c not in CTYPES:
                raise ValueError(f"PriorityByKeyPolicy: ctype {c!r} in ctype_rank is not one of {CTYPES}")
        self.name = name

    def priority(self, meta: CoflowMeta) -> Key:
        out: list[int | str] = []
        for f in self.fields:
            if f == "ctype":
                out.append(self.ctype_rank.get(meta.ctype, len(CTYPES)))
            else:
                out.append(getattr(meta, f))
        return tuple(out)


class CtypeFirstPolicy(PriorityByKeyPolicy):
    """One coflow type strictly first, the rest fair among themselves: the DP-/PP-/EP-first heuristics of
    seed 000 table 5.2."""

    def __init__(self, first: str) -> None:
        if first not in CTYPES:
            raise ValueError(f"CtypeFirstPolicy: first={first!r} is not one of {CTYPES}")
        super().__init__(
            fields=("ctype",), ctype_rank={c: (0 if c == first else 1) for c in CTYPES}, name=f"{first}-first"
        )
