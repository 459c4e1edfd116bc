"""DGS training on real DistDGL on this host: partition, servers, trainers (one per partition) and explainers.

``run_dgs(cfg) -> dict`` is the recipe entry for ``job: gnn_dgs`` (recipes/conf/gnn_dgs.yaml) and what the tests and
benchmarks/dgs_bytes.py call. Layout (per partition p): one DistGraph server (``DGL_SERVER_ID=p``, in its own mount
namespace with a private /dev/shm: DGL names a partition's graph segments after the graph, but its KVStore segments
(features, labels, masks) after the tensor only, so two sessions on one host, or two servers, would overwrite each
other's; the trainers join server 0's namespace, whose segments they map; root, ``unshare`` and ``nsenter``), one
trainer (``python -m dgl_plugin.dgs_train <args.json>``: ``DistGraph``, ``DistNodeDataLoader``,
gradients averaged by a gloo all-reduce each step) and, when DGS is on, that trainer's explainer process. Every
process exits by itself: trainers at the end, servers when the last client leaves (DistDGL), explainers with their
trainer; the parent kills whatever is left once ``timeout_s`` passes without progress (no trainer's log grew: they
log every epoch) and reports it as an error.

Under DistDGL's own launcher (one machine per partition) the recipe runs one server or one trainer per process instead
(:func:`check_launch`, :func:`run_dgs`).

Trainer p trains on the training nodes of partition p (the same number of steps on every rank: a rank out of batches
adds zero gradients). Evaluation (validation and test accuracy) samples all neighbours and pulls full features
through DGL, for every configuration alike, and is not counted in the bytes.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from flowlane.launch import free_port

if TYPE_CHECKING:
    from .distdgl import DistDGLRole

ROOT = Path(__file__).resolve().parent.parent


def redundant_graph(
    num_nodes: int = 2000,
    avg_degree: float = 10.0,
    num_classes: int = 4,
    signal_dims: int = 8,
    redundant_dims: int = 16,
    noise_dims: int = 8,
    signal: float = 1.0,
    seed: int = 0,
    **kw: Any,
):
    """A degree-corrected SBM graph (:mod:`dgl_plugin.synthetic`) whose features have redundant dimensions (digest
    A5.2): ``signal_dims`` class-signal columns, ``redundant_dims`` random mixtures of them (plus small noise), and
    ``noise_dims`` pure noise columns; so a model does not need every column of every neighbour."""
    import dgl
    import torch

    from .synthetic import SyntheticSpec, synthetic_arrays

    arr = synthetic_arrays(
        SyntheticSpec(
            num_nodes=num_nodes,
            avg_degree=avg_degree,
            num_classes=num_classes,
            num_communities=max(4 * num_classes, 8),
            feat_dim=signal_dims,
            signal=signal,
            seed=seed,
            **kw,
        )
    )
    rng = np.random.default_rng(seed + 1)
    base = arr["feat"]
    mix = rng.normal(size=(signal_dims, redundant_dims)) / math.sqrt(signal_dims)
    red = base @ mix + 0.1 * rng.normal(size=(num_nodes, redundant_dims))
    noise = rng.normal(size=(num_nodes, noise_dims))
    feat = np.concatenate([base, red, noise], axis=1).astype(np.float32)
    g = dgl.graph((torch.from_numpy(arr["src"]), torch.from_numpy(arr["dst"])), num_nodes=num_nodes)
    g.ndata["feat"] = torch.from_numpy(feat)
    g.ndata["label"] = torch.from_numpy(arr["label"])
    for k in ("train_mask", "val_mask", "test_mask"):
        g.ndata[k] = torch.from_numpy(arr[k])
    return g


def partition_redundant(workdir: str | Path, num_parts: int, seed: int = 0, **data: Any) -> tuple[str, int]:
    """:func:`redundant_graph` partitioned with DistDGL's METIS into ``workdir/parts``: (part_config, classes).
    The graph name is unique per call: DGL names a partition's shared memory after it, and two runs on one host
    (a test beside a benchmark) must not share (and truncate) each other's segments."""
    import dgl

    g = redundant_graph(seed=seed, **data)
    out = Path(workdir) / "parts"
    name = f"dgs{os.getpid()}x{int(time.time() * 1e3) % 10**9}"
    dgl.distributed.partition_graph(
        g, name, num_parts, str(out), num_hops=1, part_method="metis", balance_train=True, balance_edges=True
    )
    return str(out / f"{name}.json"), int(g.ndata["label"].max()) + 1


def _graph_name(part_config: str) -> str:
    with open(part_config) as f:
        return json.load(f)["graph_name"]


# ------------------------------------------------------------------------------------------------ trainer process


def _trainer(args: dict) -> list[dict]:
    """One trainer process: connect, then train every entry of ``args["runs"]`` in turn (fresh model, sampler,
    ledger and explainer each; the same partitions and servers), and return one result per run."""
    from .dgs import register_services
    from .distdgl import DEFAULT_PEER_TIMEOUT_S, connect_trainer, peer_guard

    t_start = time.perf_counter()

    def log(what: str) -> None:  # progress in the trainer's log (the parent shows its tail on failure)
        print(f"dgs trainer: {what} at {time.perf_counter() - t_start:.1f} s", flush=True)

    peer_s = float(args.get("peer_timeout_s", DEFAULT_PEER_TIMEOUT_S))
    register_services()
    connect_trainer(args["ip_config"], peer_s)  # DGL's exit barrier bounded by peer_s
    log("DistDGL client connected")
    # a failure here or in a peer ends this trainer (PeerLostError for a lost peer), never a wait in DGL's barrier
    with peer_guard(peer_s, "gnn_dgs trainer"):
        return _trainer_body(args, peer_s, log)


