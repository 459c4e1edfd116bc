"""The Recompute-Offload-Keep (ROK) curve of SSDTrain (seed 003 §5.4.3, Fig. 5.12; digest §2.2.12).

Each point is one run: a micro-batch size B and a strategy (keep, flowlane offload, Megatron-core full
recomputation), measured side by side by ``ssd_offload_bench.measure`` on the same Megatron-core GPT. x = peak
saved-activation memory (logical residency on CPU, digest A6), y = model throughput = Megatron's model FLOPs per step
(72*B*s*L*h^2*(1 + s/(6h) + V/(12hL)); recomputed FLOPs do not count) / median step time. Points not dominated by
another (less or equal memory and more or equal throughput) form the efficient frontier. The thesis' reading: at the
same B offload keeps keep's throughput at a lower peak, and at a fixed activation budget it fits about twice keep's
B.

    .venv-llm/bin/python benchmarks/ssd_offload_rok.py --micro-batches 1,2,4,8 --compute-threads 1 --o-direct off
        # -> results/ssd_offload/rok_<tag>.json + .png; options after --micro-batches go to ssd_offload_bench
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import ssd_offload_bench as bench  # noqa: E402

from flowlane.offload.estimate import LayerShape, gpt_model_flops_per_step  # noqa: E402
from flowlane.testing.provenance import write_result  # noqa: E402

STRATEGIES = ("keep", "offload", "recompute")


def pareto_front(points: list[dict]) -> list[dict]:
    """The points no other point dominates: less or equal ``peak_bytes`` and more or equal ``throughput``, one of
    them strictly. Sorted by memory."""
    front = []
    for p in points:
        dominated = any(
            q["peak_bytes"] <= p["peak_bytes"]
            and q["throughput"] >= p["throughput"]
            and (q["peak_bytes"] < p["peak_bytes"] or q["throughput"] > p["throughput"])
            for q in points
        )
        if not dominated:
            front.append(p)
    return sorted(front, key=lambda p: p["peak_bytes"])


def largest_batch_within(points: list[dict], strategy: str, budget_bytes: float) -> int | None:
    """The largest B whose ``strategy`` run peaks within ``budget_bytes`` (None: no run does)."""
    fits = [p["micro_batch"] for p in points if p["strategy"] == strategy and p["peak_bytes"] <= budget_bytes]
    return max(fits, default=None)


def _batches(v: str) -> list[int]:
    try:
        out = [int(x) for x in v.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--micro-batches must be integers separated by commas, got {v!r}"
        ) from None
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"--micro-batches must be >= 1 each, got {v!r}")
    return sorted(set(out))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--micro-batches", type=_batches, default=[1, 2, 4, 8], help="B values, e.g. 1,2,4,8")
    own, rest = p.parse_known_args(argv)
    bp = bench.build_parser()
    a = bp.parse_args(rest)
    bench.setup(a, bp)
    points: list[dict] = []
    runs = []
    for i, b in enumerate(own.micro_batches):
        a.micro_batch = b
        print(f"[{i + 1}/{len(own.micro_batches)}] micro-batch {b}: keep, offload, recompute ...", flush=True)
        r = bench.measure(a)
        flops = gpt_model_flops_per_step(
            LayerShape(a.seq, b, a.hidden, a.heads, dropout=False, elem_bytes=4), a.layers, a.vocab
        )
        for s in STRATEGIES:
            points.append(
                {
                    "micro_batch": b,
                    "strategy": s,
                    "peak_bytes": r["peak_activation_bytes"][s],
                    "step_s": r["step_time_s_median"][s],
                    "model_flops": flops,
                    "throughput": flops / r["step_time_s_median"][s],
                    "minor_page_faults": r["minor_page_faults_per_step_median"][s],
                }
            )
        runs.append({k: r[k] for k in ("load_average_1m", "ratios", "offload", "step_time_s_all")} | {"B": b})
        line = ", ".join(
            f"{p['strategy']} {p['peak_bytes'] / 2**20:.1f} MiB {p['throughput'] / 1e9:.2f} GFLOP/s"
            for p in points[-3:]
        )
        print(f"    {line}", flush=True)
    front = pareto_front(points)
    by = {(p["strategy"], p["micro_batch"]): p for p in points}
    same_b = {
        str(b): {
            "offload_throughput_vs_keep": by["offload", b]["throughput"] / by["keep", b]["throughput"],
            "offload_peak_vs_keep": by["offload", b]["peak_bytes"] / by["keep", b]["peak_bytes"],
            "offload_peak_vs_recompute": by["offload", b]["peak_bytes"] / by["recompute", b]["peak_bytes"],
        }
        for b in own.micro_batches
    }
    at_keep_budget = {
        str(b): {s: largest_batch_within(points, s, by["keep", b]["peak_bytes"]) for s in STRATEGIES}
        for b in own.micro_batches
    }
    doc = {
        "label": f"measured on {a.device} (logical residency of saved-activation storages, digest A6; model FLOPs)",
        "config": {k: v for k, v in vars(a).items() if k != "micro_batch"}
        | {"micro_batches": own.micro_batches},
        "points": points,
        "frontier": [(p["strategy"], p["micro_batch"]) for p in front],
        "same_micro_batch": same_b,
        "largest_micro_batch_within_keeps_peak": at_keep_budget,
        "runs": runs,
    }
    out = Path(a.out)
    tag = a.tag or f"{a.device}_{a.backend}_L{a.layers}"
    write_result(out / f"rok_{tag}.json", doc)
    _plot(doc, front, out / f"rok_{tag}.png")
    print(f"wrote {out / f'rok_{tag}.json'}; frontier: {doc['frontier']}")
    return 0


def _plot(doc: dict, front: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    colors = {"keep": "#888888", "offload": "#2a7ab9", "recompute": "#d9822b"}
    for s in STRATEGIES:
        pts = [p for p in doc["points"] if p["strategy"] == s]
        xs, ys = [p["peak_bytes"] / 2**20 for p in pts], [p["throughput"] / 1e9 for p in pts]
        ax.plot(xs, ys, "o-", color=colors[s], label=s)
        for p, x, y in zip(pts, xs, ys, strict=True):
            ax.annotate(
                f"B={p['micro_batch']}", (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points"
            )
    ax.plot(
        [p["peak_bytes"] / 2**20 for p in front],
        [p["throughput"] / 1e9 for p in front],
        "--",
        color="black",
        lw=0.8,
        label="efficient frontier",
    )
    # differences of a few % are within a shared CPU's noise: the axis starts at 0 and does not magnify them
    ax.set_ylim(bottom=0)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("peak saved-activation memory (MiB, log scale)")
    ax.set_ylabel("model throughput (GFLOP/s)")
    c = doc["config"]
    ax.set_title(
        f"ROK curve, {c['layers']}-layer GPT h={c['hidden']} s={c['seq']} on {c['device']} (measured)",
        fontsize=9,
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
