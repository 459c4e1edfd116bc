"""Start N local ranks (gloo over loopback) for tests, demos, benchmarks and the recipes.

``launch(fn, nprocs)`` starts ``nprocs`` processes, initialises ``torch.distributed`` in each (rendezvous through a
private FileStore, so parallel test runs never fight over a TCP port) and returns the list of ``fn(rank, world,
*args)`` results in rank order.

A dead or stuck peer is an error, never a hang, and a healthy run is never killed for taking long:

- start-up (the fork server's imports, spawn, imports, rendezvous) has its own limit, ``startup_timeout``;
- after start-up a rank is stuck only when it makes no progress for ``timeout`` seconds. Progress is a
  :func:`heartbeat` call or a finished :func:`flowlane.trace.span` (the recipes record spans every step), so a run
  lasts as long as it keeps moving; a stuck rank's Python stack is dumped (faulthandler on SIGUSR1);
- ``op_timeout`` is the process group's limit for one collective.

Ranks fork from a fork server (``multiprocessing``'s forkserver) that has imported ``fn``'s module, and the modules
named with :func:`preload`, once: four ranks of a Megatron-core job pay its ~20 s of imports (CPU) once instead of
four times. On a machine with a GPU device node the ranks are spawned instead (a fork server's imports could
initialise CUDA, and a forked child cannot use it); ``start_method`` overrides either. A rank sees the launcher's
environment as it is at ``launch`` (plus ``env``), as a spawned one would.

A failure names the rank at fault, not the peer that lost it: a rank killed by a signal (``kill -9``, the OOM killer)
or stopped (``kill -STOP``: the one not answering) comes first, then one that exited without a result, then the
first that raised (with its traceback); the other ranks' errors follow. A rank that crashed in native code
(SIGSEGV, SIGBUS, SIGABRT, ...) comes with every thread's Python stack at the crash (faulthandler).

SIGTERM, SIGINT and SIGHUP to the launcher are forwarded: every rank gets SIGTERM and unwinds (``finally`` blocks
and atexit handlers run, so offload directories are removed), the launcher waits for them, removes its launch
directory and raises :class:`LaunchInterrupted`. A launcher that dies without a word (``kill -9``) is noticed by its
ranks (PR_SET_PDEATHSIG, and each rank checks its parent twice a second): they stop the same way and also remove the
launch directory. A stopping rank's exit is bounded: exit hooks that do not return within seconds are abandoned
(flowlane's offload directories are removed regardless), and a rank whose normal exit hangs (a thread that never ends,
a native teardown) is ended by the kernel (SIGALRM) instead of running on as an orphan that ignores SIGTERM.

A job that torchrun or srun started runs its own rank with :mod:`flowlane.launch_external` instead.
"""

from __future__ import annotations

import _thread
import atexit
import contextlib
import ctypes
import datetime
import faulthandler
import itertools
import logging
import multiprocessing as mp
import os
import pickle
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

log = logging.getLogger("flowlane")

_FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
# a rank's PR_SET_PDEATHSIG: a signal of its own, so a rank knows its launcher is dying even before the launcher's
# other threads are gone (SIGTERM could also be the launcher's own stop)
_LAUNCHER_DIED = signal.SIGRTMIN + 7
_RANK_BLOCKED = (*_FORWARDED, _LAUNCHER_DIED)  # taken by the rank's signal thread only
_BEAT_EVERY_S = 0.5  # a rank reports progress at most this often; stall timeouts are seconds or more
# after the first failure: time for its cause to show (a killed peer's exit, the others' errors)
_SETTLE_S = 2.0
_RANK_GRACE_S = 2.0  # a signalled rank blocked in native code past this runs its atexit cleanup and exits
_CLEANUP_S = 5.0  # a stopping rank's wait for its exit hooks (atexit) before it exits without the rest
_EXIT_GUARD_S = 30  # a rank's own exit (thread joins, atexit, interpreter teardown) past this ends by SIGALRM
_PARENT_POLL_S = 0.5  # how often a rank checks that its launcher is alive
_STARTUP_NOTE_S = 15.0  # while ranks start (imports take minutes on a busy host), say so this often
_STARTUP_MIN_S = 300.0  # startup_timeout's default is max(this, timeout)
_STOP_GRACE_S = 10.0  # the launcher's wait for signalled ranks before SIGKILL
_START_METHODS = ("auto", "forkserver", "spawn")
_PRELOAD: list[str] = []  # modules the fork server imports before its first rank (see preload())
_SERVER_NOTED = False  # the fork server's start was logged (it lives as long as this process)
_SERVER_READY: int | None = None  # pid of the fork server known to have finished its imports
_PRELOAD_MISSING: set[str] = set()  # preload names this Python cannot find (warned about once)
# for ranks that cannot answer at all; one that answers is read as soon as it has written
_STACK_WAIT_S = 10.0


class LaunchError(RuntimeError):
    """Base class: something went wrong in one of the launched ranks. ``rank`` is the rank at fault, if known."""

    rank: int | None = None


class RankFailedError(LaunchError):
    def __init__(self, rank: int, detail: str, headline: str | None = None) -> None:
        super().__init__(f"{headline or f'rank {rank} failed'}:\n{detail}")
        self.rank = rank
        self.detail = detail