def _trainer_body(args: dict, peer_s: float, log) -> list[dict]:
    import dgl
    import torch

    from .dgs import read_rows
    from .distdgl import leave, trainer_process_group

    trainer_process_group(peer_s)  # every collective bounded by peer_s
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    log(f"rank {rank}/{world} joined the gloo group")
    g = dgl.distributed.DistGraph(_graph_name(args["part_config"]), part_config=args["part_config"])
    if args.get("classes") is None:  # under DistDGL's launcher: the partitions are all there is
        own = g.get_partition_book().partid2nids(rank)
        top = torch.tensor([int(read_rows(g, "label", own, peer_s).max()) if len(own) else 0])
        torch.distributed.all_reduce(top, op=torch.distributed.ReduceOp.MAX)
        args = dict(args, classes=int(top) + 1)
    lp = None
    out = []
    for run in args["runs"]:
        if run["dgs_on"] and lp is None:
            from .fullgraph import load_local_partition

            lp = load_local_partition(args["part_config"], rank, world)  # collective: every rank has DGS on
        out.append(_train_one(g, rank, world, dict(args, **run), lp, log))
        log(f"run {run.get('name', len(out))} done")
    leave(peer_s)  # DGL's exit barrier, at most peer_s
    # under DistDGL's launcher: every rank's results to rank 0 (run_cluster reads files)
    if args.get("gather"):
        every = [None] * world
        torch.distributed.all_gather_object(every, out)
        return every if rank == 0 else []
    return out


def _train_one(g, rank: int, world: int, args: dict, lp, log) -> dict:
    """One run on this rank: a fresh model, sampler, ledger and (with DGS) explainer; train ``args["epochs"]``
    epochs of the same number of steps on every rank, then evaluate."""
    import dgl
    import torch

    from flowlane.dgs import DGSConfig
    from flowlane.direct import DirectConfig

    from .dgs import DGSRuntime, NodeWeightRequest, remote_call
    from .distdgl import DEFAULT_PEER_TIMEOUT_S
    from .models import build_model

    cfg = DGSConfig.from_dict(args["dgs"])
    on = args["dgs_on"]
    torch.manual_seed(args["seed"] + rank)
    pb = g.get_partition_book()
    direct = None if args.get("direct") is None else DirectConfig.from_dict(args["direct"])
    peer_s = float(args.get("peer_timeout_s", DEFAULT_PEER_TIMEOUT_S))
    rt = DGSRuntime(g, rank, cfg, direct=direct, peer_timeout_s=peer_s)
    if direct is not None:
        log(f"own-partition rows by PyTorch-Direct: {rt.direct_note}")
    # every run starts from uniform node weights on this partition's server (empty ids: reset)
    reset = NodeWeightRequest(torch.zeros(0, dtype=torch.int64), torch.zeros(0))
    remote_call([(rank, reset)], rt.peer_timeout_s, "DGS node weights")
    own = pb.partid2nids(rank)
    train = own[rt.read(own, "train_mask").bool()]
    model_kw = {
        "name": args["model"],
        "in_feats": rt.f,
        "hidden": args["hidden"],
        "n_classes": args["classes"],
        "num_layers": len(args["fanouts"]),
        "seed": args["seed"],
    }
    model = build_model(**model_kw)
    opt = torch.optim.Adam(model.parameters(), lr=args["lr"])
    sampler = _sampler(cfg, on, [int(f) for f in args["fanouts"]], rt, seed=args["seed"] * 100 + rank)
    loader = dgl.dataloading.DistNodeDataLoader(
        g, train, sampler, batch_size=args["batch"], shuffle=True, drop_last=False
    )
    steps = _steps_per_epoch(len(train), args["batch"])
    explainer, halo_ids, pull_check = None, np.zeros(0, np.int64), None
    if on and cfg.needs_explainer:
        explainer, halo_ids, pull_check = _start_explainer(g, rt, lp, cfg, model, model_kw, args, log)
    loop = _TrainLoop(g, rt, cfg, model, opt, world, explainer, halo_ids)
    hist = []
    try:
        for ep in range(args["epochs"]):
            hist.append(dict(epoch=ep, **loop.epoch(loader, steps)))
            log(f"epoch {ep} loss {hist[-1]['loss']:.4f} mask version {rt.mask_version}")
        ex_stats = explainer.stop() if explainer is not None else {}
    except BaseException:
        if explainer is not None and explainer.proc.is_alive():
            explainer.proc.kill()
        raise
    acc = _evaluate(rt, rank, model, loop.forward, args["batch"])
    log(f"evaluated: {acc}")
    return {
        "name": args.get("name"),
        "rank": rank,
        "history": hist,
        "bytes": rt.ledger.as_dict(),
        "stats": dict(rt.stats),
        "grad_allreduce_bytes": loop.grad_bytes,
        "steps_per_epoch": steps,
        "train_nodes": int(len(train)),
        "columns_pulled": None if rt.dims is None else int(rt.dims.numel()),
        "direct": rt.direct_note,
        "feat_dim": rt.f,
        "explainer": ex_stats,
        "train_s": loop.train_s,
        "pull_check": pull_check,
        **acc,
    }


