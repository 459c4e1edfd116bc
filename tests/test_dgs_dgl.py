"""DGS on real DistDGL (issue 35): one 2-partition localhost run (servers + trainers + explainers) pins the column
pulls, the explainer's life cycle and convergence; the explainer's failure path and the recipe checks run alone."""

import math
import os
import shutil
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

pytestmark = pytest.mark.gnn
pytest.importorskip("dgl")
torch = pytest.importorskip("torch")

from dgl_plugin.dgs_explainer import (  # noqa: E402
    CTL_MASK,
    CTL_MODEL,
    CTL_STOP,
    ExplainerError,
    ExplainerHandle,
    ExplainerSpec,
    explainer_main,
    shared_state,
)
from dgl_plugin.dgs_train import partition_redundant, run_cluster  # noqa: E402
from dgl_plugin.models import build_model  # noqa: E402
from flowlane.dgs import DGSConfig  # noqa: E402

needs_root = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None or shutil.which("nsenter") is None,
    reason="every DistDGL server gets a private /dev/shm, which the trainers join (root + unshare + nsenter)",
)

DGS = {
    "t_ex": 4,
    "synchronous": True,
    "explainer_epochs": 20,
    "explainer_min_epochs": 10,
    "n_f": 0.75,
    "epsilon": 0.1,
    "explainer_timeout_s": 600.0,  # the explainer's start (torch + DGL imports) on a loaded 2-core host
}


@needs_root
@pytest.mark.slow
# six processes import torch + DGL: 2-6 min on a loaded 2-core host; run_cluster stops at 900
@pytest.mark.timeout(1000)
def test_dgs_on_two_distdgl_partitions_pulls_exact_columns_explains_and_converges(tmp_path):
    part_config, classes = partition_redundant(tmp_path, 2, seed=0, num_nodes=600, avg_degree=8)
    args = {
        "runs": [{"name": "dgs", "dgs": DGS, "dgs_on": True, "self_check": True}],
        "seed": 0,
        "epochs": 6,
        "lr": 0.02,
        "batch": 32,
        "fanouts": [5, 5],
        "model": "sage",
        "hidden": 16,
        "classes": classes,
    }
    ranks = [r[0] for r in run_cluster(tmp_path / "run", part_config, 2, args, timeout_s=900)]
    f = ranks[0]["feat_dim"]
    for r in ranks:
        pc = r["pull_check"]  # column service vs DGL's own pull, remote rows only
        assert pc["remote_rows"] == pc["rows"] > 0 and pc["equal"] and pc["zero_elsewhere"]
        # PyTorch-Direct: own rows from the local table (FeatureStore), remote rows as before: DGL's own values
        assert pc["direct_own_rows"] > 0 and pc["direct_equal"]
        ex = r["explainer"]  # started, answered every snapshot (synchronous), stopped
        steps = r["steps_per_epoch"] * 6
        assert ex["snapshots"] == steps // 4 and ex["explanations"] == ex["snapshots"]
        assert r["history"][-1]["mask_version"] == ex["snapshots"]
        assert r["columns_pulled"] == math.ceil(0.75 * f)
        last = r["history"][-1]
        # remote rows after the masks carry 75 % of the columns (+ the column list): bytes per remote row < full
        assert 0 < last["bytes"]["feature_remote"] < last["remote_rows"] * (f * 4 + 8)
        assert r["bytes"]["sampling_rpc"] > 0 and r["bytes"]["prob_update"] > 0 and r["bytes"]["setup"] > 0
    # on one host DGL places every trainer on machine 0: only partition 0's table is in the trainers' shared memory
    assert [r["pull_check"]["direct_applied"] for r in ranks] == [True, False]
    loss = [sum(r["history"][e]["loss"] for r in ranks) / 2 for e in range(6)]
    assert loss[-1] < 0.6 * loss[0], loss
    assert ranks[0]["val_acc"] > 1.5 / classes, ranks[0]["val_acc"]  # well above chance (4 classes: 0.25)


