"""flowlane.launch under faults: a healthy run is never killed, the rank at fault is the one named, and a signal to
the launcher stops every rank and removes what they left (issue 33, items 1-3).

Worker functions live here at module level: spawned ranks import them from this module.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from flowlane import launch as L
from flowlane import launch_external as LE
from flowlane import trace  # imported with this module, so during a rank's start-up

ROOT = Path(__file__).resolve().parent.parent


# ------------------------------------------------------------------------------------------------ rank workers
def steady_steps(rank: int, world: int, steps: int, step_s: float) -> int:
    """A healthy run: many short steps. Rank 0 records each as a compute span (what the recipes' loops do), the
    others call heartbeat()."""
    for i in range(steps):
        if rank == 0:
            with trace.span("step", i=i):
                time.sleep(step_s)
        else:
            time.sleep(step_s)
            L.heartbeat()
    return steps


class _SlowToUnpickle:
    """An argument whose unpickling (in the rank, before it starts) sleeps: a slow start-up (imports, loading)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def __reduce__(self):
        return (time.sleep, (self.seconds,))


def quick(rank: int, world: int, _slow: None) -> int:
    return rank


def signal_self_after_some_steps(rank: int, world: int, victim: int, signum: int) -> int:
    """All ranks all-reduce in a loop; ``victim`` sends itself ``signum`` after a few rounds (kill -9, kill -STOP)."""
    import torch
    import torch.distributed as dist

    for i in range(400):
        if rank == victim and i == 5:
            os.kill(os.getpid(), signum)
        t = torch.ones(4)
        dist.all_reduce(t)
        L.heartbeat()
        time.sleep(0.05)
    return rank


def crash_in_native_code(rank: int, world: int) -> int:
    """Rank 1 reads address 0 through ctypes: a SIGSEGV in native code, as a library bug would give."""
    import ctypes

    if rank == 1:
        ctypes.string_at(0)
    return rank


def hold_a_run_dir(rank: int, world: int, target: str, pids: str, exit_hook_hangs: bool = False) -> None:
    """Create an offload run directory (0700, removed at exit by flowlane.offload) and train forever. With
    ``exit_hook_hangs``, a library's exit hook registered after it never returns (atexit runs it first)."""
    import atexit
    import threading

    from flowlane.offload.backends import make_run_dir

    make_run_dir(target)
    if exit_hook_hangs:
        atexit.register(threading.Event().wait)
    Path(pids, f"rank{rank}.pid").write_text(str(os.getpid()))
    while True:
        L.heartbeat()
        time.sleep(0.1)


# ------------------------------------------------------------------------------------------------ 1. stall, not cap
def test_a_healthy_run_longer_than_the_stall_timeout_is_not_killed():
    """The issue's 18 it/s run killed at 40 s: a run that keeps making progress runs as long as it needs."""
    # ~10 s of steps against a 5 s stall timeout: progress (a finished span, a heartbeat) keeps each rank alive
    assert L.launch(steady_steps, 2, args=(40, 0.25), timeout=5, backend=None) == [40, 40]


def test_start_up_has_its_own_timeout():
    # a start-up (imports, rendezvous) slower than the stall timeout is not a stall
    assert L.launch(quick, 2, args=(_SlowToUnpickle(6),), timeout=2, startup_timeout=300, backend=None) == [
        0,
        1,
    ]
    with pytest.raises(L.RankTimeoutError, match=r"did not start within 1 s") as e:
        L.launch(quick, 2, args=(_SlowToUnpickle(60),), timeout=300, startup_timeout=1, backend=None)
    assert e.value.ranks == [0, 1] and e.value.phase == "start-up"


def _fork_server_launcher(tmp_path: Path, preload: str, mode: str, startup_timeout: float) -> list[str]:
    """A fresh process (the fork server is one per process) that preloads ``preload`` and launches one rank, which
    writes tmp_path/rank.pid; it prints the LaunchError it gets."""
    code = (
        "import sys\n"
        "from flowlane import launch as L\n"
        "from tests.forkserver_workers import mark_started\n"
        f"L.preload({preload!r})\n"
        "try:\n"
        f"    L.launch(mark_started, 1, args=({str(tmp_path / 'rank.pid')!r},), backend=None,"
        f" startup_timeout={startup_timeout}, start_method='forkserver')\n"
        "    print('ran')\n"
        "except L.LaunchInterrupted as e:\n"
        "    sys.exit(128 + e.signum)\n"
        "except L.LaunchError as e:\n"
        "    print(f'{type(e).__name__}: {e}')\n"
        "    sys.exit(1)\n"
    )
    return [sys.executable, "-c", code], {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "FLOWLANE_TEST_PRELOAD": mode,
    }


@pytest.mark.parametrize(
    "preload, mode, match",
    [
        # was a raw EOFError from Process.start (a traceback, not the launcher's error)
        (
            "tests.forkserver_preload",
            "exit",
            r"^LaunchError: the ranks' fork server exited with code 3 while importing tests.forkserver_preload",
        ),
        # was a hang: the first rank's Process.start waited for the fork server with no limit
        (
            "tests.forkserver_preload",
            "hang:{tmp}",
            r"^RankTimeoutError: rank\(s\) \[0\] did not start within 2 s .*\n"
            r"the ranks' fork server was still importing tests.forkserver_preload, tests.forkserver_workers; it was "
            r"stopped",
        ),
    ],
    ids=["exits", "hangs"],
)
def test_a_fork_server_that_cannot_import_its_modules_is_a_launch_error(tmp_path, preload, mode, match):
    cmd, env = _fork_server_launcher(tmp_path, preload, mode.format(tmp=tmp_path), 2)
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and re.search(match, r.stdout, re.S), (r.stdout, r.stderr[-3000:])
    assert not (tmp_path / "rank.pid").exists()
    if (tmp_path / "importing").exists():  # the hung fork server was stopped, not left importing forever
        server = int((tmp_path / "importing").read_text())
        deadline = time.monotonic() + 30  # a bound for "eventually", not a speed requirement
        while _alive(server) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(server)


def test_a_preload_module_that_cannot_be_found_is_said_to_be_left_out(tmp_path):
    """The fork server skips a module that fails to import without a word, and the launcher said it imported it."""
    cmd, env = _fork_server_launcher(tmp_path, "tests.no_such_module", "", 120)
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout == "ran\n", (r.stdout, r.stderr[-3000:])
    assert (
        f"preload: 'tests.no_such_module' is not found by this Python ({sys.executable}): not preloaded"
        in r.stderr
    )


def test_a_signal_while_the_fork_server_imports_leaves_no_rank_behind(tmp_path):
    """SIGTERM while the fork server still imported its modules raised inside the first Process.start, after rank
    0's fork request was queued (the resource tracker's first start had unblocked SIGTERM): the launcher exited and
    the fork server, still importing, forked rank 0 later as an orphan. Now the server is stopped with the launcher."""
    cmd, env = _fork_server_launcher(tmp_path, "tests.forkserver_preload", f"hang:{tmp_path}", 300)
    with open(tmp_path / "launcher.log", "w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, start_new_session=True, stdout=out, stderr=out)
    server = None
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "importing").exists():
            assert proc.poll() is None and time.monotonic() < deadline, (
                tmp_path / "launcher.log"
            ).read_text()
            time.sleep(0.05)
        server = int((tmp_path / "importing").read_text())
        os.kill(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)
        log = (tmp_path / "launcher.log").read_text()
        assert proc.returncode == 128 + signal.SIGTERM and "Traceback" not in log, log
        deadline = time.monotonic() + 30  # a bound for "eventually", not a speed requirement
        while _alive(server) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(server), (
            "the fork server outlived its launcher and would fork rank 0 when its imports end"
        )
        assert not (tmp_path / "rank.pid").exists()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if server is not None and _alive(server):
            os.kill(server, signal.SIGKILL)


def test_timeout_errors_name_the_callers_key(monkeypatch):
    """A recipe's user sets timeout_s, not startup_timeout (no recipe key): both timeout errors name timeout_s."""
    with pytest.raises(L.RankTimeoutError) as e:
        L.launch(steady_steps, 1, args=(1, 30), timeout=1, backend=None, timeout_key="timeout_s")
    assert "made no progress for 1 s" in str(e.value) and "the limit is timeout_s" in str(e.value)
    monkeypatch.setattr(L, "_STARTUP_MIN_S", 1.0)  # start-up's limit: max(this, timeout)
    with pytest.raises(L.RankTimeoutError) as e:
        L.launch(quick, 1, args=(_SlowToUnpickle(60),), timeout=1, backend=None, timeout_key="timeout_s")
    assert "did not start within 1 s" in str(e.value), str(e.value)
    assert "raise timeout_s on a slow machine: start-up may take max(1, timeout_s) s" in str(e.value)
    assert "startup_timeout" not in str(e.value)


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"startup_timeout": 0}, "startup_timeout must be > 0 seconds, got 0"),
        ({"op_timeout": -1}, "op_timeout must be > 0 seconds, got -1"),
    ],
)
def test_launch_rejects_bad_timeouts(kw, match):
    with pytest.raises(ValueError, match=match):
        L.launch(quick, 2, args=(None,), **kw)


