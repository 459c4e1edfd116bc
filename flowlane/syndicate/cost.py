"""Execution-plan options and their cost model: alpha-beta per path plus a per-motif overhead delta (digest §5 item 6).

An :class:`Option` is one way to run a comm-op: which ``path`` (an interconnect route plus the library driving it,
seed 004 §5.3's "channel"; we say *path*), its ``algo``, and how it is cut (``segments``, ``spline``). A motif of it
costs ``alpha * steps + beta * wire_bytes * incast_factor + delta`` on its path, where ``steps`` and ``wire_bytes``
are one rank's message count and bytes sent (ring: ``2(N-1)`` steps and ``2(N-1)/N * d`` bytes; tree: ``2 ceil(log2
N)`` steps and ``2 d`` bytes; a splined all-to-all motif: one message per remote destination). ``delta`` is the
fixed dispatch and launch cost of one motif: the paper names it ("too fine-grained motifs are not desirable") but
gives no value, so it is calibrated (:func:`fit_path_cost`, benchmarks/syndicate_delta.py). ``incast`` is an
*assumed* penalty that grows with a motif's fan-in (seed 004 Fig. 17 shows splining pays at large sizes; loopback
cannot measure it, digest §4.1), zero at fan-in 1 and ``incast`` at fan-in N.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from flowlane.syndicate.motif import CommOp, Motif, MotifError, decompose

#: Algorithms: ``ring`` / ``tree`` (the library's own, one motif per segment), ``rs_ag`` (R4: reduce-scatter then
#: all-gather motifs, all-reduce only), ``direct`` (one message per destination: all-to-all, all-gather).
ALGOS: tuple[str, ...] = ("ring", "tree", "rs_ag", "direct")


@dataclass(frozen=True, slots=True)
class Option:
    """One execution-plan choice for a comm-op."""

    path: str
    """Name of the path (a key of :attr:`CostModel.paths`); a motif holds its path exclusively while it runs."""
    algo: str = "ring"
    """One of :data:`ALGOS`."""
    segments: int = 1
    """Segmentation ``S``: the payload (per destination block) is cut into this many byte ranges."""
    spline: int = 1
    """Splining ``P`` (all-to-all, all-gather, broadcast): the destinations are cut into this many groups."""

    def __post_init__(self) -> None:
        if self.algo not in ALGOS:
            raise MotifError(f"Option.algo {self.algo!r} is not one of {ALGOS}")
        for name in ("segments", "spline"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise MotifError(f"Option.{name} must be an integer >= 1, got {v!r}")

    def motifs(self, op: CommOp) -> list[Motif]:
        if self.algo == "rs_ag" and op.kind != "all_reduce":
            raise MotifError(f"Option algo 'rs_ag' applies to all_reduce, not {op.kind!r} ({op.name!r})")
        return decompose(op, self.segments, self.spline, ring=self.algo == "rs_ag")

    def label(self) -> str:
        return f"{self.path}/{self.algo}/S{self.segments}/P{self.spline}"


@dataclass(frozen=True, slots=True)
class PathCost:
    """Alpha-beta-delta parameters of one path."""

    alpha: float
    """Seconds per message step (latency)."""
    beta: float
    """Seconds per byte one rank sends (1 / bandwidth)."""
    delta: float = 0.0
    """Fixed seconds per motif (dispatch + launch), on top of alpha and beta."""
    incast: float = 0.0
    """Assumed extra fraction of wire time at full fan-in (N senders to one destination); 0 at fan-in 1."""

    def __post_init__(self) -> None:
        for name in ("alpha", "beta", "delta", "incast"):
            v = getattr(self, name)
            if not (isinstance(v, int | float) and math.isfinite(v) and v >= 0):
                raise ValueError(f"PathCost.{name} must be a finite number >= 0, got {v!r}")


@dataclass(frozen=True)
class CostModel:
    """Per-path costs, and which paths each collective kind may use (all-reduce reduces on the device, so a
    typical model keeps it off a CPU-driven path: seed 004 Fig. 18)."""

    paths: Mapping[str, PathCost]
    """Path name -> its parameters."""
    allowed: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    """Collective kind -> paths it may use; a kind not listed may use every path."""
    per_kind: Mapping[str, Mapping[str, PathCost]] = field(default_factory=dict)
    """Collective kind -> path -> parameters fitted for that collective alone (digest §5 item 6: fit per collective
    and path); overrides ``paths`` for that kind's motifs."""

    def __post_init__(self) -> None:
        if not self.paths:
            raise ValueError("CostModel.paths is empty; give at least one path")
        for kind, ps in self.allowed.items():
            bad = [p for p in ps if p not in self.paths]
            if bad:
                raise ValueError(
                    f"CostModel.allowed[{kind!r}] names unknown paths {bad}; paths: {sorted(self.paths)}"
                )
        for kind, pcs in self.per_kind.items():
            bad = [p for p in pcs if p not in self.paths]
            if bad:
                raise ValueError(
                    f"CostModel.per_kind[{kind!r}] names unknown paths {bad}; paths: {sorted(self.paths)}"
                )

    def path(self, name: str) -> PathCost:
        if name not in self.paths:
            raise MotifError(f"unknown path {name!r}; the cost model has {sorted(self.paths)}")
        return self.paths[name]

    def motif_time(self, op: CommOp, m: Motif, option: Option) -> float:
        """Seconds one motif holds its path."""
        pc = self.per_kind.get(op.kind, {}).get(option.path) or self.path(option.path)
        n = op.ranks
        d = m.nbytes
        if m.kind == "all_reduce":
            if option.algo == "tree":
                steps, wire = 2 * math.ceil(math.log2(max(n, 2))), 2.0 * d
            else:
                steps, wire = 2 * (n - 1), 2.0 * (n - 1) / n * d
        elif m.kind in ("reduce_scatter", "all_gather") and op.kind == "all_reduce":
            steps, wire = n - 1, (n - 1) / n * d
        elif m.kind == "broadcast":
            steps, wire = math.ceil(math.log2(max(n, 2))), float(d)
        elif m.kind == "reduce_scatter":
            steps, wire = n - 1, float(d) * (n - 1)
        else:  # all_to_all, all_gather: one message per remote destination
            remote = sum(1 for t in m.dests if t % n)
            steps, wire = remote, float(d) * remote
            if remote > 1 and n > 2:
                wire *= 1.0 + pc.incast * (remote - 1) / (n - 2)
        if n == 1:
            steps, wire = 0, 0.0
        return pc.alpha * steps + pc.beta * wire + pc.delta

    def option_allowed(self, op: CommOp, option: Option) -> bool:
        ok = self.allowed.get(op.kind)
        return option.path in self.paths and (ok is None or option.path in ok)

    def standalone(self, op: CommOp, option: Option) -> float:
        """The option's time alone (its motifs in a row on one path): the greedy planner's criterion."""
        return sum(self.motif_time(op, m, option) for m in option.motifs(op))


