"""Hermod vs the default (FIFO) order on 4 real CPU ranks over an emulated, shaped network.

    sudo .venv-llm/bin/python -m benchmarks.hermod_real [--fabric per-rank|shared-nic] [--rate-mbit 200]
        [--rounds 4] [--out results/hermod] [--variant chunk_bytes=131072,max_inflight_chunks=1,gate_timeout_s=0.05
        [,dp_mid=consumer][,wire=1] ...]

Network (:class:`EmulatedFabric`, needs root; every name is unique to this run and everything is deleted on exit,
also on error / SIGTERM; traffic never leaves the namespaces created here): one network namespace per rank.
``per-rank``: each rank's egress is its own shaped link, so a rank's DP chunks contend only with that rank's PP/EP
sends -- what Hermod's sender-side order and DP chunking can resolve. (An earlier version shaped one loopback
shared by all 4 ranks and measured 0.96x: one rank's host-side order cannot protect another rank's flow.)
``shared-nic``: two servers of two ranks behind one shaped NIC each (both directions), PP inside the server, DP and
EP across -- there one rank's DP competes with the other rank's all-to-all, which only wire priority can resolve.
Every shaped port is an HTB tree with a bulk class served only when nothing else waits; a variant with ``wire=1``
runs Hermod's bulk (DP) class on its own gloo communicator bound to a macvlan with its own address
(:func:`flowlane.sched.groups.build_class_groups` with ``gloo_class_ifnames``), which the filters put in that class
-- the gloo stand-in for DSCP-marked traffic in a priority queue. FIFO and host-only variants never use it.
gloo rendezvous is ``tcp://`` on rank 0's namespace address and ``GLOO_SOCKET_IFNAME=eth0``.

Workload: the synthetic PP2 x DP2 (x EP2) 1F1B iteration of :mod:`flowlane.sched.workload` (ZeRO parameter gathers,
per-layer gradient reductions, pipeline p2p and skewed MoE all-to-alls; compute emulated with sleep because 2 cores
cannot run 4 ranks' matmuls at once). FIFO and every Hermod variant alternate, round after round, in the same
processes over the same links; the first iteration of each run is warm-up. Iteration time = max over ranks; the
summary is the median over all steady iterations. Per-op timings (PP / EP / DP) come from flowlane.comm's recorder;
the bytes each shaped port's classes carried are read from tc at the end (``network.class_bytes_at_end``).
Label: measured on CPU with emulated links (netns + tc).
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import re
import secrets
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
LABEL = "measured on CPU with emulated links (netns + tc)"
WORK = dict(pp=2, layers_per_stage=2, microbatches=4, iterations=3, act_elems=32768, param_elems=262144, moe=True,
            fwd_s=0.01, opt_s=0.005)
DEFAULT_VARIANT = {"chunk_bytes": 128 << 10, "max_inflight_chunks": 1, "gate_timeout_s": 0.05}
PORT = 29561


# -- per-rank worker (runs inside its namespace) ----------------------------------------------------------------------
def _op_stats(ops: list[Any]) -> dict[str, Any]:
    """``ops``: (kind, op, nbytes, start, duration) from flowlane.comm's recorder."""
    out: dict[str, Any] = {}
    for kind in sorted({o[0] for o in ops}):
        ds = [o[4] for o in ops if o[0] == kind]
        sent = sum(o[2] for o in ops if o[0] == kind and o[1] not in ("recv", "irecv"))
        out[kind] = {"n": len(ds), "bytes_sent": sent, "sum_s": sum(ds), "median_s": statistics.median(ds)}
    return out


def _run_variant(rank: int, world: int, sched: dict[str, Any]) -> dict[str, Any]:
    from flowlane.sched.workload import WorkloadConfig, run_rank

    sched = dict(sched)
    dp_mid = sched.pop("dp_mid", "last")  # Hermod's DP-MID policy knob (digest A6.1 #1)
    # wire classes: Hermod's bulk class on its own source address, which the fabric queues behind everything else
    ifnames = ["eth0", "eth0", "bulk0"] if sched.pop("wire", 0) else None
    r = run_rank(rank, world, asdict(WorkloadConfig(**WORK, sched=sched, dp_mid=dp_mid, gloo_class_ifnames=ifnames)))
    steady = [o for o in r["ops"] if o[3] >= r["iter_starts"][1]]  # the first iteration warms up
    t_last = r["iter_starts"][-1]
    timeline = [(o[0], o[1], o[2], round(o[3] - t_last, 4), round(o[4], 4)) for o in r["ops"] if o[3] >= t_last]
    return {"times": r["times"][1:], "digest": r["digest"], "ops": _op_stats(steady), "timeline": timeline}