class RankTimeoutError(LaunchError):
    def __init__(
        self,
        ranks: Sequence[int],
        timeout: float,
        stacks: Mapping[int, str],
        phase: str = "stall",
        culprit: int | None = None,
        note: str = "",
        key: str | None = None,
    ) -> None:
        where = "\n".join(f"--- rank {r} stack ---\n{stacks.get(r) or '(no stack captured)'}" for r in ranks)
        if phase == "start-up":
            fix = (
                f"raise {key} on a slow machine: start-up may take max({_STARTUP_MIN_S:g}, {key}) s"
                if key
                else "raise startup_timeout on a slow machine"
            )
            what = (
                f"rank(s) {list(ranks)} did not start within {timeout:g} s (spawn, imports, process-group "
                f"rendezvous; {fix})"
            )
        else:
            what = (
                f"rank(s) {list(ranks)} made no progress for {timeout:g} s (stuck; progress is "
                f"flowlane.launch.heartbeat() or a finished flowlane.trace.span{f'; the limit is {key}' if key else ''})"
            )
        super().__init__(f"{what}:\n{note}{where}")
        self.ranks = list(ranks)
        self.timeout = timeout
        self.phase = phase
        self.rank = culprit if culprit is not None else self.ranks[0]


class LaunchInterrupted(LaunchError):
    """The launcher got SIGTERM/SIGINT/SIGHUP: every rank was stopped and its directories removed."""

    def __init__(self, signum: int, nprocs: int) -> None:
        super().__init__(
            f"interrupted by {signal.Signals(signum).name}: all {nprocs} ranks were stopped "
            "and their launch and offload directories removed"
        )
        self.signum = signum


class RankInterrupted(BaseException):
    """Raised in a rank's main thread when it is told to stop; a BaseException, so ``except Exception`` lets it
    through and the rank unwinds."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"rank stopped by {signal.Signals(signum).name}")
        self.signum = signum


def check_output_dir(path: str | os.PathLike, key: str) -> Path:
    """Create ``path`` if needed and prove a file can be written there, before any work: a run must never end with
    its results unwritable. Raises ValueError naming ``key`` (the option as the user wrote it)."""
    if not isinstance(path, str | os.PathLike) or not str(path):
        raise ValueError(f"{key}={path!r} must be a folder path")
    p = Path(path)
    try:
        p.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=p, prefix=".flowlane-write-probe-")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise ValueError(
            f"{key}={str(path)!r} is not a writable folder ({e.strerror or e}); "
            f"pick another with {key} <folder>"
        ) from None
    return p


# ------------------------------------------------------------------------------------------------ in the rank
class _Channel:
    """The rank's end of its pipe to the launcher (sends from any thread)."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.lock = threading.Lock()
        self.last_beat = 0.0
        self.interrupted = False
        self.stopping = False  # the signal thread owns the exit: the main thread parks when it has unwound
        self.requested: int | None = None  # a signal the main thread's handler took (see _raise_interrupted)
        self.unwound = threading.Event()  # the main thread has left fn (unwound or finished)

    def send(self, kind: str, payload: Any = None) -> None:
        with self.lock:
            self.conn.send_bytes(pickle.dumps((kind, payload)))


_CHANNEL: _Channel | None = None


def heartbeat() -> None:
    """Tell the launcher this rank is making progress (call it every step; cheap, rate-limited). A no-op outside
    a launched rank."""
    ch = _CHANNEL
    if ch is None:
        return
    now = time.monotonic()
    if now - ch.last_beat < _BEAT_EVERY_S:
        return
    ch.last_beat = now
    with contextlib.suppress(OSError, ValueError):  # the launcher is gone: its SIGTERM (PDEATHSIG) follows
        ch.send("beat")


def _raise_interrupted(signum: int, frame: Any) -> None:
    # The main thread's handler: the signal thread interrupts it, or a signal reached a thread that does not block
    # them (one a library started before the rank blocked them) and Python runs the handler here. Either way the
    # signal thread then owns the exit (``stopping``: the main thread parks once it has unwound).
    ch = _CHANNEL
    if ch is None or ch.interrupted:
        return  # unwinding already: let the finally blocks finish
    ch.interrupted = ch.stopping = True
    ch.requested = signum
    raise RankInterrupted(signal.SIGTERM if signum == _LAUNCHER_DIED else signum)


