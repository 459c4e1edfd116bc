"""`flowlane-train` under an external launcher (issue 41): torchrun / srun start one process per rank and each runs
its own rank only; a bad launcher environment is refused before any work, naming the variable.

Launcher-environment checks are pure (both lanes); the GPT recipe under torchrun needs the llm lane, the GNN recipe
under torchrun and under DistDGL's launcher the gnn lane.
"""

from __future__ import annotations

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
from flowlane.launch_external import (
    ExternalLaunch,
    LauncherEnvError,
    check_world,
    cuda_device_for,
    detect_launcher,
)

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


def _torchrun_env(**kw: str) -> dict[str, str]:
    env = {
        "RANK": "1",
        "WORLD_SIZE": "4",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "4",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29500",
        "TORCHELASTIC_RUN_ID": "job7",
    }
    env.update(kw)
    return {k: v for k, v in env.items() if v is not None}


def _srun_env(**kw: str) -> dict[str, str]:
    env = {
        "SLURM_JOB_ID": "123",
        "SLURM_STEP_ID": "0",
        "SLURM_PROCID": "5",
        "SLURM_NTASKS": "8",
        "SLURM_LOCALID": "1",
        "SLURM_NODEID": "1",
        "SLURM_TASKS_PER_NODE": "4(x2)",
        "MASTER_ADDR": "node01",
        "MASTER_PORT": "29500",
    }
    env.update(kw)
    return {k: v for k, v in env.items() if v is not None}


# ------------------------------------------------------------------------------------------------ launcher env
def test_no_launcher_variables_mean_local_ranks():
    assert detect_launcher({"PATH": "/usr/bin"}) is None
    # a Slurm batch script running the command directly (no srun step) is no launcher either
    assert detect_launcher({"SLURM_JOB_ID": "123", "SLURM_PROCID": "0", "SLURM_NTASKS": "8"}) is None
    assert detect_launcher(_srun_env(SLURM_STEP_ID="batch")) is None
    # nor an interactive one-task step (srun --pty bash), where flowlane-train starts its local ranks
    assert (
        detect_launcher(
            _srun_env(SLURM_NTASKS="1", SLURM_PROCID="0", SLURM_LOCALID="0", SLURM_TASKS_PER_NODE="1")
        )
        is None
    )


def test_torchrun_environment_is_read_as_this_ranks_place():
    ext = detect_launcher(_torchrun_env())
    assert ext == ExternalLaunch("torchrun", 1, 4, 1, 4, "127.0.0.1", 29500, "job7")


def test_srun_environment_is_read_with_tasks_per_node():
    ext = detect_launcher(_srun_env())
    assert ext == ExternalLaunch("slurm", 5, 8, 1, 4, "node01", 29500, "123.0")
    # uneven nodes: "4(x2),3" puts 3 tasks on the third node; the step's own count wins over the job's
    ext = detect_launcher(
        _srun_env(
            SLURM_NODEID="2", SLURM_TASKS_PER_NODE="4(x2),3", SLURM_STEP_NUM_TASKS="11", SLURM_PROCID="9"
        )
    )
    assert (ext.world_size, ext.local_world_size) == (11, 3)
    # srun torchrun ...: torchrun's variables win
    both = {**_srun_env(), **_torchrun_env()}
    assert detect_launcher(both).launcher == "torchrun"


