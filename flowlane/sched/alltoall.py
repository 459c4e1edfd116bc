"""Matching-based all-to-all (seed 000 §5.3.2, §5.4: "an asynchronous AlltoAll operator using our matching-based
algorithm"): the split matrix is decomposed into incast-free phases (:mod:`flowlane.sched.matching`) and each phase
runs as one batch of isend/irecv pairs. Every rank plans from the same matrix with the same integer algorithm, so
the plans agree without synchronisation; between phases only the pairwise wait of that phase (no global barrier,
digest A6.1 #10), unless ``phase_sync="barrier"``. The digest (A2.6) expects a transient 2-to-1 incast without a
barrier (a rank that finished phase k sends its phase k+1 flow to a receiver still busy with phase k) and calls the
barrier a tunable. On a rendezvous transport that cannot happen: gloo sends a message's data only once the receiver
has posted the matching receive (its tcp ``Pair::send`` waits for the peer's recv-ready notice), and a receiver posts
phase k+1 only after its phase-k receive has completed. What does overlap on gloo is the sender's side: a send
completes once the kernel has buffered it, so a rank starts phase k+1 while its phase-k data still drains, and the
two flows share its uplink (``benchmarks.hermod_intra_real --tcp-wmem`` bounds that). Measured, the barrier only
costs time (README "Intra-coflow all-to-all, measured"); pairwise is the default.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import torch
import torch.distributed as dist

from flowlane import comm
from flowlane.sched.matching import Phase, algorithm3_phases, bvn_phases

Algorithm = Literal["bvn", "bvn_bottleneck", "alg3"]
# bvn_bottleneck: BvN with the max-min matching each step (fewer, longer phases; flowlane.sched.matching)
ALGORITHMS = ("bvn", "bvn_bottleneck", "alg3")
PhaseSync = Literal["pairwise", "barrier"]
PHASE_SYNCS = ("pairwise", "barrier")


def needs_matching(group_size: int) -> bool:
    """Whether phases can beat one ``all_to_all_single`` in a group of ``group_size`` ranks. In a group of two every
    rank receives from one peer only, so there is no incast to avoid: the plan of any 2x2 matrix is the single
    exchange ``all_to_all_single`` makes, and gathering the matrix to find that out is a collective round spent for
    nothing (on the real Megatron MoE benchmark, EP 2 at 800 Mbit/s, it cost ~11 % of the iteration). Decided from
    the group size alone, so every rank of the group decides alike."""
    return group_size > 2


def plan_all_to_all(matrix: Sequence[Sequence[int]], quantum: int = 1, algorithm: Algorithm = "bvn") -> list[Phase]:
    """Phases for ``matrix[i][j]`` rows from group rank i to j, planned in units of ``quantum`` rows (ceil), which
    bounds the number of phases (digest A2.6 "Units")."""
    if not isinstance(quantum, int) or quantum < 1:
        raise ValueError(f"quantum must be an integer >= 1, got {quantum!r}")
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm {algorithm!r} is not one of {list(ALGORITHMS)}")
    q = [[-(-int(v) // quantum) for v in row] for row in matrix]
    if algorithm == "alg3":
        return algorithm3_phases(q)
    return bvn_phases(q, "bottleneck" if algorithm == "bvn_bottleneck" else "first")


def gather_split_matrix(input_split_sizes: Sequence[int], group: dist.ProcessGroup | None = None) -> list[list[int]]:
    """Every rank's input splits -> the full matrix (what Megatron's dispatcher already all-gathers)."""
    n = dist.get_world_size(group)
    mine = torch.tensor(list(input_split_sizes), dtype=torch.long)
    out = [torch.zeros(n, dtype=torch.long) for _ in range(n)]
    dist.all_gather(out, mine, group=group)
    return [t.tolist() for t in out]


def matched_all_to_all(output: torch.Tensor, input: torch.Tensor, output_split_sizes: Sequence[int],
                       input_split_sizes: Sequence[int], matrix: Sequence[Sequence[int]],
                       group: dist.ProcessGroup | None = None, quantum: int = 1, algorithm: Algorithm = "bvn",
                       kind: str = "ep", key: Any = None, phase_sync: PhaseSync = "pairwise") -> list[Phase]:
    """Same result as ``all_to_all_single(output, input, output_split_sizes, input_split_sizes, group)``, sent as
    incast-free phases. ``matrix`` must be identical on every rank (row i = group rank i's input splits).
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
    output[recv_off[me]:recv_off[me] + output_split_sizes[me]].copy_(
        input[send_off[me]:send_off[me] + input_split_sizes[me]])
    phases = plan_all_to_all(matrix, quantum, algorithm)
    sent = [0] * n
    got = [0] * n
    for ph in phases:
        dst, a_out, src, a_in = ph.partner_of(me)
        ops = []
        if dst is not None:
            a = min(a_out * quantum, input_split_sizes[dst] - sent[dst])
            if a > 0:
                t = input[send_off[dst] + sent[dst]: send_off[dst] + sent[dst] + a]
                ops.append(dist.P2POp(dist.isend, t, ranks[dst], group))
                sent[dst] += a
        if src is not None:
            a = min(a_in * quantum, output_split_sizes[src] - got[src])
            if a > 0:
                t = output[recv_off[src] + got[src]: recv_off[src] + got[src] + a]
                ops.append(dist.P2POp(dist.irecv, t, ranks[src], group))
                got[src] += a
        for w in comm.batch_isend_irecv(ops, kind=kind, key=key):
            w.wait()
        if phase_sync == "barrier" and ph is not phases[-1]:
            dist.barrier(group=group)
    if sent != [input_split_sizes[j] if j != me else 0 for j in range(n)] or \
            got != [output_split_sizes[i] if i != me else 0 for i in range(n)]:
        raise RuntimeError(f"matched all-to-all incomplete on group rank {me}: sent {sent}, received {got}")
    return phases
