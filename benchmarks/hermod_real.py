"""Hermod vs the default (FIFO) order on 4 (or ``--ranks``) real CPU ranks over an emulated, shaped network.

    sudo .venv-llm/bin/python -m benchmarks.hermod_real [--fabric per-rank|shared-nic|star] [--ranks 4] [--pp 2]
        [--switch-buffer-kb B] [--act-elems N] [--rate-mbit 200|100,200,...]
        [--rounds 4] [--layers-per-stage 2] [--param-elems 262144] [--bulk-lane-mbit R] [--timeline]
        [--baselines megatron,lina] [--workload synthetic|megatron] [--out results/hermod/real] [--name real]
        [--variant chunk_bytes=131072,max_inflight_chunks=1,gate_timeout_s=0.05[,dp_mid=consumer]
                   [,ep_algorithm=bvn|bvn_bottleneck|alg3|plain|auto][,ep_auto_candidates=plain+bvn+alg3]
                   [,ep_auto_probe_iterations=2][,wire=1|2][,launch=pacer|program_order] ...]

Network (:func:`emulated_fabric`, a :class:`flowlane.testing.netem.EmulatedNetwork`; needs root; every name is unique to this
run and everything is deleted on exit, also on error / SIGTERM; traffic never leaves the namespaces created here):
one network namespace per rank.
``per-rank``: each rank's egress is its own shaped link, so a rank's DP chunks contend only with that rank's PP/EP
sends -- what Hermod's sender-side order and DP chunking can resolve. (An earlier version shaped one loopback
shared by all 4 ranks and measured 0.96x: one rank's host-side order cannot protect another rank's flow.)
``shared-nic``: two servers of two ranks behind one shaped NIC each (both directions), PP inside the server, DP and
EP across -- there one rank's DP competes with the other rank's all-to-all, which only wire priority can resolve.
``star``: one switch, every rank's link shaped both ways, the switch ports queueing ``--switch-buffer-kb`` KiB: a
shallow buffer drops packets when several senders meet in one port (incast, TCP retransmission timeouts), the
fabric on which Hermod's incast-free all-to-all matters (with ``--ranks 8``: EP groups of four). No classes there.
Every shaped port is an HTB tree with a bulk class served only when nothing else waits; a variant with ``wire=1``
runs Hermod's bulk (DP) class on its own gloo communicator bound to a macvlan with its own address
(:func:`flowlane.sched.groups.build_class_groups` with ``gloo_class_ifnames``), which the filters put in that class
-- the gloo stand-in for DSCP-marked traffic in a priority queue. FIFO and host-only variants never use it.
gloo rendezvous is ``tcp://`` on rank 0's namespace address and ``GLOO_SOCKET_IFNAME=eth0``.

Workload: the synthetic PP2 x DP2 (x EP2; ``--ranks 8``: DP4 x EP4; ``--pp 1``: one stage, DP4 x EP4 on 4 ranks) 1F1B
iteration of :mod:`flowlane.testing.workload` (ZeRO parameter gathers,
per-layer gradient reductions, pipeline p2p and skewed MoE all-to-alls; compute emulated with sleep because 2 cores
cannot run 4 ranks' matmuls at once). FIFO and every Hermod variant alternate, round after round, in the same
processes over the same links; the first iteration of each run is warm-up. Beside ``fifo`` (Megatron with DP
overlap on: every op launched when issued, parameter gathers one layer ahead) run the thesis' other baselines
(``--baselines``, seed 000 §5.5.1): ``megatron`` (Megatron-LM's defaults, no DP overlap) and ``lina`` (EP before
DP, DP chunked, in issue order); the 1.15x goal is judged against the fastest of them. Iteration time = max over
ranks; the summary is the median over all steady iterations. Per-op timings (PP / EP / DP) come from flowlane.comm's recorder;
the bytes each shaped port's classes carried are read from tc at the end (``network.class_bytes_at_end``).
``--workload megatron`` runs the default recipe's Megatron-core GPT instead (:data:`MEGATRON_WORK`, real compute,
Megatron's 1F1B schedule and rank layout; on ``shared-nic`` its ranks are placed so that PP stays inside a server,
:func:`rank_slots`) with the distributed optimizer: ``fifo`` = Megatron's
``--overlap-grad-reduce --overlap-param-gather``, ``megatron`` = neither (all on Megatron-core's own DDP and
optimizer); Hermod variants run ``--coflow-scheduler hermod`` under fifo's flags (Megatron's bucket-group
reduce-scatters and parameter gathers deferred and keyed, pipeline p2p critical; ``wire=1`` puts its bulk class on
the ``bulk0`` address). Compute is real here, so 4 ranks share 2 cores: overlapped
communication also competes for CPU.
``--bulk-lane-mbit R`` turns the wire variants into a bound: their DP runs on its own lane of R Mbit/s beside the
link, so it never competes with PP/EP (``bound_speedup``; never the best variant).
``--rate-mbit 100,200,400,800`` sweeps the link rate (the thesis' fig. 5.9 analogue): one fabric and one alternating
run per rate, one JSON (:func:`rate_sweep`) and a plot of each variant's speedup over each baseline against the rate.
Label: measured on CPU with emulated links (netns + tc).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from flowlane.testing.netem import BULK_IFNAME, PIPELINE_IFNAME, EmulatedNetwork
from flowlane.testing.provenance import write_result

REPO = Path(__file__).resolve().parents[1]
LABEL = "measured on CPU with emulated links (netns + tc)"
WORK = dict(
    pp=2,
    layers_per_stage=2,
    microbatches=4,
    iterations=3,
    act_elems=32768,
    param_elems=262144,
    moe=True,
    fwd_s=0.01,
    opt_s=0.005,
)
DEFAULT_VARIANT = {"chunk_bytes": 128 << 10, "max_inflight_chunks": 1, "gate_timeout_s": 0.05}
# The thesis' baselines (seed 000 §5.5.1) beside "fifo" (Megatron with --overlap-grad-reduce/--overlap-param-gather:
# every op launched when issued, gathers one layer ahead): "megatron" is Megatron-LM's defaults (no DP overlap: gathers before the first
# forward, reductions after the whole backward); "lina" is Lina's key design as the thesis re-implemented it (EP
# all-to-alls before DP, DP partitioned into chunks; DP in issue order, PP not prioritised).
BASELINES: dict[str, dict[str, Any]] = {
    "megatron": {"mode": "fifo", "overlap_dp": False, "ep_algorithm": "plain"},
    "lina": {
        "mode": "hermod",
        **DEFAULT_VARIANT,
        "gate_ctypes": ["ep"],
        "order": "fifo",
        "ep_algorithm": "plain",
    },
}
# the default order's all-to-all: one all_to_all_single, every flow at once (as NCCL's); EP groups of two run it in
# every variant anyway (flowlane.sched.alltoall.needs_matching)
FIFO = {"mode": "fifo", "ep_algorithm": "plain"}
PORT = 29561
# --workload megatron: the default recipe's Megatron-core GPT (recipes.gpt) with Megatron's distributed optimizer,
# real compute; sized so that one iteration's DP traffic (reduce-scatter + gather of ~7.4 MB per stage) takes about
# as long as its compute at 200 Mbit/s
MEGATRON_WORK = dict(
    world_size=4,
    pipeline_parallel=2,
    num_layers=4,
    hidden_size=256,
    num_attention_heads=4,
    vocab_size=1024,
    seq_length=64,
    micro_batch_size=2,
    num_microbatches=4,
    iterations=3,
    dp_bucket_bytes=1 << 20,
    progress=False,
    timeout_s=600.0,
)
MEGATRON_MOE = dict(num_moe_experts=4, expert_parallel=2, moe_router_topk=2)
# the Megatron flags of each baseline (fifo = Megatron with both overlap flags, megatron = its defaults)
MEGATRON_BASELINES: dict[str, dict[str, Any]] = {
    "fifo": {"distributed_optimizer": True, "overlap_grad_reduce": True, "overlap_param_gather": True},
    "megatron": {"distributed_optimizer": True, "overlap_grad_reduce": False},
}


# -- per-rank worker (runs inside its namespace) ----------------------------------------------------------------------
def _op_stats(ops: list[Any]) -> dict[str, Any]:
    """``ops``: (kind, op, nbytes, start, duration) from flowlane.comm's recorder."""
    out: dict[str, Any] = {}
    for kind in sorted({o[0] for o in ops}):
        ds = [o[4] for o in ops if o[0] == kind]
        sent = sum(o[2] for o in ops if o[0] == kind and o[1] not in ("recv", "irecv"))
        out[kind] = {"n": len(ds), "bytes_sent": sent, "sum_s": sum(ds), "median_s": statistics.median(ds)}
    return out


