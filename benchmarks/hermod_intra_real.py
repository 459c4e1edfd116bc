"""Hermod's incast-free all-to-all against a plain one on an emulated fabric with shallow switch buffers (measured on
CPU with emulated links: real TCP through gloo, netns + tc), and the incast penalty that calibrates the simulator.

Seed 000 §5.3.2 sends an imbalanced EP all-to-all as incast-free matchings because "imbalanced EP AllToAll flows
cause incast and long CCTs" (§5.1.3); its fig. 5.11 credits this intra-coflow part with ~1.1x on MoE models. A max-min
fluid model has no incast (digest A6 R6), so ``hermod_intra_sim`` had to *assume* a penalty. Here the penalty is
measured instead:

- Fabric: ``--ranks`` gloo ranks, one namespace each, on one switch (:class:`flowlane.testing.netem.EmulatedNetwork`, a star):
  every access link is shaped to ``--rate-mbit`` both ways; the switch port towards each rank queues at most
  ``B`` KiB (``switch_buffer_kb``), one fabric per ``B`` in ``--buffers-kb``. A deep buffer (1 MiB) never drops; a
  shallow one drops what many senders push into one port at once, and TCP then waits for a retransmission timeout.
- Traffic: ``--matrices`` dispatch matrices drawn like the simulator's (:func:`flowlane.sim.workloads.zipf_token_matrix`:
  Zipf expert popularity ``--skew``, ``--experts-per-rank`` experts per rank, top-k ``--top-k``), ``--hidden`` float32
  values per token. Every rank draws the same matrices from ``--seed``.
- Algorithms, alternating in every round: ``plain`` (``all_to_all_single``: gloo posts every send at once, as NCCL
  does), ``bvn`` (Hermod: the split matrix all-gathered, then the Birkhoff-von Neumann phases of
  :func:`flowlane.sched.alltoall.matched_all_to_all`, each rank stepping on when its own pairs are done),
  ``bvn_bottleneck`` (BvN taking the max-min perfect matching each step: the same total in fewer, longer phases;
  :mod:`flowlane.hermod.matching`), ``bvn_barrier`` (``bvn``'s phases with a group barrier between them: every rank
  in lockstep) and ``alg3`` (the seed's Algorithm 3 phases), planned in units of ``--quantum`` tokens. Each rank times
  its part after a barrier; a collective's time is the slowest rank's. Every algorithm's output must equal
  ``plain``'s bit for bit on every rank (checked; a mismatch fails the run).
- Calibration: the simulator (:mod:`flowlane.sim`, a star at the same rate) replays each matrix. The deepest buffer
  fixes the goodput (TCP/IP headers: the simulated rate is scaled until the simulated plain all-to-all takes the
  measured time) and the per-phase overhead (the simulator's ``launch_overhead`` that makes the simulated phases as
  slow as the measured ``bvn``); then, for every buffer, the :class:`flowlane.sim.IncastModel` ``alpha`` that makes
  the simulated plain all-to-all as slow as the measured one (bisection; capacity / (1 + alpha (k - 1)) for k flows
  into one port), and the phases' time the calibrated simulator predicts, beside the measured one. At 16 ranks
  (fan-in 15) even an 8 MiB buffer loses to fan-in (it bloats, then TCP times out), so the deepest buffer no longer
  shows the goodput; ``--goodput`` then takes it from a run with fewer ranks at the same rate.

Writes ``--out`` (JSON: every measured time, per-buffer medians, speedups over plain, lower bound, fitted alpha) and a
PNG. Needs root (ip netns, tc); every namespace is uniquely named and deleted on exit; traffic stays inside them.

    .venv-llm/bin/python -m benchmarks.hermod_intra_real [--ranks 8] [--rate-mbit 100] [--buffers-kb 1024,128,64]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from flowlane.hermod.matching import lower_bound  # noqa: E402
from flowlane.sim.workloads import zipf_token_matrix  # noqa: E402
from flowlane.testing.netem import EmulatedNetwork, NetemError, check_available  # noqa: E402
from flowlane.testing.provenance import write_result  # noqa: E402

PORT = 29541
ALGORITHMS = ("plain", "bvn", "bvn_bottleneck", "bvn_barrier", "alg3")
_BYTES_PER_VALUE = 4  # float32


def draw_matrices(cfg: dict[str, Any]) -> list[list[list[int]]]:
    """The run's dispatch matrices (token counts), identical on every rank (one seeded generator)."""
    rng = np.random.default_rng(cfg["seed"])
    n = cfg["ranks"]
    return [
        zipf_token_matrix(
            rng, n, n * cfg["experts_per_rank"], cfg["tokens"], cfg["top_k"], cfg["skew"]
        ).tolist()
        for _ in range(cfg["matrices"])
    ]


