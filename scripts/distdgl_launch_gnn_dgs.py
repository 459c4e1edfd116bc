"""End-to-end check of `gnn_dgs` under DistDGL's launch layout on one host (issue 41 item 2; run by hand, root).

What DistDGL's tools/launch.py starts for 2 machines x 1 trainer: a graph server per machine (DGL_ROLE=server) and
per machine one trainer under `torch.distributed.run --nnodes 2` (DGL_ROLE=client), all running `flowlane-train
--config-name gnn_dgs`. On one host DGL takes every trainer for machine 0 and names a partition's shared-memory
tensors after the tensor only, so server 1 gets a private /dev/shm (a second host's) and the trainers share the host's
with server 0; two servers in one /dev/shm overwrite each other's features (a trainer then fails in fast_pull).

    .venv-gnn/bin/python scripts/distdgl_launch_gnn_dgs.py /tmp/gnn_dgs_launch   # prints the run's summary
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from flowlane.launch import free_port  # noqa: E402

BIN = Path(sys.executable).parent


def main(work: Path) -> int:
    from dgl_plugin.dgs_train import partition_redundant

    work.mkdir(parents=True, exist_ok=True)
    part, _ = partition_redundant(work, 2, seed=0, num_nodes=2000)
    ports = [free_port() for _ in range(3)]
    ip = work / "ip_config.txt"
    ip.write_text(f"127.0.0.1 {ports[0]}\n127.0.0.1 {ports[1]}\n")
    train = [str(BIN / "flowlane-train"), "--config-name", "gnn_dgs", "world_size=2", "epochs=3"]
    train += [f"output_dir={work}/out", f"hydra.run.dir={work}/hydra"]
    common = {"DGL_NUM_SAMPLER": "0", "DGL_NUM_CLIENT": "2", "DGL_CONF_PATH": part, "DGL_IP_CONFIG": str(ip)}
    common |= {"DGL_NUM_SERVER": "1", "DGL_GRAPH_FORMAT": "csc", "OMP_NUM_THREADS": "1"}

    def sh(role: dict[str, str], cmd: list[str], log: str) -> str:
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in {**common, **role}.items())
        return f"env {env} {shlex.join(cmd)} > {shlex.quote(str(work / log))} 2>&1"

    shells = []
    for m in range(2):
        server = sh({"DGL_ROLE": "server", "DGL_SERVER_ID": str(m)}, train, f"server{m}.log")
        if m == 1:  # a second host's /dev/shm
            server = f"mount -t tmpfs none /dev/shm && {server}"
        shells.append(
            ["unshare", "--mount", "--propagation", "private", "sh", "-c", server]
            if m
            else ["sh", "-c", server]
        )
        torchrun = [str(BIN / "python"), "-m", "torch.distributed.run", "--nproc_per_node=1", "--nnodes=2"]
        torchrun += [f"--node_rank={m}", "--master_addr=127.0.0.1", f"--master_port={ports[2]}", *train]
        client = {"DGL_DIST_MODE": "distributed", "DGL_ROLE": "client", "DGL_GROUP_ID": "0"}
        shells.append(["sh", "-c", sh(client, torchrun, f"trainer{m}.log")])
    t0 = time.monotonic()
    procs = [subprocess.Popen(cmd, cwd=work, start_new_session=True) for cmd in shells]
    try:
        rcs = [p.wait(timeout=1200) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    print(f"exit codes {rcs}, {time.monotonic() - t0:.1f} s")
    summary = work / "out" / "summary.json"
    if not summary.exists():
        return 1
    d = json.loads(summary.read_text())
    print(json.dumps({k: d[k] for k in ("launcher", "world_size", "val_acc", "test_acc", "bytes", "loss")}))
    return 0 if d["launcher"] == "distdgl" and not any(rcs) else 1


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/gnn_dgs_launch")))
