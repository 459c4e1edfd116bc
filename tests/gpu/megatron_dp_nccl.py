"""ALEPH and SYNDICATE on Megatron-core DDP's data-parallel all-reduce, on NCCL (issues #38 and #37: the Megatron
path as its users run it; label: measured on one GPU).

Two ranks (DP 2) time-share the one GPU (``NCCL_HOSTID`` per rank, NCCL's socket transport over loopback: see
tests/gpu/harness.py). Megatron-core's own DistributedDataParallel (overlap_grad_reduce), get_megatron_optimizer,
finalize_model_grads and the stock schedule train the tiny GPT of tests/megatron_dp_workers.py; the components take
over the bucket all-reduces through megatron_plugin.dp_collective's ``flowlane_dp`` process-group backend. Checks,
on every rank (with two ranks a sum is order-free, so every result must be bitwise Megatron's own):

* stock twice: the GPU run repeats itself bitwise (the control);
* ALEPH, both ranks in one cluster with the PS tree on top (the Megatron-LM flags ``--aleph --aleph-clusters 0,1
  --aleph-top ps``), and an all-singleton plan (API): bitwise stock, every bucket group's all-reduce taken;
* SYNDICATE in FIFO mode (API, recording the buckets' signatures) and with a plan that cuts every bucket into up
  to 3 motifs launched last op first (``--syndicate --syndicate-plan``): bitwise stock, and both ranks launched the
  motifs in the same order;
* the distributed optimizer (tests/megatron_dp_workers.py ``dist_opt_runs``: reduce-scatters and the parameters'
  all-gathers): ALEPH's PS tree, SYNDICATE FIFO and a plan of gathers and reduce-scatters with and without
  ``overlap_param_gather``, each bitwise Megatron's own distributed-optimizer run, the plan's order held.

    python3 tests/gpu/megatron_dp_nccl.py --out $OUT/megatron_dp_nccl.json
    python3 tests/gpu/megatron_dp_nccl.py --backend gloo --device cpu --out /tmp/mdp.json   # the logic, on CPU
"""

from __future__ import annotations

import os
import sys
import tempfile
import traceback
from typing import Any

from harness import CPU_LABEL, check_args, init_rank, run_ranks, skip_reason

WORLD = 2


def _cpu_shim() -> None:
    from megatron_plugin import cpu_shim

    cpu_shim.apply()