def _stat(pid: int | None) -> list[str]:
    """/proc/PID/stat's fields after the command name (state first, start time at [19]); empty if unreadable."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return []
    return fields if len(fields) > 19 else []


def _start_time(pid: int) -> str | None:
    """Start time in clock ticks: a pid with another start time is another process."""
    fields = _stat(pid)
    return fields[19] if fields else None


def _watch(parent_pid: int, store_dir: str) -> None:
    # Python runs signal handlers only in the main thread and only between bytecodes; a rank blocked in a
    # collective would never see them. This thread takes the (blocked) signals instead and also checks that the
    # launcher lives (PR_SET_PDEATHSIG is set only once the rank runs, and a subreaper may adopt the rank).
    assert _CHANNEL is not None
    while True:
        info = signal.sigtimedwait(set(_RANK_BLOCKED), _PARENT_POLL_S)
        signum = info.si_signo if info is not None else _CHANNEL.requested
        if signum == _LAUNCHER_DIED:
            _stop_rank(int(signal.SIGTERM), parent_pid, store_dir, launcher_died=True)
        if signum is not None or _launcher_gone(parent_pid):
            _stop_rank(signum or int(signal.SIGTERM), parent_pid, store_dir)


_LAUNCHER_START: str | None = None  # the launcher's start time, read when the rank starts (it lives then)


def _launcher_gone(parent_pid: int) -> bool:
    # not os.getppid(): a rank forked by the fork server has the server as its parent
    fields = _stat(parent_pid)
    if not fields or fields[0] in ("Z", "X"):
        return True
    return _LAUNCHER_START is not None and fields[19] != _LAUNCHER_START  # the pid was reused


def _stop_rank(signum: int, parent_pid: int, store_dir: str, launcher_died: bool = False) -> None:
    """Interrupt the main thread, let it unwind (``finally`` blocks) for a grace period, run the exit hooks for a
    bounded time, and exit. Never returns. A dead launcher cannot remove its directory (``store_dir``): this does."""
    ch = _CHANNEL
    assert ch is not None
    ch.stopping = True
    if not ch.interrupted and not ch.unwound.is_set():
        _thread.interrupt_main(signum)
    ch.unwound.wait(_RANK_GRACE_S)
    hooks = threading.Thread(target=_run_exit_hooks, name="flowlane-exit-hooks", daemon=True)
    hooks.start()
    hooks.join(_CLEANUP_S)
    if hooks.is_alive():  # a hook hangs: the ones after it in atexit's order never run; flowlane's own must
        _remove_offload_dirs()
    if launcher_died or _launcher_gone(parent_pid):
        shutil.rmtree(store_dir, ignore_errors=True)
    os._exit(128 + signum)


def _run_exit_hooks() -> None:
    with contextlib.suppress(Exception):
        atexit._run_exitfuncs()
    for f in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            f.flush()


def _remove_offload_dirs() -> None:
    # flowlane.offload removes its per-run directories from an atexit hook (flowlane/offload/backends.py); run that
    # hook directly when another one blocks the queue. Looked up, not imported: a rank without offload has none.
    mod = sys.modules.get("flowlane.offload.backends")
    remove = getattr(mod, "_remove_live_run_dirs", None)
    if callable(remove):
        with contextlib.suppress(Exception):
            remove()


def _install_rank_signals(parent_pid: int, store_dir: str) -> None:
    global _LAUNCHER_START
    _LAUNCHER_START = _start_time(parent_pid)
    for s in _RANK_BLOCKED:
        signal.signal(s, _raise_interrupted)
    # blocked here (already, from the launcher) and so in every thread this rank starts
    signal.pthread_sigmask(signal.SIG_BLOCK, _RANK_BLOCKED)
    threading.Thread(
        target=_watch, args=(parent_pid, store_dir), name="flowlane-signals", daemon=True
    ).start()
    # Linux: a signal when the parent dies, however it dies. A forked rank's parent is the fork server, which exits
    # when the launcher does (its end of the launcher's pipe closes); the watch thread checks the launcher itself.
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(1, int(_LAUNCHER_DIED), 0, 0, 0)  # PR_SET_PDEATHSIG


def _leave(ch: _Channel) -> None:
    """The main thread's last step in a rank. A stopping rank waits here for the signal thread to end it (one owner
    of the exit); otherwise the normal exit follows (thread joins, atexit, interpreter teardown) with the signal
    thread still watching until the teardown, and a kernel alarm bounds it: after it nothing could stop a hang,
    as the forwarded signals are blocked in every thread."""
    ch.unwound.set()
    if ch.stopping:
        while True:
            time.sleep(3600)
    signal.signal(signal.SIGALRM, signal.SIG_DFL)
    signal.alarm(_EXIT_GUARD_S)


def _child(
    fn: Callable[..., Any],
    rank: int,
    world: int,
    args: tuple,
    backend: str | None,
    store_dir: str,
    op_timeout: float,
    env: Mapping[str, str],
    conn: Connection,
    threads: int,
    parent_pid: int,
) -> None:
    global _CHANNEL
    _CHANNEL = ch = _Channel(conn)
    _install_rank_signals(parent_pid, store_dir)
    if os.environ != env:  # a forked rank has the fork server's environment: take the launcher's
        os.environ.clear()
        os.environ.update(env)
    os.environ.update(
        {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world)}
    )
    stack_file = open(Path(store_dir) / f"stack.{rank}", "w")  # noqa: SIM115 - must outlive this frame
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    # a crash in native code (SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT) leaves every thread's Python stack here
    crash_file = open(Path(store_dir) / f"crash.{rank}", "w")  # noqa: SIM115 - must outlive this frame
    faulthandler.enable(file=crash_file, all_threads=True)
    if "torch" in sys.modules:  # imported by the fork server, before OMP_NUM_THREADS was this rank's
        sys.modules["torch"].set_num_threads(threads)
    try:
        if backend is not None:
            import torch
            import torch.distributed as dist

            torch.set_num_threads(threads)
            # every rank has its imports done: the rendezvous below is quick
            _arrive(store_dir, rank, world, ch)
            # torch's barrier at the end of init: a rank whose fn returns at once must not exit (closing its
            # sockets) while a peer is still connecting to it (gloo's connectFullMesh then fails in that peer)
            # (only there: fn's own new_group calls keep the rank's setting)
            barrier = os.environ.get("TORCH_DIST_INIT_BARRIER")
            os.environ["TORCH_DIST_INIT_BARRIER"] = "1"
            try:
                dist.init_process_group(
                    backend,
                    init_method=f"file://{store_dir}/store",
                    rank=rank,
                    world_size=world,
                    timeout=datetime.timedelta(seconds=op_timeout),
                )
            finally:
                if barrier is None:
                    del os.environ["TORCH_DIST_INIT_BARRIER"]
                else:
                    os.environ["TORCH_DIST_INIT_BARRIER"] = barrier
        ch.send("ready")
        # plain pickle (not the multiprocessing reducer): tensors are copied into the message instead of being
        # shared through file descriptors that vanish when this process exits. Sent from this thread, before
        # teardown: a peer's teardown must not delay or lose this result.
        ch.send("ok", pickle.dumps(fn(rank, world, *args)))
        if backend is not None and dist.is_initialized():
            dist.destroy_process_group()
    except BaseException as e:  # noqa: BLE001 - everything must reach the parent
        signum = e.signum if isinstance(e, RankInterrupted) else None
        with contextlib.suppress(OSError, ValueError):
            ch.send("err", (traceback.format_exc(), signum))
    finally:
        _leave(ch)


def _arrive(store_dir: str, rank: int, world: int, ch: _Channel) -> None:
    """Wait for every rank to get here. Slow imports on a busy host are start-up (startup_timeout, enforced by the
    launcher), not a collective that timed out after op_timeout."""
    ch.send("imported")
    Path(store_dir, f"arrived.{rank}").touch()
    while not all(Path(store_dir, f"arrived.{r}").exists() for r in range(world)):
        time.sleep(0.05)


# ------------------------------------------------------------------------------------------------ in the launcher
def free_port() -> int:
    """A TCP port free on the loopback interface now (the OS picks it; another process may take it before use, so
    callers bind it soon: a rendezvous, a DistDGL server)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class _Failure:
    rank: int
    severity: int  # 0: killed by a signal or stopped (a root cause), 1: exited without a result, 2: raised
    seq: int  # order observed
    headline: str | None
    text: str


