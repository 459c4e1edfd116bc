"""The offload budget replayed on measured GPU profiles (issue 36): what ``recompute`` would change, modelled.

Reads the profiled steps that ``tests/gpu/offload_bench.py`` recorded on a GPU (``budget_profile`` of its
``flowlane`` column: per-layer bytes, CUDA-event forward/backward times, measured D2H/H2D rates) and plans each one
as the cache does (``flowlane.offload.choose_plan``): the plain byte budget, and the budget with ``max_slowdown``
spent on recomputing kept layers. Reports, per size, the modelled saved-activation bytes on the device where
backward begins, the modelled added time (reload waits plus recomputation) against the profiled step, and an
estimate of the measured peak with recomputation: the measured flowlane peak less the modelled difference.

Label: **modelled** (a replay of measured profiles), not a measurement; the GPU column ``flowlane_recompute`` of
``offload_bench.py`` measures it when a device is lent.

    .venv-llm/bin/python benchmarks/offload_budget_replay.py [--bench results/gpu/offload_bench_2026-11-26b.json]
        [--max-slowdown 0.05] [--out results/offload/budget_replay.json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from flowlane.offload import StepProfile, choose_plan
from flowlane.testing.provenance import write_result

GiB = 1 << 30


def replay(size: dict, max_slowdown: float) -> dict:
    """One size of an offload_bench result: the plain and the recomputing plan, and what they would measure."""
    st = size["strategies"]
    fl = st["flowlane"]
    bp = fl["budget_profile"]
    p = StepProfile.from_stats(bp)
    max_prefetch = fl["config"]["prefetch_groups"]
    slack = max_slowdown * p.step_s
    plans = {}
    for name, rec in (("budget", False), ("budget_recompute", True)):
        b, depth = choose_plan(p, max_prefetch, slack if rec else 0.0, rec)
        plans[name] = {
            "prefetch_groups": depth,
            "offloaded_layers": sum(b.allow_bytes) / max(1, max(p.group_bytes)),
            "recomputed_layers": [i for i, r in enumerate(b.recompute) if r],
            "resident_GiB_at_backward_start": b.resident_bytes / GiB,
            "peak_GiB": b.peak_bytes / GiB,
            "added_s": b.exposed_s + b.recompute_s,
            "added_vs_profiled_step": (b.exposed_s + b.recompute_s) / p.step_s,
            "added_vs_measured_keep_step": (b.exposed_s + b.recompute_s) / st["keep"]["step_s"],
        }
    keep_peak = st["keep"]["peak_act_bytes"]
    lower = (plans["budget"]["peak_GiB"] - plans["budget_recompute"]["peak_GiB"]) * GiB
    estimate = fl["peak_act_bytes"] - lower
    return {
        "hidden": size["hidden"],
        "profiled_step_s": p.step_s,
        "measured": {
            "keep_step_s": st["keep"]["step_s"],
            "keep_peak_act_GiB": keep_peak / GiB,
            "flowlane_peak_act_ratio": fl["peak_act_bytes"] / keep_peak,
            "flowlane_time_ratio": fl["step_s"] / st["keep"]["step_s"],
        },
        "modelled": plans,
        "estimated_recompute_peak_act_ratio": estimate / keep_peak,
        "estimated_recompute_time_ratio": fl["step_s"] / st["keep"]["step_s"]
        + plans["budget_recompute"]["added_vs_measured_keep_step"],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bench", default="results/gpu/offload_bench_2026-11-26b.json")
    ap.add_argument("--max-slowdown", type=float, default=0.05)
    ap.add_argument("--out", default="results/offload/budget_replay.json")
    a = ap.parse_args(argv)
    if not 0 < a.max_slowdown < 1:
        ap.error(f"--max-slowdown {a.max_slowdown} must be a fraction in (0, 1)")
    bench = json.loads(Path(a.bench).read_text())
    rows = [
        replay(s, a.max_slowdown) for s in bench["sizes"] if "budget_profile" in s["strategies"]["flowlane"]
    ]
    doc = {
        "label": f"modelled: the offload budget replayed on the profiles measured in {a.bench} "
        f"({bench['label']}, commit {bench['provenance']['commit']})",
        "max_slowdown": a.max_slowdown,
        "sizes": rows,
    }
    out = write_result(a.out, doc)
    for r in rows:
        m = r["modelled"]
        print(
            f"hidden {r['hidden']}: measured flowlane {r['measured']['flowlane_peak_act_ratio']:.3f}x memory at "
            f"{r['measured']['flowlane_time_ratio']:.3f}x; recompute layers "
            f"{m['budget_recompute']['recomputed_layers']}: modelled peak "
            f"{m['budget']['peak_GiB']:.2f} -> {m['budget_recompute']['peak_GiB']:.2f} GiB, +"
            f"{100 * m['budget_recompute']['added_vs_measured_keep_step']:.1f} % of keep's step; estimated "
            f"{r['estimated_recompute_peak_act_ratio']:.3f}x memory at {r['estimated_recompute_time_ratio']:.3f}x"
        )
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
