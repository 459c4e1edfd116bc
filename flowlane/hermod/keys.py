"""How a framework adapter names its operations as Hermod coflows (seed 000 §5.3.1; decisions.md A6.1 #1, #6).

One rank of stage ``s`` with ``L`` layers per stage owns global layers ``s*L .. s*L+L-1``. Its coflows are keyed:

* **PP** (``ctype="pp"``): the microbatch ID is the number of earlier ops in the same direction this iteration (the
  schedule issues each direction in microbatch order, 1F1B included), clamped to ``M-1``; the layer ID is the
  stage-boundary layer the data crosses, the last layer before the boundary (decisions.md A6.1 #6): ``(s+1)*L - 1`` toward
  the next stage (activations sent, gradients received), ``s*L - 1`` toward the previous one (clamped at 0).
* **DP reductions** (gradient all-reduce / reduce-scatter of a bucket of layers ``lo..hi``): microbatch ``M-1`` ("DP
  coflows always carry the highest MID", §5.3.1) and the bucket's highest layer ``hi``: a bucket is ready once
  its lowest layer's gradient is, and backward reaches high layers first.
* **DP parameter gathers** (ZeRO / distributed optimizer) of layers ``lo..hi``: keyed with the iteration that
  consumes them, microbatch 0, and the bucket's lowest layer ``lo``, so gathers go out in the order the next
  forward needs them (what :class:`~flowlane.hermod.order.HermodOrderConfig` ``dp_mid="consumer"`` ranks first).
* **EP** all-to-alls: the microbatch and layer of the MoE layer that issues them.

The interleaved schedule (``virtual_chunks`` V > 1; seed 000 §5.3.1) runs V model chunks per stage, chunk ``c`` of
stage ``s`` holding global layers ``(c*S + s)*Lc ..`` (``Lc = L / V`` layers per chunk, ``S`` stages). Its forward
passes go through the *virtual microbatches* of Megatron's schedule table (groups of ``microbatch_group`` microbatches,
each group through every chunk in turn: :func:`interleaved_order`), its backward passes through the same table with
the chunks reversed, and each direction's ops follow that order, minus the chunks that have no peer in that direction
(the first stage's chunk 0 receives nothing from before it, the last stage's chunk V-1 sends nothing after it). The
n-th op of a direction is therefore keyed with the microbatch and chunk boundary layer of the n-th entry.

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


def interleaved_order(
    num_microbatches: int, virtual_chunks: int, microbatch_group: int
) -> list[tuple[int, int]]:
    """The forward order of an interleaved pipeline schedule as ``(microbatch, chunk)`` pairs: microbatches in groups
    of ``microbatch_group`` (the last group takes the rest), each group through chunk 0, 1, .., V-1 in turn."""
    for name, v in (
        ("num_microbatches", num_microbatches),
        ("virtual_chunks", virtual_chunks),
        ("microbatch_group", microbatch_group),
    ):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"interleaved_order: {name} must be an integer >= 1, got {v!r}")
    order: list[tuple[int, int]] = []
    lo = 0
    while lo < num_microbatches:
        hi = num_microbatches if lo + microbatch_group >= num_microbatches else lo + microbatch_group
        order += [(mb, c) for c in range(virtual_chunks) for mb in range(lo, hi)]
        lo = hi
    return order


class HermodKeys:
    """The keys of one rank's coflows, iteration by iteration (see the module docstring for the rules).

    ``next_seq`` numbers the keys in issue order (FIFO tie-break); pass the scheduler's so that its own entries and
    these share one sequence. Call :meth:`end_iteration` once per iteration on every rank, at the same program point.
    """

    def __init__(
        self,
        *,
        num_microbatches: int,
        layers_per_stage: int,
        stage: int,
        next_seq: Callable[[], int] | None = None,
        num_stages: int = 1,
        virtual_chunks: int = 1,
        microbatch_group: int | None = None,
    ) -> None:
        for name, v, lo in (
            ("num_microbatches", num_microbatches, 1),
            ("layers_per_stage", layers_per_stage, 1),
            ("stage", stage, 0),
            ("num_stages", num_stages, 1),
            ("virtual_chunks", virtual_chunks, 1),
        ):
            if not isinstance(v, int) or isinstance(v, bool) or v < lo:
                raise ValueError(f"HermodKeys: {name} must be an integer >= {lo}, got {v!r}")
        if layers_per_stage % virtual_chunks:
            raise ValueError(
                f"HermodKeys: layers_per_stage={layers_per_stage} must be divisible by "
                f"virtual_chunks={virtual_chunks}"
            )
        if stage >= num_stages and virtual_chunks > 1:
            raise ValueError(f"HermodKeys: stage={stage} must be < num_stages={num_stages}")
        self.num_microbatches, self.layers_per_stage, self.stage = num_microbatches, layers_per_stage, stage
        self.num_stages, self.virtual_chunks = num_stages, virtual_chunks
        #: Megatron's microbatch_group_size_per_vp_stage (default: the number of stages)
        self.microbatch_group = num_stages if microbatch_group is None else microbatch_group
        self._orders: dict[tuple[str, int], list[tuple[int, int]]] = {}
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

    def meta(
        self, ctype: str, microbatch: int, layer: int, op: str, iteration: int | None = None
    ) -> CoflowMeta:
        """A key with the microbatch clamped to ``M-1`` and the layer at 0 or above."""
        return CoflowMeta(
            ctype,
            iteration=self.iteration if iteration is None else iteration,
            microbatch=min(microbatch, self.num_microbatches - 1),
            layer=max(layer, 0),
            stage=self.stage,
            op=op,
            seq=self._next_seq(),
        )

    def chunk_layers(self, chunk: int) -> tuple[int, int]:
        """First and last global layer of this stage's model chunk ``chunk``."""
        per = self.layers_per_stage // self.virtual_chunks
        first = (chunk * self.num_stages + self.stage) * per
        return first, first + per - 1

    def _direction_order(self, direction: str) -> list[tuple[int, int]]:
        """(microbatch, chunk) of each op of ``direction`` this iteration, in issue order (interleaved only)."""
        key = (direction, self.num_microbatches)
        if key not in self._orders:
            v, first, last = self.virtual_chunks, self.stage == 0, self.stage == self.num_stages - 1
            table = interleaved_order(self.num_microbatches, v, self.microbatch_group)
            forward = direction in ("send_next", "recv_prev")
            steps = [(mb, c if forward else v - 1 - c) for mb, c in table]
            if direction in ("recv_prev", "send_prev"):  # the first virtual stage has no previous
                steps = [(mb, c) for mb, c in steps if not (first and c == 0)]
            else:  # send_next, recv_next: the last virtual stage has no next
                steps = [(mb, c) for mb, c in steps if not (last and c == v - 1)]
            self._orders[key] = steps
        return self._orders[key]

    def pp(self, direction: P2PDirection) -> CoflowMeta:
        """The key of this rank's next pipeline op in ``direction`` (one of :data:`P2P_DIRECTIONS`)."""
        if direction not in self._counts:
            raise ValueError(f"pipeline direction {direction!r} is not one of {list(P2P_DIRECTIONS)}")
        n = self._counts[direction]
        self._counts[direction] += 1
        if self.virtual_chunks == 1:
            mb, (first, last) = n, (self.first_layer, self.last_layer)
        else:
            order = self._direction_order(direction)
            mb, chunk = order[min(n, len(order) - 1)]
            first, last = self.chunk_layers(chunk)
        boundary = last if direction in _TOWARD_NEXT else first - 1
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
