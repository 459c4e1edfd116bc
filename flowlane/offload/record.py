"""What the tensor cache knows about one micro-batch (seed 003 §5.3.2, Fig. 5.5), and its counters.

A :class:`Record` holds a micro-batch's scopes (:class:`Scope`), the storages it saved (:class:`Stored`, one per
untyped storage, digest A1) and, on the CUDA tiers, the per-layer host blocks they were copied into (:class:`Slab`).
The autograd graph holds a :class:`SavedHandle` (or a :class:`SubclassHandle`) in place of each saved tensor.
:func:`measured_profile` reads a profiled record's timings into the :class:`~flowlane.offload.budget.StepProfile` the
byte budget is planned from. State only: the cache (``cache.py``) does every transition.
"""

from __future__ import annotations

import math
import weakref
from concurrent.futures import Future
from dataclasses import asdict, dataclass
from typing import Any

import torch

from flowlane.offload.budget import Point, StepProfile
from flowlane.offload.pool import HostBlock, align_up


@dataclass
class OffloadStats:
    """Counters of one cache (cumulative; take :meth:`TensorCache.stats_snapshot` differences per step).

    A store still queued on the I/O pool adds its bytes to ``bytes_written`` or ``bytes_cancelled`` when it runs:
    call :meth:`TensorCache.wait_io` first for final byte counts."""

    packs: int = 0
    small_skips: int = 0
    param_skips: int = 0
    cpu_skips: int = 0
    lazy_view_skips: int = 0
    """nested tensors and views with a lazy conjugate or negative bit: kept (bytes alone would lose them)"""
    outside_scope: int = 0
    backward_packs: int = 0
    dedup_hits: int = 0
    storages_tracked: int = 0
    storages_offloaded: int = 0
    storages_kept: int = 0
    bytes_written: int = 0
    bytes_cancelled: int = 0
    """bytes whose store was cancelled because the tensor was forwarded (needed again) before its write began"""
    bytes_read: int = 0
    forwards: int = 0
    cancellations: int = 0
    fallbacks: int = 0
    io_errors: int = 0
    loads: int = 0
    sync_loads: int = 0
    version_errors: int = 0
    records: int = 0
    keep_last_k: int = 0
    profile: dict[str, Any] | None = None
    peak_resident_bytes: int = 0
    """peak bytes of saved-activation storages inside scopes that are alive (kept, in flight, or reloaded)"""
    peak_resident_all_bytes: int = 0
    """the same including eligible tensors saved outside scopes or during backward (comparable across strategies)"""
    bulk_stores: int = 0
    """layers copied in bulk into one host block (CUDA tiers)"""
    bulk_loads: int = 0
    """layer reloads issued as one bulk copy (CUDA tiers)"""
    budget_kept: int = 0
    """storages kept resident because the byte budget was spent (``adaptive``)"""
    late_loads: int = 0
    """unpacks that waited on the host for a disk read still running (SSD tier only; never for pinned_cpu)"""
    pool: dict[str, int] | None = None
    """host pool counters (CUDA tiers): allocated, in use, peak, hits, misses"""
    recomputed_layers: int = 0
    """layer forwards run under ``torch.utils.checkpoint`` because the budget chose to recompute them (``recompute``)"""
    ordered_releases: int = 0
    """layer blocks whose device tensors were dropped in the compute stream's order (``release="stream_order"``)"""
    ordered_release_misses: int = 0
    """layer blocks stored after their release point had passed: released by ``record_stream`` instead"""
    unused_loads: int = 0
    """reloads released without being unpacked (their autograd node never ran): link time spent for nothing"""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class Scope:
    """One scope module's forward in a record: its layer (``group``), its parent scope, and its storages."""

    __slots__ = ("name", "group", "parent", "begun", "ended", "sids")

    def __init__(self, name: str, group: int, parent: int | None) -> None:
        self.name = name
        self.group = group
        self.parent = parent
        self.begun = False
        self.ended = False
        self.sids: set[int] = set()