@dataclass
class _Rank:
    rank: int
    proc: Any  # multiprocessing Process (forkserver or spawn context)
    conn: Connection | None
    started: float
    ready: float | None = None
    progress: float = 0.0
    exited: bool = False
    done: bool = False
    result: Any = None
    failure: _Failure | None = field(default=None, repr=False)


class _Interrupts:
    """While launching: SIGTERM/SIGINT/SIGHUP raise LaunchInterrupted (the finally then stops every rank); during
    that cleanup they are only recorded, so a second Ctrl-C cannot cut it short."""

    def __init__(self, nprocs: int) -> None:
        self.nprocs = nprocs
        self.signum: int | None = None
        self.stopping = False
        self.prev: dict[int, Any] = {}

    def __enter__(self) -> _Interrupts:
        if threading.current_thread() is threading.main_thread():
            for s in _FORWARDED:
                self.prev[s] = signal.signal(s, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signum is None:
            self.signum = signum
        if not self.stopping:
            self.stopping = True
            raise LaunchInterrupted(signum, self.nprocs)

    def __exit__(self, *exc: Any) -> None:
        for s, h in self.prev.items():
            signal.signal(s, h if h is not None else signal.SIG_DFL)  # None: set outside Python
        if self.signum is not None and not isinstance(exc[1], LaunchInterrupted):
            raise LaunchInterrupted(self.signum, self.nprocs)


def preload(*modules: str) -> None:
    """Name modules for the ranks' fork server to import once, before its first rank (a test suite's heavy frameworks,
    say). ``fn``'s own module is always preloaded. The fork server lives as long as this process and keeps the modules
    it started with, so call this before the first :func:`launch`."""
    for m in modules:
        if not (isinstance(m, str) and m and all(part.isidentifier() for part in m.split("."))):
            raise ValueError(
                f"preload: {m!r} is not a module name (dotted identifiers, like 'megatron.core')"
            )
        if m not in _PRELOAD:
            _PRELOAD.append(m)


def _rank_context(fn: Callable[..., Any], start_method: str) -> tuple[Any, list[str] | None]:
    """(the multiprocessing context, the fork server's preload modules or None for spawn)."""
    if start_method not in _START_METHODS:
        raise ValueError(f"start_method must be one of {', '.join(_START_METHODS)}, got {start_method!r}")
    if start_method == "auto":
        gpu = any(Path("/dev").glob("nvidia[0-9]*")) or Path("/dev/kfd").exists()
        start_method = "spawn" if gpu else "forkserver"
    ctx = mp.get_context(start_method)
    modules = None
    if start_method == "forkserver":
        mod = getattr(fn, "__module__", None)
        # __main__ is re-imported in every rank as __mp_main__, as under spawn
        modules = [*_PRELOAD, *([mod] if mod and mod != "__main__" else [])]
        # the fork server skips a module that fails to import without a word: one this Python cannot find is left
        # out here and said so (a lane's venv lacks the other lane's frameworks: tests/conftest.py names both)
        for m in [m for m in modules if not _findable(m)]:
            modules.remove(m)
            if m not in _PRELOAD_MISSING:
                _PRELOAD_MISSING.add(m)
                log.warning("preload: %r is not found by this Python (%s): not preloaded", m, sys.executable)
        ctx.set_forkserver_preload(modules)
        global _SERVER_NOTED
        if not _SERVER_NOTED:  # its imports delay the first rank (~20 s for Megatron-core): say why
            _SERVER_NOTED = True
            log.info(
                "ranks fork from a fork server; it imports %s once first", ", ".join(modules) or "nothing"
            )
    return ctx, modules


def _findable(name: str) -> bool:
    """Whether module ``name`` is on this Python's path, found without importing it or its parents
    (importlib.util.find_spec imports the parents: Megatron-core's would cost the launcher its ~20 s)."""
    import importlib.machinery
    import importlib.util

    parts = name.split(".")
    try:
        spec = importlib.util.find_spec(parts[0])
        for i in range(2, len(parts) + 1):
            if spec is None or spec.submodule_search_locations is None:
                return False
            sub = ".".join(parts[:i])
            loaded = sys.modules.get(sub)
            spec = getattr(loaded, "__spec__", None) or importlib.machinery.PathFinder.find_spec(
                sub, list(spec.submodule_search_locations)
            )
    except (ImportError, ValueError):
        return False
    return spec is not None


def _server_ready() -> None:
    """The fork server's first child, forked once its imports are done; does nothing."""


def _start_fork_server(
    ctx: Any, modules: list[str], startup_timeout: float, nprocs: int, key: str | None
) -> None:
    """Start the ranks' fork server and wait, within ``startup_timeout``, until it has imported ``modules`` (a rank
    asked of it before then waits in ``Process.start`` with no limit, and a signal there left the request queued:
    rank 0 forked after the launcher had gone). Its first child is a no-op that proves the imports are done.
    A server that does not finish in time, or is interrupted, is killed; one that exits is a LaunchError."""
    global _SERVER_READY
    from multiprocessing import forkserver, resource_tracker

    # the resource tracker's first start unblocks SIGINT and SIGTERM in this thread (CPython's resource_tracker.py):
    # start it before they are blocked, then the fork server with them blocked (ranks inherit its mask, see launch)
    resource_tracker.ensure_running()
    old = signal.pthread_sigmask(signal.SIG_BLOCK, _RANK_BLOCKED)
    try:
        forkserver.ensure_running()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)
    pid = forkserver._forkserver._forkserver_pid  # private, CPython 3.8-3.13
    if pid == _SERVER_READY:
        return
    done = threading.Event()
    failed: list[BaseException] = []

    def first_child() -> None:
        try:
            p = ctx.Process(target=_server_ready, name="flowlane-fork-server-ready", daemon=True)
            p.start()
            p.join()
        except BaseException as e:  # noqa: BLE001 - reported by the launcher's thread
            failed.append(e)
        finally:
            done.set()

    waiter = threading.Thread(target=first_child, name="flowlane-fork-server-wait", daemon=True)
    t0 = last = time.monotonic()
    waiter.start()
    try:
        while not done.wait(0.5):
            now = time.monotonic()
            if now - last >= _STARTUP_NOTE_S:
                last = now
                log.info(
                    "still starting: the fork server is importing %s after %.0f s (startup_timeout=%g s)",
                    ", ".join(modules),
                    now - t0,
                    startup_timeout,
                )
            if now - t0 > startup_timeout:
                note = f"the ranks' fork server was still importing {', '.join(modules)}; it was stopped\n"
                raise RankTimeoutError(
                    list(range(nprocs)), startup_timeout, {}, "start-up", note=note, key=key
                )
    finally:
        if not done.is_set():  # timed out or interrupted: no rank may fork from it later
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
            waiter.join(10)
    if failed:
        raise LaunchError(
            f"the ranks' fork server {_exit_text(pid)} while importing {', '.join(modules)} "
            f"({type(failed[0]).__name__}; its own error, if any, is printed above)"
        ) from failed[0]
    _SERVER_READY = pid


