"""``flowlane sim``: simulate a workload under several scheduling policies, print a table, write JSON/trace/plot."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

from flowlane.launch import check_output_dir
from flowlane.policies import make_policy, policy_names
from flowlane.sim.engine import ROUTING, SimConfig, SimResult, Simulator
from flowlane.sim.graph import SimSpecError
from flowlane.sim.models import EP_A2A, MODELS, SCHEDULES
from flowlane.sim.network import INCAST_COUNTS, SHARING, IncastModel
from flowlane.sim.output import chrome_trace, plot, summary, write_json
from flowlane.sim.workloads import WORKLOADS, build_workload, cluster
from flowlane.testing.provenance import provenance

# the simulator holds every flow in memory: 8,192 GPUs is the largest run measured, a million ends in MemoryError
MAX_GPUS = 16384


def _number(
    kind: type, low: float, high: float | None = None, low_open: bool = False
) -> Callable[[str], object]:
    """An argparse type: an int or finite float in range; argparse names the flag, this names the value."""
    what = "an integer" if kind is int else "a finite number"
    rng = f"in [{low:g}, {high:g}]" if high is not None else f"{'>' if low_open else '>='} {low:g}"

    def parse(text: str) -> object:
        try:
            v = kind(text)
        except ValueError:
            v = None
        if (
            v is None
            or not math.isfinite(v)
            or v < low
            or (low_open and v == low)
            or (high is not None and v > high)
        ):
            raise argparse.ArgumentTypeError(f"must be {what} {rng}, got {text!r}")
        return v

    return parse


class _HelpWithDefaults(argparse.ArgumentDefaultsHelpFormatter):
    """'(default: X)' after each option's help; an option whose default is the preset's own (None) says so in its
    help instead of '(default: None)'."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        return action.help if action.default is None else super()._get_help_string(action)


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "sim",
        help="flow-level training simulator (simulated times)",
        description="Simulate one training workload under several scheduling policies "
        "(all times are simulated).",
        formatter_class=_HelpWithDefaults,
    )
    p.add_argument(
        "--workload",
        default="gpt3-13b",
        choices=WORKLOADS,
        metavar="NAME",
        help=f"one of {', '.join(WORKLOADS)}",
    )
    p.add_argument(
        "--gpus",
        type=_number(int, 1, MAX_GPUS),
        default=32,
        help="number of GPUs (DP degree follows for LLM presets)",
    )
    p.add_argument(
        "--bandwidth", type=_number(float, 0, low_open=True), default=100.0, help="NIC bandwidth in Gbps"
    )
    p.add_argument(
        "--policy",
        default="fifo,priority",
        help=f"comma-separated scheduling policies, the first is the speedup baseline; "
        f"from: {', '.join(policy_names())}",
    )
    p.add_argument(
        "--routing",
        default="ecmp",
        choices=ROUTING,
        help="equal-cost routes: ecmp (each flow hashed onto one), spray (every flow split over all), first",
    )
    p.add_argument(
        "--sharing",
        default="strict",
        choices=SHARING,
        help="bandwidth across priority classes: strict (a higher class fills first) or weighted",
    )
    p.add_argument(
        "--incast-alpha", type=_number(float, 0), default=0.0, help="incast penalty alpha (0 = off)"
    )
    p.add_argument(
        "--incast-count",
        default="port",
        choices=INCAST_COUNTS,
        help="who adds to a port's incast fan-in: every flow (port: one shared queue) or the flows of the "
        "same priority class (class: a switch queue per class)",
    )
    p.add_argument("--schedule", choices=SCHEDULES, help="pipeline schedule (LLM presets; default: 1f1b)")
    p.add_argument(
        "--microbatches",
        type=_number(int, 1),
        help="microbatches per iteration (LLM presets; default: 2 x the preset's pipeline stages)",
    )
    p.add_argument(
        "--iterations",
        type=_number(int, 1),
        help="iterations to simulate (LLM presets; default: 2, the second (steady) one is reported)",
    )
    p.add_argument(
        "--ep-a2a",
        choices=EP_A2A,
        help="MoE all-to-all (LLM MoE presets): plain = NCCL's; phases = Hermod's BvN matching phases "
        "as the runtime sends them (phases_bottleneck: with bottleneck BvN, fewer phases); "
        "matched = their fluid abstraction (seed 000 §5.3.2); default: plain",
    )
    p.add_argument(
        "--nics-per-server",
        type=_number(int, 0, 8),
        default=0,
        help="NICs per 8-GPU server (LLM presets; 0 = one per GPU; the seed does not say, 1 is its literal "
        "reading)",
    )
    p.add_argument(
        "--no-overlap",
        action="store_true",
        help="Megatron-LM's defaults: DP reductions after the backward, gathers before the next forward "
        "(LLM presets; default: both overlapped)",
    )
    p.add_argument(
        "--seed", type=int, default=0, help="seed of the random draws (MoE token routing, ECMP hashing)"
    )
    p.add_argument(
        "--out",
        default="outputs/sim",
        help="output folder for sim.json, trace and plot (outputs/ is not tracked by git)",
    )
    p.add_argument("--trace", action="store_true", help="write a Chrome trace per policy")
    p.add_argument("--no-plot", action="store_true", help="do not draw sim.png")
    return p


