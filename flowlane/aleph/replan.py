"""Re-planning when measured bandwidth drifts (digest §5.1 #13, E10; the seed does not re-cluster).

Every ``replan_every`` iterations the caller hands in fresh per-worker bandwidth figures (from
:func:`flowlane.aleph.probe.probe_bandwidth` or its own counters). Hysteresis, two layers:

1. a worker's figure is replaced only when the new one differs from the figure in use by more than ``hysteresis``
   (relative), so jitter around a capacity threshold never reaches the planner;
2. with the figures in use changed, the current plan is kept unless it is now infeasible (an aggregator has more
   members than its new capacity) or a fresh plan needs fewer flows into the PS (with ``ps_gbps``: is faster, or
   as fast with fewer flows).

With ``ps_gbps`` (digest §5.1 #12) plans are made by :func:`flowlane.aleph.cluster.plan_with_rate` (b lowered to
P/|D| while |D|*b > P) and the plan in force is checked at the fresh plan's b
(:func:`flowlane.aleph.cluster.planned_rate`): it is infeasible when an aggregator exceeds its capacity at that b or
its |D| flows at b exceed P, i.e. when it is slower than a fresh plan. Without ``ps_gbps`` that b is the paper's
(``b_gbps`` or min B), the check above. ``top="ps"`` lowers a plan's rate by its PS head's flows
(:func:`flowlane.aleph.cluster.flow_rate`) but never that b. ``rate`` is the plan in force's.

Every rank must feed the same figures (all-gathered) so every rank takes the same decision: the planner is seeded.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from flowlane.aleph.cluster import (
    Neighbours,
    Plan,
    adjacency_complete,
    capacities,
    flow_rate,
    plan_with_rate,
    planned_rate,
)
from flowlane.aleph.config import PROBE_BYTES, AlephConfig
from flowlane.aleph.model import ps_feasibility


@dataclass(frozen=True)
class ReplanDecision:
    """What :meth:`Replanner.observe` did: ``changed`` (a new plan is in force), ``reason`` and the plan in force."""

    changed: bool
    reason: str
    plan: Plan


class Replanner:
    """Holds the plan in force and the bandwidth figures it was made from."""

    def __init__(
        self,
        bandwidth: Sequence[float],
        config: AlephConfig | None = None,
        adj: Neighbours | None = None,
        cpu: Sequence[float] | None = None,
    ) -> None:
        self.config = config or AlephConfig()
        self.adj = adjacency_complete(len(bandwidth)) if adj is None else adj
        self.cpu = None if cpu is None else list(cpu)
        self.bandwidth = [float(b) for b in bandwidth]
        self.plan, self.rate = self._plan(self.bandwidth)
        """The plan in force and its rate per flow b (Gbit/s, :func:`flowlane.aleph.cluster.flow_rate`)."""

    def _plan(self, bandwidth: Sequence[float]) -> tuple[Plan, float]:
        return plan_with_rate(bandwidth, self.adj, self.config, self.cpu)

    def _infeasible(self, bandwidth: Sequence[float], b: float) -> list[str]:
        """Why the plan in force cannot run at rate ``b`` under ``bandwidth``: capacities (Eq. 1) and the PS check."""
        c = self.config
        bad = self.plan.violations(capacities(bandwidth, b, self.cpu, c.cpu_per_member), self.adj)
        if c.ps_gbps is not None and not (check := ps_feasibility(self.plan, b, c.ps_gbps)).feasible:
            bad.append(
                f"|D|={self.plan.num_flows} flows at b={b:.4g} need {check.ps_load:.4g} > ps_gbps={c.ps_gbps:.4g}"
            )
        return bad

    def due(self, iteration: int) -> bool:
        """Whether ``iteration`` is a re-planning point (every ``replan_every``; never when it is 0)."""
        k = self.config.replan_every
        return k > 0 and iteration > 0 and iteration % k == 0

    def moved(self, bandwidth: Sequence[float]) -> list[int]:
        """The workers whose figure in ``bandwidth`` differs from the one in use by more than the hysteresis."""
        if len(bandwidth) != len(self.bandwidth):
            raise ValueError(f"{len(bandwidth)} bandwidth figures for {len(self.bandwidth)} workers")
        h = self.config.hysteresis
        return [
            w
            for w, (old, new) in enumerate(zip(self.bandwidth, bandwidth, strict=True))
            if abs(new - old) > h * old
        ]

    def observe(self, bandwidth: Sequence[float]) -> ReplanDecision:
        h = self.config.hysteresis
        moved = self.moved(bandwidth)
        if not moved:
            return ReplanDecision(False, f"no worker moved by more than {h:.0%}", self.plan)
        for w in moved:
            self.bandwidth[w] = float(bandwidth[w])
        fresh, rate = self._plan(self.bandwidth)
        # Eq. 1 at the fresh plan's b, not at its rate: top="ps" lowers that by the PS head's flows, and capacities
        # grow as b falls, so an aggregator overloaded at b would pass (E10 root_1probe, iteration 16)
        bad = self._infeasible(self.bandwidth, planned_rate(fresh, self.bandwidth, self.config))
        if bad:
            self.plan, self.rate = fresh, rate
            return ReplanDecision(
                True, f"plan infeasible after workers {moved} moved: {bad[0]}{self._b()}", fresh
            )
        now = flow_rate(self.plan, self.bandwidth, self.config)
        # a faster fresh plan, or as fast with fewer flows (without ps_gbps both rates are b: fewer flows)
        faster = rate > now * (1 + 1e-9)
        if faster or (rate >= now * (1 - 1e-9) and fresh.num_flows < self.plan.num_flows):
            old, self.plan, self.rate = self.plan.num_flows, fresh, rate
            return ReplanDecision(
                True, f"workers {moved} moved; |D| {old} -> {fresh.num_flows}{self._b()}", fresh
            )
        self.rate = now
        return ReplanDecision(
            False,
            f"workers {moved} moved; plan still feasible and no better one "
            f"(|D| {self.plan.num_flows} vs {fresh.num_flows}){self._b()}",
            self.plan,
        )

    def _b(self) -> str:
        """The rate in force, for a decision's reason where the PS check applies (``ps_gbps``)."""
        return "" if self.config.ps_gbps is None else f"; rate per flow {self.rate:.4g} Gbit/s"