def _sampler(cfg, on: bool, fanouts: list[int], rt, seed: int):
    """DGS's weighted (or LABOR-based) neighbour sampler when DGS samples nodes, else DGL's uniform one; both count
    the rows they fetch in the runtime's ledger."""
    from .dgs import CountingNeighborSampler, DGSNeighborSampler

    if on and (cfg.node_sampling or cfg.base_sampler == "labor"):
        return DGSNeighborSampler(
            fanouts, rt, weighted=cfg.node_sampling, epsilon=cfg.epsilon, base=cfg.base_sampler, seed=seed
        )
    return CountingNeighborSampler(fanouts, rt)


def _steps_per_epoch(train_nodes: int, batch: int) -> int:
    """The same on every rank: the largest partition's batches (a rank out of batches adds zero gradients, so no
    rank waits in an all-reduce the others never join)."""
    import torch

    from flowlane import comm

    counts = torch.tensor([float(train_nodes)])
    comm.all_reduce(counts, op=torch.distributed.ReduceOp.MAX, kind="setup")
    return max(1, math.ceil(float(counts) / batch))


def _start_explainer(g, rt, lp, cfg, model, model_kw: dict, args: dict, log):
    """The trainer's explainer process over its partition plus halo (DGS §A5.1): the halo's features come in one
    counted setup pull (A6 #4). Returns (explainer, halo ids, the column-pull self-check or None)."""
    import torch

    from .dgs_explainer import ExplainerHandle, ExplainerSpec

    halo_ids = lp.halo_ids
    halo_x = rt.pull(torch.from_numpy(halo_ids), None, kind="setup")
    pull_check = None
    if args.get("self_check") and len(halo_ids):
        pull_check = _check_column_pull(g, rt, torch.from_numpy(halo_ids[:50]))
    x_all = torch.cat([lp.x.float(), halo_x])
    spec = ExplainerSpec(lp.e_src, lp.e_dst, len(lp.inner_ids), model_kw, cfg, seed=args["seed"])
    explainer = ExplainerHandle(spec, x_all, model)
    log(f"explainer started (halo {len(halo_ids)} nodes)")
    return explainer, halo_ids, pull_check


class _TrainLoop:
    """A run's training steps: pull the batch's inputs through DGS, forward layer by layer, average the gradients
    across ranks, step; every ``t_ex`` steps hand the model to the explainer and apply the masks it returns."""

    def __init__(self, g, rt, cfg, model, opt, world: int, explainer, halo_ids) -> None:
        self.g, self.rt, self.cfg, self.model, self.opt = g, rt, cfg, model, opt
        self.world, self.explainer, self.halo_ids = world, explainer, halo_ids
        self.it = 0
        self.train_s = 0.0
        self.grad_bytes = 0

    def forward(self, blocks, x):
        h = x
        for k, blk in enumerate(blocks):
            h = self.model.forward_layer(k, blk, h, h[: blk.num_dst_nodes()])
        return h

    def epoch(self, loader, steps: int) -> dict:
        """``steps`` steps (the loader's batches, then empty ones), drained loader; the epoch's history row."""
        rt = self.rt
        self.model.train()
        t0 = time.perf_counter()
        before, rows0 = rt.ledger.as_dict(), dict(rt.stats)
        waited = 0.0  # in explainer.wait() (synchronous mode): the explainer's time, not the trainer's
        batches = iter(loader)
        tot, n = 0.0, 0
        for _ in range(steps):
            if self.explainer is not None:
                new = self.explainer.poll()
                if new is not None:
                    rt.apply_masks(self.halo_ids, *new)
            loss = self._step(next(batches, None))
            if loss is not None:
                tot, n = tot + loss, n + 1
            waited += self._explain()
        for _ in batches:  # DistNodeDataLoader must be drained
            pass
        dt = time.perf_counter() - t0
        self.train_s += dt
        after = rt.ledger.as_dict()
        return {
            "loss": tot / max(n, 1),
            "epoch_s": dt,
            "explainer_wait_s": waited,
            "mask_version": rt.mask_version,
            "bytes": {k: after[k] - before[k] for k in after},
            "remote_rows": rt.stats["remote_rows"] - rows0["remote_rows"],
            "input_rows": rt.stats["input_rows"] - rows0["input_rows"],
        }

    def _step(self, batch) -> float | None:
        """One optimizer step; ``batch`` None (this rank is out of batches) still joins the gradient average."""
        import torch.nn.functional as F

        self.opt.zero_grad()
        loss = None
        if batch is not None:
            inp, seeds, blocks = batch
            out = F.cross_entropy(
                self.forward(blocks, self.rt.pull_inputs(inp)), self.rt.read(seeds, "label")
            )
            out.backward()
            loss = float(out)
        self._average_gradients()
        self.opt.step()
        self.it += 1
        return loss

    def _average_gradients(self) -> None:
        """What DDP does, as one all-reduce of the flattened gradients: the model runs layer by layer
        (``forward_layer``), which DDP's forward would not see, and a rank without a batch contributes zeros."""
        import torch

        from flowlane import comm

        params = list(self.model.parameters())
        flat = torch.cat(
            [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params]
        )
        comm.all_reduce(flat, kind="dp")
        self.grad_bytes += flat.numel() * flat.element_size()
        flat /= self.world
        off = 0
        for p in params:
            p.grad = flat[off : off + p.numel()].view_as(p).clone()
            off += p.numel()

    def _explain(self) -> float:
        """Every ``t_ex`` steps the explainer gets the model (A5.1); in synchronous mode the trainer waits for its
        masks (returns the seconds waited)."""
        if self.explainer is None or self.it % self.cfg.t_ex:
            return 0.0
        self.explainer.publish(self.model)
        if not self.cfg.synchronous:
            return 0.0
        tw = time.perf_counter()
        new = self.explainer.wait()
        waited = time.perf_counter() - tw
        self.rt.apply_masks(self.halo_ids, *new)
        return waited