def run(args: argparse.Namespace) -> int:
    """``flowlane sim``: build the workload, simulate it under each policy, print the table, write sim.json (and the
    traces and plot asked for). Bad options print one error line and return 2 before any work."""
    from rich.console import Console

    try:
        _policies(args.policy, names_only=True)
        out = check_output_dir(args.out, "--out")  # before the work: its results must have somewhere to go
        over = _preset_overrides(args)
        topo, wl, cfg = _build(args, over)
        policies = _policies(args.policy, wl.info)  # Hermod's order follows the workload's schedule and M
    except (SimSpecError, ValueError) as e:
        Console(stderr=True).print(f"[red]error:[/red] {e}", highlight=False, soft_wrap=True)
        return 2
    con = Console()
    con.print(
        f"[bold]{wl.name}[/bold]: {len(wl.nodes)} nodes, {len(wl.coflows)} coflows, {wl.num_flows} flows "
        f"on {topo.name} ({args.bandwidth:g} Gbps) — simulated"
    )
    results = _simulate(con, topo, cfg, wl, policies)
    con.print(_table(wl.name, results))
    base = next(iter(results.values())).iteration_time
    doc = {
        "simulated": True,
        "workload": args.workload,
        "gpus": args.gpus,
        "bandwidth_gbps": args.bandwidth,
        "config": {
            "routing": args.routing,
            "sharing": args.sharing,
            "seed": args.seed,
            **over,
            "nics_per_server": args.nics_per_server or "one per GPU",
            "iterations": len(wl.info.get("iteration_end", [])) or 1,
        },
        "baseline": policies[0].name,
        "results": {n: {**summary(r), "speedup": base / r.iteration_time} for n, r in results.items()},
        "provenance": provenance(),  # the command line and commit that produced this file
    }
    write_json(out / "sim.json", doc)
    if args.trace:
        for n, r in results.items():
            chrome_trace(r, out / f"trace_{n}.json")
    if not args.no_plot:
        plot(results, out / "sim.png", f"{wl.name}, {args.bandwidth:g} Gbps (simulated)")
    con.print(f"wrote {out / 'sim.json'}" + ("" if args.no_plot else f" and {out / 'sim.png'}"))
    return 0


def _policies(spec: str, info: dict | None = None, names_only: bool = False) -> list:
    """``--policy a,b,...`` as policies for a workload whose ``info`` names its pipeline schedule, microbatches and
    layers per stage; ``names_only``: only the names are checked (before the workload is built). The first is the
    baseline the speed-ups are against."""
    names = [x.strip() for x in spec.split(",") if x.strip()]
    if not names:
        raise ValueError(f"--policy {spec!r} names no policy; choose from {', '.join(policy_names())}")
    if names_only:
        unknown = [x for x in names if x not in policy_names()]
        if unknown:
            raise ValueError(f"unknown scheduling policy {unknown[0]!r}; choose one of {policy_names()}")
        return []
    info = info or {}
    return [
        make_policy(x, info.get("schedule"), info.get("microbatches"), info.get("layers_per_stage"))
        for x in names
    ]