class Stored:
    """One storage of one micro-batch record."""

    __slots__ = (
        "sid",
        "nbytes",
        "device",
        "group",
        "scopes",
        "state",
        "ref",
        "weak",
        "handle",
        "load_fut",
        "event",
        "dirty",
        "error",
        "released",
        "where",
        "slab",
        "offset",
        "reloaded",
        "unpacked",
        "roots",
    )

    def __init__(self, sid: int, nbytes: int, device: torch.device, group: int, where: str) -> None:
        self.sid = sid
        self.nbytes = nbytes
        self.device = device
        self.group = group
        self.scopes: set[int] = set()
        self.state = "new"  # kept | storing | stored | fallback | loaded
        self.ref: torch.Tensor | None = None  # strong uint8 view of the storage while in memory
        self.weak: weakref.ref | None = None  # the original storage while it may still be alive
        self.handle: Any = None
        self.load_fut: Future | None = None
        self.event: Any = None  # CUDA event: producer done (pack) or load done
        self.dirty: str | None = None
        self.error: BaseException | None = None
        self.released = False
        self.where = where
        self.slab: Slab | None = None  # bulk tiers: the layer block holding this storage's bytes
        self.offset = 0
        self.reloaded = False  # read back from the tier (not forwarded)
        self.unpacked = False  # handed to autograd at least once
        # (saved tensor's base, version at pack, desc) while the cache holds these bytes for a copy (check_versions)
        self.roots: list[tuple[torch.Tensor, int, str]] = []


class Slab:
    """One layer's storages in one host block (bulk tiers). ``alive``: members not yet released; ``block`` is
    returned to the pool once no member needs the host copy (``last_use``: the event of the last copy from it)."""

    __slots__ = (
        "key",
        "block",
        "nbytes",
        "payload",
        "members",
        "alive",
        "d2h_done",
        "last_use",
        "handle",
        "writing",
        "write_fut",
        "t_copy",
        "hold",
    )

    def __init__(self, key: str, block: HostBlock, members: list[Stored]) -> None:
        self.key = key
        self.block: HostBlock | None = block
        self.members = members
        self.alive = {m.sid for m in members}
        self.payload = sum(m.nbytes for m in members)
        self.nbytes = sum(align_up(m.nbytes) for m in members)
        self.d2h_done: Any = None
        self.last_use: Any = None
        self.handle: Any = None
        self.writing = False
        self.write_fut: Future | None = None
        self.t_copy: tuple[Any, Any] | None = None  # (start, end) CUDA timing events while profiling
        self.hold: list[torch.Tensor] | None = None  # the stored device tensors until their release point


class Record:
    """The cache's state for one micro-batch (one record set per micro-batch, thesis §5.3.2/Fig. 5.5)."""

    def __init__(self, key: Any, family: Any, profiling: bool) -> None:
        self.key = key
        self.family = family
        self.phase = "forward"  # forward | forward_done | backward | done
        self.scopes: list[Scope] = []
        self.groups: list[list[int]] = []  # group -> scope ids
        self.group_sids: list[set[int]] = []
        self.group_bytes: list[int] = []
        self.group_t0: list[float] = []
        self.group_time: list[float] = []
        self.storages: dict[int, Stored] = {}
        # (tensor base, version at pack, sid, desc)
        self.watches: list[tuple[weakref.ref, int, int, str]] = []
        self.profiling = profiling
        # profiling: (start, end, bytes) of each host-side store call (CPU copy into a host block, or disk write)
        self.store_io: list[tuple[float, float, int]] = []
        self.callback_queued = False
        self.futures: list[Future] = []
        self.released: dict[int, str] = {}  # sid -> why (diagnostics)
        # bulk tiers: group -> storages waiting for the layer's end
        self.pending: dict[int, list[Stored]] = {}
        self.assigned: list[int] = []  # bytes of each group given to the budget so far
        self.slabs: list[Slab] = []
        # profiling (adaptive): per group backward times, the head time, the copy spans
        self.bwd_t0: dict[int, Any] = {}
        self.bwd_c0: dict[int, Any] = {}  # first unpack of a layer in backward, after its reload wait
        self.bwd_time: dict[int, float] = {}
        self.fwd_ev: dict[int, tuple[Any, Any]] = {}
        self.bwd_ev: dict[int, list[Any]] = {}
        self.fwd_end: Any = None
        self.bwd_start: Any = None
        self.load_spans: list[tuple[Any, Any, int]] = []
        self.load_io: list[tuple[float, float, int]] = []  # the same for each host-side load call
        # release="stream_order": slabs whose device tensors are dropped at a hook point, and the points passed
        self.due: dict[Point, list[Slab]] = {}
        self.passed: set[Point] = set()


class SavedHandle:
    """What the autograd graph holds instead of an offloaded tensor."""

    __slots__ = ("rec", "sid", "shape", "stride", "offset", "dtype", "watch")

    def __init__(self, rec: Record, sid: int, t: torch.Tensor, watch: int) -> None:
        self.rec = rec
        self.sid = sid
        self.shape = tuple(t.shape)
        self.stride = tuple(t.stride())
        self.offset = t.storage_offset()
        self.dtype = t.dtype
        self.watch = watch


