"""The NCCL path on a real GPU: the project's NCCL net plugin loaded by NCCL, Hermod's traffic-class communicators,
the matched all-to-all and the runtime scheduler on NCCL (label: measured on one GPU; see "What this is").

What this is: the GPU machines this project is lent have ONE GPU. NCCL refuses two ranks on one GPU of one host
("Duplicate GPU detected"), so every rank gets its own ``NCCL_HOSTID``: NCCL then believes the ranks sit on different
hosts and moves all traffic through its network transport -- the flowlane plugin (``--nets flowlane``) or NCCL's
own socket transport (``socket``) -- over loopback. The ranks share the GPU by time slicing (no MPS), so per-op
latencies are the scheduler's time slices, not a network's: the correctness checks are the point, and the timings
compare the plugin with NCCL's socket transport under the same handicap only.

Checks per net (each rank on ``cuda:0``): all-reduce / all-to-all / send-recv results exact; ``build_class_groups``
makes one NCCL communicator per Hermod class with ``ncclConfig_t.trafficClass`` and (flowlane) the plugin's log shows
connections of those classes; the matched all-to-all (BvN, bottleneck BvN, Algorithm 3) equals
``all_to_all_single`` bitwise; ``AllToAllRunner("auto")`` decides the same everywhere; the synthetic 1F1B PP x DP (x EP)
workload of :mod:`flowlane.testing.workload` gives bitwise the same parameters under fifo, Hermod (chunked, gated),
Hermod with all-to-alls on their wire class's communicator, Lina and Megatron's defaults.

``python -m benchmarks.nccl_gpu_check --out results/gpu`` (``--nets flowlane,socket``; the plugin is built with
``make -C nccl_net_plugin`` first). ``--backend gloo --device cpu`` runs the same checks on CPU (a dry run of the
script's logic; no NCCL).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time
import traceback
from dataclasses import asdict
from pathlib import Path
from typing import Any

from flowlane.launch import launch
from flowlane.sim.output import write_json
from flowlane.testing.provenance import write_result

ROOT = Path(__file__).resolve().parents[1]
PLUGIN_DIR = ROOT / "nccl_net_plugin" / "build"

# the synthetic iteration of flowlane.testing.workload, as tests/test_sched_runtime.py runs it on gloo
BASE = dict(
    pp=2, layers_per_stage=2, microbatches=3, iterations=2, act_elems=1024, param_elems=4096, moe=True
)
RUNS: dict[str, dict[str, Any]] = {
    "fifo": dict(sched={"mode": "fifo"}),
    "hermod": dict(sched={"mode": "hermod", "chunk_bytes": 4096}),
    "hermod_ep": dict(sched={"mode": "hermod", "chunk_bytes": 4096}, ep_wire_classes=True),
    "lina": dict(sched={"mode": "hermod", "chunk_bytes": 4096, "gate_ctypes": ["ep"]}, order="fifo"),
    "megatron": dict(sched={"mode": "fifo"}, overlap_dp=False),
    "fifo_ep4": dict(sched={"mode": "fifo"}, pp=1, iterations=6, ep_algorithm="plain"),
    "auto_ep4": dict(sched={"mode": "fifo"}, pp=1, iterations=6, ep_algorithm="auto"),
}


def net_env(net: str, log_dir: Path) -> dict[str, str]:
    """NCCL's environment for one transport. LD_LIBRARY_PATH must be set before the ranks start (ld.so reads it
    at process start), so the parent sets all of it and the spawned ranks inherit it."""
    env = {
        "NCCL_DEBUG": "INFO",
        "NCCL_DEBUG_SUBSYS": "INIT,NET",
        "NCCL_DEBUG_FILE": str(log_dir / f"nccl-{net}.%h.%p.log"),
        "NCCL_SOCKET_IFNAME": "lo",
        "NCCL_IB_DISABLE": "1",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
    }
    if net == "flowlane":
        env.update(
            {
                "NCCL_NET_PLUGIN": "flowlane",
                "NCCL_NET": "flowlane",
                "FLOWLANE_SOCKET_IFNAME": "lo",
                "LD_LIBRARY_PATH": f"{PLUGIN_DIR}:{os.environ.get('LD_LIBRARY_PATH', '')}",
            }
        )
    elif net == "socket":
        env.update({"NCCL_NET_PLUGIN": "none", "NCCL_NET": "Socket"})
    else:
        raise ValueError(f"net {net!r} is not one of ['flowlane', 'socket']")
    return env


# -- ranks ---------------------------------------------------------------------------------------------------------
def _init(rank: int, world: int, backend: str, device: str) -> Any:
    import datetime

    import torch
    import torch.distributed as dist

    if backend == "nccl":
        # one host hash per rank: NCCL sees `world` hosts with one GPU each instead of a duplicated GPU
        os.environ["NCCL_HOSTID"] = f"flowlane-check-host{rank}"
        torch.cuda.set_device(0)
        dist.init_process_group(
            "nccl",
            rank=rank,
            world_size=world,
            device_id=torch.device("cuda", 0),
            timeout=datetime.timedelta(seconds=90),
        )
    else:
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=90))
    return torch.device(device)


def _sync(dev: Any) -> None:
    import torch

    if dev.type == "cuda":
        torch.cuda.synchronize()


def _median_s(fn: Any, dev: Any, reps: int, barrier: bool = True) -> float:
    """Median wall time of ``fn`` over ``reps`` runs after one warm-up, the device synchronised around each (and the
    ranks lined up by a barrier first, unless ``barrier`` is False)."""
    import torch.distributed as dist

    times = []
    for i in range(reps + 1):
        if barrier:
            dist.barrier()
        _sync(dev)
        t0 = time.perf_counter()
        fn()
        _sync(dev)
        if i:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _part(out: dict, name: str, fn: Any) -> None:
    """Run one check; an exception is recorded (with its traceback) instead of ending the rank."""
    t0 = time.perf_counter()
    try:
        out[name] = {"ok": True, **fn()}
    except Exception:  # noqa: BLE001 - recorded per part, reported by the parent
        out[name] = {"ok": False, "error": traceback.format_exc()[-3000:]}
    out[name]["seconds"] = time.perf_counter() - t0


def _save_partial(partial: str, rank: int, out: dict) -> None:
    """Each rank's results so far, so that a hang in a later part (the launch then times out) loses nothing."""
    write_json(Path(f"{partial}.rank{rank}.json"), out)


