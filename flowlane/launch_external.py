"""Run this process's rank of a job that torchrun (torch.distributed.run / elastic) or Slurm's srun started.

DistDGL's tools/launch.py starts its trainers with torch.distributed.run, so they are torchrun ranks too (its servers
are the DGL plugin's business).

Another tool has started every rank: this process runs its own rank only. :func:`detect_launcher` reads the
launcher's environment (``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/``MASTER_ADDR``/``MASTER_PORT``, or Slurm's
``SLURM_*``) and refuses a partial or contradictory one with a :class:`LauncherEnvError` naming the variable;
:func:`check_world` refuses a job whose world size is not the one the launcher started, and :func:`cuda_device_for`
more local ranks than GPUs, all before any process group or model is made. :func:`run_this_rank` then runs
``fn(rank, world, *args)`` like a rank of :func:`flowlane.launch.launch`: the rendezvous is the launcher's (torch's
``env://``), ``op_timeout`` is the process group's limit for one collective, and every rank's result reaches rank 0
as a list in rank order (None on the other ranks). Nothing here spawns or supervises: the launcher restarts or kills
the group. A process group that does not go away after a failure is abandoned (:func:`destroy_default_group`), so
the rank still exits.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import math
import os
import pickle
import signal
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("flowlane")

_SLURM_EXTRA_STEPS = {"batch", "extern", "interactive", "4294967294", "4294967291", "4294967290"}


class LauncherEnvError(ValueError):
    """The environment an external launcher left is incomplete or contradicts the job; the message names the
    variable, its value and what is allowed. Raised before any process group or model is made."""


@dataclass(frozen=True)
class ExternalLaunch:
    """This process is one rank of a job that torchrun or srun started (see :func:`detect_launcher`)."""

    launcher: str
    """"torchrun" (torch.distributed.run / elastic agent) or "slurm" (srun)."""
    rank: int
    """Global rank of this process, 0 <= rank < world_size."""
    world_size: int
    """Number of ranks in the job (every node)."""
    local_rank: int
    """Rank on this node: the GPU index when each rank has its own GPU."""
    local_world_size: int
    """Ranks on this node."""
    master_addr: str
    """Rendezvous host (rank 0's TCP store)."""
    master_port: int
    """Rendezvous port."""
    run_id: str
    """The job's id as the launcher names it: TORCHELASTIC_RUN_ID, or SLURM_JOB_ID.SLURM_STEP_ID."""

    def describe(self) -> dict[str, Any]:
        return {
            "launcher": self.launcher,
            "world_size": self.world_size,
            "run_id": self.run_id,
            "master": f"{self.master_addr}:{self.master_port}",
            "local_world_size": self.local_world_size,
        }


def _int_var(env: Mapping[str, str], name: str, low: int, who: str, high: int | None = None) -> int:
    raw = env.get(name)
    if raw is None:
        raise LauncherEnvError(
            f"{name} is not set, but {who} sets it: this environment is not a complete "
            f"{who} rank (unset the partial variables, or start the job with {who})"
        )
    try:
        v = int(raw)
    except ValueError:
        raise LauncherEnvError(f"{name}={raw!r} must be an integer") from None
    if v < low or (high is not None and v >= high):
        bound = f">= {low}" + (f" and < {high}" if high is not None else "")
        raise LauncherEnvError(f"{name}={v} must be {bound}")
    return v


def _rendezvous(env: Mapping[str, str], who: str, hint: str) -> tuple[str, int]:
    addr, port = env.get("MASTER_ADDR", ""), env.get("MASTER_PORT", "")
    if not addr or not port:
        missing = [n for n, v in (("MASTER_ADDR", addr), ("MASTER_PORT", port)) if not v]
        raise LauncherEnvError(
            f"{' and '.join(missing)} not set under {who}: the ranks have no rendezvous. {hint}"
        )
    try:
        p = int(port)
    except ValueError:
        p = -1
    if not 0 < p < 65536:
        raise LauncherEnvError(f"MASTER_PORT={port!r} must be a TCP port number in 1..65535")
    return addr, p


def _slurm_tasks_on_node(spec: str, node: int) -> int | None:
    """SLURM_STEP_TASKS_PER_NODE / SLURM_TASKS_PER_NODE ("4(x2),3": 4 tasks on each of 2 nodes, then 3): the count
    on node ``node``, None if the spec cannot be read."""
    counts: list[int] = []
    try:
        for part in spec.split(","):
            n, _, rep = part.partition("(x")
            counts += [int(n)] * (int(rep.rstrip(")")) if rep else 1)
    except ValueError:
        return None
    return counts[node] if 0 <= node < len(counts) else None


def detect_launcher(env: Mapping[str, str] | None = None) -> ExternalLaunch | None:
    """Which external launcher started this process, from its environment (default ``os.environ``); None when
    none did (then the caller launches local ranks itself with :func:`flowlane.launch.launch`).

    torchrun wins where both are set (``srun torchrun ...``: one torchrun agent per node). Slurm counts only inside
    a job step (srun): a batch script running the command directly is no launcher. A partial or contradictory
    environment raises :class:`LauncherEnvError` naming the variable (a world size below the rank, a missing
    rendezvous), before anything is started. A Slurm step of one task (``srun --pty bash``) is no launcher."""
    env = os.environ if env is None else env
    if any(n in env for n in ("RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID")):
        who = "torchrun"
        world = _int_var(env, "WORLD_SIZE", 1, who)
        rank = _int_var(env, "RANK", 0, who, world)
        local_world = _int_var(env, "LOCAL_WORLD_SIZE", 1, who) if "LOCAL_WORLD_SIZE" in env else world
        local_rank = _int_var(env, "LOCAL_RANK", 0, who, local_world)
        if local_world > world:
            raise LauncherEnvError(f"LOCAL_WORLD_SIZE={local_world} must be <= WORLD_SIZE={world}")
        addr, port = _rendezvous(
            env,
            who,
            "torchrun sets them; with a hand-made environment set both "
            "(MASTER_ADDR=<rank 0's host> MASTER_PORT=<free port>)",
        )
        return ExternalLaunch(
            who, rank, world, local_rank, local_world, addr, port, env.get("TORCHELASTIC_RUN_ID", "none")
        )
    step = env.get("SLURM_STEP_ID", env.get("SLURM_STEPID"))
    if "SLURM_PROCID" in env and step is not None and step not in _SLURM_EXTRA_STEPS:
        who = "srun"
        world = _int_var(
            env, "SLURM_STEP_NUM_TASKS" if "SLURM_STEP_NUM_TASKS" in env else "SLURM_NTASKS", 1, who
        )
        if world == 1:  # a one-task step (srun --pty bash, a one-task job): nothing to join; launch locally
            return None
        rank = _int_var(env, "SLURM_PROCID", 0, who, world)
        node = int(env.get("SLURM_NODEID", "0") or 0)
        spec = env.get("SLURM_STEP_TASKS_PER_NODE", env.get("SLURM_TASKS_PER_NODE", ""))
        local_world = _slurm_tasks_on_node(spec, node) or world
        local_rank = _int_var(env, "SLURM_LOCALID", 0, who, local_world)
        addr, port = _rendezvous(
            env,
            who,
            "srun does not choose a rendezvous: in the job script, export "
            'MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1) '
            "and MASTER_PORT=<a free port, e.g. 29500>",
        )
        return ExternalLaunch(
            "slurm",
            rank,
            world,
            local_rank,
            local_world,
            addr,
            port,
            f"{env.get('SLURM_JOB_ID', '?')}.{step}",
        )
    return None


def check_world(ext: ExternalLaunch, nprocs: int, key: str) -> None:
    """The job's parallel layout (``nprocs`` ranks, the recipe's ``key``) must be what the launcher started."""
    if nprocs != ext.world_size:
        raise LauncherEnvError(
            f"{key}={nprocs} does not match the {ext.world_size} ranks {ext.launcher} started "
            f"(WORLD_SIZE={ext.world_size}): pass {key}={ext.world_size}, or start "
            f"{nprocs} ranks"
        )


def cuda_device_for(ext: ExternalLaunch, env: Mapping[str, str] | None = None) -> int:
    """The GPU of this rank: one per local rank (``LOCAL_RANK``). More local ranks than GPUs is refused, as NCCL
    refuses two ranks of one host on one GPU, unless every rank has its own ``NCCL_HOSTID`` (NCCL then takes the
    ranks for hosts of their own; the one-GPU checks in tests/gpu do this)."""
    import torch

    env = os.environ if env is None else env
    n = torch.cuda.device_count()
    if n == 0:
        raise LauncherEnvError(
            "device=cuda but this rank sees no CUDA device (CUDA_VISIBLE_DEVICES="
            f"{env.get('CUDA_VISIBLE_DEVICES', '<unset>')!r})"
        )
    # srun --gpus-per-task=1 (or --gpu-bind) shows each task its own GPU as device 0: fewer visible GPUs than
    # tasks is then the binding, and NCCL itself refuses a real duplicate when the process group starts
    bound = ext.launcher == "slurm" and n == 1
    if ext.local_world_size > n and not env.get("NCCL_HOSTID") and not bound:
        raise LauncherEnvError(
            f"{ext.local_world_size} ranks on this node (LOCAL_WORLD_SIZE) but {n} visible "
            f"GPU(s): one rank per GPU (e.g. torchrun --nproc_per_node {n})"
        )
    return ext.local_rank % n


def run_this_rank(
    fn: Callable[..., Any],
    ext: ExternalLaunch,
    nprocs: int,
    args: Sequence[Any] = (),
    backend: str = "gloo",
    op_timeout: float = 300.0,
    key: str = "nprocs",
) -> list[Any] | None:
    """Run ``fn(rank, world, *args)`` for this process's rank of an externally launched job, then gather every
    rank's result to rank 0: returns the list in rank order on rank 0, None on the others.

    Checks first (:class:`LauncherEnvError`, before anything starts): ``nprocs`` (the recipe's ``key``) equals the
    launcher's world size and, for ``backend="nccl"``, this rank has a GPU (:func:`cuda_device_for`). Then the
    process group is initialised from the launcher's rendezvous (``env://``; with NCCL bound to this rank's GPU),
    and destroyed when ``fn`` has returned."""
    import torch
    import torch.distributed as dist

    check_world(ext, nprocs, key)
    device = None
    if backend == "nccl":
        device = torch.device("cuda", cuda_device_for(ext))
    # torchrun sets these; under srun they are derived here, for code that reads them (devices, Megatron)
    os.environ.update(
        {
            "RANK": str(ext.rank),
            "WORLD_SIZE": str(ext.world_size),
            "LOCAL_RANK": str(ext.local_rank),
            "LOCAL_WORLD_SIZE": str(ext.local_world_size),
            "MASTER_ADDR": ext.master_addr,
            "MASTER_PORT": str(ext.master_port),
        }
    )
    if device is not None:
        torch.cuda.set_device(device)
    log.info("rank %d of %d (%s, %s)", ext.rank, ext.world_size, ext.launcher, backend)
    # device_id binds the group to this rank's GPU (torch >= 2.3; the gnn lane's 2.2 has none)
    bind = {} if device is None else {"device_id": device}
    dist.init_process_group(
        backend,
        init_method="env://",
        rank=ext.rank,
        world_size=ext.world_size,
        timeout=datetime.timedelta(seconds=op_timeout),
        **bind,
    )
    held: list[Any] = []  # the last collectives' tensors, alive until the group is destroyed (see below)
    try:
        result = fn(ext.rank, ext.world_size, *args)
        gathered = _gather_to_rank0(result, ext.rank, ext.world_size, device, held)
        # every rank past the gather before any tears down: a gloo group destroyed while a peer still has work
        # queued on it can block that peer's destroy (seen under DistDGL's launcher, torch 2.2)
        dist.barrier()
        return gathered
    finally:
        destroy_default_group(min(op_timeout, 60.0))  # no work is left: a healthy destroy takes ms
        held.clear()


def _gather_to_rank0(result: Any, rank: int, world: int, device: Any, held: list[Any]) -> list[Any] | None:
    """Every rank's ``result`` (pickled) on rank 0, in rank order; None on the others. Unlike ``gather_object``,
    the tensors the collectives used are put in ``held`` for the caller to keep until the group is destroyed. A
    gloo worker thread drops a finished work item a moment after the caller sees it complete, holding the group's
    lock; if the work held the last reference to a tensor created in Python, dropping it needs the GIL, which
    ``destroy_process_group`` (a Python call) holds while it waits for that lock: both wait for ever (seen in a
    fresh-clone CI on a loaded 2-core machine, torch 2.2, rank 0 of a DistDGL run). With the tensors still
    referenced from Python, the worker only decrements their count."""
    import torch
    import torch.distributed as dist

    payload = torch.frombuffer(bytearray(pickle.dumps(result)), dtype=torch.uint8)
    size = torch.tensor([payload.numel()], dtype=torch.int64, device=device)
    sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world)]
    dist.all_gather(sizes, size)
    longest = max(int(n.item()) for n in sizes)
    padded = torch.zeros(longest, dtype=torch.uint8, device=device)
    padded[: payload.numel()] = payload.to(padded.device)
    rows = [torch.empty(longest, dtype=torch.uint8, device=device) for _ in range(world)]
    dist.all_gather(rows, padded)
    held += [payload, size, *sizes, padded, *rows]
    if rank != 0:
        return None
    return [
        pickle.loads(row[: int(n.item())].cpu().numpy().tobytes()) for row, n in zip(rows, sizes, strict=True)
    ]


