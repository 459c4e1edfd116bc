"""DGCL's halo exchange (flowlane.plan.GraphExchange) on NCCL (label: measured on one GPU).

Three ranks share the one GPU (their own ``NCCL_HOSTID`` each: NCCL's socket transport over loopback, as
tests/gpu/syndicate_nccl.py). Each case runs on a process group of its own made just before, so the exchange's
one-time all-reduce is that group's first collective (NCCL requires every rank of a group in its first batched
call), then ``graph_allgather`` forward and backward on CUDA tensors:

* ``p2p_mesh``: peer-to-peer on a uniform 3-rank mesh: every pair sends to each other in the same stage (ungrouped
  NCCL send/recv between such a pair can deadlock, NVIDIA/nccl#479; the executor posts each stage as one batch);
* ``spst_relay``: SPST where ranks 0 and 2 have no link: stage 2 only relays through rank 1;
* ``subgroup``: a 2-rank plan on the group of world ranks 1 and 2 (rank 0 takes no part);
* ``pending``: the forward of ``spst_relay`` on a helper thread (``GraphExchange.start``, the pipelined schedule).

Checks, per rank: the forward equals gathering the rows, bitwise; the backward's gradient equals single-process
autograd on CPU (float64, to 1e-12: relays sum with ``index_add_``); no case hangs (each rank's launch timeout).

    python3 tests/gpu/graph_exchange_nccl.py --out $OUT/graph_exchange_nccl.json
    python3 tests/gpu/graph_exchange_nccl.py --backend gloo --device cpu --out /tmp/gx.json   # the logic, on CPU
"""

from __future__ import annotations

import sys
import traceback
from typing import Any

from harness import CPU_LABEL, check_args, init_rank, run_ranks, skip_reason

WORLD = 3
N, DIM = 600, 7


def _case(name: str) -> tuple[Any, Any, list, list[int]]:
    """(relation, plan, local ids per plan rank, world ranks of the plan's ranks): the same on every rank."""
    import numpy as np

    from flowlane.plan import CommRelation, LinkModel, build_plan, full_mesh, mesh_from_matrix

    ranks = [1, 2] if name == "subgroup" else [0, 1, 2]
    rng = np.random.default_rng(len(name))
    src, dst = rng.integers(0, N, N * 5), rng.integers(0, N, N * 5)
    owner = rng.integers(0, len(ranks), N)
    rel = CommRelation.from_edges(src, dst, owner, len(ranks))
    if name in ("spst_relay", "pending"):
        bw = np.full((3, 3), 1e9)
        bw[0, 2] = bw[2, 0] = 0.0  # no link: SPST relays through rank 1
        plan = build_plan(rel, LinkModel.from_topology(mesh_from_matrix(bw)), method="spst")
    else:
        plan = build_plan(rel, LinkModel.from_topology(full_mesh(max(len(ranks), 2), 1e9)), method="p2p")
    return rel, plan, [np.nonzero(owner == r)[0] for r in range(len(ranks))], ranks


def _reference(rel: Any, local_ids: list) -> tuple[Any, Any]:
    """Every row and the gradient of the loss below, in one CPU process."""
    import numpy as np
    import torch

    x = torch.randn(N, DIM, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    w = torch.randn(N, DIM, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    xg = x.clone().requires_grad_(True)
    loss = sum(
        (xg[torch.from_numpy(ids)] * w[torch.from_numpy(ids)] * (r + 1)).sum()
        for r, ids in enumerate(np.concatenate([local_ids[r], rel.needs[r]]) for r in range(rel.num_ranks))
    )
    loss.backward()
    assert xg.grad is not None
    return x, xg.grad


def rank_main(rank: int, world: int, backend: str, device_name: str, timeout_s: float) -> dict[str, Any]:
    import numpy as np
    import torch
    import torch.distributed as dist

    from flowlane.plan import GraphExchange, attach, compile_tables, graph_allgather

    init_rank(rank, world, backend, "flowlane-gx-host", timeout_s, deterministic=False)
    dev = torch.device(device_name)
    out: dict[str, Any] = {"rank": rank, "cases": {}}
    try:
        for name in ("p2p_mesh", "spst_relay", "subgroup", "pending"):
            rel, plan, local_ids, ranks = _case(name)
            group = dist.new_group(
                ranks
            )  # collective on the world; its first op is the exchange's all-reduce
            if rank not in ranks:
                out["cases"][name] = {"member": False}
                continue
            me = ranks.index(rank)
            ex = GraphExchange(compile_tables(plan, rel, local_ids)[me], group=group)
            x, gx = _reference(rel, local_ids)
            ids = torch.from_numpy(np.concatenate([local_ids[me], rel.needs[me]]))
            w = torch.randn(N, DIM, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
            local = x[torch.from_numpy(local_ids[me])].to(dev).requires_grad_(True)
            pipelined = name == "pending"
            full = attach(local, ex.start(local), ex) if pipelined else graph_allgather(local, ex)
            (full * w[ids].to(dev) * (me + 1)).sum().backward()
            if dev.type == "cuda":
                torch.cuda.synchronize()
            assert local.grad is not None
            out["cases"][name] = {
                "member": True,
                "stages": plan.num_stages,
                "relay_rows": int(ex.tables.num_relay),
                "forward_bitwise": bool(torch.equal(full.detach().cpu(), x[ids])),
                "grad_close": bool(
                    torch.allclose(
                        local.grad.cpu(), gx[torch.from_numpy(local_ids[me])], rtol=1e-12, atol=1e-12
                    )
                ),
            }
    except Exception:  # noqa: BLE001 - report, do not lose the other cases' output
        out["error"] = traceback.format_exc()[-3000:]
    return out


def _ok(ranks: list[dict[str, Any]]) -> bool:
    if len(ranks) != WORLD or any("error" in r for r in ranks):
        return False
    members = [c for r in ranks for c in r["cases"].values() if c["member"]]
    relayed = any(r["cases"]["spst_relay"]["relay_rows"] > 0 for r in ranks)
    return relayed and len(members) == 11 and all(c["forward_bitwise"] and c["grad_close"] for c in members)


def main() -> int:
    a = check_args(__doc__, timeout_s=90.0)
    skip = skip_reason(a.backend)
    if skip is not None:
        print(skip)
        return 0
    label = (
        "measured on one GPU (3 NCCL ranks time-sharing it; loopback socket transport)"
        if a.backend == "nccl"
        else CPU_LABEL
    )
    out, ranks = run_ranks(
        "graph_exchange_nccl",
        rank_main,
        WORLD,
        a,
        {"label": label},
        _ok,
        args=(a.backend, a.device, a.timeout),
    )
    for r in ranks:
        print(f"  rank {r['rank']}: {r.get('error', '').strip().splitlines()[-1:] or r['cases']}")
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