def _tiny_spec(cfg):
    rng = np.random.default_rng(0)
    n_in, n_h, f = 30, 10, 8
    kw = {"name": "sage", "in_feats": f, "hidden": 8, "n_classes": 3, "num_layers": 2, "seed": 0}
    spec = ExplainerSpec(rng.integers(0, n_in + n_h, 120), rng.integers(0, n_in, 120), n_in, kw, cfg)
    return spec, torch.randn(n_in + n_h, f), build_model(**kw)


def test_a_dead_explainer_is_an_error_in_the_trainer_never_a_hang():
    cfg = DGSConfig(explainer_timeout_s=30.0)
    spec, x, model = _tiny_spec(cfg)
    h = ExplainerHandle(spec, x, model)
    h.proc.kill()
    h.proc.join(30)
    with pytest.raises(ExplainerError, match="exited with code"):
        h.poll()
    with pytest.raises(ExplainerError, match="exited with code"):
        h.publish(model)
    with pytest.raises(ExplainerError, match="exited with code"):
        h.wait()
    with pytest.raises(ExplainerError, match="exited with code"):
        h.stop()


def test_the_explainer_reports_the_spread_of_its_last_node_mask():
    # whether 𝒮𝒩 can steer the picks at all: min, max and (max - min) / mean of the last node mask, in the stats
    # that reach the run's summary (A6 #8). The explainer's loop runs in a thread here (no process start).
    cfg = DGSConfig(explainer_epochs=3, explainer_min_epochs=0, explainer_threads=torch.get_num_threads())
    spec, x, model = _tiny_spec(cfg)
    h = object.__new__(ExplainerHandle)  # the trainer side's view of the same shared tensors
    h.sh, h.published = shared_state(spec, x, model), 1
    assert h.stats()["last_sn_rel_spread"] is None  # no explanation yet
    h.sh["ctl"][CTL_MODEL] = 1
    t = threading.Thread(
        target=explainer_main, args=(spec, h.sh, threading.Lock(), os.getppid()), daemon=True
    )
    t.start()
    deadline = time.monotonic() + 120
    while int(h.sh["ctl"][CTL_MASK]) < 1 and t.is_alive() and time.monotonic() < deadline:
        time.sleep(0.01)
    h.sh["ctl"][CTL_STOP] = 1
    t.join(120)
    assert not t.is_alive() and int(h.sh["ctl"][CTL_MASK]) == 1
    st, sn = h.stats(), h.sh["sn"].double()
    assert st["explanations"] == 1 and sn.numel() == 10
    assert (st["last_sn_min"], st["last_sn_max"]) == (float(sn.min()), float(sn.max()))
    assert st["last_sn_rel_spread"] == pytest.approx(float((sn.max() - sn.min()) / sn.mean()), rel=1e-6)


@pytest.mark.parametrize(
    ("override", "match"),
    [
        ({"flowlane": {"dgs": {"nf": 0.5}}}, r"unknown option\(s\) \['nf'\]"),
        ({"flowlane": {"dgs": {"epsilon": 2}}}, r"bad epsilon=2"),
        ({"flowlane": {"dsg": {}}}, r"unknown flowlane section\(s\) \['dsg'\]"),
        ({"flowlane": {"direct": {"path": "uva"}}}, r"flowlane.direct: direct.path='uva' is not one of"),
        ({"world_size": 1}, r"world_size=1"),
        ({"model": {"name": "gat"}}, r"model.name='gat'"),
        ({"model": {"hiden": 8}}, r"unknown model key\(s\) \['hiden'\]; known: \['name', 'hidden'\]"),
        ({"model": {"hidden": 0}}, r"model.hidden=0 must be an integer >= 1"),
        ({"seed": -1}, r"seed=-1 must be an integer >= 0"),
        ({"lr": 0}, r"lr=0 must be a number > 0"),
        ({"lr": -0.01}, r"lr=-0.01 must be a number > 0"),
    ],
)
def test_gnn_dgs_recipe_rejects_bad_keys_and_values_by_name_before_starting(override, match):
    from recipes.train import run_job
    from recipes.validate import ConfigError

    with pytest.raises(ConfigError, match=match):
        run_job({"job": "gnn_dgs", **override})


