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

Why a ratio is what it is (``breakdown``; its timers are ZeRO-3's, and ``bound`` is null for ZeRO-2): every step of
every rank is split by timers on the engine (the training thread in the coordinator's fetches, in DeepSpeed's
reduce-and-partition, waiting for Hermod's pacer; the pacer's reductions), with the rank's CPU seconds, its link
bytes and the host's CPU load. From DeepSpeed's own run
``breakdown.bound`` gives the most any order of the same ops could save: a step is no shorter than its time minus
all of its reductions, nor than the time its link needs at full rate, nor than the CPU time of the 4 ranks spread
over the host's cores. DeepSpeed's own knobs for other regimes: ``--micro-batch`` (compute per byte moved),
``--reduce-layers`` (reduce bucket), ``--prefetch-layers`` (ZeRO-3 prefetch bucket), ``--rate-mbit``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import hashlib
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
PORT = 29631
LABEL = "measured on CPU (4 gloo ranks) with emulated links (netem namespaces, tbf/htb)"


def _zero_section(stage: int, layer: int, reduce_layers: int = 1, prefetch_layers: int = 1) -> dict[str, Any]:
    # layer: the elements of one Linear (+ slack); buckets hold whole layers
    if stage == 2:
        return {
            "stage": 2,
            "overlap_comm": True,
            "contiguous_gradients": True,
            "reduce_bucket_size": reduce_layers * layer,
            "allgather_bucket_size": reduce_layers * layer,
        }
    return {
        "stage": 3,
        "overlap_comm": True,
        "reduce_bucket_size": reduce_layers * layer,
        "stage3_prefetch_bucket_size": prefetch_layers * layer,
        "stage3_param_persistence_threshold": 0,
        "stage3_max_live_parameters": 4 * prefetch_layers * layer,
    }


def _ds_config(
    hidden: int, world: int, hermod: dict[str, Any] | None, stage: int = 3, work: dict[str, Any] | None = None
) -> dict[str, Any]:
    work = work or {}
    mb = int(work.get("micro_batch", 8))
    layer = hidden * (hidden + 1) + 8  # one Linear
    cfg: dict[str, Any] = {
        "train_batch_size": mb * 2 * world,
        "train_micro_batch_size_per_gpu": mb,
        "gradient_accumulation_steps": 2,
        "steps_per_print": 10_000,
        "zero_allow_untested_optimizer": True,
        "zero_optimization": _zero_section(
            stage, layer, int(work.get("reduce_layers", 1)), int(work.get("prefetch_layers", 1))
        ),
    }
    if hermod is not None:
        cfg["flowlane"] = {"hermod": hermod}
    return cfg


class _Breakdown:
    """Benchmark-only timers on one engine: where a rank's step goes. ``fetch`` -- the training thread inside the
    ZeRO-3 coordinator's ``fetch_sub_module`` (issuing the module's all-gathers and prefetches and waiting for
    them); ``reduce`` -- the training thread inside ZeRO-3's reduce-and-partition (DeepSpeed's order: the whole
    reduce-scatter and the partition copy; Hermod: the deferral only); ``pacer`` -- Hermod's pacer running those
    reductions; ``flush`` -- the training thread waiting for the pacer at the epilogue and the step. Per step also
    the rank's CPU seconds (all threads), its link bytes (``/sys/class/net/<if>/statistics``, inside its own
    namespace) and the host's CPU busy share (``/proc/stat``: every process on the machine). Installed after
    Hermod and removed before its close (each wrap is an instance attribute that restores what it shadowed)."""

    def __init__(self, engine: Any, h: Any, ifname: str) -> None:
        from deepspeed_plugin.zero_hooks import Z3_REDUCE

        self.acc: dict[str, float] = dict.fromkeys(("fetch", "reduce", "pacer", "flush"), 0.0)
        self._lock = threading.Lock()
        self._undo: list[Any] = []
        self.ifname = ifname
        opt = engine.optimizer
        if hasattr(opt, "parameter_offload"):
            self._time(opt.parameter_offload.get_param_coordinator(), "fetch_sub_module", "fetch")
            self._time(opt, Z3_REDUCE, "reduce")
        if h is not None:
            self._time(h.zero, "flush", "flush")
            on_class, acc, lock = h.tap.on_class, self.acc, self._lock

            @contextlib.contextmanager
            def timed_on_class(*a: Any, **k: Any) -> Any:
                t0 = time.perf_counter()
                try:
                    with on_class(*a, **k):
                        yield
                finally:
                    with lock:
                        acc["pacer"] += time.perf_counter() - t0

            self._set(h.tap, "on_class", timed_on_class)

    def _set(self, obj: Any, name: str, value: Any) -> None:
        had, old = name in vars(obj), vars(obj).get(name)
        setattr(obj, name, value)
        self._undo.append(lambda: setattr(obj, name, old) if had else vars(obj).pop(name, None))

    def _time(self, obj: Any, name: str, key: str) -> None:
        fn, acc, lock = getattr(obj, name), self.acc, self._lock

        def timed(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                with lock:
                    acc[key] += time.perf_counter() - t0

        self._set(obj, name, timed)

    def sample(self) -> dict[str, float]:
        """Cumulative counters now: the timers, CPU seconds, link bytes, the host's busy and total jiffies."""
        net = Path("/sys/class/net") / self.ifname / "statistics"
        # "cpu user nice system idle iowait irq softirq steal guest guest_nice": guest time is inside user already
        jiffies = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
        with self._lock:
            out = dict(self.acc)
        return {
            **out,
            "cpu": time.process_time(),
            "tx": int((net / "tx_bytes").read_text()),
            "rx": int((net / "rx_bytes").read_text()),
            "host_busy": float(sum(jiffies) - jiffies[3] - jiffies[4]),  # all but idle and iowait
            "host_all": float(sum(jiffies)),
        }

    def close(self) -> None:
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()


def _step_breakdown(a: dict[str, float], b: dict[str, float], wall: float) -> dict[str, float]:
    d = {k: b[k] - a[k] for k in a}
    return {
        "wall_s": wall,
        "fetch_s": d["fetch"],
        "reduce_main_s": d["reduce"],
        "pacer_s": d["pacer"],
        "flush_wait_s": d["flush"],
        # the rest: compute, the optimizer step, DeepSpeed's own bookkeeping
        "rest_s": wall - d["fetch"] - d["reduce"] - d["flush"],
        "cpu_s": d["cpu"],
        "tx_bytes": d["tx"],
        "rx_bytes": d["rx"],
        "host_busy_share": d["host_busy"] / d["host_all"] if d["host_all"] else 0.0,
    }


def _run_variant(
    rank: int, world: int, hermod: dict[str, Any] | None, work: dict[str, Any]
) -> dict[str, Any]:
    import deepspeed
    import torch
    from deepspeed.utils import safe_get_full_fp32_param

    from deepspeed_plugin.hermod import install

    hidden, layers = work["hidden"], work["layers"]
    mb = int(work.get("micro_batch", 8))

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
    cfg = _ds_config(hidden, world, hermod, stage, work)
    engine, *_ = deepspeed.initialize(
        model=net, optimizer=torch.optim.SGD(net.parameters(), lr=0.01), config=cfg
    )
    h = install(engine, cfg)
    timers = _Breakdown(engine, h, work.get("ifname", "eth0"))
    g = torch.Generator().manual_seed(7 + rank)
    times, losses, steps = [], [], []
    try:
        for _ in range(work["steps"] + 1):  # the first step (trace recording, warm-up) is not timed
            torch.distributed.barrier()
            before = timers.sample()
            t0 = time.perf_counter()
            for _ in range(2):
                loss = engine(torch.randn(mb, hidden, generator=g))
                engine.backward(loss)
                engine.step()
                losses.append(float(loss))
            times.append(time.perf_counter() - t0)
            steps.append(_step_breakdown(before, timers.sample(), times[-1]))
        digest = hashlib.sha256()
        for p in engine.module.parameters():
            full = safe_get_full_fp32_param(p) if stage == 3 else p
            digest.update(full.detach().numpy().tobytes())
        pacer = h.sched.events["chunk"] if h is not None else 0
    finally:
        timers.close()
        if h is not None:
            h.close()
        engine.destroy()
    return {
        "times": times[1:],
        "breakdown": steps[1:],
        "digest": [digest.hexdigest(), losses],
        "paced_reductions": pacer,
    }


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
    out: dict[str, Any] = {
        m: {"times": [], "breakdown": [], "digest": None, "paced_reductions": 0} for m in variants
    }
    for _ in range(rounds):
        for mode, hermod in variants.items():
            r = _run_variant(rank, world, hermod, work)
            out[mode]["times"].extend(r["times"])
            out[mode]["breakdown"].extend(r["breakdown"])
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


def breakdown_summary(
    res: list[Any], variants: dict[str, Any], rate_mbit: float, stage: int = 3
) -> dict[str, Any]:
    """Per variant: each component's median over the timed steps, averaged over the ranks (seconds per step); the
    links' busy share (a rank's larger direction at the shaped rate over the step, the busiest rank); the CPU the
    4 ranks used against the host's cores. Then, from DeepSpeed's own run, what any reordering of the same ops could
    save at most: the step cannot be shorter than its time minus every reduction (all hidden) nor than its link time
    or CPU time at full use (both orders move the same bytes and do the same work)."""
    cores = os.cpu_count() or 1
    out: dict[str, Any] = {}
    for m in variants:
        per_rank = [r[m]["breakdown"] for r in res]
        keys = [k for k in per_rank[0][0] if k.endswith("_s") or k.endswith("_share")]
        comp = {
            k: statistics.fmean(statistics.median(s[k] for s in steps) for steps in per_rank) for k in keys
        }
        link_s = max(
            statistics.median(max(s["tx_bytes"], s["rx_bytes"]) * 8 / (rate_mbit * 1e6) for s in steps)
            for steps in per_rank
        )
        cpu_sum = statistics.median(
            sum(steps[i]["cpu_s"] for steps in per_rank) for i in range(len(per_rank[0]))
        )
        out[m] = {
            **comp,
            "link_s_at_full_rate": link_s,
            "link_busy_share": link_s / comp["wall_s"],
            "ranks_cpu_s": cpu_sum,
            "ranks_cpu_share_of_host": cpu_sum / (cores * comp["wall_s"]),
            "per_rank_steps": per_rank,
        }
        if m != "deepspeed":  # how much of the pacer's reduction time the training thread did not wait for
            out[m]["pacer_overlapped_s"] = comp["pacer_s"] - comp["flush_wait_s"]
    if stage != 3:  # the timers know ZeRO-3's fetch and reduce-and-partition only: no bound for other stages
        out["bound"] = None
        return out
    ds = out["deepspeed"]
    floors = {
        "all_reductions_hidden": ds["wall_s"] - ds["reduce_main_s"],
        "link_at_full_rate": ds["link_s_at_full_rate"],
        "cpu_at_full_use": ds["ranks_cpu_s"] / cores,
    }
    floor = max(floors.values())
    out["bound"] = {
        "floors_s": floors,
        "binding": max(floors, key=floors.__getitem__),
        "max_ratio": ds["wall_s"] / floor,
        "cores": cores,
    }
    return out


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
    ap.add_argument("--micro-batch", type=int, default=8, help="train_micro_batch_size_per_gpu")
    ap.add_argument("--reduce-layers", type=int, default=1, help="reduce_bucket_size, in Linear layers")
    ap.add_argument(
        "--prefetch-layers", type=int, default=1, help="stage3_prefetch_bucket_size, in Linear layers"
    )
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
    for name in ("rounds", "steps", "hidden", "layers", "micro_batch", "reduce_layers", "prefetch_layers"):
        if getattr(a, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}")
    from flowlane.testing.netem import unavailable_reason
    from flowlane.testing.provenance import write_result

    why = unavailable_reason()
    if why:
        print(f"cannot emulate the network here: {why}")
        return 2
    work = {"hidden": a.hidden, "layers": a.layers, "steps": a.steps, "zero": a.zero}
    # new knobs enter the work dict only when changed: the default workload's JSON keeps its keys
    for name, default in (("micro_batch", 8), ("reduce_layers", 1), ("prefetch_layers", 1)):
        if getattr(a, name) != default:
            work[name] = getattr(a, name)
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
    summary["breakdown"] = breakdown_summary(res, variants, a.rate_mbit, a.zero)
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
    }
    write_result(a.out, out, "python -m benchmarks.deepspeed_zero3 " + " ".join(sys.argv[1:]))
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
    bd = summary["breakdown"]
    for m in variants:
        b = bd[m]
        print(
            f"  {m}: wall {b['wall_s']:.3f} = fetch {b['fetch_s']:.3f} + reduce {b['reduce_main_s']:.3f} + "
            f"flush wait {b['flush_wait_s']:.3f} + rest {b['rest_s']:.3f} (pacer {b['pacer_s']:.3f}); link busy "
            f"{b['link_busy_share']:.0%}, ranks' CPU {b['ranks_cpu_share_of_host']:.0%} of the host, host busy "
            f"{b['host_busy_share']:.0%}"
        )
    if bd["bound"] is not None:
        bound = bd["bound"]
        print(f"  bound: {bound['max_ratio']:.3f}x at most ({bound['binding']}: {bound['floors_s']})")
    return 0 if summary["bitwise_equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