def _exit_text(pid: int) -> str:
    """'exited with code N' or 'was killed by SIGX' for a child that has ended (not reaped: its owner reaps it)."""
    for _ in range(20):
        try:
            info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return "exited"
        if info is not None:
            if info.si_code == os.CLD_EXITED:
                return f"exited with code {info.si_status}"
            return f"was killed by {signal.Signals(info.si_status).name}"
        time.sleep(0.05)
    return "stopped answering"


def launch(
    fn: Callable[..., Any],
    nprocs: int,
    args: Sequence[Any] = (),
    timeout: float = 120.0,
    backend: str | None = "gloo",
    env: Mapping[str, str] | None = None,
    threads_per_rank: int = 1,
    *,
    startup_timeout: float | None = None,
    op_timeout: float | None = None,
    start_method: str = "auto",
    timeout_key: str | None = None,
) -> list[Any]:
    """Run ``fn(rank, nprocs, *args)`` on ``nprocs`` local ranks and return the results in rank order.

    ``timeout``: seconds a started rank may go without progress (:func:`heartbeat`, a finished trace span, its
    result) before it counts as stuck. ``startup_timeout`` (default ``max(300, timeout)``): seconds for every rank
    to start. ``op_timeout`` (default ``timeout``): the process group's timeout for one collective.

    ``fn`` must be importable (module level). ``backend=None`` skips process-group initialisation (for frameworks
    that do their own). ``MASTER_ADDR``/``MASTER_PORT`` are set for those. ``start_method``: ``auto`` (fork server
    without a GPU, spawn with one), ``forkserver`` or ``spawn``. ``timeout_key``: the name the caller's user gives
    ``timeout`` (a recipe's ``timeout_s``); the timeout errors tell them to raise it.
    """
    if not isinstance(nprocs, int) or isinstance(nprocs, bool) or nprocs < 1:
        raise ValueError(f"nprocs must be an integer >= 1, got {nprocs!r}")
    startup_key = timeout_key if startup_timeout is None else None  # start-up's limit follows timeout
    startup_timeout = (
        max(_STARTUP_MIN_S, timeout) if startup_timeout is None and timeout > 0 else startup_timeout
    )
    op_timeout = timeout if op_timeout is None else op_timeout
    for name, v in (("timeout", timeout), ("startup_timeout", startup_timeout), ("op_timeout", op_timeout)):
        if not (isinstance(v, int | float) and v > 0):
            raise ValueError(f"{name} must be > 0 seconds, got {v!r}")
    ctx, modules = _rank_context(fn, start_method)
    base_env = {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "GLOO_SOCKET_IFNAME": "lo",
        "OMP_NUM_THREADS": str(threads_per_rank),
        **(env or {}),
    }
    ranks: list[_Rank] = []
    with _Interrupts(nprocs) as intr, tempfile.TemporaryDirectory(prefix="flowlane-launch-") as store_dir:
        try:
            log.info("starting %d rank(s) (%s)", nprocs, backend or "no process group")
            started = time.monotonic()  # start-up's limit counts the fork server's imports too
            if modules is not None:
                _start_fork_server(ctx, modules, startup_timeout, nprocs, startup_key)
            else:
                # see _start_fork_server: its first start would unblock the signals blocked around p.start()
                from multiprocessing import resource_tracker

                resource_tracker.ensure_running()
            for r in range(nprocs):
                reader, writer = ctx.Pipe(duplex=False)
                p = ctx.Process(
                    target=_child,
                    args=(
                        fn,
                        r,
                        nprocs,
                        tuple(args),
                        backend,
                        store_dir,
                        op_timeout,
                        base_env,
                        writer,
                        threads_per_rank,
                        os.getpid(),
                    ),
                    name=f"flowlane-rank{r}",
                    daemon=False,
                )
                # the rank starts with the forwarded signals blocked (the mask survives fork and exec), so every
                # thread its imports start leaves them to its signal thread
                old = signal.pthread_sigmask(signal.SIG_BLOCK, _RANK_BLOCKED)
                try:
                    p.start()
                except (EOFError, OSError) as e:
                    # the fork server died (EOF where its reply, the rank's pid, should be) or fork failed (EAGAIN)
                    writer.close()
                    reader.close()
                    via = (
                        "" if modules is None else f" from the fork server (preloaded: {', '.join(modules)})"
                    )
                    raise LaunchError(f"could not start rank {r}{via}: {type(e).__name__}: {e}") from e
                finally:
                    signal.pthread_sigmask(signal.SIG_SETMASK, old)
                writer.close()  # only the rank writes: its exit is then EOF here
                ranks.append(_Rank(r, p, reader, started))
            _Supervisor(ranks, timeout, startup_timeout, store_dir, timeout_key, startup_key).run()
        finally:
            intr.stopping = True
            _stop([r.proc for r in ranks], graceful=bool(ranks) and all(r.done for r in ranks))
            for r in ranks:
                if r.conn is not None:
                    r.conn.close()
    return [r.result for r in ranks]