def _run_variant(rank: int, world: int, sched: dict[str, Any], work: dict[str, Any]) -> dict[str, Any]:
    from flowlane.testing.workload import WorkloadConfig, run_rank

    sched = dict(sched)
    dp_mid = sched.pop("dp_mid", "last")  # Hermod's DP-MID policy knob (digest A6.1 #1)
    # wire classes: wire=1 puts Hermod's bulk class on its own source address, which the fabric queues behind
    # everything else; wire=2 also runs each all-to-all on its class's clone, the pipeline class (later
    # microbatches) on an address the fabric serves after the critical one (the oldest in-flight microbatch)
    wire = sched.pop("wire", 0)
    ifnames = {0: None, 1: ["eth0", "eth0", BULK_IFNAME], 2: ["eth0", PIPELINE_IFNAME, BULK_IFNAME]}[wire]
    dag = {
        k: sched.pop(k)
        for k in ("overlap_dp", "order", "ep_algorithm", "ep_auto_probe_iterations")
        if k in sched
    }  # workload knobs
    if "ep_auto_candidates" in sched:  # "plain+bvn+alg3" on the command line
        dag["ep_auto_candidates"] = sched.pop("ep_auto_candidates").split("+")
    r = run_rank(
        rank,
        world,
        asdict(
            WorkloadConfig(
                **work,
                **dag,
                sched=sched,
                dp_mid=dp_mid,
                gloo_class_ifnames=ifnames,
                ep_wire_classes=wire == 2,
            )
        ),
    )
    # the first iteration warms up; ep_algorithm=auto's probe iterations (most of them the slower algorithms) are
    # reported apart: the steady state is what it chose
    auto = r["ep_auto"]
    skip = 1 + (len(auto["candidates"]) * auto["probe_iterations"] if auto else 0)
    steady = [o for o in r["ops"] if o[3] >= r["iter_starts"][skip]]
    t_last = r["iter_starts"][-1]
    timeline = [
        (o[0], o[1], o[2], round(o[3] - t_last, 4), round(o[4], 4)) for o in r["ops"] if o[3] >= t_last
    ]
    return {
        "times": r["times"][skip:],
        "digest": r["digest"],
        "ops": _op_stats(steady),
        "timeline": timeline,
        "ep_auto": r["ep_auto"] and {**r["ep_auto"], "probe_iteration_times": r["times"][1:skip]},
    }


def megatron_flags(variant: dict[str, Any]) -> dict[str, Any]:
    """The recipe fields of a ``--workload megatron`` variant: a baseline's Megatron flags, or Hermod on the
    distributed optimizer (``wire=1``: its bulk class on the ``bulk0`` address)."""
    v = dict(variant)
    if v.pop("mode", None) != "hermod":
        return dict(v["megatron"])
    wire = v.pop("wire", 0)
    # Megatron-core DDP sends a bucket group whole: its bucket size is the granularity
    v.pop("chunk_bytes", None)
    if "max_inflight_chunks" in v:
        v["max_inflight_buckets"] = v.pop("max_inflight_chunks")
    # Hermod hooks Megatron-core DDP's overlapped reductions and parameter gathers (the fifo baseline's flags)
    return {
        **MEGATRON_BASELINES["fifo"],
        "features": {
            "scheduler": {
                "name": "hermod",
                **v,
                **({"gloo_class_ifnames": f"eth0,eth0,{BULK_IFNAME}"} if wire else {}),
            }
        },
    }


