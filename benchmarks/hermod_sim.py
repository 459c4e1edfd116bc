"""Hermod in the flow-level simulator (label: simulated). Seed 000 table 5.2 shape, scaling (1,024-8,192 GPUs)
and bandwidth (40-400 Gb/s) sweeps, Hermod vs FIFO, and the loss from quantising keys to wire classes.

    python -m benchmarks.hermod_sim [--full] [--workers 2] [--budget-s 2400] [--nics-per-server N] [--out results/hermod/sim]

Writes results/hermod/sim/sim.json and sim.png (sim_nicsN.json / .png with --nics-per-server N), rewritten after every
finished point, so a run cut short by the budget still leaves what it has; skipped points are listed in the JSON.
Every figure is simulated (flowlane.sim: max-min fair sharing with strict priority classes); the thesis used
FlexFlow + htsim (packet level).

Setup (seed 000 §5.5.1, table 5.5): leaf-spine full-bisection fabric, 8 GPUs per server, one NIC per GPU (or
``--nics-per-server``: the seed's "128-server cluster ... full-bisection fat-tree network with 100Gbps links" does not
say how many links a server has; 1 is the literal reading, see flowlane.sim.workloads.cluster), 1 us links;
table 5.5 simulation strategies; EP groups across DP replicas (Megatron's order; Qwen at 1,024 GPUs folds EP 32
over 4 servers); ZeRO-2 with per-bucket reduce-scatter during the last microbatch's backward (Case II) and parameter
all-gathers overlapping the next forward (Case III); 2 iterations, the second (steady) one reported. Default
("quick", what fits a 2-core machine): 8 microbatches (= PP degree; the seed does not state M) instead of 16.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from functools import lru_cache
from pathlib import Path

from benchmarks._pool import add_pool_args, run_points
from flowlane.testing.provenance import write_result

MOE = ("mixtral-8x22b", "qwen-moe-24l")
DENSE = ("gpt3-175b",)
MODELS = (*MOE, *DENSE)
TABLE_POLICIES = (
    "fifo",
    "megatron",
    "dp-first",
    "pp-first",
    "ep-first",
    "hermod",
    "hermod-consumer",
    "hermod-dscp",
    "hermod-nccl",
)
# "megatron" is a baseline, not a policy: FIFO on Megatron-LM's defaults, --overlap-grad-reduce and
# --overlap-param-gather off (every DP reduction after the stage's backward, every gather before its next forward),
# the thesis' "vanilla Megatron-LM" (§5.5.1) as far as it is stated. All other names run on the overlapped DAG.
WORKLOAD_OF = {"megatron": (("overlap_grad_reduce", False), ("overlap_param_gather", False))}
SECTIONS = ("table_5_2", "no_network", "bandwidth", "scaling")
INF_BW = 1e6  # Gb/s: "no network" reference = compute-only critical path (upper bound of any scheduling gain)


def make(name: str, m: int, layers_per_stage: int = 1):
    """Policies by name, with the number of microbatches M known (DP coflows carry MID M-1, §5.3.1) and, for the
    wire-quantised ones, the layers per stage (LID buckets per stage, digest A6.1 #3)."""
    from flowlane.policies import make_policy

    if name == "megatron":
        return make_policy("fifo")
    if not name.startswith("hermod"):
        return make_policy(name)
    from flowlane.hermod.order import HermodOrderConfig
    from flowlane.hermod.policy import HermodPolicy, QuantisationConfig, QuantisedHermodPolicy

    cfg = HermodOrderConfig(m)
    if name == "hermod":
        return HermodPolicy(cfg)
    if name == "hermod-consumer":
        p = HermodPolicy(HermodOrderConfig(m, dp_mid="consumer"))
        p.name = "hermod-consumer"
        return p
    target = name.split("-", 1)[1]
    return QuantisedHermodPolicy(cfg, QuantisationConfig(target, layers_per_stage=layers_per_stage))


@lru_cache(maxsize=1)
def _workload(model: str, gpus: int, gbps: float, mb: int, iterations: int, nics: int, overrides: tuple = ()):
    from flowlane.sim.workloads import build_llm, cluster

    topo = cluster(gpus, gbps, nics_per_server=nics)
    return build_llm(
        model, gpus, gbps, topology=topo, num_microbatches=mb, iterations=iterations, **dict(overrides)
    )


def run_point(
    section: str,
    model: str,
    gpus: int,
    gbps: float,
    policy: str,
    mb: int,
    iterations: int,
    quantum: float,
    nics: int = 0,
) -> dict:
    from flowlane.sim import SimConfig, Simulator

    topo, wl = _workload(model, gpus, gbps, mb, iterations, nics, WORKLOAD_OF.get(policy, ()))
    m = wl.info["microbatches"]
    pol = make(policy, m, max(1, len_layers(model) // wl.info["parallel"]["pp"]))
    t0 = time.process_time()
    r = Simulator(topo, SimConfig(time_quantum=quantum)).run(wl, pol)
    cct = {
        k: {"count": v["count"], "mean_ms": v["mean_s"] * 1e3, "total_gb": v["total_bytes"] / 1e9}
        for k, v in r.cct_by_ctype().items()
    }
    return {
        "section": section,
        "model": model,
        "gpus": gpus,
        "bandwidth_gbps": gbps,
        "policy": policy,
        "iteration_time_s": r.iteration_time,
        "iteration_ends_s": r.iteration_ends,
        "cct": cct,
        "cpu_s": time.process_time() - t0,
        "microbatches": m,
        "nics_per_server": _nics_per_server(topo),
        "ep_layout": wl.info.get("ep_layout"),
        "ep_crosses_servers": wl.info.get("ep_crosses_servers"),
    }


def _nics_per_server(topo) -> int:  # noqa: ANN001 - a flowlane.topology.Topology
    return sum(1 for d in topo.devices.values() if d.kind == "nic" and d.server == 0)


def isolated_ep_cct_s(
    model: str, gpus: int, gbps: float, mb: int, iterations: int, nics: int
) -> tuple[float, float]:
    """Mean CCT of the workload's EP all-to-alls without PP/DP traffic, from the workload (no simulation): the max over
    NICs of the off-server bytes sent or received through the NIC, over the NIC rate (the Varys bottleneck; the
    leaf-spine is full-bisection, so NICs are the only shared hops). Two readings: each all-to-all alone (a lower
    bound), and each with its *set*: the all-to-alls of the same (iteration, microbatch, layer, pass, op) in every EP
    group, which start at about the same time (every DP replica and TP rank does the same step; an upper reading,
    as skew staggers them). Returns (alone, with set) in seconds."""
    import numpy as np

    topo, wl = _workload(model, gpus, gbps, mb, iterations, nics)
    server = np.array([topo.devices[g].server for g in wl.devices])
    # each GPU's NIC: the device its host (pcie) link leads to
    nic_of = [next(lk.dst for lk in topo.out_links(g) if lk.kind == "pcie") for g in wl.devices]
    index = {n: i for i, n in enumerate(sorted(set(nic_of)))}
    nic = np.array([index[n] for n in nic_of])
    alone: list[float] = []
    sets: dict[tuple, list[np.ndarray]] = {}
    for c in wl.coflows:
        if c.meta.ctype != "ep":
            continue
        off = server[c.src] != server[c.dst]
        out = np.bincount(nic[c.src[off]], weights=c.nbytes[off], minlength=nic.max() + 1)
        into = np.bincount(nic[c.dst[off]], weights=c.nbytes[off], minlength=nic.max() + 1)
        alone.append(max(out.max(), into.max()))
        # name "ep:F3 L5 dispatch": mb, pass, layer, op
        acc = sets.setdefault((c.meta.iteration, c.name), [0, 0])
        acc[0], acc[1] = acc[0] + out, acc[1] + into
    with_set = [max(o.max(), i.max()) for o, i in sets.values()]
    to_s = 8 / (gbps * 1e9)
    return (float(np.mean(alone)) * to_s, float(np.mean(with_set)) * to_s) if alone else (0.0, 0.0)


def analysis(rows: list[dict], args: argparse.Namespace) -> dict:
    """Why the MoE gain is small here: how far FIFO's EP all-to-alls are from their isolated CCT (contention an order
    could remove) and what share of FIFO's iteration is network time at all (FIFO minus the no-network run)."""
    out: dict = {
        "network_share_of_fifo_iteration": {},
        "ep_a2a_cct_alone_ms": {},
        "ep_a2a_cct_with_set_ms": {},
        "fifo_ep_a2a_cct_ms": {},
    }
    for r in rows:
        if r["gpus"] != 1024 or r["bandwidth_gbps"] != 100.0 or "fifo" not in r["iteration_time_s"]:
            continue
        fifo = r["iteration_time_s"]["fifo"]
        if "no_network_iteration_s" in r:
            out["network_share_of_fifo_iteration"][r["model"]] = 1 - r["no_network_iteration_s"] / fifo
        if r["model"] in MOE and "ep" in r["cct_ms"]["fifo"]:
            alone, with_set = isolated_ep_cct_s(
                r["model"], 1024, 100.0, args.microbatches, args.iterations, args.nics_per_server
            )
            out["ep_a2a_cct_alone_ms"][r["model"]] = alone * 1e3
            out["ep_a2a_cct_with_set_ms"][r["model"]] = with_set * 1e3
            out["fifo_ep_a2a_cct_ms"][r["model"]] = r["cct_ms"]["fifo"]["ep"]
    out["note"] = (
        "EP all-to-all CCT without PP/DP traffic (max per-NIC off-server bytes / NIC rate, token skew "
        "included), each alone (lower bound) and with its set (same microbatch, layer, pass and op in "
        "every EP group, if they all start together); FIFO's mean EP CCT above them is the contention "
        "with PP/DP a priority order could remove. network share = 1 - no-network / FIFO iteration time "
        "(the most any schedule could gain)."
    )
    return out


def len_layers(model: str) -> int:
    from flowlane.sim.models import MODELS as M

    return M[model].layers


def plan(full: bool) -> list[tuple[str, str, int, float, str]]:
    """(section, model, gpus, Gb/s, policy) in the order they run: the most important points first. Quick mode
    (default) leaves out hermod-consumer on the MoE models, 200 Gb/s on the MoE models and MoE scaling beyond
    2,048 GPUs (each 1,024-GPU MoE point costs ~1-2 CPU-minutes, 2,048 twice that)."""
    t: list[tuple[str, str, int, float, str]] = []
    first = ("fifo", "hermod")
    # the thesis' sweeps (figs. 5.12 / 5.13) compare Hermod with vanilla Megatron-LM and Lina; Lina's rule is
    # EP-first (all-to-alls before DP), which has nothing to act on without EP; these run after Hermod vs FIFO
    rivals = {m: ("megatron", "ep-first") if m in MOE else ("megatron",) for m in MODELS}
    for pol in (*first, "megatron"):
        for model in MOE:
            t.append(("table_5_2", model, 1024, 100.0, pol))
    for model in MOE:
        t.append(("no_network", model, 1024, INF_BW, "fifo"))
    for model in DENSE:  # cheap
        for pol in TABLE_POLICIES:
            if pol != "ep-first":  # no EP coflows: identical to FIFO by construction
                t.append(("table_5_2", model, 1024, 100.0, pol))
        t.append(("no_network", model, 1024, INF_BW, "fifo"))
        for bw in (40.0, 200.0, 400.0):
            for pol in (*first, *rivals[model]):
                t.append(("bandwidth", model, 1024, bw, pol))
        for g in (2048, 4096, 8192):
            for pol in (*first, *rivals[model]):
                t.append(("scaling", model, g, 100.0, pol))
    for pol in TABLE_POLICIES:
        if pol not in (*first, "megatron"):
            for model in MOE:
                if full or pol != "hermod-consumer":
                    t.append(("table_5_2", model, 1024, 100.0, pol))
    for bw in (40.0, 200.0, 400.0) if full else (40.0, 400.0):
        for model in MOE:
            for pol in first:
                t.append(("bandwidth", model, 1024, bw, pol))
    for g in (2048, 4096, 8192) if full else (2048,):
        for model in MOE:
            for pol in first:
                t.append(("scaling", model, g, 100.0, pol))
    for bw in (40.0, 200.0, 400.0) if full else (40.0, 400.0):
        for model in MOE:
            for pol in rivals[model]:
                t.append(("bandwidth", model, 1024, bw, pol))
    for g in (2048, 4096, 8192) if full else (2048,):
        for model in MOE:
            for pol in rivals[model]:
                t.append(("scaling", model, g, 100.0, pol))
    return t


def summarise(
    points: list[dict],
    skipped: list,
    args: argparse.Namespace,
    wall: float,
    runs: list | None = None,
    with_analysis: bool = False,
) -> dict:
    """The results document. ``runs``: every invocation that contributed points (a --merge run appends itself)."""
    by: dict[tuple, dict] = {}
    for p in points:
        by.setdefault((p["model"], p["gpus"], p["bandwidth_gbps"]), {})[p["policy"]] = p
    rows = []
    for (model, gpus, bw), pols in sorted(by.items()):
        if bw == INF_BW:
            continue
        row = {
            "model": model,
            "gpus": gpus,
            "bandwidth_gbps": bw,
            "iteration_time_s": {n: p["iteration_time_s"] for n, p in pols.items()},
            "cct_ms": {n: {c: round(v["mean_ms"], 3) for c, v in p["cct"].items()} for n, p in pols.items()},
            "comm_gb_per_iteration": (
                {c: v["total_gb"] / args.iterations for c, v in pols["fifo"]["cct"].items()}
                if "fifo" in pols
                else None
            ),
            "ep_layout": next(iter(pols.values()))["ep_layout"],
            "ep_crosses_servers": next(iter(pols.values()))["ep_crosses_servers"],
            "cpu_s": sum(p["cpu_s"] for p in pols.values()),
        }
        if "fifo" in pols:
            base = pols["fifo"]["iteration_time_s"]
            row["speedup_vs_fifo"] = {n: base / p["iteration_time_s"] for n, p in pols.items()}
            nn = by.get((model, 1024, INF_BW), {}).get("fifo")
            if nn and gpus == 1024:
                row["no_network_iteration_s"] = nn["iteration_time_s"]
                row["max_speedup_any_schedule"] = base / nn["iteration_time_s"]
        if "megatron" in pols:
            row["speedup_vs_megatron"] = {
                n: pols["megatron"]["iteration_time_s"] / p["iteration_time_s"] for n, p in pols.items()
            }
        rows.append(row)
    t52 = [r for r in rows if r["gpus"] == 1024 and r["bandwidth_gbps"] == 100.0]
    scal = [r for r in rows if r["bandwidth_gbps"] == 100.0]
    bw = [r for r in rows if r["gpus"] == 1024]
    moe_1024 = {
        r["model"]: r["speedup_vs_fifo"]["hermod"]
        for r in t52
        if r["model"] in MOE and "hermod" in r.get("speedup_vs_fifo", {})
    }
    shape = {}
    for r in t52:
        s = r.get("speedup_vs_fifo", {})
        if {"dp-first", "pp-first", "hermod"} <= set(s):
            shape[r["model"]] = {
                "dp_first_below_1": s["dp-first"] < 1,
                "pp_first_above_1": s["pp-first"] > 1,
                "ep_first_above_1": s["ep-first"] > 1 if "ep-first" in s else None,
                "hermod_ge_pp_and_ep_first": s["hermod"] >= max(s["pp-first"], s.get("ep-first", 0)) - 1e-9,
            }
    quant = {}
    for r in t52:
        s = r.get("iteration_time_s", {})
        if "hermod" in s:
            quant[r["model"]] = {n: s[n] / s["hermod"] - 1 for n in ("hermod-dscp", "hermod-nccl") if n in s}
    return {
        "benchmark": "hermod_sim",
        "label": "simulated",
        "note": "flowlane.sim flow-level simulation (max-min fair sharing, strict priority classes), seed 000 table 5.5 "
        "presets on a 1 us full-bisection leaf-spine, 8 GPUs/server, "
        f"{f'{args.nics_per_server} NIC(s) per server' if args.nics_per_server else '1 NIC per GPU'} "
        "(A100 at 50% of peak). "
        "The seed used FlexFlow + htsim (packet level). Speedup = FIFO iteration time / policy iteration "
        "time; iteration time = steady (2nd) iteration: iteration i's ZeRO parameter all-gathers overlap "
        "iteration i+1's forward (Case III), reduce-scatters overlap the last microbatch's backward (Case II).",
        "config": {
            "nics_per_server": args.nics_per_server or "one per GPU",
            "microbatches": args.microbatches,
            "iterations": args.iterations,
            "time_quantum_s": args.quantum,
            "mode": "full"
            if args.full
            else "quick: 8 microbatches (= PP) instead of 16; MoE: no hermod-consumer, "
            "bandwidth 40/100/400 Gb/s, scaling 1,024-2,048 GPUs (more where --gpus "
            "asked, see runs); GPT-3 175B: all points",
            "runs": [
                *(runs or []),
                {
                    "argv": args.argv,
                    "points_computed": args.points_computed,
                    "workers": args.workers,
                    "budget_s": args.budget_s,
                    "wall_s": round(wall, 1),
                },
            ],
        },
        "table_5_2": t52,
        "table_5_2_shape": shape,
        "thesis_table_5_2": {"dp-first": 0.81, "pp-first": 1.29, "ep-first": 1.51},
        "scaling": sorted(scal, key=lambda r: (r["model"], r["gpus"])),
        "bandwidth": sorted(bw, key=lambda r: (r["model"], r["bandwidth_gbps"])),
        "quantisation_loss": quant,
        "quantisation_note": "relative iteration-time increase of the wire-quantised key vs the exact Hermod key: "
        "hermod-dscp = 6-bit DSCP (3b MID | 1b CType | 2b LID bucket, MID relative to 0 and "
        "clamped), hermod-nccl = 3 NCCL traffic classes",
        "goal": "hermod >= 1.5x over FIFO on the MoE models at 1,024 GPUs / 100 Gb/s",
        "moe_speedup_at_1024_100g": moe_1024,
        "moe_speedup_vs_megatron_at_1024_100g": {
            r["model"]: r["speedup_vs_megatron"]["hermod"]
            for r in t52
            if r["model"] in MOE and "hermod" in r.get("speedup_vs_megatron", {})
        },
        "megatron_note": "megatron = FIFO on Megatron-LM's defaults (--overlap-grad-reduce and --overlap-param-gather "
        "off); every other policy runs on the overlapped DAG (Case II and III overlap)",
        "goal_met": bool(moe_1024) and all(v >= 1.5 for v in moe_1024.values()),
        "analysis": analysis(t52, args) if with_analysis else None,
        "skipped": [
            {"section": s, "model": m, "gpus": g, "bandwidth_gbps": b, "policy": p, "why": why}
            for (s, m, g, b, p), why in skipped
        ],
        "points": points,
    }


def _plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axs = plt.subplots(1, 4, figsize=(20, 4.2))
    t = [r for r in res["table_5_2"] if "speedup_vs_fifo" in r]
    names = [n for n in TABLE_POLICIES if n != "fifo"]
    for i, r in enumerate(t):
        axs[0].bar(
            [j + 0.8 * i / max(1, len(t)) for j in range(len(names))],
            [r["speedup_vs_fifo"].get(n, float("nan")) for n in names],
            width=0.8 / max(1, len(t)),
            label=r["model"],
        )
    th = res["thesis_table_5_2"]
    axs[0].scatter(
        [names.index(k) + 0.3 for k in th],
        list(th.values()),
        marker="x",
        color="k",
        zorder=3,
        label="thesis table 5.2",
    )
    axs[0].set_xticks(range(len(names)), names, rotation=30, fontsize=7)
    axs[0].axhline(1.0, color="k", lw=0.5)
    nics = res["config"].get("nics_per_server", 8)
    fabric = "one NIC per GPU" if nics == "one per GPU" else f"{nics} NIC(s) per 8-GPU server"
    axs[0].set_title(f"speedup vs FIFO, 1,024 GPUs, 100 Gb/s\n{fabric} (simulated)", fontsize=9)
    axs[0].legend(fontsize=7)
    for ax, key, x, lab in (
        (axs[1], "scaling", "gpus", "GPUs"),
        (axs[2], "bandwidth", "bandwidth_gbps", "Gb/s"),
    ):
        for i, model in enumerate(MODELS):
            for base, style in (("fifo", "-"), ("megatron", "--")):
                pts = sorted(
                    (r[x], r[f"speedup_vs_{base}"]["hermod"])
                    for r in res[key]
                    if r["model"] == model and "hermod" in r.get(f"speedup_vs_{base}", {})
                )
                if pts:
                    ax.plot(
                        [p[0] for p in pts],
                        [p[1] for p in pts],
                        marker="o",
                        ls=style,
                        color=f"C{i}",
                        label=f"{model} vs {base}",
                    )
        ax.set_xscale("log")
        ax.set_xlabel(lab)
        ax.set_ylabel("Hermod speedup")
        ax.axhline(1.0, color="k", lw=0.5)
        ax.set_title(f"{key} sweep (simulated)", fontsize=9)
        ax.legend(fontsize=7)
    ax = axs[3]
    for i, r in enumerate(t):
        ax.bar(
            i - 0.2,
            r["speedup_vs_fifo"].get("hermod", float("nan")),
            0.4,
            color="C0",
            label="Hermod" if i == 0 else None,
        )
        ax.bar(
            i + 0.2,
            r.get("max_speedup_any_schedule", float("nan")),
            0.4,
            color="C7",
            label="FIFO / no-network time (bound)" if i == 0 else None,
        )
    ax.set_xticks(range(len(t)), [r["model"] for r in t], fontsize=7)
    ax.axhline(1.5, color="r", lw=0.7, ls="--", label="goal 1.5x")
    ax.set_title("Hermod vs the most any schedule can gain (simulated)", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--full", action="store_true", help="16 microbatches and MoE scaling up to 8,192 GPUs (slow)"
    )
    ap.add_argument("--microbatches", type=int, help="microbatches per iteration (default 8 quick, 16 full)")
    ap.add_argument("--iterations", type=int, default=2)
    add_pool_args(ap, budget_s=3000.0)
    ap.add_argument("--only", help="comma-separated sections to run (table_5_2,no_network,bandwidth,scaling)")
    ap.add_argument("--policies", help="comma-separated policies to run (default: all of the plan's)")
    ap.add_argument(
        "--gpus",
        help="comma-separated GPU counts to run, taken from the full plan (e.g. --only scaling "
        "--gpus 4096 adds the MoE 4,096-GPU points without --full's 16 microbatches)",
    )
    ap.add_argument("--models", help=f"comma-separated models to run (default: all of {list(MODELS)})")
    ap.add_argument(
        "--bandwidths",
        help="comma-separated link rates (Gb/s) to run, taken from the plan (e.g. --only "
        "bandwidth --bandwidths 400 fills one skipped sweep point)",
    )
    ap.add_argument(
        "--merge",
        action="store_true",
        help="keep the points of an existing sim.json that this run does not recompute",
    )
    ap.add_argument(
        "--summarise-only",
        action="store_true",
        help="simulate nothing: rewrite the JSON (and plot) from the points an existing one holds",
    )
    ap.add_argument(
        "--nics-per-server",
        type=int,
        default=0,
        choices=(0, 1, 2, 4, 8),
        help="100 Gb/s-class NICs per 8-GPU server (0 = one per GPU); the seed does not say",
    )
    ap.add_argument(
        "--no-analysis",
        dest="analysis",
        action="store_false",
        help="skip the analysis block (it rebuilds the 1,024-GPU MoE workloads, ~1 CPU-minute)",
    )
    ap.add_argument("--out", default="results/hermod/sim")
    a = ap.parse_args(argv)
    a.argv = "python -m benchmarks.hermod_sim " + " ".join(sys.argv[1:] if argv is None else argv)
    if a.iterations < 2:
        ap.error("--iterations must be >= 2 (the steady iteration is reported)")
    a.microbatches = a.microbatches or (16 if a.full else 8)
    out = Path(a.out)
    name = f"sim_nics{a.nics_per_server}" if a.nics_per_server else "sim"
    tasks = plan(a.full or bool(a.gpus))
    # --only / --policies / --models / --gpus / --bandwidths: keep the tasks whose field (section, policy, model,
    # GPUs, Gb/s) is listed
    for opt, col, allowed, cast in (
        ("only", 0, SECTIONS, str),
        ("policies", 4, TABLE_POLICIES, str),
        ("models", 1, MODELS, str),
        ("gpus", 2, sorted({t[2] for t in plan(True)}), int),
        ("bandwidths", 3, sorted({t[3] for t in plan(True)}), float),
    ):
        value = getattr(a, opt)
        if not value:
            continue
        try:
            want = {cast(v) for v in value.split(",")}
        except ValueError:
            ap.error(
                f"--{opt}: {value!r} is not a comma-separated list of {'numbers' if cast is float else 'integers'}"
            )
        if want - set(allowed):
            ap.error(f"--{opt}: unknown {sorted(want - set(allowed))}; choose from {list(allowed)}")
        tasks = [t for t in tasks if t[col] in want]
    if a.summarise_only:
        if not (out / f"{name}.json").exists():
            ap.error(f"--summarise-only: {out / name}.json does not exist")
        tasks, a.merge = [], True
    # only once the options are valid: a bad call leaves nothing behind
    out.mkdir(parents=True, exist_ok=True)
    a.points_computed = len(tasks)
    t0 = time.time()
    points: list[dict] = []
    skipped: list = []
    runs: list = []
    if a.merge and (out / f"{name}.json").exists():
        old = json.loads((out / f"{name}.json").read_text())
        runs = old["config"].get("runs", [])
        redo = {(t[1], t[2], t[3], t[4]) for t in tasks}
        points = [
            p
            for p in old.get("points", [])
            if (p["model"], p["gpus"], p["bandwidth_gbps"], p["policy"]) not in redo
        ]
        skipped = [
            ((k["section"], k["model"], k["gpus"], k["bandwidth_gbps"], k["policy"]), k["why"])
            for k in old.get("skipped", [])
            if (k["model"], k["gpus"], k["bandwidth_gbps"], k["policy"]) not in redo
        ]

    def save(points: list[dict], skipped: list) -> None:
        write_result(out / f"{name}.json", summarise(points, skipped, a, time.time() - t0, runs), a.argv)

    run_points(
        tasks,
        run_point,
        (a.microbatches, a.iterations, a.quantum, a.nics_per_server),
        a.workers,
        a.budget_s,
        "hermod sim (simulated)",
        lambda t, p: (
            f"{t[1]:14s} {t[2]:5d} GPUs {t[3]:>9g} Gb/s {t[4]:16s} "
            f"{p['iteration_time_s']:8.4f} s  (cpu {p['cpu_s']:.0f} s)"
        ),
        save,
        points,
        skipped,
    )
    res = summarise(points, skipped, a, time.time() - t0, runs, with_analysis=a.analysis)
    write_result(out / f"{name}.json", res, a.argv)
    _plot(res, out / f"{name}.png")
    print(
        f"wrote {out / name}.json and {name}.png; goal met: {res['goal_met']} ({res['moe_speedup_at_1024_100g']})"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
