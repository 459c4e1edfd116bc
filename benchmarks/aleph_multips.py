"""ALEPH E8 (digest §2.9, §4.4): the multi-PS split on emulated links (MEASURED on CPU with emulated links).

q dedicated PS ranks with unequal access links and a few workers, each gloo rank in its own network namespace
(flowlane.testing.netem.EmulatedNetwork, tbf on both directions of each access link). Ranks 0..q-1 are the PSs, at
--ps-mbit (default 300/150/100 Mbit/s: testbed-like 30/15/10 Gbit/s scaled by 1/100 as in E4); the other ranks are
workers at --worker-mbit, each its own aggregator (a singleton cluster: every worker's gradient goes to the PS tier,
the flows the split divides). Times, alternating over --reps rounds, the sum of a --mb MB float32 tensor by
flowlane.aleph.hook.HierarchicalAllReduce(top="ps", dedicated_ps=True):

- ``proportional``: the q PSs, split P_j / sum(P) (``ps_bandwidths=``, Sec. 7);
- ``equal``: the q PSs, split 1/q each;
- ``single``: only the fastest PS (rank 0) with the workers, on a subgroup (the other PSs idle);

and checks that all three give the workers gloo ``all_reduce``'s sum (allclose). Beside each, the flow model: the PS
tier absorbs A flows of S (A = workers) in max_j A S f_j / P_j (flowlane.aleph.model.multi_ps_time), and no worker
can send S faster than its link: T = max(that, S / B_w). With the defaults: proportional 4S/550, equal and single
4S/300 (the slowest PS's third takes as long as the fastest PS alone): proportional 1.83x faster than either.

Run (root): .venv-llm/bin/python benchmarks/aleph_multips.py [--reps 7] [--mb 4]  -> results/aleph/e8_multips.json
Plot: .venv-llm/bin/python benchmarks/aleph_multips.py --plot OUT.png RESULT.json [RESULT.json ...]
Without root/iproute2 it prints why and exits 0 (nothing measured).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from flowlane.aleph.model import multi_ps_split, multi_ps_time  # noqa: E402
from flowlane.testing.provenance import write_result  # noqa: E402

PORT = 29547
SCHEMES = ("proportional", "equal", "single")


def worker(rank: int, world: int, master: str, cfg: dict) -> None:
    import torch
    import torch.distributed as dist

    from flowlane.aleph import Plan
    from flowlane.aleph.hook import HierarchicalAllReduce

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{master}:{PORT}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=300),
    )
    q, chunk = len(cfg["ps_mbit"]), cfg["chunk_kb"] << 10
    singles = Plan.from_clusters(world, [[r] for r in range(world)])
    ps = tuple(range(q))
    har = {
        "proportional": HierarchicalAllReduce(
            singles, top="ps", chunk_bytes=chunk, ps=ps, ps_bandwidths=cfg["ps_mbit"], dedicated_ps=True
        ),
        "equal": HierarchicalAllReduce(
            singles, top="ps", chunk_bytes=chunk, ps=ps, split="equal", dedicated_ps=True
        ),
    }
    sub = [0, *range(q, world)]  # the fastest PS and the workers
    single_pg = dist.new_group(sub)
    workers_pg = dist.new_group(list(range(q, world)))
    if rank in sub:
        har["single"] = HierarchicalAllReduce(
            Plan.from_clusters(len(sub), [[i] for i in range(len(sub))]),
            single_pg,
            top="ps",
            chunk_bytes=chunk,
            dedicated_ps=True,
        )
    n = int(cfg["mb"] * 2**20 / 4)
    x = torch.randn(n, generator=torch.Generator().manual_seed(rank)) if rank >= q else torch.zeros(n)

    def run(s: str) -> torch.Tensor:
        t = x.clone()
        if s in har:
            har[s](t)
        return t

    outs = {s: run(s) for s in SCHEMES}  # warm-up (connections) and the sums to compare
    agree = True
    if rank >= q:
        ref = x.clone()
        dist.all_reduce(ref, group=workers_pg)
        agree = all(torch.allclose(outs[s], ref, atol=1e-4) for s in SCHEMES)
    times: dict[str, list[float]] = {s: [] for s in SCHEMES}
    for rep in range(cfg["reps"]):
        for s in SCHEMES if rep % 2 == 0 else SCHEMES[::-1]:
            dist.barrier()
            t0 = time.perf_counter()
            run(s)
            dist.barrier()
            times[s].append(time.perf_counter() - t0)
    res = {"rank": rank, "times": times, "agree": agree, "cpu_s": time.process_time()}
    gathered: list = [None] * world
    dist.all_gather_object(gathered, res)
    if rank == 0:
        with open(cfg["out"], "w") as f:
            json.dump(gathered, f)
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)  # gloo teardown can hang once rank 0 (the store) is gone; everything is written


def model_seconds(
    size_mbit: float, ps_mbit: list[float], worker_mbit: float, workers: int
) -> dict[str, float]:
    """The flow model's time per scheme: the PS tier (multi_ps_time) or a worker's own link, whichever is slower."""
    q = len(ps_mbit)
    link = size_mbit / worker_mbit
    return {
        "proportional": max(link, multi_ps_time(size_mbit, workers, ps_mbit, multi_ps_split(ps_mbit))),
        "equal": max(link, multi_ps_time(size_mbit, workers, ps_mbit, [1 / q] * q)),
        "single": max(link, multi_ps_time(size_mbit, workers, ps_mbit[:1])),
    }


def plot(png: str, paths: list[str]) -> None:
    """Measured medians (bars, each rep a dot) beside the flow model (outlined bars), one panel per result file."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    docs = [json.loads(Path(p).read_text()) for p in paths]
    fig, axes = plt.subplots(1, len(docs), figsize=(4.2 * len(docs), 3.4), squeeze=False)
    for ax, d in zip(axes[0], docs, strict=True):
        xs = range(len(SCHEMES))
        ax.bar(
            [x - 0.2 for x in xs], [d["seconds"][s]["median"] for s in SCHEMES], 0.4, label="measured median"
        )
        for x, s in zip(xs, SCHEMES, strict=True):
            ax.plot([x - 0.2] * len(d["seconds"][s]["all"]), d["seconds"][s]["all"], "k.", ms=3)
        ax.bar(
            [x + 0.2 for x in xs],
            [d["model_seconds"][s] for s in SCHEMES],
            0.4,
            fill=False,
            label="flow model",
        )
        ax.set_xticks(list(xs), SCHEMES)
        ps = "/".join(f"{p:g}" for p in d["rates_mbit"]["ps"])
        ax.set_title(f"PS {ps} Mbit/s, {len(d['rates_mbit']['workers'])} workers", fontsize=9)
        ax.set_ylabel(f"s per {d['tensor_mb']:g} MB sum")
    axes[0][0].legend(fontsize=8)
    fig.suptitle("ALEPH E8 multi-PS split (measured on CPU with emulated links)", fontsize=10)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--mb", type=float, default=4.0)
    ap.add_argument(
        "--ps-mbit",
        type=float,
        nargs="+",
        default=[300.0, 150.0, 100.0],
        help="PS access rates, fastest first",
    )
    ap.add_argument("--worker-mbit", type=float, default=200.0)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument(
        "--chunk-kb", type=int, default=256, help="the tree's pipelining chunk (per round of q parts)"
    )
    ap.add_argument("--burst-kb", type=float, default=128.0, help="tbf bucket (E4: 32 KB capped fast links)")
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--out", default=str(ROOT / "results" / "aleph" / "e8_multips.json"))
    ap.add_argument("--plot", nargs="+", metavar=("PNG", "JSON"), help="only draw PNG from result JSONs")
    ap.add_argument("--worker", nargs=4, metavar=("RANK", "WORLD", "MASTER", "CFG_JSON"))
    a = ap.parse_args()
    if a.worker:
        r, w, m, cfg = a.worker
        worker(int(r), int(w), m, json.loads(cfg))
        return
    if a.plot:
        if len(a.plot) < 2:
            ap.error(f"--plot {a.plot}: give the PNG to write, then one or more result JSONs")
        plot(a.plot[0], a.plot[1:])
        return
    bad = [
        f"{k}={v!r}"
        for k, v, ok in (
            ("--reps", a.reps, a.reps >= 1),
            ("--mb", a.mb, a.mb > 0),
            ("--ps-mbit", a.ps_mbit, 2 <= len(a.ps_mbit) <= 4 and all(p > 0 for p in a.ps_mbit)),
            ("--ps-mbit order", a.ps_mbit, a.ps_mbit == sorted(a.ps_mbit, reverse=True)),
            ("--worker-mbit", a.worker_mbit, a.worker_mbit > 0),
            ("--workers", a.workers, 2 <= a.workers <= 6),
            ("--chunk-kb", a.chunk_kb, a.chunk_kb >= 1),
        )
        if not ok
    ]
    if bad:
        ap.error(
            f"bad {bad}: reps >= 1, mb > 0, 2-4 PS rates > 0 fastest first, worker rate > 0, "
            "2-6 workers, chunk-kb >= 1"
        )
    from flowlane.testing.netem import EmulatedNetwork, NetemError, check_available

    try:
        check_available()
    except NetemError as e:
        print(f"E8 skipped, nothing measured: {e}")
        return
    q = len(a.ps_mbit)
    mbit = list(a.ps_mbit) + [a.worker_mbit] * a.workers
    world = len(mbit)
    t0, load0 = time.perf_counter(), os.getloadavg()[0]
    tmp = Path(a.out).with_suffix(".ranks.tmp.json")
    cfg = {"ps_mbit": a.ps_mbit, "mb": a.mb, "reps": a.reps, "chunk_kb": a.chunk_kb, "out": str(tmp)}
    with EmulatedNetwork(world, rate_mbit=mbit, burst_kb=a.burst_kb) as net:
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        argvs = [
            [
                sys.executable,
                str(Path(__file__).resolve()),
                "--worker",
                str(r),
                str(world),
                net.ips[0],
                json.dumps(cfg),
            ]
            for r in range(world)
        ]
        net.run_ranks(argvs, timeout_s=a.timeout, env=env, cwd=str(ROOT))
        described = net.describe()
    ranks = sorted(json.loads(tmp.read_text()), key=lambda d: d["rank"])
    tmp.unlink()
    per_rep = {s: [max(d["times"][s][i] for d in ranks) for i in range(a.reps)] for s in SCHEMES}
    med = {s: statistics.median(v) for s, v in per_rep.items()}
    size_mbit = a.mb * 2**20 * 8 / 1e6
    model = model_seconds(size_mbit, a.ps_mbit, a.worker_mbit, a.workers)
    doc = {
        "label": "measured on CPU with emulated links (netns + tbf, gloo over TCP)",
        "experiment": "E8 multi-PS split (seed 002 Sec. 7, digest §2.9)",
        "rates_mbit": {"ps": a.ps_mbit, "workers": [a.worker_mbit] * a.workers},
        "split": {"proportional": multi_ps_split(a.ps_mbit), "equal": [1 / q] * q, "single": [1.0]},
        "tensor_mb": a.mb,
        "reps": a.reps,
        "chunk_kb": a.chunk_kb,
        "burst_kb": a.burst_kb,
        "netem": described,
        "sums_agree": all(d["agree"] for d in ranks),
        "seconds": {s: {"median": med[s], "all": per_rep[s]} for s in SCHEMES},
        "model_seconds": model,
        "measured_over_model": {s: med[s] / model[s] for s in SCHEMES},
        "speedup": {
            "proportional_vs_equal": med["equal"] / med["proportional"],
            "proportional_vs_single": med["single"] / med["proportional"],
            "model_proportional_vs_equal": model["equal"] / model["proportional"],
            "model_proportional_vs_single": model["single"] / model["proportional"],
        },
        "cpu_s_per_rank": [d["cpu_s"] for d in ranks],
        "wall_s": time.perf_counter() - t0,
        "loadavg_1m_before_after": [load0, os.getloadavg()[0]],
    }
    out = write_result(a.out, doc)
    print(f"PS {a.ps_mbit} Mbit/s, {a.workers} workers at {a.worker_mbit}; sums agree {doc['sums_agree']}")
    for s in SCHEMES:
        print(
            f"{s:12s}: median {med[s]:.3f} s (model {model[s]:.3f} s) all {[round(t, 3) for t in per_rep[s]]}"
        )
    sp = doc["speedup"]
    print(
        f"proportional vs equal {sp['proportional_vs_equal']:.2f}x (model {sp['model_proportional_vs_equal']:.2f}x), "
        f"vs single {sp['proportional_vs_single']:.2f}x (model {sp['model_proportional_vs_single']:.2f}x) -> {out}"
    )
    if not doc["sums_agree"]:
        sys.exit("the schemes' sums disagree with all_reduce")


if __name__ == "__main__":
    main()
