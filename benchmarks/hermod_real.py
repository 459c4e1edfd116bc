"""Hermod vs the default (FIFO) order on 4 real CPU ranks over an emulated constrained link.

    sudo python -m benchmarks.hermod_real [--rate-mbit 200] [--out results/hermod]

Creates a private network namespace (unique name, removed on exit), rate-limits its loopback with ``tc tbf``, and
runs the synthetic PP2 x DP2 (x EP2) 1F1B iteration of :mod:`flowlane.sched.workload` inside it: ZeRO parameter
gathers and per-layer gradient reductions (DP) contend with pipeline p2p and MoE all-to-all (PP/EP) on the shared
link. FIFO and Hermod alternate in rounds inside one run (same processes, same link). Compute is emulated with sleep
(2 cores cannot run 4 ranks' matmuls concurrently). Only traffic inside the namespace is shaped. Without root it
falls back to plain loopback (no contention; reported as such). Label: measured on CPU with emulated links.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import uuid
from dataclasses import asdict
from pathlib import Path

from flowlane.sched.workload import WorkloadConfig, run_rank

WORK = dict(pp=2, layers_per_stage=2, microbatches=4, iterations=3, act_elems=32768, param_elems=262144, moe=True,
            fwd_s=0.01, opt_s=0.005)
ROUNDS = 3
HERMOD = {"mode": "hermod", "chunk_bytes": 128 << 10, "gate_timeout_s": 0.05, "max_inflight_chunks": 1}


def _rounds(rank: int, world: int, rounds: int, hermod: dict) -> dict:
    out: dict = {"fifo": [], "hermod": [], "digest": {}}
    for _ in range(rounds):
        for mode, sched in (("fifo", {"mode": "fifo"}),
                            ("hermod", hermod)):
            r = run_rank(rank, world, asdict(WorkloadConfig(**WORK, sched=sched)))
            out[mode].extend(r["times"][1:])  # the first iteration warms up
            out["digest"][mode] = r["digest"]
    return out


def worker(out_dir: Path, shaped: bool, rate: float, hermod: dict) -> None:
    from flowlane.launch import launch

    res = launch(_rounds, 4, args=(ROUNDS, hermod), timeout=500)
    per_iter = {m: [max(r[m][i] for r in res) for i in range(len(res[0][m]))] for m in ("fifo", "hermod")}
    med = {m: statistics.median(v) for m, v in per_iter.items()}
    speedup = med["fifo"] / med["hermod"]
    same = all(r["digest"]["fifo"] == r["digest"]["hermod"] for r in res)
    data = {"benchmark": "hermod_real", "label": "measured on CPU ranks (gloo) with an emulated link" if shaped
            else "measured on CPU ranks over unshaped loopback (no root: no emulated link)",
            "link": {"shaped": shaped, "tbf_rate_mbit": rate if shaped else None, "scope": "private netns loopback"},
            "workload": WORK, "hermod_scheduler": hermod, "rounds": ROUNDS, "iteration_time_s": per_iter, "median_iteration_time_s": med,
            "speedup_hermod_vs_fifo": speedup, "math_identical": same, "goal": ">= 1.15x", "goal_met": speedup >= 1.15}
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "real.json").write_text(json.dumps(data, indent=1))
    _plot(per_iter, speedup, out_dir / "real.png", data["label"])
    print(json.dumps({k: data[k] for k in ("median_iteration_time_s", "speedup_hermod_vs_fifo", "math_identical",
                                           "goal_met", "label")}, indent=1))


def _plot(per_iter: dict, speedup: float, path: Path, label: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.boxplot([per_iter["fifo"], per_iter["hermod"]])
    ax.set_xticks([1, 2], ["FIFO (default order)", "Hermod"])
    ax.set_ylabel("iteration time (s)")
    ax.set_title(f"4 ranks PP2xDP2xEP2, speedup {speedup:.2f}x\n{label}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rate-mbit", type=float, default=200.0)
    ap.add_argument("--out", default="results/hermod")
    ap.add_argument("--chunk-bytes", type=int, default=HERMOD["chunk_bytes"])
    ap.add_argument("--max-inflight-chunks", type=int, default=HERMOD["max_inflight_chunks"])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--shaped", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    hermod = dict(HERMOD, chunk_bytes=a.chunk_bytes, max_inflight_chunks=a.max_inflight_chunks)
    if a.worker:
        worker(Path(a.out), a.shaped, a.rate_mbit, hermod)
        return
    if os.geteuid() != 0:
        print("not root: running on plain loopback (no emulated link)")
        worker(Path(a.out), False, a.rate_mbit, hermod)
        return
    ns = f"flhermod-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    _sh("ip", "netns", "add", ns)
    try:
        _sh("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
        # burst >= 1 MB: lo has MTU 65536 and a smaller bucket black-holes traffic (digest A5 environment facts)
        _sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "lo", "root", "tbf", "rate",
            f"{a.rate_mbit}mbit", "burst", "1mb", "latency", "200ms")
        subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-m", "benchmarks.hermod_real", "--worker",
                        "--shaped", "--rate-mbit", str(a.rate_mbit), "--out", a.out, "--chunk-bytes",
                        str(a.chunk_bytes), "--max-inflight-chunks", str(a.max_inflight_chunks)], check=True)
    finally:
        subprocess.run(["ip", "netns", "delete", ns], check=False)


if __name__ == "__main__":
    main()
