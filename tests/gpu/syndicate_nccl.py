"""SYNDICATE's enforcer on NCCL (issue #37: "works on gloo and NCCL"; label: measured on one GPU).

Two ranks share the one GPU. Each rank gets its own ``NCCL_HOSTID``, so NCCL treats the ranks as separate hosts and
uses its socket transport over loopback (as tests/gpu/deepspeed_zero3_nccl.py does). There are two paths, F and S,
each its own NCCL communicator. Checks, per rank:

* a plan that reorders motifs across four ops (a float32 all-reduce cut into 4 segments; an all-to-all cut into 2
  segments and splined 2 ways, run as isend/irecv; a splined, segmented int64 all-gather; a second all-reduce on S)
  launches in the plan's order on both ranks (the launch logs are equal), under per-rank jitter;
* its results equal the plain NCCL collectives on the world group: all-to-all and all-gather bitwise, all-reduce
  to rounding;
* a rank that installs another plan is named by the watchdog.

Informational only: an all-reduce of 16 MiB through the enforcer cut into k = 1, 4, 16, 64 motifs, against the plain
call. The ranks time-share the GPU and the wire is loopback, so this is per-motif dispatch cost on NCCL, not a
network figure.

    python3 tests/gpu/syndicate_nccl.py --out $OUT/syndicate_nccl.json
    python3 tests/gpu/syndicate_nccl.py --backend gloo --device cpu --out /tmp/syn.json   # the logic, on CPU
"""

from __future__ import annotations

import os
import random
import sys
import tempfile
import time
import traceback
from typing import Any

from harness import CPU_LABEL, check_args, init_rank, run_ranks, skip_reason

WORLD = 2