class _Supervisor:
    """The launcher's view of its ranks: what each sends (start-up progress, heart beats, its result or error) and
    when each exits; failures are ranked by severity, then by when they were seen (:class:`_Failure`).

    :meth:`run` waits until every rank has its result, or a failure (and those it sets off, for ``_SETTLE_S``) is
    known: it raises RankFailedError naming the rank at fault, or RankTimeoutError for ranks that do not start or stop
    progressing (naming ``key`` / ``startup_key``, the caller's name for the limit, where given)."""

    def __init__(
        self,
        ranks: list[_Rank],
        timeout: float,
        startup_timeout: float,
        store_dir: str,
        key: str | None = None,
        startup_key: str | None = None,
    ) -> None:
        self.ranks = ranks
        self.key, self.startup_key = key, startup_key
        self.timeout = timeout
        self.startup_timeout = startup_timeout
        self.store_dir = store_dir
        self.seq = itertools.count()
        self.failures: list[_Failure] = []
        self.first_failure = 0.0
        self.n_ready = self.n_imported = 0
        self.t0 = self.last_note = min((r.started for r in ranks), default=time.monotonic())

    def run(self) -> None:
        while not all(r.done or r.failure for r in self.ranks):
            if self.failures and time.monotonic() - self.first_failure >= _SETTLE_S:
                break
            self._wait_for_events(0.5)
            if not self.failures:
                self._check_progress()
        if self.failures:
            self._raise_failure()

    def _fail(self, r: _Rank, severity: int, text: str, headline: str | None = None) -> None:
        if r.failure is None and not r.done:
            r.failure = _Failure(r.rank, severity, next(self.seq), headline, text)
            self.failures.append(r.failure)
            self.first_failure = self.first_failure or time.monotonic()

    def _wait_for_events(self, timeout: float) -> None:
        """A rank's messages, then its exit, for every rank with either within ``timeout`` seconds."""
        by_obj: dict[Any, tuple[str, _Rank]] = {}
        for r in self.ranks:
            if r.conn is not None:
                by_obj[r.conn] = ("conn", r)
            if not r.exited:
                by_obj[r.proc.sentinel] = ("exit", r)
        ready = wait(list(by_obj), timeout=timeout)
        for what, r in sorted((by_obj[o] for o in ready), key=lambda x: x[0] != "conn"):  # messages first
            if what == "conn" and r.conn is not None:
                self._drain(r)
            elif what == "exit":
                self._on_exit(r)

    def _drain(self, r: _Rank) -> None:
        assert r.conn is not None
        try:
            while r.conn.poll():
                self._on_message(r, *pickle.loads(r.conn.recv_bytes()))
        except (EOFError, OSError):
            r.conn.close()
            r.conn = None

    def _on_message(self, r: _Rank, kind: str, payload: Any) -> None:
        now = time.monotonic()
        if kind == "imported":  # start-up progress: imports are most of it
            self.n_imported += 1
            log.info("ranks started: %d/%d (%.0f s)", self.n_imported, len(self.ranks), now - self.t0)
        elif kind == "ready":
            r.ready = r.progress = now
            self.n_ready += 1
            if self.n_ready == len(self.ranks):
                log.info("all %d ranks ready (%.0f s)", self.n_ready, now - self.t0)
        elif kind == "beat":
            r.progress = now
        elif kind == "ok":
            r.result, r.done = pickle.loads(payload), True
        elif kind == "err":
            tb, signum = payload
            if signum is not None:  # someone else signalled this rank (the launcher's own stop comes later)
                name = signal.Signals(signum).name
                headline = f"rank {r.rank} was stopped by {name} (signal {signum}) from outside the launcher"
                self._fail(r, 0, tb, headline)
            else:
                self._fail(r, 2, tb)

    def _on_exit(self, r: _Rank) -> None:
        r.proc.join(5)  # the sentinel closes a moment before the process can be reaped
        r.exited = True
        if r.conn is not None:
            self._drain(r)  # what it wrote before it exited
        if not r.done and r.failure is None:
            self._fail(r, *_exit_failure(r.rank, r.proc.exitcode, _crash_stack(self.store_dir, r.rank)))

    def _check_progress(self) -> None:
        """Say that start-up goes on; raise RankTimeoutError for ranks past ``startup_timeout`` unstarted, or past
        ``timeout`` without progress (a stopped process among the running ranks is named as the culprit)."""
        ranks, now = self.ranks, time.monotonic()
        if self.n_ready < len(ranks) and now - self.last_note >= _STARTUP_NOTE_S:
            self.last_note = now
            log.info(
                "still starting (imports, rendezvous): %d/%d ranks ready after %.0f s (startup_timeout=%g s)",
                self.n_ready,
                len(ranks),
                now - self.t0,
                self.startup_timeout,
            )
        late = [r.rank for r in ranks if r.ready is None and now - r.started > self.startup_timeout]
        if late:
            stacks = _dump_stacks(ranks, late, self.store_dir)
            raise RankTimeoutError(late, self.startup_timeout, stacks, phase="start-up", key=self.startup_key)
        stuck = [
            r.rank for r in ranks if r.ready is not None and not r.done and now - r.progress > self.timeout
        ]
        if stuck:
            running = [r.rank for r in ranks if not r.done and not r.exited]
            stopped = [i for i in running if _stopped(ranks[i].proc.pid)]
            stuck = sorted(set(stuck) | set(stopped))
            note = "".join(f"{_stopped_text(i)}\n" for i in stopped)
            stacks = _dump_stacks(ranks, stuck, self.store_dir)
            raise RankTimeoutError(
                stuck, self.timeout, stacks, culprit=next(iter(stopped), None), note=note, key=self.key
            )

    def _raise_failure(self) -> None:
        """RankFailedError for the root cause (lowest severity, then first seen), with what followed it and the
        stacks of the ranks still running."""
        ranks = self.ranks
        for r in ranks:  # a stopped rank is the one its peers' errors are about
            if not r.done and not r.exited and r.failure is None and _stopped(r.proc.pid):
                self._fail(r, 0, "", _stopped_text(r.rank))
        running = [r.rank for r in ranks if not r.done and r.failure is None and not r.exited]
        stacks = _dump_stacks(ranks, running, self.store_dir) if running else {}
        cause = min(self.failures, key=lambda f: (f.severity, f.seq))
        parts = [cause.text] if cause.text else []
        parts += [
            f"--- then rank {f.rank}: {f.headline or 'failed'} ---\n{f.text[-3000:]}"
            for f in sorted(self.failures, key=lambda f: f.seq)
            if f is not cause
        ]
        parts += [
            f"--- rank {i} still running, at ---\n{stacks.get(i) or '(no stack captured)'}" for i in running
        ]
        raise RankFailedError(cause.rank, "\n".join(parts) or "(no further detail)", cause.headline)