def _check_column_pull(g, rt, ids) -> dict:
    """Self-check (tests): the column service returns exactly the requested columns of DGL's own pull, zeros
    elsewhere, for remote rows."""
    import torch

    dims = torch.tensor(sorted({0, 2, rt.f - 1, rt.f // 2}), dtype=torch.int64)
    got = rt.pull(ids, dims, kind="setup")
    ref = rt.read(ids)
    other = torch.ones(rt.f, dtype=torch.bool)
    other[dims] = False
    # PyTorch-Direct: own rows gathered from the local table by a FeatureStore, remote rows as before
    from flowlane.direct import DirectConfig

    from .dgs import DGSRuntime

    own = g.get_partition_book().partid2nids(rt.part_id)
    mixed = torch.cat([own[: ids.numel()], ids])
    direct = DGSRuntime(
        g, rt.part_id, rt.cfg, direct=DirectConfig(path="cpu-gather"), peer_timeout_s=rt.peer_timeout_s
    )
    return {
        "rows": int(ids.numel()),
        "cols": dims.tolist(),
        "remote_rows": int((rt.owner(ids) != rt.part_id).sum()),
        "equal": bool(torch.equal(got[:, dims], ref[:, dims])),
        "zero_elsewhere": bool((got[:, other] == 0).all()),
        "direct_own_rows": int(min(own.numel(), ids.numel())),
        "direct_applied": direct.store is not None,
        "direct_equal": bool(torch.equal(direct.pull(mixed, kind="setup"), rt.read(mixed)))
        and bool(torch.equal(direct.pull(mixed, dims, kind="setup"), rt.pull(mixed, dims, kind="setup"))),
    }


def _rss() -> float:
    import resource

    return float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)


def _evaluate(rt, rank, model, run, batch) -> dict:
    """Validation and test accuracy on this rank's partition: DGL's own sampler (all neighbours) and pulls, each
    bounded by ``peer_timeout_s`` like the training's."""
    import dgl
    import torch

    from .dgs import BoundedNeighborSampler

    out = {}
    g = rt.g
    own = rt.pb.partid2nids(rank)
    model.eval()
    for key in ("val_mask", "test_mask"):
        ids = own[rt.read(own, key).bool()]
        loader = dgl.dataloading.DistNodeDataLoader(
            g,
            ids,
            BoundedNeighborSampler([-1] * len(model.layers), rt.peer_timeout_s),
            batch_size=batch,
            shuffle=False,
            drop_last=False,
        )
        ok = torch.zeros(2)
        with torch.no_grad():
            for inp, seeds, blocks in loader:
                pred = run(blocks, rt.read(inp, "feat")).argmax(1)
                ok += torch.tensor([float((pred == rt.read(seeds, "label")).sum()), float(seeds.numel())])
        torch.distributed.all_reduce(ok)
        out[key.replace("_mask", "_acc")] = float(ok[0] / ok[1]) if ok[1] else float("nan")
    return out


# ------------------------------------------------------------------------------------------------ parent process


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _tail(path: Path, n: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


def run_cluster(
    workdir: str | Path,
    part_config: str,
    num_parts: int,
    trainer_args: dict,
    timeout_s: float = 600.0,
    net: Any = None,
) -> list[list[dict]]:
    """Start ``num_parts`` DistGraph servers and trainers on localhost and return every trainer's results (one per
    entry of ``trainer_args["runs"]``). ``net`` (a :class:`flowlane.testing.netem.EmulatedNetwork` that is up, one
    rank per partition): server p and trainer p run in rank p's namespace, so every sampling RPC, feature pull and
    gradient all-reduce between partitions crosses the shaped links, and DGL sees one machine per partition.
    Raises RuntimeError (with the logs' tails) if a process fails or the trainers make no progress for ``timeout_s``
    (a stall timeout: a long run that keeps logging epochs is never cut)."""
    if os.geteuid() != 0 or not _which("unshare") or not _which("nsenter"):
        raise RuntimeError(
            "run_cluster needs root, unshare(1) and nsenter(1): every DistGraph server runs with a private "
            "/dev/shm (DGL names its KVStore segments after the tensor only), which the trainers join"
        )
    if net is not None and net.num_ranks != num_parts:
        raise ValueError(
            f"net has {net.num_ranks} ranks but num_parts={num_parts}: one namespace per partition"
        )
    work = Path(workdir)
    work.mkdir(parents=True, exist_ok=True)
    ip_config = work / "ip_config.txt"
    ips = list(net.ips[:num_parts]) if net is not None else ["127.0.0.1"] * num_parts
    ip_config.write_text("".join(f"{ip} {free_port()}\n" for ip in ips))
    env = dict(
        os.environ,
        DGL_IP_CONFIG=str(ip_config),
        DGL_NUM_SERVER="1",
        DGL_NUM_CLIENT=str(num_parts),
        DGL_CONF_PATH=part_config,
        DGL_NUM_SAMPLER="0",
        OMP_NUM_THREADS="1",
        DGL_DIST_MODE="distributed",
        PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
    )
    procs: list[_Proc] = []
    try:
        _start_servers(procs, work, ip_config, num_parts, env, net)
        # the trainers (all "machine 0" to DGL on one host) map partition 0's segments: they join server 0's
        # mount namespace, once it is in there (its command is python, after the tmpfs mount)
        # (with ``net``: trainer p is machine p and joins server p's mount and network namespaces)
        spids = [
            _server_pid(p, deadline=time.monotonic() + 120, log=log)
            for _, p, log in (procs if net is not None else procs[:1])
        ]
        args = dict(trainer_args, ip_config=str(ip_config), part_config=part_config)
        trainers = _start_trainers(procs, work, args, ips, spids, env, net)
        _wait_for_trainers(procs, trainers, timeout_s)
        for _, p, _ in procs:
            try:
                p.wait(timeout=30)  # servers leave when the last client has left
            except subprocess.TimeoutExpired:
                p.kill()
        return [json.loads((work / f"trainer{r}.json").read_text()) for r in range(num_parts)]
    finally:
        for _, p, _ in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
        # no segment is left in the host's /dev/shm: each private tmpfs goes with its last process


#: (name, process, its log) of one server or trainer that run_cluster started
_Proc = tuple[str, subprocess.Popen, Path]


def _start_servers(
    procs: list[_Proc], work: Path, ip_config: Path, num_parts: int, env: dict, net: Any
) -> None:
    """One DistGraph server per partition, each in its own mount namespace with a private /dev/shm: DGL names a
    partition's graph segments after the graph but its KVStore segments ("node~_N:feat-kvdata-", labels, masks)
    after the tensor only, so two DistDGL sessions on one host overwrite each other's partition 0 otherwise. Each
    is added to ``procs`` as it starts (the caller kills them all if a later one fails)."""
    server_py = [
        sys.executable,
        "-c",
        "from dgl_plugin.dgs import register_services; register_services(); "
        f"import dgl; dgl.distributed.initialize({str(ip_config)!r})",
    ]
    for i in range(num_parts):
        private_shm = ["unshare", "--mount", "--propagation", "private"]
        private_shm += ["sh", "-c", 'mount -t tmpfs tmpfs /dev/shm && exec "$@"', "sh"]
        cmd = [*private_shm, *(net.exec_prefix(i) if net is not None else []), *server_py]
        server_env = dict(env, DGL_ROLE="server", DGL_SERVER_ID=str(i))
        procs.append(_spawn(f"server {i}", cmd, work / f"server{i}.log", server_env))


def _start_trainers(
    procs: list[_Proc], work: Path, args: dict, ips: list[str], spids: list[int], env: dict, net: Any
) -> list[_Proc]:
    """Trainer r (``python -m dgl_plugin.dgs_train trainer{r}.args.json``) in server 0's mount namespace, or with
    ``net`` in server r's mount and network namespaces; the trainers' gloo group meets at ``ips[0]``. Each is added
    to ``procs`` as it starts; returns the trainers."""
    port = free_port()
    first = len(procs)
    for r in range(len(ips)):
        arg_file = work / f"trainer{r}.args.json"
        arg_file.write_text(json.dumps(dict(args, result=str(work / f"trainer{r}.json"))))
        spid = spids[r if net is not None else 0]
        enter = ["nsenter", f"--mount=/proc/{spid}/ns/mnt"]
        enter += [f"--net=/proc/{spid}/ns/net"] if net is not None else []
        cmd = [*enter, "--", sys.executable, "-m", "dgl_plugin.dgs_train", str(arg_file)]
        trainer_env = dict(
            env,
            DGL_ROLE="client",
            RANK=str(r),
            WORLD_SIZE=str(len(ips)),
            MASTER_ADDR=ips[0],
            MASTER_PORT=str(port),
            **({"GLOO_SOCKET_IFNAME": net.ifname} if net is not None else {}),
        )
        procs.append(_spawn(f"trainer {r}", cmd, work / f"trainer{r}.log", trainer_env))
    return procs[first:]


def _spawn(name: str, cmd: list[str], log: Path, env: dict) -> _Proc:
    with open(log, "w") as fh:
        return name, subprocess.Popen(cmd, cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT, env=env), log


def _wait_for_trainers(procs: list[_Proc], trainers: list[_Proc], timeout_s: float) -> None:
    """Until every trainer has exited 0; a process that exits non-zero, or ``timeout_s`` without progress (no
    trainer's log grew; each logs every epoch), raises RuntimeError with the logs' tails."""
    logged, deadline = -1, 0.0
    while any(p.poll() is None for _, p, _ in trainers):
        size = sum(_size(log) for _, _, log in trainers)
        if size != logged:
            logged, deadline = size, time.monotonic() + timeout_s
        bad = [(n, p.returncode, log) for n, p, log in procs if p.poll() not in (None, 0)]
        if bad:
            raise RuntimeError(
                "DGS run failed: " + "; ".join(f"{n} exited {rc}:\n{_tail(log)}" for n, rc, log in bad)
            )
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"DGS trainers made no progress for timeout_s={timeout_s} s (no trainer log grew); trainer logs:\n"
                + "\n".join(f"{n}:\n{_tail(log)}" for n, _, log in trainers)
            )
        time.sleep(0.2)
    bad = [(n, p.returncode, log) for n, p, log in trainers if p.returncode != 0]
    if bad:
        raise RuntimeError(
            "DGS trainers failed: " + "; ".join(f"{n} exited {rc}:\n{_tail(log)}" for n, rc, log in bad)
        )


def _server_pid(p: subprocess.Popen, deadline: float, log: Path) -> int:
    """The pid of a server started as ``unshare --mount sh -c 'mount ...; exec [ip netns exec ns] python ...'``, once
    it runs python (so its private /dev/shm is mounted and it is in its network namespace)."""
    while True:
        if p.poll() is not None:
            raise RuntimeError(f"DGS run failed: a server exited {p.returncode} at start:\n{_tail(log)}")
        try:
            argv0 = Path(f"/proc/{p.pid}/cmdline").read_bytes().split(b"\0")[0].decode()
        except OSError:
            argv0 = ""
        if argv0 == sys.executable:
            return p.pid
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"DGS run failed: a server did not start python with its private /dev/shm:\n{_tail(log)}"
            )
        time.sleep(0.05)


def _which(name: str) -> bool:
    import shutil

    return shutil.which(name) is not None


RUN_KEYS = {
    "job",
    "peer_timeout_s",
    "world_size",
    "epochs",
    "lr",
    "seed",
    "timeout_s",
    "output_dir",
    "workdir",
    "batch_size",
    "fanouts",
    "data",
    "model",
    "flowlane",
}


MODEL_KEYS = ("name", "hidden")
# SyntheticSpec fields redundant_graph sets itself: feat_dim (= signal_dims), num_communities and the seed (the
# recipe's); the other fields pass through its **kw
_SET_BY_GRAPH = ("feat_dim", "num_communities", "seed")


def data_fields() -> dict[str, Any]:
    """The ``data.*`` keys and their types: :func:`redundant_graph`'s parameters (but ``seed``), then the
    :class:`~dgl_plugin.synthetic.SyntheticSpec` fields it passes on."""
    import dataclasses
    import inspect
    import typing

    from .synthetic import SyntheticSpec

    hints = typing.get_type_hints(redundant_graph)
    own = inspect.signature(redundant_graph).parameters.values()
    fields = {p.name: hints[p.name] for p in own if p.kind is p.POSITIONAL_OR_KEYWORD and p.name != "seed"}
    spec = typing.get_type_hints(SyntheticSpec)
    for f in dataclasses.fields(SyntheticSpec):
        if f.name not in fields and f.name not in _SET_BY_GRAPH:
            fields[f.name] = spec[f.name]
    return fields


def redundant_spec(data: Mapping[str, Any]):
    """The :class:`~dgl_plugin.synthetic.SyntheticSpec` :func:`redundant_graph` builds from ``data`` (seed 0: the
    checks do not depend on it); tests/test_validate_dgs_config.py pins it to redundant_graph's own."""
    import inspect

    from .synthetic import SyntheticSpec

    params = inspect.signature(redundant_graph).parameters
    d = {n: p.default for n, p in params.items() if p.default is not p.empty} | dict(data)
    kw = {k: v for k, v in data.items() if k not in params}  # what redundant_graph's **kw passes on
    return SyntheticSpec(
        num_nodes=d["num_nodes"],
        avg_degree=d["avg_degree"],
        num_classes=d["num_classes"],
        num_communities=max(4 * d["num_classes"], 8),
        feat_dim=d["signal_dims"],
        signal=d["signal"],
        **kw,
    )


def check_data(data: Any) -> None:
    """gnn_dgs's ``data`` group as the local run reads it, ``partition_redundant(..., **data)``: an unknown key was
    a TypeError, a bad value a ValueError, in the parent after the run had started (exit 1, a traceback)."""
    fields = data_fields()
    if not isinstance(data, Mapping):
        raise ValueError(f"gnn_dgs: data={data!r} must be a group of {list(fields)}")
    unknown = sorted(set(data) - set(fields))
    if unknown:
        why = " (the graph's seed is the recipe's seed)" if "seed" in unknown else ""
        raise ValueError(f"gnn_dgs: unknown data key(s) {unknown}{why}; allowed: {list(fields)}")
    for k, v in data.items():
        if fields[k] is int and (isinstance(v, bool) or not isinstance(v, int)):
            raise ValueError(f"gnn_dgs: data.{k}={v!r} must be an integer")
        if fields[k] is float and (
            isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v)
        ):
            raise ValueError(f"gnn_dgs: data.{k}={v!r} must be a finite number")
    for k in ("redundant_dims", "noise_dims"):
        if data.get(k, 0) < 0:
            raise ValueError(f"gnn_dgs: data.{k}={data[k]!r} must be an integer >= 0")
    spec = redundant_spec(data)
    try:
        spec.validate()
    except ValueError as e:  # "synthetic graph: bad num_classes=1 (num_nodes=2000, num_classes=1)"
        msg = str(e)
        if "bad num_communities=" in msg:
            raise ValueError(
                f"gnn_dgs: data.num_nodes={spec.num_nodes} is too small for data.num_classes={spec.num_classes}: "
                f"the graph has max(4 x num_classes, 8) = {spec.num_communities} communities, at most one per node"
            ) from None
        for a, b in (
            ("bad feat_dim=", "bad data.signal_dims="),
            ("bad train_frac + val_frac=", "bad data.train_frac + data.val_frac="),
            ("bad ", "bad data."),
        ):
            if a in msg:
                msg = msg.replace(a, b, 1)
                break
        raise ValueError(f"gnn_dgs: {msg}") from None