def test_the_gnn_dgs_recipe_file_passes_its_own_checks(tmp_path):
    from pathlib import Path

    import yaml

    from recipes.train import CHECKS, JOBS

    cfg = yaml.safe_load((Path(__file__).resolve().parent.parent / "recipes/conf/gnn_dgs.yaml").read_text())
    assert cfg["job"] == "gnn_dgs" and JOBS["gnn_dgs"] == "dgl_plugin.dgs_train:run_dgs"
    CHECKS["gnn_dgs"]({**cfg, "output_dir": str(tmp_path / "out")})  # the check creates output_dir
    assert DGSConfig.from_dict(cfg["flowlane"]["dgs"]).n_f == 0.85


# ------------------------------------------------------------------ gnn_dgs under DistDGL's launcher (issue 41 item 2)
_LAUNCH_VARS = (
    "DGL_ROLE",
    "DGL_DIST_MODE",
    "DGL_IP_CONFIG",
    "DGL_CONF_PATH",
    "DGL_NUM_SERVER",
    "DGL_NUM_CLIENT",
    "DGL_NUM_SAMPLER",
    "DGL_SERVER_ID",
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
    "SLURM_STEP_ID",
    "SLURM_PROCID",
)


def _launch_env(tmp_path, role: str, **kw) -> dict:
    """What DistDGL's tools/launch.py sets for 2 machines x 1 trainer (trainers: under torch.distributed.run)."""
    part = tmp_path / "parts" / "g.json"
    part.parent.mkdir(exist_ok=True)
    part.write_text('{"graph_name": "g", "num_parts": 2}')
    ip = tmp_path / "ip_config.txt"
    ip.write_text("127.0.0.1 30050\n127.0.0.1 30051\n")
    env = {
        "DGL_ROLE": role,
        "DGL_IP_CONFIG": str(ip),
        "DGL_CONF_PATH": str(part),
        "DGL_NUM_SERVER": "1",
        "DGL_NUM_CLIENT": "2",
        "DGL_NUM_SAMPLER": "0",
    }
    if role == "server":
        env["DGL_SERVER_ID"] = "1"
    else:
        env.update(
            DGL_DIST_MODE="distributed",
            RANK="0",
            WORLD_SIZE="2",
            LOCAL_RANK="0",
            LOCAL_WORLD_SIZE="1",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT="29511",
            TORCHELASTIC_RUN_ID="dgs",
        )
    env.update(kw)
    return {k: v for k, v in env.items() if v is not None}


def _set_env(monkeypatch, env: dict) -> None:
    for k in _LAUNCH_VARS:
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)


def _no_cluster(*a, **kw):
    raise AssertionError("the local path (partition + run_cluster) ran under DistDGL's launcher")


