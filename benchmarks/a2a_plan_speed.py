"""Planning speed of Hermod's matched all-to-all (issue 30 item 5): how long ``plan_all_to_all`` takes per call on
realistic MoE dispatch matrices, pure Python vs the compiled planner (flowlane/hermod/bvn.c) vs one rank's part
(``plan_for_rank``, what the runtime plans per call) vs a plan-cache hit,
at EP 8/16/32/64, with the phase counts. Goal: <= 1 ms per all-to-all at EP 32.

Matrices: ``flowlane.sim.workloads.zipf_token_matrix`` (each rank routes ``--tokens`` x ``--top-k`` token copies to
``--experts-per-rank`` x EP experts with Zipf(``--skew``) popularity). Times are wall-clock per call (median and
p99 over every call), measured on this machine with whatever else runs on it; the compiled and Python planners are
checked to give identical phases on every matrix timed with both. The cache rows time a hit (the same quantised
matrix planned before); ``stream`` rows report the hit rate of a fresh matrix per call at each quantum.

    .venv-llm/bin/python benchmarks/a2a_plan_speed.py [--eps 8,16,32,64] [--matrices 5] [--reps 5]
        [--python-reps 1] [--python-max-ep 32] [--algorithms bvn,bvn_bottleneck] [--out results/hermod/plan_speed]
"""

from __future__ import annotations

import argparse
import platform
import socket
import time
from pathlib import Path

import numpy as np

from flowlane.hermod import matching as M
from flowlane.sim.workloads import zipf_token_matrix
from flowlane.testing.provenance import write_result


def _stats(ts: list[float]) -> dict[str, float]:
    a = np.array(ts) * 1e3
    return {
        "median_ms": float(np.median(a)),
        "p99_ms": float(np.percentile(a, 99)),
        "min_ms": float(a.min()),
        "calls": len(ts),
    }


