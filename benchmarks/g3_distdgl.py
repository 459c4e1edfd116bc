"""G3 full-graph training vs real DistDGL mini-batch training on the same DistDGL partitions, on SHAPED links (issue
34 item 5).

Both read one ``dgl.distributed.partition_graph`` output (METIS, ``parts`` partitions, a graph name unique per run):
- DistDGL: one simulated machine per partition, each in its own network namespace of a
  :class:`flowlane.testing.netem.EmulatedNetwork` (access link shaped with tbf both ways, ``--rate-mbit``, bucket
  ``--burst-kb``): a DistGraph server and a trainer (``DistGraph``, ``DistNodeDataLoader`` + ``NeighborSampler``,
  gradients averaged with a gloo all-reduce every step), the same SAGE model; evaluation is sampled with all
  neighbours on the validation nodes and counts in the time. Each machine has a private /dev/shm (its own mount
  namespace: DGL names shared memory after the graph, and the tmpfs vanishes with the machine, so nothing is left in
  the host's /dev/shm). Every trainer finds its machine by its namespace's IP, so it reads its own partition locally.
- G3: ``parts`` ranks of :class:`dgl_plugin.fullgraph.FullGraphRuntime`, one per namespace of the same network, each
  loading only its partition; the halo exchange and all-reduces go over the shaped links.
Sweeps (``--layers 2,3,4 --fanouts 5,10,25``: every layer count with every uniform per-layer fanout; or one explicit
``--fanout 25,10``) run inside one session per system and seed: DistDGL's servers and trainers start once and train
every (layers, fanout) config in turn, G3's ranks every layer count (G3 samples nothing, so the fanout does not apply
to it); ``--warmup-epochs`` untimed epochs of the first config come first, so no config pays the session's lazy
start-up. Each config trains a fresh model (the same seeded initialisation for both systems).
Reported per seed and config: validation accuracy over time (after start-up), the time each reaches the same target
accuracy (``--target``, default 0.90; 0 means 0.95 x the lower of the two best accuracies; each system stops at the
first epoch at or above a fixed target unless ``--run-past-target``, and is given up to ``--g3-epochs`` /
``--dd-epochs`` to get there), and the bytes each sent: on the wire (``tx_bytes`` of every namespace's interface,
all traffic incl. TCP/IP headers, RPC and setup; per config, read inside the namespaces) and at the application
level. Per seed: graph generation and partitioning time, each system's start-up (launch to ready), peak resident
memory (this process after partitioning; all the emulated machines' processes together, sampled each second), the
host's load average at start and end. The result JSON is rewritten after every phase, and on SIGTERM or a
``--timeout``, with what was measured so far (``status`` says why it is incomplete; epochs from the progress files).
EMULATED links on a shared 2-core CPU box (both systems share its 2 cores; the figures are about this box, not a
cluster). Needs root (network namespaces).

Run: .venv-gnn/bin/python benchmarks/g3_distdgl.py [--nodes 50000] [--parts 4] [--seeds 0,1,2] [--rate-mbit 100]
     [--target 0.90] [--g3-epochs 60] [--dd-epochs 40] [--layers 2,3,4 --fanouts 5,10,25 | --fanout 10,10]
     -> results/g3/distdgl_shaped_<nodes>.json (or --out)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import time
import uuid

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = "results/g3"


def _trainer(a: argparse.Namespace) -> None:
    from dgl_plugin.distdgl import connect_trainer, leave, peer_guard, trainer_process_group

    connect_trainer(a.ip_config, 600.0)  # a dead peer trainer is an error, never a hang (dgl_plugin.distdgl)
    with peer_guard(600.0, "DistDGL baseline trainer"):
        trainer_process_group(600.0)
        _train_distdgl(a)
    leave(600.0)


def _train_distdgl(a: argparse.Namespace) -> None:
    """Every (layers, fanout) config of the sweep in turn, in this one DistDGL session (start-up paid once)."""
    import dgl
    import torch
    import torch.nn.functional as F

    from dgl_plugin.models import build_model

    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    t_ready = time.time()
    g = dgl.distributed.DistGraph(a.graph_name, part_config=a.part_config)
    pb = g.get_partition_book()
    train = dgl.distributed.node_split(g.ndata["train_mask"], pb, force_even=True)
    val = dgl.distributed.node_split(g.ndata["val_mask"], pb, force_even=True)
    configs = json.loads(a.configs)
    out = {"world": world, "t_connected_unix": t_ready, "t_graph_ready_unix": time.time(), "configs": []}

    def train_config(layers: int, fan: list[int], epochs: int, tag: str) -> dict:
        model = build_model("sage", a.feat_dim, a.hidden, a.classes, layers, seed=a.seed)
        opt = torch.optim.Adam(model.parameters(), lr=a.lr)
        loader = dgl.dataloading.DistNodeDataLoader(
            g, train, dgl.dataloading.NeighborSampler(fan), batch_size=a.batch, shuffle=True, drop_last=False
        )
        vloader = dgl.dataloading.DistNodeDataLoader(
            g,
            val,
            dgl.dataloading.NeighborSampler([-1] * layers),
            batch_size=a.batch,
            shuffle=False,
            drop_last=False,
        )

        def run(blocks, x):
            h = x
            for k, blk in enumerate(blocks):
                h = model.forward_layer(k, blk, h, h[: blk.num_dst_nodes()])
            return h

        tx0 = _ns_tx_bytes(a.ifname)
        hist, t0, rows, remote, grad_bytes, steps = [], time.perf_counter(), 0, 0, 0, 0
        for ep in range(epochs):
            model.train()
            for inp, seeds, blocks in loader:
                rows += int(inp.numel())
                # feature rows pulled from another machine
                remote += int((pb.nid2partid(inp) != pb.partid).sum())
                x, y = g.ndata["feat"][inp], g.ndata["label"][seeds]
                loss = F.cross_entropy(run(blocks, x), y)
                opt.zero_grad()
                loss.backward()
                flat = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
                torch.distributed.all_reduce(flat)  # data parallel: average the gradients (what DDP does)
                grad_bytes += flat.numel() * flat.element_size()
                flat /= world
                off = 0
                for p in model.parameters():
                    p.grad.copy_(flat[off : off + p.numel()].view_as(p))
                    off += p.numel()
                opt.step()
                steps += 1
            te = time.perf_counter()
            model.eval()
            ok = torch.zeros(2)
            with torch.no_grad():
                for inp, seeds, blocks in vloader:
                    pred = run(blocks, g.ndata["feat"][inp]).argmax(1)
                    ok += torch.tensor([float((pred == g.ndata["label"][seeds]).sum()), float(seeds.numel())])
            # every trainer holds the same global accuracy: they stop together
            torch.distributed.all_reduce(ok)
            t = time.perf_counter()
            hist.append({"epoch": ep, "t": t - t0, "val_acc": float(ok[0] / ok[1]), "eval_s": t - te})
            print(
                f"distdgl {tag} epoch {ep} t {hist[-1]['t']:.1f} s val {hist[-1]['val_acc']:.4f}", flush=True
            )
            if rank == 0:
                _progress(a.progress, {"config": tag, **hist[-1]})
            if a.stop_at and hist[-1]["val_acc"] >= a.stop_at:
                break
        return {
            "layers": layers,
            "fanout": fan,
            "history": hist,
            "wire_tx_bytes": _sum_ranks(_ns_tx_bytes(a.ifname) - tx0),
            "rank0_steps": steps,
            "rank0_input_rows": rows,
            "rank0_remote_feature_rows": remote,
            "rank0_remote_feature_bytes": remote * a.feat_dim * 4,
            "rank0_grad_allreduce_bytes": grad_bytes,
        }

    if a.warmup_epochs:  # untimed: the first config's lazy start-up costs are not charged to it
        layers, fan = configs[0]
        out["warmup"] = train_config(layers, fan, a.warmup_epochs, "warmup")["history"]
    for layers, fan in configs:
        out["configs"].append(train_config(layers, fan, a.epochs, _tag(layers, fan)))
    if rank == 0:
        out["bytes_note"] = (
            "rank 0 only; feature rows owned by another partition (training, not evaluation) and the gradient "
            "all-reduce input; sampling RPCs not counted"
        )
        out["rank0_max_rss_mb"] = _max_rss_mb()
        with open(a.result, "w") as f:
            json.dump(out, f)


def _tag(layers: int, fan: list[int] | None) -> str:
    return f"L{layers}" + ("" if fan is None else "_f" + "-".join(map(str, fan)))


def _progress(path: str | None, rec: dict) -> None:
    """One JSON line per epoch, so a run stopped early still leaves what it measured."""
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(rec) + "\n")


def _ns_tx_bytes(ifname: str) -> int:
    """Bytes sent so far on this network namespace's interface (every process in it: server and trainer)."""
    with open(f"/sys/class/net/{ifname}/statistics/tx_bytes") as f:
        return int(f.read())


