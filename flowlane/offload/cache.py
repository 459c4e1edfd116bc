"""The SSDTrain tensor cache (seed 003 §5.3, Algorithms 5.1 and 5.2; digest research/003 §2.2, §2.6).

Saved activations are replaced on the autograd graph by small handles (``torch.autograd.graph.saved_tensors_hooks``).
During forward a pack hook hands each activation's *storage* to a FIFO store pool; during backward each layer's
storages are prefetched just before the layer's backward and released just after it.

Design choices where the thesis is silent or wrong (digest §2.6):
- identity (A1/A2): one record per untyped *storage* (a monotonic uid kept on the storage object), written once; every
  saved view is rebuilt with ``as_strided`` over the reloaded storage. The thesis' timestamp+shape id collides for
  same-shape views of one storage (q/k/v of a fused QKV) and silently corrupted gradients in a prototype.
- scopes (A7/A8): scope modules get forward pre/post hooks (with kwargs). "Backward begins" and "backward ends" of a
  scope are grad hooks on its output and input tensors: ``register_full_backward_*hook`` ignore keyword inputs, which
  Megatron's TransformerLayer uses. The outermost scopes (transformer layers) are the groups that are prefetched and
  kept. A callback queued on the autograd engine releases whatever is left when a micro-batch's backward ends.
- keep (§5.3.5, Fig. 5.5): the last ``k`` groups of a micro-batch stay in memory *while its backward follows its
  forward*; when another micro-batch runs first (pipeline warm-up) they are stored after all.
- versions (A3): a saved tensor modified in place after packing raises at unpack instead of giving a wrong gradient.
- I/O errors: a failed store keeps the activation in memory (``on_io_error='keep'``) or raises; never a wrong grad.
"""

from __future__ import annotations

import contextlib
import threading
import time
import warnings
import weakref
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from flowlane.offload.adaptive import keep_last_k_from_profile
from flowlane.offload.backends import IOBackend, make_backend
from flowlane.offload.config import OffloadConfig
from flowlane.offload.residency import Residency, mark_parameters, storage_uid

_clock = time.perf_counter


@dataclass
class OffloadStats:
    """Counters of one cache (cumulative; take :meth:`TensorCache.stats_snapshot` differences per step).

    A store still queued on the I/O pool adds its bytes to ``bytes_written`` or ``bytes_cancelled`` when it runs:
    call :meth:`TensorCache.wait_io` first for final byte counts."""

    packs: int = 0
    small_skips: int = 0
    param_skips: int = 0
    cpu_skips: int = 0
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

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


_IO = threading.local()


@contextlib.contextmanager
def _io_stream(device: torch.device) -> Iterator[None]:
    """Run an I/O worker's device copies on that thread's own CUDA stream (on ``device``), so that stores and loads
    overlap the model's kernels instead of queueing behind them on the default stream (thesis §5.3.1: the offloader
    copies asynchronously to compute). Ordering is explicit: a store starts after the producer's event, and a load
    records its completion event on this stream, which the consumer's stream waits for. CPU: nothing to do."""
    if device.type != "cuda":
        yield
        return
    streams = _IO.__dict__.setdefault("streams", {})
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in streams:
        streams[index] = torch.cuda.Stream(device=index)
    with torch.cuda.stream(streams[index]):
        yield


class _Scope:
    __slots__ = ("name", "group", "parent", "begun", "ended", "sids")

    def __init__(self, name: str, group: int, parent: int | None) -> None:
        self.name = name
        self.group = group
        self.parent = parent
        self.begun = False
        self.ended = False
        self.sids: set[int] = set()


class _Stored:
    """One storage of one micro-batch record."""

    __slots__ = ("sid", "nbytes", "device", "group", "scopes", "state", "ref", "weak", "handle", "load_fut",
                 "event", "dirty", "error", "released", "where")

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


