"""Plot an activation-offload GPU run (``tests/gpu/offload_bench.py`` or ``tests/gpu/megatron_offload_bench.py``):
memory against step time, per size.

One panel per size (hidden x layers). Each strategy is a point at (step time / keep's, activation peak / keep's):
a hollow marker for the allocated peak (``max_memory_allocated``), a filled one for the reserved peak (what the
caching allocator held after ``empty_cache``), joined by a line, since the two differ by the blocks still being
copied and the allocator's caching (docs/offload.md). The goal of issue 36 for the size is the shaded box (at least
40 % / 70 % less at most 5 % slower). Labelled MEASURED with the run's device and commit.

Run: .venv-llm/bin/python benchmarks/offload_gpu_plot.py [results/gpu/offload_bench.json] [--out results/gpu/offload_bench.png]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def points(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """Per size: its label and, per strategy that ran, (time ratio, allocated ratio, reserved ratio or None)."""
    out = []
    for size in doc["sizes"]:
        rows = {}
        for name, r in size["strategies"].items():
            if r.get("status") != "ok" or name == "keep" or "time_ratio_vs_keep" not in r:
                continue
            rows[name] = (
                r["time_ratio_vs_keep"],
                r["act_mem_ratio_vs_keep"],
                r.get("reserved_ratio_vs_keep"),
            )
        # the goal the bench judged this size by (issue 36): (memory saved at least, step time ratio at most)
        judged = next(iter(size.get("goal", {}).values()), None)
        goal = (judged["act_mem_saved_at_least"], judged["step_time_ratio_at_most"]) if judged else None
        out.append(
            {
                "hidden": size["hidden"],
                "layers": size["layers"],
                "batch": size["batch"],
                "rows": rows,
                "goal": goal,
            }
        )
    return out


def source_script(doc: dict[str, Any]) -> str:
    """The bench that wrote ``doc``: the ``.py`` in its provenance command."""
    words = str(doc.get("provenance", {}).get("command", "")).split()
    return next((w for w in words if w.endswith(".py")), "tests/gpu/offload_bench.py")


def _colors(panels: list[dict[str, Any]]) -> dict[str, Any]:
    """One color per strategy, the same in every panel."""
    import matplotlib.pyplot as plt

    names = sorted({n for p in panels for n in p["rows"]})
    return {n: plt.cm.tab20(i % 20) for i, n in enumerate(names)}


def _draw(ax: Any, p: dict[str, Any], colors: dict[str, Any], xlim: tuple[float, float], log: bool) -> None:
    if p["goal"] is not None:
        goal, slowest = p["goal"]
        ax.axvspan(0, slowest, ymax=(1 - goal) / 1.1, color="tab:green", alpha=0.12, lw=0)
        ax.text(
            xlim[0] * 1.005,
            (1 - goal) / 2,
            f"goal: >= {goal:.0%} less, <= {slowest - 1:.0%} slower",
            fontsize=7,
            color="green",
        )
    for name, (t, alloc, res) in sorted(p["rows"].items()):
        c = colors[name]
        ax.scatter([t], [alloc], facecolors="none", edgecolors=[c], s=40, zorder=3)
        if res is not None:
            ax.plot([t, t], [alloc, res], color=c, lw=0.8, zorder=2)
        ax.scatter(
            [t], [res if res is not None else alloc], color=[c], s=40 if res is not None else 10, zorder=3
        )
    ax.axhline(1.0, color="grey", lw=0.6, ls=":")
    ax.axvline(1.0, color="grey", lw=0.6, ls=":")
    if log:
        ax.set_xscale("log")
        ticks = [t for t in (0.8, 1.0, 1.25, 1.5, 2.0, 3.0, 4.0) if xlim[0] <= t <= xlim[1]]
        ax.set_xticks(ticks, [f"{t:g}x" for t in ticks])
        ax.minorticks_off()
    ax.set_xlim(*xlim)
    ax.set_ylim(0, 1.1)


def plot(doc: dict[str, Any], out: Path) -> None:
    """Top row: every strategy (log time axis); bottom row: the region around keep's step time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    panels = points(doc)
    colors = _colors(panels)
    fig, axes = plt.subplots(2, len(panels), figsize=(6.2 * len(panels), 9.5), squeeze=False)
    for col, p in enumerate(panels):
        slowest = max([4.5] + [t * 1.15 for t, _, _ in p["rows"].values()])
        _draw(axes[0][col], p, colors, (0.8, slowest), log=True)
        _draw(axes[1][col], p, colors, (0.97, 1.10), log=False)
        axes[0][col].set_title(f"hidden {p['hidden']}, {p['layers']} layers, batch {p['batch']}", fontsize=10)
        axes[1][col].set_title("around keep's step time", fontsize=9)
        for row in (0, 1):
            axes[row][col].set_xlabel("step time / keep's")
            axes[row][col].set_ylabel("activation peak / keep's")
    handles = [Line2D([], [], marker="o", ls="", color=c, label=n) for n, c in colors.items()]
    handles += [
        Line2D([], [], marker="o", ls="", markerfacecolor="none", color="k", label="allocated peak"),
        Line2D([], [], marker="o", ls="", color="k", label="reserved peak"),
    ]
    fig.legend(handles=handles, loc="lower center", ncol=min(8, len(handles)), fontsize=8)
    prov = doc.get("provenance", {})
    fig.suptitle(
        f"Activation offload, MEASURED on {prov.get('device', '?')} (commit {str(prov.get('commit', '?'))[:8]}, "
        f"{prov.get('utc', '?')}; {source_script(doc)})",
        fontsize=10,
    )
    fig.tight_layout(rect=(0, 0.07, 1, 0.97))
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)


def read_run(src: Path, prog: str) -> dict[str, Any] | None:
    """A GPU offload bench's result JSON with at least one size, or None after saying on stderr (as ``prog``) why
    not: unreadable, not JSON, or a run that stopped before the benchmark."""
    try:
        doc = json.loads(src.read_text())
    except (OSError, ValueError) as e:
        print(f"{prog}: cannot read {src}: {e}", file=sys.stderr)
        return None
    if not isinstance(doc, dict) or not doc.get("sizes"):
        print(f"{prog}: {src} has no sizes (a run that stopped before the benchmark?)", file=sys.stderr)
        return None
    return doc


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("bench", nargs="?", default=str(ROOT / "results/gpu/offload_bench.json"))
    ap.add_argument("--out", default=None, help="PNG path (default: the JSON's, .png)")
    a = ap.parse_args(argv)
    src = Path(a.bench)
    doc = read_run(src, "offload_gpu_plot")
    if doc is None:
        return 2
    out = Path(a.out) if a.out else src.with_suffix(".png")
    plot(doc, out)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