def _run_megatron_variant(
    rank: int, world: int, sched: dict[str, Any], work: dict[str, Any]
) -> dict[str, Any]:
    """One run of the Megatron recipe with a baseline's flags (``sched["megatron"]``) or Hermod on the distributed
    optimizer (``sched["mode"] == "hermod"``: its reduce-scatters and parameter gathers, pipeline p2p)."""
    from flowlane import comm
    from recipes.gpt import train_rank

    with comm.recording():  # a fresh recorder per run (train_rank records steady iterations only)
        r = train_rank(rank, world, {**work, **megatron_flags(sched)})
    ops = [
        (e["args"]["kind"], e["name"], e["args"]["bytes"], e["ts"] / 1e6, e["dur"] / 1e6)
        for e in r["trace"]
        if e.get("ph") == "X" and "kind" in e.get("args", {})
    ]
    t_last = max((e["ts"] / 1e6 for e in r["trace"] if e.get("name") == "forward_backward"), default=0.0)
    timeline = [(o[0], o[1], o[2], round(o[3] - t_last, 4), round(o[4], 4)) for o in ops if o[3] >= t_last]
    return {
        "times": r["iteration_times"][1:],
        "digest": [r["param_digest"], r["losses"]],
        "ops": _op_stats(ops),
        "timeline": timeline,
        "stage": r["pp_stage"],
    }


def worker(
    rank: int, world: int, master: str, rounds: int, variants: dict[str, dict[str, Any]], work: dict[str, Any]
) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{master}:{PORT}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=300),
    )
    dist.all_reduce(torch.ones(1024))  # connections up before timing
    run = _run_megatron_variant if "pipeline_parallel" in work else _run_variant
    out: dict[str, Any] = {m: {"times": [], "ops": [], "digest": None, "timeline": []} for m in variants}
    for _ in range(rounds):
        for mode, sched in variants.items():
            r = run(rank, world, sched, work)
            out[mode]["times"].extend(r["times"])
            out[mode]["ops"].append(r["ops"])
            out[mode]["digest"] = r["digest"]
            out[mode]["timeline"] = r["timeline"]  # the last iteration of the last round, for inspection
            out[mode]["stage"] = r.get("stage", rank % work.get("pp", 2))
            if r.get("ep_auto"):  # ep_algorithm=auto: what the probe measured and kept, per round
                out[mode].setdefault("ep_auto", []).append(r["ep_auto"])
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, out)
    if rank == 0:
        print("RESULT " + json.dumps(everyone), flush=True)
    dist.destroy_process_group()


# -- the emulated network ------------------------------------------------------------------------------------------
FABRICS = ("per-rank", "shared-nic", "star")


def emulated_fabric(
    rate_mbit: float,
    fabric: str,
    bulk_lane_mbit: float | None = None,
    ranks: int = 4,
    switch_buffer_kb: float | None = None,
) -> EmulatedNetwork:
    """``ranks`` rank namespaces (4 unless ``--ranks``) with priority classes (flowlane.testing.netem, ``bulk_subnet``: a
    macvlan ``bulk0`` per rank whose traffic every shaped port queues behind the rest; not on ``star``).

    ``per-rank``: every rank has its own link; only its ``eth0`` egress is shaped (what a rank's own sender-side order
    can resolve). ``shared-nic``: ranks ``{0,1}`` and ``{2,3}`` (the PP groups) are two servers behind one NIC each,
    shaped both ways; PP stays inside the server (unshaped, as NVLink would), DP and EP cross the NIC -- the seed's
    literal fabric (one 100 Gb/s link per server, §5.5.1) in miniature. ``bulk_lane_mbit``: the bulk class gets its
    own lane instead of the link's leftovers (a bound, see ``--bulk-lane-mbit``). ``star``: ``ranks`` ranks on one
    switch, every access link shaped both ways, the switch ports queueing ``switch_buffer_kb`` KiB (a shallow buffer
    drops under incast; :mod:`benchmarks.hermod_intra_real`); no priority classes, so host order only."""
    if fabric not in FABRICS:
        raise ValueError(f"fabric {fabric!r} is not one of {list(FABRICS)}")
    if fabric == "star":
        return EmulatedNetwork(
            ranks,
            rate_mbit=rate_mbit,
            switch_buffer_kb=switch_buffer_kb,
            subnet="10.213.0.0/24",
            prefix="flh",
        )
    shared = fabric == "shared-nic"
    return EmulatedNetwork(
        ranks,
        rate_mbit=rate_mbit,
        ranks_per_server=2 if shared else 1,
        shape_downlink=shared,
        subnet="10.213.0.0/24",
        bulk_subnet="10.213.1.0/24",
        bulk_lane_mbit=bulk_lane_mbit,
        pipeline_subnet="10.213.2.0/24",
        prefix="flh",
    )


def rank_slots(megatron: bool, fabric: str, ranks: int = 4) -> list[int]:
    """The namespace slot each rank runs in (``slots[rank]``). Slots ``{0,1}`` and ``{2,3}`` are the shared-nic
    fabric's servers. The synthetic workload's PP groups are ranks ``{0,1}``/``{2,3}`` already; Megatron's rank
    layout (rank = stage * 2 + dp) puts PP groups at ``{0,2}``/``{1,3}``, so on the shared NIC its ranks 1 and 2 swap
    slots: PP stays inside a server, DP (and EP, folded into DP) crosses the NIC, as on the seed's testbed."""
    return [0, 2, 1, 3] if megatron and fabric == "shared-nic" else list(range(ranks))


def run_all(
    rate: float,
    rounds: int,
    variants: dict[str, dict[str, Any]],
    fabric: str = "per-rank",
    work: dict[str, Any] = WORK,
    bulk_lane_mbit: float | None = None,
    slots: list[int] | None = None,
    switch_buffer_kb: float | None = None,
) -> tuple[list[Any], dict[str, Any]]:
    slots = slots or [0, 1, 2, 3]
    n = len(slots)
    with emulated_fabric(rate, fabric, bulk_lane_mbit, n, switch_buffer_kb) as net:
        env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
        outs = net.run_ranks(
            [
                [
                    sys.executable,
                    "-m",
                    "benchmarks.hermod_real",
                    "--worker",
                    str(r),
                    "--world",
                    str(n),
                    "--master",
                    net.ips[slots[0]],
                    "--rounds",
                    str(rounds),
                    "--variants-json",
                    json.dumps(variants),
                    "--work-json",
                    json.dumps(work),
                ]
                for r in range(n)
            ],
            slots=slots,
            timeout_s=1800,
            env=env,
            cwd=REPO,
        )
        desc = {
            "fabric": fabric,
            **net.describe(),
            "rank_slots": slots,
            "class_bytes_at_end": net.class_bytes() if net.bulk_net is not None else None,
        }
    line = next(x for x in outs[0].splitlines() if x.startswith("RESULT "))
    return json.loads(line[7:]), desc


