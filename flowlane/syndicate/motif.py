"""The motif IR (seed 004 §4.2; digest §2.2-2.3): a comm-op cut into non-preemptible groups of point-to-point transfers.

A :class:`CommOp` is one collective as the application submits it: a kind, a group of ``ranks`` processes and a
per-rank payload of ``nbytes``. A :class:`Motif` is a slice of it:

* **segmentation** (``S``, rules R1/R3) slices the payload: every motif covers a byte range ``[lo, hi)`` of each
  per-destination block (all-to-all, all-gather, reduce-scatter) or of the buffer (all-reduce, broadcast);
* **splining** (``P``, rules R2/R4) slices the pattern: an all-to-all motif ``c`` of an ``n``-wide spline has every
  rank ``i`` send to the ``n`` consecutive destinations ``(i + c*n + t) mod N``, ``t = 0..n-1`` (digest §2.3: the
  ``a%N : b%N`` range wraps, so it is "n consecutive ranks modulo N", never a Python slice); an all-reduce splined
  as a ring becomes a reduce-scatter motif followed by an all-gather motif (R4), the second depending on the first.

The unmodified collective is one motif (``d = D``, ``n = N``). :func:`decompose` applies the two operators,
:func:`validate` checks a motif set against its op: the union of (src, dst, byte range) transfers is the op's, with no
transfer twice, and R4's reduce-scatter -> all-gather dependency is kept. This module is pure Python.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

#: Collective kinds a comm-op may have.
KINDS: tuple[str, ...] = ("all_reduce", "all_to_all", "all_gather", "reduce_scatter", "broadcast")
#: Kinds whose pattern can be splined by destination offset (rule R2 and its all-gather / broadcast analogues).
SPLINABLE: tuple[str, ...] = ("all_to_all", "all_gather", "broadcast")


class MotifError(ValueError):
    """A comm-op, option or motif set breaks the IR's rules; the message names the value and what is allowed."""


@dataclass(frozen=True, slots=True)
class CommOp:
    """One collective as submitted: ``nbytes`` is the per-rank payload (all-to-all: the whole send buffer, ``ranks``
    equal blocks, one per destination; all-gather: one rank's input; reduce-scatter: one rank's output block)."""

    name: str
    kind: str
    nbytes: int
    ranks: int
    align: int = 4
    """Segment boundaries are multiples of this many bytes (the element size)."""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise MotifError(f"CommOp {self.name!r}: kind {self.kind!r} is not one of {KINDS}")
        if not isinstance(self.ranks, int) or self.ranks < 1:
            raise MotifError(f"CommOp {self.name!r}: ranks must be an integer >= 1, got {self.ranks!r}")
        if not isinstance(self.align, int) or self.align < 1:
            raise MotifError(f"CommOp {self.name!r}: align must be an integer >= 1, got {self.align!r}")
        if not isinstance(self.nbytes, int) or self.nbytes < self.align or self.nbytes % self.align:
            raise MotifError(
                f"CommOp {self.name!r}: nbytes must be a positive multiple of align={self.align}, "
                f"got {self.nbytes!r}"
            )
        if self.kind == "all_to_all" and self.nbytes % (self.ranks * self.align):
            raise MotifError(
                f"CommOp {self.name!r}: an all-to-all's nbytes={self.nbytes} must split into ranks="
                f"{self.ranks} blocks of whole elements (a multiple of {self.ranks * self.align})"
            )

    @property
    def block_bytes(self) -> int:
        """Bytes of one per-destination block (all-to-all) or the whole payload (other kinds)."""
        return self.nbytes // self.ranks if self.kind == "all_to_all" else self.nbytes


@dataclass(frozen=True, slots=True)
class Motif:
    """A slice of ``op``: kind ``kind`` (the op's, or reduce_scatter / all_gather for a ring-splined all-reduce)
    over bytes ``[lo, hi)`` of each block and destination offsets ``dests`` (rank ``i`` sends to ``(i + t) % N``
    for ``t`` in ``dests``; all offsets for an unsplined motif). ``after`` are indices (within the op's motif list)
    this motif must follow."""

    op: str
    index: int
    kind: str
    lo: int
    hi: int
    dests: tuple[int, ...]
    after: tuple[int, ...] = ()

    @property
    def nbytes(self) -> int:
        """Bytes one rank contributes to this motif (per destination block for all-to-all: times ``len(dests)``)."""
        return self.hi - self.lo

    @property
    def fan_in(self) -> int:
        """Senders each destination hears from at once (splining cuts it from N to n; digest §2.3)."""
        return len(self.dests)


