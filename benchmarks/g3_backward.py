"""G3 pipelined backward (issue #34 item 4): epoch and backward time with the halo-gradient exchange blocking inside
autograd vs run in the background (``pipeline_backward``), same pipelined forward, same partition.

gloo ranks on CPU with an EMULATED per-peer link (flowlane.plan executor: sleep bytes/B after each stage), so the
figures are emulated, not a real network. The two variants alternate epoch by epoch (A B A B ...) so machine load
hits both alike; medians over the epochs. Gradients are checked equal (allclose, fp32) between the variants.

Run: .venv-gnn/bin/python benchmarks/g3_backward.py [--nodes 20000] [--ranks 3] [--layers 3] [--bw 5e6]
     -> results/g3/backward.json
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _worker(rank, world, spec, layers, hidden, bw, epochs, bin_size):
    import torch

    from dgl_plugin.fullgraph import FullGraphConfig, FullGraphRuntime
    from dgl_plugin.models import build_model
    from dgl_plugin.synthetic import SyntheticSpec, synthetic_graph

    torch.set_num_threads(1)
    g = synthetic_graph(SyntheticSpec(**spec))
    variants = {}
    part = None
    for pb in (False, True):
        model = build_model("sage", spec["feat_dim"], hidden, spec["num_classes"], layers, seed=0)
        cfg = FullGraphConfig(
            schedule="pipelined", pipeline_backward=pb, emulate_bandwidth=bw, bin_size=bin_size, device="cpu"
        )
        rt = FullGraphRuntime(g, model, cfg, part=part)
        part = rt.part
        variants[pb] = (rt, model)
    rec = {False: {"epoch_s": [], "backward_s": []}, True: {"epoch_s": [], "backward_s": []}}
    grads = {}
    for e in range(epochs + 1):  # epoch 0: warm-up, not recorded
        for pb in (False, True) if e % 2 == 0 else (True, False):
            rt, model = variants[pb]
            torch.distributed.barrier()
            t0 = time.perf_counter()
            loss = rt.loss(rt.forward())
            t1 = time.perf_counter()
            rt.backward(loss)
            t2 = time.perf_counter()
            if e > 0:
                rec[pb]["epoch_s"].append(t2 - t0)
                rec[pb]["backward_s"].append(t2 - t1)
            if e == 0:
                grads[pb] = [p.grad.clone() for p in model.parameters()]
    same = all(
        torch.allclose(a, b, rtol=1e-4, atol=1e-6) for a, b in zip(grads[False], grads[True], strict=True)
    )
    rt = variants[True][0]
    summary = {k: rt.summary()[k] for k in ("n_local", "n_remote", "n_boundary", "bins", "backward")}
    for rt, _ in variants.values():
        rt.close()
    return {
        "rank": rank,
        "same_gradients": bool(same),
        "blocking": rec[False],
        "pipelined": rec[True],
        "summary": summary,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nodes", type=int, default=20000)
    ap.add_argument("--ranks", type=int, default=3)
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--bw", type=float, default=5e6, help="emulated per-peer link, bytes/s")
    ap.add_argument("--epochs", type=int, default=6)
    ap.add_argument("--bin-size", type=int, default=1000)
    ap.add_argument("--out", default="results/g3/backward.json")
    a = ap.parse_args()
    from flowlane.launch import launch
    from flowlane.testing.provenance import write_result

    spec = dict(num_nodes=a.nodes, avg_degree=10, num_classes=8, num_communities=32, feat_dim=64, seed=0)
    res = launch(_worker, a.ranks, args=(spec, a.layers, a.hidden, a.bw, a.epochs, a.bin_size), timeout=1800)

    def med(key, var):  # an epoch ends when the slowest rank ends: per-epoch max over ranks, then median
        return float(np.median(np.max([r[var][key] for r in res], axis=0)))

    out = {
        "label": "EMULATED link (sleep bytes/B per exchange stage), gloo on a shared 2-core CPU box",
        "graph": spec,
        "ranks": a.ranks,
        "layers": a.layers,
        "hidden": a.hidden,
        "model": "sage (forward_layer), fp32, schedule=pipelined",
        "emulated_bandwidth_Bps": a.bw,
        "epochs_timed": a.epochs,
        "same_gradients": all(r["same_gradients"] for r in res),
        "median_epoch_s": {v: med("epoch_s", v) for v in ("blocking", "pipelined")},
        "median_backward_s": {v: med("backward_s", v) for v in ("blocking", "pipelined")},
        "per_rank": res,
    }
    out["backward_speedup"] = out["median_backward_s"]["blocking"] / out["median_backward_s"]["pipelined"]
    out["epoch_speedup"] = out["median_epoch_s"]["blocking"] / out["median_epoch_s"]["pipelined"]
    write_result(a.out, out)
    print(
        f"backward blocking {out['median_backward_s']['blocking']:.3f}s pipelined "
        f"{out['median_backward_s']['pipelined']:.3f}s ({out['backward_speedup']:.2f}x); epoch "
        f"{out['median_epoch_s']['blocking']:.3f}s vs {out['median_epoch_s']['pipelined']:.3f}s "
        f"({out['epoch_speedup']:.2f}x); same gradients: {out['same_gradients']}"
    )
    if not out["same_gradients"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
