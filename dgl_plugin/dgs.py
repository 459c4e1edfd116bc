"""DGS on real DistDGL (seed 000 ch. 3; digest 000-dgs-g3.md A2.10, A2.14, A2.15, A6): registered RPC services, the
block samplers for ``DistNodeDataLoader``, and the trainer-side runtime that pulls features and counts bytes.

Three request types are registered with ``dgl.distributed.rpc.register_service`` (in every server *and* client process,
before ``dgl.distributed.initialize``; :func:`register_services`). DGL itself is not patched:

- ``ColumnPullRequest(name, ids, dims)``: DGL's KVStore pull handler has no slot for a column list (A2.15), so this
  request runs the server's own pull handler for ``ids`` and answers only ``[:, dims]``.
- ``QuotaSampleRequest``: one hop of DGS sampling on the server that owns the frontier nodes (their in-edges live in
  its partition): the ε quota split relative to the *requesting* worker's partition (its local rows are free), then
  weighted picks inside each quota (:func:`flowlane.dgs.pick`). A6 #11: the weight of a neighbour remote to the
  requester is the owner's 𝒮𝒩 for its halo nodes, 1 for the owner's own nodes (no global synchronisation).
- ``NodeWeightRequest(gids, w)``: a worker stores 𝒮𝒩 (+ floor) for its halo nodes on its own server, once per mask
  version (A6 #12; the seed's "tensor interpreted from 𝒮𝒩 to the service").

DGL's own reads from the servers (``DistTensor[ids]``, i.e. its KVStore pull, and its ``NeighborSampler``'s sampling
RPCs) wait for the answer with no timeout and cannot be given one: DGL 2.1's C++ ``fast_pull`` and
``rpc.recv_responses`` call ``RecvRPCMessage(msg, 0)``, which retries every 5 s for ever, so a server that died with
a request in flight (or stopped answering) hung the trainer. Here they run through :func:`bounded`: DGL's own call,
in a daemon thread, the trainer waiting at most ``peer_timeout_s`` for it (:func:`read_rows`,
:class:`BoundedNeighborSampler`).

Bytes are counted here, where flowlane sends them (:class:`flowlane.dgs.ByteLedger`): remote feature pulls, sampling
RPCs to servers of other partitions (DGL's own sampler's too, by the same payload formula), probability updates,
and setup pulls. On one host DGL maps every trainer to machine 0 (it picks the machine by local IP), so "local" here
is the trainer's own partition ``part_id``: the rows a trainer on that machine would read from shared memory.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import dgl
import numpy as np
import torch
from dgl.distributed import rpc

from flowlane.dgs import (
    ByteLedger,
    DGSConfig,
    node_probabilities,
    pick,
    pull_bytes,
    sampling_bytes,
    top_columns,
)
from flowlane.direct import DirectConfig, FeatureStore

from .distdgl import DEFAULT_PEER_TIMEOUT_S

SERVICE_COLUMN_PULL = 7_353_001
SERVICE_QUOTA_SAMPLE = 7_353_002
SERVICE_NODE_WEIGHT = 7_353_003


log = logging.getLogger("flowlane.dgs")


def _ids(t) -> torch.Tensor:
    return torch.as_tensor(t, dtype=torch.int64).reshape(-1)


class _Request(rpc.Request):
    """A DGS request whose failure on the server is answered, not raised: an exception in ``process_request`` ends
    DGL's server process (every trainer then loses that partition, and DGL's RPCs wait for it). The trainer raises
    the answered error instead (:func:`remote_call`)."""

    response: type

    def process_request(self, server_state):
        try:
            return self.process(server_state)
        except Exception as e:  # any handler failure: answered, so the server lives on for the other trainers
            log.exception("DGS %s failed on the server", type(self).__name__)
            return self.response.failed(f"{type(e).__name__}: {e}")

    def process(self, server_state):
        raise NotImplementedError


def remote_call(reqs: list, timeout_s: float, what: str) -> list:
    """``rpc.remote_call_to_machine(reqs)`` waiting at most ``timeout_s`` for each answer (DGL's default waits for
    ever: a server that died in a request hung its trainer). No answer in time raises
    :class:`dgl_plugin.distdgl.PeerLostError`; an error answered by a server raises RuntimeError with its text."""
    from .distdgl import PeerLostError

    try:
        res = rpc.remote_call_to_machine(reqs, timeout=max(1, math.ceil(timeout_s * 1000)))
    except dgl.DGLError as e:
        if "timed out" not in str(e).lower():
            raise
        raise PeerLostError(_no_answer(what, sorted({p for p, _ in reqs}), timeout_s)) from e
    for (p, _), r in zip(reqs, res, strict=True):
        if getattr(r, "error", None):
            raise RuntimeError(f"{what}: the graph server of partition {p} failed: {r.error}")
    return res


def _no_answer(what: str, parts: list[int], timeout_s: float) -> str:
    return (
        f"{what}: the graph server(s) of partition(s) {parts} did not answer within peer_timeout_s={timeout_s:g} s "
        "(a server died or hangs; its log says why)"
    )


class _Waiter:
    """The daemon thread that runs :func:`bounded`'s calls, one at a time (DGL's RPC client is not made for
    concurrent callers). Daemon: a call left waiting for a dead server does not hold the interpreter's exit."""

    def __init__(self) -> None:
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.stuck: str | None = None  # the call that timed out: it still occupies the thread
        self.thread = threading.Thread(target=self._run, name="flowlane-dgl-wait", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            fn, box, done = self.jobs.get()
            try:
                box["value"] = fn()
            except BaseException as e:  # handed to the caller, which raises it
                box["error"] = e
            done.set()


_WAITER: _Waiter | None = None
_WAITER_LOCK = threading.Lock()


def bounded(fn: Callable[[], Any], timeout_s: float, what: str, parts: list[int]) -> Any:
    """``fn()``, a DGL call that waits on the graph servers of ``parts`` with no timeout of its own, waited for at
    most ``timeout_s``: past it, :class:`dgl_plugin.distdgl.PeerLostError` naming the partitions and the timeout.
    DGL's wait (native code) cannot be cancelled, so ``fn`` runs in a daemon thread and stays there when it times out;
    the trainer then has to end (its DGL client has a request without an answer), which
    :func:`~dgl_plugin.distdgl.peer_guard` and :func:`~dgl_plugin.distdgl.leave` do without DGL's exit barrier.
    Errors of ``fn`` are raised here; a call from inside another bounded call runs directly (it is already
    bounded)."""
    from .distdgl import PeerLostError

    global _WAITER
    with _WAITER_LOCK:
        if _WAITER is None:
            _WAITER = _Waiter()
        w = _WAITER
    if threading.current_thread() is w.thread:
        return fn()
    if w.stuck is not None:
        raise PeerLostError(f"{what}: not sent: an earlier DistDGL call ({w.stuck}) still waits for a server")
    box: dict[str, Any] = {}
    done = threading.Event()
    w.jobs.put((fn, box, done))
    if not done.wait(timeout_s):
        w.stuck = what
        raise PeerLostError(
            f"{_no_answer(what, parts, timeout_s)}. DGL's own wait has no timeout and cannot be cancelled: the "
            "trainer must end"
        )
    if "error" in box:
        raise box["error"]
    return box["value"]


def read_rows(g: dgl.distributed.DistGraph, name: str, ids: torch.Tensor, timeout_s: float) -> torch.Tensor:
    """``g.ndata[name][ids]`` (DGL's KVStore pull), waiting at most ``timeout_s`` for the servers of other machines
    (:func:`bounded`); rows of this machine's partition only (shared memory, no RPC) are read directly."""
    ids = _ids(ids)
    pb = g.get_partition_book()
    far = sorted(set(torch.unique(pb.nid2partid(ids)).tolist()) - {pb.partid})
    if not far:
        return g.ndata[name][ids]
    return bounded(lambda: g.ndata[name][ids], timeout_s, f"DistDGL pull of {name!r}", far)


class ColumnPullResponse(rpc.Response):
    def __init__(self, data: torch.Tensor, error: str | None = None):
        self.data, self.error = data, error

    @classmethod
    def failed(cls, error: str) -> ColumnPullResponse:
        return cls(torch.zeros(0), error)

    def __getstate__(self):
        return self.data, self.error

    def __setstate__(self, state):
        self.data, self.error = state


class ColumnPullRequest(_Request):
    """Pull rows ``ids`` (global) of KVStore tensor ``name``, columns ``dims`` only (an empty ``dims``: all)."""

    response = ColumnPullResponse

    def __init__(self, name: str, ids: torch.Tensor, dims: torch.Tensor):
        self.name, self.ids, self.dims = name, ids, dims

    def __getstate__(self):
        return self.name, self.ids, self.dims

    def __setstate__(self, state):
        self.name, self.ids, self.dims = state

    def process(self, server_state):
        kv = server_state.kv_store
        if self.name not in kv.data_store:
            raise RuntimeError(f"ColumnPullRequest: no KVStore tensor {self.name!r} on server {kv.server_id}")
        local = kv.part_policy[self.name].to_local(self.ids)
        rows = kv.pull_handlers[self.name](kv.data_store, self.name, local)
        return ColumnPullResponse(rows[:, self.dims].contiguous() if self.dims.numel() else rows)


@dataclass
class _ServerGraph:
    """The server's partition in CSC form, cached on its ServerState by the first DGS request."""

    indptr: np.ndarray
    indices: np.ndarray
    gid: np.ndarray
    owner: np.ndarray
    weight: np.ndarray
    sorted_gid: np.ndarray
    sorted_pos: np.ndarray
    version: int = 0


def _server_graph(server_state) -> _ServerGraph:
    sg = getattr(server_state, "_flowlane_dgs", None)
    if sg is None:
        g = server_state.graph
        indptr, indices, _ = g.adj_tensors("csc")
        gid = g.ndata[dgl.NID].numpy().astype(np.int64)
        owner = server_state.partition_book.nid2partid(torch.from_numpy(gid)).numpy().astype(np.int64)
        order = np.argsort(gid)
        sg = _ServerGraph(
            indptr.numpy().astype(np.int64),
            indices.numpy().astype(np.int64),
            gid,
            owner,
            np.ones(gid.size),
            gid[order],
            order,
        )
        server_state._flowlane_dgs = sg
    return sg


class QuotaSampleResponse(rpc.Response):
    def __init__(self, src: torch.Tensor, dst: torch.Tensor, error: str | None = None):
        self.src, self.dst, self.error = src, dst, error

    @classmethod
    def failed(cls, error: str) -> QuotaSampleResponse:
        return cls(torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64), error)

    def __getstate__(self):
        return self.src, self.dst, self.error

    def __setstate__(self, state):
        self.src, self.dst, self.error = state