def lower_bound_s(matrix: list[list[int]], row_bytes: int, rate_mbit: float) -> float:
    """The all-to-all's bottleneck time on a non-blocking switch: the busiest port's bytes (row or column sum, local
    rows excluded; :func:`flowlane.hermod.matching.lower_bound`, digest A2.6) at the link rate."""
    return lower_bound(matrix) * row_bytes * 8 / (rate_mbit * 1e6)


# -- one rank ------------------------------------------------------------------------------------------------------
def worker(rank: int, master: str, cfg: dict[str, Any]) -> None:
    import torch
    import torch.distributed as dist

    from flowlane.sched.alltoall import gather_split_matrix, matched_all_to_all

    torch.set_num_threads(1)
    world = cfg["ranks"]
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{master}:{PORT}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=cfg["timeout_s"]),
    )
    hidden = cfg["hidden"]
    times: dict[str, list[list[float]]] = {a: [] for a in cfg["algorithms"]}
    warm = torch.ones(world * 64, hidden)
    dist.all_to_all_single(torch.empty_like(warm), warm)  # every connection up before timing
    for mi, matrix in enumerate(draw_matrices(cfg)):
        send = matrix[rank]
        recv = [matrix[i][rank] for i in range(world)]
        inp = torch.arange(sum(send) * hidden, dtype=torch.float32).reshape(-1, hidden) + rank
        ref = None
        for a in cfg["algorithms"]:
            times[a].append([])
        for r in range(cfg["rounds"]):
            order = (
                cfg["algorithms"][r % len(cfg["algorithms"]) :]
                + cfg["algorithms"][: r % len(cfg["algorithms"])]
            )
            for a in order:  # rotated every round: no algorithm always runs first
                out = torch.full((sum(recv), hidden), float("nan"))
                dist.barrier()
                t0 = time.perf_counter()
                if a == "plain":
                    dist.all_to_all_single(out, inp, recv, send)
                else:  # as the runtime does it: the split matrix is gathered, then planned alike on every rank
                    full = gather_split_matrix(send)
                    matched_all_to_all(
                        out,
                        inp,
                        recv,
                        send,
                        full,
                        quantum=cfg["quantum"],
                        algorithm="bvn" if a == "bvn_barrier" else a,
                        phase_sync="barrier" if a == "bvn_barrier" else "pairwise",
                    )
                times[a][mi].append(time.perf_counter() - t0)
                if ref is None:
                    ref = out
                elif not torch.equal(out, ref):
                    raise RuntimeError(
                        f"rank {rank}: {a} all-to-all output differs from "
                        f"{cfg['algorithms'][0]}'s on matrix {mi}"
                    )
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, times)
    if rank == 0:
        print("RESULT " + json.dumps(everyone), flush=True)
    dist.destroy_process_group()