@pytest.mark.parametrize(
    "env, match",
    [
        (_torchrun_env(WORLD_SIZE=None), r"WORLD_SIZE is not set, but torchrun sets it"),
        (_torchrun_env(RANK="4"), r"RANK=4 must be >= 0 and < 4"),
        (_torchrun_env(WORLD_SIZE="four"), r"WORLD_SIZE='four' must be an integer"),
        (
            _torchrun_env(MASTER_ADDR=None),
            r"MASTER_ADDR not set under torchrun: the ranks have no rendezvous",
        ),
        (_torchrun_env(MASTER_ADDR=None, MASTER_PORT=None), r"MASTER_ADDR and MASTER_PORT not set"),
        (_torchrun_env(MASTER_PORT="70000"), r"MASTER_PORT='70000' must be a TCP port"),
        (_torchrun_env(LOCAL_RANK="4"), r"LOCAL_RANK=4 must be >= 0 and < 4"),
        (_srun_env(MASTER_ADDR=None), r"MASTER_ADDR not set under srun.*scontrol show hostnames"),
        (_srun_env(SLURM_PROCID="8"), r"SLURM_PROCID=8 must be >= 0 and < 8"),
    ],
)
def test_a_partial_or_contradictory_launcher_environment_is_refused(env, match):
    with pytest.raises(LauncherEnvError, match=match):
        detect_launcher(env)


def test_the_launchers_world_must_be_the_jobs():
    ext = detect_launcher(_torchrun_env())
    check_world(ext, 4, "world_size")
    with pytest.raises(
        LauncherEnvError,
        match=r"world_size=2 does not match the 4 ranks torchrun started "
        r"\(WORLD_SIZE=4\): pass world_size=4",
    ):
        check_world(ext, 2, "world_size")


def test_more_local_ranks_than_gpus_is_refused_unless_each_has_its_own_nccl_host(monkeypatch):
    import torch

    ext = detect_launcher(_torchrun_env(RANK="3", LOCAL_RANK="3"))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(
        LauncherEnvError, match=r"4 ranks on this node \(LOCAL_WORLD_SIZE\) but 2 visible GPU"
    ):
        cuda_device_for(ext, {})
    assert cuda_device_for(ext, {"NCCL_HOSTID": "h3"}) == 1
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    assert cuda_device_for(ext, {}) == 3
    # srun --gpus-per-task=1: every task sees its own GPU as device 0
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert cuda_device_for(detect_launcher(_srun_env()), {}) == 0
    with pytest.raises(LauncherEnvError, match=r"4 ranks on this node"):
        cuda_device_for(ext, {})  # torchrun's ranks all see the one GPU: refused
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(LauncherEnvError, match="sees no CUDA device"):
        cuda_device_for(ext, {})


def test_hydra_keeps_one_run_folder_rank_zero_writes_it():
    pytest.importorskip("hydra")
    from recipes.train import rank_overrides

    assert rank_overrides([], {}) == []
    assert rank_overrides([], {"RANK": "0"}) == []
    assert rank_overrides([], {"RANK": "2"}) == [
        "hydra.output_subdir=null",
        "hydra/job_logging=disabled",
        "hydra.run.dir=.",
    ]
    assert rank_overrides([], {"SLURM_PROCID": "1", "SLURM_STEP_ID": "0"})[0] == "hydra.output_subdir=null"
    assert rank_overrides([], {"SLURM_PROCID": "1"}) == []  # a batch script, not an srun task


# ------------------------------------------------------------------------------------------------ GPT recipe (llm)
def _no_ranks(*a, **kw):
    raise AssertionError("ranks or a process group were started before the launcher environment was checked")