def segment_bounds(nbytes: int, segments: int, align: int) -> list[tuple[int, int]]:
    """``segments`` contiguous ``[lo, hi)`` ranges covering ``[0, nbytes)``, boundaries on ``align`` (R1/R3)."""
    if not isinstance(segments, int) or segments < 1:
        raise MotifError(f"segments must be an integer >= 1, got {segments!r}")
    elems = nbytes // align
    if segments > elems:
        raise MotifError(f"segments={segments} exceeds the {elems} elements of a {nbytes}-byte payload")
    base, extra = divmod(elems, segments)
    out, lo = [], 0
    for s in range(segments):
        hi = lo + (base + (s < extra)) * align
        out.append((lo, hi))
        lo = hi
    return out


def spline_offsets(ranks: int, ways: int) -> list[tuple[int, ...]]:
    """Destination-offset groups of a ``ways``-way spline (R2): ``ways`` groups of ``n = ranks / ways`` consecutive
    offsets; motif ``c`` of rank ``i`` sends to ``(i + c*n + t) % ranks``."""
    if not isinstance(ways, int) or ways < 1 or ranks % ways:
        raise MotifError(f"spline ways={ways!r} must be an integer >= 1 dividing ranks={ranks}")
    n = ranks // ways
    return [tuple(range(c * n, (c + 1) * n)) for c in range(ways)]


