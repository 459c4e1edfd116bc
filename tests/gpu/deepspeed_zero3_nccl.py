"""Hermod on DeepSpeed ZeRO-3 over NCCL (issue #31 item 5; label: measured on one GPU).

Two ranks of a DeepSpeed ZeRO-3 engine (``overlap_comm``, small reduce / prefetch buckets so that every layer is
its own bucket) train a 4-layer MLP for a few steps with gradient accumulation. Runs per rank: DeepSpeed's own run
twice (a control: the GPU run must repeat itself bitwise) and Hermod installed from the ``"flowlane"`` config
section with ``window="bucket"`` (each bucket goes out at once) and ``window="backward"`` (the backward's buckets in
Hermod's layer order). Checks: Hermod's losses and full fp32 parameters bitwise equal DeepSpeed's own; every
reduce-scatter DeepSpeed issued was issued by Hermod's pacer (on the bulk-class NCCL clone, which carries a traffic
class) and none by the training thread; the coordinator's gathers ran as keyed critical ops.

The machine has ONE GPU: every rank gets its own ``NCCL_HOSTID`` so NCCL takes the ranks for hosts of their own and
moves traffic through its socket transport over loopback (see benchmarks/nccl_gpu_check.py); ranks time-share the
GPU, so step times are informational only.

    python3 tests/gpu/deepspeed_zero3_nccl.py --out $OUT/deepspeed_zero3_nccl.json
    python3 tests/gpu/deepspeed_zero3_nccl.py --backend gloo --device cpu --out /tmp/z3.json   # the logic, on CPU
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from typing import Any

from harness import CPU_LABEL, check_args, init_rank, run_ranks, skip_reason

WORLD = 2
MODEL = dict(hidden=256, layers=4, micro_batch=4, gas=2, steps=3)
RUNS = {
    "stock": None,
    "stock_again": None,
    "hermod_bucket": {"window": "bucket", "gate_timeout_s": 0.02},
    "hermod_backward": {"window": "backward", "gate_timeout_s": 0.02},
}
REDUCE_OPS = ("reduce_scatter_tensor", "reduce_scatter", "all_reduce", "reduce")


def _init(rank: int, world: int, backend: str) -> None:
    import torch

    if backend == "nccl":
        os.environ["DS_ACCELERATOR"] = "cuda"
        # every rank shares the one GPU: DeepSpeed's engine calls set_device(LOCAL_RANK), which is 1..3 here
        os.environ["LOCAL_RANK"] = "0"
        init_rank(rank, world, backend, "flowlane-ds-host", 90, deterministic=False)
        torch.use_deterministic_algorithms(True, warn_only=True)  # the bitwise checks are the judge
    else:
        os.environ["DS_ACCELERATOR"] = "cpu"
        init_rank(rank, world, backend, "flowlane-ds-host", 90)
        import deepspeed.comm.torch  # noqa: F401

        # CPU dry run only: skip DeepSpeed's JIT-built shared-memory allreduce (its build cache is shared)
        sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
    import deepspeed

    deepspeed.init_distributed(backend)  # adopts the process group made above


def _ds_config(hermod: dict[str, Any] | None, world: int) -> dict[str, Any]:
    bucket = MODEL["hidden"] * (MODEL["hidden"] + 1) + 8  # one Linear per bucket
    cfg: dict[str, Any] = {
        "train_batch_size": MODEL["micro_batch"] * MODEL["gas"] * world,
        "train_micro_batch_size_per_gpu": MODEL["micro_batch"],
        "gradient_accumulation_steps": MODEL["gas"],
        "steps_per_print": 10_000,
        "zero_allow_untested_optimizer": True,
        "zero_optimization": {
            "stage": 3,
            "overlap_comm": True,
            "reduce_bucket_size": bucket,
            "stage3_prefetch_bucket_size": bucket,
            "stage3_param_persistence_threshold": 0,
            "stage3_max_live_parameters": 4 * bucket,
        },
    }
    if hermod is not None:
        cfg["flowlane"] = {"hermod": hermod}
    return cfg


def _train(hermod: dict[str, Any] | None, device: Any, world: int, rank: int) -> dict[str, Any]:
    import deepspeed
    import torch
    from deepspeed.utils import safe_get_full_fp32_param

    from deepspeed_plugin.comm import CommTap
    from deepspeed_plugin.hermod import install

    hid, n = MODEL["hidden"], MODEL["layers"]

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = torch.nn.ModuleList(torch.nn.Linear(hid, hid) for _ in range(n))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for b in self.blocks:
                x = torch.tanh(b(x))
            return x.pow(2).mean()

    torch.manual_seed(0)
    net = Net().to(device)
    cfg = _ds_config(hermod, world)
    engine, *_ = deepspeed.initialize(
        model=net, optimizer=torch.optim.SGD(net.parameters(), lr=0.1), config=cfg
    )
    h = install(engine, cfg)
    tap = h.tap if h is not None else CommTap(None)  # DeepSpeed's own run: record only
    g = torch.Generator().manual_seed(100 + rank)
    losses, times = [], []
    try:
        for _ in range(MODEL["steps"]):
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(MODEL["gas"]):
                loss = engine(torch.randn(MODEL["micro_batch"], hid, generator=g).to(device))
                engine.backward(loss)
                engine.step()
                losses.append(float(loss))
            if device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        records = [(r.op, r.numel, r.thread, None if r.meta is None else r.meta.op) for r in tap.records]
        out: dict[str, Any] = {
            "losses": losses,
            "step_s": times,
            "params": [safe_get_full_fp32_param(p).detach().clone() for p in engine.module.parameters()],
        }
        out["reductions_main"] = sorted(
            (op, k) for op, k, t, _ in records if op in REDUCE_OPS and t == "main" and k > 1
        )
        out["reductions_pacer"] = sorted(
            (op, k) for op, k, t, _ in records if op in REDUCE_OPS and t == "pacer"
        )
        out["keyed_gathers"] = sum(
            1 for op, _, t, m in records if op.startswith("all_gather") and m == "all_gather"
        )
        if h is not None:
            out["critical_fetches"] = sum(1 for e in h.sched.log if e.event == "critical")
            out["class_backend"] = h.classes.backend
            out["clones_per_group"] = sorted({len(v) for v in h.classes.groups.values()})
        return out
    finally:
        if h is not None:
            h.close()
        else:
            tap.close()
        engine.destroy()


def rank_main(rank: int, world: int, backend: str, device_name: str) -> dict[str, Any]:
    import torch

    _init(rank, world, backend)
    device = torch.device(device_name)
    runs: dict[str, Any] = {}
    for name, hermod in RUNS.items():
        try:
            runs[name] = _train(hermod, device, world, rank)
        except Exception:  # noqa: BLE001 - one run failing must not lose the others' results
            runs[name] = {"error": traceback.format_exc()[-3000:]}
    ref = runs["stock"]

    def same(x: dict[str, Any]) -> bool:
        return (
            "error" not in ref
            and "error" not in x
            and x["losses"] == ref["losses"]
            and all(torch.equal(p, q) for p, q in zip(x["params"], ref["params"], strict=True))
        )

    res: dict[str, Any] = {}
    for name, r in runs.items():
        if "error" in r:
            res[name] = r
            continue
        c = {
            "bitwise_equal_stock": same(r),
            "losses": r["losses"],
            "step_s": r["step_s"],
            "reductions_main": len(r["reductions_main"]),
            "reductions_pacer": len(r["reductions_pacer"]),
            "keyed_gathers": r["keyed_gathers"],
        }
        if RUNS[name] is not None:
            c["pacer_has_stock_reductions"] = r["reductions_pacer"] == ref.get("reductions_main")
            c.update(
                critical_fetches=r["critical_fetches"],
                class_backend=r["class_backend"],
                clones_per_group=r["clones_per_group"],
            )
        res[name] = c
    return res


def _ok(ranks: list[dict[str, Any]]) -> bool:
    if len(ranks) != WORLD:
        return False
    for r in ranks:
        for name, c in r.items():
            if "error" in c or not c["bitwise_equal_stock"]:
                return False
            if RUNS[name] is not None and not (
                c["pacer_has_stock_reductions"]
                and c["reductions_main"] == 0
                and c["reductions_pacer"] > 0
                and c["critical_fetches"] > 0
            ):
                return False
    return True


def main() -> int:
    a = check_args(__doc__, timeout_s=120.0)
    skip = skip_reason(a.backend, "deepspeed")
    if skip is not None:
        print(skip)
        return 0
    if a.backend == "gloo":  # the CPU dry run: the same steps on a model small enough for two cores
        MODEL.update(hidden=16, steps=2)
    label = (
        "measured on one GPU (2 ranks time-share it; NCCL socket transport over loopback)"
        if a.backend == "nccl"
        else CPU_LABEL
    )
    out, ranks = run_ranks(
        "deepspeed_zero3_nccl",
        rank_main,
        WORLD,
        a,
        {"label": label, "model": MODEL},
        _ok,
        args=(a.backend, a.device),
    )
    for r, res in enumerate(ranks):
        for name, c in res.items():
            print(
                f"  rank {r} {name}: "
                + (
                    c["error"].strip().splitlines()[-1][:300]
                    if "error" in c
                    else f"== stock {c['bitwise_equal_stock']}, reductions main/pacer {c['reductions_main']}/"
                    f"{c['reductions_pacer']}, keyed gathers {c['keyed_gathers']}, loss {c['losses'][-1]:.6g}, "
                    f"step {sum(c['step_s']) / len(c['step_s']):.3f}s"
                )
            )
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
