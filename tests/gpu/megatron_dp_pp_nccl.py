"""ALEPH and SYNDICATE on Megatron-core DDP with several data-parallel groups, on NCCL (issues #38 and #37; label:
measured on one GPU): the CPU test tests/test_dp_components_pp.py on 4 NCCL ranks that time-share the one GPU
(``NCCL_HOSTID`` per rank, a world bound to the device as Megatron-LM binds it: NCCL then makes every new group by
splitting the world's communicator, which every rank must join, the case the adapters make their groups for).

PP 2 x DP 2 (each stage's DP group with its own ALEPH PS tree, then SYNDICATE FIFO and each stage's own plan), then
TP 2 x DP 2 (DP groups {0, 2} and {1, 3}, one plan), then MoE with 4 experts, EP 2 (tests/megatron_dp_workers.py
``moe_runs``: the expert bucket groups over two expert-data-parallel groups, ALEPH and SYNDICATE on them): every run
bitwise Megatron's own (DP 2: a sum of two has one order; the dense DP 4 groups keep Megatron's whole all-reduces),
every bucket group taken each iteration, each group launching its plan's order.

    python3 tests/gpu/megatron_dp_pp_nccl.py --out $OUT/megatron_dp_pp_nccl.json
    python3 tests/gpu/megatron_dp_pp_nccl.py --backend gloo --device cpu --out /tmp/mdpp.json   # the logic, on CPU
"""

from __future__ import annotations

import sys
import tempfile
from typing import Any

from harness import CPU_LABEL, check_args, init_rank, run_ranks, skip_reason

WORLD = 4
ITERATIONS = 3


def _cpu_shim() -> None:
    from megatron_plugin import cpu_shim

    cpu_shim.apply()


def rank_main(rank: int, world: int, backend: str, device: str, tmp: str) -> dict[str, Any]:
    init_rank(rank, world, backend, "flowlane-mdpp-host", 120, cpu_setup=_cpu_shim)
    from tests.megatron_dp_workers import moe_runs, pp_runs

    res = pp_runs(rank, world, tmp, device=device)
    for case in ("plan", "tp_plan"):
        res[case].pop("log", None)  # the steady order is kept; the whole log would only fill the JSON
    moe = moe_runs(rank, world, tmp, device=device)
    res["moe_aleph"], res["moe_plan"], res["moe_orders"] = moe["aleph"], moe["plan"], moe["orders"]
    return res


def _ok(ranks: list[dict[str, Any]]) -> bool:
    good = True
    for r in ranks:
        for name in ("aleph", "fifo", "plan", "tp_aleph", "tp_plan", "moe_aleph", "moe_plan"):
            good &= bool(r[name].get("bitwise"))
        for name in ("moe_aleph", "moe_plan"):
            good &= r[name].get("expert_calls") == r[name].get("expert_bucket_groups", 0) * ITERATIONS
        good &= [r["moe_plan"].get("steady"), r["moe_plan"].get("expert_steady")] == r["moe_orders"]
        for name in ("aleph", "plan", "tp_aleph", "tp_plan"):
            good &= r[name].get("calls") == r[name].get("bucket_groups", 0) * ITERATIONS
        good &= r["plan"]["steady"] == r["plan_order"] and r["tp_plan"]["steady"] == r["tp_plan_order"]
    return good


def main() -> int:
    a = check_args(__doc__, timeout_s=60.0)  # under run_all.sh's limit: a stall comes back with its stacks
    skip = skip_reason(a.backend, "megatron.core")
    if skip is not None:
        print(skip)
        return 0
    label = (
        "measured on one GPU (4 ranks time-share it; NCCL socket transport over loopback)"
        if a.backend == "nccl"
        else CPU_LABEL
    )
    with tempfile.TemporaryDirectory(prefix="fl_mdpp_nccl") as tmp:
        out, ranks = run_ranks(
            "megatron_dp_pp_nccl", rank_main, WORLD, a, {"label": label}, _ok, args=(a.backend, a.device, tmp)
        )
    for i, r in enumerate(ranks):
        print(
            f"  rank {i} (stage {r.get('stage')}): "
            + ", ".join(
                f"{n} bitwise {r[n].get('bitwise')} calls {r[n].get('calls')}"
                for n in ("aleph", "fifo", "plan", "tp_aleph", "tp_plan", "moe_aleph", "moe_plan")
                if n in r
            )
        )
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
