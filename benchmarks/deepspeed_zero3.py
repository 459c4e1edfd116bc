"""Hermod vs DeepSpeed's default order: ZeRO-3 (or 2) on 4 CPU ranks over emulated, contended links (issue #31).

    sudo .venv-llm/bin/python -m benchmarks.deepspeed_zero3 [--zero 3] [--rate-mbit 200] [--burst-kb 32]
        [--rounds 3] [--steps 4] [--hidden 512] [--layers 8] [--windows bucket] [--out results/deepspeed/...json]

Label: **measured on CPU with emulated links** (flowlane.testing.netem: one network namespace per rank, every access
link shaped to ``--rate-mbit`` both ways by tbf/htb, gloo over TCP). Not a GPU or datacenter figure.

Workload: DeepSpeed's own ZeRO-3 engine (``overlap_comm``, one Linear layer per reduce bucket and per prefetch
bucket, persistence threshold 0 so every layer is gathered) training an MLP of ``--layers`` ``Linear(hidden,
hidden)`` blocks with gradient accumulation 2, one thread per rank. Parameter all-gathers (forward and backward, with
DeepSpeed's prefetch) and gradient reduce-scatters (backward) share each rank's link. ``--zero 2``: ZeRO-2
(``overlap_comm``, ``contiguous_gradients``, one Linear per reduce bucket): the reductions of backward, then the
optimizer's parameter all-gather after the step.

Variants, alternated in every round inside one run (so the ratio compares like with like on a busy machine):

* ``deepspeed``: DeepSpeed's own order. On the CPU accelerator every collective is issued by the training thread and
  completes before it goes on (streams are no-ops), so a reduce-scatter holds the next layer's gather and compute.
* ``hermod_<window>`` (one per ``--windows`` entry): ``"flowlane": {"hermod": {"window": ...}}`` -- the reductions are deferred coflows sent by Hermod's pacer in
  key order on the bulk-class clone, which leaves from each rank's ``bulk0`` address; the links queue that class behind
  everything else (htb priority, the stand-in for DSCP); the coordinator's gathers are critical ops on the default
  class and hold the pacer back (the gate). ``bucket`` sends each backward bucket as soon as DeepSpeed hands it over
  (DeepSpeed's order); ``backward`` holds a backward's buckets to its epilogue and sends them in Hermod's key order
  (lowest layer first), giving up the overlap with backward.

Every variant must give bitwise the same losses and parameters (checked: ``bitwise_equal``). The step time of a
variant is the slowest rank's; the figures are the ratios of medians, deepspeed / hermod_<window> (> 1: faster).
The tbf bucket (``--burst-kb``) must hold a few ms of traffic: 32 KB caps a link near 200 Mbit/s.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
PORT = 29631
LABEL = "measured on CPU (4 gloo ranks) with emulated links (netem namespaces, tbf/htb)"


def _zero_section(stage: int, bucket: int) -> dict[str, Any]:
    if stage == 2:
        return {
            "stage": 2,
            "overlap_comm": True,
            "contiguous_gradients": True,
            "reduce_bucket_size": bucket,
            "allgather_bucket_size": bucket,
        }
    return {
        "stage": 3,
        "overlap_comm": True,
        "reduce_bucket_size": bucket,
        "stage3_prefetch_bucket_size": bucket,
        "stage3_param_persistence_threshold": 0,
        "stage3_max_live_parameters": 4 * bucket,
    }


def _ds_config(hidden: int, world: int, hermod: dict[str, Any] | None, stage: int = 3) -> dict[str, Any]:
    bucket = hidden * (hidden + 1) + 8  # one Linear per bucket
    cfg: dict[str, Any] = {
        "train_batch_size": 8 * 2 * world,
        "train_micro_batch_size_per_gpu": 8,
        "gradient_accumulation_steps": 2,
        "steps_per_print": 10_000,
        "zero_allow_untested_optimizer": True,
        "zero_optimization": _zero_section(stage, bucket),
    }
    if hermod is not None:
        cfg["flowlane"] = {"hermod": hermod}
    return cfg


def _run_variant(
    rank: int, world: int, hermod: dict[str, Any] | None, work: dict[str, Any]
) -> dict[str, Any]:
    import deepspeed
    import torch
    from deepspeed.utils import safe_get_full_fp32_param

    from deepspeed_plugin.hermod import install

    hidden, layers = work["hidden"], work["layers"]

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = torch.nn.ModuleList(torch.nn.Linear(hidden, hidden) for _ in range(layers))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for b in self.blocks:
                x = torch.tanh(b(x))
            return x.pow(2).mean()

    torch.manual_seed(0)
    net = Net()
    stage = int(work.get("zero", 3))
    cfg = _ds_config(hidden, world, hermod, stage)
    engine, *_ = deepspeed.initialize(
        model=net, optimizer=torch.optim.SGD(net.parameters(), lr=0.01), config=cfg
    )
    h = install(engine, cfg)
    g = torch.Generator().manual_seed(7 + rank)
    times, losses = [], []
    try:
        for _ in range(work["steps"] + 1):  # the first step (trace recording, warm-up) is not timed
            torch.distributed.barrier()
            t0 = time.perf_counter()
            for _ in range(2):
                loss = engine(torch.randn(8, hidden, generator=g))
                engine.backward(loss)
                engine.step()
                losses.append(float(loss))
            times.append(time.perf_counter() - t0)
        digest = hashlib.sha256()
        for p in engine.module.parameters():
            full = safe_get_full_fp32_param(p) if stage == 3 else p
            digest.update(full.detach().numpy().tobytes())
        pacer = sum(1 for e in h.sched.log if e.event == "chunk") if h is not None else 0
    finally:
        if h is not None:
            h.close()
        engine.destroy()
    return {"times": times[1:], "digest": [digest.hexdigest(), losses], "paced_reductions": pacer}


def worker(
    rank: int, world: int, master: str, rounds: int, variants: dict[str, Any], work: dict[str, Any]
) -> None:
    import torch
    import torch.distributed as dist

    # each rank stands for a host of its own: local rank 0 (DeepSpeed reads these)
    os.environ.update(
        DS_ACCELERATOR="cpu",
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK="0",
        MASTER_ADDR=master,
        MASTER_PORT=str(PORT),
    )
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{master}:{PORT}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=300),
    )
    import deepspeed
    import deepspeed.comm.torch  # noqa: F401

    # DeepSpeed's CPU shared-memory allreduce is a single-host fast path (and a JIT build): these ranks stand for
    # separate hosts, so their traffic must cross the emulated links
    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
    deepspeed.init_distributed("gloo")
    dist.all_reduce(torch.ones(1024))  # connections up before timing
    out: dict[str, Any] = {m: {"times": [], "digest": None, "paced_reductions": 0} for m in variants}
    for _ in range(rounds):
        for mode, hermod in variants.items():
            r = _run_variant(rank, world, hermod, work)
            out[mode]["times"].extend(r["times"])
            out[mode]["digest"] = r["digest"]
            out[mode]["paced_reductions"] = r["paced_reductions"]
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, out)
    if rank == 0:
        print("RESULT " + json.dumps(everyone), flush=True)
    dist.destroy_process_group()


def run_all(
    rate: float, rounds: int, variants: dict[str, Any], work: dict[str, Any], burst_kb: float = 32.0
) -> tuple[list[Any], dict]:
    from flowlane.testing.netem import EmulatedNetwork

    n = 4
    with EmulatedNetwork(
        n,
        rate_mbit=rate,
        subnet="10.214.0.0/24",
        bulk_subnet="10.214.1.0/24",
        prefix="fld",
        burst_kb=burst_kb,
    ) as net:
        env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
        outs = net.run_ranks(
            [
                [
                    sys.executable,
                    "-m",
                    "benchmarks.deepspeed_zero3",
                    "--worker",
                    str(r),
                    "--world",
                    str(n),
                    "--master",
                    net.ips[0],
                    "--rounds",
                    str(rounds),
                    "--variants-json",
                    json.dumps(variants),
                    "--work-json",
                    json.dumps(work),
                ]
                for r in range(n)
            ],
            timeout_s=3000,
            env=env,
            cwd=REPO,
        )
        desc = {**net.describe(), "class_bytes_at_end": net.class_bytes()}
    line = next(x for x in outs[0].splitlines() if x.startswith("RESULT "))
    return json.loads(line[7:]), desc


def summarise(res: list[Any], variants: dict[str, Any]) -> dict[str, Any]:
    modes = list(variants)
    per_step = {
        m: [max(r[m]["times"][i] for r in res) for i in range(len(res[0][m]["times"]))] for m in modes
    }
    med = {m: statistics.median(v) for m, v in per_step.items()}
    ours = [m for m in modes if m != "deepspeed"]
    return {
        "step_s_median": med,
        "step_s_all": per_step,
        "ratio_deepspeed_over": {m: med["deepspeed"] / med[m] for m in ours},
        "bitwise_equal": all(r[m]["digest"] == r["deepspeed"]["digest"] for r in res for m in ours),
        "paced_reductions_per_run": {m: [r[m]["paced_reductions"] for r in res] for m in ours},
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--zero", type=int, default=3, choices=(2, 3), help="ZeRO stage")
    ap.add_argument("--rate-mbit", type=float, default=200.0, help="every rank's access link, both ways")
    ap.add_argument(
        "--burst-kb", type=float, default=32.0, help="tbf bucket (KB); 32 caps a link near 200 Mbit/s"
    )
    ap.add_argument(
        "--windows", default="bucket", help="Hermod windows to run, comma-separated: bucket, backward"
    )
    ap.add_argument("--rounds", type=int, default=3, help="rounds; each runs both variants")
    ap.add_argument("--steps", type=int, default=4, help="timed optimizer steps per variant per round")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--gate-timeout-s", type=float, default=0.05)
    ap.add_argument("--out", default="results/deepspeed/zero3_cpu4.json")
    ap.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--world", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--master", help=argparse.SUPPRESS)
    ap.add_argument("--variants-json", help=argparse.SUPPRESS)
    ap.add_argument("--work-json", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker is not None:
        worker(a.worker, a.world, a.master, a.rounds, json.loads(a.variants_json), json.loads(a.work_json))
        return 0
    windows = [w.strip() for w in a.windows.split(",") if w.strip()]
    if (
        not windows
        or any(w not in ("bucket", "backward") for w in windows)
        or len(set(windows)) < len(windows)
    ):
        ap.error(f"--windows must list distinct entries of bucket, backward; got {a.windows!r}")
    for name in ("rate_mbit", "gate_timeout_s", "burst_kb"):
        if not getattr(a, name) > 0:
            ap.error(f"--{name.replace('_', '-')} must be > 0, got {getattr(a, name)}")
    for name in ("rounds", "steps", "hidden", "layers"):
        if getattr(a, name) < 1:
            ap.error(f"--{name} must be >= 1, got {getattr(a, name)}")
    from flowlane.testing.netem import unavailable_reason
    from flowlane.testing.provenance import provenance

    why = unavailable_reason()
    if why:
        print(f"cannot emulate the network here: {why}")
        return 2
    work = {"hidden": a.hidden, "layers": a.layers, "steps": a.steps, "zero": a.zero}
    variants: dict[str, Any] = {"deepspeed": None}
    for w in windows:
        variants[f"hermod_{w}"] = {
            "gate_timeout_s": a.gate_timeout_s,
            "gloo_class_ifnames": "eth0,eth0,bulk0",
            "window": w,
        }
    t0 = time.perf_counter()
    res, net = run_all(a.rate_mbit, a.rounds, variants, work, a.burst_kb)
    summary = summarise(res, variants)
    out = {
        "label": LABEL,
        "zero_stage": a.zero,
        "rate_mbit": a.rate_mbit,
        "burst_kb": a.burst_kb,
        "rounds": a.rounds,
        "work": work,
        "variants": variants,
        "network": net,
        **summary,
        "wall_s": time.perf_counter() - t0,
        **provenance("python -m benchmarks.deepspeed_zero3 " + " ".join(sys.argv[1:])),
    }
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=1))
    med = summary["step_s_median"]
    ratios = ", ".join(
        f"{m} {med[m]:.3f} s/step ({summary['ratio_deepspeed_over'][m]:.3f}x)"
        for m in variants
        if m != "deepspeed"
    )
    print(
        f"ZeRO-{a.zero}, 4 ranks, {a.rate_mbit:g} Mbit/s ({LABEL}): deepspeed {med['deepspeed']:.3f} s/step, "
        f"{ratios}, bitwise equal {summary['bitwise_equal']} -> {a.out}"
    )
    return 0 if summary["bitwise_equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