# -- one fabric ----------------------------------------------------------------------------------------------------
def run_fabric(cfg: dict[str, Any], buffer_kb: float) -> dict[str, Any]:
    """All rounds on one fabric whose switch ports queue ``buffer_kb`` KiB. Returns per (algorithm, matrix) the
    collective times (slowest rank per round) and the fabric's description."""
    n = cfg["ranks"]
    sysctls = {"net.ipv4.tcp_wmem": cfg["tcp_wmem"]} if cfg.get("tcp_wmem") else None
    with EmulatedNetwork(
        n,
        rate_mbit=cfg["rate_mbit"],
        switch_buffer_kb=buffer_kb,
        prefix="fli",
        subnet="10.214.0.0/24",
        sysctls=sysctls,
    ) as net:
        env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
        outs = net.run_ranks(
            [
                [
                    sys.executable,
                    "-m",
                    "benchmarks.hermod_intra_real",
                    "--worker",
                    str(r),
                    "--master",
                    net.ips[0],
                    "--cfg-json",
                    json.dumps(cfg),
                ]
                for r in range(n)
            ],
            timeout_s=cfg["timeout_s"] * 4,
            env=env,
            cwd=REPO,
        )
        desc = net.describe()
    ranks = json.loads(next(x for x in outs[0].splitlines() if x.startswith("RESULT "))[7:])
    cct = {
        a: [
            [max(rk[a][mi][r] for rk in ranks) for r in range(cfg["rounds"])] for mi in range(cfg["matrices"])
        ]
        for a in cfg["algorithms"]
    }
    return {"buffer_kb": buffer_kb, "cct_s": cct, "network": desc}


# -- the simulator, calibrated -------------------------------------------------------------------------------------
def simulate_cct(
    matrix: list[list[int]],
    row_bytes: int,
    rate_mbit: float,
    mode: str,
    alpha: float,
    quantum: int = 1,
    phase_overhead_s: float = 0.0,
) -> float:
    """One all-to-all of ``matrix`` on a simulated star at ``rate_mbit`` with an incast penalty ``alpha``;
    ``mode`` plain (every flow at once) or phases (the BvN schedule as the runtime sends it, planned in units of
    ``quantum`` rows; each unit simulated full, so the last one of a pair is rounded up). ``phase_overhead_s``: the
    simulator's ``launch_overhead``, added to every coflow (one per phase flow; the plain all-to-all is one coflow)."""
    from flowlane.policy import CoflowMeta
    from flowlane.sim import IncastModel, SimConfig, Simulator, Workload
    from flowlane.sim import collectives as C
    from flowlane.topology import gbps, star

    n = len(matrix)
    topo = star([gbps(rate_mbit / 1000)] * n, latency=20e-6)
    w = Workload(topo.gpus)
    m = np.array(matrix, dtype=np.float64)
    if mode == "phases":
        m = np.ceil(m / quantum)
    C.all_to_all(
        w,
        range(n),
        m,
        CoflowMeta("ep"),
        mode=mode,
        unit_bytes=float(row_bytes * (quantum if mode == "phases" else 1)),
    )
    inc = IncastModel(alpha=alpha) if alpha > 0 else None
    return Simulator(topo, SimConfig(incast=inc, launch_overhead=phase_overhead_s)).run(w).makespan


def _solve_increasing(f: Any, hi: float, iters: int = 30) -> float:
    """x in [0, hi] where the increasing ``f`` crosses 0 (bisection); 0 or ``hi`` when it does not cross inside."""
    if f(0.0) >= 0:
        return 0.0
    if f(hi) <= 0:
        return hi
    lo = 0.0
    for _ in range(iters):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if f(mid) < 0 else (lo, mid)
    return (lo + hi) / 2


def fit_alpha(
    matrix: list[list[int]], row_bytes: int, rate_mbit: float, measured_s: float, hi: float = 8.0
) -> float:
    """The incast penalty for which the simulated plain all-to-all takes ``measured_s`` (the simulated time grows
    with alpha). 0 when even alpha 0 is slower; ``hi`` when even ``hi`` is faster."""
    return _solve_increasing(
        lambda a: simulate_cct(matrix, row_bytes, rate_mbit, "plain", a) - measured_s, hi
    )