class QuotaSampleRequest(_Request):
    """One hop for ``seeds`` (global ids owned by the receiving server): see the module docstring."""

    response = QuotaSampleResponse

    def __init__(
        self,
        seeds: torch.Tensor,
        fanout: int,
        epsilon: float,
        requester: int,
        weighted: bool,
        base: str,
        key: int,
    ):
        self.seeds, self.fanout, self.epsilon, self.requester = seeds, fanout, epsilon, requester
        self.weighted, self.base, self.key = weighted, base, key

    def __getstate__(self):
        return self.seeds, self.fanout, self.epsilon, self.requester, self.weighted, self.base, self.key

    def __setstate__(self, state):
        self.seeds, self.fanout, self.epsilon, self.requester, self.weighted, self.base, self.key = state

    def process(self, server_state):
        sg = _server_graph(server_state)
        pb = server_state.partition_book
        loc = pb.nid2localnid(self.seeds, pb.partid).numpy().astype(np.int64)
        start, end = sg.indptr[loc], sg.indptr[loc + 1]
        deg = end - start
        offsets = np.concatenate([[0], np.cumsum(deg)])
        cand = np.repeat(start - offsets[:-1], deg) + np.arange(offsets[-1])
        nbr = sg.indices[cand]
        local = sg.owner[nbr] == self.requester
        w = np.where(local, 1.0, sg.weight[nbr]) if self.weighted else np.ones(nbr.size)
        rng = np.random.default_rng((self.key, pb.partid))
        keep = pick(offsets, sg.gid[nbr], local, w, self.fanout, self.epsilon, rng, self.base, self.key)
        dst = np.repeat(self.seeds.numpy(), deg)
        return QuotaSampleResponse(torch.from_numpy(sg.gid[nbr][keep]), torch.from_numpy(dst[keep]))


