"""Configuration of ALEPH's control plane (seed 002; digest research/002-aleph.md §2.3-2.4, §5.1)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Literal

VARIANTS = ("paper", "fill")
TOP_MODES = ("allreduce", "ps")
PROBE_BYTES = 1 << 22  # one timed transfer of the bandwidth probe (4 MiB), every caller's default
#: the settings of M-WCHA and its PS check: they act only on a plan made from bandwidth figures, never on given clusters
PLANNER_FIELDS = ("variant", "seed", "b_gbps", "max_empty_rounds", "ps_gbps")


@dataclass(frozen=True)
class AlephConfig:
    """One config for the ALEPH planner (:func:`flowlane.aleph.plan_clusters`) and its re-planner."""

    variant: Literal["paper", "fill"] = "fill"
    """M-WCHA's member assignment (Alg. 1 lines 22-23): ``paper`` adds each unclustered neighbour with probability
    alpha(w), hard-capped at the capacity (digest §5.1 #7); ``fill`` takes exactly min(capacity, candidates) members,
    lowest capacity first (digest §4.2's recommendation: within ~1.1x of the optimum)."""
    seed: int = 0
    """Seed of the planner's random choices (CA selection with probability 1/m, ties, paper assignment)."""
    b_gbps: float | None = None
    """Bandwidth one aggregation flow needs (the paper's b). None: min over workers (paper, §2.2)."""
    cpu_per_member: float = 0.0
    """CPU one aggregated member costs (the paper's c, e.g. 0.1 core). 0: CPU does not limit capacity."""
    max_empty_rounds: int = 5
    """Rounds without any selected aggregator before every unclustered worker goes straight to the PS. The paper
    stops after one (1); digest §5.1 #8 recommends a few."""
    ps_gbps: float | None = None
    """The PS's (or the aggregators' all-reduce) bandwidth P for the check |D|*b <= P (digest §5.1 #12). Where it
    fails, planning and re-planning lower b to P/|D| and re-make the plan at that b, whose larger capacities give
    bigger clusters and fewer flows into the top (:func:`flowlane.aleph.cluster.plan_with_rate`). None: no check."""
    replan_every: int = 100
    """Re-plan every K iterations from fresh bandwidth figures (digest §5.1 #13); 0 never re-plans."""
    hysteresis: float = 0.2
    """A worker's bandwidth figure is replaced only when a new one differs by more than this fraction, so a link that
    jitters around a capacity threshold does not flip the plan every K iterations."""
    top: Literal["allreduce", "ps"] = "allreduce"
    """Top tier of the comm hook: ``allreduce`` among aggregators (no dedicated PS, digest §5.1 #12), or ``ps``:
    reduce to one aggregator, which broadcasts back (the paper's single PS at the root, here one of the heads:
    :func:`flowlane.aleph.model.ps_head` where figures are known). With ``ps`` the flow model counts the PS role's
    extra |D| - 1 flows on that head (:func:`flowlane.aleph.cluster.flow_rate`)."""

    def __post_init__(self) -> None:
        if self.variant not in VARIANTS:
            raise ValueError(f"aleph variant={self.variant!r} is not one of {VARIANTS}")
        if self.top not in TOP_MODES:
            raise ValueError(f"aleph top={self.top!r} is not one of {TOP_MODES}")
        if self.b_gbps is not None and not self.b_gbps > 0:
            raise ValueError(f"aleph b_gbps={self.b_gbps!r} must be > 0 (or None for min bandwidth)")
        if self.ps_gbps is not None and not self.ps_gbps > 0:
            raise ValueError(f"aleph ps_gbps={self.ps_gbps!r} must be > 0 (or None to skip the check)")
        if not self.cpu_per_member >= 0:
            raise ValueError(
                f"aleph cpu_per_member={self.cpu_per_member!r} must be >= 0 (0 = CPU unconstrained)"
            )
        if not (isinstance(self.max_empty_rounds, int) and self.max_empty_rounds >= 1):
            raise ValueError(f"aleph max_empty_rounds={self.max_empty_rounds!r} must be an integer >= 1")
        if not (isinstance(self.replan_every, int) and self.replan_every >= 0):
            raise ValueError(f"aleph replan_every={self.replan_every!r} must be an integer >= 0 (0 = never)")
        if not 0 <= self.hysteresis < 1:
            raise ValueError(f"aleph hysteresis={self.hysteresis!r} must be in [0, 1)")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> AlephConfig:
        """Build from a plain mapping; unknown keys are an error naming them and the allowed ones."""
        allowed = {f.name for f in fields(cls)}
        bad = sorted(set(d) - allowed)
        if bad:
            raise ValueError(f"unknown aleph config key(s) {bad}; allowed: {sorted(allowed)}")
        return cls(**d)
