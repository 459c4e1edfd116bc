"""Full-graph distributed GNN training on DGL: G3 hybrid parallelism with DGCL-planned halo exchange.

Seeds: G3 (000 ch.4; digest part B) and DGCL (001). Input: a whole graph in memory (small graphs; rank 0 partitions
it) or DistDGL's partitioning (``dgl.distributed.partition_graph`` output), of which each rank loads only its own
partition (:func:`load_local_partition`: inner nodes, halo, in-edges; the relation comes from the partition book and
an all-gather of halo ids). Models: ``forward_layer`` models, or DGL-style models whose own ``forward`` runs with each
graph layer computed distributedly (:func:`check_model`, in :mod:`dgl_plugin.g3_model_check`, proves at install that
this is the user's function, or refuses the model). Per rank (digest B2.8):
- data parallel: the graph is partitioned (G3 partitioner: METIS + Algorithm 2); a rank owns ``V_i`` and computes
  only their rows, on the in-edges of ``V_i`` (halo = remote in-neighbours, B6 #1);
- model parallel: before every layer, the halo rows of the previous layer's output arrive through
  :func:`flowlane.plan.graph_allgather` (SPST or peer-to-peer plan; backward returns gradients along the reversed plan);
- pipeline: nodes are ordered boundary-first after a BFS (§4.4.3 step 1), split into groups by whether they are sent to
  other ranks (boundary) and whether they need halo rows, and packed into bins of at most ``bin_size`` nodes (step 2, B6
  #8) and, with ``mem_budget_bytes``, of at most half the budget by estimate, each recomputed in backward (§4.4.1;
  :mod:`dgl_plugin.g3_bins`). ``schedule="pipelined"`` computes, per layer: ready boundary bins, ready interior bins
  (eager: no halo needed, overlapping the previous exchange), waits for the halo, halo boundary bins, *starts sending
  the boundary outputs* (inter-layer pipeline), then the halo interior bins while the exchange runs. Departure from
  the seed (B2.2 step 3, B2.6 "start sending as early as possible"): the seed sends each bin's output as soon as the
  bin finishes; here a layer's boundary outputs (all A and C bins) leave together, once the C bins are done, because
  the halo exchange is one planned :func:`graph_allgather` per layer (a DGCL plan of relays and stages over every
  boundary row), which cannot start on part of the rows; per-bin sends would need a plan per bin. ``"sequential"``
  exchanges, then computes every bin (the seed's "Sequential" variant). Backward, pipelined (``pipeline_backward``): a
  layer's halo-gradient exchange runs in the background while the bins that do not need its result compute their
  backward; the returned rows are added where first needed;
- parameter sync: layer-wise asynchronous all-reduce (SUM) as each layer's gradients are accumulated, one optimizer
  step per epoch (B6 #12): one group per graph layer and one for the parameters outside them, trainable ones only,
  issued in the order a probe backward accumulates them (the same on every rank, which gloo needs); the loss is
  Σ local CE / global #train nodes, so gradients equal single-process training exactly (B6 #13).

Open decisions (digest B6), decided here: #1 symmetrised partitioning, in-neighbour halos; #2 stage 1 balances node
count and in-edges |E(V_i)|; #4 ``cache_halo_inputs`` (default False: layer-1 halo features are resent every epoch);
#8 bin limit = bin_size, and with a budget M the estimate of g3_bins.bin_bytes <= M / 2 (widest layer, forward and
backward, GAT attention per edge; one bin layout for every layer, a departure from the seed's per-layer limit, see
g3_bins); #9 a bin launches when full or when no more ready nodes exist (bins are built statically from the groups
above); #10 boundary group first, stable BFS order inside; #11
backward runs the autograd graph in reverse (bins reversed) and exchanges gradients along the reversed DGCL plan, all
remote contributions summed before use (fp32); #12 per-layer async all-reduce, no coordinator thread; #13 global-count
loss normalisation; #14 GCN normalisation uses global degrees (folded into edge weights); #15 GAT shares ``h`` and
computes attention at the destination; #16 exactness tests use no dropout; #18 torch.distributed isend/irecv through
flowlane.comm.
"""

from __future__ import annotations

import datetime
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import dgl
import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from flowlane import comm
from flowlane import topology as topo_mod
from flowlane.direct import DirectConfig, FeatureStore
from flowlane.plan import (
    CommRelation,
    GradSlot,
    GraphExchange,
    LinkModel,
    add_deferred_grad,
    attach,
    build_plan,
    compile_tables,
    full_mesh,
    graph_allgather,
)

from .g3_bins import bin_bytes, pack_bins
from .g3_model_check import (  # check_model & co. stay importable from here too
    ModelContractError,
    NoGraph,
    bin_block,
    check_layer0_takes_features,
    check_model,
    gcn_norms,
    grad_ready_order,
    layer_on_block,
    layer_widths,
    restore_layers,
    swap_layers,
)
from .g3_partition import STAGE1, g3_partition

log = logging.getLogger("flowlane.g3")

PARTITIONERS = ("g3", *STAGE1)
SCHEDULES = ("sequential", "pipelined")


