"""Full-graph distributed GNN training on DGL: G3 hybrid parallelism with DGCL-planned halo exchange.

Seeds: G3 (000 ch.4; digest part B) and DGCL (001). Per rank (digest B2.8):
- data parallel: the graph is partitioned (G3 partitioner: METIS + Algorithm 2); a rank owns ``V_i`` and computes
  only their rows, on the in-edges of ``V_i`` (halo = remote in-neighbours, B6 #1);
- model parallel: before every layer, the halo rows of the previous layer's output arrive through
  :func:`flowlane.plan.graph_allgather` (SPST or peer-to-peer plan; backward returns gradients along the reversed plan);
- pipeline: nodes are ordered boundary-first after a BFS (§4.4.3 step 1), split into groups by whether they are sent
  to other ranks (boundary) and whether they need halo rows, and packed into bins of at most
  ``min(bin_size, mem_budget/2 / bytes_per_node)`` nodes (step 2, B6 #8). ``schedule="pipelined"`` computes, per layer:
  ready boundary bins, ready interior bins (eager: no halo needed, overlapping the previous exchange), waits for the
  halo, halo boundary bins, *starts sending the boundary outputs* (inter-layer pipeline), then the halo interior bins
  while the exchange runs. ``"sequential"`` exchanges, then computes every bin (the seed's "Sequential" variant);
- parameter sync: layer-wise asynchronous all-reduce (SUM) as each layer's gradients are accumulated, one optimizer
  step per epoch (B6 #12); the loss is Σ local CE / global #train nodes, so gradients equal single-process training
  exactly (B6 #13).

Open decisions (digest B6), decided here: #1 symmetrised partitioning, in-neighbour halos; #4 ``cache_halo_inputs``
(default False: layer-1 halo features are resent every epoch); #8 bin limit = min(initial size, memory cap); #9 a bin
launches when full or when no more ready nodes exist (bins are built statically from the groups above); #10 boundary
group first, stable BFS order inside; #11 backward runs the autograd graph in reverse (bins reversed) and exchanges
gradients along the reversed DGCL plan, all remote contributions summed before use (fp32); #12 per-layer async
all-reduce, no coordinator thread; #13 global-count loss normalisation; #14 GCN normalisation uses global degrees
(folded into edge weights); #15 GAT shares ``h`` and computes attention at the destination; #16 exactness tests use
no dropout; #18 torch.distributed isend/irecv through flowlane.comm.
"""

from __future__ import annotations

from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import dgl
import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from dgl.nn import GraphConv

from flowlane import comm
from flowlane import topology as topo_mod
from flowlane.plan import (
    CommRelation,
    GraphExchange,
    LinkModel,
    attach,
    build_plan,
    compile_tables,
    full_mesh,
    graph_allgather,
)

from .g3_partition import STAGE1, g3_partition

PARTITIONERS = ("g3", *STAGE1)
SCHEDULES = ("sequential", "pipelined")


