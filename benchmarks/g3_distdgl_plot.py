"""Plot the G3 / DistDGL time-to-accuracy ratio of ``benchmarks/g3_distdgl.py`` sweeps against layers and fanout.

Reads one or more sweep JSONs (``--layers ... --fanouts ...`` runs; one per link speed) and draws per file the
speed-up of G3 over DistDGL (DistDGL's time to the target / G3's, after start-up; > 1: G3 faster): each seed as a
dot, the median over the seeds where both reached the target as a line; left against the number of layers (one line
per fanout), right against the fanout (one line per layer count). A seed where only DistDGL reached the target within
its epochs is drawn as a down triangle at DistDGL's time / G3's whole training time (the speed-up is below it); only
G3, an up triangle (above it). Titles carry the file's link speed (EMULATED links).

Run: .venv-gnn/bin/python benchmarks/g3_distdgl_plot.py results/g3/distdgl_sweep_50000_100mbit.json [more.json]
     [--out results/g3/distdgl_sweep.png]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def speedups(doc: dict) -> dict[tuple[int, int], dict[str, list[float]]]:
    """Per (layers, first-layer fanout): ``measured`` speed-ups, and ``below`` / ``above`` bounds for seeds where
    only DistDGL / only G3 reached the target (bound = DistDGL's time / G3's, either's last epoch where it did not)."""
    out: dict[tuple[int, int], dict[str, list[float]]] = {}
    for run in doc["runs"]:
        for row in run.get("configs", {}).values():
            dd, g3 = row["distdgl"], row["g3"]
            if g3 is None:
                continue
            key = (dd["layers"], dd["fanout"][0])
            v = out.setdefault(key, {"measured": [], "below": [], "above": [], "train_only": []})
            t_dd, t_g3 = row["tta_distdgl_s"], row["tta_g3_s"]
            if t_dd and t_g3:
                v["measured"].append(t_dd / t_g3)
                tr_dd, tr_g3 = _train_only(dd["history"], t_dd), _train_only(g3["history"], t_g3)
                if tr_dd is not None and tr_g3 is not None:
                    v["train_only"].append(tr_dd / tr_g3)
            elif t_dd:
                v["below"].append(t_dd / g3["history"][-1]["t"])
            elif t_g3:
                v["above"].append(dd["history"][-1]["t"] / t_g3)
    return out


def _train_only(hist: list[dict], t_target: float) -> float | None:
    """Time to the target less the evaluations up to it (None where the run did not record ``eval_s``)."""
    upto = [h for h in hist if h["t"] <= t_target]
    if any("eval_s" not in h for h in upto):
        return None
    return t_target - sum(h["eval_s"] for h in upto)


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


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
        if not d.get("runs") or "per_config" not in d:
            raise SystemExit(f"{p}: no runs / per_config (not a sweep result of benchmarks/g3_distdgl.py)")
        docs.append(d)
    all_fanouts = sorted({f for d in docs for f in (row[1] for row in speedups(d))})
    all_layers = sorted({n for d in docs for n in (row[0] for row in speedups(d))})
    fig, axes = plt.subplots(len(docs), 2, figsize=(11, 4 * len(docs)), squeeze=False)
    for d, (ax_l, ax_f) in zip(docs, axes, strict=True):
        sp = speedups(d)
        palette = plt.rcParams["axes.prop_cycle"].by_key()["color"]
        layers = sorted({n for n, _ in sp})
        fanouts = sorted({f for _, f in sp})
        for ax, groups, xs_of, lab in (
            (ax_l, fanouts, lambda g, ls=layers: [(n, (n, g)) for n in ls], "fanout {}"),
            (ax_f, layers, lambda g, fs=fanouts: [(f, (g, f)) for f in fs], "{} layers"),
        ):
            colours = {
                g: palette[i % len(palette)]
                for i, g in enumerate(all_fanouts if lab.startswith("fanout") else all_layers)
            }
            for g in groups:
                pts = [(x, sp[k]) for x, k in xs_of(g) if k in sp]
                med = [(x, _median(v["measured"])) for x, v in pts if v["measured"]]
                c = colours[g]
                ax.plot([x for x, _ in med], [m for _, m in med], marker="o", label=lab.format(g), color=c)
                tro = [(x, _median(v["train_only"])) for x, v in pts if v["train_only"]]
                if tro:
                    ax.plot(
                        [x for x, _ in tro],
                        [m for _, m in tro],
                        marker="x",
                        ls=":",
                        color=c,
                        label=lab.format(g) + ", training only",
                    )
                for x, v in pts:
                    for kind, marker in (("measured", "o"), ("below", "v"), ("above", "^")):
                        if v[kind]:
                            ax.scatter([x] * len(v[kind]), v[kind], s=22, alpha=0.6, color=c, marker=marker)
        args = d["args"]
        title = (
            f"{args['nodes'] // 1000}k nodes, {args['parts']} parts, {args['rate_mbit']:g} Mbit/s EMULATED, "
            f"target {args['target']}, {sum(1 for r in d['runs'] if r.get('configs'))} seed(s)"
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
        "G3 vs real DistDGL, time to the same validation accuracy; speed-up < 1: DistDGL faster\n"
        "dots: seeds; line: median; v: G3 did not reach it (speed-up below); dotted: training time only, where recorded",
        fontsize=10,
    )
    fig.tight_layout()
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(a.out, dpi=110)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