def _check_folder(c: Mapping[str, Any], key: str) -> None:
    """Create ``c[key]`` and prove it takes a file (flowlane.launch.check_output_dir), before any process."""
    from flowlane.launch import check_output_dir

    try:
        check_output_dir(c[key], key)
    except ValueError as e:
        raise ValueError(
            f"gnn_dgs: {str(e).replace(f'with {key} <folder>', f'with {key}=<folder>')}"
        ) from None


def check_config(c: dict, env: Mapping[str, str] | None = None) -> DistDGLRole | None:
    """Reject unknown keys and bad values by name, before any process starts; under DistDGL's launcher (``env``,
    default ``os.environ``) also a launch that does not fit: returns this process's role, or None (local run)."""
    from flowlane.dgs import DGSConfig

    unknown = sorted(set(c) - RUN_KEYS)
    if unknown:
        raise ValueError(f"gnn_dgs: unknown key(s) {unknown}; known: {sorted(RUN_KEYS)}")
    fl = c.get("flowlane") or {}
    if not isinstance(fl, Mapping):
        raise ValueError(f"gnn_dgs: flowlane={fl!r} must be a group of ['dgs', 'direct']")
    extra = sorted(set(fl) - {"dgs", "direct"})
    if extra:
        raise ValueError(f"gnn_dgs: unknown flowlane section(s) {extra}; known: ['dgs', 'direct']")
    dgs = fl.get("dgs")
    if dgs is not None:
        if not isinstance(dgs, Mapping):
            raise ValueError(
                f"gnn_dgs: flowlane.dgs={dgs!r} must be a group of DGSConfig's keys, or null (DGS off)"
            )
        DGSConfig.from_dict(dict(dgs))
    if fl.get("direct") is not None:
        from flowlane.direct import DirectConfig

        try:
            DirectConfig.from_dict(fl["direct"])
        except (TypeError, ValueError) as e:
            raise ValueError(f"gnn_dgs: flowlane.direct: {e}") from None
    w = c.get("world_size", 2)
    if isinstance(w, bool) or not isinstance(w, int) or w < 2:
        raise ValueError(
            f"gnn_dgs: world_size={w!r} must be an integer >= 2 (one DistDGL partition per trainer)"
        )
    fan = c.get("fanouts", [10, 10])
    if (
        not isinstance(fan, list | tuple)
        or not fan
        or any(isinstance(f, bool) or not isinstance(f, int) or (f < 1 and f != -1) for f in fan)
    ):
        raise ValueError(f"gnn_dgs: fanouts={fan!r} must be a list of integers >= 1 (or -1: all neighbours)")
    if "peer_timeout_s" in c:
        from .distdgl import check_peer_timeout

        check_peer_timeout(c["peer_timeout_s"], "gnn_dgs: peer_timeout_s")  # > 0 and at most a year
    t = c.get("timeout_s", 600)
    if isinstance(t, bool) or not isinstance(t, int | float) or not (math.isfinite(t) and t > 0):
        raise ValueError(f"gnn_dgs: timeout_s={t!r} must be a finite number of seconds > 0")
    for key, low in (("epochs", 1), ("batch_size", 1), ("seed", 0)):
        v = c.get(key, low)
        if isinstance(v, bool) or not isinstance(v, int) or v < low:
            # seed: the servers' sampling RNG is keyed by it; a negative key would end a server (numpy refuses it)
            raise ValueError(f"gnn_dgs: {key}={v!r} must be an integer >= {low}")
    lr = c.get("lr", 0.01)
    if isinstance(lr, bool) or not isinstance(lr, int | float) or not (math.isfinite(lr) and lr > 0):
        raise ValueError(f"gnn_dgs: lr={lr!r} must be a number > 0")
    m = c.get("model") or {}
    if not isinstance(m, Mapping):
        raise ValueError(f"gnn_dgs: model={m!r} must be a group of {list(MODEL_KEYS)}")
    unknown = sorted(set(m) - set(MODEL_KEYS))
    if unknown:
        raise ValueError(f"gnn_dgs: unknown model key(s) {unknown}; known: {list(MODEL_KEYS)}")
    hidden = m.get("hidden", 32)
    if isinstance(hidden, bool) or not isinstance(hidden, int) or hidden < 1:
        raise ValueError(f"gnn_dgs: model.hidden={hidden!r} must be an integer >= 1")
    model = m.get("name", "sage")
    if model not in ("sage", "gcn"):
        raise ValueError(
            f"gnn_dgs: model.name={model!r}: choose 'sage' or 'gcn' (the explainer needs layers that "
            f"take edge weights)"
        )
    check_data(c.get("data") or {})
    role = check_launch(w, env)
    # the folders this process writes: the summary (the local parent; rank 0 of the trainers under DistDGL's
    # launcher), the partitions (the local parent)
    if c.get("output_dir") and (role is None or role.role == "client"):
        _check_folder(c, "output_dir")
    if c.get("workdir") and role is None:
        _check_folder(c, "workdir")
    return role