@dataclass
class FullGraphConfig:
    """The DGL config option ``flowlane.fullgraph`` (one section of a recipe; every field is validated)."""

    partition: Literal["g3", "metis", "pymetis", "dgl-metis", "random", "chunk"] = "g3"
    """g3 = multi-constraint METIS (objtype, seeded) + Algorithm 2 (checked variant: lowers the largest
    |V_i^remote|, Eq. 4.4) to ``gamma``; others: stage 1 only (metis = pymetis, seeded; dgl-metis: DGL's, no seed)."""
    gamma: float = 0.005
    """Algorithm 2 convergence: stop when (max - min) / max of |V_i^remote| <= gamma (seed: 0.5 %)."""
    objtype: Literal["vol", "cut"] = "cut"
    """METIS objective: edge cut, or total communication volume (closest to Eq. 4.3). Both keep the two balances
    (nodes, in-edges) within 1.03; after Algorithm 2 cut left the lower largest |V_i^remote| at 8 and 16 parts on a
    20k-node synthetic graph, so cut is the default (:mod:`dgl_plugin.g3_partition`)."""
    comm_plan: Literal["spst", "p2p", "auto"] = "auto"
    """DGCL planner for the halo exchange; auto = SPST unless peer-to-peer is cheaper under the cost model."""
    topology: str = "full_mesh"
    """Topology the planner models: "full_mesh" (uniform links) or a flowlane.topology preset name."""
    topology_kwargs: dict = field(default_factory=dict)
    devices: list | None = None
    """Topology endpoints the ranks run on (default: its first world-size endpoints)."""
    schedule: Literal["sequential", "pipelined"] = "pipelined"
    pipeline_backward: bool | None = None
    """Backward gradient exchange in the background (G3 §4.4.3 in reverse): a layer's halo-gradient exchange runs
    while the bins that do not need it compute their backward (this layer's ready bins, and with ``forward_layer``
    models also the previous layer's halo-interior bins); the returned gradients are added where first needed.
    None: on with ``schedule="pipelined"``, off with "sequential" (True with "sequential" is refused)."""
    bin_size: int | None = None
    """Bin size in nodes; None (default): one bin per group. The seed launches bins of 1000 nodes (DGL's batch size)
    as GPU work units; here a group's bins run back to back in one thread and the exchange overlaps whole groups, so
    smaller bins add only per-bin cost: a 2-layer SAGE step on one CPU thread took 4.1x as long with bins of 1000 as
    with one bin per group at 125k nodes per rank (results/g3/bin_cost.json; 17.6x before blocks were compacted,
    measured at f4f923d's parent, no result JSON). Set it to mimic the seed."""
    mem_budget_bytes: float | None = None
    """Device memory budget M in bytes (§4.4.1, B2.5; B6 #8), or None (no cap). Each bin is packed to at most M / 2
    by the estimate of :func:`dgl_plugin.g3_bins.bin_bytes` (and to ``bin_size`` nodes), every group is compacted, and
    every bin of every layer is recomputed in backward (its forward keeps only its output), so the working set
    beyond the layer tensors (inputs and outputs, which the seed keeps in host memory) is about one bin, not the
    partition's activations. A node that alone exceeds M / 2 is refused at install."""
    cache_halo_inputs: bool = False
    """Fetch layer-0 halo features once instead of every epoch (B6 #4)."""
    emulate_bandwidth: float | None = None
    """Benchmarks only: emulated per-peer link speed (bytes/s) for the halo exchange."""
    device: str = "auto"
    """Where blocks, features, the model and the exchange buffers live: "auto" (CUDA when present and DGL is a CUDA
    build, else CPU), "cpu", "cuda" or "cuda:<index>" ("cuda" picks the rank's local device; refused when DGL has no
    CUDA support, as PyPI's dgl 2.1.0 wheels have not)."""
    features: Literal["device", "host"] = "device"
    """Where the input features (layer 0's input) live. "device": copied to ``device`` once. "host": PyTorch-Direct
    (seed 003 ch.4): the partition's table stays in host memory, pinned in place, and each bin gathers the rows it
    reads (zero-copy on CUDA, CPU gather elsewhere; :mod:`flowlane.direct`); layer 0 is recomputed in backward from
    a second gather, so neither the table nor layer 0's inputs are held in device memory. Layer-0 halo rows are
    sent from the host table. Needs compacted bins (used for every group) and a halo exchange that moves host
    tensors (gloo, or a CPU device)."""
    direct: dict = field(default_factory=dict)
    """``features="host"``: :class:`flowlane.direct.DirectConfig` keys (path, aligned, sort_indices, ...)."""
    seed: int = 0
    """Seed of the stage-1 partitioner (METIS / random) and of the planner."""

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
        if self.pipeline_backward not in (None, True, False):
            bad("pipeline_backward", self.pipeline_backward, "choose True, False or None")
        if self.pipeline_backward and self.schedule != "pipelined":
            bad(
                "pipeline_backward",
                self.pipeline_backward,
                f"needs schedule='pipelined' (schedule={self.schedule!r} exchanges before computing)",
            )
        if self.bin_size is not None and (
            not isinstance(self.bin_size, int) or isinstance(self.bin_size, bool) or self.bin_size < 1
        ):
            bad("bin_size", self.bin_size, "must be an integer >= 1, or None for one bin per group")
        if self.mem_budget_bytes is not None and (
            isinstance(self.mem_budget_bytes, bool)
            or not isinstance(self.mem_budget_bytes, int | float)
            or not self.mem_budget_bytes > 0
        ):
            bad(
                "mem_budget_bytes", self.mem_budget_bytes, "must be a number of bytes > 0, or None for no cap"
            )
        if self.emulate_bandwidth is not None and not self.emulate_bandwidth > 0:
            bad("emulate_bandwidth", self.emulate_bandwidth, "must be > 0 bytes/s or None")
        if world < 1:
            bad("world size", world, "must be >= 1")
        dev = self.device
        if not isinstance(dev, str) or not (
            dev in ("auto", "cpu", "cuda") or (dev.startswith("cuda:") and dev[5:].isdigit())
        ):
            bad("device", dev, "choose 'auto', 'cpu', 'cuda' or 'cuda:<index>'")
        if dev.startswith("cuda") and not torch.cuda.is_available():
            bad("device", dev, "CUDA is not available here; use 'auto' or 'cpu'")
        if dev.startswith("cuda") and not dgl_has_cuda():
            bad(
                "device",
                dev,
                f"this DGL build ({dgl.__version__}) has no CUDA support (PyPI's dgl wheels are CPU-only); use "
                f"'cpu', or 'auto' (CPU then), or install a CUDA build of DGL",
            )
        if self.features not in ("device", "host"):
            bad("features", self.features, "choose 'device' or 'host'")
        if not isinstance(self.direct, dict):
            bad("direct", self.direct, "must be a mapping of flowlane.direct.DirectConfig keys")
        if self.direct and self.features != "host":
            bad("direct", self.direct, "applies to features='host' only")
        try:
            self.direct_config()
        except (TypeError, ValueError) as e:
            bad("direct", self.direct, str(e))

    def direct_config(self) -> DirectConfig:
        """The feature store's config (``features="host"``). Indices are the runtime's own, so they are not
        re-checked per gather unless ``check_indices`` is set."""
        return DirectConfig.from_dict({"check_indices": False, **self.direct})

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
        raise ValueError(
            f"ndata[{feat!r}] must be a 2-D float tensor, got shape {tuple(x.shape)} dtype {x.dtype}"
        )
    if not torch.isfinite(x).all():
        raise ValueError(f"ndata[{feat!r}] contains NaN or inf")
    y = g.ndata[label]
    if y.dim() != 1 or torch.is_floating_point(y) or (y.numel() and y.min() < 0):
        raise ValueError(
            f"ndata[{label!r}] must be a 1-D non-negative integer tensor, got {y.dtype} {tuple(y.shape)}"
        )


@dataclass
class LocalPartition:
    """One rank's share of the graph, as DistDGL's ``load_partition`` gives it: the inner nodes, the halo (remote
    in-neighbours of inner nodes) and every in-edge of the inner nodes. Nothing here grows with the whole graph except
    ``relation.owner`` (one integer per node, derived from the partition book)."""

    inner_ids: np.ndarray
    """Global ids of the nodes this rank owns, in the partition's row order."""
    halo_ids: np.ndarray
    """Sorted global ids of the remote in-neighbours of inner nodes (``relation.needs[rank]``)."""
    e_src: np.ndarray
    """Source row of every in-edge of an inner node, in ``[inner | halo]`` row space."""
    e_dst: np.ndarray
    """Destination row (an inner row) of every in-edge."""
    x: torch.Tensor
    y: torch.Tensor
    masks: dict
    """``train_mask`` (required), ``val_mask``, ``test_mask`` of the inner rows (bool)."""
    n_train_global: int
    relation: CommRelation
    """Owner of every node and the halo of every rank (DGCL relation), built from partition books."""
    out_deg: np.ndarray | None = None
    """Global out-degree of the ``[inner | halo]`` rows; None: computed by one exchange at setup."""
    stats: dict = field(default_factory=dict)


def local_from_graph(
    g: dgl.DGLGraph, part: np.ndarray, rank: int, world: int, feat: str = "feat", label: str = "label"
) -> LocalPartition:
    """The in-memory path (small graphs): cut rank ``rank``'s partition out of the whole graph ``g``."""
    n = g.num_nodes()
    src, dst = (t.numpy().astype(np.int64) for t in g.edges())
    rel = CommRelation.from_edges(src, dst, part, world)
    inner = np.nonzero(part == rank)[0]
    halo = rel.needs[rank]
    pos = np.full(n, -1, np.int64)
    pos[inner] = np.arange(inner.size)
    pos[halo] = inner.size + np.arange(halo.size)
    mine = part[dst] == rank
    out_deg = np.bincount(src, minlength=n).astype(np.float64)
    lid = torch.from_numpy(inner)
    masks = {k: g.ndata[k][lid].bool() for k in ("train_mask", "val_mask", "test_mask") if k in g.ndata}
    return LocalPartition(
        inner,
        halo,
        pos[src[mine]],
        pos[dst[mine]],
        g.ndata[feat][lid],
        g.ndata[label][lid],
        masks,
        int(g.ndata["train_mask"].sum()),
        rel,
        out_deg[np.concatenate([inner, halo])],
    )


