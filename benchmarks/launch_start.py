"""Rank start-up of flowlane.launch: spawned ranks vs ranks forked from a preloading fork server.

Each launch starts ``--ranks`` gloo ranks whose function imports Megatron-core's model and DDP (what the GPT recipe's
ranks import first) and returns; each start method runs ``--launches`` launches in one process, so the fork server's
later launches show what a test suite or a second job in the same process pays. Measured wall seconds per launch,
from the call to the last result. The spawn runs go first in a process of their own, so neither method warms the
other's page cache more than one run does.

    python benchmarks/launch_start.py            # -> results/launch/start.json
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MODULES = ("megatron.core.models.gpt.gpt_layer_specs", "megatron.core.distributed")


def import_megatron(rank: int, world: int) -> float:
    import importlib

    t = time.perf_counter()
    for m in MODULES:
        importlib.import_module(m)
    return time.perf_counter() - t


def _one_method(method: str, ranks: int, launches: int) -> list[float]:
    from benchmarks import launch_start
    from flowlane import launch as L

    if method == "forkserver":
        L.preload(*MODULES)
    out = []
    for _ in range(launches):
        t = time.perf_counter()
        L.launch(launch_start.import_megatron, ranks, timeout=600, start_method=method)
        out.append(round(time.perf_counter() - t, 2))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--launches", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "results" / "launch" / "start.json"))
    ap.add_argument("--method", choices=("spawn", "forkserver"), help=argparse.SUPPRESS)  # one method's child
    a = ap.parse_args()
    if a.ranks < 1 or a.launches < 1:
        ap.error(f"--ranks {a.ranks} and --launches {a.launches} must be >= 1")
    if a.method:
        print(" ".join(map(str, _one_method(a.method, a.ranks, a.launches))))
        return
    from flowlane.testing.provenance import write_result

    per: dict[str, list[float]] = {}
    for method in ("spawn", "forkserver"):
        r = subprocess.run(
            [
                sys.executable,
                __file__,
                "--method",
                method,
                "--ranks",
                str(a.ranks),
                "--launches",
                str(a.launches),
            ],
            capture_output=True,
            text=True,
            check=True,
            cwd=ROOT,
            env={**os.environ, "PYTHONWARNINGS": "ignore"},
        )
        per[method] = [float(x) for x in r.stdout.split()[-a.launches :]]
        print(method, per[method], flush=True)
    doc = {
        "label": "measured (CPU, wall seconds per launch)",
        "ranks": a.ranks,
        "imports": list(MODULES),
        "load_average_1min": os.getloadavg()[0],
        "seconds_per_launch": per,
        "first_launch_ratio_spawn_over_forkserver": round(per["spawn"][0] / per["forkserver"][0], 2),
    }
    print("wrote", write_result(a.out, doc, command="python " + " ".join(sys.argv)))


if __name__ == "__main__":
    main()
