"""ALEPH's flow-level model: per-iteration communication time of PS, ring all-reduce and an ALEPH plan, the PS
feasibility check, and the multi-PS split (seed 002 §3.1 Table 1, Sec. 7; digest §1.3, §2.9, §5.1 #12).

Aggregation is pipelined per segment, so every flow of a tree advances in lockstep: the tree runs at the rate r of
its tightest budget, and an iteration takes S / r. Budgets are per direction (sending and receiving overlap):

- a member (or a worker sending straight to the PS) sends and receives one flow: r <= B_w;
- an aggregator with k members receives k flows and the PS's result and sends the aggregate and k copies:
  (k + 1) * r <= B_h (the paper's (1 + g_w) * b <= B_w);
- the PS receives |D| flows: |D| * r <= P.

The seed's PS is a machine of its own. flowlane's ``top="ps"`` runs the PS role on one of the cluster heads (there is
no separate server in a DDP/Megatron/DeepSpeed job), whose links then also carry the other |D| - 1 heads' flows up and
their results down: with k members, (k + |D| - 1) * r <= B_h (:func:`ps_head_rate`, counted by ``plan_rate``'s
``ps_head`` and by :func:`flowlane.aleph.cluster.flow_rate` with ``top="ps"``). Eq. 1's capacities do not count them
(M-WCHA is the paper's), so the PS goes on the head with the most bandwidth left for them (:func:`ps_head`).

Ring all-reduce sends 2(n-1)/n * S per worker at the slowest worker's rate; a PS alone gives each worker P/n.
Units are the caller's (Gbit and Gbit/s in the seed's Table 1).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: cluster imports this module (the planner's PS check, digest §5.1 #12)
    from flowlane.aleph.cluster import Plan


@dataclass(frozen=True)
class FlowTime:
    """One scheme's figures: bytes each worker sends, the rate every flow gets, and the iteration's time."""

    traffic: float
    rate: float
    time: float


def _check_bw(bandwidth: Sequence[float], ps: float) -> None:
    if not bandwidth or any(not b > 0 for b in bandwidth):
        raise ValueError(f"every worker bandwidth must be > 0, got {list(bandwidth)}")
    if not ps > 0:
        raise ValueError(f"PS bandwidth must be > 0, got {ps!r}")


def ps_time(size: float, bandwidth: Sequence[float], ps: float) -> FlowTime:
    """Every worker pushes ``size`` to one PS of bandwidth ``ps`` (push and pull overlap)."""
    _check_bw(bandwidth, ps)
    rate = min(min(bandwidth), ps / len(bandwidth))
    return FlowTime(size, rate, size / rate)


def ring_time(size: float, bandwidth: Sequence[float]) -> FlowTime:
    """Ring all-reduce: 2(n-1)/n * size per worker at the slowest link (reduce-scatter + all-gather)."""
    _check_bw(bandwidth, 1.0)
    n = len(bandwidth)
    traffic = 2 * (n - 1) / n * size
    rate = min(bandwidth)
    return FlowTime(traffic, rate, traffic / rate)


def plan_rate(plan: Plan, bandwidth: Sequence[float], ps: float, ps_head: int | None = None) -> float:
    """The lockstep rate of ``plan``'s two-level tree: min over members, aggregators (k+1 flows) and the PS (P/|D|;
    ``ps`` may be ``math.inf`` for no such budget). ``ps_head``: the head that also plays the PS, whose own links
    carry its k members' and the other |D| - 1 heads' flows (:func:`ps_head_rate`)."""
    _check_bw(bandwidth, ps)
    if len(bandwidth) != plan.n:
        raise ValueError(f"{len(bandwidth)} bandwidths for a plan of {plan.n} workers")
    rate = ps / plan.num_flows
    for c in plan.clusters:
        rate = min(rate, bandwidth[c.head] / len(c.members), *(bandwidth[m] for m in c.members[1:]))
    return rate if ps_head is None else min(rate, ps_head_rate(plan, bandwidth, ps_head))


def ps_head_rate(plan: Plan, bandwidth: Sequence[float], head: int) -> float:
    """The rate ``head``'s links allow when it is both its cluster's aggregator and the PS: each direction carries its
    k members' flows and the other |D| - 1 heads' (received up, results sent down): B_h / (k + |D| - 1)."""
    if head not in plan.heads:
        raise ValueError(f"PS position {head} is not a cluster head of the plan (heads: {list(plan.heads)})")
    flows = len(plan.cluster_of(head).members) - 1 + plan.num_flows - 1
    return bandwidth[head] / max(1, flows)


def ps_head(plan: Plan, bandwidth: Sequence[float]) -> int:
    """The head to run the PS role on (``top="ps"``; the seed's PS is a separate machine): the one with the most
    spare bandwidth once it carries the PS's flows, max B_h / (k_h + |D| - 1) (:func:`ps_head_rate`), the lowest
    position on a tie. Every rank computes it from the same plan and figures, so every rank picks the same head."""
    if len(bandwidth) != plan.n:
        raise ValueError(f"{len(bandwidth)} bandwidths for a plan of {plan.n} workers")
    return max(plan.heads, key=lambda h: (ps_head_rate(plan, bandwidth, h), -h))


def aleph_time(size: float, plan: Plan, bandwidth: Sequence[float], ps: float) -> FlowTime:
    """An ALEPH plan: every worker sends ``size`` once (to its aggregator or the PS)."""
    rate = plan_rate(plan, bandwidth, ps)
    return FlowTime(size, rate, size / rate)


def bandwidth_usage(plan: Plan, rate: float) -> tuple[float, float]:
    """(sum over workers of the rate each one sends, the PS's incoming rate) at flow rate ``rate``: the quantities of
    the seed's Fig. 13. An aggregator with k members sends k + 1 flows, so the workers' sum is (2n - |D|) * rate."""
    workers = sum(len(c.members) * rate + (len(c.members) - 1) * rate for c in plan.clusters)
    return workers, plan.num_flows * rate


@dataclass(frozen=True)
class PsCheck:
    """Digest §5.1 #12: can the PS take |D| flows at rate b? If not, the rate every flow gets is P / |D|."""

    feasible: bool
    ps_load: float
    rate: float


def ps_feasibility(plan: Plan, b: float, ps: float) -> PsCheck:
    """|D| * b <= P: the PS's bandwidth is not in Eq. 1, so a plan can ask more of the PS than it has."""
    if not (b > 0 and ps > 0):
        raise ValueError(f"b={b!r} and ps={ps!r} must both be > 0")
    load = plan.num_flows * b
    return PsCheck(load <= ps * (1 + 1e-12), load, min(b, ps / plan.num_flows))


def multi_ps_split(ps_bandwidths: Sequence[float]) -> list[float]:
    """Sec. 7: each aggregator sends to PS j the fraction P_j / sum(P) of its gradient."""
    if not ps_bandwidths or any(not p > 0 for p in ps_bandwidths):
        raise ValueError(f"every PS bandwidth must be > 0, got {list(ps_bandwidths)}")
    total = sum(ps_bandwidths)
    return [p / total for p in ps_bandwidths]


def multi_ps_time(
    size: float, num_flows: int, ps_bandwidths: Sequence[float], split: Sequence[float] | None = None
) -> float:
    """Time for the PS tier to absorb ``num_flows`` flows of ``size`` each when flow parts go to the PSs by
    ``split`` (default: proportional, Sec. 7); the slowest PS finishes last."""
    split = multi_ps_split(ps_bandwidths) if split is None else list(split)
    if len(split) != len(ps_bandwidths) or abs(sum(split) - 1) > 1e-9 or any(f < 0 for f in split):
        raise ValueError(f"split {list(split)} must have one fraction >= 0 per PS, summing to 1")
    return max(num_flows * size * f / p for f, p in zip(split, ps_bandwidths, strict=True))