def confirm_figures(
    sample: Callable[[], Sequence[float]], replanner: Replanner, samples: int = 2
) -> list[float]:
    """Figures for :meth:`Replanner.observe` that a single slow probe cannot move: take ``sample()``; while it moves a
    worker past the hysteresis, take another (up to ``samples`` in all) and keep each worker's best figure.

    Why (E10, results/aleph/e10_replan_root.json): on a loaded host one probe read two unchanged 400 Mbit/s links as
    229, past the 20 % hysteresis, and the Replanner swapped in a worse plan (|D| 2 -> 4) for two re-planning periods.
    A timed transfer is slowed by CPU contention and never sped up beyond the tbf bucket, so a probe's error is low
    and the best of two readings filters it, while a real change shows in both. A second probe is taken only where
    the first moved someone, so steady state costs one probe. ``sample`` must return the same figures on every rank
    (all-gathered, as :func:`flowlane.aleph.probe.probe_bandwidth` does): then every rank takes the same number of
    samples, and a collective probe cannot hang."""
    if not (isinstance(samples, int) and not isinstance(samples, bool) and samples >= 1):
        raise ValueError(f"samples={samples!r} must be an integer >= 1")
    fig = [float(x) for x in sample()]
    for _ in range(samples - 1):
        if not replanner.moved(fig):
            break
        fig = [max(a, float(b)) for a, b in zip(fig, sample(), strict=True)]
    return fig


def confirmed_probe(
    replanner: Replanner, group: object = None, nbytes: int = PROBE_BYTES, samples: int = 2
) -> Callable[[], list[float]]:
    """The default re-planning probe (the DDP hook, Megatron-core, DeepSpeed):
    :func:`flowlane.aleph.probe.probe_bandwidth` over ``group`` with ``nbytes`` transfers, confirmed by
    :func:`confirm_figures` (a second probe only where the first moves a worker; E10). A collective on ``group``:
    every rank calls it at the same iteration."""
    if not (isinstance(nbytes, int) and not isinstance(nbytes, bool) and nbytes >= 1024):
        raise ValueError(
            f"probe_bytes={nbytes!r} must be an integer >= 1024 (smaller transfers time only latency)"
        )
    from flowlane.aleph import probe  # looked up per call: torch is imported only where a probe runs

    return lambda: confirm_figures(lambda: probe.probe_bandwidth(nbytes, group=group)[0], replanner, samples)