@pytest.mark.llm
@pytest.mark.parametrize(
    "env, override, match",
    [
        (
            _torchrun_env(),
            {"world_size": 2, "pipeline_parallel": 2},
            r"world_size=2 does not match the 4 ranks torchrun started",
        ),
        (
            _torchrun_env(WORLD_SIZE="6", LOCAL_WORLD_SIZE="6"),
            {"world_size": 6, "pipeline_parallel": 4},
            r"world_size=6 must be a multiple of pipeline_parallel x tensor_parallel = 4",
        ),
        (_torchrun_env(MASTER_PORT=None), {}, r"MASTER_PORT not set under torchrun"),
        (_torchrun_env(), {"device": "cuda"}, r"device=cuda but torch .* sees no CUDA device"),
        ({}, {"device": "cuda"}, r"device=cuda runs one process per GPU, started by torchrun or srun"),
        (
            _srun_env(SLURM_NTASKS="4", SLURM_TASKS_PER_NODE="2(x2)", SLURM_PROCID="3"),
            {"world_size": 8},
            r"world_size=8 does not match the 4 ranks slurm started",
        ),
    ],
)
def test_a_bad_launcher_environment_is_refused_before_any_work(tmp_path, monkeypatch, env, override, match):
    pytest.importorskip("megatron.core")
    from recipes.train import run_job
    from recipes.validate import ConfigError

    for k in (
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "TORCHELASTIC_RUN_ID",
        "SLURM_STEP_ID",
        "SLURM_PROCID",
    ):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr("flowlane.launch.launch", _no_ranks)
    monkeypatch.setattr("flowlane.launch_external.run_this_rank", _no_ranks)
    monkeypatch.setattr("torch.distributed.init_process_group", _no_ranks)
    with pytest.raises(ConfigError, match=match):
        run_job({"job": "gpt", "output_dir": str(tmp_path / "out"), **override})


def _run(
    cmd: list[str], tmp: Path, name: str, env: dict[str, str] | None = None, timeout: float = 600
) -> subprocess.CompletedProcess:
    # output to a file, not a pipe: an orphaned rank must never hold the test's pipe open
    log = tmp / f"{name}.log"
    with open(log, "w") as f:
        r = subprocess.run(
            cmd,
            stdout=f,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=timeout,
            cwd=tmp,
            env={**os.environ, **(env or {})},
        )
    r.stdout = log.read_text(errors="replace")
    return r


@pytest.mark.llm
@pytest.mark.slow
@pytest.mark.timeout(1500)  # two 4-rank runs: imports alone take minutes on a busy 2-core host
def test_torchrun_with_four_gloo_ranks_gives_the_local_launchers_losses(tmp_path):
    """The MoE recipe (PP2 x DP2, EP2 folded into DP, Hermod on): one local-launcher run, one torchrun run.

    It covers the default recipe's path too (the same run_gpt, launcher and Megatron DDP; only the MLP differs)
    and adds the expert all-to-alls; ~30 s of CPU per rank go to importing Megatron-core, so the test runs one
    recipe, with 2 layers (1 MoE layer per stage), 2 micro-batches and 2 iterations (the second after an update)."""
    pytest.importorskip("megatron.core")
    small = ["--config-name", "moe", "iterations=2", "num_layers=2", "num_microbatches=2", "progress=false"]
    # the ranks' start-up limit is max(300 s, timeout_s): ~30 s CPU of imports each
    small += ["timeout_s=900"]
    train = str(BIN / "flowlane-train")
    local = _run(
        [train, *small, f"output_dir={tmp_path}/local", f"hydra.run.dir={tmp_path}/local/hydra"],
        tmp_path,
        "local",
    )
    assert local.returncode == 0, local.stdout[-3000:]
    tr = _run(
        [
            str(BIN / "torchrun"),
            "--nproc_per_node",
            "4",
            "--master_addr",
            "127.0.0.1",
            "--master_port",
            str(free_port()),
            train,
            *small,
            f"output_dir={tmp_path}/torchrun",
            f"hydra.run.dir={tmp_path}/torchrun/hydra",
        ],
        tmp_path,
        "torchrun",
    )
    assert tr.returncode == 0, tr.stdout[-3000:]
    a = json.loads((tmp_path / "local" / "metrics.json").read_text())
    b = json.loads((tmp_path / "torchrun" / "metrics.json").read_text())
    assert b["launch"]["launcher"] == "torchrun" and b["launch"]["world_size"] == 4
    assert b["recipe"]["device"] == "cpu" and "started by torchrun (gloo)" in b["note"]
    assert (b["recipe"]["num_moe_experts"], b["recipe"]["expert_parallel"]) == (4, 2)
    # the same float values: same weights, tokens and op order, only the launcher differs
    assert b["loss"] == a["loss"] and len(a["loss"]) == 2
    assert [r["losses"] for r in b["per_rank"]] == [r["losses"] for r in a["per_rank"]]
    assert [r["param_digest"] for r in b["per_rank"]] == [r["param_digest"] for r in a["per_rank"]]
    # expert parallelism ran: token all-to-alls between the two expert ranks of each stage, the same bytes
    assert b["bytes_by_kind"] == a["bytes_by_kind"] and b["bytes_by_kind"].get("ep", 0) > 0
    # rank 0 gathered every rank's trace and wrote the run's one folder; only one summary was printed
    trace = json.loads((tmp_path / "torchrun" / "trace.json").read_text())
    assert {e["pid"] for e in trace["traceEvents"] if e["ph"] == "X"} == {0, 1, 2, 3}
    assert tr.stdout.count("flowlane-train summary") == 1
    assert sorted(p.name for p in (tmp_path / "torchrun").iterdir()) == [
        "hydra",
        "metrics.json",
        "trace.json",
    ]
    assert not (tmp_path / "outputs").exists()  # no stray Hydra folders from the other ranks