def test_heartbeat_outside_a_launched_rank_does_nothing():
    L.heartbeat()


# ------------------------------------------------------------------------------------------------ 2. blame
def test_a_killed_rank_is_named_with_its_signal_not_the_peer_that_lost_it():
    with pytest.raises(L.RankFailedError) as e:
        L.launch(signal_self_after_some_steps, 4, args=(3, signal.SIGKILL), timeout=120)
    assert e.value.rank == 3, str(e.value)
    assert "rank 3 was killed by SIGKILL (signal 9)" in str(e.value)


def test_a_rank_that_crashes_in_native_code_is_named_with_its_python_stack():
    with pytest.raises(L.RankFailedError) as e:
        L.launch(crash_in_native_code, 2, timeout=120, backend=None)
    assert e.value.rank == 1, str(e.value)
    assert "rank 1 was killed by SIGSEGV (signal 11)" in str(e.value)
    assert "rank 1's Python stacks at the crash" in str(e.value) and "crash_in_native_code" in str(e.value)


def test_a_stopped_rank_is_named_as_the_one_not_answering():
    # stall detection first (the collectives' own timeout is longer)
    with pytest.raises(L.RankTimeoutError) as e:
        L.launch(signal_self_after_some_steps, 3, args=(1, signal.SIGSTOP), timeout=10, op_timeout=600)
    assert e.value.rank == 1, str(e.value)
    assert "rank 1 is stopped" in str(e.value) and "not answering" in str(e.value)