def rank_main(rank: int, world: int, backend: str, device_name: str, store_path: str) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from flowlane.syndicate.cost import Option
    from flowlane.syndicate.enforcer import Enforcer, EnforcerConfig, PlanMismatchError
    from flowlane.syndicate.plan import PlanOp, SyndicatePlan

    init_rank(rank, world, backend, "flowlane-syn-host", 60, deterministic=False)
    dev = torch.device(device_name)
    out: dict[str, Any] = {"rank": rank}

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize()

    try:
        store = dist.FileStore(store_path, world)
        paths = {"F": dist.new_group(list(range(world))), "S": dist.new_group(list(range(world)))}
        ops = [
            PlanOp("ar0", "all_reduce", 4096, "float32", world, Option("F", "ring", 4)),
            PlanOp("a2a", "all_to_all", world * 512, "float32", world, Option("S", "direct", 2, world)),
            PlanOp("ag", "all_gather", 256, "int64", world, Option("F", "direct", 2, world)),
            PlanOp("ar1", "all_reduce", 999, "float32", world, Option("S", "ring", 2)),
        ]
        fifo = SyndicatePlan.fifo(ops, 1)
        order = list(fifo.order)
        random.Random(7).shuffle(order)
        plan = SyndicatePlan(1, fifo.ops, tuple(order))

        def inputs(it: int) -> list:
            g = torch.Generator().manual_seed(100 * it + rank)
            return [
                t.to(dev)
                for t in (
                    torch.randn(4096, generator=g),
                    torch.randn(world * 512, generator=g),
                    torch.randint(-1000, 1000, (256,), generator=g),
                    torch.randn(999, generator=g),
                )
            ]

        enf = Enforcer(paths, store, rank, world, EnforcerConfig(namespace="plan"))
        enf.install(plan)
        jitter = random.Random(rank)
        checks = []
        for it in range(3):
            x = inputs(it)
            a2a = torch.empty_like(x[1])
            ag = torch.empty(world * 256, dtype=torch.int64, device=dev)
            hs = []
            time.sleep(jitter.uniform(0, 0.02))
            hs.append(enf.all_reduce(x[0]))
            time.sleep(jitter.uniform(0, 0.02))
            hs.append(enf.all_to_all_single(a2a, x[1]))
            time.sleep(jitter.uniform(0, 0.02))
            hs.append(enf.all_gather_into_tensor(ag, x[2]))
            time.sleep(jitter.uniform(0, 0.02))
            hs.append(enf.all_reduce(x[3]))
            for h in hs:
                h.wait()
            enf.step()
            ref = inputs(it)
            dist.all_reduce(ref[0])
            ra = torch.empty_like(ref[1])
            dist.all_to_all_single(ra, ref[1])
            rg = torch.empty(world * 256, dtype=torch.int64, device=dev)
            dist.all_gather_into_tensor(rg, ref[2])
            dist.all_reduce(ref[3])
            sync()
            checks.append(
                {
                    "a2a_bitwise": bool(torch.equal(a2a, ra)),
                    "ag_bitwise": bool(torch.equal(ag, rg)),
                    "ar_close": bool(
                        torch.allclose(x[0], ref[0], rtol=1e-5, atol=1e-5)
                        and torch.allclose(x[3], ref[3], rtol=1e-5, atol=1e-5)
                    ),
                }
            )
        out.update(checks=checks, log=list(enf.log), order=[list(e) for e in plan.order], events=enf.events)

        enf2 = Enforcer(paths, store, rank, world, EnforcerConfig(namespace="mismatch"))
        try:
            other = list(fifo.order)
            random.Random(8 if rank == 0 else 7).shuffle(other)
            enf2.install(SyndicatePlan(1, fifo.ops, tuple(other)))
            out["mismatch"] = None
        except PlanMismatchError as e:
            out["mismatch"] = str(e)

        n = (16 << 20) // 4
        base = torch.randn(n, device=dev)
        timing: dict[str, float] = {}
        enf3 = Enforcer({"F": paths["F"]}, store, rank, world, EnforcerConfig(namespace="t", check_every=0))
        for k in (1, 4, 16, 64):
            enf3.install(
                SyndicatePlan.fifo(
                    [PlanOp("ar", "all_reduce", n, "float32", world, Option("F", "ring", k))], 1
                ),
                verify=False,
            )
            ts = []
            for _ in range(4):
                y = base.clone()
                dist.barrier()
                sync()
                t0 = time.perf_counter()
                enf3.all_reduce(y).wait()
                enf3.step()
                sync()
                ts.append(time.perf_counter() - t0)
            timing[f"k{k}"] = sorted(ts[1:])[1]  # median of the 3 after a warm-up
        ts = []
        for _ in range(4):
            y = base.clone()
            dist.barrier()
            sync()
            t0 = time.perf_counter()
            dist.all_reduce(y, group=paths["F"])
            sync()
            ts.append(time.perf_counter() - t0)
        timing["plain"] = sorted(ts[1:])[1]
        out["allreduce_16MiB_s"] = timing
    except Exception:  # noqa: BLE001 - report, do not lose the other checks' output
        out["error"] = traceback.format_exc()[-3000:]
    return out


def _ok(ranks: list[dict[str, Any]]) -> bool:
    if len(ranks) != WORLD or any("error" in r for r in ranks):
        return False
    logs_equal = all(r["log"] == ranks[0]["log"] for r in ranks)
    in_order = all([[i, j] for (it, _, i, j) in r["log"] if it == 0] == r["order"] for r in ranks)
    results = all(all(c.values()) for r in ranks for c in r["checks"])
    named = all(r["mismatch"] is not None and "ranks [0]" in r["mismatch"] for r in ranks)
    return logs_equal and in_order and results and named


def main() -> int:
    a = check_args(__doc__, timeout_s=60.0)
    skip = skip_reason(a.backend)
    if skip is not None:
        print(skip)
        return 0
    label = (
        "measured on one GPU (2 NCCL ranks time-sharing it; loopback socket transport)"
        if a.backend == "nccl"
        else CPU_LABEL
    )
    with tempfile.TemporaryDirectory(prefix="fl_syn_nccl") as tmp:
        out, ranks = run_ranks(
            "syndicate_nccl",
            rank_main,
            WORLD,
            a,
            {"label": label},
            _ok,
            args=(a.backend, a.device, os.path.join(tmp, "store")),
        )
    for r in ranks:
        if "error" in r:
            print(f"  rank {r['rank']}: {r['error'].strip().splitlines()[-1][:300]}")
        else:
            print(
                f"  rank {r['rank']}: checks {r['checks']} mismatch named: {r['mismatch'] is not None}; "
                f"16 MiB all-reduce s { ({k: round(v, 4) for k, v in r['allreduce_16MiB_s'].items()}) }"
            )
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