def _sum_ranks(v: int) -> int:
    """The sum over the ranks (one per namespace) of ``v``; the all-reduce's own few bytes are not in it."""
    import torch

    t = torch.tensor([v], dtype=torch.float64)
    torch.distributed.all_reduce(t)
    return int(t.item())


def _sum_kinds(mine: dict[str, int]) -> dict[str, int]:
    """Bytes per kind summed over the ranks (each rank records only what it sent itself)."""
    import torch

    every: list = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(every, mine)
    kinds = sorted({k for d in every for k in d})
    return {k: sum(d.get(k, 0) for d in every) for k in kinds}


def _max_rss_mb() -> float:
    """This process's own peak resident memory (VmHWM: reset at exec, unlike ru_maxrss, which Linux keeps across
    exec, so a rank started by a large parent would report the parent's peak)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024.0
    raise RuntimeError("no VmHWM in /proc/self/status")


def _g3_rank(rank: int, world: int, a: dict) -> dict:
    """Each layer count of the sweep in turn (G3 samples nothing: the fanout does not apply to it)."""
    import torch

    from dgl_plugin.fullgraph import FullGraphConfig, FullGraphRuntime, load_local_partition
    from dgl_plugin.models import build_model
    from flowlane import comm

    rec = comm.get_recorder()

    def train_layers(layers: int, epochs: int, tag: str) -> dict:
        t_setup = time.perf_counter()
        lp = load_local_partition(a["part_config"], rank, world)
        model = build_model("sage", a["feat_dim"], a["hidden"], a["classes"], layers, seed=a["seed"])
        rec.clear()
        rt = FullGraphRuntime(
            lp, model, FullGraphConfig(device="cpu", cache_halo_inputs=a["g3_cache_halo_inputs"])
        )
        opt = torch.optim.Adam(model.parameters(), lr=a["lr"])
        tx0 = _ns_tx_bytes(a["ifname"])
        hist, t0 = [], time.perf_counter()
        for ep in range(epochs):
            rt.train_step(opt)
            te = time.perf_counter()
            acc = rt.evaluate("val_mask")
            t = time.perf_counter()
            hist.append({"epoch": ep, "t": t - t0, "val_acc": acc, "eval_s": t - te})
            if rank == 0:
                print(
                    f"g3 {tag} epoch {ep} t {hist[-1]['t']:.1f} s val {hist[-1]['val_acc']:.4f}",
                    file=sys.stderr,
                )
                _progress(a["progress"], {"config": tag, **hist[-1]})
            if a["stop_at"] and hist[-1]["val_acc"] >= a["stop_at"]:  # a global accuracy: all ranks stop
                break
        wire = _sum_ranks(_ns_tx_bytes(a["ifname"]) - tx0)
        rt.close()  # its exchange group, before the next depth builds its own
        return {
            "layers": layers,
            "history": hist,
            "bytes_by_kind": rec.bytes_by_kind(),  # this rank's (rank 0's in the result)
            "bytes_by_kind_all_ranks": _sum_kinds(rec.bytes_by_kind()),
            "wire_tx_bytes": wire,
            "setup_s": t0 - t_setup,  # load_local_partition + FullGraphRuntime (plan, bins): not in the times
        }

    t_ready = time.time()
    layer_list = [int(x) for x in a["layer_list"].split(",")]
    out: dict = {"t_ready_unix": t_ready, "configs": []}
    if a["warmup_epochs"]:  # untimed, as for DistDGL
        out["warmup"] = train_layers(layer_list[0], a["warmup_epochs"], "warmup")["history"]
    for layers in layer_list:
        out["configs"].append(train_layers(layers, a["epochs"], _tag(layers, None)))
    out["rank0_max_rss_mb"] = _max_rss_mb()
    return out


def _g3_main(a: argparse.Namespace) -> None:
    """One G3 rank inside its namespace: gloo over the shaped link; rank 0 prints its result as JSON."""
    import datetime

    import torch

    torch.set_num_threads(1)
    t_pg = time.time()
    torch.distributed.init_process_group(
        "gloo",
        init_method=f"tcp://{a.master}:{a.port}",
        rank=a.rank,
        world_size=a.parts,
        timeout=datetime.timedelta(seconds=1200),
    )
    res = _g3_rank(a.rank, a.parts, dict(vars(a), epochs=a.g3_epochs))
    res["t_process_group_unix"] = t_pg
    torch.distributed.barrier()
    if a.rank == 0:
        print("G3RESULT " + json.dumps(res))


def _tx_bytes(net, r: int) -> int:
    out = net.run(
        r, ["cat", f"/sys/class/net/{net.ifname}/statistics/tx_bytes"], capture_output=True, text=True
    )
    return int(out.stdout.strip())


def _wire(net, before: list[int]) -> list[int]:
    return [_tx_bytes(net, r) - before[r] for r in range(net.num_ranks)]


def _read_progress(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(x) for x in f if x.strip()]


class _TreeRss:
    """Peak summed resident memory of this process's descendants (the emulated machines' processes), sampled every
    second from /proc on a thread: the benchmark's memory figure for each phase."""

    def __init__(self) -> None:
        import threading

        self.peak_mb = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> _TreeRss:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _loop(self) -> None:
        while not self._stop.wait(1.0):
            self.peak_mb = max(self.peak_mb, self.sample_mb())

    @staticmethod
    def sample_mb() -> float:
        parent, rss = {}, {}
        for d in os.listdir("/proc"):
            if not d.isdigit():
                continue
            try:
                with open(f"/proc/{d}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                parent[int(d)], rss[int(d)] = int(fields[1]), int(fields[21]) * os.sysconf("SC_PAGE_SIZE")
            except (OSError, IndexError, ValueError):
                continue
        me, total = os.getpid(), 0
        for pid in rss:
            p, seen = pid, 0
            while p > 1 and seen < 64:
                p, seen = parent.get(p, 0), seen + 1
                if p == me:
                    total += rss[pid]
                    break
        return total / 2**20


def _distdgl(net, a, part_config: str, graph_name: str, workdir: str, seed: int, configs: list) -> dict:
    """One DistDGL session (servers + trainers) running every config; a failure or timeout returns what the
    trainers' progress file recorded, with the reason, instead of raising."""
    ip_config = os.path.join(workdir, "ip_config.txt")
    with open(ip_config, "w") as f:
        f.writelines(f"{net.ips[i]} {30050 + i}\n" for i in range(a.parts))
    result, progress = os.path.join(workdir, "distdgl.json"), os.path.join(workdir, "distdgl_progress.jsonl")
    common = dict(
        PYTHONPATH=REPO,
        OMP_NUM_THREADS="1",
        DGL_IP_CONFIG=ip_config,
        DGL_NUM_SERVER="1",
        DGL_NUM_CLIENT=str(a.parts),
        DGL_CONF_PATH=part_config,
        DGL_NUM_SAMPLER="0",
        DGL_DIST_MODE="distributed",
        GLOO_SOCKET_IFNAME=net.ifname,
    )
    trainer_args = [
        f"--ip-config={ip_config}",
        f"--part-config={part_config}",
        f"--graph-name={graph_name}",
        f"--epochs={a.dd_epochs}",
        f"--configs={json.dumps(configs)}",
        f"--batch={a.batch}",
        f"--hidden={a.hidden}",
        f"--lr={a.lr}",
        f"--seed={seed}",
        f"--feat-dim={a.feat_dim}",
        f"--classes={a.classes}",
        f"--result={result}",
        f"--progress={progress}",
        f"--ifname={net.ifname}",
        f"--warmup-epochs={a.warmup_epochs}",
        f"--stop-at={a.stop_at}",
    ]

    def env_str(d: dict) -> str:
        return " ".join(f"{k}={shlex.quote(v)}" for k, v in d.items())

    procs, logs = [], []
    before = [_tx_bytes(net, r) for r in range(a.parts)]
    t, t_unix = time.perf_counter(), time.time()
    for i in range(a.parts):
        server = (
            f"env {env_str(dict(common, DGL_ROLE='server', DGL_SERVER_ID=str(i)))} {shlex.quote(sys.executable)}"
            f" -c {shlex.quote(f'import dgl; dgl.distributed.initialize({ip_config!r})')}"
            f" > {shlex.quote(os.path.join(workdir, f'server{i}.log'))} 2>&1"
        )
        tenv = dict(common, DGL_ROLE="client", RANK=str(i), WORLD_SIZE=str(a.parts))
        tenv |= dict(MASTER_ADDR=net.ips[0], MASTER_PORT="30099")
        trainer = (
            f"env {env_str(tenv)} {shlex.quote(sys.executable)} {shlex.quote(os.path.abspath(__file__))}"
            f" --role=trainer {' '.join(shlex.quote(x) for x in trainer_args)}"
        )
        # a private /dev/shm per machine (server and trainer share it); the server stops when the trainers exit
        script = f"mount -t tmpfs tmpfs /dev/shm || exit 9; {server} & {trainer}; rc=$?; wait; exit $rc"
        log = open(os.path.join(workdir, f"machine{i}.log"), "w")  # noqa: SIM115 - closed below
        logs.append(log)
        procs.append(
            net.popen(
                i,
                ["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=REPO,
                start_new_session=True,  # its own process group: a stop ends the server and trainer with it
            )
        )
    status = "ok"
    with _TreeRss() as mem:
        try:
            deadline = time.monotonic() + a.timeout
            rcs = [p.wait(timeout=max(1.0, deadline - time.monotonic())) for p in procs]
            if any(rcs):
                status = f"failed: exit codes {rcs}"
        except subprocess.TimeoutExpired:
            status = f"timed out after {a.timeout:g} s (--timeout)"
        except SystemExit as e:  # SIGTERM (a deadline): keep what the progress file recorded
            status = f"stopped: {e}"
        finally:
            for p in procs:
                # the machine's sh, server and trainer: none is left behind
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait()
            for log in logs:
                log.close()
    wall = time.perf_counter() - t
    out = {"status": status, "wall_incl_startup_s": wall, "peak_rss_mb_all_machines": mem.peak_mb}
    out["wire_tx_bytes_per_machine"] = _wire(net, before)
    if status == "ok":
        with open(result) as f:
            out |= json.load(f)
        out["startup_s"] = out["t_graph_ready_unix"] - t_unix  # launch to DistGraph ready on rank 0
    else:
        out["progress"] = _read_progress(progress)
        with open(os.path.join(workdir, "machine0.log")) as f:
            out["log_tail"] = f.read()[-2000:]
    return out


def _g3(net, a, part_config: str, seed: int, layer_list: list[int], workdir: str) -> dict:
    progress = os.path.join(workdir, "g3_progress.jsonl")
    argv = [
        sys.executable,
        os.path.abspath(__file__),
        "--role=g3",
        f"--part-config={part_config}",
        f"--master={net.ips[0]}",
        "--port=30199",
        f"--parts={a.parts}",
        f"--g3-epochs={a.g3_epochs}",
        f"--layer-list={','.join(map(str, layer_list))}",
        f"--hidden={a.hidden}",
        f"--lr={a.lr}",
        f"--seed={seed}",
        f"--feat-dim={a.feat_dim}",
        f"--classes={a.classes}",
        f"--progress={progress}",
        f"--ifname={net.ifname}",
        f"--warmup-epochs={a.warmup_epochs}",
        f"--stop-at={a.stop_at}",
        *(["--g3-cache-halo-inputs"] if a.g3_cache_halo_inputs else []),
    ]
    before = [_tx_bytes(net, r) for r in range(a.parts)]
    t, t_unix = time.perf_counter(), time.time()
    status, res = "ok", {}
    with _TreeRss() as mem:
        try:
            outs = net.run_ranks(
                [[*argv, f"--rank={r}"] for r in range(a.parts)],
                timeout_s=a.timeout,
                env=dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1"),
                cwd=REPO,
            )
            line = next(x for x in outs[0].splitlines() if x.startswith("G3RESULT "))
            res = json.loads(line[len("G3RESULT ") :])
        except RuntimeError as e:  # a rank failed or ran past --timeout (flowlane.testing.netem.run_ranks)
            status = f"failed: {str(e)[:3000]}"
        except SystemExit as e:  # SIGTERM (a deadline): keep what the progress file recorded
            status = f"stopped: {e}"
    out = {
        "status": status,
        "wall_incl_startup_s": time.perf_counter() - t,
        "peak_rss_mb_all_machines": mem.peak_mb,
    }
    out["wire_tx_bytes_per_machine"] = _wire(net, before)
    out |= res
    if status == "ok":
        # launch to the process group up (imports, rendezvous)
        out["startup_s"] = out["t_ready_unix"] - t_unix
    else:
        out["progress"] = _read_progress(progress)
    return out


def sweep_configs(layers: str, fanouts: str, fanout: str) -> list[tuple[int, list[int]]]:
    """The (layers, per-layer fanout) configs a run sweeps, from the CLI strings; raises ValueError naming the bad
    value. ``fanouts`` empty: the one explicit ``fanout`` list (e.g. "25,10"), whose length must match ``layers``
    (empty: its length); else every layer count in ``layers`` with every uniform fanout in ``fanouts``
    (e.g. layers "2,3,4", fanouts "5,10,25": 9 configs, [5, 5] ... [25, 25, 25, 25])."""

    def ints(text: str, what: str, lo: int, hi: int) -> list[int]:
        try:
            vals = [int(x) for x in text.split(",")]
        except ValueError:
            raise ValueError(f"{what}={text!r}: expected comma-separated integers") from None
        bad = [v for v in vals if not lo <= v <= hi]
        if bad:
            raise ValueError(f"{what}={text!r}: every value must be in [{lo}, {hi}], got {bad}")
        if len(set(vals)) != len(vals):
            raise ValueError(f"{what}={text!r}: repeated values")
        return vals

    if fanouts:
        ls = ints(layers or "2", "--layers", 1, 6)
        return [(n, [f] * n) for n in ls for f in ints(fanouts, "--fanouts", 1, 1000)]
    try:
        fan = [int(x) for x in fanout.split(",")]
    except ValueError:
        raise ValueError(f"--fanout={fanout!r}: expected comma-separated integers, one per layer") from None
    if any(f < 1 and f != -1 for f in fan):
        raise ValueError(f"--fanout={fanout!r}: each value must be >= 1 (or -1: all neighbours)")
    ls = ints(layers, "--layers", 1, 6) if layers else [len(fan)]
    if ls != [len(fan)]:
        raise ValueError(
            f"--fanout={fanout!r} has {len(fan)} layers but --layers={layers!r}; "
            "give one matching layer count, or sweep with --fanouts"
        )
    return [(len(fan), fan)]


def _loadavg() -> list[float]:
    return list(os.getloadavg())


def _summarise(runs: list[dict], configs: list) -> list[dict]:
    """Per config: the per-seed times to the target and the speed-up (DistDGL time / G3 time; > 1: G3 faster)."""
    rows = []
    for layers, fan in configs:
        tag = _tag(layers, fan)
        per = [r["configs"][tag] for r in runs if tag in r.get("configs", {})]
        sp = [p["speedup_g3_vs_distdgl"] for p in per if p.get("speedup_g3_vs_distdgl")]
        # only DistDGL reached the target: G3's speed-up is below DistDGL's time / G3's whole training time
        below = [
            p["tta_distdgl_s"] / p["g3"]["history"][-1]["t"]
            for p in per
            if p["tta_distdgl_s"] and p["g3"] and not p["tta_g3_s"]
        ]
        above = [
            p["distdgl"]["history"][-1]["t"] / p["tta_g3_s"]
            for p in per
            if p["tta_g3_s"] and not p["tta_distdgl_s"]
        ]
        rows.append(
            {
                "config": tag,
                "layers": layers,
                "fanout": fan,
                "seeds": [p["seed"] for p in per],
                "tta_g3_s": [p["tta_g3_s"] for p in per],
                "tta_distdgl_s": [p["tta_distdgl_s"] for p in per],
                "speedup_per_seed": sp,
                "speedup_median": statistics.median(sp) if sp else None,
                "speedup_below_where_g3_missed_target": below,
                "speedup_above_where_distdgl_missed_target": above,
            }
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--role", default="main", choices=["main", "trainer", "g3"])
    ap.add_argument("--nodes", type=int, default=50000)
    ap.add_argument("--parts", type=int, default=4)
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--g3-epochs", dest="g3_epochs", type=int, default=60)
    ap.add_argument("--dd-epochs", dest="dd_epochs", type=int, default=40)
    ap.add_argument(
        "--g3-cache-halo-inputs",
        dest="g3_cache_halo_inputs",
        action="store_true",
        help="G3 fetches the halo's input features once (FullGraphConfig.cache_halo_inputs; default: every epoch)",
    )
    ap.add_argument(
        "--target",
        type=float,
        default=0.90,
        help="shared validation accuracy to reach (0: 0.95 x the lower of the two best, see module doc)",
    )
    ap.add_argument(
        "--run-past-target",
        dest="run_past_target",
        action="store_true",
        help="train every epoch (default: each system stops at the first epoch at or above --target)",
    )
    ap.add_argument("--stop-at", dest="stop_at", type=float, default=0.0, help=argparse.SUPPRESS)
    ap.add_argument(
        "--fanout", default="10,10", help="one explicit per-layer fanout (ignored with --fanouts)"
    )
    ap.add_argument("--layers", default="", help="layer counts to sweep, e.g. 2,3,4 (default: len(--fanout))")
    ap.add_argument(
        "--fanouts", default="", help="uniform per-layer fanouts to sweep with every --layers, e.g. 5,10,25"
    )
    ap.add_argument(
        "--warmup-epochs",
        dest="warmup_epochs",
        type=int,
        default=1,
        help="untimed epochs of the first config in each session before the sweep (0: none)",
    )
    ap.add_argument("--batch", type=int, default=1000)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--rate-mbit", dest="rate_mbit", type=float, default=100.0)
    ap.add_argument("--burst-kb", dest="burst_kb", type=float, default=256.0)
    ap.add_argument(
        "--timeout", type=float, default=2400.0, help="seconds per system and seed, start-up included"
    )
    ap.add_argument("--workdir", default="/tmp/g3_distdgl")
    ap.add_argument("--out", default="")
    ap.add_argument("--ip-config", dest="ip_config")
    ap.add_argument("--part-config", dest="part_config")
    ap.add_argument("--graph-name", dest="graph_name")
    ap.add_argument("--result")
    ap.add_argument("--progress")
    ap.add_argument("--ifname")
    ap.add_argument("--configs")
    ap.add_argument("--layer-list", dest="layer_list")
    ap.add_argument("--master")
    ap.add_argument("--port", type=int)
    ap.add_argument("--rank", type=int)
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--feat-dim", dest="feat_dim", type=int, default=32)
    ap.add_argument("--classes", type=int, default=8)
    a = ap.parse_args()
    if a.role == "trainer":
        return _trainer(a)
    if a.role == "g3":
        return _g3_main(a)
    if not 0.0 <= a.target < 1.0:
        ap.error(f"--target={a.target} must be in [0, 1): a validation accuracy (0: relative target)")
    for name in ("nodes", "parts", "g3_epochs", "dd_epochs", "batch", "hidden"):
        if getattr(a, name) < 1:
            ap.error(f"--{name.replace('_', '-')}={getattr(a, name)} must be >= 1")
    if a.warmup_epochs < 0:
        ap.error(f"--warmup-epochs={a.warmup_epochs} must be >= 0")
    if a.rate_mbit <= 0:
        ap.error(f"--rate-mbit={a.rate_mbit} must be > 0")
    try:
        configs = sweep_configs(a.layers, a.fanouts, a.fanout)
    except ValueError as e:
        ap.error(str(e))
    try:
        seeds = [int(x) for x in a.seeds.split(",")]
    except ValueError:
        ap.error(f"--seeds={a.seeds!r}: expected comma-separated integers")
    a.stop_at = 0.0 if (a.run_past_target or not a.target) else a.target
    layer_list = sorted({n for n, _ in configs}, key=[n for n, _ in configs].index)
    import shutil

    import dgl

    from dgl_plugin.datasets import load_graph
    from flowlane.testing.netem import EmulatedNetwork, check_available
    from flowlane.testing.provenance import write_result

    check_available()

    def on_term(signum: int, frame: object) -> None:  # killed (e.g. at a deadline): write what was measured
        raise SystemExit(f"stopped by signal {signum}")

    signal.signal(signal.SIGTERM, on_term)
    path = a.out or os.path.join(OUT, f"distdgl_shaped_{a.nodes}.json")
    runs, links, load_start, t_start = [], None, _loadavg(), time.time()

    def write(status: str) -> None:
        ratios = [
            c["speedup_g3_vs_distdgl"]
            for r in runs
            for c in r.get("configs", {}).values()
            if c.get("speedup_g3_vs_distdgl")
        ]
        out = {
            "label": "EMULATED links (netem tbf per access link, both ways) on a shared, loaded 2-core CPU VM (other "
            "engineers' jobs ran too: see load_average); DistDGL = real DistGraph servers + trainers "
            "(DistNodeDataLoader), one network namespace per machine; G3 = flowlane FullGraphRuntime on the same "
            "partitions and links",
            "status": status,
            "args": {
                k: v
                for k, v in vars(a).items()
                if k
                not in (
                    "role",
                    "ip_config",
                    "part_config",
                    "result",
                    "master",
                    "port",
                    "rank",
                    "graph_name",
                    "progress",
                    "ifname",
                    "configs",
                    "layer_list",
                    "epochs",
                    "seed",
                )
            },
            "configs": [_tag(n, f) for n, f in configs],
            "links": links,
            "load_average": {"start_1_5_15min": load_start, "end_1_5_15min": _loadavg()},
            "elapsed_s": time.time() - t_start,
            "speedup_g3_vs_distdgl": {
                "all": ratios,
                "median": statistics.median(ratios) if ratios else None,
                "note": "DistDGL time / G3 time to the target, after start-up; > 1 means G3 is faster",
            },
            "per_config": _summarise(runs, configs),
            "runs": runs,
        }
        write_result(path, out)

    status = "ok"
    try:
        for seed in seeds:
            name = f"g3dd{os.getpid()}{uuid.uuid4().hex[:6]}"  # unique per run: no shared-memory collisions
            workdir = os.path.join(a.workdir, name)
            os.makedirs(workdir)
            run: dict = {"seed": seed, "graph_name": name, "load_average_start": _loadavg()}
            runs.append(run)
            try:
                t = time.perf_counter()
                g = load_graph(
                    "synthetic",
                    seed=seed,
                    num_nodes=a.nodes,
                    avg_degree=10,
                    num_classes=a.classes,
                    num_communities=32,
                    feat_dim=a.feat_dim,
                )
                run["graph_gen_s"] = time.perf_counter() - t
                run["num_edges"] = int(g.num_edges())
                write("running")
                t = time.perf_counter()
                dgl.distributed.partition_graph(
                    g,
                    name,
                    a.parts,
                    os.path.join(workdir, "parts"),
                    num_hops=1,
                    part_method="metis",
                    balance_train=True,
                    balance_edges=True,
                )
                run["partition_s"] = time.perf_counter() - t
                # graph generation + METIS, this process
                run["main_max_rss_mb_after_partition"] = _max_rss_mb()
                del g
                write("running")
                part_config = os.path.join(workdir, "parts", f"{name}.json")
                with EmulatedNetwork(a.parts, rate_mbit=a.rate_mbit, burst_kb=a.burst_kb) as net:
                    links = net.describe()
                    dd = _distdgl(net, a, part_config, name, workdir, seed, configs)
                    run["distdgl_session"] = {k: v for k, v in dd.items() if k != "configs"}
                    write("running")
                    if dd["status"].startswith("stopped"):
                        g3 = {"status": "not started (the run was stopped during DistDGL)"}
                    else:
                        g3 = _g3(net, a, part_config, seed, layer_list, workdir)
                    run["g3_session"] = {k: v for k, v in g3.items() if k != "configs"}
            finally:
                shutil.rmtree(workdir, ignore_errors=True)
            run["load_average_end"] = _loadavg()
            g3_by_layers = {c["layers"]: c for c in g3.get("configs", [])}
            run["configs"] = {}
            for c in dd.get("configs", []):
                gc = g3_by_layers.get(c["layers"])
                target = a.target or (
                    0.95
                    * min(max(h["val_acc"] for h in gc["history"]), max(h["val_acc"] for h in c["history"]))
                    if gc
                    else None
                )

                def tta(hist, target=target):
                    return next((h["t"] for h in hist if target and h["val_acc"] >= target), None)

                row = {
                    "seed": seed,
                    "target_val_acc": target,
                    "tta_distdgl_s": tta(c["history"]),
                    "tta_g3_s": tta(gc["history"]) if gc else None,
                    "epochs_run": {"distdgl": len(c["history"]), "g3": len(gc["history"]) if gc else None},
                    "best_val_acc": {
                        "distdgl": max(h["val_acc"] for h in c["history"]),
                        "g3": max(h["val_acc"] for h in gc["history"]) if gc else None,
                    },
                    "wire_tx_bytes": {
                        "distdgl": c["wire_tx_bytes"],
                        "g3": gc["wire_tx_bytes"] if gc else None,
                    },
                    "distdgl": c,
                    "g3": gc,
                }
                if row["tta_g3_s"] and row["tta_distdgl_s"]:
                    row["speedup_g3_vs_distdgl"] = row["tta_distdgl_s"] / row["tta_g3_s"]
                run["configs"][_tag(c["layers"], c["fanout"])] = row
                print(
                    f"seed {seed} {_tag(c['layers'], c['fanout'])}: target {target}: G3 {row['tta_g3_s']} s, "
                    f"DistDGL {row['tta_distdgl_s']} s; speed-up {row.get('speedup_g3_vs_distdgl')}",
                    flush=True,
                )
            if dd["status"] != "ok" or g3["status"] != "ok":
                status = f"seed {seed}: DistDGL {dd['status']}; G3 {g3['status'][:300]}"
                break
            write("running")
    except BaseException as e:
        status = f"stopped: {type(e).__name__}: {e}"
        raise
    finally:
        write(status)
        print(f"wrote {path} ({status})", flush=True)
    if status != "ok":
        raise SystemExit(f"incomplete: {status}")


if __name__ == "__main__":
    main()