def load_local_partition(
    part_config: str,
    rank: int,
    world: int,
    group: dist.ProcessGroup | None = None,
    feat: str = "feat",
    label: str = "label",
) -> LocalPartition:
    """Load only partition ``rank`` of a ``dgl.distributed.partition_graph`` output (``part_config``: its JSON) and
    build the exchange relation from the partition book plus every rank's halo list (one all-gather of halo ids).
    Collective when ``world > 1``."""
    import json
    import os

    if not isinstance(part_config, str) or not os.path.isfile(part_config):
        raise FileNotFoundError(
            f"part_config={part_config!r} is not a file (give the JSON written by "
            f"dgl.distributed.partition_graph)"
        )
    with open(part_config) as f:
        meta = json.load(f)
    n_parts = int(meta.get("num_parts", -1))
    if n_parts != world:
        raise ValueError(
            f"part_config={part_config!r} has num_parts={n_parts} but world_size={world}: one rank per "
            f"partition (repartition with dgl.distributed.partition_graph(..., num_parts={world}))"
        )
    lg, node_feats, _ef, gpb, *_ = dgl.distributed.load_partition(part_config, rank)
    if not gpb.is_homogeneous:
        raise ValueError(
            f"part_config={part_config!r}: graph must be homogeneous, got node types {gpb.ntypes}"
        )
    nt = gpb.ntypes[0]

    def nf(key: str) -> torch.Tensor | None:
        return node_feats.get(f"{nt}/{key}", node_feats.get(key))

    for key in (feat, label, "train_mask"):
        if nf(key) is None:
            raise ValueError(
                f"part_config={part_config!r}: partition {rank} has no node data {key!r}; has "
                f"{sorted(node_feats)} (partition a graph whose ndata holds {feat}, {label}, train_mask)"
            )
    is_inner = lg.ndata["inner_node"].bool().numpy()
    n_inner = int(is_inner.sum())
    if not is_inner[:n_inner].all():
        raise ValueError(f"part_config={part_config!r}: inner nodes of partition {rank} are not listed first")
    gid = lg.ndata[dgl.NID].numpy().astype(np.int64)
    ls, ld = (t.numpy().astype(np.int64) for t in lg.edges())
    keep = ld < n_inner  # in-edges of inner nodes (the partition also holds halo edges)
    ls, ld = ls[keep], ld[keep]
    halo_rows = np.unique(ls[ls >= n_inner])
    halo_ids = gid[halo_rows]
    order = np.argsort(halo_ids)
    halo_ids, halo_rows = halo_ids[order], halo_rows[order]
    pos = np.full(lg.num_nodes(), -1, np.int64)
    pos[:n_inner] = np.arange(n_inner)
    pos[halo_rows] = n_inner + np.arange(halo_rows.size)
    num_nodes = int(meta["num_nodes"])
    owner = gpb.nid2partid(torch.arange(num_nodes)).numpy().astype(np.int64)
    needs = comm.all_gather_object(halo_ids, group=group) if world > 1 else [halo_ids]
    rel = CommRelation(owner, tuple(np.asarray(x, np.int64) for x in needs))
    masks = {k: nf(k).bool() for k in ("train_mask", "val_mask", "test_mask") if nf(k) is not None}
    n_train = torch.tensor([float(masks["train_mask"].sum())], dtype=torch.float64)
    if world > 1:
        n_train = n_train.to(collective_device(group))
        comm.all_reduce(n_train, group=group, kind="setup")
    return LocalPartition(
        gid[:n_inner],
        halo_ids,
        pos[ls],
        ld,
        nf(feat),
        nf(label),
        masks,
        int(n_train.item()),
        rel,
        None,
        {"part_config": part_config, "n_halo_loaded": int((~is_inner).sum())},
    )


def _bfs_boundary_first(
    n_inner: int, e_src: np.ndarray, e_dst: np.ndarray, boundary: np.ndarray
) -> np.ndarray:
    """§4.4.3 step 1: BFS over the partition's inner nodes (edges taken both ways) from every component, then boundary
    nodes first (stable). Returns inner row indices."""
    inner = e_src < n_inner
    a = np.concatenate([e_src[inner], e_dst[inner]])
    b = np.concatenate([e_dst[inner], e_src[inner]])
    order_e = np.argsort(a, kind="stable")
    a, b = a[order_e], b[order_e]
    indptr = np.searchsorted(a, np.arange(n_inner + 1))
    seen = np.zeros(n_inner, bool)
    order: list[int] = []
    for s in range(n_inner):
        if seen[s]:
            continue
        seen[s] = True
        q = deque([s])
        while q:
            v = q.popleft()
            order.append(v)
            for w in b[indptr[v] : indptr[v + 1]].tolist():
                if not seen[w]:
                    seen[w] = True
                    q.append(w)
    arr = np.asarray(order, np.int64)
    is_b = boundary[arr]
    return np.concatenate([arr[is_b], arr[~is_b]])


class _HostRows:
    """Layer 0's input with ``features="host"``: this rank's rows in a :class:`FeatureStore` (host memory) and, once
    they have arrived, the halo rows on the device. Stands where a ``[local | halo]`` tensor would."""

    def __init__(self, store: FeatureStore, halo: torch.Tensor | None = None) -> None:
        self.store, self.halo = store, halo

    def with_halo(self, full: torch.Tensor, device: torch.device) -> _HostRows:
        """The same rows plus the halo part of an exchange result ``[local | halo]``."""
        return _HostRows(self.store, full[self.store.num_rows :].to(device))

    def take(self, ids: torch.Tensor, n_local_ids: int) -> torch.Tensor:
        """Rows ``ids`` (sorted: the first ``n_local_ids`` are this rank's rows, the rest halo rows)."""
        local = self.store.gather(ids[:n_local_ids])
        if n_local_ids == ids.numel():
            return local
        if self.halo is None:
            raise RuntimeError("a bin reads halo rows before the halo exchange finished (a runtime bug)")
        return torch.cat([local, self.halo[ids[n_local_ids:] - self.store.num_rows]])


class _RowGrads:
    """The gradient of a layer input's rows, summed over the bins that gathered them (B2.8: ``g[k-1][u] +=``)."""

    def __init__(self, like: torch.Tensor) -> None:
        self.shape, self.grad = like.shape, None

    def add(self, ids: torch.Tensor, g: torch.Tensor) -> None:
        if self.grad is None:
            self.grad = g.new_zeros(self.shape)
        self.grad.index_add_(0, ids, g)


class _RowsWithGradBuffer(torch.autograd.Function):
    """``h`` unchanged; its gradient is what the bins' :func:`_gather_rows` added into ``acc`` (they return none)."""

    @staticmethod
    def forward(ctx: Any, h: torch.Tensor, acc: _RowGrads) -> torch.Tensor:
        ctx.acc = acc
        ctx.set_materialize_grads(False)
        return h.view_as(h)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor | None) -> tuple:
        out, ctx.acc.grad = ctx.acc.grad, None
        if grad is not None:  # ``h`` was also used outside the bins
            out = grad if out is None else out.add_(grad)  # the buffer is the runtime's own: added in place
        return out, None