class NodeWeightResponse(rpc.Response):
    def __init__(self, version: int, error: str | None = None):
        self.version, self.error = version, error

    @classmethod
    def failed(cls, error: str) -> NodeWeightResponse:
        return cls(-1, error)

    def __getstate__(self):
        return self.version, self.error

    def __setstate__(self, state):
        self.version, self.error = state


class NodeWeightRequest(_Request):
    """Set the sampling weight of nodes ``gids`` (halo nodes of the receiving server's partition); no ids: reset
    all to 1."""

    response = NodeWeightResponse

    def __init__(self, gids: torch.Tensor, weight: torch.Tensor):
        self.gids, self.weight = gids, weight

    def __getstate__(self):
        return self.gids, self.weight

    def __setstate__(self, state):
        self.gids, self.weight = state

    def process(self, server_state):
        sg = _server_graph(server_state)
        g = self.gids.numpy()
        if g.size == 0:  # reset: every node back to weight 1
            sg.weight[:] = 1.0
            sg.version += 1
            return NodeWeightResponse(sg.version)
        at = np.searchsorted(sg.sorted_gid, g).clip(max=max(sg.sorted_gid.size - 1, 0))
        if g.size and not (sg.sorted_gid[at] == g).all():
            raise RuntimeError("NodeWeightRequest: some ids are not in this server's partition")
        sg.weight[sg.sorted_pos[at]] = self.weight.numpy()
        sg.version += 1
        return NodeWeightResponse(sg.version)