def test_gnn_dgs_under_distdgls_launcher_serves_or_trains_the_launchers_partitions(tmp_path, monkeypatch):
    """The dispatch only (a real launched run is the slow test beside the local one): a server registers the DGS
    services before DGL's initialize and serves; a trainer trains the partitions of DGL_CONF_PATH through the
    servers of DGL_IP_CONFIG, gathers every rank's results and writes the summary."""
    from dgl.distributed import rpc

    from dgl_plugin.dgs import ColumnPullRequest
    from recipes.train import run_job

    monkeypatch.setattr("dgl_plugin.dgs_train.run_cluster", _no_cluster)
    monkeypatch.setattr("dgl_plugin.dgs_train.partition_redundant", _no_cluster)
    served = []

    def serve(role):
        served.append((role, rpc.REQUEST_CLASS_TO_SERVICE_ID.get(ColumnPullRequest)))

    monkeypatch.setattr("dgl_plugin.distdgl.serve", serve)
    env = _launch_env(tmp_path, "server")
    _set_env(monkeypatch, env)
    assert run_job({"job": "gnn_dgs", "output_dir": str(tmp_path / "out")}) == {}
    assert served[0][0].role == "server" and served[0][0].part_config == env["DGL_CONF_PATH"]
    assert served[0][1] is not None  # registered before serving
    assert not (tmp_path / "out").exists()

    seen = []

    def trainer(args):
        seen.append(args)
        rank = {
            "val_acc": 0.9,
            "test_acc": 0.8,
            "bytes": {"feature_remote": 10, "sampling_rpc": 2, "prob_update": 0, "setup": 0},
            "history": [{"loss": 1.0}, {"loss": 0.5}],
        }
        return [[rank], [dict(rank, bytes=dict(rank["bytes"], feature_remote=30))]]

    monkeypatch.setattr("dgl_plugin.dgs_train._trainer", trainer)
    env = _launch_env(tmp_path, "client")
    _set_env(monkeypatch, env)
    out = run_job({"job": "gnn_dgs", "output_dir": str(tmp_path / "out"), "flowlane": {"dgs": {"t_ex": 7}}})
    (args,) = seen
    assert args["ip_config"] == env["DGL_IP_CONFIG"] and args["part_config"] == env["DGL_CONF_PATH"]
    assert args["gather"] and args["classes"] is None  # classes come from the partitions' labels
    assert args["runs"] == [{"name": "gnn_dgs", "dgs": {"t_ex": 7}, "dgs_on": True}]
    assert out["launcher"] == "distdgl" and out["bytes"]["feature_remote"] == 40 and out["loss"] == [1.0, 0.5]
    assert (tmp_path / "out" / "summary.json").is_file()


@pytest.mark.parametrize(
    ("role", "env", "world", "match"),
    [
        ("client", {"DGL_NUM_SAMPLER": "2"}, 2, r"DGL_NUM_SAMPLER=2: gnn_dgs samples in the trainer"),
        ("client", {"DGL_NUM_CLIENT": "4"}, 2, r"DGL_NUM_CLIENT=4 but world_size=2"),
        ("client", {"WORLD_SIZE": "3"}, 2, r"world_size=2 does not match the 3 ranks torchrun started"),
        (
            "client",
            dict.fromkeys(
                (
                    "RANK",
                    "WORLD_SIZE",
                    "LOCAL_RANK",
                    "LOCAL_WORLD_SIZE",
                    "MASTER_ADDR",
                    "MASTER_PORT",
                    "TORCHELASTIC_RUN_ID",
                )
            ),
            2,
            r"DGL_ROLE=client without torchrun",
        ),
        ("server", {}, 3, r"num_parts=2 but world_size=3"),
        # DGS's node weights live in one server process per machine; DGL picks a random server per request
        (
            "server",
            {"DGL_NUM_SERVER": "2"},
            2,
            r"DGL_NUM_SERVER=2: gnn_dgs keeps its sampling weights.*--num_servers 1",
        ),
        ("client", {"DGL_NUM_SERVER": "2"}, 2, r"DGL_NUM_SERVER=2: gnn_dgs keeps its sampling weights"),
        (
            "server",
            {"DGL_CONF_PATH": "/nonexistent.json"},
            2,
            r"DGL_CONF_PATH='/nonexistent.json' is not a file",
        ),
        (None, {}, 2, r"gnn_dgs under torchrun without DistDGL's variables"),
    ],
)
def test_gnn_dgs_refuses_a_launch_that_does_not_fit_before_any_work(
    tmp_path, monkeypatch, role, env, world, match
):
    from recipes.train import run_job
    from recipes.validate import ConfigError

    for name in ("run_cluster", "partition_redundant", "_trainer"):
        monkeypatch.setattr(f"dgl_plugin.dgs_train.{name}", _no_cluster)
    monkeypatch.setattr("dgl_plugin.distdgl.serve", _no_cluster)
    if role is None:  # torchrun alone
        full = {k: v for k, v in _launch_env(tmp_path, "client").items() if not k.startswith("DGL_")}
    else:
        full = _launch_env(tmp_path, role, **env)
    _set_env(monkeypatch, full)
    with pytest.raises(ConfigError, match=match):
        run_job({"job": "gnn_dgs", "world_size": world})


