"""A dead DistDGL trainer is an error in its peers, never a hang (dgl_plugin.distdgl; gnn_dgs and gnn_fullgraph).

Before: a trainer that failed sat in DGL's exit barrier (which waits for every trainer, no timeout) while its peer
waited for it in the next gloo collective; a trainer killed outright never reached the barrier, where the survivor
then waited for ever. Here real DistDGL processes play it out: one graph server (private /dev/shm) and two trainers
running the guard the gnn_dgs and G3 trainers run (``connect_trainer``, ``trainer_process_group``, ``peer_guard``,
``leave``). Trainer 1 stops after three all-reduces: it raises (the reported case; fast tier), or, in a ``slow`` test
of two sessions side by side, is SIGKILLed or stops answering (SIGSTOP). Trainer 0 must exit non-zero
with PeerLostError, within ``peer_timeout_s`` for the silent peer; a failing trainer must exit too.

A dead graph *server* (``slow``): two servers, two DGS trainers reading partition 1 through DGL (its KVStore pull, its
neighbour sampler); server 1 is SIGKILLed with both reads in flight, and each trainer must exit with PeerLostError
after ``peer_timeout_s`` (DGL's own wait has no timeout). Hard limits (process waits, pytest timeout) keep a
regression from hanging CI."""

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import IO

import pytest

from flowlane.launch import free_port

pytestmark = pytest.mark.gnn
dgl = pytest.importorskip("dgl")

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable.encode()
PEER_S = 15.0  # peer_timeout_s of the trainers: the silent peer's survivor gives up after it

# A trainer: a DGL client, then the gloo pair; rank 1 stops after three all-reduces.
TRAINER = """
import os, signal, sys, time
import torch
from dgl_plugin import distdgl

mode, peer_s = sys.argv[1], float(sys.argv[2])
distdgl.connect(distdgl.distdgl_role(), peer_s)
with distdgl.peer_guard(peer_s, "test trainer"):
    distdgl.trainer_process_group(peer_s)
    rank = torch.distributed.get_rank()
    x = torch.ones(4)
    for _ in range(3):
        torch.distributed.all_reduce(x)
    print(f"rank {rank}: 3 all-reduces done at {time.time():.3f}", flush=True)
    if rank == 1:
        if mode == "raise":
            raise RuntimeError("trainer 1 fails on purpose")
        os.kill(os.getpid(), signal.SIGKILL if mode == "kill" else signal.SIGSTOP)
    torch.distributed.all_reduce(x)  # trainer 0: its peer is gone or silent
distdgl.leave(peer_s)
"""

needs_root = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None,
    reason="the DistDGL server gets a private /dev/shm (root + unshare)",
)


def _kill(p: subprocess.Popen) -> None:
    if p.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
        p.wait(timeout=30)