def register_services() -> None:
    """Register the three DGS request types (idempotent). Call in every server and client before initialize."""
    rpc.register_service(SERVICE_COLUMN_PULL, ColumnPullRequest, ColumnPullResponse)
    rpc.register_service(SERVICE_QUOTA_SAMPLE, QuotaSampleRequest, QuotaSampleResponse)
    rpc.register_service(SERVICE_NODE_WEIGHT, NodeWeightRequest, NodeWeightResponse)


def _check_registered() -> None:
    if rpc.REQUEST_CLASS_TO_SERVICE_ID.get(ColumnPullRequest) != SERVICE_COLUMN_PULL:
        raise RuntimeError(
            "DGS services are not registered in this process: call dgl_plugin.dgs.register_services() "
            "before dgl.distributed.initialize() (servers too)"
        )


@dataclass
class DGSRuntime:
    """Trainer-side DGS state of one worker: the current masks (as column list and halo weights), the pulls and the
    byte ledger. ``part_id`` is the worker's own partition (see the module docstring).

    ``direct`` (PyTorch-Direct, seed 003 ch.4): the own partition's rows are gathered from its local table (the
    server's shared memory, pinned in place) by a :class:`flowlane.direct.FeatureStore` onto ``device``, zero-copy on
    CUDA; remote rows arrive over the network into host memory and are copied to ``device``. None: DGL's own read
    of the local rows (``DistTensor[ids]``) into host memory, then a copy to ``device``."""

    g: dgl.distributed.DistGraph
    part_id: int
    cfg: DGSConfig
    feat: str = "feat"
    ledger: ByteLedger = field(default_factory=ByteLedger)
    dims: torch.Tensor | None = None
    """Feature columns pulled for remote rows; None: all (before the first explanation, or feature sampling off)."""
    mask_version: int = 0
    stats: dict = field(default_factory=lambda: {"remote_rows": 0, "input_rows": 0, "batches": 0})
    direct: DirectConfig | None = None
    """Own-partition rows through a FeatureStore over the local table (None: DGL's own read)."""
    device: torch.device | str = "cpu"
    """Where pulled rows land."""
    peer_timeout_s: float = DEFAULT_PEER_TIMEOUT_S
    """How long a DGS request, or a DGL read (pull, sampling), waits for a graph server's answer before it is an
    error (:func:`remote_call`, :func:`bounded`)."""

    def __post_init__(self) -> None:
        _check_registered()
        self.pb = self.g.get_partition_book()
        self.num_parts = self.pb.num_partitions()
        if not 0 <= self.part_id < self.num_parts:
            raise ValueError(f"part_id={self.part_id} must be in [0, {self.num_parts})")
        self.tensor = self.g.ndata[self.feat]
        self.key = self.tensor.kvstore_key
        self.f = int(self.tensor.shape[1])
        self.itemsize = torch.empty((), dtype=self.tensor.dtype).element_size()
        self.device = torch.device(self.device)
        self.store: FeatureStore | None = None
        self.direct_note = "off"
        """Whether PyTorch-Direct gathers the own rows: the store's path, or why not."""
        if self.direct is not None:
            here = self.pb.partid
            if here == self.part_id:
                # the rows this partition owns, in their local id order (shared memory of this machine's server)
                self.store = FeatureStore(self.tensor.local_partition, self.direct, self.device)
                self.direct_note = f"{self.store.path}: {self.store.choice.reason}"
            else:  # one host: DGL makes every trainer machine 0, whose shared memory holds partition 0 only
                self.direct_note = (
                    f"not applied: partition {self.part_id}'s table is not in this machine's shared memory "
                    f"(DGL placed this trainer on the machine of partition {here}); DGL's own read is used"
                )
                log.warning("DGS trainer %d: PyTorch-Direct %s", self.part_id, self.direct_note)

    def owner(self, ids: torch.Tensor) -> torch.Tensor:
        return self.pb.nid2partid(ids)

    def read(self, ids: torch.Tensor, name: str | None = None) -> torch.Tensor:
        """Rows ``ids`` of node tensor ``name`` (default: the features) through DGL's own pull, bounded by
        ``peer_timeout_s`` (:func:`read_rows`)."""
        return read_rows(self.g, name or self.feat, ids, self.peer_timeout_s)

    def pull(
        self, ids: torch.Tensor, dims: torch.Tensor | None = None, kind: str = "feature_remote"
    ) -> torch.Tensor:
        """Feature rows ``ids``: own-partition rows in full through DGL's DistTensor; remote rows through DGL's pull
        (``dims`` None) or the column service (``dims`` given: the other columns are zero-filled, A6 #10)."""
        ids = _ids(ids)
        own = self.owner(ids)
        out = torch.zeros(ids.numel(), self.f, dtype=self.tensor.dtype, device=self.device)
        mine = own == self.part_id
        if mine.any():
            if self.store is not None:
                out[mine.to(self.device)] = self.store.gather(self.pb.nid2localnid(ids[mine], self.part_id))
            else:
                out[mine.to(self.device)] = self.read(ids[mine]).to(self.device, non_blocking=True)
        rmt = ~mine
        n_rmt = int(rmt.sum())
        self.stats["remote_rows"] += n_rmt if kind == "feature_remote" else 0
        self.stats["input_rows"] += ids.numel() if kind == "feature_remote" else 0
        if not n_rmt:
            return out
        if dims is None or int(dims.numel()) == self.f:
            out[rmt.to(self.device)] = self.read(ids[rmt]).to(self.device, non_blocking=True)
            self.ledger.add(kind, sum(pull_bytes(n_rmt, self.f, self.itemsize, self.f)))
            return out
        reqs, where = [], []
        for p in torch.unique(own[rmt]).tolist():
            sel = torch.nonzero(own == p).reshape(-1)
            reqs.append((p, ColumnPullRequest(self.key, ids[sel], dims)))
            where.append(sel)
            self.ledger.add(kind, sum(pull_bytes(sel.numel(), dims.numel(), self.itemsize, self.f)))
        for sel, res in zip(where, remote_call(reqs, self.peer_timeout_s, "DGS column pull"), strict=True):
            sel_d, dims_d = sel.to(self.device), dims.to(self.device)
            out[sel_d[:, None], dims_d[None, :]] = res.data.to(self.device, non_blocking=True)
        return out

    def pull_inputs(self, input_nodes: torch.Tensor) -> torch.Tensor:
        self.stats["batches"] += 1
        return self.pull(input_nodes, self.dims if self.cfg.feature_sampling else None)

    def apply_masks(self, halo_ids: np.ndarray, sn: torch.Tensor, sf: torch.Tensor, version: int) -> None:
        """A new explanation (Alg. 1 l. 26): the column list from 𝒮ℱ, and 𝒮𝒩 (through ``sn_transform``, + floor) to
        the own server."""
        if self.cfg.feature_sampling:
            self.dims = torch.from_numpy(top_columns(sf.numpy(), self.cfg.n_f))
        if self.cfg.node_sampling and len(halo_ids):
            w = torch.from_numpy(node_probabilities(sn.numpy(), self.cfg.prob_floor, self.cfg.sn_transform))
            gids = torch.from_numpy(np.asarray(halo_ids, dtype=np.int64))
            remote_call([(self.part_id, NodeWeightRequest(gids, w))], self.peer_timeout_s, "DGS node weights")
            self.ledger.add("prob_update", gids.numel() * 8 + w.numel() * w.element_size())
        self.mask_version = version


