"""What G3's bins cost (``FullGraphConfig.bin_size``, seed 000 §4.4.3): one full-graph ``train_step`` with one bin per
group (``bin_size: null``, the default) vs bins of 1000 nodes (the seed's, DGL's batch size: a group of several
bins, each a block compacted to the source rows its edges read).

Measured on this machine's CPU with one thread (``torch.set_num_threads(1)``), one rank (a gloo process group of
world size 1 in this process, so no halo exchange: every node is in group D), in-memory synthetic graph
(:func:`dgl_plugin.synthetic.synthetic_graph`: power-law degrees, average degree 10, 32 features, 8 classes, 32
communities, seed 0), 2-layer SAGE 32-64-8, Adam. Per graph size both settings are built, each takes one untimed
warm-up step, then their timed steps alternate (A B A B ...) so the machine's load hits both alike; the figure is
the best of ``--repeats`` (every step time is recorded).

    .venv-gnn/bin/python benchmarks/g3_bin_cost.py --out results/g3/bin_cost.json
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from benchmarks.g3_host_features import bin_sizes  # noqa: E402
from dgl_plugin.fullgraph import FullGraphConfig, FullGraphRuntime  # noqa: E402
from dgl_plugin.models import build_model  # noqa: E402
from dgl_plugin.synthetic import synthetic_graph  # noqa: E402
from flowlane.testing.provenance import write_result  # noqa: E402

FEAT, HIDDEN, CLASSES, LAYERS = 32, 64, 8, 2


def node_counts(text: str) -> list[int]:
    """``12500,125000`` -> [12500, 125000]; anything but integers >= 100 is refused, named."""
    out = []
    for item in text.split(","):
        item = item.strip()
        if not (item.isdigit() and int(item) >= 100):
            raise argparse.ArgumentTypeError(f"node count {item!r}: use an integer >= 100")
        out.append(int(item))
    return out


def runtime(g, bins: int | None) -> tuple[FullGraphRuntime, torch.optim.Optimizer]:
    model = build_model("sage", FEAT, HIDDEN, CLASSES, num_layers=LAYERS, seed=0)
    rt = FullGraphRuntime(g, model, FullGraphConfig(bin_size=bins, device="cpu"))
    return rt, torch.optim.Adam(rt.model.parameters(), lr=0.01)


def timed_step(rt: FullGraphRuntime, opt: torch.optim.Optimizer) -> tuple[float, float]:
    """Wall and CPU seconds of one step (CPU time: this process, all threads; on a loaded host it counts the work,
    not the waits for a core)."""
    opt.zero_grad(set_to_none=True)
    t0, c0 = time.perf_counter(), time.process_time()
    rt.train_step(opt)
    return time.perf_counter() - t0, time.process_time() - c0


def measure(nodes: int, settings: list[int | None], repeats: int) -> list[dict]:
    g = synthetic_graph(
        num_nodes=nodes, avg_degree=10, num_classes=CLASSES, num_communities=32, feat_dim=FEAT, seed=0
    )
    rts = [runtime(g, bins) for bins in settings]
    try:
        for rt, opt in rts:  # warm-up: lazy allocations, DGL's first-call set-up
            timed_step(rt, opt)
        times: list[list[tuple[float, float]]] = [[] for _ in rts]
        for _ in range(repeats):
            for t, (rt, opt) in zip(times, rts, strict=True):
                t.append(timed_step(rt, opt))
        rows = []
        for bins, (rt, _), tc in zip(settings, rts, times, strict=True):
            t, c = [w for w, _ in tc], [x for _, x in tc]
            groups = {k: len(v) for k, v in rt.bins.items() if v}
            compacted = sorted(k for k, v in rt._gather.items() if v is not None)
            rows.append(
                {
                    "nodes": nodes,
                    "edges": g.num_edges(),
                    "bin_size": bins,
                    "bins_per_group": groups,
                    "compacted_groups": compacted,
                    "step_s_best": min(t),
                    "step_s_all": t,
                    "step_cpu_s_best": min(c),
                    "step_cpu_s_all": c,
                }
            )
            print(
                f"{nodes} nodes, bin_size {bins}: bins {groups}, compacted {compacted}, best {min(t):.4f} s "
                f"of {[round(x, 4) for x in t]} (CPU best {min(c):.4f} s)",
                flush=True,
            )
        return rows
    finally:
        for rt, _ in rts:
            rt.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", type=node_counts, default="12500,125000", help="comma list of node counts")
    ap.add_argument(
        "--bin-sizes", type=bin_sizes, default="none,1000", help="comma list; none = one bin per group"
    )
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    if a.repeats < 1:
        ap.error(f"--repeats {a.repeats}: must be >= 1")
    torch.set_num_threads(1)
    t_start, load0 = time.perf_counter(), os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group(
            "gloo", store=dist.FileStore(os.path.join(tmp, "store"), 1), rank=0, world_size=1
        )
        try:
            rows = [r for n in a.sizes for r in measure(n, a.bin_sizes, a.repeats)]
        finally:
            dist.destroy_process_group()
    for r in rows:  # each setting against one bin per group at the same size
        base = next((b for b in rows if b["nodes"] == r["nodes"] and b["bin_size"] is None), None)
        if base is not None:
            r["step_ratio_vs_one_bin"] = r["step_s_best"] / base["step_s_best"]
            r["cpu_ratio_vs_one_bin"] = r["step_cpu_s_best"] / base["step_cpu_s_best"]
    doc = {
        "label": "measured on CPU (one thread)",
        "what": f"FullGraphRuntime.train_step, 2-layer SAGE {FEAT}-{HIDDEN}-{CLASSES}, one rank (gloo, world 1), "
        f"best of {a.repeats} after one warm-up step, settings alternated",
        "torch_threads": torch.get_num_threads(),
        "repeats": a.repeats,
        "points": rows,
        "wall_s": time.perf_counter() - t_start,
        "loadavg_1m_before_after": [load0, os.getloadavg()[0]],
    }
    print(write_result(a.out, doc))


if __name__ == "__main__":
    main()