class _Procs:
    """The processes a test starts, each in its own session logging to ``tmp/<key>.log``; :meth:`close` kills
    whatever still runs and closes the logs."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.procs: dict[str, subprocess.Popen] = {}
        self._logs: list[IO[str]] = []

    def start(self, key: str, cmd: list[str], env: dict[str, str]) -> None:
        f = open(self.tmp / f"{key}.log", "w")  # noqa: SIM115 - closed in close()
        self._logs.append(f)
        self.procs[key] = subprocess.Popen(
            cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, env=env, start_new_session=True
        )

    def log(self, key: str) -> str:
        return (self.tmp / f"{key}.log").read_text(errors="replace")

    def dump(self, tail: int = 2500) -> str:
        return "\n".join(f"--- {k} (rc {p.poll()})\n{self.log(k)[-tail:]}" for k, p in self.procs.items())

    def close(self) -> None:
        for p in self.procs.values():
            _kill(p)
        for f in self._logs:
            f.close()


def _private_shm_server(code: str) -> list[str]:
    """``python -c code`` (a DistDGL server) in a private /dev/shm: DGL names KVStore segments after the tensor
    only, so two servers on one host would share them."""
    return [
        *("unshare", "--mount", "--propagation", "private", "sh", "-c"),
        'mount -t tmpfs tmpfs /dev/shm && exec "$@"',
        *("sh", sys.executable, "-c", code),
    ]


@needs_root
@pytest.mark.timeout(420)
@pytest.mark.parametrize(
    "modes", [("raise",), pytest.param(("kill", "stop"), marks=pytest.mark.slow)], ids=["raise", "kill+stop"]
)
def test_a_dead_or_silent_trainer_ends_its_peer_with_an_error_never_a_hang(tmp_path, modes):
    """Each mode its own session (a server and two trainers), the modes side by side (one wave of imports)."""
    from dgl_plugin.datasets import load_graph

    g = load_graph(
        "synthetic", seed=0, num_nodes=60, avg_degree=4, num_classes=2, num_communities=2, feat_dim=4
    )
    ps = _Procs(tmp_path)

    exited: dict[str, float] = {}
    try:
        for mode in modes:
            name = f"deadpeer{os.getpid()}{mode}{time.monotonic_ns() % 10**9}"  # unique: no shared segment
            dgl.distributed.partition_graph(g, name, 1, str(tmp_path / mode), num_hops=1, part_method="metis")
            ip = tmp_path / f"ip_config_{mode}.txt"
            ip.write_text(f"127.0.0.1 {free_port()}\n")
            common = {
                **os.environ,
                "PYTHONPATH": str(ROOT),
                "PYTHONUNBUFFERED": "1",
                "OMP_NUM_THREADS": "1",
                "DGL_IP_CONFIG": str(ip),
                "DGL_NUM_SERVER": "1",
                "DGL_NUM_CLIENT": "2",
                "DGL_NUM_SAMPLER": "0",
                "DGL_CONF_PATH": str(tmp_path / mode / f"{name}.json"),
            }
            serve = f"import dgl; dgl.distributed.initialize({str(ip)!r})"
            ps.start(
                f"{mode}-server",
                _private_shm_server(serve),
                dict(common, DGL_ROLE="server", DGL_SERVER_ID="0"),
            )
            port = str(free_port())
            for rank in (0, 1):
                env = dict(common, DGL_ROLE="client", DGL_DIST_MODE="distributed")
                env |= dict(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
                ps.start(f"{mode}{rank}", [sys.executable, "-c", TRAINER, mode, str(PEER_S)], env)
        # every trainer exits by itself, but a stopped one
        waiting = [f"{m}{r}" for m in modes for r in (0, 1) if (m, r) != ("stop", 1)]
        deadline = time.monotonic() + 360  # the trainers import torch + DGL on a busy 2-core host
        while time.monotonic() < deadline and not all(k in exited for k in waiting):
            for k in waiting:
                if k not in exited and ps.procs[k].poll() is not None:
                    exited[k] = time.time()
            time.sleep(0.2)
        dump = ps.dump(2000)
        assert all(k in exited for k in waiting), f"a trainer hung:\n{dump}"
    finally:
        ps.close()
    for mode in modes:
        out = ps.log(f"{mode}0")
        assert ps.procs[f"{mode}0"].returncode != 0, dump
        assert "PeerLostError" in out and "lost a peer trainer" in out, dump
        # trainer 0 did its three all-reduces with trainer 1, then lost it
        waited = exited[f"{mode}0"] - float(out.split("3 all-reduces done at ")[1].split()[0])
        if mode == "stop":  # a silent peer: gloo's wait, bounded by peer_timeout_s
            assert f"peer_timeout_s={PEER_S:g}" in out and "Timed out" in out, dump
            assert waited >= PEER_S * 0.9, json.dumps({"waited_s": waited})
        else:  # a peer that is gone: noticed when its sockets close, not after the timeout
            assert "Connection closed by peer" in out or "reset by peer" in out, dump
        if mode == "raise":  # the failing trainer exits too, instead of waiting in DGL's exit barrier
            assert ps.procs["raise1"].returncode == 1 and "trainer 1 fails on purpose" in ps.log("raise1"), (
                dump
            )
        if mode == "kill":
            assert ps.procs["kill1"].returncode == -signal.SIGKILL


def test_a_collective_that_lost_its_peer_becomes_peer_lost_error_and_skips_dgls_exit_barrier(monkeypatch):
    from dgl_plugin import distdgl

    monkeypatch.setattr(distdgl, "_EXIT", distdgl._ExitState())
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    gloo = "[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [10.0.0.2]:41127"
    lost = r"rank 1 of 2: lost a peer .*\[10\.0\.0\.2\]:41127.*peer_timeout_s=12 s"
    with pytest.raises(distdgl.PeerLostError, match=lost), distdgl.peer_guard(12.0):
        raise RuntimeError(gloo)
    assert distdgl._EXIT.abandoned  # no exit barrier after a failure
    monkeypatch.setattr(distdgl, "_EXIT", distdgl._ExitState())
    with pytest.raises(ValueError, match="bad input"), distdgl.peer_guard(12.0):
        raise ValueError("bad input")  # other errors pass unchanged, and still skip the barrier
    assert distdgl._EXIT.abandoned


@pytest.mark.parametrize("bad", [0, -1.0, "60", True, None])
def test_a_bad_peer_timeout_is_refused_naming_the_value(bad):
    from dgl_plugin.dgs_train import check_config

    with pytest.raises(ValueError, match=rf"peer_timeout_s={bad!r} must be a number of seconds > 0"):
        check_config({"peer_timeout_s": bad})


# A DGS trainer with no gloo group: DGL client, DistGraph over 2 partitions (served by servers 0 and 1), then the
# DistDGL reads DGS makes of partition 1's rows ("pull": DGSRuntime.pull, DGL's KVStore pull; "sample": a batch of
# DGL's neighbour sampler, CountingNeighborSampler). Three rounds, "ready", wait for the go file (server 1 is stopped
# by then, and killed once both requests reached it), one more round: PeerLostError, not a wait for ever.
PULLER = """
import os, sys, time
import dgl, torch
from dgl_plugin import distdgl
from dgl_plugin.dgs import CountingNeighborSampler, DGSRuntime, register_services
from flowlane.dgs import DGSConfig