def worker(rank: int, world: int, master: str, rounds: int, variants: dict[str, dict[str, Any]]) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://{master}:{PORT}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    dist.all_reduce(torch.ones(1024))  # connections up before timing
    out: dict[str, Any] = {m: {"times": [], "ops": [], "digest": None, "timeline": []} for m in variants}
    for _ in range(rounds):
        for mode, sched in variants.items():
            r = _run_variant(rank, world, sched)
            out[mode]["times"].extend(r["times"])
            out[mode]["ops"].append(r["ops"])
            out[mode]["digest"] = r["digest"]
            out[mode]["timeline"] = r["timeline"]  # the last iteration of the last round, for inspection
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, out)
    if rank == 0:
        print("RESULT " + json.dumps(everyone), flush=True)
    dist.destroy_process_group()


# -- the emulated network (runs as root in the caller's namespace; touches only what it creates) --------------------
FABRICS = ("per-rank", "shared-nic")
BULK_IF = "bulk0"


class EmulatedFabric:
    """``n`` rank namespaces ``<base>r<i>``, each with ``eth0`` = 10.<s>.0.<i+1>/24 and a macvlan ``bulk0`` on it
    = 10.<s>.1.<i+1>/24 (the address Hermod's bulk class binds to when wire classes are on; same NIC, own source
    address). Every shaped port is an HTB tree: the link rate, a default class and a bulk class that gets only what
    the default class leaves (prio 1, a 1 kbit/s guarantee), selected by a u32 filter on the bulk subnet -- the
    strict-priority queue a switch gives a DSCP class. Traffic that does not use ``bulk0`` is never reordered.

    ``per-rank``: every rank has its own link; its ``eth0`` egress is shaped; a private switch bridges them.
    ``shared-nic``: ranks ``2j, 2j+1`` (a PP group) are one server, bridged in ``<base>h<j>`` behind one NIC whose
    uplink into the switch is shaped both ways (server egress, and the switch port towards the server: the
    receive side); PP stays inside the server (unshaped, as NVLink would), DP and EP cross the NIC -- the seed's
    literal fabric (one 100 Gb/s link per server, §5.5.1) in miniature.

    Context manager; deletes its namespaces on exit, at interpreter exit and on SIGTERM."""

    def __init__(self, n: int, rate_mbit: float, fabric: str = "per-rank", burst_kb: int = 32) -> None:
        if fabric not in FABRICS:
            raise ValueError(f"fabric {fabric!r} is not one of {list(FABRICS)}")
        self.n, self.rate, self.fabric, self.burst_kb = n, rate_mbit, fabric, burst_kb
        tag = f"{os.getpid() % 100000}{secrets.token_hex(2)}"
        self.base = f"flh{tag}"
        self.switch = f"{self.base}s"
        self.ns = [f"{self.base}r{i}" for i in range(n)]
        self.servers = [f"{self.base}h{j}" for j in range(n // 2)] if fabric == "shared-nic" else []
        subnet = 100 + int(secrets.token_hex(1), 16) % 100
        self.ips = [f"10.{subnet}.0.{i + 1}" for i in range(n)]
        self.bulk_net = f"10.{subnet}.1.0/24"
        self.bulk_ips = [f"10.{subnet}.1.{i + 1}" for i in range(n)]
        self._created: list[str] = []

    @staticmethod
    def _sh(*cmd: str) -> None:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
        if r.returncode:
            raise RuntimeError(f"{' '.join(cmd)} failed: {r.stderr.strip()}")

    def _add_ns(self, name: str) -> None:
        self._sh("ip", "netns", "add", name)
        self._created.append(name)
        self._sh("ip", "-n", name, "link", "set", "lo", "up")

    def _bridge(self, ns: str) -> None:
        self._sh("ip", "-n", ns, "link", "add", "br0", "type", "bridge")
        self._sh("ip", "-n", ns, "link", "set", "br0", "up")

    def _veth(self, ns_a: str, a: str, ns_b: str, b: str) -> None:
        """veth ``a`` in ``ns_a`` <-> ``b`` in ``ns_b``, ``b`` enslaved to ``ns_b``'s br0, both up."""
        self._sh("ip", "-n", ns_a, "link", "add", a, "type", "veth", "peer", "name", b, "netns", ns_b)
        self._sh("ip", "-n", ns_b, "link", "set", b, "master", "br0")
        self._sh("ip", "-n", ns_b, "link", "set", b, "up")
        self._sh("ip", "-n", ns_a, "link", "set", a, "up")

    def _shape(self, ns: str, dev: str) -> None:
        rate, burst = f"{self.rate:g}mbit", f"{self.burst_kb}kb"
        tc = ("ip", "netns", "exec", ns, "tc")
        self._sh(*tc, "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "10")
        self._sh(*tc, "class", "add", "dev", dev, "parent", "1:", "classid", "1:1", "htb", "rate", rate, "ceil", rate,
                 "burst", burst, "cburst", burst)
        self._sh(*tc, "class", "add", "dev", dev, "parent", "1:1", "classid", "1:10", "htb", "rate", rate, "ceil",
                 rate, "burst", burst, "cburst", burst, "prio", "0")
        self._sh(*tc, "class", "add", "dev", dev, "parent", "1:1", "classid", "1:30", "htb", "rate", "1kbit", "ceil",
                 rate, "burst", burst, "cburst", burst, "prio", "1")
        for field in ("src", "dst"):
            self._sh(*tc, "filter", "add", "dev", dev, "parent", "1:", "protocol", "ip", "prio", "1", "u32", "match",
                     "ip", field, self.bulk_net, "flowid", "1:30")

    def __enter__(self) -> EmulatedFabric:
        atexit.register(self.cleanup)
        if signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):
            signal.signal(signal.SIGTERM, lambda *_: (self.cleanup(), sys.exit(143)))
        try:
            self._add_ns(self.switch)
            self._bridge(self.switch)
            for j, host in enumerate(self.servers):
                self._add_ns(host)
                self._bridge(host)
                self._veth(host, "nic", self.switch, f"d{j}")
                self._sh("ip", "-n", host, "link", "set", "nic", "master", "br0")
                self._shape(host, "nic")  # the server's NIC, transmit
                self._shape(self.switch, f"d{j}")  # the switch port towards the server: the NIC's receive side
            for i, ns in enumerate(self.ns):
                self._add_ns(ns)
                self._veth(ns, "eth0", self.servers[i // 2] if self.servers else self.switch, f"p{i}")
                self._sh("ip", "-n", ns, "addr", "add", f"{self.ips[i]}/24", "dev", "eth0")
                self._sh("ip", "-n", ns, "link", "add", BULK_IF, "link", "eth0", "type", "macvlan", "mode", "bridge")
                self._sh("ip", "-n", ns, "addr", "add", f"{self.bulk_ips[i]}/24", "dev", BULK_IF)
                self._sh("ip", "-n", ns, "link", "set", BULK_IF, "up")
                if not self.servers:
                    self._shape(ns, "eth0")  # the rank's own access link (egress)
        except BaseException:
            self.cleanup()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self.cleanup()

    def class_bytes(self) -> dict[str, dict[str, int]]:
        """Bytes sent so far by every shaped port's default and bulk classes (evidence the classes carry what the
        variants put on them)."""
        ports = [(h, "nic") for h in self.servers] + [(self.switch, f"d{j}") for j in range(len(self.servers))] \
            if self.servers else [(ns, "eth0") for ns in self.ns]
        out: dict[str, dict[str, int]] = {}
        for ns, dev in ports:
            r = subprocess.run(["ip", "netns", "exec", ns, "tc", "-s", "class", "show", "dev", dev],
                               capture_output=True, text=True, timeout=30, check=True)
            # "class htb 1:30 parent 1:1 ... \n Sent 1234 bytes ..." (this iproute2 has no JSON for classes)
            by_id = {m[0]: int(m[1]) for m in re.findall(r"class htb (\S+) .*?\n\s*Sent (\d+) bytes", r.stdout)}
            out[f"{ns.removeprefix(self.base)}:{dev}"] = {"default": by_id.get("1:10", 0), "bulk": by_id.get("1:30", 0)}
        return out

    def cleanup(self) -> None:
        while self._created:
            subprocess.run(["ip", "netns", "del", self._created.pop()], capture_output=True, check=False)

    def describe(self) -> dict[str, Any]:
        shaped = ("each rank's eth0 egress" if self.fabric == "per-rank" else
                  "each server NIC both ways (server egress and the switch port towards it); PP intra-server unshaped")
        return {"fabric": self.fabric,
                "topology": ("one netns per rank, veth eth0 into a bridge (private switch netns)"
                             if self.fabric == "per-rank" else
                             "2 servers of 2 ranks (PP groups {0,1},{2,3}); ranks bridged per server, one NIC per "
                             "server into a switch bridge"),
                "shaping": f"tc htb on {shaped}: {self.rate:g} Mbit/s, burst {self.burst_kb} KB; bulk subnet "
                           f"{self.bulk_net} (macvlan {BULK_IF}) in a class served only when the default class is "
                           "idle (strict priority); nothing else classified",
                "rate_mbit": self.rate, "ranks": self.n}


def run_all(rate: float, rounds: int, variants: dict[str, dict[str, Any]],
            fabric: str = "per-rank") -> tuple[list[Any], dict[str, Any]]:
    with EmulatedFabric(4, rate, fabric) as net:
        env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "eth0"}
        procs = [subprocess.Popen(["ip", "netns", "exec", net.ns[r], sys.executable, "-m", "benchmarks.hermod_real",
                                   "--worker", str(r), "--master", net.ips[0], "--rounds", str(rounds),
                                   "--variants-json", json.dumps(variants)], cwd=REPO, env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(4)]
        outs = []
        try:
            for p in procs:
                o, e = p.communicate(timeout=1800)
                if p.returncode:
                    raise RuntimeError(f"rank worker failed (rc {p.returncode}):\n{e[-3000:]}")
                outs.append(o)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        desc = {**net.describe(), "class_bytes_at_end": net.class_bytes()}
    line = next(x for x in outs[0].splitlines() if x.startswith("RESULT "))
    return json.loads(line[7:]), desc


def summarise(res: list[Any], variants: dict[str, dict[str, Any]]) -> dict[str, Any]:
    modes = list(variants)
    per_iter = {m: [max(r[m]["times"][i] for r in res) for i in range(len(res[0][m]["times"]))] for m in modes}
    med = {m: statistics.median(v) for m, v in per_iter.items()}
    same = {m: all(r[m]["digest"] == r["fifo"]["digest"] for r in res) for m in modes}
    ops: dict[str, Any] = {}
    for m in modes:  # per kind: median op duration and per-iteration op time, per pipeline stage
        ops[m] = {}
        for stage in (0, 1):
            ranks = [r for i, r in enumerate(res) if i % WORK["pp"] == stage]
            kinds = sorted({k for r in ranks for run in r[m]["ops"] for k in run})
            row = {}
            for k in kinds:
                runs = [run[k] for r in ranks for run in r[m]["ops"] if k in run]
                iters = sum(1 for r in ranks for _ in r[m]["ops"]) * (WORK["iterations"] - 1)
                row[k] = {"median_op_s": statistics.median(x["median_s"] for x in runs),
                          "op_time_per_iter_s": sum(x["sum_s"] for x in runs) / iters,
                          "bytes_sent_per_iter": sum(x["bytes_sent"] for x in runs) / iters}
            ops[m][f"stage{stage}"] = row
    return {"per_iter": per_iter, "median": med, "speedup": {m: med["fifo"] / med[m] for m in modes},
            "math_identical": same, "ops": ops}


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
    crit = merged([(o[3], o[3] + o[4]) for o in timeline if o[0] in ("pp", "ep") and o[1] not in ("recv", "irecv")])
    both = sum(max(0.0, min(b, d) - max(a, c)) for a, b in dp for c, d in crit)
    first = min((a for a, _ in crit), default=0.0)
    last = max((b for _, b in crit), default=0.0)
    return {"dp_wire_s": sum(b - a for a, b in dp), "dp_overlapping_pp_ep_sends_s": both,
            "dp_before_first_pp_ep_s": sum(max(0.0, min(b, first) - a) for a, b in dp),
            "dp_after_last_pp_ep_s": sum(max(0.0, b - max(a, last)) for a, b in dp)}


def _plot(per_iter: dict[str, list[float]], speedup: dict[str, float], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(per_iter)
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(names)), 3.8))
    ax.boxplot([per_iter[m] for m in names])
    ax.set_xticks(range(1, len(names) + 1),
                  [m.replace("hermod ", "hermod\n") + f"\n{speedup[m]:.2f}x" for m in names], fontsize=7)
    ax.set_ylabel("iteration time (s, max over ranks)")
    ax.set_title(title, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _parse_variant(s: str) -> dict[str, Any]:
    out: dict[str, Any] = dict(DEFAULT_VARIANT)
    for kv in s.split(","):
        k, v = kv.split("=")
        if k not in (*DEFAULT_VARIANT, "dp_mid", "wire"):
            raise ValueError(f"unknown variant key {k!r}; known: {[*DEFAULT_VARIANT, 'dp_mid', 'wire']}")
        out[k] = float(v) if k == "gate_timeout_s" else v if k == "dp_mid" else int(v)
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rate-mbit", type=float, default=200.0)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--out", default="results/hermod")
    ap.add_argument("--name", default="real", help="output file stem (real -> real.json, real.png)")
    ap.add_argument("--variant", action="append", default=[],
                    help="a Hermod variant: chunk_bytes=N,max_inflight_chunks=N,gate_timeout_s=S[,dp_mid=consumer]"
                         "[,wire=1] (repeatable); wire=1 puts the bulk class on its own address, queued by priority")
    ap.add_argument("--fabric", choices=FABRICS, default="per-rank",
                    help="per-rank: each rank's own shaped link; shared-nic: 2 servers of 2 ranks behind one shaped "
                         "NIC each (see EmulatedFabric)")
    ap.add_argument("--timeline", action="store_true",
                    help="store every rank's ops (kind, op, bytes, start, duration) of the last iteration per variant")
    ap.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--master", help=argparse.SUPPRESS)
    ap.add_argument("--variants-json", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker is not None:
        worker(a.worker, 4, a.master, a.rounds, json.loads(a.variants_json))
        return 0
    if os.geteuid() != 0:
        print("hermod_real needs root (ip netns, tc) for the per-rank emulated links", file=sys.stderr)
        return 2
    hv = [_parse_variant(v) for v in a.variant] or [dict(DEFAULT_VARIANT)]
    variants: dict[str, dict[str, Any]] = {"fifo": {"mode": "fifo"}}
    for v in hv:
        name = f"hermod c{v['chunk_bytes'] >> 10}k i{v['max_inflight_chunks']} g{v['gate_timeout_s'] * 1e3:g}ms"
        if v.get("dp_mid", "last") != "last":
            name += f" {v['dp_mid']}"
        if v.get("wire"):
            name += " wire"
        variants[name] = {"mode": "hermod", **v}
    t0 = time.time()
    res, net = run_all(a.rate_mbit, a.rounds, variants, a.fabric)
    s = summarise(res, variants)
    best = max((m for m in variants if m != "fifo"), key=lambda m: s["speedup"][m])
    doc = {"benchmark": "hermod_real", "label": LABEL, "network": net, "workload": WORK, "layout":
           "rank = dp * 2 + stage; PP groups {0,1},{2,3}; DP = EP groups {0,2},{1,3}",
           "rounds": a.rounds, "alternation": "each round runs every variant once, in the order listed",
           "variants": variants, "iteration_time_s": s["per_iter"], "median_iteration_time_s": s["median"],
           "speedup_vs_fifo": s["speedup"], "best_variant": best, "speedup_hermod_vs_fifo": s["speedup"][best],
           "math_identical": s["math_identical"], "op_timings": s["ops"], "goal": ">= 1.15x",
           "goal_met": s["speedup"][best] >= 1.15, "wall_s": time.time() - t0}
    if a.timeline:
        doc["overlap_last_iteration"] = {m: [_overlap(r[m]["timeline"]) for r in res] for m in variants}
        ov = {m: {k: statistics.mean(o[k] for o in v) for k in v[0]} for m, v in doc["overlap_last_iteration"].items()}
        doc["overlap_mean_over_ranks_s"] = ov
        # sender-side priority can at most remove the time DP shares a rank's link with that rank's PP/EP sends
        doc["fifo_contention_share"] = ov["fifo"]["dp_overlapping_pp_ep_sends_s"] / s["median"]["fifo"]
        doc["timeline_last_iteration"] = {m: [r[m]["timeline"] for r in res] for m in variants}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{a.name}.json").write_text(json.dumps(doc, indent=1))
    _plot(s["per_iter"], s["speedup"], out / f"{a.name}.png",
          f"4 ranks PP2xDP2xEP2, {a.rate_mbit:g} Mbit/s, "
          f"{'per-rank egress' if a.fabric == 'per-rank' else 'one NIC per 2-rank server'} (htb)\n{LABEL}")
    print(json.dumps({k: doc[k] for k in ("median_iteration_time_s", "speedup_vs_fifo", "math_identical",
                                          "goal_met")}, indent=1))
    for m in variants:
        for st, row in s["ops"][m].items():
            print(m, st, {k: f"{v['op_time_per_iter_s'] * 1e3:.0f}ms/it med {v['median_op_s'] * 1e3:.1f}ms"
                          for k, v in row.items()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