def _time(fn, reps: int) -> tuple[list[float], object]:
    ts, out = [], None
    for _ in range(reps):
        t0 = time.perf_counter()
        out = fn()
        ts.append(time.perf_counter() - t0)
    return ts, out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--eps", default="8,16,32,64")
    ap.add_argument("--matrices", type=int, default=5, help="Zipf matrices per EP size")
    ap.add_argument("--reps", type=int, default=5, help="timed calls per matrix (compiled, cached)")
    ap.add_argument("--python-reps", type=int, default=1, help="timed calls per matrix, pure Python")
    ap.add_argument(
        "--python-max-ep", type=int, default=32, help="time pure Python only up to this EP (slow)"
    )
    ap.add_argument("--python-matrices", type=int, default=2, help="matrices timed in pure Python per EP")
    ap.add_argument("--algorithms", default="bvn,bvn_bottleneck")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--experts-per-rank", type=int, default=4)
    ap.add_argument("--skew", type=float, default=1.0)
    ap.add_argument("--stream-quanta", default="1,64,512", help="quanta for the cache hit-rate stream")
    ap.add_argument("--stream-calls", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--max-phases",
        type=int,
        default=0,
        help="cap every plan at this many phases (0: none); rows then report the residual share",
    )
    ap.add_argument("--out", default="results/hermod/plan_speed")
    a = ap.parse_args()
    impl = M.planner_impl()
    if impl != "c":
        print("warning: the compiled planner is unavailable here; 'compiled' rows run the Python fallback")
    rows, streams = [], []
    for ep in [int(x) for x in a.eps.split(",")]:
        rng = np.random.default_rng(a.seed + ep)
        mats = [
            zipf_token_matrix(rng, ep, a.experts_per_rank * ep, a.tokens, a.top_k, a.skew).tolist()
            for _ in range(a.matrices)
        ]
        for alg in a.algorithms.split(","):
            t_c, t_py, t_hit, t_rank, phases, sends, totals, residual = [], [], [], [], [], [], [], []
            lb = [M.lower_bound(m) for m in mats]
            for k, m in enumerate(mats):
                ts, ph = _time(
                    lambda m=m, alg=alg: M.plan_all_to_all(m, 1, alg, cache=False, max_phases=a.max_phases),
                    a.reps,
                )
                t_c += ts
                # what the runtime plans per call (flowlane.sched.alltoall): one rank's part, no Phase objects
                me = k % ep
                ts, rp = _time(
                    lambda m=m, alg=alg, me=me: M.plan_for_rank(
                        m, me, 1, alg, cache=False, max_phases=a.max_phases
                    ),
                    a.reps,
                )
                t_rank += ts
                mine = [(i, d, u) for i, p in enumerate(ph) for s_, d, u in p.sends if s_ == me]
                if list(zip(rp.send_phase, rp.send_peer, rp.send_units, strict=True)) != mine:
                    raise SystemExit(
                        f"EP {ep} {alg} matrix {k}: rank {me}'s plan differs from the whole plan"
                    )
                phases.append(len(ph))
                sends.append(sum(len(p.sends) for p in ph))
                totals.append(M.phases_total(ph))
                units = sum(a_ for p in ph for _, _, a_ in p.sends)
                residual.append(sum(a_ for p in ph if p.residual for _, _, a_ in p.sends) / max(1, units))
                M.plan_cache_clear()
                M.plan_all_to_all(m, 1, alg, max_phases=a.max_phases)  # miss: fills the cache
                t_hit += _time(
                    lambda m=m, alg=alg: M.plan_all_to_all(m, 1, alg, max_phases=a.max_phases), a.reps
                )[0]
                assert M.plan_cache_info()["hits"] == a.reps
                if ep <= a.python_max_ep and k < a.python_matrices:
                    ts, ref = _time(
                        lambda m=m, alg=alg: M.plan_all_to_all(
                            m, 1, alg, impl="python", cache=False, max_phases=a.max_phases
                        ),
                        a.python_reps,
                    )
                    t_py += ts
                    if ref != ph:
                        raise SystemExit(f"EP {ep} {alg} matrix {k}: compiled and Python plans differ")
            row = {
                "ep": ep,
                "algorithm": alg,
                "matrices": len(mats),
                "phases": phases,
                "sends": sends,
                "phases_median": float(np.median(phases)),
                "total_units": totals,
                "lower_bound_units": lb,
                "max_phases": a.max_phases,
                "residual_unit_share": residual,
                "compiled": _stats(t_c),
                "rank_plan": _stats(t_rank),
                "cached_hit": _stats(t_hit),
                "python": _stats(t_py) if t_py else None,
                "python_equal_to_compiled_on": min(a.python_matrices, len(mats)) if t_py else 0,
            }
            if t_py:
                row["speedup_compiled_vs_python"] = row["python"]["median_ms"] / row["compiled"]["median_ms"]
            rows.append(row)
            py = f"{row['python']['median_ms']:9.2f}" if t_py else "        -"
            print(
                f"EP {ep:3d} {alg:15s} phases {row['phases_median']:7.0f}  python {py} ms  compiled "
                f"{row['compiled']['median_ms']:8.3f} (p99 {row['compiled']['p99_ms']:8.3f}) ms  rank "
                f"{row['rank_plan']['median_ms']:7.3f} (p99 {row['rank_plan']['p99_ms']:7.3f}) ms  cached "
                f"{row['cached_hit']['median_ms']:7.4f} (p99 {row['cached_hit']['p99_ms']:7.4f}) ms"
                + (
                    f"  residual {100 * float(np.median(residual)):.1f} % of units, total/L "
                    f"{float(np.median([t / max(1, b) for t, b in zip(totals, lb, strict=True)])):.3f}"
                    if a.max_phases
                    else ""
                ),
                flush=True,
            )
        # cache hit rate on a stream of fresh matrices (one MoE call each), per planning quantum
        for q in [int(x) for x in a.stream_quanta.split(",")]:
            M.plan_cache_clear()
            srng = np.random.default_rng(a.seed + 1000 + ep)
            for _ in range(a.stream_calls):
                m = zipf_token_matrix(srng, ep, a.experts_per_rank * ep, a.tokens, a.top_k, a.skew).tolist()
                M.plan_all_to_all(m, q, "bvn")
            info = M.plan_cache_info()
            streams.append(
                {
                    "ep": ep,
                    "quantum": q,
                    "calls": a.stream_calls,
                    "hits": info["hits"],
                    "misses": info["misses"],
                }
            )
            print(f"EP {ep:3d} stream quantum {q:4d}: {info['hits']}/{a.stream_calls} cache hits", flush=True)
    M.plan_cache_clear()
    goal = [r for r in rows if r["ep"] == 32]
    out = {
        "label": "measured",
        "host": socket.gethostname(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "planner_impl": impl,
        "workload": {
            "generator": "flowlane.sim.workloads.zipf_token_matrix",
            "tokens": a.tokens,
            "top_k": a.top_k,
            "experts_per_rank": a.experts_per_rank,
            "skew": a.skew,
            "seed": a.seed,
        },
        "note": "wall-clock ms per call on a shared machine (other load present); 'compiled': plan_all_to_all, "
        "validation and building every Phase object included; 'rank_plan': plan_for_rank, one rank's part (what "
        "the runtime plans per all-to-all; the compiled planner plus array cuts, no cache); 'cached_hit': a "
        "plan_all_to_all plan-cache hit",
        "goal": {
            "ep": 32,
            "limit_ms": 1.0,
            "compiled_median_ms": {r["algorithm"]: r["compiled"]["median_ms"] for r in goal},
            "rank_plan_median_ms": {r["algorithm"]: r["rank_plan"]["median_ms"] for r in goal},
            "cached_hit_median_ms": {r["algorithm"]: r["cached_hit"]["median_ms"] for r in goal},
        },
        "rows": rows,
        "cache_stream": streams,
    }
    od = Path(a.out)
    write_result(od / "plan_speed.json", out)  # command and commit: the provenance envelope
    print(f"wrote {od / 'plan_speed.json'}")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError:
        return
    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    for alg, ls in zip(a.algorithms.split(","), ("-", "--", ":"), strict=False):
        rs = [r for r in rows if r["algorithm"] == alg]
        eps = [r["ep"] for r in rs]
        for key, c in (("python", "C3"), ("compiled", "C0"), ("rank_plan", "C1"), ("cached_hit", "C2")):
            pts = [(r["ep"], r[key]["median_ms"]) for r in rs if r.get(key)]
            if pts:
                ax[0].plot(
                    [p[0] for p in pts], [p[1] for p in pts], ls, color=c, marker="o", label=f"{key} ({alg})"
                )
        ax[1].plot(eps, [r["phases_median"] for r in rs], ls, marker="o", label=alg)
    ax[0].axhline(1.0, color="k", lw=0.8, ls=":", label="goal 1 ms")
    ax[0].set(
        xscale="log",
        yscale="log",
        xlabel="EP group size",
        ylabel="ms per plan (median)",
        title="all-to-all planning time (measured)",
    )
    ax[0].set_xticks(sorted({r["ep"] for r in rows}), [str(e) for e in sorted({r["ep"] for r in rows})])
    ax[1].set(
        xscale="log", yscale="log", xlabel="EP group size", ylabel="phases (median)", title="phase count"
    )
    ax[1].set_xticks(sorted({r["ep"] for r in rows}), [str(e) for e in sorted({r["ep"] for r in rows})])
    for x in ax:
        x.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax[0].legend(fontsize=7)
    ax[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(od / "plan_speed.png", dpi=110)
    print(f"wrote {od / 'plan_speed.png'}")


if __name__ == "__main__":
    main()
