"""Simulator outputs: JSON summaries, per-coflow records, a Chrome trace and a PNG plot (all labelled simulated)."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from flowlane.sim.engine import SimResult
from flowlane.sim.graph import Coflow, ComputeTask


def summary(res: SimResult, top_links: int = 5) -> dict:
    """A JSON-able summary: times, per-type coflow completion times, link utilisation, simulator speed."""
    util = res.link_utilisation
    order = np.argsort(-util)[:top_links]
    busy = util > 0
    return {
        "simulated": True,
        "workload": res.workload,
        "policy": res.policy,
        "iteration_time_s": res.iteration_time,
        "iteration_ends_s": res.iteration_ends,
        "makespan_s": res.makespan,
        "coflows": int(len(res.coflow_nodes)),
        "flows": res.num_flows,
        "events": res.events,
        "rate_updates": res.rate_updates,
        "wall_s": res.wall_s,
        "cpu_s": res.cpu_s,
        "events_per_cpu_s": res.events / max(res.cpu_s, 1e-9),
        "cct_by_ctype": res.cct_by_ctype(),
        "link_utilisation": {
            "mean_over_used_links": float(util[busy].mean()) if busy.any() else 0.0,
            "max": float(util.max()) if util.size else 0.0,
            "top": [{"link": res.link_names[i], "utilisation": float(util[i])} for i in order],
        },
        "total_bytes": float(res.coflow_bytes.sum()),
    }


def coflow_records(res: SimResult, limit: int | None = None) -> list[dict]:
    """Per-coflow completion records (meta, ready/start/end times, bytes), in node order."""
    out = []
    nodes = res.workload_ref.nodes
    for k, i in enumerate(res.coflow_nodes[:limit].tolist()):
        c: Coflow = nodes[i]
        m = c.meta
        out.append(
            {
                "name": c.name,
                "ctype": m.ctype,
                "op": m.op,
                "iteration": m.iteration,
                "microbatch": m.microbatch,
                "layer": m.layer,
                "stage": m.stage,
                "ready_s": float(res.coflow_ready[k]),
                "start_s": float(res.coflow_start[k]),
                "end_s": float(res.coflow_end[k]),
                "cct_s": float(res.coflow_end[k] - res.coflow_start[k]),
                "bytes": float(res.coflow_bytes[k]),
            }
        )
    return out


def write_json(path: str | os.PathLike, obj: object) -> Path:
    """Write ``obj`` as JSON via a temporary file beside ``path``, so a reader (or a crash) never sees half a file."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(p.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1, default=float))
    tmp.replace(p)
    return p


def chrome_trace(res: SimResult, path: str | os.PathLike, max_executors: int = 64) -> Path:
    """Chrome trace (chrome://tracing, Perfetto): compute per executor, coflows per type; times in us."""
    nodes = res.workload_ref.nodes
    ev: list[dict] = [
        {"name": "process_name", "ph": "M", "pid": 0, "args": {"name": "compute (simulated)"}},
        {"name": "process_name", "ph": "M", "pid": 1, "args": {"name": "coflows (simulated)"}},
    ]
    execs: dict[str, int] = {}
    for k, i in enumerate(res.compute_nodes.tolist()):
        t: ComputeTask = nodes[i]
        if t.executor not in execs:
            if len(execs) >= max_executors:
                continue
            execs[t.executor] = len(execs)
            ev.append(
                {
                    "name": "thread_name",
                    "ph": "M",
                    "pid": 0,
                    "tid": execs[t.executor],
                    "args": {"name": t.executor},
                }
            )
        s, e = res.compute_start[k], res.compute_end[k]
        ev.append(
            {
                "name": t.name,
                "cat": t.cat,
                "ph": "X",
                "ts": s * 1e6,
                "dur": (e - s) * 1e6,
                "pid": 0,
                "tid": execs[t.executor],
            }
        )
    lanes: dict[str, int] = {}
    for r in coflow_records(res):
        lane = f"{r['ctype']} stage {r['stage']}"
        lanes.setdefault(lane, len(lanes))
        ev.append(
            {
                "name": r["name"],
                "cat": r["ctype"],
                "ph": "X",
                "ts": r["start_s"] * 1e6,
                "dur": r["cct_s"] * 1e6,
                "pid": 1,
                "tid": lanes[lane],
                "args": {k: r[k] for k in ("op", "iteration", "microbatch", "layer", "bytes", "ready_s")},
            }
        )
    for lane, tid in lanes.items():
        ev.append({"name": "thread_name", "ph": "M", "pid": 1, "tid": tid, "args": {"name": lane}})
    return write_json(path, {"traceEvents": ev, "displayTimeUnit": "ms", "otherData": {"simulated": True}})


def speedup_label(base: float, t: float) -> str:
    """Speedup over the baseline with enough digits that a 0.1 % difference shows (1.001x, not 1.00x)."""
    r = base / t
    return f"{r:.3f}x" if abs(r - 1) < 0.1 else f"{r:.2f}x"


def time_axis(times: list[float]) -> tuple[float, float, bool]:
    """(bottom, top, zoomed) of the iteration-time axis. Bars from 0 hide differences of a few percent: the axis
    then starts just below the shortest bar (and says so)."""
    if not times:
        return 0.0, 1.0, False
    lo, hi = min(times), max(times)
    if hi <= 0 or (hi - lo) / hi >= 0.05:
        return 0.0, hi * 1.18, False
    pad = max(hi - lo, hi * 1e-3)
    return max(0.0, lo - 3 * pad), hi + 2 * pad, True


def plot(results: Mapping[str, SimResult], path: str | os.PathLike, title: str = "") -> Path:
    """Iteration time per policy and mean CCT per coflow type (simulated)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    times = [results[n].iteration_time for n in names]
    ax[0].bar(names, times, color="tab:blue")
    base = times[0] if times else 1.0
    for i, t in enumerate(times):
        ax[0].text(i, t, f"{t:.4g}s\n{speedup_label(base, t)}", ha="center", va="bottom", fontsize=8)
    bottom, top, zoomed = time_axis(times)
    ax[0].set_ylim(bottom, top)
    ax[0].set_ylabel("iteration time (s)" + (", axis not from 0" if zoomed else ""))
    ax[0].set_title("iteration time (simulated)")
    ctypes = sorted({c for r in results.values() for c in r.cct_by_ctype()})
    width = 0.8 / max(1, len(names))
    for j, n in enumerate(names):
        cc = results[n].cct_by_ctype()
        ax[1].bar(
            np.arange(len(ctypes)) + j * width,
            [cc.get(c, {}).get("mean_s", 0) * 1e3 for c in ctypes],
            width,
            label=n,
        )
    ax[1].set_xticks(np.arange(len(ctypes)) + width * (len(names) - 1) / 2, ctypes)
    ax[1].set_ylabel("mean coflow completion time (ms)")
    ax[1].set_title("coflow completion time (simulated)")
    ax[1].legend(fontsize=8)
    fig.suptitle(title or "flowlane.sim (simulated)")
    fig.tight_layout()
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(p, dpi=110)
    plt.close(fig)
    return p
