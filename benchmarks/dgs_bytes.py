"""DGS on real DistDGL: remote bytes per epoch (Table 3.3 analogue), accuracy at equal epochs (Table 3.4 analogue)
and sensitivities (N_f, ε, T_ex, explainer overhead). Issue 35; digest 000-dgs-g3.md A5.2 (D-COMM, D-ACC, D-NF,
D-EPS, D-OVH).

One DistDGL session (``parts`` servers + trainers on localhost, METIS partitions of a synthetic SBM graph whose
features carry redundant dimensions: :func:`dgl_plugin.dgs_train.redundant_graph`) trains every configuration in
turn from the same initial model, so the graph, the partitions and the servers are shared:

- ``uniform``: DGL's own ``NeighborSampler`` and DistTensor pulls (the seed's "Sampling-based" = Random baseline);
- ``ns_only`` / ``fs_only`` / ``dgs``: explanation-guided nodes / columns / both (``flowlane.dgs``);
- ``labor``: LABOR-0 with uniform weights (DistGraph has no LABOR sampler in DGL 2.1; flowlane's service does it);
- ``dgs_labor``: DGS on top of LABOR-0; ``full``: all neighbours (the accuracy reference, Table 3.4).

Bytes are payload bytes counted where flowlane (or DGL, for the baseline, by the same formula) sends them:
``feature_remote`` (rows owned by another partition), ``sampling_rpc`` (sampling requests to other partitions'
servers), ``prob_update`` (once per mask version). The seed counted NIC bytes (headers and gradients included).
Per epoch = mean over the epochs after the first (the first runs the conventional sampler until the first masks).
The explainer runs ``synchronous`` here (each snapshot's masks are applied before the next step), so the bytes do
not depend on how busy the host is; ``dgs_async`` (sensitivity suite) is the seed's asynchronous mode.

``sn`` suite: the node mask's weight transform, ``sigmoid`` against ``minmax`` at ε = 0 and 0.1.

Run: .venv-gnn/bin/python benchmarks/dgs_bytes.py [--suite table|sens|sn] [--nodes 4000] [--parts 3] [--only uniform,dgs]
[--name table_3parts] -> results/dgs/<name or suite>.json/.png (root: every DistDGL server gets a private /dev/shm).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
OUT = ROOT / "results" / "dgs"


def table_runs(t_ex: int) -> list[dict]:
    base = {"t_ex": t_ex, "synchronous": True, "explainer_timeout_s": 1800.0}  # a loaded host starts slowly
    return [
        {"name": "uniform", "dgs": {}, "dgs_on": False},
        {"name": "ns_only", "dgs": dict(base, feature_sampling=False), "dgs_on": True},
        {"name": "fs_only", "dgs": dict(base, node_sampling=False), "dgs_on": True},
        {"name": "dgs", "dgs": dict(base), "dgs_on": True},
        {
            "name": "labor",
            "dgs": {"node_sampling": False, "feature_sampling": False, "base_sampler": "labor"},
            "dgs_on": True,
        },
        {"name": "dgs_labor", "dgs": dict(base, base_sampler="labor"), "dgs_on": True},
        {"name": "full", "dgs": {}, "dgs_on": False, "fanouts": [-1, -1]},
    ]


def sens_runs(t_ex: int) -> list[dict]:
    base = {"t_ex": t_ex, "synchronous": True, "explainer_timeout_s": 1800.0}  # a loaded host starts slowly
    runs = [{"name": "uniform", "dgs": {}, "dgs_on": False}]
    runs += [{"name": f"n_f={v}", "dgs": dict(base, n_f=v), "dgs_on": True} for v in (1.0, 0.7, 0.5)]
    runs += [{"name": f"epsilon={v}", "dgs": dict(base, epsilon=v), "dgs_on": True} for v in (0.0, 0.2)]
    runs += [{"name": f"t_ex={v}", "dgs": dict(base, t_ex=v), "dgs_on": True} for v in (3 * t_ex,)]
    runs += [{"name": "dgs_async", "dgs": {"t_ex": t_ex, "explainer_timeout_s": 1800.0}, "dgs_on": True}]
    return runs


def sn_runs(t_ex: int) -> list[dict]:
    """The node mask's weights alone (ε = 0: no quota shift) and with DGS's default ε = 0.1, under each
    ``sn_transform``: ``sigmoid`` (the seed's σ(M)) and ``minmax`` (digest A6 #8's normalisation)."""
    base = {"t_ex": t_ex, "synchronous": True, "explainer_timeout_s": 1800.0}
    runs = [{"name": "uniform", "dgs": {}, "dgs_on": False}]
    for eps in (0.0, 0.1):
        for tr in ("sigmoid", "minmax"):
            runs.append(
                {"name": f"eps={eps},{tr}", "dgs": dict(base, epsilon=eps, sn_transform=tr), "dgs_on": True}
            )
    return runs


SUITES = {"table": table_runs, "sens": sens_runs, "sn": sn_runs}


def summarise(name: str, ranks: list[dict]) -> dict:
    hist = [r["history"] for r in ranks]
    n_ep = len(hist[0])
    steady = range(1, n_ep) if n_ep > 1 else range(n_ep)

    def per_epoch(kind: str) -> float:
        return sum(h[e]["bytes"][kind] for h in hist for e in steady) / len(steady)

    rows = sum(h[e]["remote_rows"] for h in hist for e in steady) / len(steady)
    inputs = sum(h[e]["input_rows"] for h in hist for e in steady) / len(steady)
    out = {
        "name": name,
        "feature_remote_per_epoch": per_epoch("feature_remote"),
        "sampling_rpc_per_epoch": per_epoch("sampling_rpc"),
        "prob_update_per_epoch": per_epoch("prob_update"),
        "setup_bytes": sum(r["bytes"]["setup"] for r in ranks),
        "remote_rows_per_epoch": rows,
        "input_rows_per_epoch": inputs,
        "val_acc": ranks[0]["val_acc"],
        "test_acc": ranks[0]["test_acc"],
        "loss_last": sum(h[-1]["loss"] for h in hist) / len(hist),
        "train_s": max(r["train_s"] for r in ranks),
        "columns_pulled": ranks[0]["columns_pulled"],
        "explainer": [r["explainer"] for r in ranks],
    }
    out["total_per_epoch"] = (
        out["feature_remote_per_epoch"] + out["sampling_rpc_per_epoch"] + out["prob_update_per_epoch"]
    )
    return out


def add_session_args(ap: argparse.ArgumentParser, *, t_ex: int, workdir: str, timeout_s: float) -> None:
    """The graph and training flags every DGS benchmark shares (dgs_bytes, dgs_accuracy, dgs_netns)."""
    ap.add_argument("--nodes", type=int, default=4000)
    ap.add_argument("--degree", type=float, default=15.0)
    ap.add_argument("--parts", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--fanout", default="10,10")
    ap.add_argument("--t-ex", dest="t_ex", type=int, default=t_ex)
    ap.add_argument("--workdir", default=workdir)
    ap.add_argument("--timeout-s", dest="timeout_s", type=float, default=timeout_s)


def graph_data(a: argparse.Namespace) -> dict:
    """The synthetic graph's keyword arguments (dgl_plugin.dgs_train.partition_redundant) from those flags."""
    return {"num_nodes": a.nodes, "avg_degree": a.degree, "train_frac": 0.5, "val_frac": 0.2}