class _GatherRows(torch.autograd.Function):
    """``h[ids]``, whose backward adds the rows' gradient into ``acc`` and returns none for ``h``."""

    @staticmethod
    def forward(ctx: Any, h: torch.Tensor, ids: torch.Tensor, acc: _RowGrads) -> torch.Tensor:
        ctx.save_for_backward(ids)
        ctx.acc = acc
        return h[ids]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        (ids,) = ctx.saved_tensors
        ctx.acc.add(ids, grad)
        return None, None, None


def _gather_rows(h: torch.Tensor, ids: torch.Tensor, acc: _RowGrads) -> torch.Tensor:
    """``h[ids]``; in backward the rows' gradient goes into ``acc`` (a bin's worth), not into a new tensor of every
    row of ``h``."""
    return _GatherRows.apply(h, ids, acc) if h.requires_grad else h[ids]


def dgl_has_cuda() -> bool:
    """Whether DGL can put graphs on a GPU here: torch sees one and this DGL build has CUDA (PyPI's dgl 2.1.0 wheels,
    the gnn lane's pin, are CPU-only: there a block on CUDA fails at its first use)."""
    return torch.cuda.is_available() and bool(dgl.ndarray.gpu(0).exist)


def resolve_device(name: str) -> torch.device:
    """``auto``: the rank's local CUDA device when DGL can use it (:func:`dgl_has_cuda`), else CPU (``LOCAL_RANK``
    picks the index)."""
    import os

    if name == "auto":
        name = "cuda" if dgl_has_cuda() else "cpu"
    if name == "cuda":
        idx = int(os.environ.get("LOCAL_RANK", dist.get_rank() if dist.is_initialized() else 0))
        return torch.device("cuda", idx % max(torch.cuda.device_count(), 1))
    return torch.device(name)


def collective_backend(device: str) -> str:
    """The torch.distributed backend for ranks started by an external launcher with ``device`` (a
    :class:`FullGraphConfig` value): nccl when the runtime computes on CUDA, else gloo (nccl moves CUDA tensors
    only)."""
    return "nccl" if resolve_device(device).type == "cuda" else "gloo"


def group_timeout(group: dist.ProcessGroup | None = None) -> datetime.timedelta | None:
    """The op timeout ``group`` (default: the world, as the launcher set it up) was created with, for groups made
    from its ranks; None (torch's default) where the backend does not expose it."""
    pg = dist.GroupMember.WORLD if group is None else group
    dev = torch.device("cuda" if dist.get_backend(pg) == "nccl" else "cpu")
    try:
        timeout = pg._get_backend(dev).options._timeout  # no public getter in torch 2.2 - 2.x
    except (AttributeError, RuntimeError):
        timeout = None
    if not isinstance(timeout, datetime.timedelta):  # said, not silent: the halo group then waits 30 minutes
        log.warning(
            "G3: this torch does not expose the process group's timeout; the halo group gets torch's default"
        )
        return None
    return timeout


