"""G3 full-graph training vs real DistDGL mini-batch training on the same DistDGL partitions, on SHAPED links (issue
34 item 5).

Both read one ``dgl.distributed.partition_graph`` output (METIS, ``parts`` partitions, a graph name unique per run):
- DistDGL: one simulated machine per partition, each in its own network namespace of a
  :class:`flowlane.testing.netem.EmulatedNetwork` (access link shaped with tbf both ways, ``--rate-mbit``, bucket
  ``--burst-kb``): a DistGraph server and a trainer (``DistGraph``, ``DistNodeDataLoader`` + ``NeighborSampler``,
  gradients averaged with a gloo all-reduce every step), the same 2-layer SAGE model; evaluation is sampled with all
  neighbours on the validation nodes and counts in the wall time. Each machine has a private /dev/shm (its own mount
  namespace: DGL names shared memory after the graph, and the tmpfs vanishes with the machine, so nothing is left in
  the host's /dev/shm). Every trainer finds its machine by its namespace's IP, so it reads its own partition locally.
- G3: ``parts`` ranks of :class:`dgl_plugin.fullgraph.FullGraphRuntime`, one per namespace of the same network, each
  loading only its partition; the halo exchange and all-reduces go over the shaped links.
Reported per seed: validation accuracy over wall time, the time each reaches the same target accuracy (``--target``,
default 0.90; 0 means 0.95 x the lower of the two best accuracies; each system stops at the first epoch at or above a
fixed target unless ``--run-past-target``, and is given up to ``--g3-epochs`` / ``--dd-epochs`` to get there), and
the bytes each sent: on the wire (``tx_bytes`` of every namespace's interface, all traffic incl. TCP/IP headers, RPC
and setup) and at the application level. EMULATED links
on a shared 2-core CPU box (both systems share its 2 cores; the figures are about this box, not a cluster). Needs
root (network namespaces).

Run: .venv-gnn/bin/python benchmarks/g3_distdgl.py [--nodes 50000] [--parts 4] [--seeds 0,1,2] [--rate-mbit 100]
     [--target 0.90] [--g3-epochs 60] [--dd-epochs 40]
     -> results/g3/distdgl_shaped_<nodes>.json
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
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
    import dgl
    import torch
    import torch.nn.functional as F

    from dgl_plugin.models import build_model

    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    g = dgl.distributed.DistGraph(a.graph_name, part_config=a.part_config)
    pb = g.get_partition_book()
    train = dgl.distributed.node_split(g.ndata["train_mask"], pb, force_even=True)
    val = dgl.distributed.node_split(g.ndata["val_mask"], pb, force_even=True)
    model = build_model("sage", a.feat_dim, a.hidden, a.classes, 2, seed=a.seed)
    opt = torch.optim.Adam(model.parameters(), lr=a.lr)
    fan = [int(x) for x in a.fanout.split(",")]
    loader = dgl.dataloading.DistNodeDataLoader(
        g, train, dgl.dataloading.NeighborSampler(fan), batch_size=a.batch, shuffle=True, drop_last=False
    )
    vloader = dgl.dataloading.DistNodeDataLoader(
        g, val, dgl.dataloading.NeighborSampler([-1, -1]), batch_size=a.batch, shuffle=False, drop_last=False
    )

    def run(blocks, x):
        h = x
        for k, blk in enumerate(blocks):
            h = model.forward_layer(k, blk, h, h[: blk.num_dst_nodes()])
        return h

    hist, t0, rows, remote, grad_bytes = [], time.perf_counter(), 0, 0, 0
    for ep in range(a.epochs):
        model.train()
        for inp, seeds, blocks in loader:
            rows += int(inp.numel())
            remote += int((pb.nid2partid(inp) != pb.partid).sum())  # feature rows pulled from another machine
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
        model.eval()
        ok = torch.zeros(2)
        with torch.no_grad():
            for inp, seeds, blocks in vloader:
                pred = run(blocks, g.ndata["feat"][inp]).argmax(1)
                ok += torch.tensor([float((pred == g.ndata["label"][seeds]).sum()), float(seeds.numel())])
        torch.distributed.all_reduce(ok)  # every trainer holds the same global accuracy: they stop together
        hist.append({"epoch": ep, "t": time.perf_counter() - t0, "val_acc": float(ok[0] / ok[1])})
        print(f"distdgl epoch {ep} t {hist[-1]['t']:.1f} s val {hist[-1]['val_acc']:.4f}", flush=True)
        if a.stop_at and hist[-1]["val_acc"] >= a.stop_at:
            break
    if rank == 0:
        with open(a.result, "w") as f:
            json.dump(
                {
                    "history": hist,
                    "world": world,
                    "rank0_input_rows": rows,
                    "rank0_remote_feature_rows": remote,
                    "rank0_remote_feature_bytes": remote * a.feat_dim * 4,
                    "rank0_grad_allreduce_bytes": grad_bytes,
                    "bytes_note": "rank 0 only; feature rows owned by another partition (training, not "
                    "evaluation) and the gradient all-reduce input; sampling RPCs not counted",
                },
                f,
            )


def _g3_rank(rank: int, world: int, a: dict) -> dict:
    import torch

    from dgl_plugin.fullgraph import FullGraphConfig, FullGraphRuntime, load_local_partition
    from dgl_plugin.models import build_model
    from flowlane import comm

    lp = load_local_partition(a["part_config"], rank, world)
    model = build_model("sage", a["feat_dim"], a["hidden"], a["classes"], 2, seed=a["seed"])
    rec = comm.get_recorder()
    rec.clear()
    rt = FullGraphRuntime(lp, model, FullGraphConfig(device="cpu"))
    opt = torch.optim.Adam(model.parameters(), lr=a["lr"])
    hist, t0 = [], time.perf_counter()
    for ep in range(a["epochs"]):
        rt.train_step(opt)
        hist.append({"epoch": ep, "t": time.perf_counter() - t0, "val_acc": rt.evaluate("val_mask")})
        if rank == 0:
            print(
                f"g3 epoch {ep} t {hist[-1]['t']:.1f} s val {hist[-1]['val_acc']:.4f}",
                file=sys.stderr,
                flush=True,
            )
        if a["stop_at"] and hist[-1]["val_acc"] >= a["stop_at"]:  # a global accuracy: every rank stops here
            break
    return {"history": hist, "bytes_by_kind": rec.bytes_by_kind()}


def _g3_main(a: argparse.Namespace) -> None:
    """One G3 rank inside its namespace: gloo over the shaped link; rank 0 prints its result as JSON."""
    import datetime

    import torch

    torch.set_num_threads(1)
    torch.distributed.init_process_group(
        "gloo",
        init_method=f"tcp://{a.master}:{a.port}",
        rank=a.rank,
        world_size=a.parts,
        timeout=datetime.timedelta(seconds=1200),
    )
    res = _g3_rank(a.rank, a.parts, dict(vars(a), epochs=a.g3_epochs))
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


def _distdgl(
    net, a, part_config: str, graph_name: str, workdir: str, seed: int
) -> tuple[dict, list[int], float]:
    ip_config = os.path.join(workdir, "ip_config.txt")
    with open(ip_config, "w") as f:
        f.writelines(f"{net.ips[i]} {30050 + i}\n" for i in range(a.parts))
    result = os.path.join(workdir, "distdgl.json")
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
        f"--fanout={a.fanout}",
        f"--batch={a.batch}",
        f"--hidden={a.hidden}",
        f"--lr={a.lr}",
        f"--seed={seed}",
        f"--feat-dim={a.feat_dim}",
        f"--classes={a.classes}",
        f"--result={result}",
        f"--stop-at={a.stop_at}",
    ]

    def env_str(d: dict) -> str:
        return " ".join(f"{k}={shlex.quote(v)}" for k, v in d.items())

    procs, logs = [], []
    before = [_tx_bytes(net, r) for r in range(a.parts)]
    t = time.perf_counter()
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
            )
        )
    try:
        rcs = [p.wait(timeout=a.timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for log in logs:
            log.close()
    wall = time.perf_counter() - t
    if any(rcs):
        raise SystemExit(f"DistDGL machines failed: exit codes {rcs}; logs in {workdir}")
    with open(result) as f:
        return json.load(f), _wire(net, before), wall


def _g3(net, a, part_config: str, seed: int) -> tuple[dict, list[int], float]:
    argv = [
        sys.executable,
        os.path.abspath(__file__),
        "--role=g3",
        f"--part-config={part_config}",
        f"--master={net.ips[0]}",
        "--port=30199",
        f"--parts={a.parts}",
        f"--g3-epochs={a.g3_epochs}",
        f"--hidden={a.hidden}",
        f"--lr={a.lr}",
        f"--seed={seed}",
        f"--feat-dim={a.feat_dim}",
        f"--classes={a.classes}",
        f"--stop-at={a.stop_at}",
    ]
    before = [_tx_bytes(net, r) for r in range(a.parts)]
    t = time.perf_counter()
    outs = net.run_ranks(
        [[*argv, f"--rank={r}"] for r in range(a.parts)],
        timeout_s=a.timeout,
        env=dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1"),
        cwd=REPO,
    )
    wall = time.perf_counter() - t
    line = next(x for x in outs[0].splitlines() if x.startswith("G3RESULT "))
    return json.loads(line[len("G3RESULT ") :]), _wire(net, before), wall


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--role", default="main", choices=["main", "trainer", "g3"])
    ap.add_argument("--nodes", type=int, default=50000)
    ap.add_argument("--parts", type=int, default=4)
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--g3-epochs", dest="g3_epochs", type=int, default=60)
    ap.add_argument("--dd-epochs", dest="dd_epochs", type=int, default=40)
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
    ap.add_argument("--fanout", default="10,10")
    ap.add_argument("--batch", type=int, default=1000)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--rate-mbit", dest="rate_mbit", type=float, default=100.0)
    ap.add_argument("--burst-kb", dest="burst_kb", type=float, default=256.0)
    ap.add_argument("--timeout", type=float, default=2400.0)
    ap.add_argument("--workdir", default="/tmp/g3_distdgl")
    ap.add_argument("--out", default="")
    ap.add_argument("--ip-config", dest="ip_config")
    ap.add_argument("--part-config", dest="part_config")
    ap.add_argument("--graph-name", dest="graph_name")
    ap.add_argument("--result")
    ap.add_argument("--master")
    ap.add_argument("--port", type=int)
    ap.add_argument("--rank", type=int)
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--feat-dim", dest="feat_dim", type=int, default=32)
    ap.add_argument("--classes", type=int, default=8)
    a = ap.parse_args()
    if a.role == "main":
        if not 0.0 <= a.target < 1.0:
            ap.error(f"--target={a.target} must be in [0, 1): a validation accuracy (0: relative target)")
        a.stop_at = 0.0 if (a.run_past_target or not a.target) else a.target
    if a.role == "trainer":
        return _trainer(a)
    if a.role == "g3":
        return _g3_main(a)
    import shutil

    import dgl

    from dgl_plugin.datasets import load_graph
    from flowlane.testing.netem import EmulatedNetwork, check_available
    from flowlane.testing.provenance import write_result

    check_available()
    runs = []
    for seed in [int(x) for x in a.seeds.split(",")]:
        name = f"g3dd{os.getpid()}{uuid.uuid4().hex[:6]}"  # unique per run: no shared-memory collisions
        workdir = os.path.join(a.workdir, name)
        os.makedirs(workdir)
        try:
            g = load_graph(
                "synthetic",
                seed=seed,
                num_nodes=a.nodes,
                avg_degree=10,
                num_classes=a.classes,
                num_communities=32,
                feat_dim=a.feat_dim,
            )
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
            part_s = time.perf_counter() - t
            del g
            part_config = os.path.join(workdir, "parts", f"{name}.json")
            with EmulatedNetwork(a.parts, rate_mbit=a.rate_mbit, burst_kb=a.burst_kb) as net:
                links = net.describe()
                dd, dd_wire, dd_wall = _distdgl(net, a, part_config, name, workdir, seed)
                g3, g3_wire, g3_wall = _g3(net, a, part_config, seed)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
        best_g3 = max(h["val_acc"] for h in g3["history"])
        best_dd = max(h["val_acc"] for h in dd["history"])
        target = a.target or 0.95 * min(best_g3, best_dd)

        def tta(hist, target=target):
            return next((h["t"] for h in hist if h["val_acc"] >= target), None)

        run = {
            "seed": seed,
            "graph_name": name,
            "partition_s": part_s,
            "target_val_acc": target,
            "tta_g3_s": tta(g3["history"]),
            "tta_distdgl_s": tta(dd["history"]),
            "best_val_acc": {"g3": best_g3, "distdgl": best_dd},
            "epochs_run": {"g3": len(g3["history"]), "distdgl": len(dd["history"])},
            "stopped_at_target": bool(a.stop_at),
            "wire_tx_bytes": {"g3": sum(g3_wire), "distdgl": sum(dd_wire)},
            "wire_tx_bytes_per_machine": {"g3": g3_wire, "distdgl": dd_wire},
            "wall_incl_startup_s": {"g3": g3_wall, "distdgl": dd_wall},
            "g3": g3,
            "distdgl": dd,
        }
        if run["tta_g3_s"] and run["tta_distdgl_s"]:
            run["speedup_g3_vs_distdgl"] = run["tta_distdgl_s"] / run["tta_g3_s"]
        runs.append(run)
        print(
            f"seed {seed}: target {target:.3f}: G3 {run['tta_g3_s']} s, DistDGL {run['tta_distdgl_s']} s; wire "
            f"bytes G3 {sum(g3_wire) / 1e6:.1f} MB, DistDGL {sum(dd_wire) / 1e6:.1f} MB",
            flush=True,
        )
    ratios = [r["speedup_g3_vs_distdgl"] for r in runs if "speedup_g3_vs_distdgl" in r]
    out = {
        "label": "EMULATED links (netem tbf per access link, both ways) on a shared 2-core CPU VM; DistDGL = real "
        "DistGraph servers + trainers (DistNodeDataLoader), one network namespace per machine; G3 = flowlane "
        "FullGraphRuntime on the same partitions and links",
        "args": {
            k: v
            for k, v in vars(a).items()
            if k not in ("role", "ip_config", "part_config", "result", "master", "port", "rank", "graph_name")
        },
        "links": links,
        "speedup_g3_vs_distdgl": {
            "per_seed": ratios,
            "median": sorted(ratios)[len(ratios) // 2] if ratios else None,
        },
        "runs": runs,
    }
    path = write_result(a.out or os.path.join(OUT, f"distdgl_shaped_{a.nodes}.json"), out)
    print(f"speedup (DistDGL time / G3 time to the target) per seed {ratios}; wrote {path}")


if __name__ == "__main__":
    main()