def check_launch(world: int, env: Mapping[str, str] | None = None) -> DistDGLRole | None:
    """gnn_dgs under DistDGL's launcher (``tools/launch.py``: servers with DGL_ROLE=server, trainers under
    torch.distributed.run with DGL_ROLE=client; :mod:`dgl_plugin.distdgl` reads the variables): one trainer per
    partition (trainer p trains partition p, and its explainer explains partition p), one server per machine (the
    servers' DGS weights are per process), no sampler processes (the DGS block sampler calls the servers from the
    trainer), and torchrun's world equal to ``world_size``. Returns the role, or None when no launcher started this
    process. Errors are :class:`flowlane.launch_external.LauncherEnvError`."""
    from flowlane.launch_external import LauncherEnvError, check_world, detect_launcher

    from .distdgl import distdgl_role

    role = distdgl_role(env)
    ext = detect_launcher(env)
    if role is None:
        if ext is not None:
            raise LauncherEnvError(
                f"gnn_dgs under {ext.launcher} without DistDGL's variables (DGL_ROLE, DGL_IP_CONFIG, ...): "
                "it needs DistGraph servers; start it with DistDGL's launch.py, or run it locally (no launcher)"
            )
        return None
    with open(role.part_config) as f:
        parts = json.load(f).get("num_parts")
    if parts != world:
        raise LauncherEnvError(
            f"DGL_CONF_PATH={role.part_config!r} has num_parts={parts} but world_size={world}: gnn_dgs trains "
            f"one partition per trainer"
        )
    if role.num_servers != 1:
        # DGS's node weights (NodeWeightRequest) live in the server process that stored them, and DGL sends each
        # request to a random server of the machine: with several, sampling would read weights never set there
        raise LauncherEnvError(
            f"DGL_NUM_SERVER={role.num_servers}: gnn_dgs keeps its sampling weights in the graph server's process, "
            f"so it needs one server per machine; launch with --num_servers 1"
        )
    if role.role == "server":
        return role
    if ext is None:
        raise LauncherEnvError(
            "DGL_ROLE=client without torchrun's variables (RANK, WORLD_SIZE, MASTER_ADDR, ...): DistDGL's "
            "launch.py starts trainers with python -m torch.distributed.run"
        )
    check_world(ext, world, "world_size")
    if role.num_samplers:
        raise LauncherEnvError(
            f"DGL_NUM_SAMPLER={role.num_samplers}: gnn_dgs samples in the trainer (its block sampler calls the "
            f"servers' DGS services); launch with --num_samplers 0"
        )
    if role.num_clients != world:
        raise LauncherEnvError(
            f"DGL_NUM_CLIENT={role.num_clients} but world_size={world} trainers: launch.py counts trainers x "
            f"machines; launch one trainer per partition"
        )
    return role