@dataclass
class FullGraphConfig:
    """The DGL config option ``flowlane.fullgraph`` (one section of a recipe; every field is validated)."""

    partition: Literal["g3", "metis", "pymetis", "random", "chunk"] = "g3"
    """g3 = multi-constraint METIS (objtype) + Algorithm 2 refinement to ``gamma``; others: stage 1 only."""
    gamma: float = 0.005
    """Algorithm 2 convergence: stop when (max - min) / max of |V_i^remote| <= gamma (seed: 0.5 %)."""
    objtype: Literal["vol", "cut"] = "vol"
    """METIS objective: total communication volume (Eq. 4.3) or edge cut."""
    comm_plan: Literal["spst", "p2p", "auto"] = "auto"
    """DGCL planner for the halo exchange; auto = SPST unless peer-to-peer is cheaper under the cost model."""
    topology: str = "full_mesh"
    """Topology the planner models: "full_mesh" (uniform links) or a flowlane.topology preset name."""
    topology_kwargs: dict = field(default_factory=dict)
    devices: list | None = None
    """Topology endpoints the ranks run on (default: its first world-size endpoints)."""
    schedule: Literal["sequential", "pipelined"] = "pipelined"
    bin_size: int = 1000
    """Initial bin size in nodes (seed: DGL batch size 1000)."""
    mem_budget_bytes: float | None = None
    """Device memory budget; a bin uses at most half of it (§4.4.1). None: no cap."""
    cache_halo_inputs: bool = False
    """Fetch layer-0 halo features once instead of every epoch (B6 #4)."""
    emulate_bandwidth: float | None = None
    """Benchmarks only: emulated per-peer link speed (bytes/s) for the halo exchange."""
    seed: int = 0

    def validate(self, world: int) -> None:
        def bad(name: str, value: Any, why: str) -> None:
            raise ValueError(f"flowlane.fullgraph: bad {name}={value!r}: {why}")

        if self.partition not in PARTITIONERS:
            bad("partition", self.partition, f"choose one of {PARTITIONERS}")
        if not 0 <= self.gamma < 1:
            bad("gamma", self.gamma, "must be in [0, 1)")
        if self.objtype not in ("vol", "cut"):
            bad("objtype", self.objtype, "choose 'vol' or 'cut'")
        if self.comm_plan not in ("spst", "p2p", "auto"):
            bad("comm_plan", self.comm_plan, "choose 'spst', 'p2p' or 'auto'")
        if self.topology != "full_mesh" and self.topology not in topo_mod.PRESETS:
            bad("topology", self.topology, f"choose 'full_mesh' or one of {sorted(topo_mod.PRESETS)}")
        if self.schedule not in SCHEDULES:
            bad("schedule", self.schedule, f"choose one of {SCHEDULES}")
        if not isinstance(self.bin_size, int) or self.bin_size < 1:
            bad("bin_size", self.bin_size, "must be an integer >= 1")
        if self.mem_budget_bytes is not None and not self.mem_budget_bytes > 0:
            bad("mem_budget_bytes", self.mem_budget_bytes, "must be > 0 or None")
        if self.emulate_bandwidth is not None and not self.emulate_bandwidth > 0:
            bad("emulate_bandwidth", self.emulate_bandwidth, "must be > 0 bytes/s or None")
        if world < 1:
            bad("world size", world, "must be >= 1")

    @classmethod
    def from_dict(cls, d: dict | None) -> FullGraphConfig:
        d = dict(d or {})
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"flowlane.fullgraph: unknown option(s) {unknown}; known: {sorted(known)}")
        return cls(**d)


def check_graph(g: dgl.DGLGraph, feat: str = "feat", label: str = "label") -> None:
    """Reject graphs the runtime cannot train, naming the problem."""
    if not isinstance(g, dgl.DGLGraph):
        raise TypeError(f"expected a dgl.DGLGraph, got {type(g).__name__}")
    if not g.is_homogeneous:
        raise ValueError(f"graph must be homogeneous, got node types {g.ntypes} and edge types {g.etypes}")
    if g.num_nodes() == 0:
        raise ValueError("graph has no nodes")
    for key in (feat, label, "train_mask"):
        if key not in g.ndata:
            raise ValueError(f"graph lacks ndata[{key!r}]; has {sorted(g.ndata.keys())}")
    x = g.ndata[feat]
    if x.dim() != 2 or not torch.is_floating_point(x):
        raise ValueError(f"ndata[{feat!r}] must be a 2-D float tensor, got shape {tuple(x.shape)} dtype {x.dtype}")
    if not torch.isfinite(x).all():
        raise ValueError(f"ndata[{feat!r}] contains NaN or inf")
    y = g.ndata[label]
    if y.dim() != 1 or torch.is_floating_point(y) or (y.numel() and y.min() < 0):
        raise ValueError(f"ndata[{label!r}] must be a 1-D non-negative integer tensor, got {y.dtype} {tuple(y.shape)}")


