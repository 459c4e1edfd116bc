"""G3 with the input features in host memory (``FullGraphConfig.features="host"``, PyTorch-Direct) vs on the device.

Measured on this machine's CPU, one rank, in-memory synthetic graph: the bytes autograd holds for backward during one
full-graph step (distinct storages saved by the forward: what would sit in GPU memory until backward), the feature
table's bytes, and the step time (forward + backward, median of ``--repeats``). On a CPU the host path is a CPU gather
and layer 0 is recomputed in backward, so the time ratio is the recomputation's cost here; a GPU's zero-copy gather
was not run (DGL does not import on the GPU machine).

    .venv-gnn/bin/python benchmarks/g3_host_features.py --out results/g3/host_features.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


from benchmarks._g3_one_rank import add_graph_args, graph_from_args  # noqa: E402
from dgl_plugin.fullgraph import FullGraphConfig, FullGraphRuntime  # noqa: E402
from dgl_plugin.models import build_model  # noqa: E402
from flowlane.offload import track_saved_tensors  # noqa: E402
from flowlane.testing.provenance import write_result  # noqa: E402


def held_bytes_and_time(rt: FullGraphRuntime, repeats: int) -> tuple[int, float]:
    """Peak bytes of saved activations alive in one step (flowlane.offload's tracker: distinct storages, parameters
    excluded), and the median step time of ``repeats`` further steps."""
    with track_saved_tensors(0, list(rt.model.parameters())) as res:
        rt.backward(rt.loss(rt.forward()))
    times = []
    for _ in range(repeats):  # the tracked step is not timed
        t0 = time.perf_counter()
        rt.backward(rt.loss(rt.forward()))
        times.append(time.perf_counter() - t0)
    return res.peak, statistics.median(times)


def bin_sizes(text: str) -> list[int | None]:
    """``none,10000`` -> [None, 10000]; anything else than ``none`` or an integer >= 1 is refused, named."""
    out: list[int | None] = []
    for item in text.split(","):
        item = item.strip().lower()
        if item == "none":
            out.append(None)
        elif item.isdigit() and int(item) >= 1:
            out.append(int(item))
        else:
            raise argparse.ArgumentTypeError(f"bin size {item!r}: use 'none' or an integer >= 1")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_graph_args(ap, feat_dim=512, layers=2)
    ap.add_argument(
        "--bin-sizes", type=bin_sizes, default="none,10000", help="comma list; none = one bin per group"
    )
    a = ap.parse_args()
    g = graph_from_args(ap, a)
    table = g.ndata["feat"].nbytes
    rows = []
    for bins in a.bin_sizes:
        point: dict = {"bin_size": bins}
        for feats in ("device", "host"):
            model = build_model(a.model, a.feat_dim, a.hidden, 8, num_layers=a.layers, seed=0)
            cfg = FullGraphConfig(
                bin_size=bins,
                device="cpu",
                features=feats,
                direct={"path": "cpu-gather"} if feats == "host" else {},
            )
            with FullGraphRuntime(g, model, cfg) as rt:
                held, step = held_bytes_and_time(rt, a.repeats)
            point[feats] = {"held_for_backward_bytes": held, "step_s": step}
            print(f"bins {bins} features={feats}: held {held / 1e6:.1f} MB, step {step:.3f} s", flush=True)
        d, h = point["device"], point["host"]
        point["held_ratio_host_over_device"] = h["held_for_backward_bytes"] / d["held_for_backward_bytes"]
        point["step_ratio_host_over_device"] = h["step_s"] / d["step_s"]
        rows.append(point)
    doc = {
        "label": "measured on CPU (one rank); held bytes = peak of saved-activation storages alive in one step",
        "nodes": a.nodes,
        "feat_dim": a.feat_dim,
        "hidden": a.hidden,
        "layers": a.layers,
        "model": a.model,
        "feature_table_bytes": table,
        "points": rows,
    }
    print(write_result(a.out, doc))


if __name__ == "__main__":
    main()