class SubclassHandle:
    """What the graph holds for a saved tensor subclass (DTensor, float8 tensors): its inner tensors, each kept or
    offloaded like any activation, and what ``__tensor_unflatten__`` needs to rebuild it around them."""

    __slots__ = ("cls", "inner", "ctx", "size", "stride")

    def __init__(self, t: torch.Tensor, inner: dict[str, Any], ctx: Any) -> None:
        self.cls = type(t)
        self.inner = inner
        self.ctx = ctx
        self.size = t.size()
        self.stride = t.stride()


def busy_rate(spans: list[tuple[float, float, int]]) -> float:
    """Bytes/s of I/O calls ``(start, end, bytes)``: their bytes over the union of their busy intervals. The time
    between calls (the disk idle while layers compute) is not I/O time, and calls that overlap on parallel workers
    count once (the forward's I/O time, thesis §5.3.5; digest §2.2.8, A10). 0.0 when no call took time."""
    busy = 0.0
    end = -math.inf
    for a, b, _ in sorted(spans):
        if b > end:
            busy += b - max(a, end)
            end = b
    return sum(nb for _, _, nb in spans) / busy if busy > 0 else 0.0


def measured_profile(rec: Record, keeps_host_memory: bool, link_GBps: float = 0.0) -> tuple[StepProfile, str]:
    """The profiled micro-batch ``rec`` as a :class:`StepProfile`, and the timer it was read with: per-layer
    forward/backward times (CUDA events on a GPU, which this waits for: the feature's one host wait; the clock on
    CPU), the head between forward and backward, and the link rates its copies saw. SSD tiers (``keeps_host_memory``
    false) take the slower of PCIe and the disk (issue 36); ``link_GBps`` > 0 overrides both rates. Raises
    ``ValueError`` when no copy ran (nothing to measure a rate from)."""
    n = len(rec.groups)
    if rec.fwd_ev and len(rec.fwd_ev) == n and all(e[1] is not None for e in rec.fwd_ev.values()):
        timer = "cuda events"
        torch.cuda.synchronize()
        fwd = [rec.fwd_ev[g][0].elapsed_time(rec.fwd_ev[g][1]) / 1e3 for g in range(n)]
        bwd = [
            rec.bwd_ev[g][0].elapsed_time(rec.bwd_ev[g][1]) / 1e3 if g in rec.bwd_ev else 0.0
            for g in range(n)
        ]
        head = (
            rec.fwd_end.elapsed_time(rec.bwd_start) / 1e3
            if rec.fwd_end is not None and rec.bwd_start is not None
            else 0.0
        )
        spans = [
            (sl.t_copy[0].elapsed_time(sl.t_copy[1]) / 1e3, sl.payload)
            for sl in rec.slabs
            if sl.t_copy is not None
        ]
        store_s = sum(t for t, _ in spans)
        store = sum(b for _, b in spans) / store_s if store_s > 0 else 0.0
        # one copy stream each way, FIFO: the copies never overlap, so their times add up to the busy time
        load_s = sum(a.elapsed_time(b) / 1e3 for a, b, _ in rec.load_spans)
        load = sum(nb for _, _, nb in rec.load_spans) / load_s if load_s > 0 else 0.0
        if not keeps_host_memory:  # SSD tier: the slower of PCIe and the disk
            disk_w, disk_r = busy_rate(rec.store_io), busy_rate(rec.load_io)
            if disk_w:
                store = min(store, disk_w) if store else disk_w
            if disk_r:
                load = min(load, disk_r) if load else disk_r
    else:
        timer = "clock"
        fwd = list(rec.group_time)
        bwd = [rec.bwd_time.get(g, 0.0) for g in range(n)]
        head = (
            (rec.bwd_start - rec.fwd_end)
            if isinstance(rec.bwd_start, float) and isinstance(rec.fwd_end, float)
            else 0.0
        )
        store = busy_rate(rec.store_io)
        load = busy_rate(rec.load_io)
    if link_GBps > 0:
        store = load = link_GBps * 1e9
    store = store or load
    load = load or store
    if not store:
        raise ValueError(
            "no copy ran in the profiled micro-batch (everything was forwarded or kept); set offload.link_GBps"
        )
    prof = StepProfile(
        tuple(rec.group_bytes),
        tuple(max(0.0, x) for x in fwd),
        tuple(max(0.0, x) for x in bwd),
        store,
        load,
        max(0.0, head),
    )
    return prof, timer