def rank_main(rank: int, world: int, backend: str, device: str, tmp: str) -> dict[str, Any]:
    init_rank(rank, world, backend, "flowlane-mdp-host", 120, cpu_setup=_cpu_shim)
    import torch.distributed as dist

    from flowlane.syndicate.cost import Option
    from flowlane.syndicate.plan import PlanOp, SyndicatePlan
    from megatron_plugin import aleph, syndicate
    from tests.megatron_dp_workers import _equal, dist_opt_runs, train

    def run(name: str, fn: Any) -> None:
        try:
            res[name] = fn()
        except Exception:  # noqa: BLE001 - one case failing must not lose the others' results
            res[name] = {"error": traceback.format_exc()[-3000:]}
        # at once: a later case that hangs ends the launch, and the ranks' results with it
        print(f"  [rank {rank}] {name}: {_line(res[name])}", flush=True)

    res: dict[str, Any] = {"rank": rank}
    stock = train("stock", world, device=device)
    run("stock_repeats", lambda: _equal(stock, train("stock", world, device=device)))

    def aleph_flags() -> dict[str, Any]:
        flags = ("--aleph", "--aleph-clusters", "0,1", "--aleph-top", "ps")
        out = train("megatron_lm", world, flags=flags, device=device)
        return {**_equal(stock, out), "calls": out["calls"], "bucket_groups": out["bucket_groups"]}

    def aleph_singletons() -> dict[str, Any]:
        cfg = aleph.AlephMegatronConfig(clusters="0;1")
        out = train("api", world, lambda m, c: aleph.install([m], cfg), device=device)
        return {**_equal(stock, out), "calls": out["calls"], "bucket_groups": out["bucket_groups"]}

    fifo: dict[str, Any] = {}

    def syndicate_fifo() -> dict[str, Any]:
        cfg = syndicate.SyndicateMegatronConfig(mode="fifo")
        fifo.update(train("api", world, lambda m, c: syndicate.install([m], cfg, c), device=device))
        return {**_equal(stock, fifo), "calls": fifo["calls"]}

    def syndicate_plan() -> dict[str, Any]:
        sigs = [(n, d) for it, _, n, d in fifo["submitted"] if it == 1]  # the steady state's submissions
        ops = tuple(
            PlanOp(f"bucket{i}", "all_reduce", n, d, world, Option("S", "ring", min(3, n)))
            for i, (n, d) in enumerate(sigs)
        )
        order = tuple(
            (i, j) for i in reversed(range(len(ops))) for j in reversed(range(ops[i].option.segments))
        )
        path = os.path.join(tmp, "plan.json")
        if rank == 0:
            with open(path, "w") as f:
                f.write(SyndicatePlan(1, ops, order).to_json())
        dist.barrier()
        out = train("megatron_lm", world, flags=("--syndicate", "--syndicate-plan", path), device=device)
        steady = [[i, j] for (it, _, i, j) in out["log"] if it == 1]
        return {
            **_equal(stock, out),
            "calls": out["calls"],
            "ops": len(ops),
            "steady_order_is_plan": steady == [list(e) for e in order],
            "log": [list(e) for e in out["log"]],
        }

    run("syndicate_fifo", syndicate_fifo)
    run(
        "syndicate_plan",
        syndicate_plan if "submitted" in fifo else lambda: {"error": "no FIFO run to plan from"},
    )
    # ALEPH last: its PS tree hung on NCCL twice (NCCL's connection set-up, fixed by HierarchicalAllReduce._connect)
    run("aleph_one_cluster_ps_flags", aleph_flags)
    run("aleph_singletons", aleph_singletons)
    run("dist_opt", lambda: _dist_opt_case(dist_opt_runs(rank, world, tmp, device=device)))
    return res


def _dist_opt_case(r: dict[str, Any]) -> dict[str, Any]:
    """One case's summary of ``dist_opt_runs``: bitwise when its four runs are, calls from the components'."""
    return {
        "bitwise": all(r[k]["bitwise"] for k in ("aleph", "fifo", "plan", "sync")),
        "calls": min(r["aleph"]["calls"], r["plan"]["calls"]),
        "gathers": min(r["aleph"]["gathers"], r["plan"]["gathers"]),
        "steady_order_is_plan": r["plan"]["steady"] == r["plan_order"]
        and r["sync"]["steady"] == r["sync_order"],
    }


def _line(c: dict[str, Any]) -> str:
    """One case's result on one line: its error's last line, or its fields (without the order log)."""
    if "error" in c:
        return c["error"].strip().splitlines()[-1][:300]
    return ", ".join(f"{k} {v}" for k, v in c.items() if k != "log")


def _ok(ranks: list[dict[str, Any]]) -> bool:
    cases = [k for k in ranks[0] if k != "rank"]
    bitwise = all(r[k].get("bitwise") for r in ranks for k in cases)
    taken = all(r[k].get("calls", 1) > 0 for r in ranks for k in cases)
    planned = all(r[k].get("steady_order_is_plan") for r in ranks for k in ("syndicate_plan", "dist_opt"))
    same_log = ranks[0]["syndicate_plan"].get("log") == ranks[-1]["syndicate_plan"].get("log")
    return bitwise and taken and planned and same_log


def main() -> int:
    a = check_args(__doc__, timeout_s=60.0)  # under run_all.sh's 150 s: a stall comes back with its stacks
    skip = skip_reason(a.backend, "megatron.core")
    if skip is not None:
        print(skip)
        return 0
    label = (
        "measured on one GPU (2 ranks time-share it; NCCL socket transport over loopback)"
        if a.backend == "nccl"
        else CPU_LABEL
    )
    with tempfile.TemporaryDirectory(prefix="fl_mdp_nccl") as tmp:
        out, ranks = run_ranks(
            "megatron_dp_nccl", rank_main, WORLD, a, {"label": label}, _ok, args=(a.backend, a.device, tmp)
        )
    for r in ranks:
        for name, c in r.items():
            if name == "rank":
                continue
            print(f"  rank {r['rank']} {name}: {_line(c)}")
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