def destroy_default_group(
    timeout: float, destroy: Callable[[], None] | None = None, backstop_s: float = 30.0
) -> bool:
    """Destroy the default process group, waiting at most ``timeout`` seconds; True when it returned.

    After a failure a peer may be gone or blocked, and a group's destructor can then wait on it forever; the
    rank must still exit (and reach its framework's own shutdown, e.g. DistDGL's exit barrier), so the destroy
    runs in a daemon thread and is abandoned, with a warning, when it has not returned in time. A destroy blocked
    while holding the GIL (see :func:`_gather_to_rank0`) keeps this thread from ever waking to abandon it: then the
    kernel ends the process ``backstop_s`` seconds later (SIGALRM with its default action, which runs no Python
    code), so a rank stuck there exits with an error instead of hanging."""
    if destroy is None:
        import torch.distributed as dist

        destroy = dist.destroy_process_group
    done = threading.Thread(target=destroy, name="flowlane-destroy-pg", daemon=True)
    with _alarm_backstop(timeout + backstop_s):
        done.start()
        done.join(timeout)
    if done.is_alive():
        log.warning(
            "destroying the process group did not return in %.0f s; leaving it to process exit", timeout
        )
        return False
    return True


@contextlib.contextmanager
def _alarm_backstop(seconds: float) -> Iterator[None]:
    """End the process (SIGALRM, default action: no handler, no GIL needed) if the block runs ``seconds`` longer;
    the signal's previous handler and any pending alarm are restored after it. Only in the main thread (where
    signal handlers are set), where ``signal.alarm`` exists and where SIGALRM's handler can be put back (one set
    from C reads as None and could not be); elsewhere the block runs without a backstop."""
    if (
        threading.current_thread() is not threading.main_thread()
        or not hasattr(signal, "alarm")
        or signal.getsignal(signal.SIGALRM) is None
    ):
        yield
        return
    previous = signal.signal(signal.SIGALRM, signal.SIG_DFL)
    pending = signal.alarm(max(1, math.ceil(seconds)))
    t0 = time.monotonic()
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
        if pending:  # someone's alarm was due: set it again for what is left of it
            signal.alarm(max(1, pending - int(time.monotonic() - t0)))
