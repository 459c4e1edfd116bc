"""ALEPH E10 (digest §4.4 row E10, §5.1 #13): re-planning under changing link rates (MEASURED, emulated links).

A DDP job (a 3-layer MLP, ~2 MiB of gradients in ~0.5-1 MiB buckets, SGD) on --workers gloo ranks, each in its own
network namespace (flowlane.testing.netem.EmulatedNetwork, prefix ``e10``: tbf on both directions of each access
link, a bridge as the switch). No dedicated PS: with ``top="ps"`` the root is the plan's
:func:`flowlane.aleph.model.ps_head` under the probed figures (the head with the most spare bandwidth; tier 0, digest
§5.4), at start-up (the frozen run keeps that one) as after each re-plan (ReplanningAllReduce). Between iterations, at the --change points, rank 0 changes the tbf rates with ``tc qdisc change``
(all ranks wait at a barrier around it, so the change falls between the same two iterations in every mode). Default
schedule, Mbit/s, b fixed at 75 (capacity g = floor(B/b - 1), class = g rounded up to a power of two, Eq. 3;
the probe read 400-500 Mbit/s links as 315-404 on this loaded host, which b = 75 keeps inside class 4, [300, 450)):

- start ``400,400,100,100,100,100``: g = 4,4,0,0,0,0 (3 or 4 as probed), classes 4,4,0,0,0,0; M-WCHA fill makes
  worker 1 an aggregator (with worker 0 as the other head, with or without a member; the root is ps_head's pick);
- before iteration 10, workers 3 and 4 go to 135 (+35 %, beyond the 20 % hysteresis, but g stays 0: a change
  *within* a power-of-two class, where the digest expects no plan change);
- before iteration 21, worker 1 goes to 100 and worker 2 to 400 (the busiest aggregator becomes slow, a slow worker
  fast): classes 4,4,0 -> 4,0,4, and the plan in force is infeasible (worker 1 aggregates, with capacity 0).

With K = 4 the re-planning points fall after iterations 3, 7, 11, ..., so each change runs 2-3 iterations on the
plan made before it.

Three runs of the same job (same seed, data and schedule), each on a fresh network:

- ``replan``: ALEPH's DDP hook (flowlane.aleph.hook.aleph_comm_hook) with a ReplanningAllReduce: the start-up plan
  from a real probe (flowlane.aleph.probe.probe_bandwidth, timed transfers, all-gathered) and, after every
  --replan-every-th iteration's last bucket, a fresh probe and the Replanner (hysteresis; a new plan swaps in);
  with --samples 2 (default, as install_aleph_hook's default probe) a probe that moves a worker is confirmed by a
  second one, the best reading per worker kept (flowlane.aleph.replan.confirm_figures); --samples 1: one probe;
- ``frozen``: the same start-up probe and plan, never re-planned;
- ``ring``: gloo's all_reduce of each bucket (a ring for these sizes).

Every bucket's reduction is timed inside a comm hook that wraps the library's (the re-planning step is timed on its
own: probe and planning), so an iteration's communication time excludes compute; the per-iteration figure is the
slowest rank's. The hooks run synchronously (ALEPH's tier 0 does; the ring hook does too, for a like comparison).
The final parameters of the three runs are compared (ALEPH sums in another order: within 1e-5, not bitwise).

Run (root): .venv-llm/bin/python benchmarks/aleph_replan.py  -> results/aleph/e10_replan.json (+ .png)
Without root/iproute2 it prints why and exits 0 (nothing measured).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from flowlane.aleph import AlephConfig  # noqa: E402
from flowlane.aleph.cluster import capacities  # noqa: E402
from flowlane.testing.provenance import write_result  # noqa: E402

PORT = 29563
MODES = ("replan", "frozen", "ring")
LABEL = "measured, emulated links (netns + tbf, gloo over TCP, CPU)"


def rounded(g: int) -> int:
    """Eq. 3's capacity class: the smallest power of two >= g (0 stays 0)."""
    return 0 if g <= 0 else 1 << (g - 1).bit_length()