def _trainer_args(c: dict, classes: int | None) -> dict:
    from .distdgl import DEFAULT_PEER_TIMEOUT_S

    dgs = (c.get("flowlane") or {}).get("dgs")
    model = dict(c.get("model") or {})
    return {
        "runs": [{"name": "gnn_dgs", "dgs": dgs or {}, "dgs_on": dgs is not None}],
        "direct": (c.get("flowlane") or {}).get("direct"),
        "seed": int(c.get("seed", 0)),
        "epochs": int(c.get("epochs", 5)),
        "lr": float(c.get("lr", 0.01)),
        "batch": int(c.get("batch_size", 64)),
        "fanouts": list(c.get("fanouts", [10, 10])),
        "model": model.get("name", "sage"),
        "hidden": int(model.get("hidden", 32)),
        "classes": classes,
        "peer_timeout_s": float(c.get("peer_timeout_s", DEFAULT_PEER_TIMEOUT_S)),
    }


def run_dgs(cfg: Any) -> dict:
    """``job: gnn_dgs``. Locally (no launcher): partition a synthetic graph with redundant features, start the servers
    and trainers (:func:`run_cluster`) and train with ``flowlane.dgs`` (DGS off when the section is null). Under
    DistDGL's launcher: this process is a server (serves until the trainers finish) or one trainer of the
    partitions in DGL_CONF_PATH (``data`` is then unused). Returns per-rank bytes and accuracy (rank 0 / the local
    parent; other launched processes return {}) and writes ``output_dir/summary.json``."""
    from .train import _plain

    c = _plain(cfg)
    role = check_config(c)
    world = int(c.get("world_size", 2))
    t = time.perf_counter()
    if role is not None and role.role == "server":
        from .dgs import register_services
        from .distdgl import serve

        register_services()  # before initialize, in servers too
        serve(role)
        return {}
    if role is not None:
        every = _trainer(
            dict(_trainer_args(c, None), ip_config=role.ip_config, part_config=role.part_config, gather=True)
        )
        if not every:
            return {}
        ranks = [r[0] for r in every]
    else:
        work = Path(c.get("workdir") or f"/tmp/flowlane_dgs_{os.getpid()}")
        part_config, classes = partition_redundant(
            work, world, seed=int(c.get("seed", 0)), **dict(c.get("data") or {})
        )
        ranks = [
            r[0]
            for r in run_cluster(
                work / "run", part_config, world, _trainer_args(c, classes), float(c.get("timeout_s", 600))
            )
        ]
    out = {
        "job": "gnn_dgs",
        "world_size": world,
        "launcher": "distdgl" if role is not None else "local",
        "config": c,
        "wall_s": time.perf_counter() - t,
        "val_acc": ranks[0]["val_acc"],
        "test_acc": ranks[0]["test_acc"],
        "bytes": {k: sum(r["bytes"][k] for r in ranks) for k in ranks[0]["bytes"]},
        "loss": [
            sum(r["history"][e]["loss"] for r in ranks) / world for e in range(len(ranks[0]["history"]))
        ],
        "ranks": ranks,
    }
    out_dir = c.get("output_dir")
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        tmp = os.path.join(out_dir, "summary.json.tmp")
        with open(tmp, "w") as f:
            json.dump(out, f, indent=1, default=str)
        os.replace(tmp, os.path.join(out_dir, "summary.json"))
    print(
        f"gnn_dgs: {world} partitions, loss {out['loss'][0]:.3f} -> {out['loss'][-1]:.3f}, "
        f"val {out['val_acc']:.3f}, test {out['test_acc']:.3f}, remote feature bytes {out['bytes']['feature_remote']:,}"
        f", sampling RPC bytes {out['bytes']['sampling_rpc']:,}"
    )
    return out


def main(argv: list[str]) -> None:
    args = json.loads(Path(argv[0]).read_text())
    res = _trainer(args)
    tmp = args["result"] + ".tmp"
    with open(tmp, "w") as f:
        json.dump(res, f)
    os.replace(tmp, args["result"])


if __name__ == "__main__":
    main(sys.argv[1:])
