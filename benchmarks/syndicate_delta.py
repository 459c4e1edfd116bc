"""E4: the per-motif overhead delta on gloo (seed 004: "too fine-grained motifs are not desirable"; the paper gives
no value). Real gloo ranks on this host's loopback, **measured**, no emulated links.

An all-reduce of S bytes is run through the SYNDICATE enforcer cut into k segments (k = 1, 2, 4, ... 256), with 2
and 4 ranks, beside the plain ``torch.distributed.all_reduce`` (the framework's own path, k = 1); an all-to-all is
cut by segmentation and by splining. Results are checked against the plain collectives (all-to-all bitwise, float
all-reduce to rounding). ``fit_path_cost`` turns the all-reduce times into alpha, beta and delta; the smallest useful
motif is the segment size at which the fixed per-motif cost (delta + alpha * steps) is 10 % of the motif's time.

Run: .venv-llm/bin/python benchmarks/syndicate_delta.py [--reps 5]   -> results/syndicate/delta_gloo.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flowlane.syndicate.cost import Option, fit_path_cost  # noqa: E402
from flowlane.testing.provenance import write_result  # noqa: E402

KS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def worker(rank: int, world: int, sizes_mb: list[float], reps: int, store_path: str) -> dict:
    import torch
    import torch.distributed as dist

    from flowlane.syndicate.enforcer import Enforcer, EnforcerConfig
    from flowlane.syndicate.plan import PlanOp, SyndicatePlan

    store = dist.FileStore(store_path, world)
    enf = Enforcer({"F": None}, store, rank, world, EnforcerConfig(check_every=0))
    out: dict = {"all_reduce": [], "all_to_all": [], "equal": True}

    def timed(fn) -> float:
        ts = []
        for _ in range(reps):
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts)

    for mb in sizes_mb:
        n = int(mb * (1 << 20)) // 4 // world * world
        base = torch.randn(n, generator=torch.Generator().manual_seed(rank))
        ref = base.clone()
        dist.all_reduce(ref)
        plain = timed(lambda base=base: dist.all_reduce(base.clone()))
        row = {"mb": mb, "numel": n, "plain_s": plain, "k": {}}
        for k in KS:
            if k > n:
                continue
            plan = SyndicatePlan.fifo(
                [PlanOp("ar", "all_reduce", n, "float32", world, Option("F", "ring", k))], 1
            )
            enf.install(plan, verify=False)
            got = base.clone()

            def run(got=got, base=base) -> None:
                got.copy_(base)
                enf.all_reduce(got).wait()
                enf.step()

            row["k"][k] = timed(run)
            out["equal"] &= bool(torch.allclose(got, ref, rtol=1e-5, atol=1e-5))
        out["all_reduce"].append(row)
        x = torch.randn(n, generator=torch.Generator().manual_seed(10 + rank))
        ref_a = torch.empty_like(x)
        dist.all_to_all_single(ref_a, x)
        arow = {
            "mb": mb,
            "plain_s": timed(lambda x=x: dist.all_to_all_single(torch.empty_like(x), x)),
            "cuts": {},
        }
        for label, opt in (
            ("S1", Option("F", "direct")),
            ("S4", Option("F", "direct", 4)),
            ("S16", Option("F", "direct", 16)),
            (f"P{world}", Option("F", "direct", 1, world)),
            (f"S4P{world}", Option("F", "direct", 4, world)),
        ):
            enf.install(
                SyndicatePlan.fifo([PlanOp("a2a", "all_to_all", n, "float32", world, opt)], 1), verify=False
            )
            got = torch.empty_like(x)

            def run_a(got=got, x=x) -> None:
                enf.all_to_all_single(got, x).wait()
                enf.step()

            arow["cuts"][label] = timed(run_a)
            out["equal"] &= torch.equal(got, ref_a)
        out["all_to_all"].append(arow)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--sizes-mb", type=float, nargs="+", default=[1.0, 16.0])
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--out", default="results/syndicate/delta_gloo.json")
    a = ap.parse_args()
    from flowlane import launch as L

    runs = {}
    samples = []
    for world in a.worlds:
        with tempfile.TemporaryDirectory() as d:
            res = L.launch(worker, world, args=(a.sizes_mb, a.reps, str(Path(d) / "store")), timeout=600)
        r0 = res[0]
        r0["equal_all_ranks"] = all(r["equal"] for r in res)
        runs[world] = r0
        for row in r0["all_reduce"]:
            wire = 2 * (world - 1) / world * row["numel"] * 4
            for k, t in row["k"].items():
                samples.append((int(k), 2 * (world - 1), wire, t))
        print(
            f"world {world}: equal={r0['equal_all_ranks']}",
            {row["mb"]: {k: round(v * 1e3, 2) for k, v in row["k"].items()} for row in r0["all_reduce"]},
            flush=True,
        )
    fit = fit_path_cost(samples)
    min_motif = {}
    for world in a.worlds:
        fixed = fit.delta + fit.alpha * 2 * (world - 1)
        per_byte = fit.beta * 2 * (world - 1) / world
        min_motif[world] = 9 * fixed / per_byte if per_byte > 0 else None  # fixed part = 10 % of the motif
    doc = {
        "label": "measured (gloo, loopback, this host's CPUs; no emulated links)",
        "runs": {str(w): r for w, r in runs.items()},
        "fit": {
            "alpha_s": fit.alpha,
            "beta_s_per_byte": fit.beta,
            "delta_s": fit.delta,
            "bandwidth_GBps": 1 / fit.beta / 1e9 if fit.beta else None,
        },
        "min_useful_motif_bytes": {str(w): v for w, v in min_motif.items()},
        "enforcer_overhead_k1_vs_plain": {
            str(w): {str(row["mb"]): row["k"][1] / row["plain_s"] - 1 for row in r["all_reduce"]}
            for w, r in runs.items()
        },
    }
    print("fit:", doc["fit"], "min useful motif bytes:", doc["min_useful_motif_bytes"])
    print("wrote", write_result(a.out, doc))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