def checks_rank(rank: int, world: int, backend: str, device: str, partial: str) -> dict[str, Any]:
    import random

    import torch
    import torch.distributed as dist

    from flowlane import comm
    from flowlane.sched.alltoall import AllToAllRunner, gather_split_matrix, matched_all_to_all
    from flowlane.sched.groups import build_class_groups

    dev = _init(rank, world, backend, device)
    out: dict[str, Any] = {"rank": rank}
    if dev.type == "cuda":
        out["device"] = torch.cuda.get_device_name(0)
        out["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    out["torch"] = torch.__version__

    def collectives() -> dict:
        res = {}
        # integers in float32: every reduction order gives the exact sum
        for n in (1, 1000, 1 << 20, 1 << 22):
            t = torch.full((n,), float(rank + 1), device=dev)
            dist.all_reduce(t)
            res[f"all_reduce_{n}"] = bool(torch.all(t == world * (world + 1) / 2).item())
        splits = [(rank + j) % 3 + 1 for j in range(world)]
        recv = [(i + rank) % 3 + 1 for i in range(world)]
        x = torch.arange(sum(splits), dtype=torch.float32, device=dev) + 100 * rank
        y = torch.full((sum(recv),), -1.0, device=dev)
        dist.all_to_all_single(y, x, recv, splits)
        want = []
        for i in range(world):  # rank i's chunk for me starts at the sum of its splits to ranks < me
            start = sum((i + j) % 3 + 1 for j in range(rank))
            want += [100 * i + start + k for k in range(recv[i])]
        res["all_to_all_single"] = y.tolist() == [float(v) for v in want]
        buf = torch.empty(4096, device=dev)
        ops = [
            dist.P2POp(dist.isend, torch.full((4096,), float(rank), device=dev), (rank + 1) % world),
            dist.P2POp(dist.irecv, buf, (rank - 1) % world),
        ]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        res["send_recv_ring"] = bool(torch.all(buf == (rank - 1) % world).item())
        return res

    def classes() -> dict:
        cg = build_class_groups([list(range(world))], backend=backend)
        sums = []
        for c in range(3):
            t = torch.ones(1 << 16, device=dev)
            dist.all_reduce(t, group=cg.get(None, c))
            sums.append(float(t[0]))
        n = len(cg.groups[tuple(range(world))])
        tc = None
        if backend == "nccl":  # what each clone's NCCL backend was created with
            tc = [
                g._get_backend(torch.device("cuda")).options.config.traffic_class
                for g in cg.groups[tuple(range(world))]
            ]
        return {"sums": sums, "clones": n, "traffic_classes": tc}

    def alltoall() -> dict:
        r = random.Random(rank)
        splits = [r.randint(0, 9) for _ in range(world)]
        matrix = gather_split_matrix(splits)
        recv = [matrix[i][rank] for i in range(world)]
        x = (torch.arange(sum(splits) * 3, dtype=torch.float32).view(-1, 3) + 1000 * rank).to(dev)
        ref = torch.empty(sum(recv), 3, device=dev)
        dist.all_to_all_single(ref, x, recv, splits)
        res: dict[str, Any] = {}
        for alg in ("bvn", "bvn_bottleneck", "alg3"):
            y = torch.full((sum(recv), 3), -1.0, device=dev)
            matched_all_to_all(y, x, recv, splits, matrix, algorithm=alg, quantum=2)
            res[f"equal_{alg}"] = bool(torch.equal(y, ref))
        runner = AllToAllRunner("auto", probe_iterations=1)
        for _ in range(4):
            y = torch.full((sum(recv), 3), -1.0, device=dev)
            runner(y, x, recv, splits)
            res.setdefault("auto_equal", []).append(bool(torch.equal(y, ref)))
            _sync(dev)
            runner.end_iteration()
        res["auto_choice"] = runner.choice
        return res

    def timings() -> dict:
        res: dict[str, Any] = {}
        n = 16 << 20  # 64 MiB of float32
        t = torch.ones(n, device=dev)
        res["all_reduce_64MiB_s"] = _median_s(lambda: dist.all_reduce(t), dev, reps=4)
        res["all_reduce_64MiB_busbw_GBps"] = 2 * (world - 1) / world * n * 4 / res["all_reduce_64MiB_s"] / 1e9
        small = torch.ones(2, device=dev)
        res["all_reduce_8B_s"] = _median_s(lambda: dist.all_reduce(small), dev, reps=20, barrier=False)
        # one phase of a matched all-to-all: a send to the next rank and a receive from the previous, batched;
        # the host's issue time is taken inside, the whole phase around it
        issue: list[float] = []
        a, b = torch.ones(256, device=dev), torch.empty(256, device=dev)

        def phase() -> None:
            t0 = time.perf_counter()
            works = comm.batch_isend_irecv(
                [
                    dist.P2POp(dist.isend, a, (rank + 1) % world),
                    dist.P2POp(dist.irecv, b, (rank - 1) % world),
                ],
                kind="ep",
            )
            issue.append(time.perf_counter() - t0)
            for w in works:
                w.wait()

        res["phase_total_s"] = _median_s(phase, dev, reps=20)
        res["phase_issue_s"] = statistics.median(issue[1:])  # without the warm-up
        # a skewed all-to-all: one all_to_all_single vs BvN phases
        r = random.Random(7 + rank)
        splits = [int(64 * r.paretovariate(1.2)) for _ in range(world)]
        matrix = gather_split_matrix(splits)
        recv = [matrix[i][rank] for i in range(world)]
        x = torch.randn(sum(splits), 1024, device=dev)
        y = torch.empty(sum(recv), 1024, device=dev)
        res["a2a_plain_s"] = _median_s(lambda: dist.all_to_all_single(y, x, recv, splits), dev, reps=5)
        res["a2a_bvn_s"] = _median_s(lambda: matched_all_to_all(y, x, recv, splits, matrix), dev, reps=5)
        res["a2a_bytes_sent"] = sum(splits) * 1024 * 4
        return res

    for name, fn in (
        ("collectives", collectives),
        ("classes", classes),
        ("alltoall", alltoall),
        ("timings", timings),
    ):
        _part(out, name, fn)
        _save_partial(partial, rank, out)
    return out


def workload_rank(
    rank: int, world: int, backend: str, device: str, partial: str, runs: list[str]
) -> dict[str, Any]:
    import torch

    from flowlane.testing.workload import WorkloadConfig, run_rank

    _init(rank, world, backend, device)
    out: dict[str, Any] = {}
    for name in runs:
        cfg = asdict(WorkloadConfig(**{**BASE, **RUNS[name], "device": device}))
        t0 = time.perf_counter()
        try:
            r = run_rank(rank, world, cfg)
            out[name] = {
                "ok": True,
                "params": r["params"],
                "digest": r["digest"],
                "times": r["times"],
                "ep_classes": r["ep_classes"],
                "ep_auto": r["ep_auto"],
                "stage": r["stage"],
                "chunks": sum(1 for e in r["log"] if e[0] == "chunk"),
            }
        except Exception:  # noqa: BLE001
            out[name] = {"ok": False, "error": traceback.format_exc()[-3000:]}
        out[name]["seconds"] = time.perf_counter() - t0
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        _save_partial(partial, rank, out)
    return out


# -- parent ----------------------------------------------------------------------------------------------------
CONNECTED = re.compile(
    r"NET/flowlane : (send|recv) comm \d+ (?:connected|accepted): class (-?\d+) lane (\d+)"
)


def read_logs(log_dir: Path, net: str) -> dict[str, Any]:
    """What NCCL said: which network it used, whether it loaded the plugin, and the class of every connection the
    plugin made (its INFO lines)."""
    text = "".join(p.read_text(errors="replace") for p in sorted(log_dir.glob(f"nccl-{net}.*.log")))
    classes: dict[str, int] = {}
    for m in CONNECTED.finditer(text):
        k = f"{m.group(1)} class {m.group(2)} lane {m.group(3)}"
        classes[k] = classes.get(k, 0) + 1
    using = sorted(set(re.findall(r"Using network (\S+)", text)))
    plugin_lines = sorted(
        {
            line.split("NCCL INFO ", 1)[-1].strip()
            for line in text.splitlines()
            if "NET/Plugin" in line or "NET/flowlane : using" in line
        }
    )[:12]
    warns = sorted({line.split("NCCL WARN ", 1)[-1].strip() for line in text.splitlines() if "WARN" in line})[
        :20
    ]
    return {
        "using_network": using,
        "plugin_lines": plugin_lines,
        "connections_by_class": classes,
        "warnings": warns,
        "log_bytes": len(text),
    }


def compare_workloads(ranks: list[dict]) -> dict[str, Any]:
    """Bitwise parameter equality of every run with its baseline (fifo; fifo_ep4 for the one-stage runs)."""
    res: dict[str, Any] = {}
    for name in [n for n in RUNS if any(n in r for r in ranks)]:
        base = "fifo_ep4" if RUNS[name].get("pp") == 1 else "fifo"
        oks = [r.get(name, {}).get("ok") and r.get(base, {}).get("ok") for r in ranks]
        equal = all(oks) and all(r[name]["params"] == r[base]["params"] for r in ranks)
        res[name] = {
            "ran": all(bool(r.get(name, {}).get("ok")) for r in ranks),
            "params_equal_to": base,
            "equal": bool(equal),
            "iteration_s_median": statistics.median(
                t for r in ranks if r.get(name, {}).get("ok") for t in r[name]["times"][1:]
            )
            if all(bool(r.get(name, {}).get("ok")) for r in ranks)
            else None,
            "errors": [r[name]["error"] for r in ranks if name in r and not r[name]["ok"]][:1],
        }
        if name == "hermod_ep" and res[name]["ran"]:
            res[name]["ep_classes_seen"] = sorted({c for r in ranks for *_, c in r[name]["ep_classes"]})
        if name == "auto_ep4" and res[name]["ran"]:
            res[name]["choices"] = sorted({r[name]["ep_auto"]["choice"] for r in ranks})
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="results/gpu")
    ap.add_argument(
        "--nets", default="flowlane,socket", help="flowlane (the plugin) and/or socket (NCCL's own)"
    )
    ap.add_argument("--backend", default="nccl", choices=["nccl", "gloo"])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--runs", default=",".join(RUNS), help=f"workload runs, subset of {list(RUNS)}")
    ap.add_argument("--timeout", type=float, default=150.0, help="per launch (s); a stuck rank is an error")
    args = ap.parse_args(argv)
    runs = [r for r in args.runs.split(",") if r]
    bad = [r for r in runs if r not in RUNS]
    if bad:
        ap.error(f"--runs {bad} not in {list(RUNS)}")
    # gloo has one clone per group unless given an interface per class (tested elsewhere)
    if args.backend == "gloo":
        runs = [r for r in runs if r != "hermod_ep"]
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    log_dir = out_dir / "logs"
    log_dir.mkdir(exist_ok=True)
    nets = args.nets.split(",") if args.backend == "nccl" else ["gloo"]
    label = (
        (
            "measured on one GPU; ranks time-share it and reach each other over loopback (NCCL_HOSTID per "
            "rank): correctness is the point, timings are not a network's"
        )
        if args.backend == "nccl"
        else "dry run on CPU (gloo): the script's logic only"
    )
    result: dict[str, Any] = {"label": label, "backend": args.backend, "ranks": args.ranks, "nets": {}}
    saved_env = dict(os.environ)
    failed = False
    for net in nets:
        os.environ.clear()
        os.environ.update(saved_env)
        if net != "gloo":
            os.environ.update(net_env(net, log_dir))
        entry: dict[str, Any] = {}
        result["nets"][net] = entry
        for part, fn, extra in (("checks", checks_rank, ()), ("workloads", workload_rank, (runs,))):
            t0 = time.perf_counter()
            partial = str(out_dir / f"partial-{net}-{part}")
            try:
                ranks = launch(
                    fn,
                    args.ranks,
                    args=(args.backend, args.device, partial, *extra),
                    backend=None,
                    timeout=args.timeout,
                )
                entry[part] = ranks[0] if part == "checks" else compare_workloads(ranks)
                if part == "checks":
                    entry["checks_all_ranks_ok"] = all(
                        all(v.get("ok") for v in r.values() if isinstance(v, dict)) for r in ranks
                    )
                    entry["checks_other_ranks"] = [
                        {k: v for k, v in r.items() if k not in ("timings",)} for r in ranks[1:]
                    ]
            except Exception:  # noqa: BLE001 - one part failing must not lose the others' results
                entry[part] = {"ok": False, "error": traceback.format_exc()[-4000:]}
                entry[f"{part}_partial"] = [
                    json.loads(p.read_text())
                    for p in sorted(Path(out_dir).glob(f"partial-{net}-{part}.rank*.json"))
                ]
                failed = True
            entry[f"{part}_wall_s"] = time.perf_counter() - t0
            if net != "gloo":
                entry["nccl_log"] = read_logs(log_dir, net)
            write_result(out_dir / "nccl_gpu_check.json", result)  # with command and commit
    os.environ.clear()
    os.environ.update(saved_env)
    failed |= not summarize(result)
    return 1 if failed else 0


