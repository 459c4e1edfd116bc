"""What the multi-rank GPU checks share: their flags, the skip when a machine cannot run them, one rank's process
group on the lent machine's single GPU, and the launch that writes the result JSON.

The lent machine has ONE GPU. Each rank gets its own ``NCCL_HOSTID``, so NCCL treats the ranks as separate hosts and
uses its socket transport over loopback (``NCCL_SOCKET_IFNAME=lo``); the ranks time-share the GPU. Every check also
runs with ``--backend gloo --device cpu``: the same steps on CPU, to test the script's logic where no GPU is lent.

A check's ``main`` is::

    a = check_args(__doc__, timeout_s=120)
    if (skip := skip_reason(a.backend, "deepspeed")) is not None:
        print(skip)
        return 0
    out, ranks = run_ranks("name", rank_main, WORLD, a, {"label": ..., "model": MODEL}, ok=_ok, args=(...))
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # the checks run as `python3 tests/gpu/<name>.py` from a copy of the tree
    sys.path.insert(0, str(ROOT))

CPU_LABEL = "dry run on CPU (gloo): the script's logic only"


def check_args(doc: str | None, timeout_s: float) -> argparse.Namespace:
    """The flags every multi-rank check takes: ``--out``, ``--backend nccl|gloo``, ``--device`` and ``--timeout``
    (seconds a rank may go without progress)."""
    ap = argparse.ArgumentParser(description=(doc or "").splitlines()[0] if doc else None)
    ap.add_argument("--out", required=True, help="result JSON path")
    ap.add_argument("--backend", choices=["nccl", "gloo"], default="nccl")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--timeout", type=float, default=timeout_s, help="seconds a rank may go without progress")
    return ap.parse_args()


def skip_reason(backend: str, *modules: str) -> str | None:
    """Why this machine cannot run the check (a line starting ``SKIP:``), or None: NCCL without a CUDA device, or a
    framework that does not import (the lent machine has only what travels in .whl/)."""
    if backend == "nccl":
        import torch

        if not torch.cuda.is_available():
            return "SKIP: no CUDA device (run with --backend gloo --device cpu for the CPU dry run)"
    for name in modules:
        try:
            __import__(name)
        except ImportError as e:
            return f"SKIP: {name} is not importable here ({e})"
    return None


def init_rank(
    rank: int,
    world: int,
    backend: str,
    host_prefix: str,
    timeout_s: float,
    *,
    deterministic: bool = True,
    cpu_setup: Callable[[], None] | None = None,
) -> None:
    """This rank's default process group. NCCL: ``NCCL_HOSTID=<host_prefix><rank>`` (one "host" per rank on the one
    GPU), device 0, and deterministic algorithms when asked. gloo: ``cpu_setup`` first (e.g. Megatron's CPU shim)."""
    import torch
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    if backend == "nccl":
        os.environ["NCCL_HOSTID"] = f"{host_prefix}{rank}"
        torch.cuda.set_device(0)
        dist.init_process_group(
            "nccl", rank=rank, world_size=world, device_id=torch.device("cuda", 0), timeout=timeout
        )
        if deterministic:
            torch.use_deterministic_algorithms(True)
    else:
        if cpu_setup is not None:
            cpu_setup()
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timeout)


def run_ranks(
    name: str,
    rank_main: Callable[..., Any],
    world: int,
    a: argparse.Namespace,
    doc: dict[str, Any],
    ok: Callable[[list[Any]], bool],
    args: Sequence[Any] = (),
) -> tuple[dict[str, Any], list[Any]]:
    """Run ``rank_main(rank, world, *args)`` on ``world`` local processes (flowlane.launch: a rank that dies or
    stalls for ``a.timeout`` s ends the run), then write ``doc`` + ``ranks`` + ``ok`` + ``wall_s`` (or the error)
    with the provenance envelope to ``a.out``, atomically. Returns the document and the ranks' results."""
    from flowlane.launch import launch
    from flowlane.testing.provenance import write_result

    # deterministic cuBLAS, inherited by the ranks
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
    t0 = time.perf_counter()
    out: dict[str, Any] = {"world": world, "backend": a.backend, **doc}
    ranks: list[Any] = []
    try:
        ranks = launch(rank_main, world, args=tuple(args), backend=None, timeout=a.timeout)
        out["ranks"] = ranks
    except Exception:  # noqa: BLE001 - the JSON says what failed
        out["error"] = traceback.format_exc()[-4000:]
    out["wall_s"] = time.perf_counter() - t0
    out["ok"] = bool(ranks) and "error" not in out and ok(ranks)
    write_result(a.out, out)
    print(f"{name}: ok={out['ok']} wall {out['wall_s']:.0f}s")
    if "error" in out:
        print(out["error"][-1500:])
    return out, ranks