def trainer_args(a: argparse.Namespace, runs: list[dict], classes: int, seed: int = 0) -> dict:
    """The trainers' arguments (dgl_plugin.dgs_train.run_cluster) from those flags."""
    return {
        "runs": runs,
        "seed": seed,
        "epochs": a.epochs,
        "lr": 0.01,
        "batch": a.batch,
        "fanouts": [int(x) for x in a.fanout.split(",")],
        "model": "sage",
        "hidden": 32,
        "classes": classes,
    }


def main() -> None:
    from dgl_plugin.dgs_train import partition_redundant, run_cluster
    from flowlane.testing.provenance import provenance

    ap = argparse.ArgumentParser()
    ap.add_argument("--suite", choices=sorted(SUITES), default="table")
    add_session_args(ap, t_ex=5, workdir="/tmp/flowlane_dgs_bench", timeout_s=5400)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--only", default="", help="comma-separated run names to keep (default: the whole suite)")
    ap.add_argument("--name", default="", help="result file name (default: the suite's)")
    a = ap.parse_args()
    work = Path(a.workdir) / a.suite
    part_config, classes = partition_redundant(work, a.parts, seed=a.seed, **graph_data(a))
    runs = SUITES[a.suite](a.t_ex)
    if a.only:
        keep = a.only.split(",")
        unknown = sorted(set(keep) - {r["name"] for r in runs})
        if unknown:
            raise SystemExit(
                f"--only: unknown run(s) {unknown}; the {a.suite} suite has {[r['name'] for r in runs]}"
            )
        runs = [r for r in runs if r["name"] in keep]
    args = trainer_args(a, runs, classes, seed=a.seed)
    t = time.perf_counter()
    per_rank = run_cluster(work / "run", part_config, a.parts, args, timeout_s=a.timeout_s)
    wall = time.perf_counter() - t
    res = [summarise(run["name"], [r[i] for r in per_rank]) for i, run in enumerate(runs)]
    base = next(r for r in res if r["name"] == "uniform")
    for r in res:
        for k in ("feature_remote_per_epoch", "total_per_epoch"):
            r[k.replace("_per_epoch", "_vs_uniform_pct")] = (
                100.0 * (r[k] / base[k] - 1.0) if base[k] else None
            )
    out = {
        "label": "measured on a shared 2-core CPU VM: real DistDGL (servers + trainers + explainer processes) on "
        "localhost loopback, NOT shaped; bytes are payload bytes counted at flowlane's pull/sampling "
        "layer (the seed counted NIC bytes); times are not meaningful on this host",
        "args": vars(a),
        "data": graph_data(a),
        "classes": classes,
        "wall_s": wall,
        "runs": res,
        "raw": {run["name"]: [r[i] for r in per_rank] for i, run in enumerate(runs)},
        "provenance": provenance(),
    }
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / f"{a.name or a.suite}.json"
    path.write_text(json.dumps(out, indent=1))
    print(
        f"{'config':<12} {'remote feat B/ep':>16} {'vs uniform':>10} {'sampling B/ep':>14} {'total vs unif':>13} "
        f"{'test acc':>8}"
    )
    for r in res:
        print(
            f"{r['name']:<12} {r['feature_remote_per_epoch']:>16,.0f} {r['feature_remote_vs_uniform_pct']:>9.1f}% "
            f"{r['sampling_rpc_per_epoch']:>14,.0f} {r['total_vs_uniform_pct']:>12.1f}% {r['test_acc']:>8.3f}"
        )
    _plot(res, OUT / f"{a.name or a.suite}.png", a)
    print(f"wrote {path}")


def _plot(res: list[dict], path: Path, a: argparse.Namespace) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    names = [r["name"] for r in res]
    feat = [r["feature_remote_per_epoch"] / 1e3 for r in res]
    samp = [r["sampling_rpc_per_epoch"] / 1e3 for r in res]
    ax[0].bar(names, feat, label="remote feature pulls")
    ax[0].bar(names, samp, bottom=feat, label="sampling RPCs")
    ax[0].set_ylabel("KB per epoch (all trainers)")
    ax[0].set_title(f"remote bytes per epoch ({a.parts} partitions, {a.nodes} nodes)")
    ax[0].legend()
    ax[0].tick_params(axis="x", rotation=45)
    ax[1].bar(names, [100 * r["test_acc"] for r in res])
    ax[1].set_ylim(min(100 * r["test_acc"] for r in res) - 5, 100)
    ax[1].set_ylabel("test accuracy (%)")
    ax[1].set_title(f"accuracy after {a.epochs} epochs")
    ax[1].tick_params(axis="x", rotation=45)
    fig.text(0.01, 0.01, "measured: DistDGL on localhost (loopback, not shaped), payload bytes", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
