"""Matching-based all-to-all (seed 000 §5.3.2, §5.4: "an asynchronous AlltoAll operator using our matching-based
algorithm"): the split matrix is decomposed into incast-free phases (:mod:`flowlane.hermod.matching`, which also plans) and each phase
runs as one batch of isend/irecv pairs. Every rank plans from the same matrix with the same integer algorithm, so
the plans agree without synchronisation; between phases only the pairwise wait of that phase (no global barrier,
decisions.md A6.1 #10), unless ``phase_sync="barrier"``. The digest (A2.6) expects a transient 2-to-1 incast without a
barrier (a rank that finished phase k sends its phase k+1 flow to a receiver still busy with phase k) and calls the
barrier a tunable. On a rendezvous transport that cannot happen: gloo sends a message's data only once the receiver
has posted the matching receive (its tcp ``Pair::send`` waits for the peer's recv-ready notice), and a receiver posts
phase k+1 only after its phase-k receive has completed. What does overlap on gloo is the sender's side: a send
completes once the kernel has buffered it, so a rank starts phase k+1 while its phase-k data still drains, and the
two flows share its uplink (``benchmarks.hermod_intra_real --tcp-wmem`` bounds that). Measured, the barrier only
costs time (results/hermod/README.md, "Intra-coflow all-to-all, measured"); pairwise is the default.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from flowlane import comm
from flowlane.hermod.matching import (
    AUTO_CANDIDATES,
    PHASE_SYNCS,
    RUN_ALGORITHMS,
    Algorithm,
    PhaseSync,
    RankPlan,
    RunAlgorithm,
    check_candidates,
    needs_matching,
    plan_for_rank,
)

#: the planners that ``max_phases`` caps (Birkhoff-von Neumann; Algorithm 3 and the plain all-to-all have no cap)
CAPPED_ALGORITHMS = ("bvn", "bvn_bottleneck")


def check_max_phases(
    algorithm: str, candidates: Sequence[str], max_phases: int, name: str = "max_phases"
) -> None:
    """Refuse a phase cap that nothing would read: ``algorithm`` (``auto``: its ``candidates``) runs no BvN plan."""
    if not isinstance(max_phases, int) or isinstance(max_phases, bool) or max_phases < 0:
        raise ValueError(f"{name} must be an integer >= 0 (0: no cap), got {max_phases!r}")
    runs = tuple(candidates) if algorithm == "auto" else (algorithm,)
    if max_phases and not any(a in CAPPED_ALGORITHMS for a in runs):
        what = f"auto with candidates {list(runs)}" if algorithm == "auto" else repr(algorithm)
        raise ValueError(
            f"{name}={max_phases} has no effect with {what}: it caps the Birkhoff-von Neumann plans "
            f"({', '.join(CAPPED_ALGORITHMS)}) only; leave it at 0 or run one of them"
        )


def gather_split_matrix(
    input_split_sizes: Sequence[int], group: dist.ProcessGroup | None = None
) -> list[list[int]]:
    """Every rank's input splits -> the full matrix (what Megatron's dispatcher already all-gathers)."""
    n = dist.get_world_size(group)
    device = comm.collective_device(group)
    mine = torch.tensor(list(input_split_sizes), dtype=torch.long, device=device)
    out = [torch.zeros(n, dtype=torch.long, device=device) for _ in range(n)]
    dist.all_gather(out, mine, group=group)
    return [t.tolist() for t in out]


def matched_all_to_all(
    output: torch.Tensor,
    input: torch.Tensor,
    output_split_sizes: Sequence[int],
    input_split_sizes: Sequence[int],
    matrix: Sequence[Sequence[int]],
    group: dist.ProcessGroup | None = None,
    quantum: int = 1,
    algorithm: Algorithm = "bvn",
    kind: str = "ep",
    key: Any = None,
    phase_sync: PhaseSync = "pairwise",
    max_phases: int = 0,
) -> RankPlan:
    """Same result as ``all_to_all_single(output, input, output_split_sizes, input_split_sizes, group)``, sent as
    incast-free phases; returns this rank's part of the plan. ``matrix`` must be identical on every rank (row i = group rank i's input splits).
    ``max_phases`` > 0 caps the plan: its last phase then sends everything left at once (it may incast).
    ``phase_sync``: ``pairwise`` (each rank starts phase k+1 when its own phase-k ops are done) or ``barrier`` (the
    whole group finishes phase k first; module docstring)."""
    if phase_sync not in PHASE_SYNCS:
        raise ValueError(f"phase_sync {phase_sync!r} is not one of {list(PHASE_SYNCS)}")
    ranks = list(range(dist.get_world_size())) if group is None else dist.get_process_group_ranks(group)
    n = len(ranks)
    me = ranks.index(dist.get_rank())
    if len(matrix) != n or any(len(r) != n for r in matrix):
        raise ValueError(f"matrix must be {n}x{n} for a group of {n} ranks")
    if list(matrix[me]) != list(input_split_sizes):
        raise ValueError(f"matrix row {me} {list(matrix[me])} != input_split_sizes {list(input_split_sizes)}")
    if [matrix[i][me] for i in range(n)] != list(output_split_sizes):
        raise ValueError(f"matrix column {me} != output_split_sizes {list(output_split_sizes)}")
    send_off = [0] * n
    recv_off = [0] * n
    for j in range(1, n):
        send_off[j] = send_off[j - 1] + input_split_sizes[j - 1]
        recv_off[j] = recv_off[j - 1] + output_split_sizes[j - 1]
    output[recv_off[me] : recv_off[me] + output_split_sizes[me]].copy_(
        input[send_off[me] : send_off[me] + input_split_sizes[me]]
    )
    plan = plan_for_rank(matrix, me, quantum, algorithm, max_phases=max_phases)  # this rank's part only
    sent = [0] * n
    got = [0] * n

    def moves(
        op: Any,
        pairs: list[tuple[int, int]],
        buf: torch.Tensor,
        splits: Sequence[int],
        off: list[int],
        done: list[int],
    ) -> list[dist.P2POp]:
        """The next rows of ``buf`` to or from each peer of ``pairs`` ((peer, units) of this phase)."""
        out = []
        for peer, units in pairs:
            a = min(units * quantum, splits[peer] - done[peer])
            if a > 0:
                start = off[peer] + done[peer]
                out.append(dist.P2POp(op, buf[start : start + a], ranks[peer], group))
                done[peer] += a
        return out

    for k, sends, recvs in _with_idle_phases(plan, phase_sync == "barrier"):
        # a matched phase gives each rank at most one send and one receive; a residual phase (capped plan) several.
        # Receives are posted first, so a peer's data finds its buffer waiting: with sends first, Hermod's EP time
        # rose 6-10 % on the 8-layer per-rank run (results/hermod/README.md, real_100mbit_l8_*)
        ops = moves(dist.irecv, recvs, output, output_split_sizes, recv_off, got) + moves(
            dist.isend, sends, input, input_split_sizes, send_off, sent
        )
        for w in comm.batch_isend_irecv(ops, kind=kind, key=key):
            w.wait()
        if phase_sync == "barrier" and k < len(plan) - 1:
            dist.barrier(group=group)
    if sent != [input_split_sizes[j] if j != me else 0 for j in range(n)] or got != [
        output_split_sizes[i] if i != me else 0 for i in range(n)
    ]:
        raise RuntimeError(f"matched all-to-all incomplete on group rank {me}: sent {sent}, received {got}")
    return plan


def _with_idle_phases(
    plan: RankPlan, every_phase: bool
) -> list[tuple[int, list[tuple[int, int]], list[tuple[int, int]]]]:
    """The rank's steps; with ``every_phase`` (barrier sync: the whole group meets after each phase) also the phases
    it sits out, with nothing to send or receive."""
    steps = plan.steps()
    if not every_phase:
        return steps
    mine = {k: (s, r) for k, s, r in steps}
    return [(k, *mine.get(k, ([], []))) for k in range(len(plan))]


class AllToAllRunner:
    """Runs a MoE layer's all-to-alls with one algorithm for every group: a planner of :data:`ALGORITHMS` (matched
    phases), ``plain`` (one ``all_to_all_single``) or ``auto``.

    Why ``auto``: matching pays only where fan-in costs something -- ports that drop or pause under incast -- and on
    a deep-buffered or lossless fabric its per-phase cost makes it slower than one all-to-all
    (results/hermod/README.md, "Intra-coflow all-to-all, measured": 1.2-1.7x faster with 64-128 KiB switch buffers,
    16-19 % slower with 1 MiB). The seed always matches (§5.3.2); a user should not have to know the switch's
    buffer depth, so ``auto`` measures.

    What it measures is whole iterations, not all-to-alls. A first version timed each group's first eight
    all-to-alls and picked plain on the shallow-buffered star where BvN makes the iteration 1.3x faster: there most
    plain all-to-alls run near line rate and a minority wait for a retransmission timeout (steady state, 4 ranks,
    64 KiB ports: median plain all-to-all 16 % slower than with deep buffers, their total per iteration 47 %
    slower), a tail a few calls easily miss; an iteration holds dozens of all-to-alls, and also counts what their
    drops cost the DP and pipeline traffic sharing the ports. So the caller marks iteration ends
    (:meth:`end_iteration`, on every rank); iteration 0 warms up (with the first matched candidate), iterations
    1 .. k * ``probe_iterations`` cycle through the k ``candidates`` (default ``plain``, ``bvn``; ``alg3`` may join,
    but two probe iterations do not separate two matchings a few % apart: results/hermod/README.md, "Three
    candidates"), and at the end of the last one an all-reduce over ``decision_group`` (default: all ranks) sums
    every rank's time per candidate, rank 0 of that group decides (the lowest total; a tie keeps the earlier
    candidate, ``plain`` by default, which needs no matrix gather) and broadcasts it, so every rank -- and with it
    every EP group -- keeps the same algorithm for the rest of the run (:attr:`choice`, and the totals in
    :attr:`probe_seconds`). One-shot: re-probing would pay the slower candidates again each time; each candidate
    more costs ``probe_iterations`` iterations more.

    Groups of two never match (:func:`needs_matching`), whatever the choice. Iteration times are host wall times
    between :meth:`end_iteration` calls; on CUDA they follow the device only where the loop synchronises once per
    iteration (Megatron's loss reduction does). On NCCL it ran on one GPU (results/gpu/README.md).
    """

    def __init__(
        self,
        algorithm: RunAlgorithm = "bvn",
        quantum: int = 1,
        probe_iterations: int = 2,
        decision_group: dist.ProcessGroup | None = None,
        candidates: Sequence[str] | str = AUTO_CANDIDATES,
        max_phases: int = 0,
    ) -> None:
        if algorithm not in RUN_ALGORITHMS:
            raise ValueError(f"all-to-all algorithm {algorithm!r} is not one of {list(RUN_ALGORITHMS)}")
        if not isinstance(probe_iterations, int) or probe_iterations < 1:
            raise ValueError(f"probe_iterations must be an integer >= 1, got {probe_iterations!r}")
        if not isinstance(quantum, int) or quantum < 1:
            raise ValueError(f"quantum must be an integer >= 1, got {quantum!r}")
        self.candidates = check_candidates(candidates)
        check_max_phases(algorithm, self.candidates, max_phases)
        self.algorithm, self.quantum, self.probe_iterations = algorithm, quantum, probe_iterations
        self.max_phases = max_phases
        self.decision_group = decision_group
        self.iteration = 0
        self.choice: str | None = None if algorithm == "auto" else algorithm
        self.probe_seconds: dict[str, float] = dict.fromkeys(self.candidates, 0.0)
        self._t0: float | None = None
        #: matched all-to-alls whose split matrix the caller handed over / that had to gather it (one all_gather)
        self.matrices_given = 0
        self.matrices_gathered = 0

    @property
    def current(self) -> str:
        """The algorithm this iteration's all-to-alls run (``auto``: the probe's candidate until decided)."""
        if self.choice is not None:
            return self.choice
        if self.iteration == 0:  # warm-up: the matrix gather and the planner's first call
            return next(c for c in self.candidates if c != "plain")
        return self.candidates[(self.iteration - 1) % len(self.candidates)]

    def __call__(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: Sequence[int],
        input_split_sizes: Sequence[int],
        group: dist.ProcessGroup | None = None,
        matrix: Sequence[Sequence[int]] | None = None,
        kind: str = "ep",
        key: Any = None,
    ) -> str:
        """Same result as ``all_to_all_single``. ``matrix``: the group's split matrix if the caller already has it
        (Megatron's dispatcher gathers it anyway); gathered here when a matched algorithm needs it. Returns the
        algorithm that ran."""
        algorithm = self.current if needs_matching(dist.get_world_size(group)) else "plain"
        if algorithm == "plain":
            comm.all_to_all_single(
                output,
                input,
                list(output_split_sizes),
                list(input_split_sizes),
                group=group,
                kind=kind,
                key=key,
            )
            return algorithm
        if matrix is None:
            matrix = gather_split_matrix(input_split_sizes, group)
            self.matrices_gathered += 1
        else:
            self.matrices_given += 1
        matched_all_to_all(
            output,
            input,
            output_split_sizes,
            input_split_sizes,
            matrix,
            group=group,
            max_phases=self.max_phases if algorithm in CAPPED_ALGORITHMS else 0,  # auto's alg3 runs uncapped
            quantum=self.quantum,
            algorithm=algorithm,
            kind=kind,
            key=key,
        )  # type: ignore[arg-type]
        return algorithm

    def end_iteration(self, key: Any = None) -> None:
        """Mark the end of a training iteration; every rank of ``decision_group`` must call it at the same point
        (``auto`` runs its decision collectives here once, recorded with ``key``). Costs nothing for a fixed
        algorithm."""
        now = time.perf_counter()
        if self.choice is None:
            if self.iteration >= 1 and self._t0 is not None:
                self.probe_seconds[self.current] += now - self._t0
            if self.iteration == len(self.candidates) * self.probe_iterations:
                self.choice = self._decide(key)
        self.iteration += 1
        self._t0 = time.perf_counter()

    def _decide(self, key: Any) -> str:
        """Sum every rank's probe times, decide on the group's first rank, broadcast: one answer everywhere even if
        a transport's reduction were to round differently per rank."""
        g = self.decision_group
        device = comm.collective_device(g)
        stats = torch.tensor(
            [self.probe_seconds[c] for c in self.candidates], dtype=torch.float64, device=device
        )
        comm.all_reduce(stats, group=g, kind="ep", key=key)
        self.probe_seconds = dict(zip(self.candidates, stats.tolist(), strict=True))
        totals = stats.tolist()
        # ties: the earlier one
        pick = torch.tensor([totals.index(min(totals))], dtype=torch.long, device=device)
        first = 0 if g is None else dist.get_process_group_ranks(g)[0]
        comm.broadcast(pick, src=first, group=g, kind="ep", key=key)
        return self.candidates[int(pick.item())]