mode, peer_s, go = sys.argv[1], float(sys.argv[2]), sys.argv[3]
register_services()
role = distdgl.distdgl_role()
distdgl.connect(role, peer_s)
with distdgl.peer_guard(peer_s, "test DGS trainer"):
    g = dgl.distributed.DistGraph(os.environ["GRAPH_NAME"], part_config=role.part_config)
    rt = DGSRuntime(g, 0, DGSConfig(), peer_timeout_s=peer_s)
    far = g.get_partition_book().partid2nids(1)

    def one_round():
        if mode == "pull":
            return rt.pull(far)
        loader = dgl.dataloading.DistNodeDataLoader(g, far, CountingNeighborSampler([2], rt), batch_size=far.numel())
        return list(loader)

    for _ in range(3):
        one_round()
    print(f"{mode}: ready at {time.time():.3f}", flush=True)
    for _ in range(3000):  # the test writes the go file once server 1 is dead (hard limit: 300 s)
        if os.path.exists(go):
            break
        time.sleep(0.1)
    print(f"{mode}: go at {time.time():.3f}", flush=True)
    one_round()
    print(f"{mode}: read from a dead server", flush=True)
distdgl.leave(peer_s)
"""


def _unread_connections(port: int) -> int:
    """Established TCP connections to local ``port`` with bytes its (stopped) server has not read."""
    n = 0
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        f = line.split()
        if int(f[1].split(":")[1], 16) == port and f[3] == "01" and int(f[4].split(":")[1], 16) > 0:
            n += 1
    return n


@needs_root
@pytest.mark.skipif(shutil.which("nsenter") is None, reason="the trainers join server 0's /dev/shm (nsenter)")
@pytest.mark.slow  # 4 processes import torch + DGL, then a 15 s timeout: 1-2 min (the mechanism: test_dgs_dgl.py)
@pytest.mark.timeout(480)
def test_a_dead_graph_server_ends_dgls_distdgl_reads_with_peer_lost_error_never_a_hang(tmp_path):
    """Server 1 dies (SIGKILL) while both trainers wait for its answer: DGL's KVStore pull (``fast_pull``) and its
    sampling RPC wait with no timeout (C++ ``RecvRPCMessage(msg, 0)``), so both trainers hung before; DGS bounds them
    by ``peer_timeout_s``. Each trainer must exit 1 with PeerLostError naming partition 1 and the timeout. The bound
    on the wait (``PEER_S`` + 150 s) only tells a hang from an error; it is not a speed assertion."""
    from dgl_plugin.datasets import load_graph

    g = load_graph(
        "synthetic", seed=0, num_nodes=80, avg_degree=4, num_classes=2, num_communities=2, feat_dim=4
    )
    name = f"deadsrv{os.getpid()}x{time.monotonic_ns() % 10**9}"
    dgl.distributed.partition_graph(g, name, 2, str(tmp_path / "parts"), num_hops=1, part_method="metis")
    ip = tmp_path / "ip_config.txt"
    port1 = free_port()
    ip.write_text(f"127.0.0.1 {free_port()}\n127.0.0.1 {port1}\n")
    go = tmp_path / "go"
    common = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "PYTHONUNBUFFERED": "1",
        "OMP_NUM_THREADS": "1",
        "DGL_IP_CONFIG": str(ip),
        "DGL_NUM_SERVER": "1",
        "DGL_NUM_CLIENT": "2",
        "DGL_NUM_SAMPLER": "0",
        "DGL_CONF_PATH": str(tmp_path / "parts" / f"{name}.json"),
        "GRAPH_NAME": name,
    }
    serve = "from dgl_plugin.dgs import register_services; register_services(); import dgl; "
    serve += f"dgl.distributed.initialize({str(ip)!r})"
    ps = _Procs(tmp_path)

    modes = {"pull": "DistDGL pull of 'feat'", "sample": "DGL neighbour sampling"}
    exited: set[str] = set()
    try:
        # each server in a private /dev/shm (DGL names KVStore segments after the tensor only)
        for sid in (0, 1):
            ps.start(
                f"server{sid}",
                _private_shm_server(serve),
                dict(common, DGL_ROLE="server", DGL_SERVER_ID=str(sid)),
            )
        deadline = time.monotonic() + 120
        while Path(f"/proc/{ps.procs['server0'].pid}/cmdline").read_bytes().split(b"\0")[0] != PY:
            assert ps.procs["server0"].poll() is None and time.monotonic() < deadline, ps.dump()
            time.sleep(0.05)
        for mode in modes:  # the trainers map partition 0's segments: they join server 0's mount namespace
            enter = ["nsenter", f"--mount=/proc/{ps.procs['server0'].pid}/ns/mnt", "--"]
            env = dict(common, DGL_ROLE="client", DGL_DIST_MODE="distributed")
            ps.start(mode, [*enter, sys.executable, "-c", PULLER, mode, str(PEER_S), str(go)], env)
        deadline = time.monotonic() + 300  # torch + DGL imports on a busy 2-core host
        while not all(f"{m}: ready" in ps.log(m) for m in modes):
            assert time.monotonic() < deadline and all(ps.procs[m].poll() is None for m in modes), ps.dump()
            time.sleep(0.2)
        # server 1 dies with both trainers' requests in flight: stopped, the requests reach its sockets (unread
        # bytes), then SIGKILL. (Killed between requests instead, DGL's sender aborts the trainer: "Broken pipe".)
        os.killpg(ps.procs["server1"].pid, signal.SIGSTOP)
        go.write_text("")
        deadline = time.monotonic() + 120
        while _unread_connections(port1) < 2:
            assert time.monotonic() < deadline and all(ps.procs[m].poll() is None for m in modes), ps.dump()
            time.sleep(0.2)
        os.killpg(ps.procs["server1"].pid, signal.SIGKILL)
        deadline = time.monotonic() + PEER_S + 150
        while time.monotonic() < deadline and not all(m in exited for m in modes):
            for m in modes:
                if ps.procs[m].poll() is not None:
                    exited.add(m)
            time.sleep(0.2)
        assert all(m in exited for m in modes), f"a trainer hung in a read from the dead server:\n{ps.dump()}"
    finally:
        ps.close()
    for m, what in modes.items():
        out = ps.log(m)
        assert ps.procs[m].returncode == 1, ps.dump()
        assert "PeerLostError" in out and "read from a dead server" not in out, ps.dump()
        lost = f"{what}: the graph server(s) of partition(s) [1] did not answer within peer_timeout_s={PEER_S:g} s"
        assert lost in out, ps.dump()
