"""Recipe entry for ``job: gnn_fullgraph``: ``run_fullgraph(cfg) -> dict`` (wired into recipes/train.py).

Starts ``world_size`` local gloo ranks (flowlane.launch, one rank is allowed), or under torchrun/srun/DistDGL's
launcher runs this process's rank only (NCCL when the runtime's device is CUDA, which needs a CUDA build of DGL:
:func:`dgl_plugin.fullgraph.collective_backend`) with results gathered to rank 0; every rank builds the model with the
same seed and trains full-graph with :class:`dgl_plugin.fullgraph.FullGraphRuntime` (one update per epoch). Graph
source: ``data.part_config`` (the JSON written by ``dgl.distributed.partition_graph`` with ``num_parts =
world_size``): each rank loads only its own partition (inner nodes, halo, in-edges); otherwise every rank loads the
whole graph (``data.name``, the in-memory path for small graphs) and rank 0 partitions it with
``flowlane.fullgraph.partition``.
Returns and writes (``output_dir/summary.json``) per-epoch loss, time and accuracy plus communication bytes by kind.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from typing import Any

from flowlane.launch import heartbeat, launch, preload
from flowlane.launch_external import detect_launcher, run_this_rank


def _plain(cfg: Any) -> dict:
    try:
        from omegaconf import OmegaConf

        if OmegaConf.is_config(cfg):
            return OmegaConf.to_container(cfg, resolve=True)  # type: ignore[return-value]
    except ImportError:  # pragma: no cover
        pass
    return dict(cfg)


def _rank_main(rank: int, world: int, c: dict) -> dict:
    import torch

    from flowlane import comm

    from .datasets import load_graph
    from .fullgraph import FullGraphConfig, FullGraphRuntime, collective_device, load_local_partition
    from .models import build_model

    data = dict(c.get("data", {}))
    part_config = data.pop("part_config", None)
    fg = FullGraphConfig.from_dict(c.get("flowlane", {}).get("fullgraph", {}))
    rec = comm.get_recorder()
    rec.clear()
    t0 = time.perf_counter()
    if part_config:
        source = load_local_partition(part_config, rank, world)
        feat, labels = source.x, source.y
    else:
        source = load_graph(data.pop("name", "synthetic"), seed=c.get("seed", 0), **data)
        feat, labels = source.ndata["feat"], source.ndata["label"]
    top = torch.tensor([int(labels.max()) if labels.numel() else 0])
    if world > 1:
        top = top.to(collective_device())
        comm.all_reduce(top, op=torch.distributed.ReduceOp.MAX, kind="setup")
    m = c.get("model", {})
    model = build_model(
        m.get("name", "sage"),
        feat.shape[1],
        m.get("hidden", 64),
        int(top) + 1,
        m.get("num_layers", 2),
        seed=c.get("seed", 0),
    )
    with FullGraphRuntime(source, model, fg) as rt:  # its exchange group is destroyed after the last epoch
        setup_s = time.perf_counter() - t0
        opt = torch.optim.Adam(model.parameters(), lr=c.get("lr", 0.01))
        hist = []
        for ep in range(int(c.get("epochs", 20))):
            t = time.perf_counter()
            loss = rt.train_step(opt)
            dt = time.perf_counter() - t
            val = rt.evaluate("val_mask") if "val_mask" in rt.masks else float("nan")
            hist.append({"epoch": ep, "loss": loss, "epoch_s": dt, "val_acc": val})
            heartbeat()  # progress: the launcher's stall timeout counts from the last epoch, not from the start
        test = rt.evaluate("test_mask") if "test_mask" in rt.masks else float("nan")
    return {
        "summary": rt.summary(),
        "history": hist,
        "test_acc": test,
        "setup_s": setup_s,
        "bytes_by_kind": rec.bytes_by_kind(),
    }


def run_fullgraph(cfg: Any) -> dict:
    """Train a dgl.nn model full-graph across ``cfg.world_size`` local ranks (G3 + DGCL). Returns a summary dict."""
    c = _plain(cfg)
    world = int(c.get("world_size", 2))
    if world < 1:
        raise ValueError(f"world_size must be >= 1, got {world}")
    ext = detect_launcher()
    if ext is None:
        # what _rank_main imports (~10 s of CPU for DGL): once in the ranks' fork server, not in every rank
        preload("dgl", "dgl_plugin.datasets", "dgl_plugin.fullgraph", "dgl_plugin.models")
        res = launch(_rank_main, world, args=(c,), timeout=float(c.get("timeout_s", 1800)))
    else:  # torchrun, srun, DistDGL's trainers: this process's rank only; rank 0 reports for all
        from .distdgl import distdgl_role, peer_guard
        from .fullgraph import FullGraphConfig, collective_backend

        fg = FullGraphConfig.from_dict((c.get("flowlane") or {}).get("fullgraph") or {})
        fg.validate(world)  # before this rank joins: e.g. device=cuda with a DGL that has no CUDA, by name
        # nccl only where the runtime computes on CUDA: auto is CPU when DGL has no CUDA (PyPI's wheels)
        backend = collective_backend(fg.device)
        op_timeout = float(c.get("timeout_s", 1800))
        # under DistDGL's launcher: a failure here or a lost peer ends this trainer, never a wait in DGL's exit
        # barrier (dgl_plugin.distdgl); every collective waits at most timeout_s
        guard = (
            peer_guard(op_timeout, "gnn_fullgraph trainer") if distdgl_role() else contextlib.nullcontext()
        )
        with guard:
            gathered = run_this_rank(
                _rank_main,
                ext,
                world,
                args=(c,),
                backend=backend,
                op_timeout=op_timeout,
                key="world_size",
            )
        if gathered is None:
            return {}
        res = gathered
    out = {
        "job": "gnn_fullgraph",
        "world_size": world,
        "config": c,
        "history": res[0]["history"],
        "test_acc": res[0]["test_acc"],
        "graph_bytes_total": sum(r["bytes_by_kind"].get("graph", 0) for r in res),
        "dp_bytes_total": sum(r["bytes_by_kind"].get("dp", 0) for r in res),
        "ranks": [
            {"summary": r["summary"], "setup_s": r["setup_s"], "bytes_by_kind": r["bytes_by_kind"]}
            for r in res
        ],
    }
    out_dir = c.get("output_dir")
    if out_dir:  # atomically: a reader (or a crash) never sees half a summary
        os.makedirs(out_dir, exist_ok=True)
        tmp = os.path.join(out_dir, "summary.json.tmp")
        with open(tmp, "w") as f:
            json.dump(out, f, indent=1, default=str)
        os.replace(tmp, os.path.join(out_dir, "summary.json"))
    _print_summary(out, out_dir)
    return out


def _print_summary(out: dict, out_dir: str | None) -> None:
    from rich.console import Console
    from rich.table import Table

    hist = out["history"]
    t = Table(title="flowlane-train gnn_fullgraph summary")
    t.add_column("metric")
    t.add_column("value", justify="right")
    t.add_row("ranks", str(out["world_size"]))
    t.add_row("epochs", str(len(hist)))
    if hist:
        steady = hist[1:] or hist
        t.add_row(
            "epoch time (mean, epochs after the first)",
            f"{sum(h['epoch_s'] for h in steady) / len(steady):.3f} s",
        )
        t.add_row("loss first -> last", f"{hist[0]['loss']:.4f} -> {hist[-1]['loss']:.4f}")
        t.add_row("validation accuracy (last)", f"{hist[-1]['val_acc']:.4f}")
    t.add_row("test accuracy", f"{out['test_acc']:.4f}")
    t.add_row("halo exchange bytes (all ranks)", f"{out['graph_bytes_total']:,}")
    t.add_row("gradient all-reduce bytes (all ranks)", f"{out['dp_bytes_total']:,}")
    if out_dir:
        t.add_row("summary", os.path.join(out_dir, "summary.json"))
    Console().print(t)
