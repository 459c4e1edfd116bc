"""Plot the G3 / DistDGL time-to-accuracy ratio of ``benchmarks/g3_distdgl.py`` sweeps against layers and fanout.

Reads one or more sweep JSONs (``--layers ... --fanouts ...`` runs) and draws, per file (one link speed), the
speed-up of G3 over DistDGL (DistDGL's time to the target / G3's, after start-up; > 1: G3 faster), each seed as a
dot and the median as a line: left against the number of layers (one line per fanout), right against the fanout (one
line per layer count). Labelled with the files' own label (EMULATED links).

Run: .venv-gnn/bin/python benchmarks/g3_distdgl_plot.py results/g3/distdgl_sweep_50000_100mbit.json [more.json]
     [--out results/g3/distdgl_sweep.png]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("results", nargs="+", help="sweep JSONs written by benchmarks/g3_distdgl.py")
    ap.add_argument("--out", default="results/g3/distdgl_sweep.png")
    a = ap.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    docs = []
    for p in a.results:
        d = json.loads(Path(p).read_text())
        if not d.get("per_config"):
            raise SystemExit(f"{p}: no per_config rows (not a sweep result of benchmarks/g3_distdgl.py)")
        docs.append((p, d))
    fig, axes = plt.subplots(len(docs), 2, figsize=(11, 4 * len(docs)), squeeze=False)
    for (_p, d), (ax_l, ax_f) in zip(docs, axes, strict=True):
        rows = [r for r in d["per_config"] if r["speedup_per_seed"]]
        fanouts = sorted({r["fanout"][0] for r in rows})
        layers = sorted({r["layers"] for r in rows})
        for f in fanouts:
            pts = sorted((r["layers"], r) for r in rows if r["fanout"][0] == f)
            (line,) = ax_l.plot(
                [n for n, _ in pts], [r["speedup_median"] for _, r in pts], marker="o", label=f"fanout {f}"
            )
            for n, r in pts:
                seeds = r["speedup_per_seed"]
                ax_l.scatter([n] * len(seeds), seeds, s=12, alpha=0.5, color=line.get_color())
        for n in layers:
            pts = sorted((r["fanout"][0], r) for r in rows if r["layers"] == n)
            (line,) = ax_f.plot(
                [f for f, _ in pts], [r["speedup_median"] for _, r in pts], marker="o", label=f"{n} layers"
            )
            for f, r in pts:
                seeds = r["speedup_per_seed"]
                ax_f.scatter([f] * len(seeds), seeds, s=12, alpha=0.5, color=line.get_color())
        args = d["args"]
        title = (
            f"{args['nodes'] // 1000}k nodes, {args['parts']} parts, {args['rate_mbit']:g} Mbit/s EMULATED, "
            f"target {args['target']}"
        )
        for ax, xl in ((ax_l, "GNN layers"), (ax_f, "per-layer fanout (DistDGL)")):
            ax.axhline(1.0, color="grey", lw=0.8, ls="--")
            ax.set_xlabel(xl)
            ax.set_ylabel("G3 speed-up (DistDGL time / G3 time)")
            ax.set_title(title, fontsize=9)
            ax.legend(fontsize=8)
            ax.grid(alpha=0.3)
            ax.set_ylim(bottom=0)
        ax_l.set_xticks(layers)
        ax_f.set_xscale("log")
        ax_f.minorticks_off()
        ax_f.set_xticks(fanouts, [str(f) for f in fanouts])
    fig.suptitle(
        "G3 vs real DistDGL, time to the same validation accuracy (dots: seeds; line: median; <1: DistDGL faster)"
    )
    fig.tight_layout()
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(a.out, dpi=110)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
