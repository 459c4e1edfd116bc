"""Start N local ranks (gloo over loopback) for tests, demos and benchmarks.

``launch(fn, nprocs)`` spawns ``nprocs`` processes, initialises ``torch.distributed`` in each (rendezvous through a
private FileStore, so parallel test runs never fight over a TCP port) and returns the list of ``fn(rank, world,
*args)`` results in rank order.

A dead or stuck peer is an error, never a hang: when a rank raises, the others are stopped and
:class:`RankFailedError` carries the failing rank and its traceback; when ranks are still running at the deadline,
their Python stacks are dumped (faulthandler on SIGUSR1) and :class:`RankTimeoutError` names each stuck rank and
where it was.
"""

from __future__ import annotations

import contextlib
import datetime
import faulthandler
import multiprocessing as mp
import os
import pickle
import queue
import signal
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any


class LaunchError(RuntimeError):
    """Base class: something went wrong in one of the launched ranks."""


class RankFailedError(LaunchError):
    def __init__(self, rank: int, detail: str) -> None:
        super().__init__(f"rank {rank} failed:\n{detail}")
        self.rank = rank


class RankTimeoutError(LaunchError):
    def __init__(self, ranks: Sequence[int], timeout: float, stacks: Mapping[int, str]) -> None:
        where = "\n".join(f"--- rank {r} stack ---\n{stacks.get(r, '(no stack captured)')}" for r in ranks)
        super().__init__(f"rank(s) {list(ranks)} still running after {timeout:.0f} s (stuck):\n{where}")
        self.ranks = list(ranks)


def _child(fn: Callable[..., Any], rank: int, world: int, args: tuple, backend: str | None, store_dir: str,
           timeout: float, env: Mapping[str, str], results: mp.Queue, threads: int) -> None:
    os.environ.update(env)
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": str(world)})
    stack_file = open(Path(store_dir) / f"stack.{rank}", "w")  # noqa: SIM115 - must outlive this frame
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(threads)
        if backend is not None:
            dist.init_process_group(backend, init_method=f"file://{store_dir}/store", rank=rank, world_size=world,
                                    timeout=datetime.timedelta(seconds=timeout))
        # plain pickle (not the multiprocessing reducer): tensors are copied into the message instead of being
        # shared through file descriptors that vanish when this process exits
        out = pickle.dumps(fn(rank, world, *args))
        results.put(("ok", rank, out))  # report before teardown: a peer's teardown must not delay this result
        # put() only hands the message to a feeder thread; flush it now, because a teardown that blocks in C++
        # without releasing the GIL (seen with gloo on torch 2.2) would starve that thread and lose the result
        results.close()
        results.join_thread()
        if backend is not None and dist.is_initialized():
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - everything must reach the parent
        with contextlib.suppress(ValueError):  # closed: the result was already sent, a teardown error is moot
            results.put(("err", rank, traceback.format_exc()))


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(fn: Callable[..., Any], nprocs: int, args: Sequence[Any] = (), timeout: float = 120.0,
           backend: str | None = "gloo", env: Mapping[str, str] | None = None, threads_per_rank: int = 1) -> list[Any]:
    """Run ``fn(rank, nprocs, *args)`` on ``nprocs`` local ranks and return the results in rank order.

    ``fn`` must be importable (module level), as processes are spawned. ``backend=None`` skips process-group
    initialisation (for frameworks that do their own). ``MASTER_ADDR``/``MASTER_PORT`` are set for those.
    """
    if not isinstance(nprocs, int) or nprocs < 1:
        raise ValueError(f"nprocs must be an integer >= 1, got {nprocs!r}")
    if not timeout > 0:
        raise ValueError(f"timeout must be > 0 seconds, got {timeout!r}")
    ctx = mp.get_context("spawn")
    results: mp.Queue = ctx.Queue()
    base_env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "GLOO_SOCKET_IFNAME": "lo",
                "OMP_NUM_THREADS": str(threads_per_rank), **(env or {})}
    with tempfile.TemporaryDirectory(prefix="flowlane-launch-") as store_dir:
        procs = [ctx.Process(target=_child, args=(fn, r, nprocs, tuple(args), backend, store_dir, timeout, base_env,
                                                   results, threads_per_rank), name=f"flowlane-rank{r}", daemon=False)
                 for r in range(nprocs)]
        for p in procs:
            p.start()
        out: dict[int, Any] = {}
        deadline = time.monotonic() + timeout
        try:
            while len(out) < nprocs:
                try:
                    status, rank, payload = results.get(timeout=0.2)
                except queue.Empty:
                    for r, p in enumerate(procs):
                        # a process that died without reporting (segfault, os._exit, OOM kill)
                        if r not in out and not p.is_alive() and p.exitcode not in (0, None):
                            _drain_errors(results, out)
                            raise RankFailedError(r, f"process exited with code {p.exitcode} without a result") \
                                from None
                    if time.monotonic() > deadline:
                        stuck = [r for r in range(nprocs) if r not in out]
                        raise RankTimeoutError(stuck, timeout, _dump_stacks(procs, stuck, store_dir)) from None
                    continue
                if status == "err":
                    raise RankFailedError(rank, payload)
                out[rank] = pickle.loads(payload)
        finally:
            _stop(procs, graceful=len(out) == nprocs)
            results.close()
    return [out[r] for r in range(nprocs)]


def _drain_errors(results: mp.Queue, out: dict[int, Any]) -> None:
    """A rank that raised reports first: prefer its traceback over a peer's exit code."""
    try:
        while True:
            status, rank, payload = results.get(timeout=0.5)
            if status == "err":
                raise RankFailedError(rank, payload)
            out[rank] = pickle.loads(payload)
    except queue.Empty:
        return


def _dump_stacks(procs: Sequence[mp.Process], ranks: Sequence[int], store_dir: str) -> dict[int, str]:
    for r in ranks:
        if procs[r].is_alive() and procs[r].pid:
            with contextlib.suppress(ProcessLookupError):
                os.kill(procs[r].pid, signal.SIGUSR1)
    time.sleep(0.5)
    stacks = {}
    for r in ranks:
        f = Path(store_dir) / f"stack.{r}"
        stacks[r] = f.read_text()[-4000:] if f.exists() else ""
    return stacks


def _stop(procs: Sequence[mp.Process], graceful: bool) -> None:
    if graceful:  # every rank reported: give them a moment to exit on their own
        for p in procs:
            p.join(timeout=10)
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
            p.join()
