"""Re-planning when measured bandwidth drifts (digest §5.1 #13, E10; the seed does not re-cluster).

Every ``replan_every`` iterations the caller hands in fresh per-worker bandwidth figures (from
:func:`flowlane.aleph.probe.probe_bandwidth` or its own counters). Hysteresis, two layers:

1. a worker's figure is replaced only when the new one differs from the figure in use by more than ``hysteresis``
   (relative), so jitter around a capacity threshold never reaches the planner;
2. with the figures in use changed, the current plan is kept unless it is now infeasible (an aggregator has more
   members than its new capacity) or a fresh plan needs fewer flows into the PS.

Every rank must feed the same figures (all-gathered) so every rank takes the same decision: the planner is seeded.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from flowlane.aleph.cluster import Neighbours, Plan, adjacency_complete, capacities, mwcha
from flowlane.aleph.config import PROBE_BYTES, AlephConfig


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
        self.plan = self._plan(self.bandwidth)

    def _capacity(self, bandwidth: Sequence[float]) -> list[int]:
        return capacities(bandwidth, self.config.b_gbps, self.cpu, self.config.cpu_per_member)

    def _plan(self, bandwidth: Sequence[float]) -> Plan:
        c = self.config
        return mwcha(self._capacity(bandwidth), self.adj, c.variant, c.seed, c.max_empty_rounds)

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
        bad = self.plan.violations(self._capacity(self.bandwidth), self.adj)
        fresh = self._plan(self.bandwidth)
        if bad:
            self.plan = fresh
            return ReplanDecision(True, f"plan infeasible after workers {moved} moved: {bad[0]}", fresh)
        if fresh.num_flows < self.plan.num_flows:
            old, self.plan = self.plan.num_flows, fresh
            return ReplanDecision(True, f"workers {moved} moved; |D| {old} -> {fresh.num_flows}", fresh)
        return ReplanDecision(
            False,
            f"workers {moved} moved; plan still feasible and no better one "
            f"(|D| {self.plan.num_flows} vs {fresh.num_flows})",
            self.plan,
        )


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