def _crash_stack(store_dir: str, rank: int) -> str:
    """What faulthandler wrote when ``rank`` crashed in native code (empty if it did not)."""
    try:
        return (Path(store_dir) / f"crash.{rank}").read_text(errors="replace").strip()
    except OSError:
        return ""


def _exit_failure(rank: int, code: int | None, crash: str = "") -> tuple[int, str, str | None]:
    """(severity, text, headline) for a rank that exited without a result; ``crash``: its Python stacks at a fatal
    signal, appended to the text."""
    sev, text, headline = _exit_failure_kind(rank, code)
    if crash:
        text += f"\n--- rank {rank}'s Python stacks at the crash ---\n{crash[-6000:]}"
    return sev, text, headline


def _exit_failure_kind(rank: int, code: int | None) -> tuple[int, str, str | None]:
    if code is not None and code < 0:
        sig = -code
        name = signal.Signals(sig).name if sig in signal.valid_signals() else f"signal {sig}"
        if sig == signal.SIGABRT:  # a library's abort on a lost peer: a consequence as often as a cause
            return 2, f"process aborted ({name}, signal {sig}) without a result", None
        why = {
            signal.SIGKILL: "kill -9 or the kernel's OOM killer",
            signal.SIGSEGV: "a crash in native code",
            signal.SIGBUS: "a crash in native code",
        }.get(sig, "")
        return (
            0,
            f"it returned no result{f' ({why})' if why else ''}",
            f"rank {rank} was killed by {name} (signal {sig})",
        )
    return 1, f"process exited with code {code} without a result", None


