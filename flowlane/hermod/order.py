"""Hermod's coflow model: keys and the cluster-wide priority order (seed 000 ch.5).

Every network coflow of a hybrid-parallel training job is named by model factors fixed for the whole run
(seed 000 §5.2.2): microbatch ID (MID), coflow type (CType) and layer ID (LID), plus the iteration.
:class:`CoflowKey` holds them; :class:`HermodOrder` maps a key to a sort tuple (smaller = served first).

The order is the plain lexicographic (MID, CType, LID) of §5.3.1 / table 5.3 ("MID > CType > LID"), i.e. what the
thesis' DSCP layout (§5.4: MID in the top bits) actually enforces. The thesis' conditional "LID first when a DP
coflow is involved" rule (table 5.4, MID*) is *not* transitive (digest A2.4: A=EP(m1,l3) > C=EP(m2,l1) by MID,
C > B=DP(l2) by LID, B > A by LID), so it cannot drive a priority queue; we do not implement it. What the thesis
wanted from it -- parameter AllGathers that feed the next iteration's first microbatch -- is the documented knob
``dp_mid="consumer"`` (decisions.md A6.1 #1); the thesis default is ``dp_mid="last"`` (DP carries MID = M-1).

Total order (decisions.md A6.1 #2: the iteration is only a tie-breaker, older first): the sort tuple is
``(effective MID, CType rank, LID, iteration, CType index, raw MID, op)``; the last three fields only separate distinct
keys that the policy treats as equally urgent, so that distinct keys never compare equal (antisymmetry).

What the wire can carry of a key is :mod:`flowlane.hermod.wire`; how a framework adapter assigns keys to its
operations is :mod:`flowlane.hermod.keys`. Pure Python: no torch, no framework.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from flowlane.policy import CTYPES, CoflowMeta

#: coflow types with their fixed index (stable: used in sort tuples and encodings)
CTYPE_INDEX: dict[str, int] = {c: i for i, c in enumerate(CTYPES)}  # dp, pp, ep, tp, cp

#: CType rank per pipeline schedule; smaller = more urgent. Seed 000 §5.3.1: 1F1B "EP & PP > DP", interleaved 1F1B
#: "EP > PP > DP". CP is same-layer critical-path data like EP and TP is intra-node but, if ever keyed, equally
#: critical (decisions.md A6.1 #7 -- the thesis covers neither).
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

    ``microbatch`` is 0-based within the iteration; ``layer`` is the global 0-based layer index (PP: the last layer
    before the stage boundary the data crosses, i.e. of the sending stage in forward and of the receiving stage in
    backward, :mod:`flowlane.hermod.keys`; DP bucket: its lowest layer for gathers, highest for reductions --
    decisions.md A6.1 #6). For a DP parameter gather issued after step ``i``, pass the
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
        return CoflowMeta(
            ctype=self.ctype,
            iteration=self.iteration,
            microbatch=self.microbatch,
            layer=self.layer,
            stage=stage,
            op=self.op,
            seq=seq,
        )


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
    M-1). docs/decisions.md A2.4, A6.1 #1."""

    def __post_init__(self) -> None:
        if self.num_microbatches is not None and (
            not isinstance(self.num_microbatches, int) or self.num_microbatches < 1
        ):
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
        return (
            self.effective_mid(key),
            self._rank[key.ctype],
            key.layer,
            key.iteration,
            CTYPE_INDEX[key.ctype],
            key.microbatch,
            key.op,
        )

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