def _preset_overrides(args: argparse.Namespace) -> dict:
    """The LLM presets' ParallelConfig fields the flags set; refused for the other workloads."""
    over: dict = {}
    if args.schedule:
        over["schedule"] = args.schedule
    if args.microbatches is not None:
        over["num_microbatches"] = args.microbatches
    if args.iterations is not None:
        over["iterations"] = args.iterations
    if args.ep_a2a:
        over["ep_a2a"] = args.ep_a2a
    if args.no_overlap:
        over.update(overlap_grad_reduce=False, overlap_param_gather=False)
    if (over or args.nics_per_server) and args.workload not in WORKLOADS[:6]:
        raise SimSpecError(
            "--schedule/--microbatches/--iterations/--ep-a2a/--nics-per-server/--no-overlap apply "
            f"to LLM presets, not {args.workload!r}"
        )
    if args.ep_a2a and not MODELS[args.workload].moe:  # a dense model has no all-to-all for it to change
        moe = [w for w in WORKLOADS if w in MODELS and MODELS[w].moe]
        raise SimSpecError(
            f"--ep-a2a {args.ep_a2a} applies to MoE presets ({', '.join(moe)}), not the dense {args.workload!r}"
        )
    return over


def _build(args: argparse.Namespace, over: dict) -> tuple:
    """(topology, workload, SimConfig) from the flags."""
    topo_kw = {}
    if args.nics_per_server:
        topo_kw["topology"] = cluster(args.gpus, args.bandwidth, nics_per_server=args.nics_per_server)
    topo, wl = build_workload(args.workload, args.gpus, args.bandwidth, seed=args.seed, **over, **topo_kw)
    incast = IncastModel(alpha=args.incast_alpha, count=args.incast_count) if args.incast_alpha > 0 else None
    cfg = SimConfig(routing=args.routing, sharing=args.sharing, seed=args.seed, incast=incast)
    return topo, wl, cfg


def _simulate(con, topo, cfg: SimConfig, wl, policies: list) -> dict[str, SimResult]:
    """One simulation per policy, with a progress bar over the workload's nodes."""
    from rich.progress import Progress, TaskID

    results: dict[str, SimResult] = {}
    with Progress(console=con, transient=True) as prog:
        for pol in policies:
            task = prog.add_task(f"simulating {pol.name}", total=len(wl.nodes))

            def show(done: int, total: int, t: TaskID = task) -> None:
                prog.update(t, completed=done)

            results[pol.name] = Simulator(topo, cfg).run(wl, pol, on_progress=show)
    return results


def _table(name: str, results: dict[str, SimResult]):
    """Iteration time, speed-up over the first policy and mean CCT per coflow type, one row per policy."""
    from rich.table import Table

    base = next(iter(results.values())).iteration_time
    ctypes = sorted({c for r in results.values() for c in r.cct_by_ctype()})
    tab = Table(title=f"{name} — simulated iteration time")
    cols = [
        "policy",
        "iteration (s)",
        "speedup",
        *[f"{c} CCT (ms)" for c in ctypes],
        "events/cpu-s",
        "cpu (s)",
    ]
    for col in cols:
        tab.add_column(col, justify="right")
    for pol, r in results.items():
        cc = r.cct_by_ctype()
        tab.add_row(
            pol,
            f"{r.iteration_time:.4f}",
            f"{base / r.iteration_time:.3f}x",
            *[f"{cc[c]['mean_s'] * 1e3:.3f}" if c in cc else "-" for c in ctypes],
            f"{r.events / max(r.cpu_s, 1e-9):,.0f}",
            f"{r.cpu_s:.2f}",
        )
    return tab


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="flowlane")
    sub = ap.add_subparsers(dest="command", required=True)
    add_parser(sub)
    return run(ap.parse_args(argv))


__all__ = ["add_parser", "run", "policy_names"]