def summarise(res: list[Any], variants: dict[str, dict[str, Any]]) -> dict[str, Any]:
    modes = list(variants)
    per_iter = {
        m: [max(r[m]["times"][i] for r in res) for i in range(len(res[0][m]["times"]))] for m in modes
    }
    med = {m: statistics.median(v) for m, v in per_iter.items()}
    same = {m: all(r[m]["digest"] == r["fifo"]["digest"] for r in res) for m in modes}
    # over DP > 2 a chunked all-reduce sums each element in another order (CommScheduler.chunk_bounds): parameters
    # then agree to rounding, not bit for bit; this is how far apart they are
    drift = {m: max(_rel_diff(r[m]["digest"], r["fifo"]["digest"]) for r in res) for m in modes}
    ops: dict[str, Any] = {}
    for m in modes:  # per kind: median op duration and per-iteration op time, per pipeline stage
        ops[m] = {}
        for stage in (0, 1):
            ranks = [r for r in res if r[m]["stage"] == stage]
            kinds = sorted({k for r in ranks for run in r[m]["ops"] for k in run})
            row = {}
            for k in kinds:
                runs = [run[k] for r in ranks for run in r[m]["ops"] if k in run]
                iters = sum(len(r[m]["times"]) for r in ranks)  # steady iterations, all runs
                row[k] = {
                    "median_op_s": statistics.median(x["median_s"] for x in runs),
                    "op_time_per_iter_s": sum(x["sum_s"] for x in runs) / iters,
                    "bytes_sent_per_iter": sum(x["bytes_sent"] for x in runs) / iters,
                }
            ops[m][f"stage{stage}"] = row
    # ep_algorithm=auto, per round: the choice and the probe's summed seconds (the same on every rank), and the
    # probe iterations' times (max over ranks)
    choices = {
        m: [
            {
                "choice": a["choice"],
                "probe_seconds_all_ranks": a["probe_seconds"],
                "probe_iteration_times": [
                    max(r[m]["ep_auto"][i]["probe_iteration_times"][k] for r in res)
                    for k in range(len(a["probe_iteration_times"]))
                ],
            }
            for i, a in enumerate(res[0][m]["ep_auto"])
        ]
        for m in modes
        if res[0][m].get("ep_auto")
    }
    return {
        "per_iter": per_iter,
        "median": med,
        "speedup": {m: med["fifo"] / med[m] for m in modes},
        "math_identical": same,
        "digest_max_rel_diff": drift,
        "ops": ops,
        "ep_auto": choices,
    }


def _rel_diff(a: Any, b: Any) -> float:
    """Largest relative difference between two digests (a parameter sum, or a list of them and of losses)."""
    if isinstance(a, list):
        return max((_rel_diff(x, y) for x, y in zip(a, b, strict=True)), default=0.0)
    return abs(a - b) / max(abs(a), abs(b), 1e-30)


def _overlap(timeline: list[Any]) -> dict[str, float]:
    """One rank's last iteration: how long DP was on the wire together with a PP/EP op of the same rank (the only
    contention sender-side ordering can resolve on per-rank links), and how much DP time is exposed before the first
    and after the last PP/EP op (parameter gathers feeding the first forward; reductions feeding the optimizer)."""

    def merged(iv: list[tuple[float, float]]) -> list[tuple[float, float]]:
        out: list[tuple[float, float]] = []
        for a, b in sorted(iv):
            if out and a <= out[-1][1]:
                out[-1] = (out[-1][0], max(out[-1][1], b))
            else:
                out.append((a, b))
        return out

    dp = merged([(o[3], o[3] + o[4]) for o in timeline if o[0] == "dp"])
    crit = merged(
        [(o[3], o[3] + o[4]) for o in timeline if o[0] in ("pp", "ep") and o[1] not in ("recv", "irecv")]
    )
    both = sum(max(0.0, min(b, d) - max(a, c)) for a, b in dp for c, d in crit)
    first = min((a for a, _ in crit), default=0.0)
    last = max((b for _, b in crit), default=0.0)
    return {
        "dp_wire_s": sum(b - a for a, b in dp),
        "dp_overlapping_pp_ep_sends_s": both,
        "dp_before_first_pp_ep_s": sum(max(0.0, min(b, first) - a) for a, b in dp),
        "dp_after_last_pp_ep_s": sum(max(0.0, b - max(a, last)) for a, b in dp),
    }


def _wrap(name: str) -> str:
    """A variant's name on short lines for an axis label."""
    for old, new in (("hermod ", "hermod\n"), (" a2a=", "\na2a="), ("auto(", "auto\n("), (" wire", "\nwire")):
        name = name.replace(old, new)
    return name