class _Record:
    """The cache's state for one micro-batch (one record set per micro-batch, thesis §5.3.2/Fig. 5.5)."""

    def __init__(self, key: Any, family: Any, profiling: bool) -> None:
        self.key = key
        self.family = family
        self.phase = "forward"  # forward | forward_done | backward | done
        self.scopes: list[_Scope] = []
        self.groups: list[list[int]] = []  # group -> scope ids
        self.group_sids: list[set[int]] = []
        self.group_bytes: list[int] = []
        self.group_t0: list[float] = []
        self.group_time: list[float] = []
        self.storages: dict[int, _Stored] = {}
        self.watches: list[tuple[weakref.ref, int, int, str]] = []  # (tensor base, version at pack, sid, desc)
        self.profiling = profiling
        self.store_t0 = float("inf")
        self.store_t1 = 0.0
        self.store_bytes = 0
        self.callback_queued = False
        self.futures: list[Future] = []
        self.released: dict[int, str] = {}  # sid -> why (diagnostics)


class SavedHandle:
    """What the autograd graph holds instead of an offloaded tensor."""

    __slots__ = ("rec", "sid", "shape", "stride", "offset", "dtype", "watch")

    def __init__(self, rec: _Record, sid: int, t: torch.Tensor, watch: int) -> None:
        self.rec = rec
        self.sid = sid
        self.shape = tuple(t.shape)
        self.stride = tuple(t.stride())
        self.offset = t.storage_offset()
        self.dtype = t.dtype
        self.watch = watch


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


def _tensors(obj: Any, depth: int = 0) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif depth < 2 and isinstance(obj, (list, tuple)):
        for o in obj:
            yield from _tensors(o, depth + 1)
    elif depth < 2 and isinstance(obj, dict):
        for o in obj.values():
            yield from _tensors(o, depth + 1)


def _bytes_view(st: torch.UntypedStorage, device: torch.device) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=device).set_(st)


