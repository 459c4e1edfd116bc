"""Simulator speed: one iteration of GPT-3 175B (table 5.5 strategy: TP 8, PP 8, mbs 8; DP grows with the GPU count)
on Hermod's simulated fabric (100 Gbps, full bisection). Reports CPU seconds (single-threaded; robust to other load
on the machine), events per CPU second, and how time grows with the number of flows. Writes
results/sim/speed.json and speed.png (``--name``). Goals (issue 3): 1,024 GPUs <= 10 s, 8,192 GPUs <= 120 s on one core.

    .venv-llm/bin/python benchmarks/sim_speed.py [--sizes 256,512,1024,2048,4096,8192] [--quantum 1e-4]
        [--numpy-up-to 1024] [--before OLD.json --before-label TEXT]

``--numpy-up-to`` also runs the scaled config on the numpy rate path (no C kernel) up to that size: same events,
its CPU time beside the kernel's (``numpy_over_c``).

``--before`` keeps a run of this benchmark on other code (e.g. the engine before a change) in the JSON beside this
one, with the CPU-time ratio per row and whether the simulated iteration times are identical (they must be, bit for
bit, for a change that only reorganises the engine). CPU seconds on a shared machine move with its load, so compare
runs made back to back.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

from flowlane.policies import make_policy
from flowlane.sim import SimConfig, Simulator
from flowlane.sim.workloads import build_workload
from flowlane.testing.provenance import provenance


@contextlib.contextmanager
def _rate_path(kernel: str) -> Iterator[None]:
    """Run the rate allocation on the C kernel or on numpy (``FLOWLANE_SIM_NO_C``, read at each allocation)."""
    old = os.environ.get("FLOWLANE_SIM_NO_C")
    os.environ["FLOWLANE_SIM_NO_C"] = "1" if kernel == "numpy" else "0"
    try:
        yield
    finally:
        if old is None:
            del os.environ["FLOWLANE_SIM_NO_C"]
        else:
            os.environ["FLOWLANE_SIM_NO_C"] = old


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="256,512,1024,2048,4096,8192")
    ap.add_argument(
        "--quantum", type=float, default=1e-4, help="event batching window (s) for the scaled runs"
    )
    ap.add_argument(
        "--exact-up-to", type=int, default=8192, help="also run exact (quantum 0) up to this size"
    )
    ap.add_argument(
        "--numpy-up-to",
        type=int,
        default=1024,
        help="also run the scaled config on the numpy rate path (FLOWLANE_SIM_NO_C=1) up to this size",
    )
    ap.add_argument("--out", default="results/sim")
    ap.add_argument("--name", default="speed", help="output file stem (NAME.json, NAME.png)")
    ap.add_argument("--before", type=Path, help="an earlier speed.json to record beside this run")
    ap.add_argument("--before-label", default="", help="what the earlier run ran (e.g. its commit)")
    a = ap.parse_args()
    before = None
    if a.before is not None:
        try:
            before = json.loads(a.before.read_text())
        except (OSError, ValueError) as e:
            ap.error(f"--before: cannot read {a.before}: {e}")
    env = provenance()
    rows = []
    from rich.console import Console
    from rich.table import Table

    con = Console()
    for g in [int(x) for x in a.sizes.split(",")]:
        c0 = time.process_time()
        topo, wl = build_workload("gpt3-175b", g)
        build_cpu = time.process_time() - c0
        runs = [(q, "c") for q in ([0.0] if g <= a.exact_up_to else []) + [a.quantum]]
        runs += [(a.quantum, "numpy")] if g <= a.numpy_up_to else []
        for q, kernel in runs:
            c1 = time.process_time()
            with _rate_path(kernel):
                r = Simulator(topo, SimConfig(time_quantum=q)).run(wl, make_policy("fifo"))
            sim_cpu = time.process_time() - c1
            row = {
                "gpus": g,
                "quantum_s": q,
                "kernel": kernel,
                "flows": r.num_flows,
                "coflows": len(r.coflow_nodes),
                "nodes": len(wl.nodes),
                "events": r.events,
                "rate_updates": r.rate_updates,
                "build_cpu_s": build_cpu,
                "sim_cpu_s": sim_cpu,
                "total_cpu_s": build_cpu + sim_cpu,
                "sim_wall_s": r.wall_s,
                "events_per_cpu_s": r.events / sim_cpu,
                "iteration_time_s_simulated": r.iteration_time,
                "load_average_1min": os.getloadavg()[0],  # CPU seconds grow with the machine's load
            }
            rows.append(row)
            con.print(row)
        del topo, wl
    numpy_over_c = {}
    for r in rows:
        if r["kernel"] == "numpy":
            c = next(
                x
                for x in rows
                if x["kernel"] == "c" and (x["gpus"], x["quantum_s"]) == (r["gpus"], r["quantum_s"])
            )
            numpy_over_c[str(r["gpus"])] = {
                "sim_cpu_s_ratio": r["sim_cpu_s"] / c["sim_cpu_s"],
                "iteration_time_identical": r["iteration_time_s_simulated"]
                == c["iteration_time_s_simulated"],
            }
    goals = {}
    for g, lim in ((1024, 10.0), (8192, 120.0)):
        rs = [r for r in rows if r["gpus"] == g and r["kernel"] == "c"]
        if rs:
            best = min(rs, key=lambda r: r["total_cpu_s"])
            goals[str(g)] = {
                "limit_s": lim,
                "total_cpu_s": best["total_cpu_s"],
                "quantum_s": best["quantum_s"],
                "met": best["total_cpu_s"] <= lim,
            }
    exact_err = {}
    for g in {r["gpus"] for r in rows}:
        e = [r for r in rows if r["gpus"] == g and r["quantum_s"] == 0]
        q = [r for r in rows if r["gpus"] == g and r["quantum_s"] > 0 and r["kernel"] == "c"]
        if e and q:
            exact_err[str(g)] = abs(
                q[0]["iteration_time_s_simulated"] / e[0]["iteration_time_s_simulated"] - 1
            )
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    doc = {
        "benchmark": "sim_speed",
        "workload": "gpt3-175b (TP8 PP8 mbs8, 16 microbatches, ZeRO, 100 Gbps)",
        "note": "iteration times are simulated; CPU seconds measured on this machine, single-threaded",
        "provenance": env,
        "rows": rows,
        "goals": goals,
        "quantum_relative_error": exact_err,
        "numpy_over_c": numpy_over_c,
    }
    if before is not None:
        old = {(r["gpus"], r["quantum_s"]): r for r in before["rows"] if r.get("kernel", "c") == "c"}
        cmp = []
        for r in rows:
            o = old.get((r["gpus"], r["quantum_s"])) if r["kernel"] == "c" else None
            if o is not None:
                cmp.append(
                    {
                        "gpus": r["gpus"],
                        "quantum_s": r["quantum_s"],
                        "sim_cpu_s_before": o["sim_cpu_s"],
                        "sim_cpu_s_now": r["sim_cpu_s"],
                        "before_over_now": o["sim_cpu_s"] / r["sim_cpu_s"],
                        "iteration_time_identical": o["iteration_time_s_simulated"]
                        == r["iteration_time_s_simulated"],
                        "events_identical": o["events"] == r["events"],
                    }
                )
        doc["before"] = {
            "label": a.before_label,
            "file": str(a.before),
            "rows": before["rows"],
            "provenance": before.get("provenance"),
        }
        doc["before_vs_now"] = cmp
        con.print({"before_vs_now": cmp})
    (out / f"{a.name}.json").write_text(json.dumps(doc, indent=1))
    tab = Table(title="flowlane.sim speed (GPT-3 175B, one iteration)")
    for c in (
        "GPUs",
        "quantum",
        "rates",
        "flows",
        "events",
        "rate updates",
        "build cpu s",
        "sim cpu s",
        "events/cpu-s",
    ):
        tab.add_column(c, justify="right")
    for r in rows:
        tab.add_row(
            str(r["gpus"]),
            f"{r['quantum_s']:g}",
            r["kernel"],
            f"{r['flows']:,}",
            f"{r['events']:,}",
            f"{r['rate_updates']:,}",
            f"{r['build_cpu_s']:.1f}",
            f"{r['sim_cpu_s']:.1f}",
            f"{r['events_per_cpu_s']:,.0f}",
        )
    con.print(tab)
    con.print({"goals": goals, "quantum_relative_error": exact_err, "numpy_over_c": numpy_over_c})
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for q, kernel in sorted({(r["quantum_s"], r["kernel"]) for r in rows}):
        rs = [r for r in rows if (r["quantum_s"], r["kernel"]) == (q, kernel)]
        label = f"quantum {q:g} s" + (", numpy rates" if kernel == "numpy" else "")
        ax.loglog([r["flows"] for r in rs], [r["total_cpu_s"] for r in rs], "o-", label=label)
        for r in rs:
            ax.annotate(f"{r['gpus']}", (r["flows"], r["total_cpu_s"]), fontsize=7)
    ax.set_xlabel("flows per iteration")
    ax.set_ylabel("CPU seconds (build + simulate)")
    ax.set_title("flowlane.sim speed, GPT-3 175B iteration (simulated workload)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / f"{a.name}.png", dpi=110)


if __name__ == "__main__":
    main()