def fit_phase_overhead(
    matrix: list[list[int]],
    row_bytes: int,
    rate_mbit: float,
    measured_s: float,
    quantum: int = 1,
    hi: float = 0.05,
) -> float:
    """The per-phase-flow overhead (s) for which the simulated phases, without incast, take ``measured_s``: what
    launching and waiting for each phase costs the runtime beyond its bytes."""
    return _solve_increasing(
        lambda o: simulate_cct(matrix, row_bytes, rate_mbit, "phases", 0.0, quantum, o) - measured_s, hi
    )


def summarise(cfg: dict[str, Any], fabrics: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians per buffer, speedups over plain, and the simulator calibrated on the measurements: goodput (unless
    ``cfg["goodput"]`` gives it) and the phase overhead from the deepest buffer (no incast there), then alpha per buffer from the plain times, and the
    phases' time the calibrated simulator predicts next to the measured one (``bvn``)."""
    mats = draw_matrices(cfg)
    row_bytes = cfg["hidden"] * _BYTES_PER_VALUE
    q = cfg["quantum"]
    bounds = [lower_bound_s(m, row_bytes, cfg["rate_mbit"]) for m in mats]
    deep = max(fabrics, key=lambda f: f["buffer_kb"])
    deep_med = {a: [statistics.median(v) for v in deep["cct_s"][a]] for a in cfg["algorithms"]}
    # goodput: the deepest buffer has no incast, so the simulated rate is scaled to match its plain times -- unless
    # it is given: at wide fan-in even a deep buffer loses (16 ranks here: bufferbloat, then spurious timeouts)
    goodput = cfg.get("goodput") or statistics.median(
        simulate_cct(m, row_bytes, cfg["rate_mbit"], "plain", 0.0) / deep_med["plain"][mi]
        for mi, m in enumerate(mats)
    )
    rate_eff = cfg["rate_mbit"] * goodput
    overhead = (
        statistics.median(
            fit_phase_overhead(m, row_bytes, rate_eff, deep_med["bvn"][mi], q) for mi, m in enumerate(mats)
        )
        if "bvn" in cfg["algorithms"]
        else 0.0
    )
    rows = []
    for f in sorted(fabrics, key=lambda f: -f["buffer_kb"]):
        med = {a: [statistics.median(v) for v in f["cct_s"][a]] for a in cfg["algorithms"]}
        alphas = [fit_alpha(m, row_bytes, rate_eff, med["plain"][mi]) for mi, m in enumerate(mats)]
        alpha = statistics.median(alphas)
        rows.append(
            {
                "buffer_kb": f["buffer_kb"],
                "median_cct_s": {a: statistics.median(v) for a, v in med.items()},
                "cct_over_lower_bound": {
                    a: statistics.median(v / b for v, b in zip(med[a], bounds, strict=True))
                    for a in cfg["algorithms"]
                },
                "speedup_vs_plain": {
                    a: statistics.median(p / v for p, v in zip(med["plain"], med[a], strict=True))
                    for a in cfg["algorithms"]
                    if a != "plain"
                },
                "fitted_incast_alpha": alpha,
                "fitted_incast_alpha_per_matrix": alphas,
                "simulated_at_fitted_alpha_s": {
                    mode: statistics.median(
                        simulate_cct(
                            m, row_bytes, rate_eff, mode, alpha, q, overhead if mode == "phases" else 0.0
                        )
                        for m in mats
                    )
                    for mode in ("plain", "phases")
                },
            }
        )
    from flowlane.hermod.matching import plan_all_to_all

    phases = {
        alg: [len(plan_all_to_all(m, q, alg)) for m in mats] for alg in ("bvn", "bvn_bottleneck", "alg3")
    }
    return {
        "lower_bound_s": bounds,
        "goodput_fraction": goodput,
        "goodput_source": "given (--goodput)" if cfg.get("goodput") else "fitted on the deepest buffer",
        "phase_overhead_s": overhead,
        "phases_per_matrix": phases,
        "rows": rows,
    }


def _plot(doc: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = doc["summary"]["rows"]
    algs = doc["config"]["algorithms"]
    fig, ax = plt.subplots(figsize=(7, 3.6))
    w = 0.8 / (len(algs) + 1)
    for k, a in enumerate(algs):
        ax.bar(
            [i + k * w for i in range(len(rows))], [r["cct_over_lower_bound"][a] for r in rows], w, label=a
        )
    ax.bar(
        [i + len(algs) * w for i in range(len(rows))],
        [
            r["simulated_at_fitted_alpha_s"]["phases"] / statistics.median(doc["summary"]["lower_bound_s"])
            for r in rows
        ],
        w,
        label="bvn phases, calibrated simulator"
        if "bvn" in algs
        else "bvn phases, simulator (no per-phase cost: bvn not measured)",
        color="C7",
    )
    ax.set_xticks(
        [i + w * len(algs) / 2 for i in range(len(rows))],
        [f"{r['buffer_kb']:g} KiB buffer\nalpha {r['fitted_incast_alpha']:.2f}" for r in rows],
        fontsize=8,
    )
    ax.axhline(1.0, color="k", lw=0.5)
    ax.set_ylim(0, 1.35 * max(p.get_height() for p in ax.patches))  # room for the legend above the bars
    ax.set_ylabel("all-to-all time / lower bound")
    c = doc["config"]
    wmem = f", tcp_wmem max {int(c['tcp_wmem'].split()[2]) // 1024} KiB" if c.get("tcp_wmem") else ""
    ax.set_title(
        f"EP all-to-all, {c['ranks']} ranks, {c['rate_mbit']:g} Mbit/s, Zipf {c['skew']:g}{wmem} "
        f"(measured, emulated links)",
        fontsize=9,
    )
    ax.legend(fontsize=7, ncol=3, loc="upper center")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _floats(s: str, what: str) -> list[float]:
    try:
        v = [float(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"{what} must be comma-separated numbers, got {s!r}") from None
    if not v or any(not x > 0 for x in v):
        raise SystemExit(f"{what} must be numbers > 0, got {s!r}")
    return v


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--rate-mbit", type=float, default=100.0)
    ap.add_argument(
        "--buffers-kb",
        default="1024,128,64",
        help="switch port buffers to compare; the largest calibrates goodput (no incast)",
    )
    ap.add_argument("--matrices", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=1024, help="tokens per rank")
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--experts-per-rank", type=int, default=4)
    ap.add_argument(
        "--skew", type=float, default=0.5, help="Zipf exponent of expert popularity (the sim's default)"
    )
    ap.add_argument("--hidden", type=int, default=256, help="float32 values per token")
    ap.add_argument(
        "--quantum",
        type=int,
        default=1,
        help="tokens per planning unit of the phases (the Megatron plugin's --hermod-ep-quantum)",
    )
    ap.add_argument("--algorithms", default=",".join(ALGORITHMS))
    ap.add_argument(
        "--tcp-wmem",
        default="",
        help="the ranks' net.ipv4.tcp_wmem ('min default max' bytes; default: the host's): a small max "
        "bounds how far gloo's completed sends run ahead of the wire",
    )
    ap.add_argument(
        "--goodput",
        type=float,
        default=None,
        help="fraction of the link rate TCP delivers without incast, in (0, 1]; default: fitted on the "
        "deepest buffer's plain all-to-all. Give it (e.g. from a run with fewer ranks at the same "
        "rate) where even the deepest buffer loses to fan-in; with --summarise-only it replaces "
        "the stored setting",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--timeout-s", type=int, default=300, help="a rank that waits longer on a peer fails the run"
    )
    ap.add_argument("--out", default="results/hermod/intra_real/intra_real.json")
    ap.add_argument(
        "--summarise-only",
        action="store_true",
        help="measure nothing: recompute the summary and plot of --out from its stored times",
    )
    ap.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--master", help=argparse.SUPPRESS)
    ap.add_argument("--cfg-json", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker is not None:
        worker(a.worker, a.master, json.loads(a.cfg_json))
        return 0
    algorithms = [x for x in a.algorithms.split(",") if x]
    if (
        algorithms[:1] != ["plain"]
        or len(set(algorithms)) != len(algorithms)
        or any(x not in ALGORITHMS for x in algorithms)
    ):
        raise SystemExit(
            f"--algorithms must start with plain and name each of {list(ALGORITHMS)} at most once, "
            f"got {a.algorithms!r}"
        )
    for name in (
        "ranks",
        "matrices",
        "rounds",
        "tokens",
        "top_k",
        "experts_per_rank",
        "hidden",
        "quantum",
        "timeout_s",
    ):
        if getattr(a, name) < (3 if name == "ranks" else 1):
            raise SystemExit(
                f"--{name.replace('_', '-')} must be >= {3 if name == 'ranks' else 1} "
                f"(an EP group of two has no incast), got {getattr(a, name)}"
            )
    if not a.skew >= 0:
        raise SystemExit(f"--skew must be >= 0, got {a.skew}")
    if a.tcp_wmem and not re.fullmatch(r"[1-9]\d* [1-9]\d* [1-9]\d*", a.tcp_wmem):
        raise SystemExit(f"--tcp-wmem must be three byte counts 'min default max', got {a.tcp_wmem!r}")
    if a.goodput is not None and not 0 < a.goodput <= 1:
        raise SystemExit(f"--goodput must be a fraction of the link rate in (0, 1], got {a.goodput}")
    buffers = _floats(a.buffers_kb, "--buffers-kb")
    out = Path(a.out)
    if a.summarise_only:
        if not out.is_file():
            raise SystemExit(f"--summarise-only reads --out, and {out} does not exist")
        doc = json.loads(out.read_text())
        if a.goodput is not None:
            doc["config"]["goodput"] = a.goodput
        doc["summary"] = summarise(doc["config"], doc["fabrics"])
        _write(doc, out)
        return 0
    cfg = {
        "ranks": a.ranks,
        "rate_mbit": a.rate_mbit,
        "matrices": a.matrices,
        "rounds": a.rounds,
        "tokens": a.tokens,
        "top_k": a.top_k,
        "experts_per_rank": a.experts_per_rank,
        "skew": a.skew,
        "hidden": a.hidden,
        "quantum": a.quantum,
        "algorithms": algorithms,
        "seed": a.seed,
        "timeout_s": a.timeout_s,
        "tcp_wmem": a.tcp_wmem or None,
        "goodput": a.goodput,
    }
    try:
        check_available()
    except NetemError as e:
        print(e, file=sys.stderr)
        return 2
    from rich.progress import track

    t0 = time.time()
    fabrics = [run_fabric(cfg, b) for b in track(buffers, description="fabrics (one per switch buffer)")]
    doc = {
        "what": "EP all-to-all on an emulated star (measured on CPU with emulated links: gloo over real TCP in "
        "network namespaces, tc tbf); plain vs Hermod's incast-free phases; simulator calibrated to it",
        "config": cfg,
        "fabrics": fabrics,
        "summary": summarise(cfg, fabrics),
        "wall_s": time.time() - t0,
    }
    _write(doc, out)
    return 0


def _write(doc: dict[str, Any], out: Path) -> None:
    write_result(out, doc)  # atomic: never a half-written result
    _plot(doc, out.with_suffix(".png"))
    s = doc["summary"]
    print(
        f"goodput {s['goodput_fraction']:.3f} of the link rate, phase overhead {s['phase_overhead_s'] * 1e3:.2f} ms"
    )
    for r in s["rows"]:
        print(
            f"buffer {r['buffer_kb']:g} KiB: median CCT "
            + ", ".join(f"{k} {v:.3f}s" for k, v in r["median_cct_s"].items())
            + " | speedup vs plain "
            + ", ".join(f"{k} {v:.3f}x" for k, v in r["speedup_vs_plain"].items())
            + f" | fitted alpha {r['fitted_incast_alpha']:.3f}; calibrated sim: plain "
            f"{r['simulated_at_fitted_alpha_s']['plain']:.3f}s, phases "
            f"{r['simulated_at_fitted_alpha_s']['phases']:.3f}s"
        )
    print(f"wrote {out}")


if __name__ == "__main__":
    sys.exit(main())
