"""What the network can see of a Hermod key: DSCP code points and NCCL traffic classes (seed 000 §5.4).

The seed's 6-bit DSCP = 3 bits MID | 1 bit CType | 2 bits LID (§5.4), with relative, clamped MID and per-stage LID
buckets (decisions.md A6.1 #3; the thesis does not state the quantisation), and a small number of NCCL traffic classes for
per-communicator ``ncclConfig_t.trafficClass`` (digest A6.2 options 1/2). The class -> ``trafficClass`` numbers are
the NCCL net plugin's contract (:mod:`flowlane.wire_classes`, pinned to its C header by a test). Pure Python.

Who uses what: the simulator's quantised policies (``hermod-dscp``, ``hermod-nccl``) use both encodings, and the
synthetic workload (:mod:`flowlane.testing.workload`, ``ep_wire_classes``) puts :meth:`WireEncoder.nccl_class` on its
all-to-alls. The Megatron and DeepSpeed adapters carry the CType alone: class 0 for all pipeline and EP traffic, class
2 for DP. No code puts :meth:`WireEncoder.dscp` on a packet: the NCCL net plugin marks its own per-class DiffServ
code points (EF 46 for class 0, CS1 8 for bulk: :data:`flowlane.wire_classes.CLASS_DSCP`).
"""

from __future__ import annotations

from dataclasses import dataclass

from flowlane.hermod.order import CoflowKey, HermodOrder
from flowlane.wire_classes import HERMOD_TRAFFIC_CLASSES

#: Number of NCCL traffic classes Hermod uses (digest A6.2 option 2: "K ~ 2-4" communicator copies per group).
NCCL_NUM_CLASSES = 3
#: Hermod classes, most urgent first (:meth:`WireEncoder.nccl_class`); :func:`nccl_traffic_class` maps each to the
#: NCCL net plugin's ``trafficClass``.
NCCL_CLASS_NAMES: tuple[str, ...] = ("critical", "pipeline", "bulk")


@dataclass(frozen=True)
class WireConfig:
    """How exact keys are quantised onto the wire (decisions.md A6.1 #3; the thesis does not state it)."""

    mid_bits: int = 3
    """MID bits (thesis: 3); MID is sent relative to the oldest in-flight microbatch and clamped."""
    ctype_bits: int = 1
    """CType bits (thesis: 1 = EP&PP vs DP; 2 needed for interleaved 1F1B, taken from the LID bits)."""
    lid_bits: int = 2
    """LID bits (thesis: 2); LID is bucketed per pipeline stage: floor(local_layer * 2^bits / layers_per_stage)."""
    layers_per_stage: int = 1

    def __post_init__(self) -> None:
        if self.mid_bits < 0 or self.ctype_bits < 0 or self.lid_bits < 0:
            raise ValueError(
                f"bit widths must be >= 0, got mid={self.mid_bits} ctype={self.ctype_bits} "
                f"lid={self.lid_bits}"
            )
        if self.mid_bits + self.ctype_bits + self.lid_bits != 6:
            raise ValueError(
                f"DSCP has 6 bits; mid_bits + ctype_bits + lid_bits = "
                f"{self.mid_bits + self.ctype_bits + self.lid_bits}"
            )
        if self.layers_per_stage < 1:
            raise ValueError(f"layers_per_stage must be >= 1, got {self.layers_per_stage}")


class WireEncoder:
    """Quantises exact keys into the seed's DSCP code points (a simulator model) and NCCL traffic classes; smaller =
    higher priority for both (unlike the plugin's DiffServ marking)."""

    def __init__(self, order: HermodOrder, wire: WireConfig | None = None) -> None:
        self.order = order
        self.wire = wire or WireConfig(
            ctype_bits=2 if order.config.schedule == "interleaved" else 1,
            lid_bits=1 if order.config.schedule == "interleaved" else 2,
        )

    def dscp(self, key: CoflowKey, oldest_mid: int = 0) -> int:
        """6-bit DSCP: MID_rel | CType | LID bucket (seed 000 §5.4; quantisation per decisions.md A6.1 #3)."""
        w = self.wire
        mid = min(max(self.order.effective_mid(key) - oldest_mid, 0), (1 << w.mid_bits) - 1)
        ct = min(self.order.level(key), (1 << w.ctype_bits) - 1)
        local = key.layer % w.layers_per_stage
        lid = min(local * (1 << w.lid_bits) // w.layers_per_stage, (1 << w.lid_bits) - 1)
        return (mid << (w.ctype_bits + w.lid_bits)) | (ct << w.lid_bits) | lid

    def nccl_class(self, key: CoflowKey, oldest_mid: int = 0) -> int:
        """Hermod NCCL class: 0 critical (effective MID up to the oldest in-flight microbatch), 1 pipeline (later
        microbatches), 2 bulk (DP at the last MID, M-1: reductions, and gathers under ``dp_mid="last"``).

        The classes coarsen the exact order and never reverse it (for keys with microbatch < M; a test checks
        random pairs): DP at M-1 ranks after every non-DP key, so it may take the last class; a parameter gather that
        ``dp_mid="consumer"`` ranks at an earlier microbatch is served before that microbatch's successors, so it
        takes the class of that microbatch, not the bulk one."""
        mid = self.order.effective_mid(key)
        if key.ctype == "dp" and mid >= self._last_mid:
            return 2
        return 0 if mid <= oldest_mid else 1

    @property
    def _last_mid(self) -> int:
        """The effective MID of a DP reduction: M-1, or past every microbatch when M is unknown."""
        return self.order.effective_mid(CoflowKey(0, 0, "dp", 0, "reduce_scatter"))


def nccl_traffic_class(hermod_class: int) -> int:
    """``ncclConfig_t.trafficClass`` for a Hermod class (0..NCCL_NUM_CLASSES-1): the NCCL net plugin's class for it
    (:data:`flowlane.wire_classes.HERMOD_TRAFFIC_CLASSES`: critical 0, pipeline 1, bulk 3)."""
    if not isinstance(hermod_class, int) or not 0 <= hermod_class < NCCL_NUM_CLASSES:
        raise ValueError(f"hermod_class must be an integer in [0, {NCCL_NUM_CLASSES}), got {hermod_class!r}")
    return HERMOD_TRAFFIC_CLASSES[hermod_class]