def parse_changes(text: str, n: int) -> dict[int, dict[int, float]]:
    """'12:0=500,1=500;27:0=100,2=500' -> {12: {0: 500, 1: 500}, 27: {...}}; bad input names the piece."""
    out: dict[int, dict[int, float]] = {}
    for part in filter(None, text.split(";")):
        try:
            it, rest = part.split(":")
            rates = {int(w): float(r) for w, r in (kv.split("=") for kv in rest.split(","))}
        except ValueError as e:
            raise SystemExit(
                f"--changes piece {part!r}: expected ITER:WORKER=MBIT[,WORKER=MBIT...] ({e})"
            ) from e
        if int(it) < 1 or any(not 0 <= w < n or not r > 0 for w, r in rates.items()):
            raise SystemExit(f"--changes piece {part!r}: iteration >= 1, workers in 0..{n - 1}, rates > 0")
        out[int(it)] = rates
    return out


def set_rate(cfg: dict, worker: int, mbit: float) -> None:
    """``tc qdisc change`` both directions of ``worker``'s access link (its eth0 and the switch port towards it),
    keeping netem's bucket rule (at least burst_kb, at least 1 ms of traffic)."""
    from flowlane.testing.netem import _burst, _mbit

    for ns, dev in ((cfg["ns"][worker], cfg["ifname"]), (cfg["switch_ns"], f"p{worker}")):
        cmd = ["ip", "netns", "exec", ns, "tc", "qdisc", "change", "dev", dev, "root", "handle", "1:", "tbf"]
        cmd += [
            "rate",
            _mbit(mbit),
            "burst",
            _burst(mbit, cfg["burst_kb"]),
            "latency",
            f"{cfg['latency_ms']:g}ms",
        ]
        subprocess.run(cmd, check=True, capture_output=True, timeout=30)


