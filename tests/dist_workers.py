"""Module-level worker functions for tests that spawn ranks (spawned processes must import them)."""

import os
import time

import torch
import torch.distributed as dist

from flowlane import comm, trace


def comm_roundtrip(rank: int, world: int) -> dict:
    with comm.recording() as rec:
        t = torch.full((256,), float(rank))
        comm.all_reduce(t, kind="dp", key=("it", 0))
        out = torch.empty(world * 4)
        comm.all_gather_into_tensor(out, torch.full((4,), float(rank)), kind="dp")
        a2a_out = torch.empty(world * 2)
        comm.all_to_all_single(a2a_out, torch.arange(world * 2, dtype=torch.float32) + 100 * rank, kind="ep")
        peer = rank ^ 1
        buf = torch.empty(1000)
        with trace.span("p2p", rank=rank):
            works = comm.batch_isend_irecv(
                [dist.P2POp(dist.isend, torch.ones(1000) * rank, peer), dist.P2POp(dist.irecv, buf, peer)],
                kind="pp",
                keys=["s", "r"],
            )
            for w in works:
                w.wait()
        events = trace.rank_events(rank)
        return {
            "sum": t[0].item(),
            "gathered": out.tolist(),
            "a2a": a2a_out.tolist(),
            "recv": buf[0].item(),
            "bytes": rec.bytes_by_kind(),
            "ops": [(o.kind, o.op, o.nbytes, o.key, o.end is not None) for o in rec.ops],
            "events": events,
        }


def raise_on_rank_one(rank: int, world: int) -> None:
    if rank == 1:
        raise ValueError("boom from rank one")
    dist.barrier()  # the other ranks wait for rank 1, which never arrives


def hang_on_rank_two(rank: int, world: int) -> None:
    if rank == 2:
        time.sleep(600)


def env_and_parent(rank: int, world: int, name: str) -> tuple[str | None, int, int]:
    return os.environ.get(name), os.getppid(), torch.get_num_threads()


def die_on_rank_zero(rank: int, world: int) -> None:
    if rank == 0:
        os._exit(3)
    time.sleep(600)


def return_tensors(rank: int, world: int) -> dict:
    return {"t": torch.arange(1000, dtype=torch.float32) * rank, "rank": rank}


def class_groups_with(rank: int, world: int, ifnames_by_rank: dict) -> dict:
    """build_class_groups with per-rank gloo class interfaces (None where a rank has none), then an all_reduce of
    the rank id on every class's clone."""
    from flowlane.sched.groups import build_class_groups

    cg = build_class_groups([list(range(world))], gloo_class_ifnames=ifnames_by_rank.get(rank))
    clones = cg.groups[tuple(range(world))]
    sums = []
    for c in range(3):
        t = torch.full((1024,), float(rank))
        dist.all_reduce(t, group=cg.get(None, c))
        sums.append(float(t[0]))
    return {"clones": len(clones), "sums": sums}


def nccl_class_group_calls(rank: int, world: int) -> dict:
    """build_class_groups(backend="nccl") on a gloo world with ``new_group`` recorded instead of run (no GPU here):
    which groups it would create, in which order, with which ``ncclConfig_t.trafficClass``."""
    from flowlane.sched import groups as G

    calls = []

    def record(ranks, backend=None, pg_options=None):
        calls.append([list(ranks), backend, pg_options.config.traffic_class])
        return f"clone{len(calls) - 1}"

    real, dist.new_group = dist.new_group, record
    try:
        mine = [[0, 1], [rank]] if rank == 0 else [[0, 1]]  # rank 0 alone also wants its singleton cloned
        cg = G.build_class_groups(mine, backend="nccl")
    finally:
        dist.new_group = real
    return {"calls": calls, "world_clones": [cg.get(None, c) for c in range(4)], "mine": sorted(cg.groups)}


def owned_groups(rank: int, world: int) -> dict:
    """Groups made inside comm.owned_process_groups are destroyed on a normal exit and kept when the block raises."""
    from torch.distributed import distributed_c10d as c10d

    before = len(c10d._world.pg_map)
    with comm.owned_process_groups():
        g = dist.new_group([0, 1])
        comm.all_reduce(torch.ones(2), group=g)
        inside = len(c10d._world.pg_map)
    after = len(c10d._world.pg_map)
    try:
        with comm.owned_process_groups():
            dist.new_group([0, 1])
            raise KeyError("boom")
    except KeyError:
        pass
    return {"before": before, "inside": inside, "after": after, "after_error": len(c10d._world.pg_map)}