def option_space(
    op: CommOp,
    cost: CostModel,
    algos: Sequence[str] | None = None,
    segments: Sequence[int] = (1, 2, 4),
    splines: Sequence[int] = (1, 2, 4),
) -> tuple[Option, ...]:
    """Every valid option of ``op`` (digest §5 item 5: algorithm x splining x segments x path), invalid cuts
    dropped. ``algos`` defaults by kind: all-reduce ring/tree/rs_ag, all-to-all and all-gather direct, others
    ring."""
    if algos is None:
        algos = {
            "all_reduce": ("ring", "tree", "rs_ag"),
            "all_to_all": ("direct",),
            "all_gather": ("direct",),
            "broadcast": ("tree",),
        }.get(op.kind, ("ring",))
    out = []
    for path in cost.paths:
        for algo in algos:
            for s in segments:
                for p in splines:
                    o = Option(path, algo, s, p)
                    if not cost.option_allowed(op, o):
                        continue
                    try:
                        o.motifs(op)
                    except MotifError:
                        continue
                    out.append(o)
    if not out:
        raise MotifError(
            f"CommOp {op.name!r}: no valid option (paths {sorted(cost.paths)}, algos {list(algos)})"
        )
    return tuple(out)


def greedy_option(op: CommOp, options: Sequence[Option], cost: CostModel) -> Option:
    """The fastest option alone (what NCCL's tuner does per call); ties: the first listed."""
    return min(options, key=lambda o: cost.standalone(op, o))


def fit_path_cost(samples: Sequence[tuple[int, int, float, float]], incast: float = 0.0) -> PathCost:
    """Least-squares ``PathCost`` from measurements ``(motifs, steps per motif, wire bytes in all, seconds)``:
    ``seconds = motifs * (alpha * steps + delta) + beta * wire``. Alpha and delta separate only when the samples
    vary ``steps`` (e.g. two group sizes); otherwise the per-motif cost is reported as delta with alpha 0.
    Negative fits are clamped to 0 (noise on a busy host)."""
    import numpy as np

    if len(samples) < 2:
        raise ValueError(f"fit_path_cost needs >= 2 samples, got {len(samples)}")
    a = np.array([[k * s, k, w] for k, s, w, _ in samples], dtype=float)
    y = np.array([t for *_, t in samples], dtype=float)
    if np.linalg.matrix_rank(a[:, :2]) < 2:  # steps constant: alpha and delta are one number
        a2 = a[:, 1:]
        (per, beta), *_ = np.linalg.lstsq(a2, y, rcond=None)
        return PathCost(0.0, max(float(beta), 0.0), max(float(per), 0.0), incast)
    (alpha, delta, beta), *_ = np.linalg.lstsq(a, y, rcond=None)
    return PathCost(max(float(alpha), 0.0), max(float(beta), 0.0), max(float(delta), 0.0), incast)