def worker(rank: int, world: int, master: str, cfg_path: str) -> None:
    import torch
    import torch.distributed as dist

    from flowlane.aleph import Replanner
    from flowlane.aleph.hook import HierarchicalAllReduce, ReplanningAllReduce, aleph_comm_hook
    from flowlane.aleph.model import ps_head
    from flowlane.aleph.probe import probe_bandwidth
    from flowlane.aleph.replan import confirm_figures

    cfg = json.loads(Path(cfg_path).read_text())
    mode = cfg["mode"]
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://{master}:{PORT}", rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=300),
    )  # fmt: skip
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512), torch.nn.ReLU(),
        torch.nn.Linear(512, 256),
    )  # fmt: skip
    model = torch.nn.parallel.DistributedDataParallel(net, bucket_cap_mb=cfg["bucket_mb"])
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(100 + rank)
    xb, yb = torch.randn(32, 256, generator=g), torch.randn(32, 256, generator=g)

    rec: dict = {"comm": [0.0], "replan": [], "buckets": 0}
    probe_nbytes = cfg["probe_kb"] << 10

    def probe(replanner: Replanner | None = None) -> list[float]:
        """Gbit/s per rank, as the Replanner takes them, timed on its own. With a replanner and --samples 2 (the
        default, as install_aleph_hook's default probe): a second probe where the first moves a worker, the best
        reading per worker kept (flowlane.aleph.replan.confirm_figures); --samples 1: the first reading only."""
        t0, seen = time.perf_counter(), []

        def sample() -> list[float]:
            seen.append(probe_bandwidth(nbytes=probe_nbytes)[0])
            return seen[-1]

        fig = sample() if replanner is None else confirm_figures(sample, replanner, cfg["samples"])
        rec["replan"].append({
            "probe_s": time.perf_counter() - t0, "figures_mbit": [f * 1e3 for f in fig],
            "samples_mbit": [[round(f * 1e3, 1) for f in x] for x in seen],
        })  # fmt: skip
        return fig

    class Timed(ReplanningAllReduce):
        def end_iteration(self) -> None:
            t0 = time.perf_counter()
            n0 = len(rec["replan"])
            super().end_iteration()
            if len(rec["replan"]) > n0:  # a re-planning point: probe + Replanner.observe (+ a new hierarchy)
                r = rec["replan"][-1]
                r["total_s"] = time.perf_counter() - t0
                r["plan_s"] = r["total_s"] - r["probe_s"]
                r["iteration"] = self.iteration
                r["in_use_mbit"] = [b * 1e3 for b in self.replanner.bandwidth]
                r["decision"] = list(self.decisions[-1])
                r["plan"] = [list(c.members) for c in self.har.plan.clusters]
                r["root"] = self.har.ps[0]

    state: object = None
    startup: dict = {}
    if mode != "ring":
        fig = probe()
        startup = rec["replan"].pop()
        replanner = Replanner(
            fig, AlephConfig(b_gbps=cfg["b_mbit"] / 1e3, replan_every=cfg["replan_every"], top="ps")
        )
        startup["plan"] = [list(c.members) for c in replanner.plan.clusters]
        # the PS where a re-plan puts it (ReplanningAllReduce: ps_head under the figures in use), frozen run too
        har = HierarchicalAllReduce(
            replanner.plan,
            None,
            "ps",
            cfg["chunk_kb"] << 10,
            ps=(ps_head(replanner.plan, replanner.bandwidth),),
        )
        startup["root"] = har.ps[0]
        state = Timed(har, replanner, lambda: probe(replanner)) if mode == "replan" else har

    def hook(st: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        t0 = time.perf_counter()
        n0 = len(rec["replan"])
        if mode == "ring":
            buf = bucket.buffer()
            buf.mul_(1.0 / world)  # as DDP's reducer and ALEPH's hook: scale first
            dist.all_reduce(buf)
            fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
            fut.set_result(buf)
        else:
            fut = aleph_comm_hook(st, bucket)  # type: ignore[arg-type]
        dt = time.perf_counter() - t0
        if len(rec["replan"]) > n0:
            dt -= rec["replan"][-1]["total_s"]  # the re-planning step is counted on its own
        rec["comm"][-1] += dt
        return fut

    # DDP checks the annotations themselves (this module's are strings: ``from __future__ import annotations``)
    hook.__annotations__ = {"bucket": dist.GradBucket, "return": torch.futures.Future[torch.Tensor]}
    model.register_comm_hook(state, hook)
    changes = {int(k): v for k, v in cfg["changes"].items()}
    iters: list[dict] = []
    for it in range(cfg["iters"]):
        if it in changes:
            dist.barrier()
            if rank == 0:
                t0 = time.perf_counter()
                for w, r in changes[it].items():
                    set_rate(cfg, int(w), r)
                print(
                    f"iteration {it}: rates {changes[it]} set in {time.perf_counter() - t0:.3f} s", flush=True
                )
            dist.barrier()
        t0 = time.perf_counter()
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(xb), yb)
        loss.backward()
        opt.step()
        iters.append({"wall_s": time.perf_counter() - t0, "comm_s": rec["comm"][-1], "loss": float(loss)})
        rec["comm"].append(0.0)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    res = {
        "rank": rank,
        "iters": iters,
        "replan": rec["replan"],
        "startup": startup,
        "cpu_s": time.process_time(),
        "params": flat.tolist() if rank == 0 else None,
    }
    gathered: list = [None] * world
    dist.all_gather_object(gathered, res)
    if rank == 0:
        Path(cfg["out"]).write_text(json.dumps(gathered))
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)  # gloo teardown can hang once rank 0 (the store) is gone; everything is written


def run_mode(mode: str, a: argparse.Namespace, start: list[float], changes: dict) -> list[dict]:
    from flowlane.testing.netem import EmulatedNetwork

    tmp = Path(a.out).with_name(f".e10_{mode}.{os.getpid()}")
    with EmulatedNetwork(
        len(start), rate_mbit=start, burst_kb=a.burst_kb, tbf_latency_ms=a.latency_ms, prefix="e10",
        subnet="10.214.10.0/24",
    ) as net:  # fmt: skip
        cfg = {
            "mode": mode, "iters": a.iters, "replan_every": a.replan_every, "b_mbit": a.b_mbit,
            "probe_kb": a.probe_kb, "samples": a.samples, "chunk_kb": a.chunk_kb, "bucket_mb": a.bucket_mb, "changes": changes,
            "ns": net.ns, "switch_ns": net.switch_ns, "ifname": net.ifname, "burst_kb": a.burst_kb,
            "latency_ms": a.latency_ms, "out": str(tmp.with_suffix(".json")),
        }  # fmt: skip
        cfg_path = tmp.with_suffix(".cfg")
        cfg_path.write_text(json.dumps(cfg))
        try:
            argv = [sys.executable, str(Path(__file__).resolve()), "--worker"]
            argvs = [[*argv, str(r), str(len(start)), net.ips[0], str(cfg_path)] for r in range(len(start))]
            env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
            net.run_ranks(argvs, timeout_s=a.timeout, env=env, cwd=str(ROOT))
            ranks = sorted(json.loads(Path(cfg["out"]).read_text()), key=lambda q: q["rank"])
        finally:
            cfg_path.unlink(missing_ok=True)
            Path(cfg["out"]).unlink(missing_ok=True)
    return ranks


