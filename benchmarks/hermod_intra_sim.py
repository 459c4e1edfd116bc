"""Hermod inter- vs intra-coflow scheduling under an incast model (label: simulated). Seed 000 Fig. 5.11 analogue.

    python -m benchmarks.hermod_intra_sim [--alphas 0.05,0.1] [--only small,scale] [--scale-variants V,..]
                                          [--scale-models M,..] [--scale-gpus 1024] [--op-overhead-us 0]
                                          [--incast-count port|class] [--measured-costs | --plan-ms X
                                          --plan-hit-ms X --plan-cache N --phase-issue-us X]
                                          [--workers 2] [--out results/hermod/intra_sim] [--name intra]

Writes results/hermod/intra_sim/NAME.json and NAME.png. Every figure is simulated (flowlane.sim, flow-level).

Why a separate benchmark: in a max-min fluid model the plain all-to-all already finishes at the bottleneck bound
(digest A2.6 / R6), so Hermod's matching (incast-free phases, §5.3.2) can only show an effect when many-to-one
traffic loses goodput. flowlane.sim.IncastModel does that phenomenologically: a switch port feeding a NIC that
carries k concurrent flows delivers capacity / (1 + alpha (k - 1)). alpha is an assumption, not a number from the
seeds (the thesis used htsim's packet-level queues), so it is swept, and alpha = 0 is the fluid baseline.
``--incast-count`` says who adds to k: ``port`` (default) every flow on the port, one shared switch queue, as on the
emulated fabric alpha was fitted on; ``class`` only the flows of the same priority class, a switch queue per class
(Hermod's keys select queues on the wire, seed 000 §5.4). FIFO has one class, so it is the same under both; the
``hermod-nccl-*`` variants quantise the keys to the 3 NCCL traffic classes, i.e. 3 queues, which switches have,
where exact keys would need a queue per key.

The runtime's costs of a phased all-to-all (issue 30; 0 by default, as in every figure before them):
``--measured-costs`` charges each phased all-to-all the planning time measured for its EP size and plan
(``results/hermod/plan_speed/plan_speed.json``: the median ms of one rank's plan on a plan-cache miss, ``plan_for_rank``,
or the whole compiled plan's in files written before it; the cache-hit median) and
every phase the host time one phase's grouped send/receive took to issue on NCCL (``results/gpu/nccl_gpu_check.json``,
``phase_issue_s``, one H200), with the runtime's plan cache of 16 entries; ``--plan-ms`` / ``--plan-hit-ms`` /
``--plan-cache`` / ``--phase-issue-us`` set them by hand (and override the measured ones). Label: "simulated (with
measured costs charged)". ``SimConfig.plan_time`` etc. say how the engine charges them.

Variants (the policy decides inter-coflow order, the all-to-all mode intra-coflow):
  fifo            Megatron's order, NCCL's plain all-to-all
  hermod-inter    Hermod's priorities, plain all-to-all                      (Fig. 5.11 "inter only")
  hermod-phases   Hermod's priorities + BvN phases as the runtime sends them (both components, faithful)
  hermod-phases-bn  the same with bottleneck BvN (the runtime's ``bvn_bottleneck``: fewer, longer phases)
  hermod-matched  Hermod's priorities + the fluid abstraction of the phases  (both components, optimistic; cheap)
  fifo-phases     FIFO order + BvN phases                                     (intra only)
  hermod-nccl-phases-bn  bottleneck BvN phases under Hermod quantised to the 3 NCCL traffic classes
Sections: ``small`` = Qwen-MoE-12L (testbed strategy, PP4 x EP8) on 32 GPUs at 2 GPUs per server so the all-to-all
crosses NICs; ``scale`` = the table 5.5 simulation presets at 1,024 GPUs, 100 Gb/s. Qwen-MoE-24L's EP 32 gives ~940
first-found or ~180 bottleneck BvN phases per all-to-all; each all-to-all is one
:class:`flowlane.sim.graph.PhasedAllToAll` node whose phase flows the engine starts one by one (each waits on its two
ranks). Measured with the bottleneck plan at 256 GPUs: 5.6M phase flows, 1.0 GB peak, 12.5 CPU-minutes (11.6 GB and
16 minutes when every phase flow was a coflow node of its own). So Qwen's bottleneck phases run at 1,024 GPUs, but
only when ``--scale-variants`` names them (CPU time: ~4x the flows); its first-found phases (~5x as many flows
again) never run. Mixtral-8x22B (EP 8) runs both phase plans at 1,024.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

from benchmarks._pool import add_pool_args, run_points
from flowlane.sim.network import INCAST_COUNTS
from flowlane.sim.output import write_json
from flowlane.testing.provenance import provenance

VARIANTS = {  # name -> (policy, all-to-all mode)
    "fifo": ("fifo", "plain"),
    "hermod-inter": ("hermod", "plain"),
    "hermod-phases": ("hermod", "phases"),
    "hermod-matched": ("hermod", "matched"),
    "fifo-phases": ("fifo", "phases"),
    "hermod-phases-bn": ("hermod", "phases_bottleneck"),
    "hermod-nccl-phases-bn": ("hermod-nccl", "phases_bottleneck"),
}
SMALL = ("qwen-moe-12l", 32, 2)  # model, GPUs, GPUs per server
SCALE = {
    "mixtral-8x22b": ("fifo", "hermod-inter", "hermod-matched", "hermod-phases", "hermod-phases-bn"),
    "qwen-moe-24l": ("fifo", "hermod-inter", "hermod-matched"),
}
SCALE_OPT_IN = {
    "mixtral-8x22b": ("hermod-nccl-phases-bn",),
    "qwen-moe-24l": ("hermod-phases-bn", "hermod-nccl-phases-bn"),
}  # run only when --scale-variants names them (CPU, above)
# Cost: the incast penalty gives every receiver port its own capacity, so max-min filling needs many more rounds;
# a 1,024-GPU point costs ~10x its no-incast time (measured: 3-15 CPU-minutes plain or matched, 25 for phases).


PLAN_ALGORITHM = {"phases": "bvn", "phases_bottleneck": "bvn_bottleneck"}  # sim a2a mode -> runtime planner
RUNTIME_PLAN_CACHE = 16  # flowlane.hermod.matching: FLOWLANE_HERMOD_PLAN_CACHE's default
COSTS_OFF = {"plan_ms": None, "plan_hit_ms": None, "plan_cache": 0, "phase_issue_us": 0.0}


def measured_costs(plan_speed: Path, gpu_check: Path) -> dict:
    """The runtime's costs as measured: planning ms per (algorithm, EP) from a2a_plan_speed's JSON (one rank's plan
    median, or the whole compiled plan's in older files; cache-hit median) and the host issue time of one phase from nccl_gpu_check's JSON (rank 0, flowlane net)."""
    ps = json.loads(plan_speed.read_text())
    # what the runtime plans per all-to-all: one rank's part (plan_for_rank) where the file has it, else the
    # whole plan with its Phase objects (files before plan_for_rank)
    kind = "rank_plan" if all("rank_plan" in r for r in ps["rows"]) else "compiled"
    plan = {f"{r['algorithm']}/{r['ep']}": r[kind]["median_ms"] for r in ps["rows"]}
    hit = {f"{r['algorithm']}/{r['ep']}": r["cached_hit"]["median_ms"] for r in ps["rows"]}
    gc = json.loads(gpu_check.read_text())
    try:
        t = gc["nets"]["flowlane"]["checks"]["timings"]
        issue_s = float(t["phase_issue_s"])
    except (KeyError, TypeError):
        raise ValueError(f"{gpu_check}: no nets.flowlane.checks.timings.phase_issue_s") from None
    return {
        "plan_ms": plan,
        "plan_hit_ms": hit,
        "plan_cache": RUNTIME_PLAN_CACHE,
        "phase_issue_us": issue_s * 1e6,
        "sources": {
            "plan_ms": f"{plan_speed} rows[].{kind}.median_ms (label {ps.get('label')!r}, commit "
            f"{ps.get('commit')}, planner {ps.get('planner_impl')})",
            "plan_hit_ms": f"{plan_speed} rows[].cached_hit.median_ms",
            "plan_cache": "flowlane.hermod.matching FLOWLANE_HERMOD_PLAN_CACHE default",
            "phase_issue_us": f"{gpu_check} nets.flowlane.checks.timings.phase_issue_s (device "
            f"{gc['nets']['flowlane']['checks'].get('device')})",
        },
    }


def _cost_s(v: float | dict | None, mode: str, ep: int, what: str) -> float:
    """A cost in ms for this point: a number, or a table keyed "algorithm/ep"; 0 where the mode never plans."""
    if v is None or mode not in PLAN_ALGORITHM:
        return 0.0
    if isinstance(v, dict):
        k = f"{PLAN_ALGORITHM[mode]}/{ep}"
        if k not in v:
            raise ValueError(f"{what}: no measured figure for {k!r}; measured: {sorted(v)}")
        v = v[k]
    return float(v) * 1e-3


def run_point(
    section: str,
    model: str,
    gpus: int,
    per_server: int,
    gbps: float,
    variant: str,
    alpha: float,
    microbatches: int,
    quantum: float,
    op_overhead_s: float = 0.0,
    incast_count: str = "port",
    costs: dict | None = None,
) -> dict:
    from flowlane.policies import make_policy
    from flowlane.sim import IncastModel, SimConfig, Simulator
    from flowlane.sim.models import preset
    from flowlane.sim.workloads import build_llm, cluster

    policy, mode = VARIANTS[variant]
    t0 = time.process_time()
    job = preset(model, num_microbatches=microbatches, ep_a2a=mode)
    topo, wl = build_llm(job, gpus, gbps, topology=cluster(gpus, gbps, gpus_per_server=per_server))
    c = costs or COSTS_OFF
    ep = job.parallel.ep
    charged = {
        "plan_time": _cost_s(c["plan_ms"], mode, ep, "plan_ms"),
        "plan_hit_time": _cost_s(c["plan_hit_ms"], mode, ep, "plan_hit_ms"),
        "plan_cache_entries": int(c["plan_cache"]),
        "phase_issue_time": float(c["phase_issue_us"]) * 1e-6 if mode in PLAN_ALGORITHM else 0.0,
    }
    cfg = SimConfig(
        time_quantum=quantum,
        incast=IncastModel(alpha=alpha, count=incast_count) if alpha > 0 else None,
        launch_overhead=op_overhead_s,
        **charged,
    )
    last = [t0]

    # a line per 5 CPU-minutes: what a cut-off long point had reached
    def progress(done: int, n: int) -> None:
        now = time.process_time()
        if now - last[0] >= 300 or done == n:
            last[0] = now
            print(f"  {model} {gpus} GPUs {variant}: {done}/{n} nodes, cpu {now - t0:.0f} s", flush=True)

    r = Simulator(topo, cfg).run(wl, make_policy(policy), on_progress=progress)
    ends = r.iteration_ends
    extra = {}
    if any(charged[k] for k in ("plan_time", "plan_hit_time", "phase_issue_time")):
        extra = {"charged": charged, "plan_hits": r.plan_hits, "plan_misses": r.plan_misses}
    return {
        "section": section,
        "model": model,
        "gpus": gpus,
        "gpus_per_server": per_server,
        "bandwidth_gbps": gbps,
        "variant": variant,
        "policy": policy,
        "a2a_mode": mode,
        "incast_alpha": alpha,
        "op_overhead_s": op_overhead_s,
        "incast_count": incast_count,
        **extra,
        "iteration_time_s": ends[-1] - ends[-2],
        "cct_mean_ms": {k: v["mean_s"] * 1e3 for k, v in r.cct_by_ctype().items()},
        "ep_crosses_servers": wl.info.get("ep_crosses_servers"),
        "flows": r.num_flows,
        "cpu_s": time.process_time() - t0,
    }


def _key(p: dict | tuple) -> tuple:
    """Identity of a point, from a plan tuple or a result dict."""
    if isinstance(p, tuple):
        return p[0], p[1], p[2], p[5], p[6]
    return p["section"], p["model"], p["gpus"], p["variant"], p["incast_alpha"]


def plan(
    alphas: list[float],
    only: set[str],
    scale_variants: set[str] | None = None,
    models: set[str] | None = None,
    gpus: int = 1024,
) -> list[tuple]:
    t = []
    if "small" in only:
        model, gpus, per = SMALL
        for a in [0.0, *alphas]:
            for v in VARIANTS:
                t.append(("small", model, gpus, per, 100.0, v, a))
    if "scale" in only:
        for a in alphas:
            for model, vs in SCALE.items():
                for v in (*vs, *(SCALE_OPT_IN.get(model, ()) if scale_variants else ())):
                    if (scale_variants is None or v in scale_variants) and (
                        models is None or model in models
                    ):
                        t.append(("scale", model, gpus, 8, 100.0, v, a))
    return t


def summarise(points: list[dict], skipped: list, args: argparse.Namespace, wall: float) -> dict:
    groups: dict[tuple, dict] = {}
    for p in points:
        groups.setdefault((p["section"], p["model"], p["gpus"], p["incast_alpha"]), {})[p["variant"]] = p
    rows = []
    for (sec, model, gpus, alpha), vs in sorted(groups.items()):
        row = {
            "section": sec,
            "model": model,
            "gpus": gpus,
            "incast_alpha": alpha,
            "iteration_time_s": {v: p["iteration_time_s"] for v, p in vs.items()},
            "ep_cct_mean_ms": {v: p["cct_mean_ms"].get("ep") for v, p in vs.items()},
        }
        if "fifo" in vs:
            base = vs["fifo"]["iteration_time_s"]
            row["speedup_vs_fifo"] = {v: base / p["iteration_time_s"] for v, p in vs.items()}
        rows.append(row)
    costs = args.costs
    on = costs["plan_ms"] is not None or costs["plan_hit_ms"] is not None or costs["phase_issue_us"] > 0
    return {
        "benchmark": "hermod_intra_sim",
        "label": "simulated (with measured costs charged)" if on else "simulated",
        "provenance": args.provenance,
        "runtime_costs": costs if on else None,
        "note": "flowlane.sim flow-level simulation with the phenomenological incast model (capacity / (1 + alpha "
        "(k - 1)) on switch ports feeding a NIC; alpha assumed, swept; 0 = no incast). Speedup = FIFO "
        "iteration time / variant iteration time, steady (2nd) iteration. Thesis Fig. 5.11 (testbed, "
        "32 GPUs): inter only 1.12-1.40x, both components 1.24-1.40x; intra adds ~1.11x on MoE models.",
        "config": {
            "microbatches": args.microbatches,
            "time_quantum_s": args.quantum,
            "alphas": args.alphas,
            "op_overhead_s": args.op_overhead_s,
            "incast_count": args.incast_count,
            "workers": args.workers,
            "wall_s": round(wall, 1),
        },
        "variants": {k: {"policy": p, "a2a_mode": m} for k, (p, m) in VARIANTS.items()},
        "rows": rows,
        "skipped": [{"point": list(t), "why": why} for t, why in skipped],
        "points": points,
    }


def _plot(res: dict, path: Path) -> bool:
    """Speedup over FIFO per point; False (nothing drawn) when no point has a FIFO run to compare with."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in res["rows"] if "speedup_vs_fifo" in r]
    names = [v for v in VARIANTS if v != "fifo" and any(v in r["speedup_vs_fifo"] for r in rows)]
    if not names:  # no ratio to draw (FIFO only, or no FIFO)
        return False
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(rows)), 4))
    w = 0.8 / len(names)
    for j, v in enumerate(names):
        ax.bar(
            [i + j * w for i in range(len(rows))],
            [r["speedup_vs_fifo"].get(v, float("nan")) for r in rows],
            w,
            label=v,
        )
    ax.set_xticks(
        [i + 0.4 - w / 2 for i in range(len(rows))],
        [f"{r['model']}\n{r['gpus']} GPUs, alpha {r['incast_alpha']:g}" for r in rows],
        fontsize=7,
    )
    ax.axhline(1.0, color="k", lw=0.5)
    lo = min(v for r in rows for v in r["speedup_vs_fifo"].values())
    ax.set_ylim(bottom=min(0.8, lo - 0.05))
    ax.set_ylabel("speedup vs FIFO (plain all-to-all)")
    o = res["config"].get("op_overhead_s", 0.0)
    extra = (
        ([f"{o * 1e6:g} us per communication op"] if o else [])
        + (
            ["incast fan-in counted per priority class (a switch queue per class)"]
            if res["config"].get("incast_count") == "class"
            else []
        )
        + (
            [
                f"phased all-to-alls charged planning and {res['runtime_costs']['phase_issue_us']:.0f} us issue per phase "
                f"(measured costs)"
            ]
            if res.get("runtime_costs")
            else []
        )
    )
    ax.set_title(
        "\n".join(["Hermod inter- vs intra-coflow under an assumed incast penalty (simulated)", *extra]),
        fontsize=9,
    )
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--alphas", default="0.05,0.1", help="incast penalties to sweep (0 = none is always in 'small')"
    )
    ap.add_argument("--only", default="small,scale", help="sections: small, scale")
    ap.add_argument("--microbatches", type=int, default=8)
    # 10 us, not the other benchmarks' 100 us: the quantum lets each event slip by up to one quantum, and a phased
    # all-to-all chains ~180 dependent phase steps of ~80 us, so at 100 us it lost up to ~7 ms per all-to-all
    # (Qwen-MoE-24L, 256 GPUs: 5.168 s at 100 us, 4.186 s at 10 us; FIFO 7.341 s / 7.303 s; results/hermod/README.md)
    add_pool_args(ap, budget_s=3600.0, quantum=1e-5)
    ap.add_argument(
        "--scale-variants", help=f"comma-separated subset of {list(VARIANTS)} for the scale section"
    )
    ap.add_argument("--scale-models", help=f"comma-separated subset of {list(SCALE)} for the scale section")
    ap.add_argument("--scale-gpus", type=int, default=1024, help="GPUs in the scale section (default 1024)")
    ap.add_argument("--out", default="results/hermod/intra_sim")
    ap.add_argument("--name", default="intra", help="output file stem (NAME.json, NAME.png)")
    ap.add_argument(
        "--op-overhead-us",
        type=float,
        default=0.0,
        help="fixed cost of every communication op in microseconds (SimConfig.launch_overhead): one per "
        "collective, p2p, plain or matched all-to-all, one per phase flow of a phased all-to-all (default 0)",
    )
    ap.add_argument(
        "--incast-count",
        default="port",
        choices=INCAST_COUNTS,
        help="who adds to a port's incast fan-in: every flow on it (port, default: one shared queue) or "
        "the flows of the same priority class (class: a switch queue per class)",
    )
    ap.add_argument(
        "--measured-costs",
        action="store_true",
        help="charge phased all-to-alls the runtime's measured planning and per-phase issue costs "
        "(--plan-speed-json, --gpu-check-json; module docstring)",
    )
    ap.add_argument("--plan-speed-json", type=Path, default=Path("results/hermod/plan_speed/plan_speed.json"))
    ap.add_argument("--gpu-check-json", type=Path, default=Path("results/gpu/nccl_gpu_check.json"))
    ap.add_argument(
        "--plan-ms", type=float, help="planning time per phased all-to-all on a plan-cache miss (ms)"
    )
    ap.add_argument("--plan-hit-ms", type=float, help="planning time on a plan-cache hit (ms)")
    ap.add_argument("--plan-cache", type=int, help="plan-cache entries per rank (0 = none)")
    ap.add_argument("--phase-issue-us", type=float, help="host time to issue one phase on a rank (us)")
    ap.add_argument(
        "--fifo-from",
        type=Path,
        help="take the FIFO points from this stored run instead of re-running them (same quantum, op "
        "overhead and incast count; plain all-to-alls are never charged the runtime costs, so FIFO "
        "is the same with and without them); each carried point names its file",
    )
    ap.add_argument(
        "--resume",
        action="store_true",
        help="keep the points already in NAME.json and run only the missing ones",
    )
    a = ap.parse_args(argv)
    try:
        alphas = [float(x) for x in a.alphas.split(",") if x]
    except ValueError:
        ap.error(f"--alphas must be comma-separated numbers, got {a.alphas!r}")
    if any(not x > 0 for x in alphas):
        ap.error(f"--alphas must be > 0, got {a.alphas!r}")
    only = set(a.only.split(","))
    if not only <= {"small", "scale"}:
        ap.error(f"--only takes small and/or scale, got {a.only!r}")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    sv = set(a.scale_variants.split(",")) if a.scale_variants else None
    if sv is not None and not sv <= set(VARIANTS):
        ap.error(f"--scale-variants must be among {list(VARIANTS)}, got {a.scale_variants!r}")
    sm = set(a.scale_models.split(",")) if a.scale_models else None
    if sm is not None and not sm <= set(SCALE):
        ap.error(f"--scale-models must be among {list(SCALE)}, got {a.scale_models!r}")
    if not (a.op_overhead_us >= 0 and math.isfinite(a.op_overhead_us)):
        ap.error(f"--op-overhead-us must be a finite number >= 0, got {a.op_overhead_us}")
    if a.scale_gpus < 1:
        ap.error(f"--scale-gpus must be >= 1, got {a.scale_gpus}")
    # seconds, once, for points and summary
    a.op_overhead_s = op_overhead_s = round(a.op_overhead_us * 1e-6, 12)
    costs = dict(COSTS_OFF)
    if a.measured_costs:
        try:
            costs = measured_costs(a.plan_speed_json, a.gpu_check_json)
        except (OSError, ValueError, KeyError) as e:
            ap.error(f"--measured-costs: {e}")
    for flag, key in (
        ("plan_ms", "plan_ms"),
        ("plan_hit_ms", "plan_hit_ms"),
        ("phase_issue_us", "phase_issue_us"),
    ):
        v = getattr(a, flag)
        if v is not None:
            if not (v >= 0 and math.isfinite(v)):
                ap.error(f"--{flag.replace('_', '-')} must be a finite number >= 0, got {v}")
            costs[key] = v
            costs.setdefault("sources", {})[key] = "given on the command line"
    if a.plan_cache is not None:
        if a.plan_cache < 0:
            ap.error(f"--plan-cache must be an integer >= 0, got {a.plan_cache}")
        costs["plan_cache"] = a.plan_cache
    a.costs = costs
    a.provenance = provenance()  # at the start: the commit the points run on
    tasks = plan(alphas, only, sv, sm, a.scale_gpus)
    done: list[dict] = []
    if a.resume and (out / f"{a.name}.json").exists():
        stored = json.loads((out / f"{a.name}.json").read_text())
        # a resumed file must hold one setting: points at another quantum, op overhead or count are not comparable
        was = (
            stored["config"].get("time_quantum_s"),
            stored["config"].get("op_overhead_s", 0.0),
            stored["config"].get("incast_count", "port"),
        )
        now = (a.quantum, op_overhead_s, a.incast_count)
        if was != now or stored.get("runtime_costs") != (
            costs if summarise([], [], a, 0)["runtime_costs"] else None
        ):
            if was == now:
                ap.error(
                    f"--resume: {a.name}.json was run with other runtime costs ({stored.get('runtime_costs')}); "
                    f"use another --name"
                )
            ap.error(
                f"--resume: {a.name}.json was run with quantum {was[0]:g} s, op overhead {was[1]:g} s and incast "
                f"count {was[2]}, not {now[0]:g} s, {now[1]:g} s and {now[2]}; use another --name"
            )
        done = stored["points"]
        have = {_key(p) for p in done}
        tasks = [t for t in tasks if _key(t) not in have]
        print(f"resuming: {len(done)} points kept, {len(tasks)} to run")
    if a.fifo_from is not None:
        try:
            ref = json.loads(a.fifo_from.read_text())
        except (OSError, ValueError) as e:
            ap.error(f"--fifo-from: cannot read {a.fifo_from}: {e}")
        rc = ref.get("config", {})
        if (
            rc.get("time_quantum_s"),
            rc.get("op_overhead_s", 0.0),
            rc.get("incast_count", "port"),
            rc.get("microbatches"),
        ) != (a.quantum, op_overhead_s, a.incast_count, a.microbatches):
            ap.error(
                f"--fifo-from: {a.fifo_from} was run with quantum {rc.get('time_quantum_s')}, op overhead "
                f"{rc.get('op_overhead_s', 0.0)}, incast count {rc.get('incast_count', 'port')}, microbatches "
                f"{rc.get('microbatches')}; this run has {a.quantum}, {op_overhead_s}, {a.incast_count}, "
                f"{a.microbatches}"
            )
        have = {_key(p) for p in done}
        carried = [
            {**p, "carried_from": str(a.fifo_from)}
            for p in ref["points"]
            if p["variant"] == "fifo" and _key(p) in {_key(t) for t in tasks} and _key(p) not in have
        ]
        if not carried:
            ap.error(f"--fifo-from: {a.fifo_from} holds no FIFO point this run needs")
        done = [*done, *carried]
        keys = {_key(p) for p in carried}
        tasks = [t for t in tasks if _key(t) not in keys]
        print(f"FIFO points carried from {a.fifo_from}: {len(carried)}")
    t0 = time.time()

    def save(points: list[dict], skipped: list) -> None:  # after every point, so a cut-off run can --resume
        write_json(out / f"{a.name}.json", summarise(points, skipped, a, time.time() - t0))

    points, skipped = run_points(
        tasks,
        run_point,
        (a.microbatches, a.quantum, op_overhead_s, a.incast_count, costs),
        a.workers,
        a.budget_s,
        "hermod intra (simulated)",
        lambda t, p: (
            f"{t[1]:14s} {t[2]:5d} GPUs alpha {t[6]:<5g} {t[5]:15s} {p['iteration_time_s']:8.4f} s  "
            f"(cpu {p['cpu_s']:.0f} s)"
        ),
        save,
        points=done,
    )
    res = summarise(points, skipped, a, time.time() - t0)
    write_json(out / f"{a.name}.json", res)
    drawn = _plot(res, out / f"{a.name}.png")
    print(
        f"wrote {out / a.name}.json"
        + (f" and {a.name}.png" if drawn else " (no plot: no FIFO point to compare with)")
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