def _stopped(pid: int | None) -> bool:
    return _stat(pid)[:1] in (["T"], ["t"])


def _signal_state(pid: int | None, signum: int) -> tuple[bool, frozenset[str]]:
    """(``signum`` pending for process ``pid``, the threads that block it). A handler runs with its signal blocked in
    its thread, so a thread that blocks it now and did not before is still handling it."""
    bit = 1 << (int(signum) - 1)
    pending, blocked = False, set()
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/status") as f:
                for line in f:
                    if line.startswith(("ShdPnd:", "SigPnd:", "SigBlk:")) and int(line.split()[1], 16) & bit:
                        if line.startswith("SigBlk:"):
                            blocked.add(task)
                        else:
                            pending = True
    except (OSError, ValueError, IndexError):
        pass
    return pending, frozenset(blocked)


def _stopped_text(rank: int) -> str:
    return (
        f"rank {rank} is stopped (process state T: SIGSTOP, Ctrl-Z or a debugger) and not answering; "
        "the other ranks wait for it"
    )


def _dump_stacks(ranks: Sequence[_Rank], which: Sequence[int], store_dir: str) -> dict[int, str]:
    asked, blocking = [], {}
    for i in which:
        p = ranks[i].proc
        if p.is_alive() and p.pid and not _stopped(p.pid):
            blocking[i] = _signal_state(p.pid, signal.SIGUSR1)[1]  # threads that block it anyway
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signal.SIGUSR1)
                asked.append(i)

    def written(i: int, f: Path) -> bool:
        # begun (the file has bytes) and finished (SIGUSR1 neither pending nor held by a handler still writing):
        # faulthandler writes the main thread, the one usually stuck, last
        if not (f.exists() and f.stat().st_size):
            return False
        pending, blocked = _signal_state(ranks[i].proc.pid, signal.SIGUSR1)
        return not pending and blocked <= blocking[i]

    deadline = time.monotonic() + _STACK_WAIT_S
    stacks: dict[int, str] = {}
    for i in which:
        f = Path(store_dir) / f"stack.{i}"
        while i in asked and time.monotonic() < deadline and not written(i, f):
            time.sleep(0.05)
        text = f.read_text()[-4000:] if f.exists() else ""
        if not text and _stopped(ranks[i].proc.pid):
            text = "(no stack: the process is stopped and cannot answer)"
        stacks[i] = text
    return stacks


def _stop(procs: Sequence[Any], graceful: bool) -> None:
    if graceful:  # every rank reported: give them a moment to exit on their own
        for p in procs:
            p.join(timeout=10)
    alive = [p for p in procs if p.is_alive()]
    for p in alive:  # SIGTERM: the rank unwinds and removes what it made; SIGCONT lets a stopped one do so
        with contextlib.suppress(ProcessLookupError):
            p.terminate()
            os.kill(p.pid, signal.SIGCONT)
    deadline = time.monotonic() + _STOP_GRACE_S
    for p in alive:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
    for p in alive:
        if p.is_alive():
            p.kill()
            p.join()
