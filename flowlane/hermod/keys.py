"""How a framework adapter names its operations as Hermod coflows (seed 000 §5.3.1; digest A6.1 #1, #6).

One rank of stage ``s`` with ``L`` layers per stage owns global layers ``s*L .. s*L+L-1``. Its coflows are keyed:

* **PP** (``ctype="pp"``): the microbatch ID is the number of earlier ops in the same direction this iteration (the
  schedule issues each direction in microbatch order, 1F1B included), clamped to ``M-1``; the layer ID is the
  stage-boundary layer the data crosses, the last layer before the boundary (digest A6.1 #6): ``(s+1)*L - 1`` toward
  the next stage (activations sent, gradients received), ``s*L - 1`` toward the previous one (clamped at 0).
* **DP reductions** (gradient all-reduce / reduce-scatter of a bucket of layers ``lo..hi``): microbatch ``M-1`` ("DP
  coflows always carry the highest MID", §5.3.1) and the bucket's highest layer ``hi``: a bucket is ready once
  its lowest layer's gradient is, and backward reaches high layers first.
* **DP parameter gathers** (ZeRO / distributed optimizer) of layers ``lo..hi``: keyed with the iteration that
  consumes them, microbatch 0, and the bucket's lowest layer ``lo``, so gathers go out in the order the next
  forward needs them (what :class:`~flowlane.hermod.order.HermodOrderConfig` ``dp_mid="consumer"`` ranks first).
* **EP** all-to-alls: the microbatch and layer of the MoE layer that issues them.

:class:`HermodKeys` keeps the per-iteration counters; the adapters translate their framework's event names into
the four p2p directions of :data:`P2P_DIRECTIONS` (Megatron-core's names). Pure Python.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal, get_args

from flowlane.policy import CoflowMeta

#: forward activations go to the next stage (send_next / recv_prev), gradients to the previous (send_prev / recv_next)
P2PDirection = Literal["send_next", "recv_prev", "send_prev", "recv_next"]
P2P_DIRECTIONS: tuple[str, ...] = get_args(P2PDirection)
_TOWARD_NEXT = frozenset({"send_next", "recv_next"})


class HermodKeys:
    """The keys of one rank's coflows, iteration by iteration (see the module docstring for the rules).

    ``next_seq`` numbers the keys in issue order (FIFO tie-break); pass the scheduler's so that its own entries and
    these share one sequence. Call :meth:`end_iteration` once per iteration on every rank, at the same program point.
    """

    def __init__(self, *, num_microbatches: int, layers_per_stage: int, stage: int,
                 next_seq: Callable[[], int] | None = None) -> None:
        for name, v, lo in (("num_microbatches", num_microbatches, 1), ("layers_per_stage", layers_per_stage, 1),
                            ("stage", stage, 0)):
            if not isinstance(v, int) or isinstance(v, bool) or v < lo:
                raise ValueError(f"HermodKeys: {name} must be an integer >= {lo}, got {v!r}")
        self.num_microbatches, self.layers_per_stage, self.stage = num_microbatches, layers_per_stage, stage
        self.iteration = 0
        self._counts = dict.fromkeys(P2P_DIRECTIONS, 0)
        self._seq = 0
        self._next_seq = next_seq or self._own_seq

    def _own_seq(self) -> int:
        self._seq += 1
        return self._seq - 1

    @property
    def first_layer(self) -> int:
        return self.stage * self.layers_per_stage

    @property
    def last_layer(self) -> int:
        return (self.stage + 1) * self.layers_per_stage - 1

    def meta(self, ctype: str, microbatch: int, layer: int, op: str, iteration: int | None = None) -> CoflowMeta:
        """A key with the microbatch clamped to ``M-1`` and the layer at 0 or above."""
        return CoflowMeta(ctype, iteration=self.iteration if iteration is None else iteration,
                          microbatch=min(microbatch, self.num_microbatches - 1), layer=max(layer, 0),
                          stage=self.stage, op=op, seq=self._next_seq())

    def pp(self, direction: P2PDirection) -> CoflowMeta:
        """The key of this rank's next pipeline op in ``direction`` (one of :data:`P2P_DIRECTIONS`)."""
        if direction not in self._counts:
            raise ValueError(f"pipeline direction {direction!r} is not one of {list(P2P_DIRECTIONS)}")
        mb = self._counts[direction]
        self._counts[direction] += 1
        boundary = self.last_layer if direction in _TOWARD_NEXT else self.first_layer - 1
        return self.meta("pp", mb, boundary, direction)

    def dp_reduce(self, layer_hi: int, op: str = "all_reduce") -> CoflowMeta:
        """A gradient reduction of a bucket whose highest layer is ``layer_hi``: MID ``M-1``."""
        return self.meta("dp", self.num_microbatches - 1, layer_hi, op)

    def dp_gather(self, layer_lo: int, op: str = "all_gather", iteration: int | None = None) -> CoflowMeta:
        """A parameter gather of a bucket whose lowest layer is ``layer_lo``, consumed by ``iteration`` (default:
        the current one; a gather issued at the end of a step, after :meth:`end_iteration`, feeds the next)."""
        return self.meta("dp", 0, layer_lo, op, iteration=iteration)

    def ep(self, microbatch: int, layer: int, op: str = "all_to_all") -> CoflowMeta:
        return self.meta("ep", microbatch, layer, op)

    def end_iteration(self) -> None:
        self.iteration += 1
        self._counts = dict.fromkeys(P2P_DIRECTIONS, 0)