def classes(mbit: list[float], b_mbit: float) -> tuple[list[int], list[int]]:
    g = capacities([m / 1e3 for m in mbit], b_mbit / 1e3)
    return g, [rounded(x) for x in g]


def summarize(a: argparse.Namespace, start: list[float], changes: dict, runs: dict[str, list[dict]]) -> dict:
    n_it = a.iters
    bounds = [0, *sorted(changes), n_it]
    phases = [(bounds[i], bounds[i + 1]) for i in range(len(bounds) - 1)]
    per_iter = {
        m: [max(r["iters"][i]["comm_s"] for r in ranks) for i in range(n_it)] for m, ranks in runs.items()
    }
    nominal = [list(start)]
    for it in sorted(changes):
        nxt = list(nominal[-1])
        for w, r in changes[it].items():
            nxt[int(w)] = r
        nominal.append(nxt)
    doc_phases = []
    points = [p["iteration"] for p in runs["replan"][0]["replan"]] if "replan" in runs else []
    for k, (lo, hi) in enumerate(phases):
        # "settled": from the first re-planning point inside the phase on (the plan in force has seen the new rates)
        first = next((p for p in points if lo < p <= hi), None)
        ph: dict = {
            "iterations": [lo, hi],
            "nominal_mbit": nominal[k],
            "g": classes(nominal[k], a.b_mbit)[0],
            "class": classes(nominal[k], a.b_mbit)[1],
            "median_comm_s": {m: statistics.median(v[lo:hi]) for m, v in per_iter.items()},
        }
        if first is not None and first < hi:
            ph["settled_from"] = first
            ph["median_comm_s_settled"] = {m: statistics.median(v[first:hi]) for m, v in per_iter.items()}
            ph["median_comm_s_before_replan"] = {
                m: statistics.median(v[lo:first]) for m, v in per_iter.items()
            }
        doc_phases.append(ph)
    wall = {
        m: [max(r["iters"][i]["wall_s"] for r in ranks) for i in range(n_it)] for m, ranks in runs.items()
    }
    doc: dict = {"phases": doc_phases, "per_iteration_comm_s": per_iter, "per_iteration_wall_s": wall}
    if "replan" in runs:
        r0 = runs["replan"]
        ranks_agree = all(
            [(p["decision"], p["plan"]) for p in r["replan"]]
            == [(p["decision"], p["plan"]) for p in r0[0]["replan"]]
            for r in r0
        )
        pts = []
        plan_before = r0[0]["startup"]["plan"]
        in_use_before = r0[0]["startup"]["figures_mbit"]
        for i, p in enumerate(r0[0]["replan"]):
            cost = max(r["replan"][i]["total_s"] for r in r0)
            g0, c0 = classes(in_use_before, a.b_mbit)
            g1, c1 = classes(p["in_use_mbit"], a.b_mbit)
            changed = bool(p["decision"][1])
            pts.append({
                "iteration": p["iteration"],
                "probe_s_max_rank": max(r["replan"][i]["probe_s"] for r in r0),
                "plan_s_max_rank": max(r["replan"][i]["plan_s"] for r in r0),
                "total_s_max_rank": cost,
                "probed_mbit": [round(x, 1) for x in p["figures_mbit"]],
                "probe_samples_mbit": p["samples_mbit"],
                "in_use_mbit": [round(x, 1) for x in p["in_use_mbit"]],
                "g_before_after": [g0, g1],
                "class_before_after": [c0, c1],
                "class_changed": c0 != c1,
                "plan_changed": changed,
                "reason": p["decision"][2],
                "plan": p["plan"],
                "root": p["root"],
                "plan_changed_from": plan_before if changed else None,
            })  # fmt: skip
            plan_before, in_use_before = p["plan"], p["in_use_mbit"]
        totals = [q["total_s_max_rank"] for q in pts]
        n = len(start)
        doc["replan"] = {
            "every": a.replan_every,
            "startup": {
                "probed_mbit": [round(x, 1) for x in r0[0]["startup"]["figures_mbit"]],
                "plan": r0[0]["startup"]["plan"],
                "root": r0[0]["startup"]["root"],
                "probe_s_max_rank": max(r["startup"]["probe_s"] for r in r0),
            },  # fmt: skip
            "points": pts,
            "ranks_agree": ranks_agree,
            "cost_s": {"max": max(totals), "median": statistics.median(totals)},
            # the probe's n-1 rotation rounds each move probe_kb over a flow no faster than the slowest link
            "probe_floor_s": (n - 1) * a.probe_kb * 1024 * 8 / (min(min(x) for x in nominal) * 1e6),
            "amortized_share": sum(totals) / (sum(per_iter["replan"]) + sum(totals)),
        }
        doc["claims"] = {
            "bounded_replan_time": {
                "what": "every re-planning point costs at most a few probe rounds (probe + planning), not growing",
                "max_s": max(totals),
                "max_over_median_iteration_comm": max(totals) / statistics.median(per_iter["replan"]),
            },
            "plan_changes_only_when_classes_change": {
                "what": "every plan change coincides with a capacity-class (power of two) change in the figures in use",
                "held": all(q["class_changed"] for q in pts if q["plan_changed"]),
                "plan_changes": [q["iteration"] for q in pts if q["plan_changed"]],
                "class_changes": [q["iteration"] for q in pts if q["class_changed"]],
                "figures_moved_within_class_without_plan_change": [
                    q["iteration"] for j, q in enumerate(pts)
                    if q["in_use_mbit"] != (pts[j - 1]["in_use_mbit"] if j else doc["replan"]["startup"]["probed_mbit"])
                    and not q["class_changed"] and not q["plan_changed"]
                ],
            },
        }  # fmt: skip
    base = runs.get("ring", next(iter(runs.values())))[0]["params"]
    doc["final_params_max_abs_diff_vs_ring"] = {
        m: max(abs(x - y) for x, y in zip(r[0]["params"], base, strict=True)) for m, r in runs.items()
    }
    doc["cpu_s_per_rank"] = {m: [round(r["cpu_s"], 1) for r in ranks] for m, ranks in runs.items()}
    return doc


