"""DGS vs uniform: time per epoch on emulated (netns + tc) links (issue 35; digest 000-dgs-g3.md A5.2 D-TIME).

Each partition is one "machine": its DistGraph server and its trainer run in its own network namespace
(:class:`flowlane.testing.netem.EmulatedNetwork`, one rank per partition, a tbf access link of ``--rate-mbit`` each
way), so every sampling RPC, feature pull and gradient all-reduce between partitions crosses the shaped links, and
DGL maps each trainer to its own partition (on plain loopback every trainer is DGL's machine 0). One session per
rate trains ``uniform`` (DGL's own ``NeighborSampler`` and pulls) and ``dgs`` (``flowlane.dgs``) from the same
initial model; the explainer runs synchronously (reproducible masks), and the time each epoch spent waiting for it is
recorded apart (``explainer_wait_s``): ``epoch_s - explainer_wait_s`` is the trainer's own time, what the seed's
asynchronous explainer (on spare cores) would leave. Per epoch = mean over epochs 2.. (epoch 1 has no masks yet).
The tbf bucket is ``--burst-kb`` (netem's 32 KB default topped out near 200 Mbit/s on a host at load ~25; a quiet
host reaches 0.96x of 1 Gbit/s with it: results/netem/tbf_burst.json).

Emulated: a shared 2-core CPU VM, links shaped with tc; compute is slow and noisy here, so the time a link adds is
what the comparison shows, not absolute speeds.

Run: .venv-gnn/bin/python benchmarks/dgs_netns.py [--rates 10,100] -> results/dgs/netns.json (root).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
OUT = ROOT / "results" / "dgs"


def main() -> None:
    from benchmarks.dgs_bytes import add_session_args, graph_data, summarise, trainer_args
    from dgl_plugin.dgs_train import partition_redundant, run_cluster
    from flowlane.testing.netem import EmulatedNetwork
    from flowlane.testing.provenance import write_result

    ap = argparse.ArgumentParser()
    ap.add_argument("--rates", default="10,100", help="access-link rates in Mbit/s, one session each")
    ap.add_argument("--burst-kb", dest="burst_kb", type=float, default=128.0)
    add_session_args(ap, t_ex=15, workdir="/tmp/flowlane_dgs_netns", timeout_s=3600)
    ap.add_argument("--out", default=str(OUT / "netns.json"))
    a = ap.parse_args()
    rates = [float(x) for x in a.rates.split(",")]
    part_config, classes = partition_redundant(Path(a.workdir), a.parts, seed=0, **graph_data(a))
    runs = [
        {"name": "uniform", "dgs": {}, "dgs_on": False},
        {
            "name": "dgs",
            "dgs": {"t_ex": a.t_ex, "synchronous": True, "explainer_timeout_s": 1800.0},
            "dgs_on": True,
        },
    ]
    args = trainer_args(a, runs, classes)
    sessions = []
    for rate in rates:
        with EmulatedNetwork(a.parts, rate_mbit=rate, burst_kb=a.burst_kb) as net:
            t = time.perf_counter()
            per_rank = run_cluster(
                Path(a.workdir) / f"run{rate:g}", part_config, a.parts, args, timeout_s=a.timeout_s, net=net
            )
            wall = time.perf_counter() - t
            shape = (
                net.describe() if hasattr(net, "describe") else {"rate_mbit": rate, "burst_kb": a.burst_kb}
            )
        res = []
        for i, run in enumerate(runs):
            r = summarise(run["name"], [ranks[i] for ranks in per_rank])
            steady = range(1, a.epochs) if a.epochs > 1 else range(a.epochs)
            # an epoch ends when its slowest trainer does (they all-reduce every step)
            ep = [max(ranks[i]["history"][e]["epoch_s"] for ranks in per_rank) for e in steady]
            wait = [max(ranks[i]["history"][e]["explainer_wait_s"] for ranks in per_rank) for e in steady]
            own = [
                max(
                    ranks[i]["history"][e]["epoch_s"] - ranks[i]["history"][e]["explainer_wait_s"]
                    for ranks in per_rank
                )
                for e in steady
            ]
            r.update(
                epoch_s=ep,
                epoch_s_mean=statistics.fmean(ep),
                explainer_wait_s=wait,
                epoch_s_without_wait_mean=statistics.fmean(own),
            )
            res.append(r)
        base, dgs = res[0], res[1]
        sessions.append(
            {
                "rate_mbit": rate,
                "network": shape,
                "wall_s": wall,
                "runs": res,
                "dgs_vs_uniform_epoch_pct": 100
                * (dgs["epoch_s_without_wait_mean"] / base["epoch_s_mean"] - 1),
                "dgs_vs_uniform_bytes_pct": 100 * (dgs["total_per_epoch"] / base["total_per_epoch"] - 1),
            }
        )
        print(
            f"{rate:g} Mbit/s: uniform {base['epoch_s_mean']:.2f} s/epoch, DGS {dgs['epoch_s_mean']:.2f} s/epoch "
            f"({dgs['epoch_s_without_wait_mean']:.2f} s without waiting for the explainer), remote bytes "
            f"{base['total_per_epoch'] / 1e6:.2f} -> {dgs['total_per_epoch'] / 1e6:.2f} MB/epoch, test acc "
            f"{base['test_acc']:.3f} / {dgs['test_acc']:.3f}",
            flush=True,
        )
    doc = {
        "label": "emulated: DistDGL servers + trainers in network namespaces joined by a bridge, tbf-shaped access "
        "links (rate each way), on a shared 2-core CPU VM; times are wall-clock per epoch (slowest trainer)",
        "args": vars(a),
        "data": graph_data(a),
        "classes": classes,
        "sessions": sessions,
    }
    print(f"wrote {write_result(a.out, doc)}")


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
