"""Bandwidth probing at start-up: timed transfers between ranks (digest §5.1 #13; the seed does not say how B_w is
obtained).

``probe_bandwidth(nbytes, rounds)`` runs ``rounds`` shifts of a rotation: in round r every rank i sends ``nbytes``
to (i + r) mod n and receives from (i - r) mod n, all at once after a barrier, so each access link carries exactly
one flow per direction and flows do not share a link on a star. The receiver times its transfer. A flow i -> j runs
at min(up_i, down_j), so worker w's figure is the best rate seen on any flow it took part in: exact for every
worker that met a partner at least as fast, an underestimate (the second-fastest figure) for the fastest worker
when rounds < n - 1 or it has no equal. The n x n matrix of rates is all-gathered, so every rank returns the same
figures and plans the same clusters.

It runs on gloo only (:func:`check_probe_backend`): its buffers are CPU tensors, and it reads the host's clock after
``Work.wait()``, which on NCCL neither takes CPU tensors nor blocks the host until the transfer is done. The plugins
and the DDP hook refuse re-planning with this probe on any other backend at install (a probe on the GPU's own links
is not written: there was no GPU to test it on).
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from flowlane.aleph.config import PROBE_BYTES


def check_probe_backend(group: dist.ProcessGroup | None, key: str) -> None:
    """Refuse, naming ``key`` (the setting that asks for the probe), when ``group``'s backend cannot run the probe:
    gloo, or a multi-device backend whose CPU part is gloo ("cpu:gloo,cuda:nccl")."""
    backend = str(dist.get_backend(group))
    if backend != "gloo" and "cpu:gloo" not in backend.split(","):
        raise ValueError(
            f"{key}: re-planning's bandwidth probe (probe_bandwidth) runs on the group's backend, which is "
            f"{backend!r}; it needs gloo (it times CPU tensors by the host clock after Work.wait(): NCCL refuses CPU "
            "tensors and its wait does not block the host). Set re-planning off, or give a probe of your own"
        )


def probe_bandwidth(
    nbytes: int = PROBE_BYTES, rounds: int | None = None, group: dist.ProcessGroup | None = None
) -> tuple[list[float], list[list[float]]]:
    """(per-rank figure in Gbit/s, matrix rate[src][dst] in Gbit/s, 0 where not probed) over ``group``'s ranks."""
    if not (isinstance(nbytes, int) and nbytes >= 1024):
        raise ValueError(
            f"nbytes={nbytes!r} must be an integer >= 1024 (smaller transfers time only latency)"
        )
    check_probe_backend(group, "probe_bandwidth")
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
    n = len(ranks)
    rounds = n - 1 if rounds is None else rounds
    if not (isinstance(rounds, int) and 1 <= rounds <= max(1, n - 1)):
        raise ValueError(f"rounds={rounds!r} must be an integer in [1, {max(1, n - 1)}] (n={n})")
    me = ranks.index(dist.get_rank())
    row = torch.zeros(n, dtype=torch.float64)  # row[src]: rate of src -> me
    out = torch.ones(nbytes // 4, dtype=torch.float32)
    inb = torch.empty_like(out)
    for r in range(1, rounds + 1) if n > 1 else ():
        dst, src = (me + r) % n, (me - r) % n
        dist.barrier(group=group)
        t0 = time.perf_counter()
        reqs = [dist.isend(out, ranks[dst], group=group), dist.irecv(inb, ranks[src], group=group)]
        reqs[1].wait()
        row[src] = out.numel() * 4 * 8 / (time.perf_counter() - t0) / 1e9
        reqs[0].wait()
    mat = [torch.zeros(n, dtype=torch.float64) for _ in range(n)]
    dist.all_gather(mat, row, group=group)
    rate = [[float(mat[dst][src]) for dst in range(n)] for src in range(n)]
    figure = [max([rate[w][j] for j in range(n)] + [rate[j][w] for j in range(n)]) for w in range(n)]
    return figure, rate
