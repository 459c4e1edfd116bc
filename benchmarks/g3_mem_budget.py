"""G3 under a device memory budget (``FullGraphConfig.mem_budget_bytes``, seed 000 §4.4.1; digest B2.5, G-MEM).

Measured on this machine's CPU, one rank, in-memory synthetic graph, one full-graph step (forward + backward) per
budget, side by side with no budget: the peak bytes PyTorch's CPU allocator held above the step's start and the
bytes it held when the forward ended, i.e. what the step keeps for backward
(:func:`flowlane.testing.memory.cpu_allocation_peak`: activations, layer tensors, gradients, temporaries), the
step time (median of ``--repeats``), the number of bins and the largest bin estimate (each must be <= budget / 2).
A budget too small for one node is recorded as refused. No GPU: DGL does not import on the GPU machine, so device
memory itself is not measured.

    .venv-gnn/bin/python benchmarks/g3_mem_budget.py --out results/g3/mem_budget.json
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
from flowlane.testing.memory import cpu_allocation_peak  # noqa: E402
from flowlane.testing.provenance import write_result  # noqa: E402


def budgets(text: str) -> list[float | None]:
    """``none,64e6`` -> [None, 64e6]; anything else than ``none`` or a number of bytes > 0 is refused, named."""
    out: list[float | None] = []
    for item in text.split(","):
        item = item.strip().lower()
        try:
            out.append(None if item == "none" else float(item))
        except ValueError:
            raise argparse.ArgumentTypeError(f"budget {item!r}: use 'none' or a number of bytes") from None
        if out[-1] is not None and not out[-1] > 0:
            raise argparse.ArgumentTypeError(f"budget {item!r}: must be > 0 bytes")
    return out


def measure(rt: FullGraphRuntime, repeats: int) -> tuple[int, int, float]:
    """Allocator peak of one step, bytes held when its forward ends, median step time."""
    rt.backward(rt.loss(rt.forward()))  # warm-up (lazy allocations, DGL's first-call set-up)
    with cpu_allocation_peak() as peak:
        loss = rt.loss(rt.forward())
        peak.mark("forward_end")
        rt.backward(loss)
        del loss
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        rt.backward(rt.loss(rt.forward()))
        times.append(time.perf_counter() - t0)
    return peak.peak_bytes, peak.at_marks["forward_end"], statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_graph_args(ap, feat_dim=128, layers=3)
    ap.add_argument(
        "--budgets", type=budgets, default="none,256e6,64e6,16e6", help="comma list of bytes; none"
    )
    a = ap.parse_args()
    g = graph_from_args(ap, a)
    rows = []
    for budget in a.budgets:
        model = build_model(a.model, a.feat_dim, a.hidden, 8, num_layers=a.layers, seed=0)
        try:
            rt = FullGraphRuntime(g, model, FullGraphConfig(device="cpu", mem_budget_bytes=budget))
        except ValueError as e:  # a node that alone exceeds budget / 2: refused at install, recorded
            rows.append({"mem_budget_bytes": budget, "refused": str(e)})
            print(f"budget {budget}: refused: {e}", flush=True)
            continue
        with rt:
            peak, held, step = measure(rt, a.repeats)
        point = {
            "mem_budget_bytes": budget,
            "bins": sum(len(v) for v in rt.bins.values()),
            "bin_bytes_max": max(rt.bin_bytes, default=None),
            "bins_within_half_budget": budget is None or max(rt.bin_bytes) <= budget / 2,
            "step_peak_bytes": peak,
            "held_after_forward_bytes": held,
            "backward_above_forward_bytes": peak - held,
            "step_s": step,
        }
        rows.append(point)
        print(
            f"budget {budget}: {point['bins']} bins (largest est. {point['bin_bytes_max']}), step peak "
            f"{peak / 1e6:.1f} MB, after forward {held / 1e6:.1f} MB, step {step:.3f} s",
            flush=True,
        )
    base = next((r for r in rows if r["mem_budget_bytes"] is None), None)
    if base is not None:
        for r in (r for r in rows if "refused" not in r):
            r["peak_ratio_vs_no_budget"] = r["step_peak_bytes"] / base["step_peak_bytes"]
            r["step_ratio_vs_no_budget"] = r["step_s"] / base["step_s"]
    doc = {
        "label": "measured on CPU (one rank): allocator bytes above the step's start, at its peak and when its "
        "forward ends",
        "nodes": a.nodes,
        "feat_dim": a.feat_dim,
        "hidden": a.hidden,
        "layers": a.layers,
        "model": a.model,
        "points": rows,
    }
    print(write_result(a.out, doc))


if __name__ == "__main__":
    main()
