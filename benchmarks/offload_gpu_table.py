"""The markdown table of an activation-offload GPU run (``tests/gpu/offload_bench.py`` or
``tests/gpu/megatron_offload_bench.py``), as docs/offload.md shows it: a row per size, a column per strategy, each
cell ``step time x keep's; allocated / reserved activation peak x keep's`` (``not run`` or ``error`` where it did
not). Labelled with the run's device and commit, so a table pasted into the docs says where it came from.

Run: .venv-llm/bin/python benchmarks/offload_gpu_table.py results/gpu/offload_bench.json [--columns a,b,c]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.offload_gpu_plot import read_run  # noqa: E402

GiB = 1 << 30


def cell(r: dict[str, Any]) -> str:
    """One strategy's figures against keep's: ``1.03x; 0.59 / 0.59`` (time; allocated / reserved peak)."""
    if r.get("status") != "ok":
        return "error" if r.get("status") == "error" else "not run"
    if r.get("time_ratio_vs_keep") is None or r.get("act_mem_ratio_vs_keep") is None:
        return "no ratio"
    reserved = r.get("reserved_ratio_vs_keep")
    mem = f"{r['act_mem_ratio_vs_keep']:.2f}" + (f" / {reserved:.2f}" if reserved is not None else "")
    return f"{r['time_ratio_vs_keep']:.2f}x; {mem}"


def table(doc: dict[str, Any], columns: list[str] | None = None) -> str:
    """The markdown table of ``doc``'s sizes; ``columns`` (default: every strategy that any size ran, in run
    order, keep and its repeat left out) picks and orders the strategies."""
    if columns is None:
        columns = []
        for size in doc["sizes"]:
            for name in size["strategies"]:
                if name not in columns and name not in ("keep", "keep_repeat"):
                    columns.append(name)
    lines = [
        "| size | " + " | ".join(f"`{c}`" for c in columns) + " |",
        "|---|" + "---|" * len(columns),
    ]
    for size in doc["sizes"]:
        st = size["strategies"]
        keep = st.get("keep", {})
        label = f"h{size['hidden']}, {size['layers']} layers"
        if keep.get("step_s") and keep.get("peak_act_bytes"):
            label += f" (keep {keep['step_s'] * 1e3:.1f} ms, {keep['peak_act_bytes'] / GiB:.1f} GiB)"
        lines.append(f"| {label} | " + " | ".join(cell(st.get(c, {})) for c in columns) + " |")
    prov = doc.get("provenance", {})
    lines.append("")
    lines.append(
        f"{doc.get('label', 'measured')}, commit {str(prov.get('commit', '?'))[:7]}, {prov.get('utc', '?')}: step "
        "time; allocated / reserved activation peak, each x keep's"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("bench", help="a GPU offload bench's result JSON")
    ap.add_argument(
        "--columns", default=None, help="comma-separated strategies, in order (default: all that ran)"
    )
    a = ap.parse_args(argv)
    doc = read_run(Path(a.bench), "offload_gpu_table")
    if doc is None:
        return 2
    print(table(doc, a.columns.split(",") if a.columns else None))
    return 0


if __name__ == "__main__":
    sys.exit(main())