class TensorCache:
    """SSDTrain's tensor cache. Framework-neutral: plugins call :meth:`add_scope`, :meth:`register_parameters`,
    :meth:`activate` and (optionally) the schedule hints ``forward_begin/forward_end/backward_begin/backward_end/
    prefetch_last_module`` (Alg. 5.1). Without hints every forward starts a new record and the autograd engine's
    end-of-backward callback closes it.
    """

    def __init__(self, config: OffloadConfig | None = None, rank: int = 0,
                 backend: IOBackend | None = None) -> None:
        self.config = config or OffloadConfig()
        self.config.validate()
        self.rank = rank
        self.backend = backend if backend is not None else make_backend(self.config, rank)
        self.stats = OffloadStats(keep_last_k=self.config.keep_last_k)
        self._k = self.config.keep_last_k
        self._lock = threading.RLock()
        self._store_pool = ThreadPoolExecutor(self.config.store_workers, thread_name_prefix="flowlane-store")
        self._load_pool = ThreadPoolExecutor(self.config.load_workers, thread_name_prefix="flowlane-load")
        self._records: dict[Any, _Record] = {}
        self._current: _Record | None = None
        self._auto_key = 0
        self._stack: list[tuple[_Record, int] | None] = []
        self._ngroups: dict[Any, int] = {}
        self._module_handles: list[Any] = []
        self._hooks_ctx: Any = None
        self._error: BaseException | None = None
        self._warned_fallback = False
        self._resident = Residency()
        self._resident_all = Residency()
        self._closed = False
        self._outstanding: set[Future] = set()

    # ------------------------------------------------------------------------------------------ setup
    def register_parameters(self, params: Iterable[torch.nn.Parameter]) -> None:
        """Exclude parameters and every view of them (``W.t()``) from offloading (thesis §5.3.3)."""
        mark_parameters(list(params))

    def add_scope(self, module: torch.nn.Module, name: str | None = None) -> None:
        """Make ``module`` a scope (Alg. 5.2 lines 1-10). Outermost scopes are the prefetch/keep groups."""
        label = name or type(module).__name__
        self._module_handles.append(module.register_forward_pre_hook(
            lambda m, a, kw: self._scope_pre(label, a, kw), with_kwargs=True))
        self._module_handles.append(module.register_forward_hook(
            lambda m, a, kw, out: self._scope_post(out), with_kwargs=True, always_call=True))

    def activate(self) -> TensorCache:
        """Install the pack/unpack hooks in this thread (forward must run in it)."""
        if self._hooks_ctx is None:
            self._hooks_ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
            self._hooks_ctx.__enter__()
        return self

    def deactivate(self) -> None:
        if self._hooks_ctx is not None:
            self._hooks_ctx.__exit__(None, None, None)
            self._hooks_ctx = None

    def __enter__(self) -> TensorCache:
        return self.activate()

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        """Remove hooks, wait for I/O, drop every record and delete the run directories."""
        if self._closed:
            return
        self._closed = True
        self.deactivate()
        for h in self._module_handles:
            h.remove()
        self._module_handles.clear()
        with contextlib.suppress(RuntimeError, OSError):  # closing must not fail on an I/O error already reported
            self.wait_io()
        self._store_pool.shutdown(wait=True)
        self._load_pool.shutdown(wait=True)
        with self._lock:
            for rec in list(self._records.values()):
                self._finish_backward(rec)
        self.backend.close()

    # ------------------------------------------------------------------------------------------ hints (Alg. 5.1)
    @property
    def keep_last_k(self) -> int:
        return self._k

    def forward_begin(self, key: Any) -> None:
        """A micro-batch's forward starts (``set_stage``). Stores other micro-batches' kept layers: their backward
        does not follow immediately (thesis Fig. 5.5)."""
        self._raise_pending_error()
        with self._lock:
            old = self._records.get(key)
            if old is not None and old.phase != "done":
                self._finish_backward(old)
            rec = self._new_record(key)
            self._flush_others(rec)
            self._current = rec

    def forward_end(self, key: Any, next_is_own_backward: bool | None = None) -> None:
        """The forward of ``key`` is done. ``next_is_own_backward=False`` stores its kept layers now."""
        with self._lock:
            rec = self._records.get(key)
            if rec is None:
                return
            if self._current is rec:
                self._current = None
            self._complete_forward(rec)
            if next_is_own_backward is False:
                self._flush_kept(rec)

    def backward_begin(self, key: Any) -> None:
        """The backward of ``key`` starts; other micro-batches' kept layers are stored."""
        self._raise_pending_error()
        with self._lock:
            rec = self._records.get(key)
            if rec is None:
                return
            self._enter_backward(rec)

    def backward_end(self, key: Any) -> None:
        """The backward of ``key`` is done: release what module hooks did not (digest A8)."""
        with self._lock:
            rec = self._records.get(key)
            if rec is not None:
                self._finish_backward(rec)
        self._raise_pending_error()

    def prefetch_last_module(self, key: Any) -> None:
        """Start loading the last offloaded layer of ``key`` (Alg. 5.1 lines 12-13: while receiving its output
        gradient)."""
        with self._lock:
            rec = self._records.get(key)
            if rec is None:
                return
            for g in range(len(rec.group_sids) - 1, -1, -1):
                if any(rec.storages[s].ref is None for s in rec.group_sids[g] if s in rec.storages):
                    self._ensure_loading(rec, rec.group_sids[g])
                    break

    def wait_io(self) -> None:
        """Join the outstanding store and load jobs (Alg. 5.1 line 15)."""
        with self._lock:
            futs = list(self._outstanding)
        for f in futs:
            f.exception()
        self._raise_pending_error()

    def stats_snapshot(self) -> OffloadStats:
        with self._lock:
            s = OffloadStats(**{k: v for k, v in self.stats.as_dict().items()})
            s.peak_resident_bytes = self._resident.peak
            s.peak_resident_all_bytes = self._resident_all.peak
            return s

    def reset_peak(self) -> None:
        self._resident.reset_peak()
        self._resident_all.reset_peak()

    @property
    def resident_bytes(self) -> int:
        return self._resident.current

    # ------------------------------------------------------------------------------------------ records
    def _new_record(self, key: Any) -> _Record:
        family = key[0] if isinstance(key, tuple) and key else "default"
        profiling = self.config.adaptive and self.stats.records == self.config.profile_step
        rec = _Record(key, family, profiling)
        self._records[key] = rec
        self.stats.records += 1
        return rec

    def _forward_record(self) -> _Record:
        rec = self._current
        if rec is not None and rec.phase == "forward":
            return rec
        self._auto_key += 1
        rec = self._new_record(("auto", self._auto_key))
        self._flush_others(rec)
        self._current = rec
        return rec

    def _flush_others(self, rec: _Record) -> None:
        for other in self._records.values():
            if other is not rec and other.phase in ("forward", "forward_done"):
                self._flush_kept(other)

    def _complete_forward(self, rec: _Record) -> None:
        if rec.phase != "forward":
            return
        rec.phase = "forward_done"
        self._ngroups[rec.family] = len(rec.groups)
        self._check_versions(rec)
        if rec.profiling:
            self._finish_profile(rec)

    def _enter_backward(self, rec: _Record) -> None:
        if rec.phase == "backward":
            return
        if self._current is rec:
            self._current = None
        self._complete_forward(rec)
        rec.phase = "backward"
        self._flush_others(rec)

    def _finish_backward(self, rec: _Record) -> None:
        if rec.phase == "done":
            return
        rec.phase = "done"
        if self._current is rec:
            self._current = None
        for st in list(rec.storages.values()):
            self._release(rec, st)
        if self._records.get(rec.key) is rec:
            del self._records[rec.key]

    def _effective_k(self, rec: _Record) -> int:
        return 0 if rec.profiling else self._k

    # ------------------------------------------------------------------------------------------ scope hooks
    def _scope_pre(self, name: str, args: tuple, kwargs: dict) -> None:
        if not torch.is_grad_enabled() or _in_backward():
            self._stack.append(None)  # recomputation inside backward: tensors are kept (Alg. 5.2 line 15)
            return
        with self._lock:
            rec = self._forward_record()
            parent = next((e[1] for e in reversed(self._stack) if e is not None and e[0] is rec), None)
            if parent is None:
                group = len(rec.groups)
                rec.groups.append([])
                rec.group_sids.append(set())
                rec.group_bytes.append(0)
                rec.group_t0.append(_clock())
                rec.group_time.append(0.0)
                self._on_group_start(rec, group)
            else:
                group = rec.scopes[parent].group
            sid = len(rec.scopes)
            rec.scopes.append(_Scope(name, group, parent))
            rec.groups[group].append(sid)
        self._stack.append((rec, sid))
        hook = self._end_hook(rec, sid)
        for t in _tensors((args, kwargs)):
            # only graph-local tensors: a hook on a leaf (a parameter passed in or returned, like Megatron's
            # skip-bias-add biases) would fire in every later backward and outlive this micro-batch
            if t.requires_grad and t.grad_fn is not None:
                t.register_hook(hook)

    def _scope_post(self, out: Any) -> None:
        top = self._stack.pop() if self._stack else None
        if top is None:
            return
        rec, sid = top
        hook = self._begin_hook(rec, sid)
        seen: set[int] = set()
        for t in _tensors(out):
            if not t.requires_grad:
                continue
            # a node pre-hook runs after the tensor hooks of the same node, i.e. after the *end* hook that the next
            # layer put on this tensor: the next layer is released before this one prefetches its predecessor
            if t.grad_fn is not None and id(t.grad_fn) not in seen:
                seen.add(id(t.grad_fn))
                t.grad_fn.register_prehook(lambda grad_outputs, _h=hook: _h(None))
        sc = rec.scopes[sid]
        if sc.parent is None:
            rec.group_time[sc.group] = _clock() - rec.group_t0[sc.group]
        if self.config.check_versions:
            self._check_versions(rec)

    def _begin_hook(self, rec: _Record, sid: int) -> Any:
        def hook(grad: torch.Tensor | None) -> None:
            self._scope_backward_begin(rec, sid)
        return hook

    def _end_hook(self, rec: _Record, sid: int) -> Any:
        def hook(grad: torch.Tensor) -> None:
            self._scope_backward_end(rec, sid)
        return hook

    def _scope_backward_begin(self, rec: _Record, sid: int) -> None:
        """``full_backward_pre_hook``: prefetch this layer and the next one in backward order (Alg. 5.2 l.5-6)."""
        with self._lock:
            if rec.phase == "done":
                return
            self._enter_backward(rec)
            if not rec.callback_queued:
                rec.callback_queued = True
                torch.autograd.Variable._execution_engine.queue_callback(lambda: self._on_engine_done(rec))
            sc = rec.scopes[sid]
            if sc.begun:
                return
            sc.begun = True
            self._ensure_loading(rec, rec.group_sids[sc.group])
            if sc.group > 0:
                self._ensure_loading(rec, rec.group_sids[sc.group - 1])

    def _on_engine_done(self, rec: _Record) -> None:
        with self._lock:
            self._finish_backward(rec)

    def _scope_backward_end(self, rec: _Record, sid: int) -> None:
        """``full_backward_hook``: drop this scope from its tensors; release those no scope uses (Alg. 5.2 l.7-10)."""
        with self._lock:
            sc = rec.scopes[sid]
            if sc.ended or rec.phase == "done":
                return
            sc.ended = True
            for s in sc.sids:
                st = rec.storages.get(s)
                if st is None:
                    continue
                st.scopes.discard(sid)
                if not st.scopes:
                    rec.released[s] = f" after the backward of {sc.name}#{sid}"
                    self._release(rec, st)

    def _on_group_start(self, rec: _Record, group: int) -> None:
        """Without a known layer count, kept layers are decided late: store groups that are now >= k behind."""
        k = self._effective_k(rec)
        if k > 0 and rec.family not in self._ngroups:
            self._flush_kept(rec, upto_group=group - k)

    # ------------------------------------------------------------------------------------------ pack / unpack
    def _pack(self, t: torch.Tensor) -> Any:
        """Alg. 5.2 lines 11-18."""
        self.stats.packs += 1
        if self._error is not None:
            self._raise_pending_error()
        if not isinstance(t, torch.Tensor) or isinstance(t, torch.nn.Parameter) or t.layout != torch.strided:
            return t
        if t.device.type == "cpu" and not self.config.offload_cpu_tensors:
            self.stats.cpu_skips += 1
            return t
        st = t.untyped_storage()
        if getattr(st, "_flowlane_param", False):
            self.stats.param_skips += 1
            return t
        if t.numel() * t.element_size() < self.config.min_bytes:
            self.stats.small_skips += 1
            return t
        if st.nbytes() % t.element_size() != 0:
            return t  # cannot rebuild a view of a storage that is not a whole number of elements
        self._resident_all.add(st)
        if _in_backward():
            self.stats.backward_packs += 1  # recomputation in backward: kept (Alg. 5.2 line 15, condition b)
            return t
        top = self._stack[-1] if self._stack else None
        if top is None or top[0].phase != "forward":
            self.stats.outside_scope += 1  # digest A7: tensors outside every scope are kept
            return t
        rec, scope_id = top
        with self._lock:
            uid = storage_uid(st)
            sc = rec.scopes[scope_id]
            sc.sids.add(uid)
            stored = rec.storages.get(uid)
            if stored is not None:
                self.stats.dedup_hits += 1  # another view of a storage already recorded (thesis §5.3.3)
                stored.scopes.add(scope_id)
            else:
                stored = _Stored(uid, st.nbytes(), t.device, sc.group, f"{sc.name}#{scope_id}")
                stored.scopes.add(scope_id)
                rec.storages[uid] = stored
                rec.group_sids[sc.group].add(uid)
                rec.group_bytes[sc.group] += stored.nbytes
                self.stats.storages_tracked += 1
                self._resident.add(st)
                base = _bytes_view(st, t.device)
                if t.is_cuda:
                    stored.event = torch.cuda.Event()
                    stored.event.record()
                if self._keep_now(rec, sc.group):
                    stored.state = "kept"
                    stored.ref = base
                    self.stats.storages_kept += 1
                else:
                    self._submit_store(rec, stored, base, st)
            watch = -1
            if self.config.check_versions:
                root = t._base if t._base is not None else t
                watch = len(rec.watches)
                rec.watches.append((weakref.ref(root), t._version, uid,
                                    f"{tuple(t.shape)} {t.dtype} saved in {sc.name}"))
            return SavedHandle(rec, uid, t, watch)

    def _keep_now(self, rec: _Record, group: int) -> bool:
        k = self._effective_k(rec)
        if k <= 0:
            return False
        n = self._ngroups.get(rec.family)
        if n is None:
            return True  # decided at later group starts (_on_group_start) or at the next stage
        return group >= n - k

    def _unpack(self, h: Any) -> torch.Tensor:
        """Alg. 5.2 lines 19-22."""
        if isinstance(h, torch.Tensor):
            return h
        rec: _Record = h.rec
        with self._lock:
            st = rec.storages.get(h.sid)
            if st is None:
                raise RuntimeError(
                    f"flowlane offload: a saved activation {h.shape} {h.dtype} of micro-batch {rec.key!r} (phase "
                    f"{rec.phase}) was already released{rec.released.get(h.sid, '')} (was backward run twice over "
                    "an offloaded graph? retain_graph=True is not supported with activation offloading)")
            if h.watch >= 0:
                self._check_watch(rec, h.watch)
            if st.dirty is not None:
                self.stats.version_errors += 1
                raise RuntimeError(
                    f"flowlane offload: one of the variables needed for gradient computation has been modified by an "
                    f"inplace operation after it was saved ({st.dirty}); the offloaded copy would give a wrong "
                    "gradient")
            base = self._materialize(rec, st)
        if base.is_cuda and st.event is not None and st.state == "loaded":
            torch.cuda.current_stream().wait_event(st.event)
            base.record_stream(torch.cuda.current_stream())
        return torch.as_strided(base.view(h.dtype), h.shape, h.stride, h.offset)

    def _materialize(self, rec: _Record, st: _Stored) -> torch.Tensor:
        if st.ref is not None:
            return st.ref
        fwd = self._try_forward(st)
        if fwd is not None:
            return fwd
        fut = st.load_fut
        if fut is None:
            self.stats.sync_loads += 1  # not prefetched: a hook did not fire or the order differs
            fut = self._submit_load(rec, st)
        self._lock.release()
        try:
            fut.result()
        finally:
            self._lock.acquire()
        if st.ref is None:
            err = st.error
            raise RuntimeError(f"flowlane offload: reading back a saved activation ({st.nbytes} bytes, "
                               f"{st.where}) failed: {err}; the gradient cannot be computed") from err
        return st.ref

    def _try_forward(self, st: _Stored) -> torch.Tensor | None:
        """Forwarding (thesis §5.3.4): a tensor still in memory (being written, or alive elsewhere) is reused."""
        if st.state in ("storing", "stored") and st.weak is not None:
            s = st.weak()
            if s is not None:
                st.ref = _bytes_view(s, st.device)
                st.state = "loaded"
                st.event = None
                self.stats.forwards += 1
                return st.ref
        return None

    # ------------------------------------------------------------------------------------------ versions
    def _check_watch(self, rec: _Record, i: int) -> None:
        ref, version, sid, desc = rec.watches[i]
        t = ref()
        if t is not None and t._version != version:
            st = rec.storages.get(sid)
            if st is not None and st.dirty is None:
                st.dirty = f"{desc}: version {version} at save, {t._version} now"

    def _check_versions(self, rec: _Record) -> None:
        if not self.config.check_versions:
            return
        for i in range(len(rec.watches)):
            self._check_watch(rec, i)

    # ------------------------------------------------------------------------------------------ store / load
    def _flush_kept(self, rec: _Record, upto_group: int | None = None) -> None:
        if rec.phase in ("backward", "done"):
            return
        for st in rec.storages.values():
            if st.state == "kept" and (upto_group is None or st.group <= upto_group):
                base = st.ref
                st.ref = None
                s = base.untyped_storage()
                self._submit_store(rec, st, base, s)

    def _submit_store(self, rec: _Record, st: _Stored, base: torch.Tensor, storage: torch.UntypedStorage) -> None:
        st.state = "storing"
        st.weak = weakref.ref(storage)
        self.stats.storages_offloaded += 1
        fut = self._store_pool.submit(self._store_job, rec, st, base)
        self._track(rec, fut)

    def _store_job(self, rec: _Record, st: _Stored, base: torch.Tensor) -> None:
        with self._lock:
            if st.released or st.ref is not None:
                self.stats.cancellations += 1  # forwarded or released before the write began (thesis §5.3.5)
                self.stats.bytes_cancelled += st.nbytes
                if st.state == "storing":
                    st.state = "loaded" if st.ref is not None else "stored"
                return
        t0 = _clock()
        if st.event is not None:
            st.event.synchronize()  # the producer kernel must have finished (digest A4)
        try:
            with _io_stream(base.device):
                handle = self.backend.write(f"{_key_str(rec.key)}-s{st.sid}", base)
        except Exception as e:  # noqa: BLE001 - any failure must leave "storing", or a load would wait forever
            self._on_store_error(rec, st, base, e)
            return
        t1 = _clock()
        with self._lock:
            st.handle = handle
            self.stats.bytes_written += st.nbytes
            if rec.profiling:
                rec.store_t0 = min(rec.store_t0, t0)
                rec.store_t1 = max(rec.store_t1, t1)
                rec.store_bytes += st.nbytes
            if st.state == "storing":
                st.state = "stored"
            if st.released:
                self.backend.delete(handle)
                st.handle = None

    def _on_store_error(self, rec: _Record, st: _Stored, base: torch.Tensor, e: BaseException) -> None:
        with self._lock:
            self.stats.io_errors += 1
            # keep the bytes in memory in both modes, so no unpack can ever see missing or partial data
            if st.ref is None and not st.released:
                st.ref = base
            st.state = "fallback"
            if self.config.on_io_error == "keep":
                self.stats.fallbacks += 1
                if not self._warned_fallback:
                    self._warned_fallback = True
                    warnings.warn(f"flowlane offload: storing an activation failed ({e}); keeping activations in "
                                  f"memory when this happens (offload.on_io_error='keep')", RuntimeWarning,
                                  stacklevel=1)
            elif self._error is None:
                self._error = RuntimeError(
                    f"flowlane offload: writing a saved activation ({st.nbytes} bytes, {st.where}) to "
                    f"{self.backend.describe()} failed: {e}. Free space in the target directories, add more with "
                    f"offload.dirs, or set offload.on_io_error='keep' to keep activations in memory instead")
                self._error.__cause__ = e

    def _raise_pending_error(self) -> None:
        if self._error is not None:
            err, self._error = self._error, None
            raise err

    def _ensure_loading(self, rec: _Record, sids: Iterable[int]) -> None:
        for s in sids:
            st = rec.storages.get(s)
            if st is None or st.ref is not None or st.load_fut is not None or st.released:
                continue
            if self._try_forward(st) is None and st.state in ("storing", "stored"):
                self._submit_load(rec, st)

    def _submit_load(self, rec: _Record, st: _Stored) -> Future:
        fut = self._load_pool.submit(self._load_job, rec, st)
        st.load_fut = fut
        self._track(rec, fut)
        return fut

    def _track(self, rec: _Record, fut: Future) -> None:
        rec.futures.append(fut)
        self._outstanding.add(fut)
        fut.add_done_callback(self._outstanding.discard)

    def _load_job(self, rec: _Record, st: _Stored) -> None:
        with self._lock:
            if st.ref is not None or st.released:
                return
            if self._try_forward(st) is not None:
                return
        # a load may be queued behind the store of the same storage (FIFO pools): wait for the write first
        while True:
            with self._lock:
                if st.state != "storing" or st.ref is not None:
                    break
            time.sleep(0.0002)
        with self._lock:
            if st.ref is not None or st.released:
                return
            handle = st.handle
        if handle is None:
            st.error = RuntimeError("no stored copy exists (the write failed or was cancelled)")
            return
        try:
            with _io_stream(st.device):
                buf = self.backend.read(handle, st.nbytes, st.device)
                if buf.is_cuda:  # on this worker's I/O stream; backward's stream waits for it before the unpack
                    ev = torch.cuda.Event()
                    ev.record()
                else:
                    ev = None
        except Exception as e:  # noqa: BLE001 - recorded and raised at the unpack that needs the tensor
            with self._lock:
                self.stats.io_errors += 1
                st.error = e
            return
        with self._lock:
            self.stats.bytes_read += st.nbytes
            self.stats.loads += 1
            if st.released or st.ref is not None:
                return
            self._resident.add(buf.untyped_storage())
            self._resident_all.add(buf.untyped_storage())
            st.ref = buf
            st.event = ev
            st.state = "loaded"

    def _release(self, rec: _Record, st: _Stored) -> None:
        """Drop the reference and the file (thesis §5.3.4 release)."""
        if st.released:
            return
        st.released = True
        st.ref = None
        st.weak = None
        if st.handle is not None:
            self.backend.delete(st.handle)
            st.handle = None
        rec.storages.pop(st.sid, None)

    def _finish_profile(self, rec: _Record) -> None:
        """Adaptive offloading (thesis §5.3.5): wait for this micro-batch's stores, measure the write bandwidth,
        and choose how many trailing layers to keep from then on."""
        futs = list(rec.futures)
        self._lock.release()
        try:
            for f in futs:
                f.exception()
        finally:
            self._lock.acquire()
        window = rec.store_t1 - rec.store_t0
        bw = rec.store_bytes / window if window > 0 else float("inf")
        res = keep_last_k_from_profile(rec.group_bytes, rec.group_time, bw)
        self._k = res.keep_last_k
        self.stats.keep_last_k = res.keep_last_k
        self.stats.profile = {"sizes": list(res.sizes), "fwd_times_s": list(res.fwd_times),
                              "write_bandwidth_Bps": bw, "last_offloaded": res.last_offloaded,
                              "keep_last_k": res.keep_last_k}