def collective_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """Where a setup or metric tensor for a collective on ``group`` must live: this rank's CUDA device on nccl,
    else CPU."""
    if dist.is_initialized() and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class FullGraphRuntime:
    """One rank of hybrid-parallel full-graph training. Collective: construct on every rank of ``group``.

    ``source``: a whole ``dgl.DGLGraph`` (in-memory path for small graphs: partitioned here on rank 0, or by ``part``)
    or this rank's :class:`LocalPartition` (e.g. from :func:`load_local_partition` on ``partition_graph`` output).
    The model is moved to ``cfg.device``."""

    def __init__(
        self,
        source: dgl.DGLGraph | LocalPartition,
        model: torch.nn.Module,
        cfg: FullGraphConfig | None = None,
        feat: str = "feat",
        label: str = "label",
        group: dist.ProcessGroup | None = None,
        part: np.ndarray | None = None,
    ) -> None:
        self.cfg = cfg = cfg or FullGraphConfig()
        self.group = group
        self.rank = dist.get_rank(group) if dist.is_initialized() else 0
        self.world = dist.get_world_size(group) if dist.is_initialized() else 1
        cfg.validate(self.world)
        self.part_stats: dict = {}
        lp = self._local_partition(source, part, feat, label)
        x = lp.x
        if x.dim() != 2 or not torch.is_floating_point(x):
            raise ValueError(
                f"node features must be a 2-D float tensor, got shape {tuple(x.shape)} dtype {x.dtype}"
            )
        self.mode = check_model(model, x.shape[1], x.dtype)
        if cfg.features == "host" and self.mode == "forward":
            check_layer0_takes_features(model, x.shape[1], x.dtype)
        self.device = resolve_device(cfg.device)
        self.model = model.to(self.device)
        self.n_local = lp.inner_ids.size
        order, e_src, e_dst = self._order_rows(lp)
        self._xgroup: dist.ProcessGroup | None = None
        self.store: FeatureStore | None = None
        try:
            xgroup = self._plan_exchange(lp.relation)
            norms = self._edge_norms(lp, order, e_src, e_dst, xgroup)
            self._build_bins(e_src, e_dst, norms, model, x)
            self._index_bin_rows()
            self._load_rows(lp, order, xgroup)
            # the layer-wise all-reduces' order (B6 #12): local, the same on every rank
            self._ready_pos = grad_ready_order(model, x.shape[1]) if self.world > 1 else {}
        except BaseException:
            # a failed constructor returns no runtime to close(): release what it made (the exchange's group keeps
            # threads and a socket per peer; the store may hold the feature table pinned), then re-raise
            self._release()
            raise
        # layer-wise all-reduce groups (B6 #12): each graph layer's parameters (one held by two layers belongs to the
        # first), and those outside the graph layers (a head, an input projection) as one more group, "rest"
        self._layer_groups: list[tuple[str, list[torch.nn.Parameter]]] = []
        seen: set[int] = set()
        for i, layer in enumerate(model.layers):
            ps = [p for p in layer.parameters() if id(p) not in seen]
            seen.update(map(id, ps))
            self._layer_groups.append((f"layer{i}", ps))
        rest = [p for p in model.parameters() if id(p) not in seen]
        if rest:
            self._layer_groups.append(("rest", rest))
        self._param_names = {id(p): n for n, p in model.named_parameters()}
        self._ar_groups: list[tuple[str, list[torch.nn.Parameter]]] = []
        self._pending_ar: list = []
        log.info(
            "G3 rank %d/%d on %s: %d nodes (%d boundary), %d halo rows, %s plan, %s schedule, bins %s",
            self.rank,
            self.world,
            self.device,
            self.n_local,
            self.n_boundary,
            self.n_remote,
            self.plan.method,
            cfg.schedule,
            {k: len(v) for k, v in self.bins.items()},
        )
        budget = cfg.mem_budget_bytes
        if budget is not None:
            log.info(
                "G3 memory budget %.0f bytes: bins of at most %.0f by estimate (largest %d), each recomputed in "
                "backward; the layer tensors stay on %s",
                budget,
                budget / 2,
                max(self.bin_bytes, default=0),
                self.device,
            )

    def close(self) -> None:
        """Destroy the halo exchange's own process group (a gloo group keeps its threads and a socket per peer: a
        process that builds runtime after runtime, as a sweep does, would gain them with each). Collective: every
        rank of ``group`` calls it, after its last step (a barrier first, so no peer still uses the group). The
        runtime cannot exchange afterwards; a second call does nothing."""
        xgroup, self._xgroup = self._xgroup, None
        if xgroup is None:
            return
        dist.barrier(group=self.group)
        dist.destroy_process_group(xgroup)

    def _release(self) -> None:
        """Destroy the exchange group and close the feature store, without a barrier (a failed constructor: the
        peers fail at the same step, or get a closed connection, not a hang)."""
        store, self.store = self.store, None
        if store is not None:
            store.close()
        xgroup, self._xgroup = self._xgroup, None
        if xgroup is not None:
            dist.destroy_process_group(xgroup)

    def __enter__(self) -> FullGraphRuntime:
        return self

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        # after an error a peer may still be blocked in the group: it is left to the launcher's teardown
        if exc_type is None:
            self.close()

    # -- construction steps, in order -----------------------------------------------------------------------------
    def _local_partition(
        self, source: dgl.DGLGraph | LocalPartition, part: np.ndarray | None, feat: str, label: str
    ) -> LocalPartition:
        """This rank's partition: the one given, or cut from a whole graph by ``part`` or by the seed's partitioner
        (G3's two-stage METIS, §4.4.2) run on rank 0 and broadcast."""
        cfg, group = self.cfg, self.group
        if isinstance(source, LocalPartition):
            if part is not None:
                raise ValueError("part= applies to a whole graph, not to a LocalPartition")
            if source.relation.num_ranks != self.world:
                raise ValueError(
                    f"the partition was made for {source.relation.num_ranks} ranks, world size is {self.world}"
                )
            self.part = None  # a rank that loaded its partition has no whole-graph assignment
            return source
        check_graph(source, feat, label)
        n = source.num_nodes()
        if part is None:
            part_t = torch.zeros(n, dtype=torch.int64)
            if self.rank == 0:
                src, dst = (t.numpy().astype(np.int64) for t in source.edges())
                method = "metis" if cfg.partition == "g3" else cfg.partition
                p, stats = g3_partition(
                    src,
                    dst,
                    n,
                    self.world,
                    cfg.gamma,
                    method,
                    cfg.objtype,
                    refine_stage2=cfg.partition == "g3",
                    seed=cfg.seed,
                )
                part_t = torch.from_numpy(p)
                self.part_stats = stats.as_dict()
            if self.world > 1:
                part_t = part_t.to(collective_device(group))
                comm.broadcast(part_t, 0, group=group, kind="setup")
            part = part_t.cpu().numpy()
        part = np.asarray(part, np.int64)
        if part.shape != (n,) or part.min() < 0 or part.max() >= self.world:
            raise ValueError(f"partition must assign each of the {n} nodes a rank in [0, {self.world})")
        self.part = part  # the whole graph's assignment
        return local_from_graph(source, part, self.rank, self.world, feat, label)

    def _order_rows(self, lp: LocalPartition) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Boundary rows (sent to other ranks) first, in BFS order (§4.4.3 step 1): the row order, and the edges'
        source and destination rows in it (halo rows keep their indices past ``n_local``)."""
        rel = lp.relation
        others = [ids for r, ids in enumerate(rel.needs) if r != self.rank]
        boundary = np.isin(lp.inner_ids, np.concatenate(others)) if others else np.zeros(self.n_local, bool)
        order = _bfs_boundary_first(self.n_local, lp.e_src, lp.e_dst, boundary)
        inv = np.empty(self.n_local, np.int64)
        inv[order] = np.arange(self.n_local)
        self.local_ids = lp.inner_ids[order]
        self.n_boundary = int(boundary.sum())
        e_dst = inv[lp.e_dst]
        e_src = np.where(lp.e_src < self.n_local, inv[np.minimum(lp.e_src, self.n_local - 1)], lp.e_src)
        return order, e_src, e_dst

    def _plan_exchange(self, rel: CommRelation) -> dist.ProcessGroup | None:
        """The DGCL plan (the same seeded planner on every rank; digests compared), this rank's tables and the halo
        exchange; returns the exchange's own process group."""
        cfg, group = self.cfg, self.group
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
        owner = np.asarray(rel.owner)
        local_ids = [
            self.local_ids if r == self.rank else np.nonzero(owner == r)[0] for r in range(self.world)
        ]
        self.tables = compile_tables(self.plan, rel, local_ids)[self.rank]
        # The halo exchange gets its own process group: its p2p ops run on a helper thread (pipelined schedule)
        # while layer all-reduces are in flight, and gloo only orders ops within one group, so sharing a group
        # lets the two streams interleave differently on different ranks (a timing-dependent hang).
        xgroup = None
        if self.world > 1:
            ranks = (
                list(range(dist.get_world_size())) if group is None else dist.get_process_group_ranks(group)
            )
            # kept at once: a failure later in the constructor destroys it (_release); it inherits the op timeout
            # of the runtime's group (the launch's), not torch's 30-minute default: a dead peer fails the exchange
            # as soon as any other collective
            xgroup = self._xgroup = dist.new_group(ranks, timeout=group_timeout(group))
        self.exchange = GraphExchange(self.tables, group=xgroup, emulate_bandwidth=cfg.emulate_bandwidth)
        # gloo moves CPU tensors only: with a CUDA device on gloo the exchange stages through host memory
        self._host_exchange = (
            self.device.type != "cpu" and self.world > 1 and dist.get_backend(xgroup) == "gloo"
        )
        self.n_remote = self.tables.num_remote
        return xgroup

    def _edge_norms(
        self, lp: LocalPartition, order: np.ndarray, e_src: np.ndarray, e_dst: np.ndarray, xgroup: Any
    ) -> dict[str, np.ndarray]:
        """Per-edge GCN normalisations from global degrees (B6 #14): in-degree = local in-edges (all present);
        out-degree of halo rows needs the owners' totals: partial counts summed along the reversed plan, then sent
        forward."""
        in_deg = np.bincount(e_dst, minlength=self.n_local).clip(min=1).astype(np.float64)
        if lp.out_deg is not None:
            full_out = np.concatenate([lp.out_deg[: self.n_local][order], lp.out_deg[self.n_local :]])
        else:
            full_out = self._global_out_degree(e_src, xgroup)
        return gcn_norms(in_deg, full_out.clip(min=1), e_src, e_dst)

    def _build_bins(
        self,
        e_src: np.ndarray,
        e_dst: np.ndarray,
        norms: dict[str, np.ndarray],
        model: torch.nn.Module,
        x: torch.Tensor,
    ) -> None:
        """The four groups of rows and their bins (§4.4.3 steps 2-3): each bin a DGL block over the in-edges of its
        destination rows, carrying the edges' normalisations."""
        cfg = self.cfg
        needs_halo = np.zeros(self.n_local, bool)
        needs_halo[e_dst[e_src >= self.n_local]] = True
        is_b = np.arange(self.n_local) < self.n_boundary
        groups = {
            "A": is_b & ~needs_halo,
            "D": ~is_b & ~needs_halo,
            "C": is_b & needs_halo,
            "E": ~is_b & needs_halo,
        }
        d_in = x.shape[1]
        eo = np.argsort(e_dst, kind="stable")
        e_src, e_dst = e_src[eo], e_dst[eo]
        norms_t = {k: torch.from_numpy(v[eo]).to(x.dtype) for k, v in norms.items()}
        eptr = np.searchsorted(e_dst, np.arange(self.n_local + 1))
        self.avg_in_degree = float(e_dst.size / max(self.n_local, 1))
        self.bins: dict[str, list] = {k: [] for k in groups}
        # A group of several bins: each bin's block holds only the source rows its edges read (compacted, as DGL's
        # to_block makes them) and the group gathers all its bins' source and destination rows with one index each.
        # A block over every source row makes each bin cost O(rows of the partition) (DGL's SAGEConv and GraphConv
        # apply their weight to every source row when it narrows the features; backward makes a dense gradient per
        # bin): 17.6x the step time of a single bin at 125k nodes per rank with bins of 1000 (measured at f4f923d's
        # parent, no result JSON), 4.1x compacted (results/g3/bin_cost.json; docs/g3.md "Bins"). A group
        # of one bin keeps the block over every row (no gather).
        # With host features every group is compacted: a bin then gathers exactly the input rows it reads.
        self._gather: dict[str, tuple[torch.Tensor, list[int], torch.Tensor] | None] = {}
        self._n_local_src: dict[str, list[int]] = {}
        """Per bin of a compacted group: how many of its (sorted) source rows are this rank's, not halo rows."""
        self._bin_limit = self._limit(d_in)
        host = cfg.features == "host"
        budget = cfg.mem_budget_bytes
        self.widths = layer_widths(model, d_in, x.dtype) if budget is not None else []
        self.bin_bytes: list[int] = []
        """``mem_budget_bytes``: the estimate of every bin (:func:`g3_bins.bin_bytes`), each <= budget / 2."""
        splits = self._split_bins(groups, eptr, e_src, x.element_size())
        for name, mask in groups.items():
            rows = np.nonzero(mask)[0]
            # a budget recomputes every bin in backward from its gathered rows: every group is compacted
            compact = rows.size > self._bin_limit or host or budget is not None
            n_src = self.n_local if name in ("A", "D") else self.n_local + self.n_remote
            srcs = []
            for b in splits[name]:
                src, blk = bin_block(b, eptr, e_src, norms_t, n_src if not compact else None)
                if src is not None:
                    srcs.append(src)
                    if budget is not None:
                        n_edges = int((eptr[b + 1] - eptr[b]).sum())
                        self.bin_bytes.append(
                            bin_bytes(src.size, b.size, self.widths, x.element_size(), n_edges)
                        )
                    self._n_local_src.setdefault(name, []).append(int(np.searchsorted(src, self.n_local)))
                self.bins[name].append((torch.from_numpy(b).to(self.device), blk.to(self.device)))
            self._gather[name] = (
                (
                    torch.from_numpy(np.concatenate(srcs) if srcs else np.zeros(0, np.int64)).to(self.device),
                    [a.size for a in srcs],
                    torch.from_numpy(rows).to(self.device),
                )
                if compact
                else None
            )

    def _split_bins(
        self, groups: dict[str, np.ndarray], eptr: np.ndarray, e_src: np.ndarray, elem: int
    ) -> dict[str, list[np.ndarray]]:
        """Each group's destination rows cut into bins: ``bin_size`` rows each, or with ``mem_budget_bytes`` packed
        so that every bin's estimate fits half the budget (:func:`g3_bins.pack_bins`). A budget no bin can meet is
        refused on every rank together."""
        budget = self.cfg.mem_budget_bytes
        splits: dict[str, list[np.ndarray]] = {}
        refused = None
        for name, mask in groups.items():
            rows = np.nonzero(mask)[0]
            if budget is None:
                splits[name] = [rows[s : s + self._bin_limit] for s in range(0, rows.size, self._bin_limit)]
                continue
            try:
                splits[name] = pack_bins(rows, eptr, e_src, self._bin_limit, budget / 2, self.widths, elem)
            except ValueError as e:
                refused, splits[name] = refused or f"rank {self.rank}: {e}", []
        if budget is not None and self.world > 1:
            # all ranks refuse together: a rank left running would wait for the refused one in its first exchange
            refused = next((r for r in comm.all_gather_object(refused, group=self.group) if r), None)
        if refused:
            raise ValueError(f"flowlane.fullgraph: bad mem_budget_bytes={budget!r}: {refused}")
        return splits

    def _index_bin_rows(self) -> None:
        """Where each row lands when the bins' outputs are concatenated (group order A, D, C, E; boundary first:
        A, C, D, E), and the backward schedule's state."""
        cfg = self.cfg
        self._boundary_rows = torch.cat(
            [b for nm in ("A", "C") for b, _ in self.bins[nm]]
            or [torch.zeros(0, dtype=torch.long, device=self.device)]
        )
        perm = torch.cat(
            [b for k in ("A", "D", "C", "E") for b, _ in self.bins[k]]
            or [torch.zeros(0, dtype=torch.long, device=self.device)]
        )
        self._inv = torch.empty_like(perm)
        self._inv[perm] = torch.arange(perm.numel(), device=self.device)
        perm_b = torch.cat(
            [b for k in ("A", "C", "D", "E") for b, _ in self.bins[k]]
            or [torch.zeros(0, dtype=torch.long, device=self.device)]
        )
        self._inv_bfirst = torch.empty_like(perm_b)
        self._inv_bfirst[perm_b] = torch.arange(perm_b.numel(), device=self.device)
        pb = cfg.pipeline_backward
        self._pipe_bwd = (cfg.schedule == "pipelined" if pb is None else pb) and self.world > 1
        self._slots: list[GradSlot] = []
        self.backward_stats: dict = {}
        """Pipelined backward of the last step: exchanges started in the background, and how many of them were
        applied by ``add_deferred_grad`` (the rest are joined after autograd)."""

    def _load_rows(self, lp: LocalPartition, order: np.ndarray, xgroup: Any) -> None:
        """The partition's features, labels and masks in the runtime's row order: features on the device, or in host
        memory behind a PyTorch-Direct store (``features="host"``)."""
        cfg = self.cfg
        o = torch.from_numpy(order)
        self.x: torch.Tensor | _HostRows
        if cfg.features == "host":
            if self.world > 1 and self.device.type != "cpu" and not self._host_exchange:
                raise ValueError(
                    f"flowlane.fullgraph: bad features='host': layer-0 halo rows are sent from host memory, which "
                    f"needs a halo exchange on gloo; this one is on {dist.get_backend(xgroup)!r}"
                )
            self._x_host = lp.x[o].contiguous()  # the partition's rows in the runtime's order, in host memory
            self.store = FeatureStore(self._x_host, cfg.direct_config(), self.device)
            self.x = _HostRows(self.store)
            log.info(
                "G3 input features in host memory (%d x %d, %s), gathered per bin by %s: %s",
                *self._x_host.shape,
                self._x_host.dtype,
                self.store.path,
                self.store.choice.reason,
            )
        else:
            self.x = lp.x[o].to(self.device)
        self.y = lp.y[o].to(self.device)
        self.masks = {k: v[o].to(self.device) for k, v in lp.masks.items()}
        self.n_train_global = lp.n_train_global
        if self.n_train_global == 0:
            raise ValueError("train_mask selects no node")
        self.part_stats.update(lp.stats)
        self._halo0 = None
        if cfg.cache_halo_inputs:
            self._halo0 = self._allgather(self.x)

    def _global_out_degree(self, e_src: np.ndarray, xgroup: Any) -> np.ndarray:
        """Out-degree of every ``[inner | halo]`` row over the whole graph, from partial counts (one setup exchange
        each way, DGCL plan reversed then forward)."""
        ex = GraphExchange(self.tables, group=xgroup, kind="setup")
        cnt = torch.from_numpy(np.bincount(e_src, minlength=self.n_local + self.n_remote).astype(np.float64))
        cnt = cnt.to(collective_device(xgroup))
        total = ex.backward_raw(cnt[:, None].contiguous())  # own counts + the halo counts of other ranks
        return ex.forward_raw(total)[:, 0].cpu().numpy()

    def _allgather(self, h: torch.Tensor | _HostRows) -> Any:
        if isinstance(h, _HostRows):  # layer 0, host features: the table is sent from host memory
            return h if self.world == 1 else h.with_halo(self.exchange.forward_raw(self._x_host), self.device)
        if self._host_exchange:
            return graph_allgather(h.cpu(), self.exchange).to(self.device)
        return graph_allgather(h, self.exchange)

    def _start(self, h: torch.Tensor | _HostRows):
        if isinstance(h, _HostRows):
            return self.exchange.start(self._x_host)
        return self.exchange.start(h.cpu() if self._host_exchange else h)

    def _attach(self, h: torch.Tensor | _HostRows, pending, slot: GradSlot | None = None) -> Any:
        if isinstance(h, _HostRows):  # layer-0 features need no gradient (slot is None)
            return h.with_halo(pending.wait(), self.device)
        if self._host_exchange:
            return attach(h.cpu(), pending, self.exchange, slot).to(self.device)
        return attach(h, pending, self.exchange, slot)

    def _slot(self, like: torch.Tensor) -> GradSlot | None:
        """A deferred backward exchange of the halo of rows like ``like`` (pipelined backward), when a gradient
        will flow."""
        if not (self._pipe_bwd and torch.is_grad_enabled() and like.requires_grad):
            return None
        slot = GradSlot(self.exchange, like.cpu()[:0] if self._host_exchange else like)
        self._slots.append(slot)
        return slot

    # -- helpers -----------------------------------------------------------------------------------------------
    def _limit(self, d_in: int) -> int:
        """Bin size in nodes (§4.4.3 step 2; B6 #8): ``bin_size``, or every node of a group; ``mem_budget_bytes``
        caps the bins' bytes on top (:func:`g3_bins.pack_bins`)."""
        return self.cfg.bin_size or max(self.n_local, 1)

    def _run_bins(
        self, k: int, name: str, h_src: torch.Tensor | _HostRows, layer: torch.nn.Module
    ) -> list[torch.Tensor]:
        """Layer ``k`` on the bins of group ``name``; with ``forward_layer`` also what follows the layer."""
        bins = self.bins[name]
        if not bins:
            return []
        if isinstance(h_src, _HostRows):
            return self._run_bins_host(k, name, h_src, layer)
        if self.cfg.mem_budget_bytes is not None and torch.is_grad_enabled():
            return self._run_bins_budget(k, name, h_src, layer)
        gathered = self._gather[name]
        if gathered is None:  # one bin over every source row
            srcs, dsts = [h_src], [h_src[bins[0][0]]]
        else:
            src_ids, src_sizes, rows_all = gathered
            srcs = h_src[src_ids].split(src_sizes)
            dsts = h_src[rows_all].split([rows.numel() for rows, _ in bins])
        return [
            self._bin_forward(k, layer, blk, x_src, x_dst)
            for (_, blk), x_src, x_dst in zip(bins, srcs, dsts, strict=True)
        ]

    def _run_bins_host(
        self, k: int, name: str, rows: _HostRows, layer: torch.nn.Module
    ) -> list[torch.Tensor]:
        """Layer 0 with host features (PyTorch-Direct, seed 003 ch.4): each bin gathers the rows it reads from the
        host table, and is checkpointed, so its gathered inputs are freed after its forward and gathered again for
        its backward (the weight gradients need them) instead of being held in device memory until then."""
        n_loc = self._n_local_src.get(name, [])
        grad = torch.is_grad_enabled() and any(p.requires_grad for p in layer.parameters())
        return self._run_bins_gathering(
            k,
            name,
            layer,
            lambda src, i: rows.take(src, n_loc[i]),
            lambda dst: rows.take(dst, dst.numel()),
            grad,
        )

    def _run_bins_budget(
        self, k: int, name: str, h_src: torch.Tensor, layer: torch.nn.Module
    ) -> list[torch.Tensor]:
        """Layer ``k`` on the bins of group ``name`` under ``mem_budget_bytes`` (B2.5, B2.8): each bin gathers its
        rows and computes inside a checkpoint, so its forward keeps only its output and its backward recomputes it
        (one bin's working set at a time). The bins' row gradients are added into one buffer (B2.8's
        ``g[k-1][u] +=``) instead of each bin's gather making a gradient of every row of ``h_src``."""
        acc = _RowGrads(h_src)
        ref = _RowsWithGradBuffer.apply(h_src, acc) if h_src.requires_grad else h_src
        return self._run_bins_gathering(
            k,
            name,
            layer,
            lambda src, _i: _gather_rows(ref, src, acc),
            lambda dst: _gather_rows(ref, dst, acc),
            True,
        )

    def _run_bins_gathering(
        self,
        k: int,
        name: str,
        layer: torch.nn.Module,
        take_src: Callable[[torch.Tensor, int], torch.Tensor],
        take_dst: Callable[[torch.Tensor], torch.Tensor],
        checkpointed: bool,
    ) -> list[torch.Tensor]:
        """Layer ``k`` on the bins of a compacted group, each bin gathering its own rows (``take_src(ids, bin)``,
        ``take_dst(ids)``) inside its forward; ``checkpointed``: in a non-reentrant checkpoint, so the gathered rows
        are freed after the bin's forward and gathered again for its backward."""
        gathered = self._gather[name]
        if gathered is None:
            raise RuntimeError(
                f"group {name} is not compacted (a runtime bug: gathering bins need compacted groups)"
            )
        src_ids, src_sizes, _ = gathered
        outs = []
        for i, ((dst, blk), src) in enumerate(zip(self.bins[name], src_ids.split(src_sizes), strict=True)):

            def run(src: torch.Tensor, dst: torch.Tensor, blk=blk, i=i) -> torch.Tensor:
                return self._bin_forward(k, layer, blk, take_src(src, i), take_dst(dst))

            outs.append(checkpoint(run, src, dst, use_reentrant=False) if checkpointed else run(src, dst))
        return outs

    def _bin_forward(
        self, k: int, layer: torch.nn.Module, blk: Any, x_src: torch.Tensor, x_dst: torch.Tensor
    ) -> torch.Tensor:
        """Layer ``k`` on one bin's block; with ``forward_layer`` also what follows the layer."""
        return layer_on_block(self.model, self.mode, k, layer, blk, x_src, x_dst)

    def _local(self, full: torch.Tensor | _HostRows) -> torch.Tensor | _HostRows:
        """This rank's rows of ``[local | halo]`` (host features: the bins of groups A and D read no halo rows)."""
        return full if isinstance(full, _HostRows) else full[: self.n_local]

    def _assemble(self, outs: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat(outs)[self._inv]

    # -- forward / train -----------------------------------------------------------------------------------------
    def forward(self) -> torch.Tensor:
        """Logits of this rank's nodes (rows in ``self.local_ids`` order)."""
        if self.mode == "forward":
            return self._forward_user()
        layers = list(self.model.layers)
        L = len(layers)
        h = self.x
        if self.cfg.schedule == "sequential" or self.world == 1:
            for k in range(L):
                full = self._halo0 if (k == 0 and self._halo0 is not None) else self._allgather(h)
                outs = [
                    o
                    for name in ("A", "D", "C", "E")
                    for o in self._run_bins(k, name, full if name in "CE" else self._local(full), layers[k])
                ]
                h = self._assemble(outs)
            return h
        self._slots = []
        pending = None if self._halo0 is not None else self._start(h)
        slot = None  # layer 0's input (features) needs no gradient
        for k in range(L):
            outs_a = self._run_bins(k, "A", h, layers[k])  # ready boundary nodes first
            outs_d = self._run_bins(k, "D", h, layers[k])  # eager: overlaps the running exchange
            full = self._halo0 if pending is None else self._attach(h, pending, slot)
            outs_c = self._run_bins(k, "C", full, layers[k])
            pending = None
            bnd = outs_a + outs_c
            slot = None
            if k < L - 1 and bnd:  # inter-layer pipeline: send boundary now
                bnd_rows = torch.cat(bnd)
                slot = self._slot(bnd_rows)
                send = bnd_rows.new_zeros((self.n_local, bnd_rows.shape[1]))
                send[self._boundary_rows] = bnd_rows.detach()
                pending = self._start(send)
                if slot is not None:
                    # pipelined backward: the boundary rows' returned gradients are awaited here, after this
                    # layer's E bins (created later, so autograd runs their backward first) and the next layer's
                    # A/D bins have run their backward while the exchange was in flight
                    bnd_rows = add_deferred_grad(bnd_rows, slot, self._boundary_rows)
                outs_e = self._run_bins(k, "E", full, layers[k])
                h = torch.cat([bnd_rows, *outs_d, *outs_e])[self._inv_bfirst]
            else:
                outs_e = self._run_bins(k, "E", full, layers[k])
                h = self._assemble(outs_a + outs_d + outs_c + outs_e)
            if k < L - 1 and not bnd:  # nothing to send early: still receive (and return gradients)
                pending = self._start(h)
                slot = self._slot(h)
        return h

    def _forward_user(self) -> torch.Tensor:
        """The user's own ``model.forward`` on this rank's rows, each ``model.layers[k]`` computed over the partition
        (halo exchange + bins). What runs between layers acts row by row (checked at install), so it runs on the
        local rows unchanged. Eager computation: the bins that need no halo rows run while the exchange is in flight;
        the outputs cannot be sent before the model's post-processing has run, so the exchange of layer k+1 starts
        when the user's forward calls it."""
        layers = list(self.model.layers)
        pipelined = self.cfg.schedule == "pipelined" and self.world > 1
        self._slots = []

        def dist_layer(k: int, h: Any) -> torch.Tensor:
            if h.shape[0] != self.n_local:
                raise ModelContractError(
                    f"layers[{k}] got {h.shape[0]} rows, expected this rank's {self.n_local}"
                )
            if self.store is not None and k == 0:
                # checked at install (check_layer0_takes_features); a forward that branches on its input gets here
                if h is not self._x_host:
                    raise ModelContractError(
                        "features='host': model.layers[0] got other rows than the node features (see "
                        "check_layer0_takes_features)"
                    )
                h = self.x
            cached = k == 0 and self._halo0 is not None and h is self.x
            if cached or not pipelined:
                full = self._halo0 if cached else self._allgather(h)
                outs = [
                    o
                    for name in ("A", "D", "C", "E")
                    for o in self._run_bins(k, name, full if name in "CE" else self._local(full), layers[k])
                ]
                return self._assemble(outs)
            slot = None if isinstance(h, _HostRows) else self._slot(h)
            if slot is not None:  # returned halo gradients are awaited after this layer's A/D bins' backward
                h = add_deferred_grad(h, slot)
            pending = self._start(h)
            outs = self._run_bins(k, "A", h, layers[k]) + self._run_bins(k, "D", h, layers[k])
            full = self._attach(h, pending, slot)
            outs += self._run_bins(k, "C", full, layers[k]) + self._run_bins(k, "E", full, layers[k])
            return self._assemble(outs)

        saved = swap_layers(self.model, dist_layer)
        try:
            return self.model(NoGraph(), self._x_host if self.store is not None else self.x)
        finally:
            restore_layers(self.model, saved)

    def _issue_ready(self, force: bool = False) -> None:
        """Issue the groups' all-reduces in ``_ar_groups`` order, the same on every rank (gloo matches collectives
        by order), each as soon as its gradients and those of every group before it exist."""
        while self._next_ar < len(self._ar_groups):
            key, params = self._ar_groups[self._next_ar]
            if not force and not self._ready[self._next_ar]:
                return
            for p in params:
                if p.grad is None:  # a layer this rank's loss did not reach still joins the all-reduce
                    p.grad = torch.zeros_like(p)
            flat = torch.cat([p.grad.reshape(-1) for p in params])
            work = comm.all_reduce(flat, group=self.group, kind="dp", key=key, async_op=True)
            self._pending_ar.append((params, flat, work))
            self._next_ar += 1

    def _hook_layerwise_allreduce(self) -> list:
        """Async SUM all-reduce of a layer's gradients as soon as they are accumulated (B6 #12). A group holds the
        parameters that require a gradient now (a frozen one has none to hook or sum; a group left empty is
        dropped). Groups are issued in the order a probe backward accumulated their last gradient
        (:func:`grad_ready_order`): an input projection used in layer 0 comes after the last layer, a head before
        it, so no layer's all-reduce waits for a group that becomes ready later."""
        names, pos = self._param_names, self._ready_pos
        groups = [(key, [p for p in ps if p.requires_grad]) for key, ps in self._layer_groups]
        groups = [(key, ps) for key, ps in groups if ps]

        def ready_at(i: int) -> tuple[float, int]:  # groups the probe did not reach last, last layer first
            return max(pos.get(names.get(id(p), ""), float("inf")) for p in groups[i][1]), -i

        self._ar_groups = [groups[i] for i in sorted(range(len(groups)), key=ready_at)]
        self._ready = [False] * len(self._ar_groups)
        self._next_ar = 0
        handles = []
        if self.world == 1:
            return handles
        for gi, (_key, params) in enumerate(self._ar_groups):
            left = {"n": len(params)}

            def hook(_p, left=left, gi=gi):
                left["n"] -= 1
                if left["n"] == 0:
                    self._ready[gi] = True
                    self._issue_ready()

            handles += [p.register_post_accumulate_grad_hook(hook) for p in params]
        return handles

    def _finish_slots(self) -> None:
        """Join every deferred backward exchange of the last forward (a rank whose halo got no gradient still
        takes part). A returned gradient that no ``add_deferred_grad`` consumed would be lost: refused."""
        slots, self._slots = self._slots, []
        self.backward_stats = {
            "deferred_exchanges": sum(s.started for s in slots),
            "applied_where_needed": sum(s.consumed for s in slots),
        }
        for slot in slots:
            got = slot.result()
            if not slot.consumed and bool(got.ne(0).any()):
                raise RuntimeError(
                    "pipelined backward: gradients returned for this rank's rows were not applied "
                    "(a runtime bug; set pipeline_backward=False)"
                )

    def _finish_allreduce(self) -> None:
        if self.world > 1:
            self._issue_ready(force=True)
        for ps, flat, work in self._pending_ar:
            work.wait()
            off = 0
            for p in ps:
                p.grad.copy_(flat[off : off + p.numel()].view_as(p.grad))
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
            self._finish_slots()
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
            t = t.to(collective_device(self.group))
            comm.all_reduce(t, group=self.group, kind="metric")
        return float(t[0] / t[1].clamp(min=1))

    def summary(self) -> dict:
        return {
            "rank": self.rank,
            "n_local": self.n_local,
            "n_remote": self.n_remote,
            "n_relay": self.tables.num_relay,
            "n_boundary": self.n_boundary,
            "bins": {k: len(v) for k, v in self.bins.items()},
            "bin_limit": self._bin_limit,
            "bin_bytes_max": max(self.bin_bytes, default=None),
            "plan_method": self.plan.method,
            "plan_stages": self.plan.num_stages,
            "plan_transfers": self.plan.num_transfers,
            "plan_cost": self.plan.cost,
            "backward": dict(self.backward_stats),
            "p2p_cost": self.plan.info.get("p2p_cost"),
            "config": asdict(self.cfg),
            "partition": self.part_stats,
        }