def _plot(per_iter: dict[str, list[float]], speedup: dict[str, float], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(per_iter)
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(names)), 3.8))
    ax.boxplot([per_iter[m] for m in names])
    ax.set_xticks(range(1, len(names) + 1), [_wrap(m) + f"\n{speedup[m]:.2f}x" for m in names], fontsize=7)
    ax.set_ylabel("iteration time (s, max over ranks)")
    ax.set_title(title, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


TEXT_KEYS = ("dp_mid", "ep_algorithm", "ep_auto_candidates", "launch")
INT_KEYS = ("wire", "ep_auto_probe_iterations")
# the all-to-all Hermod runs (HermodConfig.ep_algorithm): BvN matching phases (bvn_bottleneck: fewer, longer ones),
# the seed's Algorithm 3, one all_to_all_single (inter-coflow priority only), or auto (measure the candidates, by
# default plain and BvN, keep the fastest; ep_auto_candidates=plain+bvn+alg3 to add more). A literal, not
# flowlane.sched.alltoall.RUN_ALGORITHMS, so the parent process never imports torch;
# tests/test_netem.py checks the two agree.
EP_ALGORITHMS = ("bvn", "bvn_bottleneck", "alg3", "plain", "auto")
# auto's defaults in variant-string form, literals for the same reason (the core's AUTO_CANDIDATES and
# AllToAllRunner's probe_iterations; tests/test_netem.py checks them); the candidate check in _parse_variant mirrors
# flowlane.sched.alltoall.check_candidates so a bad variant is refused before any namespace is set up
AUTO_CANDIDATES = "plain+bvn"
AUTO_PROBE_ITERATIONS = 2


def _parse_variant(s: str) -> dict[str, Any]:
    out: dict[str, Any] = dict(DEFAULT_VARIANT)
    for kv in s.split(","):
        k, v = kv.split("=")
        if k not in (*DEFAULT_VARIANT, *TEXT_KEYS, *INT_KEYS):
            raise ValueError(f"unknown variant key {k!r}; known: {[*DEFAULT_VARIANT, *TEXT_KEYS, *INT_KEYS]}")
        out[k] = float(v) if k == "gate_timeout_s" else v if k in TEXT_KEYS else int(v)
    if out.get("ep_algorithm", "bvn") not in EP_ALGORITHMS:
        raise ValueError(f"ep_algorithm={out['ep_algorithm']} is not one of {list(EP_ALGORITHMS)}")
    for k in ("ep_auto_candidates", "ep_auto_probe_iterations"):
        if k in out and out.get("ep_algorithm") != "auto":
            raise ValueError(f"{k}={out[k]} needs ep_algorithm=auto")
    if out.get("ep_auto_probe_iterations", AUTO_PROBE_ITERATIONS) < 1:
        raise ValueError(f"ep_auto_probe_iterations={out['ep_auto_probe_iterations']} must be >= 1")
    cands = out.get("ep_auto_candidates", AUTO_CANDIDATES).split("+")
    if len(cands) < 2 or len(set(cands)) != len(cands) or not set(cands) <= set(EP_ALGORITHMS) - {"auto"}:
        raise ValueError(
            f"ep_auto_candidates={out['ep_auto_candidates']} must be two or more distinct names of "
            f"{[x for x in EP_ALGORITHMS if x != 'auto']} joined by '+'"
        )
    if out.get("wire", 0) not in (0, 1, 2):
        raise ValueError(
            f"wire={out['wire']} is not one of 0 (host order), 1 (DP in the bulk class), "
            "2 (and each all-to-all in its MID class)"
        )
    return out


def _measure(
    a: argparse.Namespace,
    rate: float,
    variants: dict[str, dict[str, Any]],
    work: dict[str, Any],
    baselines: list[str],
    megatron: bool,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """One run at ``rate`` Mbit/s: every variant, alternating round after round; the result document."""
    t0 = time.time()
    res, net = run_all(
        rate,
        a.rounds,
        variants,
        a.fabric,
        work,
        a.bulk_lane_mbit,
        rank_slots(megatron, a.fabric, a.ranks),
        a.switch_buffer_kb,
    )
    s = summarise(res, variants)
    # with a bulk lane the wire variants' DP is off the link: a bound, not a schedule's result
    bounds = [m for m, v in variants.items() if a.bulk_lane_mbit and v.get("wire")]
    scheds = [m for m in variants if m != "fifo" and m not in bounds and m not in baselines]
    best = max(scheds, key=lambda m: s["speedup"][m]) if scheds else None
    med = s["median"]
    vs = {b: med[b] / med[best] for b in ["fifo", *baselines]} if best else {}
    # the goal is judged against the fastest baseline of the run: Megatron's overlap flags can make it slower than
    # its defaults, and a gain over the slower of the two is not a gain a user would see
    fastest = min(vs, key=vs.get) if vs else None
    layout = (
        (
            "Megatron: rank = stage * 2 + dp; PP groups {0,2},{1,3}; DP groups {0,1},{2,3}; "
            + ("EP groups = DP groups (expert-DP size 1)" if a.megatron_moe else "dense GPT (no EP)")
            + (
                "; servers = ranks {0,2},{1,3} (PP inside a server, DP/EP across the NIC)"
                if a.fabric == "shared-nic"
                else ""
            )
        )
        if megatron
        else f"rank = dp * {a.pp} + stage ({a.ranks} ranks, PP {a.pp}); DP = EP groups "
        f"= the ranks of one stage (EP {a.ranks // a.pp})"
    )
    doc = {
        "benchmark": "hermod_real",
        "label": LABEL,
        "network": net,
        "workload_kind": a.workload,
        "workload": work,
        "layout": layout,
        "rounds": a.rounds,
        "alternation": "each round runs every variant once, in the order listed",
        "variants": variants,
        "iteration_time_s": s["per_iter"],
        "median_iteration_time_s": s["median"],
        "speedup_vs_fifo": s["speedup"],
        "best_variant": best,
        "speedup_hermod_vs_fifo": s["speedup"][best] if best else None,
        "math_identical": s["math_identical"],
        "digest_max_rel_diff": s["digest_max_rel_diff"],
        "op_timings": s["ops"],
        **({"ep_auto": s["ep_auto"]} if s["ep_auto"] else {}),
        "goal": ">= 1.15x",
        "goal_met": fastest is not None and vs[fastest] >= 1.15,
        "goal_judged_against": fastest,
        "baselines": (
            {
                "fifo": "the Megatron recipe with --use-distributed-optimizer --overlap-grad-reduce "
                "--overlap-param-gather: reduce-scatters in the last backward, gathers one bucket "
                "ahead of the forward (forward pre-hooks)",
                "megatron": "the Megatron recipe with --use-distributed-optimizer, overlap off: "
                "reduce-scatters after the backward, gathers at the end of the step",
                "hermod": "fifo's flags with --coflow-scheduler hermod: Megatron DDP's bucket-group "
                "reduce-scatters deferred in Hermod order behind pipeline p2p, gathers in key "
                "order (lowest layer first), pipeline p2p critical",
            }
            if megatron
            else {
                "fifo": "Megatron with --overlap-grad-reduce --overlap-param-gather: every op launched "
                "when issued, parameter gathers one layer ahead (forward pre-hooks)",
                "megatron": "Megatron-LM's defaults (overlap off): the thesis' 'vanilla Megatron-LM'",
                "lina": "Lina as the thesis re-implemented it: EP before DP, DP chunked, in issue order",
            }
        ),
        "speedup_best_hermod_vs_baseline": vs,
        "wall_s": time.time() - t0,
    }
    if bounds:
        doc["bound_speedup"] = max(s["speedup"][m] for m in bounds)
        doc["bound_note"] = (
            f"'(bound)' variants: Hermod with DP on its own {a.bulk_lane_mbit:g} Mbit/s lane beside "
            "the link, so DP never competes with PP/EP; FIFO / them bounds what any order of the DP "
            "traffic could gain here (not a schedule's result; excluded from best_variant)"
        )
    if a.timeline:
        doc["overlap_last_iteration"] = {m: [_overlap(r[m]["timeline"]) for r in res] for m in variants}
        ov = {
            m: {k: statistics.mean(o[k] for o in v) for k in v[0]}
            for m, v in doc["overlap_last_iteration"].items()
        }
        doc["overlap_mean_over_ranks_s"] = ov
        # sender-side priority can at most remove the time DP shares a rank's link with that rank's PP/EP sends
        doc["fifo_contention_share"] = ov["fifo"]["dp_overlapping_pp_ep_sends_s"] / s["median"]["fifo"]
        doc["timeline_last_iteration"] = {m: [r[m]["timeline"] for r in res] for m in variants}
    return doc, s


#: per-rank, per-op data behind the figures: written to the result's ``.detail.json.gz`` sidecar, not its JSON
DETAIL_KEYS = ("timeline_last_iteration", "overlap_last_iteration")


def split_detail(doc: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``doc`` without :data:`DETAIL_KEYS` (also inside a sweep's ``points``), and those keys on their own."""
    summary = {k: v for k, v in doc.items() if k not in DETAIL_KEYS}
    detail = {k: doc[k] for k in DETAIL_KEYS if k in doc}
    if isinstance(doc.get("points"), dict):
        split = {r: split_detail(p) for r, p in doc["points"].items()}
        summary["points"] = {r: sp[0] for r, sp in split.items()}
        detail["points"] = {r: sp[1] for r, sp in split.items() if sp[1]}
        if not detail["points"]:
            del detail["points"]
    return summary, detail


def rate_sweep(docs: dict[float, dict[str, Any]], baselines: list[str]) -> dict[str, Any]:
    """One document for a ``--rate-mbit`` sweep (the thesis' fig. 5.9 analogue): every rate's run in ``points``, and
    each variant's speedup over each baseline per rate. Each rate is its own run (variants alternate within it), so
    speedups compare within a rate, iteration times across rates only loosely."""
    rates = sorted(docs)
    first = docs[rates[0]]
    base = ["fifo", *baselines]
    spd = {
        b: {
            m: {
                f"{r:g}": docs[r]["median_iteration_time_s"][b] / docs[r]["median_iteration_time_s"][m]
                for r in rates
            }
            for m in first["variants"]
            if m != b
        }
        for b in base
    }
    return {
        "benchmark": "hermod_real",
        "sweep": "rate_mbit",
        "label": LABEL,
        "rates_mbit": rates,
        "workload_kind": first["workload_kind"],
        "workload": first["workload"],
        "rounds": first["rounds"],
        "variants": first["variants"],
        "speedup_vs_baseline": spd,
        "best_hermod_vs_baseline": {f"{r:g}": docs[r]["speedup_best_hermod_vs_baseline"] for r in rates},
        "goal": first["goal"],
        "goal_met_at": {f"{r:g}": docs[r]["goal_met"] for r in rates},
        "math_identical": all(all(d["math_identical"].values()) for d in docs.values()),
        "points": {f"{r:g}": docs[r] for r in rates},
        "wall_s": sum(d["wall_s"] for d in docs.values()),
    }


def _plot_sweep(sweep: dict[str, Any], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = sweep["rates_mbit"]
    bases = list(sweep["speedup_vs_baseline"])
    fig, axes = plt.subplots(1, len(bases), figsize=(5.2 * len(bases), 3.8), squeeze=False)
    for ax, b in zip(axes[0], bases, strict=True):
        for m, row in sweep["speedup_vs_baseline"][b].items():
            ax.plot(
                rates,
                [row[f"{r:g}"] for r in rates],
                marker="o",
                label=m,
                ls="--" if "hermod" not in m else "-",
            )
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.axhline(1.15, color="tab:red", lw=0.8, ls=":", label="goal 1.15x")
        ax.set_xscale("log")
        ax.set_xticks(rates, [f"{r:g}" for r in rates])
        ax.minorticks_off()
        ax.set_xlabel("link rate (Mbit/s per rank)")
        ax.set_ylabel(f"speedup vs {b}")
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _title(a: argparse.Namespace, megatron: bool, rate: float | None) -> str:
    what = ("Megatron MoE GPT" if a.megatron_moe else "Megatron GPT") if megatron else "synthetic"
    where = {
        "per-rank": "per-rank egress (htb)",
        "shared-nic": "one NIC per 2-rank server (htb)",
        "star": "one switch, {kb:g} KiB port buffers (tbf)",
    }[a.fabric].format(kb=a.switch_buffer_kb or 0)
    at = f"{rate:g} Mbit/s, " if rate is not None else ""
    pp = 2 if megatron else a.pp
    dp = a.ranks // pp
    return (
        f"{a.ranks} ranks PP{pp}xDP{dp}{'' if megatron and not a.megatron_moe else f'xEP{dp}'} ({what}), "
        f"{at}{where}\n{LABEL}"
    )


def _command() -> str:
    return "python -m benchmarks.hermod_real " + " ".join(sys.argv[1:])


def _parse_rates(s: str) -> list[float]:
    try:
        rates = [float(x) for x in s.split(",")]
    except ValueError:
        raise ValueError(
            f"--rate-mbit must be a rate or a comma-separated list of rates in Mbit/s, got {s!r}"
        ) from None
    if any(not r > 0 for r in rates) or len(set(rates)) != len(rates):
        raise ValueError(f"--rate-mbit rates must be > 0 Mbit/s and distinct, got {s!r}")
    return sorted(rates)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--rate-mbit",
        default="200",
        help="link rate in Mbit/s; a comma-separated list runs a sweep (one run per rate) into one file",
    )
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--out", default="results/hermod/real")
    ap.add_argument("--name", default="real", help="output file stem (real -> real.json, real.png)")
    ap.add_argument(
        "--variant",
        action="append",
        default=[],
        help="a Hermod variant: chunk_bytes=N,max_inflight_chunks=N,gate_timeout_s=S[,dp_mid=consumer]"
        "[,ep_algorithm=bvn|bvn_bottleneck|alg3|plain|auto][,ep_auto_candidates=plain+bvn+alg3]"
        "[,ep_auto_probe_iterations=N][,wire=1|2] (repeatable); wire=1 puts the "
        "bulk class on its own address, queued by priority; wire=2 also puts each all-to-all in "
        "its class (critical: oldest in-flight microbatch, pipeline: later ones), the pipeline class "
        "on a third address",
    )
    ap.add_argument(
        "--fabric",
        choices=FABRICS,
        default="per-rank",
        help="per-rank: each rank's own shaped link; shared-nic: 2 servers of 2 ranks behind one shaped "
        "NIC each; star: one switch, links shaped both ways, --switch-buffer-kb (see emulated_fabric)",
    )
    ap.add_argument(
        "--ranks",
        type=int,
        default=4,
        help="synthetic workload: PP x DP(ranks/PP), EP = DP (8: EP groups of four, where matching "
        "matters); shared-nic and --workload megatron need 4",
    )
    ap.add_argument(
        "--pp",
        type=int,
        default=WORK["pp"],
        choices=(1, 2),
        help="synthetic workload's pipeline stages (1: no PP; 4 ranks then form one EP group of four)",
    )
    ap.add_argument(
        "--switch-buffer-kb",
        type=float,
        help="star fabric: KiB each switch port towards a rank queues (shallow: incast drops)",
    )
    ap.add_argument(
        "--timeline",
        action="store_true",
        help="store every rank's ops (kind, op, bytes, start, duration) of the last iteration per variant",
    )
    ap.add_argument(
        "--layers-per-stage",
        type=int,
        default=WORK["layers_per_stage"],
        help="layers per pipeline stage (seed testbed: 3-16); each has its own DP bucket and all-to-alls "
        "(--workload megatron: the GPT's num_layers = 2 x this, each layer its full size)",
    )
    ap.add_argument(
        "--param-elems",
        type=int,
        help=f"parameters per layer (float32): the size of each layer's DP gather and reduction (synthetic "
        f"workload only; default {WORK['param_elems']})",
    )
    ap.add_argument(
        "--act-elems",
        type=int,
        help=f"activation elements (float32) per microbatch: the size of each pipeline send and of each "
        f"rank's all-to-all input (synthetic workload only; default {WORK['act_elems']})",
    )
    ap.add_argument(
        "--bulk-lane-mbit",
        type=float,
        help="a bound, not a schedule: the bulk class gets its own lane of this rate beside the link, so "
        "wire=1 variants' DP traffic no longer competes with PP/EP at all (FIFO never uses it); "
        "FIFO / that variant is then the most any order of the DP traffic could gain",
    )
    ap.add_argument(
        "--baselines",
        help=f"comma-separated baselines run beside fifo, from {list(BASELINES)} ('' for none; default "
        "megatron,lina, with --workload megatron: megatron): megatron = Megatron-LM's defaults (no "
        "DP overlap), lina = EP-first with chunked DP (synthetic workload only)",
    )
    ap.add_argument(
        "--iterations",
        type=int,
        default=WORK["iterations"],
        help="iterations per run, the first a warm-up (synthetic workload; ep_algorithm=auto also "
        "spends ep_auto_probe_iterations (2) per candidate on its probe: >= 6 with the default two "
        "candidates)",
    )
    ap.add_argument(
        "--workload",
        choices=("synthetic", "megatron"),
        default="synthetic",
        help="synthetic: flowlane.testing.workload (sleep compute, MoE); megatron: the default recipe's "
        "Megatron-core GPT with Megatron's distributed optimizer and real compute (per-rank fabric)",
    )
    ap.add_argument(
        "--megatron-moe",
        action="store_true",
        help="--workload megatron with MoE layers: 4 experts, top-2, expert parallel 2 (EP groups = DP "
        "groups, so the token all-to-alls share each rank's link with the DP traffic)",
    )
    ap.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--work-json", help=argparse.SUPPRESS)
    ap.add_argument("--master", help=argparse.SUPPRESS)
    ap.add_argument("--world", type=int, default=4, help=argparse.SUPPRESS)
    ap.add_argument("--variants-json", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker is not None:
        worker(a.worker, a.world, a.master, a.rounds, json.loads(a.variants_json), json.loads(a.work_json))
        return 0
    hv = [_parse_variant(v) for v in a.variant] or [dict(DEFAULT_VARIANT)]
    try:
        rates = _parse_rates(a.rate_mbit)
    except ValueError as e:
        ap.error(str(e))
    if (a.param_elems is not None or a.act_elems is not None) and a.workload == "megatron":
        ap.error(
            "--param-elems / --act-elems size the synthetic workload; --workload megatron has its GPT's own"
        )
    param_elems = WORK["param_elems"] if a.param_elems is None else a.param_elems
    act_elems = WORK["act_elems"] if a.act_elems is None else a.act_elems
    if a.layers_per_stage < 1 or act_elems < 64 or act_elems % 64 or param_elems < act_elems:
        # a layer's weights cover one activation; activations are rows of 64
        ap.error(
            f"--layers-per-stage must be >= 1, --act-elems a multiple of 64 and --param-elems >= --act-elems, "
            f"got {a.layers_per_stage}, {act_elems} and {param_elems}"
        )
    if a.bulk_lane_mbit is not None and not any(v.get("wire") for v in hv):
        ap.error("--bulk-lane-mbit needs a variant with wire=1 (only those use the bulk class)")
    megatron = a.workload == "megatron"
    if a.ranks < 4 or a.ranks % 2 or (a.ranks != 4 and (megatron or a.fabric == "shared-nic")):
        ap.error(
            f"--ranks must be an even number >= 4 (PP x DP ranks/PP), and 4 with --workload megatron or "
            f"--fabric shared-nic; got {a.ranks}"
        )
    if a.pp != WORK["pp"] and (megatron or a.fabric == "shared-nic"):
        ap.error(
            f"--pp {a.pp} needs the synthetic workload on per-rank or star links (the shared-NIC servers hold "
            f"PP pairs; --workload megatron has its own PP 2)"
        )
    if (a.switch_buffer_kb is not None) != (a.fabric == "star"):
        ap.error("--switch-buffer-kb goes with --fabric star, and --fabric star needs it")
    if a.fabric == "star" and (any(v.get("wire") for v in hv) or a.bulk_lane_mbit is not None):
        ap.error(
            "--fabric star has no priority classes: wire=1|2 variants and --bulk-lane-mbit need per-rank or "
            "shared-nic"
        )
    allowed = ["megatron"] if megatron else list(BASELINES)
    baselines = [b for b in (a.baselines if a.baselines is not None else ",".join(allowed)).split(",") if b]
    if set(baselines) - set(allowed):
        ap.error(
            f"--baselines: unknown {sorted(set(baselines) - set(allowed))} for --workload {a.workload}; "
            f"choose from {allowed}"
        )
    if megatron and any(v.get("wire", 0) == 2 for v in hv):
        ap.error("wire=2 (all-to-alls in their classes) needs the synthetic MoE workload; use wire=1")
    if a.megatron_moe and not megatron:
        ap.error("--megatron-moe needs --workload megatron")
    auto = any(v.get("ep_algorithm") == "auto" for v in hv)
    # warm-up + the probe (ep_auto_probe_iterations, default 2, per candidate) + one steady iteration
    least = max(
        (
            2
            + v.get("ep_auto_probe_iterations", AUTO_PROBE_ITERATIONS)
            * len(v.get("ep_auto_candidates", AUTO_CANDIDATES).split("+"))
            for v in hv
            if v.get("ep_algorithm") == "auto"
        ),
        default=2,
    )
    if megatron and (auto or a.iterations != WORK["iterations"]):
        ap.error(
            "ep_algorithm=auto and --iterations need the synthetic workload (the Megatron recipe runs 3 "
            "iterations, too few for auto's probe, and its EP groups of two never match anyway)"
        )
    if a.iterations < least:
        ap.error(
            f"--iterations must be >= 2 (one warm-up), and with ep_algorithm=auto >= 2 + its probe "
            f"(warm-up, probe, one steady iteration): >= {least} here; got {a.iterations}"
        )
    if megatron:
        work: dict[str, Any] = dict(
            MEGATRON_WORK,
            **(MEGATRON_MOE if a.megatron_moe else {}),
            num_layers=MEGATRON_WORK["pipeline_parallel"] * a.layers_per_stage,
        )
        variants: dict[str, dict[str, Any]] = {
            b: {"megatron": MEGATRON_BASELINES[b]} for b in ["fifo", *baselines]
        }
    else:
        work = {
            **WORK,
            "pp": a.pp,
            "layers_per_stage": a.layers_per_stage,
            "param_elems": param_elems,
            "act_elems": act_elems,
            "iterations": a.iterations,
        }
        variants = {"fifo": dict(FIFO), **{b: BASELINES[b] for b in baselines}}
    for v in hv:
        name = (
            f"hermod c{v['chunk_bytes'] >> 10}k i{v['max_inflight_chunks']} g{v['gate_timeout_s'] * 1e3:g}ms"
        )
        if v.get("dp_mid", "last") != "last":
            name += f" {v['dp_mid']}"
        if v.get("launch", "auto") != "auto":
            name += f" {v['launch']}"
        if v.get("ep_algorithm", "bvn") != "bvn":
            name += f" a2a={v['ep_algorithm']}"
        if v.get("ep_auto_candidates", AUTO_CANDIDATES) != AUTO_CANDIDATES:
            name += f"({v['ep_auto_candidates']})"
        if v.get("ep_auto_probe_iterations", AUTO_PROBE_ITERATIONS) != AUTO_PROBE_ITERATIONS:
            name += f" x{v['ep_auto_probe_iterations']}"
        if v.get("wire"):
            w = " wire" if v["wire"] == 1 else " wire+ep"
            name += f"{w}, DP on own {a.bulk_lane_mbit:g} Mbit lane (bound)" if a.bulk_lane_mbit else w
        variants[name] = {"mode": "hermod", **v}
    if os.geteuid() != 0:
        print("hermod_real needs root (ip netns, tc) for the per-rank emulated links", file=sys.stderr)
        return 2
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    docs = {}
    for rate in rates:
        doc, s = _measure(a, rate, variants, work, baselines, megatron)
        docs[rate] = doc
        if len(rates) == 1:
            summary, detail = split_detail(doc)
            write_result(out / f"{a.name}.json", summary, _command(), detail)
            _plot(s["per_iter"], s["speedup"], out / f"{a.name}.png", _title(a, megatron, rate))
        print(
            f"-- {rate:g} Mbit/s",
            json.dumps(
                {
                    k: doc[k]
                    for k in (
                        "median_iteration_time_s",
                        "speedup_vs_fifo",
                        "math_identical",
                        "speedup_best_hermod_vs_baseline",
                        "goal_judged_against",
                        "goal_met",
                    )
                },
                indent=1,
            ),
        )
        for m in variants:
            for st, row in s["ops"][m].items():
                print(
                    m,
                    st,
                    {
                        k: f"{v['op_time_per_iter_s'] * 1e3:.0f}ms/it med {v['median_op_s'] * 1e3:.1f}ms"
                        for k, v in row.items()
                    },
                )
    if len(rates) > 1:
        sweep = rate_sweep(docs, baselines)
        summary, detail = split_detail(sweep)
        write_result(out / f"{a.name}.json", summary, _command(), detail)
        _plot_sweep(sweep, out / f"{a.name}.png", _title(a, megatron, None))
        print(json.dumps({k: sweep[k] for k in ("speedup_vs_baseline", "goal_met_at")}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