def summarize(result: dict[str, Any]) -> bool:
    ok = True
    print(f"\n{result['label']}")
    for net, e in result["nets"].items():
        c = e.get("checks", {})
        print(f"\n== {net} ==  checks ok on every rank: {e.get('checks_all_ranks_ok')}")
        if c.get("ok") is False:
            print("  checks failed:", c["error"].strip().splitlines()[-1][:300])
            c = (e.get("checks_partial") or [{}])[0]  # rank 0's parts that finished
        for part in ("collectives", "classes", "alltoall"):
            v = c.get(part, {})
            print(f"  {part}: " + json.dumps({k: x for k, x in v.items() if k != "error"})[:300])
            if v.get("error"):
                print("   ", v["error"].strip().splitlines()[-1][:300])
                ok = False
        t = c.get("timings", {})
        if t.get("ok"):
            print(
                f"  all_reduce 64 MiB {t['all_reduce_64MiB_s'] * 1e3:.1f} ms ({t['all_reduce_64MiB_busbw_GBps']:.2f}"
                f" GB/s bus), 8 B {t['all_reduce_8B_s'] * 1e3:.2f} ms; one phase: issue "
                f"{t['phase_issue_s'] * 1e6:.0f} us, total {t['phase_total_s'] * 1e3:.2f} ms; skewed a2a plain "
                f"{t['a2a_plain_s'] * 1e3:.1f} ms, bvn {t['a2a_bvn_s'] * 1e3:.1f} ms"
            )
        for name, w in (e.get("workloads") or {}).items():
            if isinstance(w, dict) and "equal" in w:
                print(
                    f"  workload {name}: ran {w['ran']}, params == {w['params_equal_to']}: {w['equal']}"
                    + (f", ep classes {w['ep_classes_seen']}" if "ep_classes_seen" in w else "")
                    + (f", auto chose {w['choices']}" if "choices" in w else "")
                )
                ok &= bool(w["equal"])
            elif isinstance(w, str):
                print(f"  workloads: {w[-300:]}")
        if isinstance(e.get("workloads"), dict) and e["workloads"].get("ok") is False:
            print("  workloads failed:", e["workloads"]["error"].strip().splitlines()[-1][:300])
            ok = False
        log = e.get("nccl_log")
        if log:
            print(
                f"  NCCL used {log['using_network']}; plugin connections by class: {log['connections_by_class']}"
            )
            for w in log["warnings"][:5]:
                print(f"  NCCL WARN {w[:200]}")
        ok &= bool(e.get("checks_all_ranks_ok"))
    return ok


if __name__ == "__main__":
    sys.exit(main())
