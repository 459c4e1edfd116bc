"""A dead DistDGL trainer is an error in its peers, never a hang (dgl_plugin.distdgl; gnn_dgs and gnn_fullgraph).

Before: a trainer that failed sat in DGL's exit barrier (which waits for every trainer, no timeout) while its peer
waited for it in the next gloo collective; a trainer killed outright never reached the barrier, where the survivor
then waited for ever. Here real DistDGL processes play it out: one graph server (private /dev/shm) and two trainers
running the guard the gnn_dgs and G3 trainers run (``connect_trainer``, ``trainer_process_group``, ``peer_guard``,
``leave``). Trainer 1 stops after three all-reduces: it raises (the reported case; fast tier), or, in a ``slow`` test
of two sessions side by side, is SIGKILLed or stops answering (SIGSTOP). Trainer 0 must exit non-zero
with PeerLostError, within ``peer_timeout_s`` for the silent peer; a failing trainer must exit too. Hard limits
(process waits, pytest timeout) keep a regression from hanging CI."""

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flowlane.launch import free_port

pytestmark = pytest.mark.gnn
dgl = pytest.importorskip("dgl")

ROOT = Path(__file__).resolve().parent.parent
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
    procs: dict[str, subprocess.Popen] = {}
    logs = []

    def start(key: str, cmd: list[str], env: dict[str, str]) -> None:
        f = open(tmp_path / f"{key}.log", "w")  # noqa: SIM115 - closed below
        logs.append(f)
        procs[key] = subprocess.Popen(
            cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, env=env, start_new_session=True
        )

    def log(key: str) -> str:
        return (tmp_path / f"{key}.log").read_text(errors="replace")

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
            start(
                f"{mode}-server",
                [
                    *("unshare", "--mount", "--propagation", "private", "sh", "-c"),
                    'mount -t tmpfs tmpfs /dev/shm && exec "$@"',
                    *("sh", sys.executable, "-c", serve),
                ],
                dict(common, DGL_ROLE="server", DGL_SERVER_ID="0"),
            )
            port = str(free_port())
            for rank in (0, 1):
                env = dict(common, DGL_ROLE="client", DGL_DIST_MODE="distributed")
                env |= dict(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
                start(f"{mode}{rank}", [sys.executable, "-c", TRAINER, mode, str(PEER_S)], env)
        # every trainer exits by itself, but a stopped one
        waiting = [f"{m}{r}" for m in modes for r in (0, 1) if (m, r) != ("stop", 1)]
        deadline = time.monotonic() + 360  # the trainers import torch + DGL on a busy 2-core host
        while time.monotonic() < deadline and not all(k in exited for k in waiting):
            for k in waiting:
                if k not in exited and procs[k].poll() is not None:
                    exited[k] = time.time()
            time.sleep(0.2)
        dump = "\n".join(f"--- {k} (rc {p.poll()})\n{log(k)[-2000:]}" for k, p in procs.items())
        assert all(k in exited for k in waiting), f"a trainer hung:\n{dump}"
    finally:
        for p in procs.values():
            _kill(p)
        for f in logs:
            f.close()
    for mode in modes:
        out = log(f"{mode}0")
        assert procs[f"{mode}0"].returncode != 0, dump
        assert "PeerLostError" in out and "lost a peer trainer" in out, dump
        # trainer 0 did its three all-reduces with trainer 1, then lost it
        waited = exited[f"{mode}0"] - float(out.split("3 all-reduces done at ")[1].split()[0])
        if mode == "stop":  # a silent peer: gloo's wait, bounded by peer_timeout_s
            assert f"peer_timeout_s={PEER_S:g}" in out and "Timed out" in out, dump
            assert waited >= PEER_S * 0.9, json.dumps({"waited_s": waited})
        else:  # a peer that is gone: noticed when its sockets close, not after the timeout
            assert "Connection closed by peer" in out or "reset by peer" in out, dump
        if mode == "raise":  # the failing trainer exits too, instead of waiting in DGL's exit barrier
            assert procs["raise1"].returncode == 1 and "trainer 1 fails on purpose" in log("raise1"), dump
        if mode == "kill":
            assert procs["kill1"].returncode == -signal.SIGKILL


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