def test_a_stopped_rank_is_blamed_when_its_peers_collectives_time_out_first():
    with pytest.raises(L.LaunchError) as e:
        L.launch(signal_self_after_some_steps, 3, args=(1, signal.SIGSTOP), timeout=600, op_timeout=5)
    assert e.value.rank == 1, str(e.value)
    assert "rank 1 is stopped" in str(e.value)


# ------------------------------------------------------------------------------------------------ 3. signals
def _start_launcher(
    tmp_path: Path, world: int, exit_hook_hangs: bool = False
) -> tuple[subprocess.Popen, Path, Path, Path]:
    target, pids, tmp = tmp_path / "offload", tmp_path / "pids", tmp_path / "tmp"
    for d in (target, pids, tmp):
        d.mkdir()
    code = (
        "import sys\n"
        "from flowlane import launch as L\n"
        "from tests.test_launch_faults import hold_a_run_dir\n"
        "try:\n"
        f"    L.launch(hold_a_run_dir, {world}, args=({str(target)!r}, {str(pids)!r}, {exit_hook_hangs}),"
        " timeout=600,"
        " backend=None)\n"
        "except L.LaunchInterrupted as e:\n"
        "    sys.exit(128 + e.signum)\n"
    )
    env = {**os.environ, "TMPDIR": str(tmp), "PYTHONPATH": str(ROOT)}
    # output to a file, not a pipe: an orphaned rank would hold a pipe open and hide the launcher's exit
    with open(tmp_path / "launcher.log", "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-c", code],
            cwd=ROOT,
            env=env,
            start_new_session=True,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    deadline = time.monotonic() + 300
    while len(list(pids.glob("*.pid"))) < world:
        assert proc.poll() is None, (tmp_path / "launcher.log").read_text()
        assert time.monotonic() < deadline, "ranks did not start"
        time.sleep(0.2)
    return proc, target, pids, tmp


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.parametrize(
    "signum, to_group",
    [(signal.SIGTERM, False), (signal.SIGINT, True)],
    ids=["SIGTERM to the launcher", "Ctrl-C to the process group"],
)
def test_a_signal_to_the_launcher_stops_every_rank_and_removes_their_directories(tmp_path, signum, to_group):
    world = 2
    proc, target, pids, tmp = _start_launcher(tmp_path, world)
    rank_pids = [int(p.read_text()) for p in sorted(pids.glob("*.pid"))]
    try:
        assert len(list(target.iterdir())) == world and list(tmp.glob("flowlane-launch-*"))
        if to_group:
            os.killpg(proc.pid, signum)  # what a terminal's Ctrl-C does
        else:
            os.kill(proc.pid, signum)  # what timeout, Slurm, Kubernetes and systemd do
        proc.wait(timeout=120)
        assert proc.returncode == 128 + signum, (tmp_path / "launcher.log").read_text()
        assert [p for p in rank_pids if _alive(p)] == [], "orphaned ranks"
        assert list(target.iterdir()) == [], "offload run directories left behind"
        assert list(tmp.glob("flowlane-launch-*")) == [], "launch directory left behind"
    finally:
        for p in rank_pids:  # the unfixed launcher orphans them: do not leave them running
            if _alive(p):
                os.kill(p, signal.SIGKILL)
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("exit_hook_hangs", [False, True], ids=["plain", "an exit hook that hangs"])
def test_ranks_do_not_outlive_a_launcher_killed_with_sigkill(tmp_path, exit_hook_hangs):
    """kill -9 of the launcher runs none of its code: the ranks learn of it from the kernel (PR_SET_PDEATHSIG) or by
    seeing their parent gone, and still stop, remove their offload directories and the launch directory, even when
    a library's exit hook never returns (such a rank ignored every further SIGTERM and ran on forever)."""
    proc, target, pids, tmp = _start_launcher(tmp_path, 2, exit_hook_hangs)
    rank_pids = [int(p.read_text()) for p in sorted(pids.glob("*.pid"))]
    try:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
        deadline = time.monotonic() + 120  # a bound for "eventually", not a speed requirement
        while any(_alive(p) for p in rank_pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert [p for p in rank_pids if _alive(p)] == [], "orphaned ranks"
        assert list(target.iterdir()) == [], "offload run directories left behind"
        assert list(tmp.glob("flowlane-launch-*")) == [], "launch directory left behind"
    finally:
        for p in rank_pids:
            if _alive(p):
                os.kill(p, signal.SIGKILL)


# ------------------------------------------------------------------------------------------------ stacks
def test_a_stack_is_read_only_once_the_rank_has_finished_writing_it(tmp_path):
    """The launcher asks a stuck rank for its stack (SIGUSR1: faulthandler writes every thread's frames) and must not
    read the file half-written: under load it read the first thread's lines and missed the main thread's (the one
    stuck), which is written last. Here the rank has begun the file and holds SIGUSR1 back until it has written the
    rest; the launcher waits for it instead of reading the first bytes."""
    from types import SimpleNamespace

    code = (
        "import faulthandler, signal, sys, time\n"
        "f = open(sys.argv[1], 'w')\n"
        "faulthandler.register(signal.SIGUSR1, file=f, all_threads=True)\n"
        "signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})\n"
        "f.write('first thread\\n'); f.flush()\n"
        "print('ready', flush=True)\n"
        "while signal.SIGUSR1 not in signal.sigpending():\n"
        "    time.sleep(0.01)\n"
        "time.sleep(0.5)\n"
        "f.write('the main thread, where it is stuck\\n'); f.flush()\n"
        "signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGUSR1})\n"
        "time.sleep(600)\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code, str(tmp_path / "stack.0")], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout.readline() == "ready\n"
        rank = SimpleNamespace(proc=SimpleNamespace(pid=proc.pid, is_alive=lambda: proc.poll() is None))
        stacks = L._dump_stacks([rank], [0], str(tmp_path))
        assert "the main thread, where it is stuck" in stacks[0], stacks[0]
    finally:
        proc.kill()
        proc.wait()


# ------------------------------------------------------------------------------------------------ start-up display
def test_a_slow_start_up_says_it_is_still_starting(monkeypatch, caplog):
    """Minutes of imports on a busy host showed nothing between 'starting 4 rank(s)' and the first rank's 'ranks
    started': the launcher now says every _STARTUP_NOTE_S that it is still starting, and against which limit."""
    monkeypatch.setattr(L, "_STARTUP_NOTE_S", 0.5)
    with caplog.at_level("INFO", logger="flowlane"):
        assert L.launch(quick, 1, args=(_SlowToUnpickle(3),), timeout=60, backend=None) == [0]
    notes = [r.getMessage() for r in caplog.records if r.getMessage().startswith("still starting")]
    assert notes and "0/1 ranks ready after" in notes[0] and "startup_timeout=300 s" in notes[0], notes


def test_a_destroy_that_never_returns_is_abandoned_with_a_warning(caplog):
    # a group's destructor blocked on a gone peer must not keep the rank from exiting (DistDGL's exit barrier)
    blocked = threading.Event()
    with caplog.at_level(logging.WARNING, logger="flowlane"):
        assert LE.destroy_default_group(0.2, destroy=blocked.wait) is False
    assert "did not return" in caplog.text
    blocked.set()


def gather_unequal(rank: int, world: int) -> tuple[Any, int, bool]:
    import torch

    held: list[Any] = []
    got = LE._gather_to_rank0({"rank": rank, "pad": "x" * (100 * rank)}, rank, world, None, held)
    return got, len(held), all(isinstance(t, torch.Tensor) for t in held)


def test_an_external_launchs_results_reach_rank_0_and_their_tensors_outlive_the_group():
    """run_this_rank's final gather (pickled results of unequal length, rank order on rank 0) leaves every tensor
    its collectives used in the caller's list, which is cleared only after the group is destroyed: a gloo worker
    dropping a work item's last reference to a Python tensor needs the GIL, which the destroy holds while it waits
    for that worker (a deadlock seen in a fresh-clone CI)."""
    results = L.launch(gather_unequal, 2, timeout=120)
    assert results[0] == ([{"rank": 0, "pad": ""}, {"rank": 1, "pad": "x" * 100}], 7, True)
    assert results[1] == (None, 7, True)  # payload, size, 2 sizes, padded, 2 rows


def test_a_destroy_that_returns_is_waited_for():
    calls = []
    handler = signal.getsignal(signal.SIGALRM)
    assert LE.destroy_default_group(60.0, destroy=lambda: calls.append(1)) is True
    assert calls == [1]
    assert signal.getsignal(signal.SIGALRM) is handler  # the backstop's alarm is gone with it


def test_a_destroy_blocked_while_holding_the_gil_ends_the_process_instead_of_hanging():
    """The deadlock the CI saw, reduced: a destroy that blocks in native code without releasing the GIL (libc's
    sleep called through ctypes.PyDLL) keeps the waiting thread from ever waking up; the SIGALRM backstop ends the
    process after timeout + backstop_s."""
    code = (
        "import ctypes\n"
        "from flowlane import launch_external as LE\n"
        "LE.destroy_default_group(0.2, destroy=lambda: ctypes.PyDLL(None).sleep(60), backstop_s=1.0)\n"
        "print('returned', flush=True)\n"
    )
    # a hang raises TimeoutExpired; the backstop ends the process in about 2 s
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == -signal.SIGALRM and "returned" not in r.stdout, (r.returncode, r.stdout, r.stderr)