# ------------------------------------------------------------------------------------------------ GNN recipe (gnn)
def _partition(tmp: Path) -> Path:
    import dgl

    from dgl_plugin.datasets import load_graph

    g = load_graph(
        "synthetic", seed=0, num_nodes=600, avg_degree=8, num_classes=4, num_communities=8, feat_dim=8
    )
    # a graph name unique per run: DGL names the servers' shared-memory segments after it
    name = f"syn{os.getpid()}x{time.monotonic_ns() % 10**9}"
    dgl.distributed.partition_graph(g, name, 2, str(tmp / "parts"), num_hops=1, part_method="metis")
    return tmp / "parts" / f"{name}.json"


@pytest.mark.gnn
def test_gnn_recipe_refuses_a_distdgl_environment_that_does_not_fit(tmp_path, monkeypatch):
    pytest.importorskip("dgl")
    from recipes.train import run_job
    from recipes.validate import ConfigError

    part = _partition(tmp_path)
    ip = tmp_path / "ip_config.txt"
    ip.write_text("127.0.0.1 30050\n127.0.0.1 30051\n")
    monkeypatch.setattr("dgl_plugin.distdgl.serve", _no_ranks)
    monkeypatch.setattr("dgl_plugin.distdgl.connect", _no_ranks)
    monkeypatch.setattr("flowlane.launch_external.run_this_rank", _no_ranks)
    client = {
        "DGL_ROLE": "client",
        "DGL_DIST_MODE": "distributed",
        "DGL_IP_CONFIG": str(ip),
        "DGL_CONF_PATH": str(part),
        "DGL_NUM_SERVER": "1",
        "DGL_NUM_CLIENT": "2",
        "DGL_NUM_SAMPLER": "0",
        "GROUP_RANK": "0",
        **_torchrun_env(RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1"),
    }
    one_line = tmp_path / "ip_one.txt"
    one_line.write_text("127.0.0.1 30050\n")
    cases = [
        ({"DGL_NUM_CLIENT": "4"}, {}, r"DGL_NUM_CLIENT=4 but 2 trainers were started"),
        ({"DGL_NUM_SAMPLER": "1"}, {}, r"DGL_NUM_SAMPLER=1: full-graph training samples nothing"),
        ({"DGL_CONF_PATH": str(tmp_path / "nope.json")}, {}, r"DGL_CONF_PATH='.*nope.json' is not a file"),
        ({"DGL_IP_CONFIG": None}, {}, r"DGL_ROLE=client but \['DGL_IP_CONFIG'\] not set"),
        (
            {"RANK": None, "WORLD_SIZE": None, "TORCHELASTIC_RUN_ID": None},
            {},
            r"DGL_ROLE=client without torchrun's variables",
        ),
        (
            {"WORLD_SIZE": "3", "DGL_NUM_CLIENT": "3"},
            {},
            r"world_size=2 does not match the 3 ranks torchrun started",
        ),
        (  # launch.py --num_trainers 2 on one machine: the 2 trainers would share its one partition
            {"DGL_IP_CONFIG": str(one_line), "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"},
            {},
            r"DistDGL's launcher started 2 trainers per machine \(--num_trainers 2, LOCAL_WORLD_SIZE=2\) "
            r"on a partitioning of num_parts=2 for the 1 line\(s\) of DGL_IP_CONFIG=.*runs --num_trainers 1",
        ),
        (
            {"DGL_IP_CONFIG": str(one_line)},
            {},
            r"has num_parts=2 but DGL_IP_CONFIG='.*ip_one.txt' lists 1 machine\(s\)",
        ),
        (  # a host listed once per trainer: the line tells the trainer's GPU, torchrun's GROUP_RANK names it
            {"GROUP_RANK": None},
            {},
            r"GROUP_RANK=None must be this trainer's line of DGL_IP_CONFIG=.* \(0 to 1\)",
        ),
        (
            {},
            {"data": {"name": "synthetic", "part_config": str(tmp_path / "other.json")}},
            r"data.part_config='.*other.json' but DistDGL's launcher gave DGL_CONF_PATH",
        ),
    ]
    (tmp_path / "other.json").write_text("{}")
    for env, override, match in cases:
        for k in (*client, "SLURM_STEP_ID", "SLURM_PROCID"):
            monkeypatch.delenv(k, raising=False)
        for k, v in {**client, **env}.items():
            if v is not None:
                monkeypatch.setenv(k, v)
        with pytest.raises(ConfigError, match=match):
            run_job(
                {"job": "gnn_fullgraph", "world_size": 2, "output_dir": str(tmp_path / "out"), **override}
            )


def test_a_host_listed_once_per_trainer_gives_each_trainer_its_own_slot(tmp_path):
    from dgl_plugin.distdgl import DistDGLRole, host_slot, ip_config_hosts

    ip = tmp_path / "ip_config.txt"
    ip.write_text("10.0.0.1 30050\n10.0.0.2 30050\n\n10.0.0.1 30051\n10.0.0.1\n")
    assert ip_config_hosts(str(ip)) == ["10.0.0.1", "10.0.0.2", "10.0.0.1", "10.0.0.1"]
    r = DistDGLRole("client", str(ip), "p.json", 1, 4, 0)
    # line i is torchrun node i (GROUP_RANK): its place among its host's lines is its GPU
    assert [host_slot(r, {"GROUP_RANK": str(i)}) for i in range(4)] == [(0, 3), (0, 1), (1, 3), (2, 3)]
    ip.write_text("10.0.0.1\n10.0.0.2\n")
    assert host_slot(r, {}) is None  # one line per host: torchrun's LOCAL_RANK stands


def _gnn_cmd(tmp: Path, name: str) -> list[str]:
    return [
        str(BIN / "flowlane-train"),
        "--config-name",
        "gnn_fullgraph",
        "world_size=2",
        "epochs=3",
        "model.hidden=16",
        f"output_dir={tmp}/{name}",
        f"hydra.run.dir={tmp}/{name}/hydra",
    ]


@pytest.mark.gnn
@pytest.mark.slow
@pytest.mark.timeout(1500)
@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None,
    reason="each DistDGL server gets a private /dev/shm, as on a machine of its own (root + unshare)",
)
def test_gnn_recipe_under_distdgls_launcher_on_localhost_equals_the_local_launcher(tmp_path):
    """What DistDGL's tools/launch.py does for 2 machines x 1 trainer, on localhost: a graph server per machine
    (DGL_ROLE=server) and, per machine, the command under torch.distributed.run --nnodes 2 (DGL_ROLE=client).
    Both lines of ip_config name 127.0.0.1: this is also the layout for 2 trainers on one machine (the host listed
    once per trainer; launch.py's --num_trainers 2 is refused, see the test above). Each server runs in its own
    mount namespace with a private /dev/shm: DGL names its KVStore segments after the tensor only, so two servers
    (or another run's) in one /dev/shm would overwrite each other's (docs/dgs.md); the trainers read their
    partitions from disk and map no segment."""
    pytest.importorskip("dgl")
    part = _partition(tmp_path)
    ports = [free_port() for _ in range(3)]
    ip = tmp_path / "ip_config.txt"
    ip.write_text(f"127.0.0.1 {ports[0]}\n127.0.0.1 {ports[1]}\n")
    common = {
        "DGL_NUM_SAMPLER": "0",
        "DGL_NUM_CLIENT": "2",
        "DGL_CONF_PATH": str(part),
        "DGL_IP_CONFIG": str(ip),
        "DGL_NUM_SERVER": "1",
        "DGL_GRAPH_FORMAT": "csc",
        "OMP_NUM_THREADS": "1",
    }
    procs: list[subprocess.Popen] = []
    logs = []

    def start(cmd: list[str], env: dict[str, str], name: str, distdgl: bool = True) -> None:
        f = open(tmp_path / f"{name}.log", "w")  # noqa: SIM115 - closed below
        logs.append(f)
        procs.append(
            subprocess.Popen(
                cmd,
                stdout=f,
                stderr=subprocess.STDOUT,
                cwd=tmp_path,
                start_new_session=True,
                env={**os.environ, **(common if distdgl else {"OMP_NUM_THREADS": "1"}), **env},
            )
        )

    try:
        # the local launcher's run on the same partitions goes side by side (its ranks import while DistDGL's
        # processes wait for each other); no DGL_ROLE: flowlane-train starts its own 2 ranks
        start([*_gnn_cmd(tmp_path, "local"), f"+data.part_config={part}"], {}, "local", distdgl=False)
        for i in range(2):
            private_shm = ["unshare", "--mount", "--propagation", "private", "sh", "-c"]
            private_shm += ['mount -t tmpfs tmpfs /dev/shm && exec "$@"', "sh"]
            start(
                [*private_shm, *_gnn_cmd(tmp_path, "distdgl")],
                {"DGL_ROLE": "server", "DGL_SERVER_ID": str(i)},
                f"server{i}",
            )
        for node in range(2):
            start(
                [
                    sys.executable,
                    "-m",
                    "torch.distributed.run",
                    "--nproc_per_node=1",
                    "--nnodes=2",
                    f"--node_rank={node}",
                    "--master_addr=127.0.0.1",
                    f"--master_port={ports[2]}",
                    *_gnn_cmd(tmp_path, "distdgl"),
                ],
                {"DGL_DIST_MODE": "distributed", "DGL_ROLE": "client", "DGL_GROUP_ID": "0"},
                f"trainer{node}",
            )
        deadline = time.monotonic() + 900  # busy 2-core CI host: 9 processes import DGL
        for p in procs:  # the trainers finish, then the first one shuts the servers down
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        for f in logs:
            f.close()
    out = {
        n: (tmp_path / f"{n}.log").read_text(errors="replace")
        for n in ("local", "server0", "server1", "trainer0", "trainer1")
    }
    assert all(p.returncode == 0 for p in procs), "\n".join(f"--- {n}\n{t[-2000:]}" for n, t in out.items())
    a = json.loads((tmp_path / "local" / "summary.json").read_text())
    b = json.loads((tmp_path / "distdgl" / "summary.json").read_text())
    assert b["world_size"] == 2 and len(b["history"]) == 3
    # same partitions, seed and op order: the same float values as the local launcher's run
    assert [h["loss"] for h in b["history"]] == [h["loss"] for h in a["history"]]
    assert b["graph_bytes_total"] == a["graph_bytes_total"] > 0
    assert (
        out["trainer0"].count("gnn_fullgraph summary") + out["trainer1"].count("gnn_fullgraph summary") == 1
    )