class BoundedNeighborSampler(dgl.dataloading.NeighborSampler):
    """DGL's own ``NeighborSampler``, each batch's sampling (RPCs to the servers of other machines, no timeout in
    DGL) waited for at most ``timeout_s`` (:func:`bounded`)."""

    def __init__(self, fanouts: list[int], timeout_s: float, **kw):
        super().__init__(fanouts, **kw)
        self.timeout_s = timeout_s

    def sample_blocks(self, g, seed_nodes, exclude_eids=None):
        pb = g.get_partition_book()
        far = sorted(set(range(pb.num_partitions())) - {pb.partid})
        sample = super().sample_blocks
        return bounded(
            lambda: sample(g, seed_nodes, exclude_eids=exclude_eids),
            self.timeout_s,
            "DGL neighbour sampling",
            far,
        )


class CountingNeighborSampler(BoundedNeighborSampler):
    """DGL's own ``NeighborSampler`` (the baseline path), with its sampling RPCs to other partitions counted by the
    same payload formula as the DGS service: frontier ids in, (src, dst) per sampled edge out; bounded by the
    runtime's ``peer_timeout_s``."""

    def __init__(self, fanouts: list[int], runtime: DGSRuntime, **kw):
        super().__init__(fanouts, runtime.peer_timeout_s, **kw)
        self.rt = runtime

    def sample_blocks(self, g, seed_nodes, exclude_eids=None):
        res = super().sample_blocks(g, seed_nodes, exclude_eids=exclude_eids)
        for block in res[2]:
            dst = block.dstdata[dgl.NID]
            far = self.rt.owner(dst) != self.rt.part_id
            n_edges = int(far[block.edges()[1]].sum())
            self.rt.ledger.add("sampling_rpc", sum(sampling_bytes(int(far.sum()), n_edges)))
        return res