def _bfs_boundary_first(members: np.ndarray, indptr: np.ndarray, indices: np.ndarray, part: np.ndarray,
                        rank: int, boundary: np.ndarray) -> np.ndarray:
    """§4.4.3 step 1: BFS over the partition from every component, then boundary nodes first (stable)."""
    seen = np.zeros(part.size, bool)
    order: list[int] = []
    for s in members.tolist():
        if seen[s]:
            continue
        seen[s] = True
        q = deque([s])
        while q:
            v = q.popleft()
            order.append(v)
            for w in indices[indptr[v]:indptr[v + 1]].tolist():
                if not seen[w] and part[w] == rank:
                    seen[w] = True
                    q.append(w)
    arr = np.asarray(order, np.int64)
    is_b = boundary[arr]
    return np.concatenate([arr[is_b], arr[~is_b]])


class FullGraphRuntime:
    """One rank of hybrid-parallel full-graph training. Collective: construct on every rank of ``group``."""

    def __init__(self, g: dgl.DGLGraph, model: torch.nn.Module, cfg: FullGraphConfig | None = None,
                 feat: str = "feat", label: str = "label", group: dist.ProcessGroup | None = None,
                 part: np.ndarray | None = None) -> None:
        self.cfg = cfg = cfg or FullGraphConfig()
        self.group = group
        self.rank = dist.get_rank(group) if dist.is_initialized() else 0
        self.world = dist.get_world_size(group) if dist.is_initialized() else 1
        cfg.validate(self.world)
        check_graph(g, feat, label)
        if not hasattr(model, "layers"):
            raise ValueError("model must expose its graph layers as `model.layers` (see dgl_plugin.models)")
        self.model = model
        n = g.num_nodes()
        src, dst = (t.numpy().astype(np.int64) for t in g.edges())
        # -- partition (rank 0; the assignment is broadcast so every rank agrees) --------------------------------
        self.part_stats: dict = {}
        if part is None:
            part_t = torch.zeros(n, dtype=torch.int64)
            if self.rank == 0:
                method = "metis" if cfg.partition == "g3" else cfg.partition
                p, stats = g3_partition(src, dst, n, self.world, cfg.gamma, method, cfg.objtype,
                                        refine_stage2=cfg.partition == "g3", seed=cfg.seed)
                part_t = torch.from_numpy(p)
                self.part_stats = stats.as_dict()
            if self.world > 1:
                comm.broadcast(part_t, 0, group=group, kind="setup")
            part = part_t.numpy()
        part = np.asarray(part, np.int64)
        if part.shape != (n,) or part.min() < 0 or part.max() >= self.world:
            raise ValueError(f"partition must assign each of the {n} nodes a rank in [0, {self.world})")
        self.part = part
        # -- DGCL relation, plan (same seeded planner on every rank; digests compared), tables -----------------
        rel = CommRelation.from_edges(src, dst, part, self.world)
        from .g3_partition import symmetric_csr

        indptr, indices = symmetric_csr(src, dst, n)
        boundary = np.zeros(n, bool)
        for ids in rel.needs:
            boundary[ids] = True
        members = [np.nonzero(part == r)[0] for r in range(self.world)]
        local_ids = [_bfs_boundary_first(members[r], indptr, indices, part, r, boundary)
                     for r in range(self.world)]
        if cfg.topology == "full_mesh":
            topo = full_mesh(max(self.world, 2), **({"bandwidth": 1e9} | cfg.topology_kwargs))
        else:
            topo = topo_mod.preset(cfg.topology, **cfg.topology_kwargs)
        lm = LinkModel.from_topology(topo, devices=cfg.devices, num_ranks=None if cfg.devices else self.world)
        self.plan = build_plan(rel, lm, method=cfg.comm_plan, seed=cfg.seed)
        if self.world > 1:
            digests = comm.all_gather_object(self.plan.digest(), group=group)
            if len(set(digests)) != 1:
                raise RuntimeError(f"ranks planned different exchanges: {digests}")
        self.tables = compile_tables(self.plan, rel, local_ids)[self.rank]
        # The halo exchange gets its own process group: its p2p ops run on a helper thread (pipelined schedule)
        # while layer all-reduces are in flight, and gloo only orders ops within one group, so sharing a group
        # lets the two streams interleave differently on different ranks (a timing-dependent hang).
        xgroup = None
        if self.world > 1:
            ranks = list(range(dist.get_world_size())) if group is None else dist.get_process_group_ranks(group)
            xgroup = dist.new_group(ranks)
        self.exchange = GraphExchange(self.tables, group=xgroup, emulate_bandwidth=cfg.emulate_bandwidth)
        self.local_ids = local_ids[self.rank]
        self.n_local, self.n_remote = self.tables.num_local, self.tables.num_remote
        self.n_boundary = int(boundary[self.local_ids].sum())
        full_ids = np.concatenate([self.local_ids, rel.needs[self.rank]])
        # -- local in-edges in row space [local | remote] -----------------------------------------------------
        pos = np.full(n, -1, np.int64)
        pos[full_ids] = np.arange(full_ids.size)
        mine = part[dst] == self.rank
        e_src, e_dst = pos[src[mine]], pos[dst[mine]]
        in_deg = np.bincount(dst, minlength=n).clip(min=1).astype(np.float64)
        out_deg = np.bincount(src, minlength=n).clip(min=1).astype(np.float64)
        gs, gd = src[mine], dst[mine]
        norms = {"both": out_deg[gs] ** -0.5 * in_deg[gd] ** -0.5, "left": 1.0 / out_deg[gs],
                 "right": 1.0 / in_deg[gd]}
        # -- groups and bins (§4.4.3 steps 2-3) ----------------------------------------------------------------
        needs_halo = np.zeros(self.n_local, bool)
        needs_halo[e_dst[e_src >= self.n_local]] = True
        is_b = np.arange(self.n_local) < self.n_boundary
        groups = {"A": is_b & ~needs_halo, "D": ~is_b & ~needs_halo, "C": is_b & needs_halo,
                  "E": ~is_b & needs_halo}
        d_in = g.ndata[feat].shape[1]
        order = np.argsort(e_dst, kind="stable")
        e_src, e_dst = e_src[order], e_dst[order]
        norms = {k: torch.from_numpy(v[order]).to(g.ndata[feat].dtype) for k, v in norms.items()}
        eptr = np.searchsorted(e_dst, np.arange(self.n_local + 1))
        self.avg_in_degree = float(e_dst.size / max(self.n_local, 1))
        self.bins: dict[str, list] = {k: [] for k in groups}
        self._bin_limit = self._limit(d_in)
        for name, mask in groups.items():
            rows = np.nonzero(mask)[0]
            for s in range(0, rows.size, self._bin_limit):
                b = rows[s:s + self._bin_limit]
                eidx = np.concatenate([np.arange(eptr[r], eptr[r + 1]) for r in b]) if b.size else \
                    np.zeros(0, np.int64)
                dst_pos = np.repeat(np.arange(b.size), eptr[b + 1] - eptr[b])
                n_src = self.n_local if name in ("A", "D") else self.n_local + self.n_remote
                blk = dgl.create_block((torch.from_numpy(e_src[eidx]), torch.from_numpy(dst_pos)),
                                       num_src_nodes=n_src, num_dst_nodes=b.size)
                for k, w in norms.items():
                    blk.edata[f"norm_{k}"] = w[torch.from_numpy(eidx)]
                self.bins[name].append((torch.from_numpy(b), blk))
        self._boundary_rows = torch.cat([b for nm in ("A", "C") for b, _ in self.bins[nm]] or
                                        [torch.zeros(0, dtype=torch.long)])
        perm = torch.cat([b for k in ("A", "D", "C", "E") for b, _ in self.bins[k]] or [torch.zeros(0, dtype=torch.long)])
        self._inv = torch.empty_like(perm)
        self._inv[perm] = torch.arange(perm.numel())
        # -- data ----------------------------------------------------------------------------------------------
        lid = torch.from_numpy(self.local_ids)
        self.x = g.ndata[feat][lid]
        self.y = g.ndata[label][lid]
        self.masks = {k: g.ndata[k][lid].bool() for k in ("train_mask", "val_mask", "test_mask") if k in g.ndata}
        self.n_train_global = int(g.ndata["train_mask"].sum())
        if self.n_train_global == 0:
            raise ValueError("ndata['train_mask'] selects no node")
        self._halo0 = None
        if cfg.cache_halo_inputs:
            self._halo0 = graph_allgather(self.x, self.exchange)
        self._layer_groups = [list(layer.parameters()) for layer in model.layers]
        self._pending_ar: list = []

    # -- helpers -----------------------------------------------------------------------------------------------
    def _limit(self, d_in: int) -> int:
        """Bin size: min(initial, (M / 2) / bytes per node) (§4.4.3 step 2; B6 #8), bytes for the widest layer."""
        if self.cfg.mem_budget_bytes is None:
            return self.cfg.bin_size
        widths = [d_in] + [p.shape[0] for layer in self.model.layers for p in layer.parameters() if p.dim() == 2]
        per_node = 4 * max(widths) * (2 + self.avg_in_degree)
        return max(1, min(self.cfg.bin_size, int(0.5 * self.cfg.mem_budget_bytes / per_node)))

    def _run_bins(self, k: int, name: str, h_src: torch.Tensor) -> list[torch.Tensor]:
        layer = self.model.layers[k]
        fl = getattr(self.model, "forward_layer", None)
        outs = []
        for rows, blk in self.bins[name]:
            h_dst = h_src[rows]
            if isinstance(layer, GraphConv) and layer._norm != "none":
                saved = layer._norm
                layer._norm = "none"          # B6 #14: global-degree normalisation folded into edge weights
                try:
                    out = self._call(fl, k, layer, blk, h_src, h_dst,
                                     blk.edata[f"norm_{saved}"].to(h_src.dtype))
                finally:
                    layer._norm = saved
            else:
                out = self._call(fl, k, layer, blk, h_src, h_dst, None)
            outs.append(out)
        return outs

    def _call(self, fl, k, layer, blk, h_src, h_dst, w):
        if w is not None:
            h = layer(blk, (h_src, h_dst), edge_weight=w)
            if fl is not None:     # the model's post-processing without re-running the layer
                return _post(self.model, k, h)
            act = getattr(self.model, "activation", None)
            return act(h) if act is not None and k < len(self.model.layers) - 1 else h
        if fl is not None:
            return fl(k, blk, h_src, h_dst)
        h = layer(blk, (h_src, h_dst))
        act = getattr(self.model, "activation", None)
        return act(h) if act is not None and k < len(self.model.layers) - 1 else h

    def _assemble(self, outs: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat(outs)[self._inv]

    # -- forward / train -----------------------------------------------------------------------------------------
    def forward(self) -> torch.Tensor:
        """Logits of this rank's nodes (rows in ``self.local_ids`` order)."""
        L = len(self.model.layers)
        h = self.x
        if self.cfg.schedule == "sequential" or self.world == 1:
            for k in range(L):
                full = self._halo0 if (k == 0 and self._halo0 is not None) else graph_allgather(h, self.exchange)
                outs = [o for name in ("A", "D", "C", "E") for o in self._run_bins(k, name, full if name in "CE"
                                                                                   else full[:self.n_local])]
                h = self._assemble(outs)
            return h
        pending = None if self._halo0 is not None else self.exchange.start(h)
        for k in range(L):
            outs_a = self._run_bins(k, "A", h)                          # ready boundary nodes first
            outs_d = self._run_bins(k, "D", h)                          # eager: overlaps the running exchange
            full = self._halo0 if pending is None else attach(h, pending, self.exchange)
            outs_c = self._run_bins(k, "C", full)
            pending = None
            bnd = outs_a + outs_c
            if k < L - 1 and bnd:                                       # inter-layer pipeline: send boundary now
                send = bnd[0].new_zeros((self.n_local, bnd[0].shape[1]))
                send[self._boundary_rows] = torch.cat(bnd).detach()
                pending = self.exchange.start(send)
            outs_e = self._run_bins(k, "E", full)
            h = self._assemble(outs_a + outs_d + outs_c + outs_e)
            if k < L - 1 and not bnd:                                   # nothing to send early: still receive
                pending = self.exchange.start(h)
        return h

    def _issue_ready(self, force: bool = False) -> None:
        """Issue layer all-reduces last layer first, each once all its gradients exist, so every rank issues the
        collectives in the same order (gloo matches collectives by order)."""
        while self._next_ar >= 0:
            params = self._layer_groups[self._next_ar]
            if not force and not self._ready[self._next_ar]:
                return
            for p in params:
                if p.grad is None:          # a layer this rank's loss did not reach still joins the all-reduce
                    p.grad = torch.zeros_like(p)
            flat = torch.cat([p.grad.reshape(-1) for p in params]) if params else torch.zeros(0)
            work = comm.all_reduce(flat, group=self.group, kind="dp", key=f"layer{self._next_ar}", async_op=True)
            self._pending_ar.append((params, flat, work))
            self._next_ar -= 1

    def _hook_layerwise_allreduce(self) -> list:
        """Async SUM all-reduce of a layer's gradients as soon as they are accumulated (B6 #12)."""
        self._ready = [False] * len(self._layer_groups)
        self._next_ar = len(self._layer_groups) - 1
        handles = []
        if self.world == 1:
            return handles
        for li, params in enumerate(self._layer_groups):
            left = {"n": len(params)}

            def hook(_p, left=left, li=li):
                left["n"] -= 1
                if left["n"] == 0:
                    self._ready[li] = True
                    self._issue_ready()

            handles += [p.register_post_accumulate_grad_hook(hook) for p in params]
        return handles

    def _finish_allreduce(self) -> None:
        if self.world > 1:
            self._issue_ready(force=True)
        for ps, flat, work in self._pending_ar:
            work.wait()
            off = 0
            for p in ps:
                p.grad.copy_(flat[off:off + p.numel()].view_as(p.grad))
                off += p.numel()
        self._pending_ar.clear()

    def loss(self, logits: torch.Tensor) -> torch.Tensor:
        m = self.masks["train_mask"]
        return F.cross_entropy(logits[m], self.y[m], reduction="sum") / self.n_train_global

    def backward(self, loss: torch.Tensor) -> None:
        """Backward with the reversed exchange plan and layer-wise gradient all-reduce (gradients are SUMmed:
        the loss is already normalised by the global train count)."""
        for p in self.model.parameters():
            p.grad = None
        handles = self._hook_layerwise_allreduce()
        try:
            loss.backward()
            self._finish_allreduce()
        finally:
            for h in handles:
                h.remove()

    def train_step(self, optimizer: torch.optim.Optimizer) -> float:
        """One epoch = one full-graph iteration: forward, loss, backward, one update. Returns the global loss."""
        self.model.train()
        logits = self.forward()
        loss = self.loss(logits)
        self.backward(loss)
        optimizer.step()
        out = loss.detach().clone()
        if self.world > 1:
            comm.all_reduce(out, group=self.group, kind="metric")
        return float(out)

    @torch.no_grad()
    def evaluate(self, mask: str = "val_mask") -> float:
        """Global accuracy on ``mask``."""
        self.model.eval()
        pred = self.forward().argmax(1)
        m = self.masks[mask]
        t = torch.tensor([float((pred[m] == self.y[m]).sum()), float(m.sum())])
        if self.world > 1:
            comm.all_reduce(t, group=self.group, kind="metric")
        return float(t[0] / t[1].clamp(min=1))

    def summary(self) -> dict:
        return {"rank": self.rank, "n_local": self.n_local, "n_remote": self.n_remote, "n_relay": self.tables.num_relay,
                "n_boundary": self.n_boundary, "bins": {k: len(v) for k, v in self.bins.items()},
                "bin_limit": self._bin_limit, "plan_method": self.plan.method, "plan_stages": self.plan.num_stages,
                "plan_transfers": self.plan.num_transfers,
                "plan_cost": self.plan.cost, "p2p_cost": self.plan.info.get("p2p_cost"),
                "config": asdict(self.cfg), "partition": self.part_stats}


def _post(model: torch.nn.Module, k: int, h: torch.Tensor) -> torch.Tensor:
    """Apply ``model.forward_layer``'s post-processing (activation, head reshaping) to an already computed output."""

    class _Given(torch.nn.Module):
        def forward(self, blk, feats):
            return h

    saved = model.layers[k]
    model.layers[k] = _Given()
    try:
        return model.forward_layer(k, None, None, None)
    finally:
        model.layers[k] = saved
