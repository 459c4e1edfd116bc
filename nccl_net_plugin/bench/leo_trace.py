"""Where LEO and Greedy-E2E put each 2 MiB ping-pong request, and what they predicted (issue 32 item 2).

Measured on CPU with emulated links (netns + tbf, scripts/netns.sh): paths 400+100 Mbit/s, with and without the
benchmark's on/off competing TCP flow on the 400 path. Runs greedy and LEO in alternating order (paired runs, so
load drifts hit both), each with FLOWLANE_NET_LEO_TRACE, and summarises per side (ping = sender -> receiver over
the shaped paths; pong = the reverse direction, which scripts/netns.sh leaves unshaped): path placement, medians of
t2 - t1, receiver dwell, end-to-end time and the intra JCT LEO predicted, the learnt BW(p) and T_tr(p), and the
ping-pong RTT p50/p99. A crossed study (400+100, no flow) then sets the ping side's and the pong side's selector
independently (fl_driver's FL_DRIVER_RECV_SELECTOR), to tell a selector's effect from run-to-run noise.
Writes results/nccl_net_plugin/leo_paths.json (with provenance). Needs root.

    python nccl_net_plugin/bench/leo_trace.py [--repeats 3] [--iters 60]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import re
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))
import nccl_net_plugin_bench as B  # noqa: E402  (Netns, competitor, _driver: the benchmark's own tooling)

from flowlane.testing.provenance import provenance  # noqa: E402

OUT = ROOT / "results" / "nccl_net_plugin" / "leo_paths.json"
SCENARIOS = {"4to1": ("400,100", None), "4to1_varying": ("400,100", (0.5, 0.5))}
CROSSED = (("greedy", "greedy"), ("leo", "greedy"), ("greedy", "leo"), ("leo", "leo"))  # (ping side, pong side)


def _parse(trace: Path, warmup: int) -> dict:
    """Per process (one sends pings, the other pongs): placement and timing medians after the warm-up."""
    choose, done = collections.defaultdict(list), collections.defaultdict(list)
    for line in trace.read_text().splitlines():
        head = line.split("|")[0]
        d = dict(re.findall(r"(\w+)=(\S+)", head))
        if line.startswith("choose"):
            paths = {int(m[0]): {"bw": float(m[1]), "ttr": float(m[2])}
                     for m in re.findall(r"p(\d+) cost=\S+ bw=(\S+) ttr=(\S+)", line)}
            choose[d["pid"]].append({"path": int(d["path"]), "paths": paths})
        elif line.startswith("done"):
            done[d["pid"]].append({k: float(d[k]) for k in ("path", "wait", "dwell", "e2e", "predicted")})
    sides = {}
    for pid, dn in done.items():
        dn = dn[warmup:]
        ch = choose[pid][warmup:]
        med = {k: statistics.median(x[k] for x in dn) / 1e6 for k in ("wait", "dwell", "e2e", "predicted")}
        last = ch[-1]["paths"] if ch else {}
        side = "ping" if med["dwell"] > 10 else "pong"  # the shaped direction takes > 40 ms per 2 MiB
        sides[side] = {"requests_per_path": dict(collections.Counter(str(int(x["path"])) for x in dn)),
                       "median_ms": {"t2_minus_t1": med["wait"], "receiver_dwell": med["dwell"],
                                     "end_to_end": med["e2e"], "predicted_intra_jct": med["predicted"]},
                       "learnt_at_end": {f"path{p}": {"bw_mbit_s": v["bw"] * 8e3, "t_tr_ms": v["ttr"] / 1e6}
                                         for p, v in last.items()}}
    return sides


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3, help="paired runs per scenario")
    ap.add_argument("--iters", type=int, default=60, help="measured ping-pongs per run (plus 10 warm-up)")
    args = ap.parse_args()
    if args.repeats < 1 or args.iters < 2:
        ap.error(f"--repeats must be >= 1 and --iters >= 2, got {args.repeats} and {args.iters}")
    if os.geteuid() != 0:
        print("leo_trace: needs root for network namespaces; nothing run", file=sys.stderr)
        return 0
    B.subprocess.run(["make", "-s", "-C", str(B.PLUGIN_DIR), "all"], check=True)
    load = [os.getloadavg()[0]]
    runs: dict = {sc: {"greedy": [], "leo": []} for sc in SCENARIOS}
    with tempfile.TemporaryDirectory() as tmp:
        for sc, (rates, comp) in SCENARIOS.items():
            with B.Netns(rates) as ns:
                ctx = B.competitor(ns, 0, *comp) if comp else contextlib.nullcontext()
                with ctx:
                    for rep in range(args.repeats):
                        for sel in (("greedy", "leo") if rep % 2 == 0 else ("leo", "greedy")):
                            trace = Path(tmp) / f"{sc}_{sel}_{rep}.log"
                            env = {"FLOWLANE_NET_PATH_SELECTOR": sel, "FLOWLANE_NET_LEO_TRACE": str(trace)}
                            pp = B._driver(*ns.args(), "--ping-size", str(2 << 20), "--iters", str(args.iters),
                                           "--ping-class", "2", "--timeout", "120", "bench-pingpong", env=env)
                            r = {"rtt_ms_p50": pp["rtt_us_p50"] / 1e3, "rtt_ms_p99": pp["rtt_us_p99"] / 1e3,
                                 "load_1min": os.getloadavg()[0], **_parse(trace, 10)}
                            runs[sc][sel].append(r)
                            print(sc, sel, rep, json.dumps(r), flush=True)
        crossed: dict = {f"ping_{a}_pong_{b}": [] for a, b in CROSSED}
        with B.Netns("400,100") as ns:
            for rep in range(args.repeats):
                for a, b in (CROSSED if rep % 2 == 0 else CROSSED[::-1]):
                    trace = Path(tmp) / f"crossed_{a}_{b}_{rep}.log"
                    env = {"FLOWLANE_NET_PATH_SELECTOR": a, "FL_DRIVER_RECV_SELECTOR": b,
                           "FLOWLANE_NET_LEO_TRACE": str(trace)}
                    pp = B._driver(*ns.args(), "--ping-size", str(2 << 20), "--iters", str(args.iters),
                                   "--ping-class", "2", "--timeout", "120", "bench-pingpong", env=env)
                    r = {"rtt_ms_p50": pp["rtt_us_p50"] / 1e3, "rtt_ms_p99": pp["rtt_us_p99"] / 1e3,
                         "load_1min": os.getloadavg()[0], **_parse(trace, 10)}
                    crossed[f"ping_{a}_pong_{b}"].append(r)
                    print("crossed", a, b, rep, json.dumps(r), flush=True)
    load.append(os.getloadavg()[0])
    crossed_med = {k: {"rtt_ms_p50": statistics.median(r["rtt_ms_p50"] for r in v),
                       "rtt_ms_p99": statistics.median(r["rtt_ms_p99"] for r in v),
                       "ping_end_to_end_ms": statistics.median(r["ping"]["median_ms"]["end_to_end"] for r in v),
                       "ping_end_to_end_ms_runs": [r["ping"]["median_ms"]["end_to_end"] for r in v]}
                   for k, v in crossed.items()}
    med = {sc: {sel: {k: statistics.median(r[k] for r in v) for k in ("rtt_ms_p50", "rtt_ms_p99")}
                for sel, v in d.items()} for sc, d in runs.items()}
    ratios = {sc: {k: m["leo"][k] / m["greedy"][k] for k in ("rtt_ms_p50", "rtt_ms_p99")} for sc, m in med.items()}
    out = {"label": B.LABEL + "; per-request trace (FLOWLANE_NET_LEO_TRACE)", "scenarios": SCENARIOS,
           "ping_bytes": 2 << 20, "iters": args.iters, "load_average_1min_at_start_and_end": load,
           "runs": runs, "median": med, "leo_over_greedy": ratios, "crossed_runs": crossed, "crossed_median": crossed_med,
           "provenance": provenance()}
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(out, indent=2))
    print(json.dumps({"median": med, "leo_over_greedy": ratios, "crossed_median": crossed_med}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