def _key_str(key: Any) -> str:
    s = "_".join(str(k) for k in key) if isinstance(key, tuple) else str(key)
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in s)[:60]


@dataclass
class ScopeSpec:
    """Which modules become scopes: classes by name (digest A7); tensors saved outside any scope are kept."""

    class_names: tuple[str, ...] = field(default_factory=tuple)

    def matches(self, module: torch.nn.Module) -> bool:
        return type(module).__name__ in self.class_names


def install(model: torch.nn.Module | Iterable[torch.nn.Module], config: OffloadConfig,
            scope_classes: Iterable[str], rank: int = 0) -> TensorCache:
    """configure_tensor_cache (Alg. 5.1 lines 1-5) for a framework-neutral model: parameters registered, every
    module whose class name is in ``scope_classes`` made a scope, hooks activated in this thread."""
    models = [model] if isinstance(model, torch.nn.Module) else list(model)
    spec = ScopeSpec(tuple(scope_classes))
    cache = TensorCache(config, rank=rank)
    n = 0
    for m in models:
        cache.register_parameters(m.parameters())
        for mod in m.modules():
            if spec.matches(mod):
                cache.add_scope(mod)
                n += 1
    if n == 0:
        cache.close()
        raise ValueError(f"no module of class {sorted(spec.class_names)} found in the model; offloading would do "
                         "nothing (set scope classes to the model's layer class names)")
    return cache.activate()


class OffloadHandle:
    """What a framework adapter returns from ``install``: the cache (None when offloading is off), its counters,
    and a ``close`` that adapters extend to undo their own patches. A context manager."""

    def __init__(self, cache: TensorCache | None) -> None:
        self.cache = cache

    @property
    def enabled(self) -> bool:
        return self.cache is not None

    @property
    def stats(self) -> OffloadStats:
        return self.cache.stats_snapshot() if self.cache is not None else OffloadStats()

    def wait_io(self) -> None:
        if self.cache is not None:
            self.cache.wait_io()

    def close(self) -> None:
        if self.cache is not None:
            self.cache.close()

    def __enter__(self) -> OffloadHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
