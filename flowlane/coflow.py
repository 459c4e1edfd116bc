"""Hermod's coflow model: keys, the cluster-wide priority order, and wire classes (seed 000 ch.5).

Every network coflow of a hybrid-parallel training job is named by model factors fixed for the whole run
(seed 000 §5.2.2): microbatch ID (MID), coflow type (CType) and layer ID (LID), plus the iteration.
:class:`CoflowKey` holds them; :class:`HermodOrder` maps a key to a sort tuple (smaller = served first).

The order is the plain lexicographic (MID, CType, LID) of §5.3.1 / table 5.3 ("MID > CType > LID"), i.e. what the
thesis' DSCP layout (§5.4: MID in the top bits) actually enforces. The thesis' conditional "LID first when a DP
coflow is involved" rule (table 5.4, MID*) is *not* transitive (digest A2.4: A=EP(m1,l3) > C=EP(m2,l1) by MID,
C > B=DP(l2) by LID, B > A by LID), so it cannot drive a priority queue; we do not implement it. What the thesis
wanted from it -- parameter AllGathers that feed the next iteration's first microbatch -- is the documented knob
``dp_mid="consumer"`` (digest A6.1 #1); the thesis default is ``dp_mid="last"`` (DP carries MID = M-1).

Total order (digest A6.1 #2: the iteration is only a tie-breaker, older first): the sort tuple is
``(effective MID, CType rank, LID, iteration, CType index, raw MID, op)``; the last three fields only separate distinct
keys that the policy treats as equally urgent, so that distinct keys never compare equal (antisymmetry).

Wire classes (:class:`WireEncoder`): the seed's 6-bit DSCP = 3 bits MID | 1 bit CType | 2 bits LID (§5.4), with
relative, clamped MID and per-stage LID buckets (digest A6.1 #3; quantisation is not stated in the thesis), and a
small number of NCCL traffic classes for per-communicator ``ncclConfig_t.trafficClass`` (digest A6.2 option 1/2).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from flowlane.policy import CTYPES, CoflowMeta

#: coflow types with their fixed index (stable: used in sort tuples and encodings)
CTYPE_INDEX: dict[str, int] = {c: i for i, c in enumerate(CTYPES)}  # dp, pp, ep, tp, cp

#: CType rank per pipeline schedule; smaller = more urgent. Seed 000 §5.3.1: 1F1B "EP & PP > DP", interleaved 1F1B
#: "EP > PP > DP". CP is same-layer critical-path data like EP and TP is intra-node but, if ever keyed, equally
#: critical (digest A6.1 #7 -- the thesis covers neither).
CTYPE_RANK: dict[str, dict[str, int]] = {
    "1f1b": {"ep": 0, "pp": 0, "cp": 0, "tp": 0, "dp": 1},
    "interleaved": {"ep": 0, "cp": 0, "tp": 0, "pp": 1, "dp": 2},
}

Schedule = Literal["1f1b", "interleaved"]
DpMid = Literal["last", "consumer"]

#: DP operations whose data is consumed by the *next* iteration's forward (parameter gathers under ZeRO).
GATHER_OPS: frozenset[str] = frozenset({"all_gather", "param_gather"})


@dataclass(frozen=True, slots=True)
class CoflowKey:
    """The identity of one coflow: ``(iteration, microbatch, ctype, layer)`` (+ ``op``, used by the DP-MID knob).

    ``microbatch`` is 0-based within the iteration; ``layer`` is the global 0-based layer index (PP: last layer of the
    sending stage in forward / first layer of the receiving stage in backward; DP bucket: its lowest layer for
    gathers, highest for reductions -- digest A6.1 #6). For a DP parameter gather issued after step ``i``, pass the
    iteration that consumes it (``i + 1``).
    """

    iteration: int
    microbatch: int
    ctype: str
    layer: int
    op: str = "other"

    def __post_init__(self) -> None:
        if self.ctype not in CTYPE_INDEX:
            raise ValueError(f"CoflowKey.ctype {self.ctype!r} is not one of {CTYPES}")
        for name in ("iteration", "microbatch", "layer"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"CoflowKey.{name} must be an integer >= 0, got {v!r}")

    @classmethod
    def from_meta(cls, meta: CoflowMeta) -> CoflowKey:
        return cls(meta.iteration, meta.microbatch, meta.ctype, meta.layer, meta.op)

    def to_meta(self, stage: int = 0, seq: int = 0) -> CoflowMeta:
        return CoflowMeta(ctype=self.ctype, iteration=self.iteration, microbatch=self.microbatch, layer=self.layer,
                          stage=stage, op=self.op, seq=seq)


@dataclass(frozen=True)
class HermodOrderConfig:
    """Policy knobs of the Hermod priority order."""

    num_microbatches: int | None = None
    """M, microbatches per iteration; DP coflows with ``dp_mid="last"`` carry MID = M-1 (seed 000 §5.3.1).
    ``None``: unknown -- DP then ranks after every microbatch (the same order for all keys with microbatch < M)."""
    schedule: Schedule = "1f1b"
    """Pipeline schedule: ``1f1b`` (EP & PP > DP) or ``interleaved`` (EP > PP > DP)."""
    dp_mid: DpMid = "last"
    """MID assigned to DP coflows: ``last`` (thesis: "DP coflows always carry the highest MID") or ``consumer``
    (parameter gathers take the MID of their first consumer, microbatch 0 of the next iteration; reductions keep
    M-1). Digest A2.4 / A6.1 #1."""

    def __post_init__(self) -> None:
        if self.num_microbatches is not None and (not isinstance(self.num_microbatches, int)
                                                  or self.num_microbatches < 1):
            raise ValueError(f"num_microbatches must be an integer >= 1, got {self.num_microbatches!r}")
        if self.schedule not in CTYPE_RANK:
            raise ValueError(f"schedule {self.schedule!r} is not one of {sorted(CTYPE_RANK)}")
        if self.dp_mid not in ("last", "consumer"):
            raise ValueError(f"dp_mid {self.dp_mid!r} is not one of ['consumer', 'last']")


SortKey = tuple[int, int, int, int, int, int, str]
_MID_LAST = (1 << 31) - 1


class HermodOrder:
    """The strict, total Hermod priority order over :class:`CoflowKey` (smaller sort tuple = higher priority)."""

    def __init__(self, config: HermodOrderConfig | None = None) -> None:
        self.config = config or HermodOrderConfig()
        self._rank = CTYPE_RANK[self.config.schedule]

    def effective_mid(self, key: CoflowKey) -> int:
        if key.ctype != "dp":
            return key.microbatch
        if self.config.dp_mid == "consumer" and key.op in GATHER_OPS:
            return 0  # first consumer: microbatch 0 of the iteration in key.iteration
        m = self.config.num_microbatches
        return _MID_LAST if m is None else m - 1

    def sort_key(self, key: CoflowKey) -> SortKey:
        return (self.effective_mid(key), self._rank[key.ctype], key.layer, key.iteration,
                CTYPE_INDEX[key.ctype], key.microbatch, key.op)

    def before(self, a: CoflowKey, b: CoflowKey) -> bool:
        """True when ``a`` is served strictly before ``b``."""
        return self.sort_key(a) < self.sort_key(b)

    def level(self, key: CoflowKey) -> int:
        """CType rank alone (0 = critical class)."""
        return self._rank[key.ctype]


def thesis_conditional_before(a: CoflowKey, b: CoflowKey, schedule: Schedule = "1f1b") -> bool | None:
    """The printed pairwise rule of table 5.4 (LID first when a DP coflow is involved, else MID first, then CType):
    kept only to demonstrate its non-transitivity in tests (digest A2.4). None = tie."""
    rank = CTYPE_RANK[schedule]
    if "dp" in (a.ctype, b.ctype):
        ka, kb = (a.layer, rank[a.ctype], a.microbatch), (b.layer, rank[b.ctype], b.microbatch)
    else:
        ka, kb = (a.microbatch, rank[a.ctype], a.layer), (b.microbatch, rank[b.ctype], b.layer)
    return None if ka == kb else ka < kb


# -- wire classes ----------------------------------------------------------------------------------------------------
#: Number of NCCL traffic classes Hermod uses (digest A6.2 option 2: "K ~ 2-4" communicator copies per group).
NCCL_NUM_CLASSES = 3
#: Hermod class -> ``ncclConfig_t.trafficClass`` value. The values are the DSCP of the class's representative key in
#: the 6-bit layout, shifted into the IP TOS byte (DSCP << 2), which is what stock NCCL's IB transport puts in the
#: GRH traffic class; smaller = higher priority. Contract with flowlane/wire_classes.py (NCCL-plugin side): see
#: :func:`nccl_traffic_class`.
NCCL_CLASS_NAMES: tuple[str, ...] = ("critical", "pipeline", "bulk")


@dataclass(frozen=True)
class WireConfig:
    """How exact keys are quantised onto the wire (digest A6.1 #3; the thesis does not state it)."""

    mid_bits: int = 3
    """MID bits (thesis: 3); MID is sent relative to the oldest in-flight microbatch and clamped."""
    ctype_bits: int = 1
    """CType bits (thesis: 1 = EP&PP vs DP; 2 needed for interleaved 1F1B, taken from the LID bits)."""
    lid_bits: int = 2
    """LID bits (thesis: 2); LID is bucketed per pipeline stage: floor(local_layer * 2^bits / layers_per_stage)."""
    layers_per_stage: int = 1

    def __post_init__(self) -> None:
        if self.mid_bits < 0 or self.ctype_bits < 0 or self.lid_bits < 0:
            raise ValueError(f"bit widths must be >= 0, got mid={self.mid_bits} ctype={self.ctype_bits} "
                             f"lid={self.lid_bits}")
        if self.mid_bits + self.ctype_bits + self.lid_bits != 6:
            raise ValueError(f"DSCP has 6 bits; mid_bits + ctype_bits + lid_bits = "
                             f"{self.mid_bits + self.ctype_bits + self.lid_bits}")
        if self.layers_per_stage < 1:
            raise ValueError(f"layers_per_stage must be >= 1, got {self.layers_per_stage}")


class WireEncoder:
    """Quantises exact keys into DSCP code points and NCCL traffic classes; smaller = higher priority."""

    def __init__(self, order: HermodOrder, wire: WireConfig | None = None) -> None:
        self.order = order
        self.wire = wire or WireConfig(ctype_bits=2 if order.config.schedule == "interleaved" else 1,
                                       lid_bits=1 if order.config.schedule == "interleaved" else 2)

    def dscp(self, key: CoflowKey, oldest_mid: int = 0) -> int:
        """6-bit DSCP: MID_rel | CType | LID bucket (seed 000 §5.4; quantisation per digest A6.1 #3)."""
        w = self.wire
        mid = min(max(self.order.effective_mid(key) - oldest_mid, 0), (1 << w.mid_bits) - 1)
        ct = min(self.order.level(key), (1 << w.ctype_bits) - 1)
        local = key.layer % w.layers_per_stage
        lid = min(local * (1 << w.lid_bits) // w.layers_per_stage, (1 << w.lid_bits) - 1)
        return (mid << (w.ctype_bits + w.lid_bits)) | (ct << w.lid_bits) | lid

    def nccl_class(self, key: CoflowKey, oldest_mid: int = 0) -> int:
        """Hermod NCCL class: 0 critical (non-DP, oldest in-flight microbatch), 1 pipeline (non-DP, later
        microbatches), 2 bulk (DP). DP is last because "EP & PP > DP" holds within every microbatch."""
        if key.ctype == "dp":
            return 2
        return 0 if self.order.effective_mid(key) <= oldest_mid else 1


def nccl_traffic_class(hermod_class: int) -> int:
    """``ncclConfig_t.trafficClass`` for a Hermod class (0..NCCL_NUM_CLASSES-1).

    If ``flowlane.wire_classes`` (owned by the NCCL-plugin engineer) defines ``HERMOD_TRAFFIC_CLASSES`` (a sequence
    indexed by Hermod class), it is authoritative; otherwise the TOS byte of DSCP 0 / 8 / 56 (MID_rel 0, MID_rel 1,
    clamped-last) is used."""
    if not 0 <= hermod_class < NCCL_NUM_CLASSES:
        raise ValueError(f"hermod_class must be in [0, {NCCL_NUM_CLASSES}), got {hermod_class!r}")
    try:
        from flowlane import wire_classes  # type: ignore[attr-defined]

        table = getattr(wire_classes, "HERMOD_TRAFFIC_CLASSES", None)
        if table is not None:
            return int(table[hermod_class])
    except ImportError:
        pass
    return (0, 8, 56)[hermod_class] << 2