def plot(png: str, doc: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.6))
    colours = {"replan": "tab:blue", "frozen": "tab:orange", "ring": "tab:purple"}  # red: re-planning marks
    for m, v in doc["per_iteration_comm_s"].items():
        ax.plot(range(len(v)), v, ".-", ms=4, lw=1, label=m, color=colours.get(m))
    pts = doc.get("replan", {}).get("points", [])
    if pts:
        ax.plot([p["iteration"] - 0.5 for p in pts], [p["total_s_max_rank"] for p in pts], "D", color="tab:red",
                ms=4, label="re-plan cost (probe + plan), s")  # fmt: skip
    ax.set_ylim(bottom=0)
    for ph in doc["phases"][1:]:
        x = ph["iterations"][0] - 0.5
        ax.axvline(x, color="k", ls="--", lw=0.8)
        ax.text(x, ax.get_ylim()[1] * 0.97, f" rates {','.join(f'{r:g}' for r in ph['nominal_mbit'])}",
                fontsize=7, va="top")  # fmt: skip
    for p in doc.get("replan", {}).get("points", []):
        x = p["iteration"] - 0.5  # after the iteration's last bucket
        ax.axvline(x, color="tab:red" if p["plan_changed"] else "0.8", lw=2 if p["plan_changed"] else 0.8)
        if p["plan_changed"]:
            ax.text(x, ax.get_ylim()[1] * 0.75, f" re-plan\n {p['total_s_max_rank']:.2f} s\n |D| {len(p['plan'])}",
                    fontsize=7, color="tab:red", va="top")  # fmt: skip
    ax.set_xlabel("iteration (grey: re-planning point, red: plan changed; dashed: tbf rates changed)")
    ax.set_ylabel("comm s / iteration (slowest rank)")
    ax.set_title(f"ALEPH E10: re-planning under changing link rates ({LABEL})", fontsize=9)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(0.0, 0.9))
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--rates", default="400,400,100,100,100,100", help="start-up access rates, Mbit/s per worker"
    )
    ap.add_argument("--changes", default="10:3=135,4=135;21:1=100,2=400", help="ITER:WORKER=MBIT,...;...")
    ap.add_argument("--iters", type=int, default=32)
    ap.add_argument("--replan-every", type=int, default=4)
    ap.add_argument(
        "--b-mbit", type=float, default=75.0, help="b, the rate one aggregation flow needs (fixed)"
    )
    ap.add_argument("--probe-kb", type=int, default=1024)
    ap.add_argument(
        "--samples",
        type=int,
        default=2,
        help="probes per re-planning point at most (confirm_figures); 1: one",
    )
    ap.add_argument("--chunk-kb", type=int, default=256)
    ap.add_argument("--bucket-mb", type=float, default=0.75)
    ap.add_argument("--burst-kb", type=float, default=64.0)
    ap.add_argument("--latency-ms", type=float, default=100.0)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--out", default=str(ROOT / "results" / "aleph" / "e10_replan.json"))
    ap.add_argument("--worker", nargs=4, metavar=("RANK", "WORLD", "MASTER", "CFG"))
    a = ap.parse_args()
    if a.worker:
        r, w, m, c = a.worker
        worker(int(r), int(w), m, c)
        return
    from flowlane.testing.netem import NetemError, unavailable_reason

    why = unavailable_reason()
    if why:
        print(f"not measured: {why}")
        return
    start = [float(x) for x in a.rates.split(",")]
    changes = parse_changes(a.changes, len(start))
    modes = a.modes.split(",")
    if not modes or any(m not in MODES for m in modes):
        raise SystemExit(f"--modes {a.modes!r}: a comma list of {MODES}")
    if a.iters <= max(changes, default=0):
        raise SystemExit(f"--iters {a.iters} must exceed the last change point {max(changes)}")
    t0, load0 = time.perf_counter(), os.getloadavg()[0]
    runs: dict[str, list[dict]] = {}
    for mode in modes:
        t1 = time.perf_counter()
        try:
            runs[mode] = run_mode(mode, a, start, changes)
        except NetemError as e:
            print(f"not measured: {e}")
            return
        print(f"{mode}: {time.perf_counter() - t1:.0f} s", flush=True)
    doc = {
        "label": LABEL,
        "what": "E10: per-iteration communication time of a DDP job while tbf rates change mid-run; ALEPH re-planning "
        "every K iterations vs ALEPH with its start-up plan frozen vs gloo all_reduce",
        "rates_mbit_start": start,
        "changes_mbit": {str(k): {str(w): r for w, r in v.items()} for k, v in changes.items()},
        "config": {
            k: getattr(a, k)
            for k in (
                "iters",
                "replan_every",
                "b_mbit",
                "probe_kb",
                "samples",
                "chunk_kb",
                "bucket_mb",
                "burst_kb",
                "latency_ms",
            )
        },  # fmt: skip
        **summarize(a, start, changes, runs),
        "wall_s": time.perf_counter() - t0,
        "loadavg_1m_before_after": [load0, os.getloadavg()[0]],
    }
    out = write_result(a.out, doc)
    plot(str(out.with_suffix(".png")), doc)
    for ph in doc["phases"]:
        s = {m: round(v, 3) for m, v in ph["median_comm_s"].items()}
        st = {m: round(v, 3) for m, v in ph.get("median_comm_s_settled", {}).items()}
        print(f"iters {ph['iterations']} rates {ph['nominal_mbit']}: median comm s {s}; settled {st}")
    for p in doc.get("replan", {}).get("points", []):
        print(
            f"re-plan @{p['iteration']}: {p['total_s_max_rank']:.3f} s (probe {p['probe_s_max_rank']:.3f}) probed "
            f"{[round(x) for x in p['probed_mbit']]} classes {p['class_before_after'][1]} changed {p['plan_changed']}"
            f" plan {p['plan']} root {p['root']}: {p['reason']}"
        )
    print(
        json.dumps({k: doc[k] for k in ("claims", "final_params_max_abs_diff_vs_ring") if k in doc}, indent=1)
    )
    print(f"-> {out}")


if __name__ == "__main__":
    main()