def decompose(op: CommOp, segments: int = 1, spline: int = 1, ring: bool = False) -> list[Motif]:
    """The motifs of ``op`` under ``segments``-way segmentation and ``spline``-way splining (all-to-all,
    all-gather, broadcast) or the ring splining RS -> AG (all-reduce, ``ring=True``). Order: spline-major, then
    segment, which is the order a FIFO enforcer would launch them."""
    if spline != 1 and op.kind not in SPLINABLE:
        raise MotifError(
            f"CommOp {op.name!r}: splining applies to {SPLINABLE}, not {op.kind!r} "
            f"(an all-reduce is splined with ring=True)"
        )
    if ring and op.kind != "all_reduce":
        raise MotifError(f"CommOp {op.name!r}: ring splining (R4) applies to all_reduce, not {op.kind!r}")
    if ring and (op.nbytes // op.align) % (segments * op.ranks):
        raise MotifError(
            f"CommOp {op.name!r}: ring splining needs each of the {segments} segments to split into "
            f"ranks={op.ranks} whole-element pieces ({op.nbytes} bytes, align {op.align})"
        )
    bounds = segment_bounds(op.block_bytes, segments, op.align)
    groups = spline_offsets(op.ranks, spline) if op.kind in SPLINABLE else [tuple(range(op.ranks))]
    motifs: list[Motif] = []
    for dests in groups:
        for lo, hi in bounds:
            if ring:
                rs = len(motifs)
                motifs.append(Motif(op.name, rs, "reduce_scatter", lo, hi, dests))
                motifs.append(Motif(op.name, rs + 1, "all_gather", lo, hi, dests, after=(rs,)))
            else:
                motifs.append(Motif(op.name, len(motifs), op.kind, lo, hi, dests))
    return motifs


def _cover(what: str, pieces: Iterable[tuple[int, int]], total: int) -> None:
    at = 0
    for lo, hi in sorted(pieces):
        if lo != at:
            raise MotifError(f"{what}: bytes [{at}, {lo}) are {'sent twice' if lo < at else 'never sent'}")
        if hi <= lo:
            raise MotifError(f"{what}: empty or inverted byte range [{lo}, {hi})")
        at = hi
    if at != total:
        raise MotifError(f"{what}: bytes [{at}, {total}) are never sent")


def validate(op: CommOp, motifs: Sequence[Motif]) -> None:
    """Raise :class:`MotifError` unless ``motifs`` is a correct-by-construction cut of ``op``: each (destination
    offset, byte) of the pattern is covered exactly once per stage, kinds fit the op, indices are dense, and a
    ring-splined all-reduce's all-gather follows the reduce-scatter of the same range."""
    if not motifs:
        raise MotifError(f"CommOp {op.name!r}: no motifs")
    for k, m in enumerate(motifs):
        if m.op != op.name:
            raise MotifError(f"motif {k} belongs to op {m.op!r}, not {op.name!r}")
        if m.index != k:
            raise MotifError(f"CommOp {op.name!r}: motif at position {k} has index {m.index}")
        if any(not 0 <= a < k for a in m.after):
            raise MotifError(f"CommOp {op.name!r}: motif {k} follows {m.after}, which are not earlier motifs")
        if m.hi > op.block_bytes or m.lo < 0 or m.lo % op.align or m.hi % op.align:
            raise MotifError(
                f"CommOp {op.name!r}: motif {k} range [{m.lo}, {m.hi}) is outside [0, "
                f"{op.block_bytes}) or not on {op.align}-byte boundaries"
            )
        if any(not 0 <= t < op.ranks for t in m.dests) or len(set(m.dests)) != len(m.dests):
            raise MotifError(
                f"CommOp {op.name!r}: motif {k} destination offsets {m.dests} are not distinct "
                f"values in [0, {op.ranks})"
            )
    kinds = {m.kind for m in motifs}
    if op.kind == "all_reduce" and kinds == {"reduce_scatter", "all_gather"}:
        stages = {
            "reduce_scatter": [m for m in motifs if m.kind == "reduce_scatter"],
            "all_gather": [m for m in motifs if m.kind == "all_gather"],
        }
        rs_at = {(m.lo, m.hi): m.index for m in stages["reduce_scatter"]}
        for m in stages["all_gather"]:
            if rs_at.get((m.lo, m.hi)) not in m.after:
                raise MotifError(
                    f"CommOp {op.name!r}: all-gather motif {m.index} over [{m.lo}, {m.hi}) does not "
                    f"follow the reduce-scatter of that range (R4: RS -> AG)"
                )
    elif kinds == {op.kind}:
        stages = {op.kind: list(motifs)}
    else:
        raise MotifError(
            f"CommOp {op.name!r} ({op.kind}): motif kinds {sorted(kinds)} are not allowed; use "
            f"{op.kind!r}" + (" or reduce_scatter + all_gather" if op.kind == "all_reduce" else "")
        )
    for stage, ms in stages.items():
        if op.kind in SPLINABLE:
            for t in range(op.ranks):
                _cover(
                    f"CommOp {op.name!r} {stage} offset {t}",
                    [(m.lo, m.hi) for m in ms if t in m.dests],
                    op.block_bytes,
                )
        else:
            if any(len(m.dests) != op.ranks for m in ms):
                raise MotifError(f"CommOp {op.name!r}: a {op.kind} cannot be splined by destination")
            _cover(f"CommOp {op.name!r} {stage}", [(m.lo, m.hi) for m in ms], op.block_bytes)


def transfers(op: CommOp, motifs: Sequence[Motif]) -> set[tuple[int, int, int, int]]:
    """The (src, dst, lo, hi) point-to-point transfers of the splinable kinds' motifs (all-to-all: bytes of the
    block for ``dst``; all-gather: bytes of ``src``'s input; broadcast from rank 0: src is the root), for checking
    that a cut keeps the op's pattern. Raises on a transfer that appears twice."""
    if op.kind not in SPLINABLE:
        raise MotifError(f"transfers() lists point-to-point patterns of {SPLINABLE}, not {op.kind!r}")
    out: set[tuple[int, int, int, int]] = set()
    for m in motifs:
        srcs = [0] if op.kind == "broadcast" else range(op.ranks)
        for i in srcs:
            for t in m.dests:
                tr = (i, (i + t) % op.ranks, m.lo, m.hi)
                if tr in out:
                    raise MotifError(f"CommOp {op.name!r}: transfer {tr} appears twice")
                out.add(tr)
    return out
