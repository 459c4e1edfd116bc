"""G3 full-graph training vs real DistDGL mini-batch training on the same DistDGL partitions (issue 34 item 5, small).

Both read one ``dgl.distributed.partition_graph`` output (METIS, ``parts`` partitions):
- DistDGL: ``parts`` DistGraph servers (one per simulated machine, ``127.0.0.1`` with its own port) and ``parts``
  trainer processes (``DistGraph``, ``DistNodeDataLoader`` + ``NeighborSampler``, gradients averaged with a gloo
  all-reduce every step), the same 2-layer
  SAGE model; evaluation is sampled with all neighbours on the validation nodes and is included in the wall time.
- G3: ``parts`` ranks of :class:`dgl_plugin.fullgraph.FullGraphRuntime`, each loading only its partition.
Reported: per-epoch wall time (evaluation included) and validation accuracy, and the time each reaches the target
accuracy (``--target``). Measured on this machine's loopback, NOT shaped (no flowlane.testing.netem links): the
figures say nothing about slow links. On one host every DistDGL trainer resolves to machine 0 (DGL picks the
machine by local IP), so trainers read partition 0 through shared memory and the others over RPC; DGL names a
partition's shared memory after the graph only, so the servers of machines 1.. run with a private /dev/shm
(``unshare --mount``, needs root).

Run: .venv-gnn/bin/python benchmarks/g3_distdgl.py [--nodes 5000] [--parts 2] [--epochs 10] -> results/g3/distdgl.json
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(1, os.path.dirname(os.path.abspath(__file__)))

OUT = "results/g3"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _trainer(a: argparse.Namespace) -> None:
    import dgl
    import torch
    import torch.nn.functional as F

    from dgl_plugin.models import build_model

    dgl.distributed.initialize(a.ip_config)
    torch.distributed.init_process_group("gloo")
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    g = dgl.distributed.DistGraph("syn", part_config=a.part_config)
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
        torch.distributed.all_reduce(ok)
        hist.append({"epoch": ep, "t": time.perf_counter() - t0, "val_acc": float(ok[0] / ok[1])})
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
    dgl.distributed.exit_client()


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
    return {"history": hist, "bytes_by_kind": rec.bytes_by_kind()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--role", default="main", choices=["main", "trainer"])
    ap.add_argument("--nodes", type=int, default=5000)
    ap.add_argument("--parts", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument(
        "--target", type=float, default=0.0, help="validation accuracy to reach (0: 0.95 x G3's best)"
    )
    ap.add_argument("--fanout", default="10,10")
    ap.add_argument("--batch", type=int, default=1000)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workdir", default="/tmp/g3_distdgl")
    ap.add_argument("--ip-config", dest="ip_config")
    ap.add_argument("--part-config", dest="part_config")
    ap.add_argument("--result")
    ap.add_argument("--feat-dim", dest="feat_dim", type=int, default=32)
    ap.add_argument("--classes", type=int, default=8)
    a = ap.parse_args()
    if a.role == "trainer":
        return _trainer(a)
    import dgl

    from dgl_plugin.datasets import load_graph
    from flowlane.launch import launch

    os.makedirs(a.workdir, exist_ok=True)
    g = load_graph(
        "synthetic",
        seed=a.seed,
        num_nodes=a.nodes,
        avg_degree=10,
        num_classes=a.classes,
        num_communities=32,
        feat_dim=a.feat_dim,
    )
    dgl.distributed.partition_graph(
        g,
        "syn",
        a.parts,
        os.path.join(a.workdir, "parts"),
        num_hops=1,
        part_method="metis",
        balance_train=True,
        balance_edges=True,
    )
    part_config = os.path.join(a.workdir, "parts", "syn.json")
    ip_config = os.path.join(a.workdir, "ip_config.txt")
    with open(ip_config, "w") as f:
        f.writelines(f"127.0.0.1 {_free_port()}\n" for _ in range(a.parts))
    common = [
        f"--ip-config={ip_config}",
        f"--part-config={part_config}",
        f"--epochs={a.epochs}",
        f"--fanout={a.fanout}",
        f"--batch={a.batch}",
        f"--hidden={a.hidden}",
        f"--lr={a.lr}",
        f"--seed={a.seed}",
        f"--feat-dim={a.feat_dim}",
        f"--classes={a.classes}",
    ]
    base = dict(
        os.environ,
        DGL_IP_CONFIG=ip_config,
        DGL_NUM_SERVER="1",
        DGL_NUM_CLIENT=str(a.parts),
        DGL_CONF_PATH=part_config,
        DGL_NUM_SAMPLER="0",
        OMP_NUM_THREADS="1",
    )
    # DistDGL: servers first, then trainers
    logs = [open(os.path.join(a.workdir, f"server{i}.log"), "w") for i in range(a.parts)]  # noqa: SIM115 - held by the servers

    # DGL names a partition's shared memory after the graph only: servers of different partitions on one host would
    # collide, so every server but machine 0's gets a private /dev/shm (its own mount namespace)
    def server_cmd(i):
        py = [sys.executable, "-c", f"import dgl; dgl.distributed.initialize({ip_config!r})"]
        if i == 0:
            return py
        return [
            "unshare",
            "--mount",
            "--propagation",
            "private",
            "sh",
            "-c",
            'mount -t tmpfs tmpfs /dev/shm && exec "$@"',
            "sh",
            *py,
        ]

    servers = [
        subprocess.Popen(
            server_cmd(i),
            env=dict(base, DGL_ROLE="server", DGL_SERVER_ID=str(i), DGL_DIST_MODE="distributed"),
            stdout=logs[i],
            stderr=subprocess.STDOUT,
        )
        for i in range(a.parts)
    ]
    result = os.path.join(a.workdir, "distdgl.json")
    port = _free_port()
    t = time.perf_counter()
    trainers = [
        subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--role=trainer", f"--result={result}", *common],
            env=dict(
                base,
                DGL_ROLE="client",
                DGL_DIST_MODE="distributed",
                RANK=str(r),
                WORLD_SIZE=str(a.parts),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
            ),
        )
        for r in range(a.parts)
    ]
    rcs = [p.wait(timeout=3000) for p in trainers]
    dist_wall = time.perf_counter() - t
    for p in servers:
        try:
            p.wait(timeout=60)
        except subprocess.TimeoutExpired:
            p.kill()
    if any(rcs):
        raise SystemExit(f"DistDGL trainers failed: exit codes {rcs}")
    with open(result) as f:
        dd = json.load(f)
    g3 = launch(_g3_rank, a.parts, args=(dict(vars(a), part_config=part_config),), timeout=3000)[0]
    best = max(h["val_acc"] for h in g3["history"])
    target = a.target or 0.95 * best

    def tta(hist):
        return next((h["t"] for h in hist if h["val_acc"] >= target), None)

    out = {
        "label": "measured on a shared 2-core CPU VM, localhost loopback NOT shaped; DistDGL = real DistGraph "
        "servers + trainers (DistNodeDataLoader); G3 = flowlane FullGraphRuntime on the same partitions",
        "args": {k: v for k, v in vars(a).items() if k not in ("role", "ip_config", "part_config", "result")},
        "target_val_acc": target,
        "tta_g3_s": tta(g3["history"]),
        "tta_distdgl_s": tta(dd["history"]),
        "distdgl": dd,
        "distdgl_wall_incl_startup_s": dist_wall,
        "g3": g3,
    }
    from g3_bench import provenance  # benchmarks/ is on sys.path when this file runs as a script

    out["provenance"] = provenance()
    out["provenance"]["command"] = "python benchmarks/g3_distdgl.py " + " ".join(sys.argv[1:])
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, "distdgl.json"), "w") as f:
        json.dump(out, f, indent=1)
    print(
        f"target {target:.3f}: G3 {out['tta_g3_s']} s, DistDGL {out['tta_distdgl_s']} s; "
        f"final val G3 {g3['history'][-1]['val_acc']:.3f} DistDGL {dd['history'][-1]['val_acc']:.3f}"
    )


if __name__ == "__main__":
    main()