# ------------------------------------------------------------------ a graph server that fails or does not answer
def test_a_server_that_does_not_answer_is_an_error_after_peer_timeout_never_a_hang(monkeypatch):
    """DGS's RPCs wait at most peer_timeout_s per answer. DGL's contract, emulated here: timeout=0 waits for ever (a
    server that died in a request hung the trainer), a finite one raises DGLError "Timed out ..." when nothing came."""
    from types import SimpleNamespace

    import dgl
    from dgl.distributed import rpc

    from dgl_plugin.dgs import DGSNeighborSampler
    from dgl_plugin.distdgl import PeerLostError
    from flowlane.dgs import ByteLedger

    waits = []

    def no_answer(target_and_requests, timeout=0):
        waits.append(timeout)
        if timeout == 0:
            raise AssertionError("remote_call_to_machine(timeout=0) waits for ever for a dead server")
        raise dgl.DGLError(f"Timed out for receiving message within {timeout} milliseconds")

    monkeypatch.setattr(rpc, "remote_call_to_machine", no_answer)
    rt = SimpleNamespace(
        owner=lambda ids: ids % 2, part_id=0, mask_version=0, ledger=ByteLedger(), peer_timeout_s=2.5
    )
    sampler = DGSNeighborSampler([3], rt, weighted=True, epsilon=0.1)
    g = SimpleNamespace(num_nodes=lambda: 10)
    with pytest.raises(
        PeerLostError,
        match=r"DGS sampling: the graph server\(s\) of partition\(s\) \[0, 1\] did not answer "
        r"within peer_timeout_s=2.5 s",
    ):
        sampler._hop(g, torch.arange(4), 3)
    assert waits == [2500]


def test_a_dgl_read_without_an_answer_is_peer_lost_error_after_peer_timeout_never_a_hang(monkeypatch):
    """DGL's own pull (``DistTensor[ids]``) and sampling have no timeout (C++ ``RecvRPCMessage(msg, 0)``); DGS runs
    them through ``bounded``. Emulated: a tensor whose rows of partition 1 never come. Rows of this machine's partition
    are read directly; a read that waits on partition 1 is PeerLostError after peer_timeout_s, and so is every later
    read (the first still holds DGL's client). Errors and values of the call pass through. (The real thing, a killed
    server: tests/test_dgs_dead_peer.py.)"""
    import threading
    from types import SimpleNamespace

    from dgl_plugin import dgs
    from dgl_plugin.distdgl import PeerLostError

    release, seen = threading.Event(), []

    class Rows:  # a DistTensor over 2 partitions whose server 1 never answers
        def __getitem__(self, ids):
            seen.append(threading.current_thread())
            if bool((ids % 2 == 1).any()):
                release.wait()
            return ids.float()[:, None]

    pb = SimpleNamespace(partid=0, nid2partid=lambda ids: ids % 2)
    g = SimpleNamespace(get_partition_book=lambda: pb, ndata={"feat": Rows()})
    monkeypatch.setattr(dgs, "_WAITER", None)
    try:
        assert dgs.read_rows(g, "feat", torch.tensor([0, 2]), 0.5).tolist() == [[0.0], [2.0]]
        assert seen == [threading.current_thread()]  # shared memory only: no server to wait for
        lost = r"DistDGL pull of 'feat': the graph server\(s\) of partition\(s\) \[1\] did not answer within "
        with pytest.raises(PeerLostError, match=lost + r"peer_timeout_s=0.5 s"):
            dgs.read_rows(g, "feat", torch.tensor([0, 1]), 0.5)
        with pytest.raises(
            PeerLostError, match=r"not sent: an earlier DistDGL call \(DistDGL pull of 'feat'\)"
        ):
            dgs.read_rows(g, "feat", torch.tensor([3]), 0.5)
    finally:
        release.set()  # let the emulated read end (a real one stays, in a daemon thread)
    monkeypatch.setattr(dgs, "_WAITER", None)
    with pytest.raises(ZeroDivisionError):
        dgs.bounded(lambda: 1 / 0, 5.0, "x", [1])
    assert (
        dgs.bounded(lambda: dgs.bounded(lambda: 7, 5.0, "inner", [1]), 5.0, "outer", [1]) == 7
    )  # nested: direct