class DGSNeighborSampler(dgl.dataloading.BlockSampler):
    """Block sampler for ``DistNodeDataLoader``: each hop through ``QuotaSampleRequest`` on the frontier's owners.

    ``weighted`` uses the stored 𝒮𝒩 weights and ``epsilon`` the quota shift (NS); both off with ``base="labor"`` is
    plain LABOR-0. Blocks are built as DGL's NeighborSampler builds them (``to_block`` of the frontier)."""

    def __init__(
        self,
        fanouts: list[int],
        runtime: DGSRuntime,
        *,
        weighted: bool,
        epsilon: float,
        base: str = "uniform",
        seed: int = 0,
    ):
        super().__init__()
        if any((not isinstance(f, int)) or (f < 1 and f != -1) for f in fanouts):
            raise ValueError(f"fanouts={fanouts!r}: each must be an integer >= 1, or -1 for all neighbours")
        self.fanouts = list(fanouts)
        self.rt = runtime
        self.weighted = weighted
        self.epsilon = epsilon
        self.base = base
        self.calls = seed * 1_000_003

    def _hop(self, g, seeds: torch.Tensor, fanout: int) -> dgl.DGLGraph:
        own = self.rt.owner(seeds)
        self.calls += 1
        active = self.weighted and self.rt.mask_version > 0  # Alg. 1 l. 6-7: conventional until masks exist
        reqs = []
        for p in torch.unique(own).tolist():
            s = seeds[own == p]
            reqs.append(
                (
                    p,
                    QuotaSampleRequest(
                        s,
                        fanout,
                        self.epsilon if active else 0.0,
                        self.rt.part_id,
                        active,
                        self.base,
                        self.calls,
                    ),
                )
            )
        res = remote_call(reqs, self.rt.peer_timeout_s, "DGS sampling")
        for (p, req), r in zip(reqs, res, strict=True):
            if p != self.rt.part_id:
                self.rt.ledger.add("sampling_rpc", sum(sampling_bytes(req.seeds.numel(), r.src.numel())))
        src = torch.cat([r.src for r in res]) if res else torch.zeros(0, dtype=torch.int64)
        dst = torch.cat([r.dst for r in res]) if res else torch.zeros(0, dtype=torch.int64)
        return dgl.graph((src, dst), num_nodes=g.num_nodes())

    def sample_blocks(self, g, seed_nodes, exclude_eids=None):
        if exclude_eids is not None:
            raise ValueError("DGSNeighborSampler: exclude_eids is not supported (node classification only)")
        seeds = _ids(seed_nodes)
        output_nodes, blocks = seeds, []
        for fanout in reversed(self.fanouts):
            block = dgl.to_block(self._hop(g, seeds, fanout), seeds)
            seeds = block.srcdata[dgl.NID]
            blocks.insert(0, block)
        return seeds, output_nodes, blocks