def test_a_failing_dgs_request_is_answered_as_an_error_and_the_server_lives_on(tmp_path, monkeypatch):
    """An exception in a request handler used to end DGL's server process (here: a negative sampling key, which numpy
    refuses); it is answered instead, and the trainer raises it naming the partition."""
    import types

    import dgl
    from dgl.distributed import rpc

    from dgl_plugin.dgs import QuotaSampleRequest, QuotaSampleResponse, remote_call

    part_config, _ = partition_redundant(tmp_path, 2, num_nodes=300)
    g, _, _, gpb, *_ = dgl.distributed.load_partition(part_config, 0)
    server = types.SimpleNamespace(graph=g, partition_book=gpb)
    seeds = gpb.partid2nids(0)[:5]
    ok = QuotaSampleRequest(seeds, 3, 0.1, 0, True, "uniform", 1).process_request(server)
    assert ok.error is None and ok.src.numel() > 0
    bad = QuotaSampleRequest(seeds, 3, 0.1, 0, True, "uniform", -5).process_request(server)
    assert bad.src.numel() == 0 and "ValueError" in bad.error
    data, tensors = rpc.serialize_to_payload(bad)  # the error crosses the wire with the response
    got = rpc.deserialize_from_payload(QuotaSampleResponse, data, tensors)
    assert got.error == bad.error
    monkeypatch.setattr(rpc, "remote_call_to_machine", lambda reqs, timeout=0: [ok, got])
    with pytest.raises(
        RuntimeError, match=r"DGS sampling: the graph server of partition 1 failed: ValueError"
    ):
        remote_call([(0, None), (1, None)], 5.0, "DGS sampling")


def test_the_run_timeout_is_a_stall_timeout_not_a_cap(tmp_path):
    """The parent cuts a trainer only after ``timeout_s`` without a line in any trainer's log: one that logs every
    0.2 s runs twice as long as a 2 s timeout; one that falls silent is an error naming the stall (a cap of
    ``timeout_s`` on the whole run cut the first)."""
    from dgl_plugin.dgs_train import _wait_for_trainers

    def trainer(name: str, code: str):
        log = tmp_path / f"{name}.log"
        with open(log, "w") as fh:
            return (
                name,
                subprocess.Popen([sys.executable, "-c", code], stdout=fh, stderr=subprocess.STDOUT),
                log,
            )

    busy = "import time\nfor i in range(20):\n    print(i, flush=True)\n    time.sleep(0.2)"
    t0 = time.monotonic()
    procs = [trainer("busy", busy)]
    _wait_for_trainers(procs, procs, timeout_s=2.0)  # 4 s of epochs under a 2 s stall timeout
    assert time.monotonic() - t0 > 2.0 and procs[0][1].returncode == 0
    silent = [trainer("silent", "print('start', flush=True)\nimport time\ntime.sleep(60)")]
    try:
        with pytest.raises(RuntimeError, match=r"made no progress for timeout_s=1.0 s"):
            _wait_for_trainers(silent, silent, timeout_s=1.0)
    finally:
        silent[0][1].kill()
        silent[0][1].wait()
