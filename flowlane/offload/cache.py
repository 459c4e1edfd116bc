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

CUDA tiers (``pinned_cpu``, and ``posix`` staged through host memory) never wait on the host in pack or unpack:
a layer's storages are copied in bulk when the layer's forward ends, on a device-to-host stream that waits for the
compute stream's event, into one block of a persistent host pool (``pool.py``); ``record_stream`` keeps the device
memory from reuse until the copy ran (or, with ``release="stream_order"``, the compute stream waits for the copy where
the budget's timeline says it ended and the tensors are dropped there). Reloads of a layer are issued when the
backward of the layer ``prefetch_groups`` after it begins, into buffers from the compute stream's pool, on a
host-to-device stream that waits for the store's event and for the compute stream to reach the point of issue; the
consumer's stream waits for the reload's event. Threads remain only for disk I/O (``posix`` writes each layer's
block with one O_DIRECT write straight from the pool). ``kvikio`` and ``null`` keep the thread path. ``adaptive``
profiles one micro-batch (CUDA events on a GPU, the clock on CPU) and offloads only the byte budget of
``budget.py``; with ``recompute`` the scopes the budget names run their forward under ``torch.utils.checkpoint``
from then on (nothing of theirs is saved; backward runs the forward again).

What the cache knows of one micro-batch (its record, scopes, storages, host blocks) and its counters are in
``record.py``; this module does every transition.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from flowlane.offload.backends import IOBackend, make_backend
from flowlane.offload.budget import Point, choose_plan, release_points
from flowlane.offload.config import OffloadConfig
from flowlane.offload.pool import HostBlock, PinnedPool, align_up
from flowlane.offload.record import (
    OffloadStats,
    Record,
    SavedHandle,
    Scope,
    Slab,
    Stored,
    SubclassHandle,
    measured_profile,
)
from flowlane.offload.residency import Residency, is_flattenable, mark_parameters, plain_tensors, storage_uid

log = logging.getLogger("flowlane.offload")
# per thread: the caches whose hooks are on torch's saved-tensor hooks stack (also thread-local), in push order
_hook_owners = threading.local()

_clock = time.perf_counter


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


def _owners() -> list[TensorCache]:
    owners = getattr(_hook_owners, "caches", None)
    if owners is None:
        owners = _hook_owners.caches = []
    return owners


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


def _first_device(*objs: Any) -> torch.device | None:
    for t in _tensors(objs):
        return t.device
    return None


def _timing_event(device: torch.device | None) -> Any:
    """A CUDA timing event recorded on the current stream (profiling on a GPU), or None off the GPU."""
    if device is None or device.type != "cuda":
        return None
    ev = torch.cuda.Event(enable_timing=True)
    ev.record()
    return ev


def _bytes_view(st: torch.UntypedStorage, device: torch.device) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=device).set_(st)


def recompute_forward(
    forward: Callable[..., Any], *args: Any, context_fn: Callable[[], Any] | None = None, **kwargs: Any
) -> Any:
    """Run ``forward`` saving only its inputs; backward runs it again (``torch.utils.checkpoint``, non-reentrant:
    keyword arguments pass through, and the CPU and CUDA random states are restored for the second run).
    ``context_fn``: checkpoint's pair of context managers (first run, second run), for other random state."""
    import torch.utils.checkpoint

    extra = {} if context_fn is None else {"context_fn": context_fn}
    return torch.utils.checkpoint.checkpoint(forward, *args, use_reentrant=False, **extra, **kwargs)


def recompute_with_rng_tracker(get_tracker: Callable[[], Any]) -> Callable[..., Any]:
    """A ``checkpoint`` for :class:`TensorCache` that also restores a model-parallel RNG tracker (an object with
    ``get_states()`` / ``set_states(states)``, as Megatron-core's and DeepSpeed's are) around the second run, as their
    own activation checkpointing does: dropout inside tensor-parallel regions draws from the tracker, and a second run
    from a moved state would drop other elements than the first and give wrong gradients."""

    def checkpoint(forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        at_forward: dict[str, Any] = {}

        @contextlib.contextmanager
        def first_run() -> Iterator[None]:
            at_forward["states"] = get_tracker().get_states()
            yield

        @contextlib.contextmanager
        def second_run() -> Iterator[None]:
            tracker = get_tracker()
            now = tracker.get_states()
            tracker.set_states(at_forward["states"])
            try:
                yield
            finally:
                tracker.set_states(now)

        return recompute_forward(forward, *args, context_fn=lambda: (first_run(), second_run()), **kwargs)

    return checkpoint


class TensorCache:
    """SSDTrain's tensor cache. Framework-neutral: plugins call :meth:`add_scope`, :meth:`register_parameters`,
    :meth:`activate` and (optionally) the schedule hints ``forward_begin/forward_end/backward_begin/backward_end/
    prefetch_last_module`` (Alg. 5.1). Without hints every forward starts a new record and the autograd engine's
    end-of-backward callback closes it.
    """

    def __init__(
        self,
        config: OffloadConfig | None = None,
        rank: int = 0,
        backend: IOBackend | None = None,
        bulk_on_cpu: bool = False,
        checkpoint: Callable[..., Any] | None = None,
    ) -> None:
        """``bulk_on_cpu`` (tests): CPU tensors take the CUDA tiers' bulk path too (copies are synchronous there),
        so that its bookkeeping, pool and O_DIRECT writes run in CPU CI. ``checkpoint(forward, *args, **kwargs)``
        runs a layer the budget recomputes (``recompute``); default :func:`recompute_forward` (a framework with its
        own random-number state, like Megatron's model-parallel RNG tracker, passes one that restores it)."""
        self.config = config or OffloadConfig()
        self.config.validate()
        self.rank = rank
        self.backend = backend if backend is not None else make_backend(self.config, rank)
        # CUDA tiers with bulk copies: pinned host memory, and posix staged through it (kvikio and null: threads)
        self._bulk_backend = self.backend.name == "pinned_cpu" or (
            self.backend.name == "posix" and hasattr(self.backend, "write_block")
        )
        if self.config.release == "stream_order" and not self._bulk_backend:
            if backend is None:
                self.backend.close()  # made here: its run directory goes with the refusal
            raise ValueError(
                f"offload.release='stream_order' applies to the bulk tiers (pinned_cpu, posix), not to the "
                f"{self.backend.name} backend, whose stores run on threads; use release='record_stream'"
            )
        self.stats = OffloadStats(keep_last_k=self.config.keep_last_k)
        self._k = self.config.keep_last_k
        self._lock = threading.RLock()
        self._store_pool = ThreadPoolExecutor(self.config.store_workers, thread_name_prefix="flowlane-store")
        self._load_pool = ThreadPoolExecutor(self.config.load_workers, thread_name_prefix="flowlane-load")
        self._records: dict[Any, Record] = {}
        self._current: Record | None = None
        self._auto_key = 0
        # layer-block files are named by record key, which a pipeline reuses every step (DeepSpeed's buffer id):
        # a cache-wide serial keeps a new block from meeting the old file its unlink thread has not deleted yet
        self._slab_serial = itertools.count()
        self._stack: list[tuple[Record, int] | None] = []
        self._ngroups: dict[Any, int] = {}
        self._module_handles: list[Any] = []
        self._hooks_ctx: Any = None
        self._hooks_leaving = False  # deactivated while a cache activated later is still on the stack above
        self._error: BaseException | None = None
        self._warned_fallback = False
        self._first_backward_seen = False
        self._resident = Residency()
        self._resident_all = Residency()
        self._closed = False
        self._outstanding: set[Future] = set()
        self._bulk_on_cpu = bulk_on_cpu
        self._pool: PinnedPool | None = None
        # device index -> (device-to-host, host-to-device) stream
        self._streams: dict[int, tuple[Any, Any]] = {}
        self._allow: dict[Any, list[int]] = {}  # family -> bytes per group the budget offloads (adaptive)
        self._prefetch = self.config.prefetch_groups  # layers reloaded ahead (adaptive: the budget's choice)
        # family -> host block size per layer (to size the pool before profiling)
        self._warm: dict[Any, list[int]] = {}
        self._checkpoint = checkpoint or recompute_forward
        # family -> layers recomputed in backward (``recompute``)
        self._recompute: dict[Any, frozenset[int]] = {}
        # family -> per layer, the hook point where its stored tensors are dropped (``release="stream_order"``)
        self._release_at: dict[Any, tuple[Point | None, ...]] = {}
        # scopes whose forward is wrapped: (module, whether it had an instance forward of its own)
        self._forwards: list[tuple[torch.nn.Module, bool]] = []

    # ------------------------------------------------------------------------------------------ setup
    def register_parameters(self, params: Iterable[torch.nn.Parameter]) -> None:
        """Exclude parameters and every view of them (``W.t()``) from offloading (thesis §5.3.3); a DTensor
        parameter by its local tensor. A subclass parameter that cannot be flattened is refused (see ``_pack``)."""
        params = list(params)
        for p in params:
            if plain_tensors(p) is None:
                raise TypeError(
                    _subclass_msg(p.data if isinstance(p, torch.nn.Parameter) else p, "a parameter")
                )
        mark_parameters(params)

    def add_scope(self, module: torch.nn.Module, name: str | None = None) -> None:
        """Make ``module`` a scope (Alg. 5.2 lines 1-10). Outermost scopes are the prefetch/keep groups."""
        label = name or type(module).__name__
        if self.config.recompute:
            own = "forward" in module.__dict__  # an instance attribute already (restored as it was by close)
            module.forward = functools.partial(self._forward_or_recompute, module.forward)
            self._forwards.append((module, own))
        self._module_handles.append(
            module.register_forward_pre_hook(
                lambda m, a, kw: self._scope_pre(label, m, a, kw), with_kwargs=True
            )
        )
        self._module_handles.append(
            module.register_forward_hook(
                lambda m, a, kw, out: self._scope_post(out), with_kwargs=True, always_call=True
            )
        )

    def activate(self) -> TensorCache:
        """Install the pack/unpack hooks in this thread (forward must run in it)."""
        if self._hooks_ctx is None:
            self._hooks_ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
            self._hooks_ctx.__enter__()
            _owners().append(self)
        self._hooks_leaving = False
        return self

    def deactivate(self) -> None:
        """Take the hooks off this thread's stack. Torch pops whichever hooks are on top: while a cache activated
        later is still active this one only stops packing, and leaves the stack when the caches above it do."""
        if self._hooks_ctx is None:
            return
        self._hooks_leaving = True
        owners = _owners()
        if self not in owners:
            return  # activated in another thread: its hooks stay there, inert
        while owners and owners[-1]._hooks_leaving:
            top = owners.pop()
            top._hooks_ctx.__exit__(None, None, None)
            top._hooks_ctx = None

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
        for module, own in reversed(self._forwards):
            wrapper = module.__dict__.get("forward")
            if own and isinstance(wrapper, functools.partial):
                module.forward = wrapper.args[0]
            else:
                module.__dict__.pop("forward", None)
        self._forwards.clear()
        # closing must not fail on an I/O error already reported
        with contextlib.suppress(RuntimeError, OSError):
            self.wait_io()
        self._store_pool.shutdown(wait=True)
        self._load_pool.shutdown(wait=True)
        with self._lock:
            for rec in list(self._records.values()):
                self._finish_backward(rec)
        for d2h, h2d in self._streams.values():
            d2h.synchronize()
            h2d.synchronize()
        if self._pool is not None:
            self._pool.clear()
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
            s.pool = self._pool.stats() if self._pool is not None else None
            return s

    def reset_peak(self) -> None:
        self._resident.reset_peak()
        self._resident_all.reset_peak()

    @property
    def resident_bytes(self) -> int:
        return self._resident.current

    # ------------------------------------------------------------------------------------------ records
    def _new_record(self, key: Any) -> Record:
        family = key[0] if isinstance(key, tuple) and key else "default"
        profiling = self.config.adaptive and self.stats.records == self.config.profile_step
        rec = Record(key, family, profiling)
        self._records[key] = rec
        self.stats.records += 1
        if profiling and self._pool is not None and family in self._warm:
            self._prewarm(self._warm[family])
        return rec

    def _prewarm(self, sizes: list[int]) -> None:
        """Size the host pool for a micro-batch that offloads every layer before it is profiled (thesis §5.3.1:
        the pool's size comes from profiling the first step): pinning memory inside the profiled step stalls the
        host, and the stall would be timed as compute (a first H200 run measured a 0.48 s "head" this way and chose
        a budget that cost 1.20x)."""
        pool = self._host_pool()
        got: list[HostBlock] = []
        try:
            for n in sizes:
                if n > 0:
                    got.append(pool.acquire(n))
        except (OSError, RuntimeError):
            pass  # a bounded pool: whatever fits; the profiled step falls back for the rest as usual
        for blk in got:
            pool.release(blk, blk.ready)

    def _forward_record(self) -> Record:
        rec = self._current
        if rec is not None and rec.phase == "forward":
            return rec
        for other in list(self._records.values()):
            # an automatic record's backward ends with the engine's callback, which never runs when backward
            # raised (an OOM caught to skip the batch): its files and reloaded layers would stay until close()
            if other.phase == "backward" and isinstance(other.key, tuple) and other.key[:1] == ("auto",):
                self._finish_backward(other)
        self._auto_key += 1
        rec = self._new_record(("auto", self._auto_key))
        self._flush_others(rec)
        self._current = rec
        return rec

    def _flush_others(self, rec: Record) -> None:
        for other in self._records.values():
            if other is not rec and other.phase in ("forward", "forward_done"):
                self._flush_kept(other)

    def _complete_forward(self, rec: Record) -> None:
        if rec.phase != "forward":
            return
        rec.phase = "forward_done"
        self._ngroups[rec.family] = len(rec.groups)
        self._check_versions(rec)
        if self._pool is not None:  # what one block per layer would take: the pool size a profiled step needs
            sizes = [0] * len(rec.groups)
            for st in rec.storages.values():
                sizes[st.group] += align_up(st.nbytes)
            self._warm[rec.family] = sizes
        for g in sorted(rec.pending):  # layers whose forward hook did not run (an exception, a partial layer)
            self._store_bulk(rec, g, rec.pending.pop(g))
        for st in (
            rec.storages.values()
        ):  # kept ones now rely on the weak watches; a write in flight settles itself
            if st.state != "storing":
                self._settle_roots(st)

    def _enter_backward(self, rec: Record) -> None:
        if rec.phase == "backward":
            return
        if self._current is rec:
            self._current = None
        self._complete_forward(rec)
        rec.phase = "backward"
        self._flush_others(rec)

    def _finish_backward(self, rec: Record) -> None:
        if rec.phase == "done":
            return
        was_backward = rec.phase == "backward"
        rec.phase = "done"
        if self._current is rec:
            self._current = None
        if rec.profiling and was_backward:
            self._finish_profile(rec)
            rec.profiling = False
        for point in list(rec.due):
            self._release_due(rec, point)
        for st in list(rec.storages.values()):
            self._release(rec, st)
        if self._records.get(rec.key) is rec:
            del self._records[rec.key]

    def _effective_k(self, rec: Record) -> int:
        return 0 if rec.profiling else self._k

    # ------------------------------------------------------------------------------------------ scope hooks
    def _scope_pre(self, name: str, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        if not torch.is_grad_enabled() or _in_backward():
            self._stack.append(None)  # recomputation inside backward: tensors are kept (Alg. 5.2 line 15)
            return
        with self._lock:
            rec = self._forward_record()
            parent = next((e[1] for e in reversed(self._stack) if e is not None and e[0] is rec), None)
            if parent is None:
                # the parameters as the layer holds them now: FSDP's unsharded ones live in storages it gathered
                # (and frees after the forward); they are parameters too, never activations to copy
                mark_parameters(p for p in module.parameters() if p.numel() > 0)
                group = len(rec.groups)
                rec.groups.append([])
                rec.group_sids.append(set())
                rec.group_bytes.append(0)
                rec.group_t0.append(_clock())
                rec.group_time.append(0.0)
                if rec.profiling:
                    ev = _timing_event(_first_device(args, kwargs))
                    if ev is not None:
                        rec.fwd_ev[group] = (ev, None)
                self._on_group_start(rec, group)
            else:
                group = rec.scopes[parent].group
            sid = len(rec.scopes)
            rec.scopes.append(Scope(name, group, parent))
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
            rec.fwd_end = _clock()
            if sc.group in rec.fwd_ev:
                end = _timing_event(torch.device("cuda"))
                rec.fwd_ev[sc.group] = (rec.fwd_ev[sc.group][0], end)
                rec.fwd_end = end
            with self._lock:
                pend = rec.pending.pop(sc.group, None)
                if pend:
                    self._store_bulk(rec, sc.group, pend)  # the layer's forward is done: one bulk copy
        if self.config.check_versions:
            self._check_versions(rec)

    def _forward_or_recompute(self, forward: Any, *args: Any, **kwargs: Any) -> Any:
        """A scope's forward (``recompute``): under ``torch.utils.checkpoint`` when it is an outermost scope of a
        layer the budget recomputes. Its pre-hook has just pushed the scope; checkpoint's own saved-tensor hooks sit
        inside this cache's, so nothing of the layer is packed here, and backward runs ``forward`` again."""
        top = self._stack[-1] if self._stack else None
        if top is not None:
            rec, sid = top
            sc = rec.scopes[sid]
            if sc.parent is None and not rec.profiling and sc.group in self._recompute.get(rec.family, ()):
                self.stats.recomputed_layers += 1
                return self._checkpoint(forward, *args, **kwargs)
        return forward(*args, **kwargs)

    def _begin_hook(self, rec: Record, sid: int) -> Any:
        def hook(grad: torch.Tensor | None) -> None:
            self._scope_backward_begin(rec, sid)

        return hook

    def _end_hook(self, rec: Record, sid: int) -> Any:
        def hook(grad: torch.Tensor) -> None:
            self._scope_backward_end(rec, sid)

        return hook

    def _scope_backward_begin(self, rec: Record, sid: int) -> None:
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
            if rec.profiling and sc.parent is None:
                now: Any = _clock() if sc.group not in rec.fwd_ev else _timing_event(torch.device("cuda"))
                rec.bwd_t0[sc.group] = now
                if rec.bwd_start is None:
                    rec.bwd_start = now
            if sc.parent is None:  # stored layers whose copies the timeline has ended by now, before reloads
                self._release_due(rec, ("backward", sc.group))
            # this layer, then ``prefetch_groups`` layers ahead in backward order, in stream order
            for g in range(sc.group, max(-1, sc.group - 1 - self._prefetch), -1):
                self._ensure_loading(rec, rec.group_sids[g])

    def _on_engine_done(self, rec: Record) -> None:
        with self._lock:
            if rec.profiling:
                # a layer whose input needs no gradient (the first, fed the batch itself) gets no end hook: its
                # backward ends with the engine's (timed as 0 s before, on an H200's profile)
                for sc in rec.scopes:
                    if sc.parent is None and sc.begun and not sc.ended:
                        self._time_backward_end(rec, sc)
            self._finish_backward(rec)

    def _time_backward_end(self, rec: Record, sc: Scope) -> None:
        if rec.profiling and sc.parent is None and sc.group in rec.bwd_t0:
            t0 = rec.bwd_c0.get(sc.group, rec.bwd_t0[sc.group])
            if isinstance(t0, float):
                rec.bwd_time[sc.group] = _clock() - t0
            else:
                rec.bwd_ev[sc.group] = [t0, _timing_event(torch.device("cuda"))]

    def _scope_backward_end(self, rec: Record, sid: int) -> None:
        """``full_backward_hook``: drop this scope from its tensors; release those no scope uses (Alg. 5.2 l.7-10)."""
        with self._lock:
            sc = rec.scopes[sid]
            if sc.ended or rec.phase == "done":
                return
            sc.ended = True
            self._time_backward_end(rec, sc)
            for s in sc.sids:
                st = rec.storages.get(s)
                if st is None:
                    continue
                st.scopes.discard(sid)
                if not st.scopes:
                    rec.released[s] = f" after the backward of {sc.name}#{sid}"
                    self._release(rec, st)

    def _on_group_start(self, rec: Record, group: int) -> None:
        """Without a known layer count, kept layers are decided late: store groups that are now >= k behind. Stored
        layers due here go back to the allocator (``release="stream_order"``)."""
        self._release_due(rec, ("forward", group))
        k = self._effective_k(rec)
        if k > 0 and rec.family not in self._ngroups:
            self._flush_kept(rec, upto_group=group - k)

    def _release_point(self, rec: Record, group: int) -> Point | None:
        """Where layer ``group``'s stored tensors are dropped (``release="stream_order"``), None: ``record_stream``."""
        if rec.profiling or self.config.release != "stream_order":
            return None
        points = self._release_at.get(rec.family, ())
        point = points[group] if group < len(points) else None
        if point is not None and point in rec.passed:  # stored late (a flush after the layer's end)
            self.stats.ordered_release_misses += 1
            return None
        return point

    def _release_due(self, rec: Record, point: Point) -> None:
        """Drop the stored tensors due at ``point``: the compute stream first waits for their copies' events (the
        timeline says they have fired), so the allocator may hand their blocks to the work that follows in stream
        order (caller holds the lock)."""
        rec.passed.add(point)
        for slab in rec.due.pop(point, ()):
            if slab.hold and slab.d2h_done is not None:
                torch.cuda.current_stream(slab.hold[0].device).wait_event(slab.d2h_done)
            slab.hold = None
            self.stats.ordered_releases += 1

    # ------------------------------------------------------------------------------------------ pack / unpack
    def _pack(self, t: torch.Tensor) -> Any:
        """Alg. 5.2 lines 11-18."""
        if self._hooks_leaving:
            return t
        self.stats.packs += 1
        if self._error is not None:
            self._raise_pending_error()
        return self._pack_tensor(t)

    def _pack_tensor(self, t: torch.Tensor) -> Any:
        if not isinstance(t, torch.Tensor) or isinstance(t, torch.nn.Parameter) or t.layout != torch.strided:
            return t
        if t.is_nested or t.is_conj() or t.is_neg():
            # rebuilt from storage bytes these would lose their structure or their lazy conjugate / negative bit
            # (a silently wrong gradient): kept
            self.stats.lazy_view_skips += 1
            return t
        if type(t) is not torch.Tensor:
            if not is_flattenable(t):
                # RuntimeError: torch turns a TypeError inside an operator into NotImplemented
                raise RuntimeError(_subclass_msg(t, f"a saved activation {tuple(t.shape)}"))
            names, ctx = t.__tensor_flatten__()
            inner = {n: getattr(t, n) for n in names}
            return SubclassHandle(
                t,
                {n: self._pack_tensor(x) if isinstance(x, torch.Tensor) else x for n, x in inner.items()},
                ctx,
            )
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
                stored = Stored(uid, st.nbytes(), t.device, sc.group, f"{sc.name}#{scope_id}")
                stored.scopes.add(scope_id)
                rec.storages[uid] = stored
                rec.group_sids[sc.group].add(uid)
                rec.group_bytes[sc.group] += stored.nbytes
                self.stats.storages_tracked += 1
                self._resident.add(st)
                base = _bytes_view(st, t.device)
                bulk = self._is_bulk(t.device)
                if t.is_cuda and not bulk:
                    stored.event = torch.cuda.Event()
                    stored.event.record()
                keep = self._keep_now(rec, sc.group)
                if not keep and not self._within_budget(rec, sc.group, stored.nbytes):
                    stored.state = "resident"  # the budget is spent: stays on the device, never stored
                    stored.ref = base
                    self.stats.budget_kept += 1
                elif keep:
                    stored.state = "kept"
                    stored.ref = base
                    self.stats.storages_kept += 1
                elif bulk:
                    # copied with the rest of its layer when the layer's forward ends
                    stored.state = "pending"
                    stored.ref = base
                    rec.pending.setdefault(sc.group, []).append(stored)
                else:
                    self._submit_store(rec, stored, base, st)
            watch = -1
            if self.config.check_versions:
                root = t._base if t._base is not None else t
                desc = f"{tuple(t.shape)} {t.dtype} saved in {sc.name}"
                watch = len(rec.watches)
                rec.watches.append((weakref.ref(root), t._version, uid, desc))
                if stored.state in ("kept", "resident", "pending", "storing"):
                    # while the cache holds these bytes the tensor costs no memory: held, so an in-place change
                    # made before the copy is taken is seen even once the layer dropped its last reference
                    stored.roots.append((root, t._version, desc))
            return SavedHandle(rec, uid, t, watch)

    def _is_bulk(self, device: torch.device) -> bool:
        return self._bulk_backend and (device.type == "cuda" or (self._bulk_on_cpu and device.type == "cpu"))

    def _within_budget(self, rec: Record, group: int, nbytes: int) -> bool:
        """``adaptive`` after profiling: offload a layer's storages, in the order they are saved, while they fit in
        the layer's byte allowance (budget.py); the rest stays resident."""
        allow = None if rec.profiling else self._allow.get(rec.family)
        if allow is None:
            return True
        while len(rec.assigned) <= group:
            rec.assigned.append(0)
        if group >= len(allow) or rec.assigned[group] + nbytes > allow[group]:
            return False
        rec.assigned[group] += nbytes
        return True

    def _keep_now(self, rec: Record, group: int) -> bool:
        if not rec.profiling and rec.family in self._allow:
            return False  # the budget decides (it never offloads the last layer: budget.choose_budget)
        k = self._effective_k(rec)
        if k <= 0:
            return False
        n = self._ngroups.get(rec.family)
        if n is None:
            return True  # decided at later group starts (_on_group_start) or at the next stage
        return group >= n - k

    def _say_why_nothing_was_offloaded(self) -> None:
        """At the first backward: a warning naming the reasons when the first forward offloaded nothing (a config
        that silently does nothing is worse than none)."""
        st = self.stats
        if st.storages_tracked or st.packs == 0:
            return
        reasons = [
            f"{n} {what}"
            for n, what in (
                (st.cpu_skips, "on the CPU (set offload_cpu_tensors=True to offload CPU tensors)"),
                (st.small_skips, f"smaller than min_bytes={self.config.min_bytes}"),
                (
                    st.outside_scope,
                    "outside every scope class (pass scope_classes naming the model's layer classes)",
                ),
                (st.param_skips, "parameters (never offloaded)"),
                (st.lazy_view_skips, "nested, or views with a lazy conjugate/negative bit (kept)"),
                (st.backward_packs, "saved during backward (recomputation: kept)"),
            )
            if n
        ]
        log.warning(
            "flowlane offload: the first forward offloaded nothing: of %d saved tensors, %s",
            st.packs,
            "; ".join(reasons) or "none qualified",
        )

    def _unpack(self, h: Any) -> torch.Tensor:
        """Alg. 5.2 lines 19-22."""
        if not self._first_backward_seen:
            self._first_backward_seen = True
            self._say_why_nothing_was_offloaded()
        return self._unpack_handle(h)

    def _unpack_handle(self, h: Any) -> torch.Tensor:
        if isinstance(h, torch.Tensor):
            return h
        if isinstance(h, SubclassHandle):
            inner = {
                n: self._unpack_handle(x) if isinstance(x, (SavedHandle, SubclassHandle)) else x
                for n, x in h.inner.items()
            }
            return h.cls.__tensor_unflatten__(inner, h.ctx, h.size, h.stride)
        rec: Record = h.rec
        with self._lock:
            st = rec.storages.get(h.sid)
            if st is None:
                raise RuntimeError(
                    f"flowlane offload: a saved activation {h.shape} {h.dtype} of micro-batch {rec.key!r} (phase "
                    f"{rec.phase}) was already released{rec.released.get(h.sid, '')} (was backward run twice over "
                    "an offloaded graph? retain_graph=True is not supported with activation offloading)"
                )
            if h.watch >= 0:
                self._check_watch(rec, h.watch)
            if st.dirty is not None:
                self.stats.version_errors += 1
                raise RuntimeError(
                    f"flowlane offload: one of the variables needed for gradient computation has been modified by an "
                    f"inplace operation after it was saved ({st.dirty}); the offloaded copy would give a wrong "
                    "gradient"
                )
            base = self._materialize(rec, st)
            st.unpacked = True
        if base.is_cuda and st.event is not None and st.state == "loaded":
            consumer = torch.cuda.current_stream(base.device)
            consumer.wait_event(st.event)
            base.record_stream(consumer)  # a thread-path reload's memory belongs to its I/O stream's pool
        if rec.profiling and st.group not in rec.bwd_c0:
            # the layer's backward computes from here: its time excludes waiting for the reload, which the
            # profiled step (everything offloaded) may do, so the budget sees compute, not the stall
            rec.bwd_c0[st.group] = _timing_event(base.device) if base.is_cuda else _clock()
        return torch.as_strided(base.view(h.dtype), h.shape, h.stride, h.offset)

    def _materialize(self, rec: Record, st: Stored) -> torch.Tensor:
        if st.ref is not None:
            return st.ref
        fwd = self._try_forward(st)
        if fwd is not None:
            return fwd
        if st.slab is not None:
            return self._materialize_bulk(rec, st)
        fut = st.load_fut
        if fut is None:
            self.stats.sync_loads += 1  # not prefetched: a hook did not fire or the order differs
            fut = self._submit_load(rec, st)
        return self._await_load(st, fut)

    def _await_load(self, st: Stored, fut: Future | None) -> torch.Tensor:
        """Wait for the read ``fut`` (if any) without the lock, then the storage back in memory or the read's error
        (caller holds the lock)."""
        if fut is not None:
            self._lock.release()
            try:
                fut.result()
            finally:
                self._lock.acquire()
        if st.ref is None:
            err = st.error
            raise RuntimeError(
                f"flowlane offload: reading back a saved activation ({st.nbytes} bytes, "
                f"{st.where}) failed: {err}; the gradient cannot be computed"
            ) from err
        return st.ref

    def _try_forward(self, st: Stored) -> torch.Tensor | None:
        """Forwarding (thesis §5.3.4): a tensor still in memory (being written, or alive elsewhere) is reused."""
        if st.state in ("storing", "stored") and st.weak is not None:
            s = st.weak()
            if s is not None:
                st.ref = _bytes_view(s, st.device)
                st.state = "loaded"
                st.event = None
                self.stats.forwards += 1
                if st.slab is not None:
                    self._slab_member_done(st.slab, st.sid)
                return st.ref
        return None

    # ------------------------------------------------------------------------------------------ versions
    def _check_watch(self, rec: Record, i: int) -> None:
        ref, version, sid, desc = rec.watches[i]
        t = ref()
        if t is not None and t._version != version:
            st = rec.storages.get(sid)
            if st is not None and st.dirty is None:
                st.dirty = f"{desc}: version {version} at save, {t._version} now"

    def _check_versions(self, rec: Record) -> None:
        if not self.config.check_versions:
            return
        for i in range(len(rec.watches)):
            self._check_watch(rec, i)

    @staticmethod
    def _settle_roots(st: Stored) -> None:
        """The copy of ``st`` is taken (written, enqueued as a layer's bulk copy) or the forward is over: an in-place
        change before this point is in the copy, so check now and drop the strong references (003 §2.6 A3: the
        tensor is held until its write completes). Later changes are seen through the weak watches."""
        for root, version, desc in st.roots:
            if root._version != version and st.dirty is None:
                st.dirty = f"{desc}: version {version} at save, {root._version} when its copy was taken"
        st.roots.clear()

    # ------------------------------------------------------------------------------------------ store / load
    def _flush_kept(self, rec: Record, upto_group: int | None = None) -> None:
        if rec.phase in ("backward", "done"):
            return
        bulk: dict[int, list[Stored]] = {}
        for st in list(rec.storages.values()):
            if st.state == "kept" and (upto_group is None or st.group <= upto_group):
                if self._is_bulk(st.device):
                    st.state = "pending"
                    bulk.setdefault(st.group, []).append(st)
                    continue
                base = st.ref
                st.ref = None
                s = base.untyped_storage()
                self._submit_store(rec, st, base, s)
        for g, sts in sorted(bulk.items()):
            self._store_bulk(rec, g, sts)

    def _submit_store(
        self, rec: Record, st: Stored, base: torch.Tensor, storage: torch.UntypedStorage
    ) -> None:
        st.state = "storing"
        st.weak = weakref.ref(storage)
        self.stats.storages_offloaded += 1
        # the job takes the tensor out of the list: a worker thread holds its job's arguments until it picks up its
        # next job, and those must not keep a written activation alive (a busy CI host measured 2.25 layers
        # resident for 2 in backward: the last layer's storages, stored but not yet dropped)
        fut = self._store_pool.submit(self._store_job, rec, st, [base])
        self._track(rec, fut)

    def _store_job(self, rec: Record, st: Stored, box: list[torch.Tensor]) -> None:
        base = box.pop()
        with self._lock:
            if st.released or st.ref is not None:
                self.stats.cancellations += 1  # forwarded or released before the write began (thesis §5.3.5)
                self.stats.bytes_cancelled += st.nbytes
                if st.state == "storing":
                    st.state = "loaded" if st.ref is not None else "stored"
                self._settle_roots(st)
                return
        if st.event is not None:
            st.event.synchronize()  # the producer kernel must have finished (digest A4)
        # the write's own time: the budget's rate is bytes over busy I/O time (record.busy_rate)
        t0 = _clock()
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
                rec.store_io.append((t0, t1, st.nbytes))
            if st.state == "storing":
                st.state = "stored"
            self._settle_roots(st)
            if st.released:
                self.backend.delete(handle)
                st.handle = None

    def _on_store_error(self, rec: Record, st: Stored, base: torch.Tensor, e: BaseException) -> None:
        with self._lock:
            # keep the bytes in memory in both modes, so no unpack can ever see missing or partial data
            if st.ref is None and not st.released:
                st.ref = base
            st.state = "fallback"
            self._settle_roots(st)
            self._note_store_error(rec, st.nbytes, st.where, e)

    def _raise_pending_error(self) -> None:
        if self._error is not None:
            err, self._error = self._error, None
            raise err

    def _ensure_loading(self, rec: Record, sids: Iterable[int]) -> None:
        bulk: list[Stored] = []
        for s in sorted(sids):
            st = rec.storages.get(s)
            if st is None or st.ref is not None or st.load_fut is not None or st.released:
                continue
            if self._try_forward(st) is None and st.state in ("storing", "stored"):
                if st.slab is not None:
                    bulk.append(st)
                else:
                    self._submit_load(rec, st)
        if bulk:
            self._load_bulk(rec, bulk)

    def _submit_load(self, rec: Record, st: Stored) -> Future:
        fut = self._load_pool.submit(self._load_job, rec, st)
        st.load_fut = fut
        self._track(rec, fut)
        return fut

    def _track(self, rec: Record, fut: Future) -> None:
        rec.futures.append(fut)
        self._outstanding.add(fut)
        fut.add_done_callback(self._outstanding.discard)

    def _load_job(self, rec: Record, st: Stored) -> None:
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
        t_load = _clock()
        try:
            with _io_stream(st.device):
                buf = self.backend.read(handle, st.nbytes, st.device)
                # on this worker's I/O stream; backward's stream waits for it before the unpack
                if buf.is_cuda:
                    ev = torch.cuda.Event()
                    ev.record()
                else:
                    ev = None
            t_read = _clock()
        except Exception as e:  # noqa: BLE001 - recorded and raised at the unpack that needs the tensor
            with self._lock:
                self.stats.io_errors += 1
                st.error = e
            return
        with self._lock:
            self.stats.bytes_read += st.nbytes
            self.stats.loads += 1
            if rec.profiling:
                rec.load_io.append((t_load, t_read, st.nbytes))
            if st.released or st.ref is not None:
                return
            self._resident.add(buf.untyped_storage())
            self._resident_all.add(buf.untyped_storage())
            st.ref = buf
            st.event = ev
            st.state = "loaded"
            st.reloaded = True

    def _release(self, rec: Record, st: Stored) -> None:
        """Drop the reference and the file (thesis §5.3.4 release)."""
        if st.released:
            return
        st.released = True
        st.roots.clear()
        if st.reloaded and not st.unpacked and st.ref is not None:
            self.stats.unused_loads += 1
            if st.slab is not None and st.event is not None:
                # the reload's memory is the compute stream's (_h2d) and goes back to its pool with this reference,
                # while the copy into it may still be queued: that stream waits for the copy first
                torch.cuda.current_stream(st.device).wait_event(st.event)
        st.ref = None
        st.weak = None
        if st.handle is not None:
            self.backend.delete(st.handle)
            st.handle = None
        if st.slab is not None:
            self._slab_member_done(st.slab, st.sid)
        rec.storages.pop(st.sid, None)

    def _finish_profile(self, rec: Record) -> None:
        """Adaptive offloading (thesis §5.3.5, on a timeline): after the profiled micro-batch's backward, read its
        timings (:func:`record.measured_profile`) and set each layer's byte allowance from
        :func:`budget.choose_plan`."""
        futs = list(rec.futures)
        self._lock.release()
        try:
            for f in futs:
                f.exception()
        finally:
            self._lock.acquire()
        try:
            prof, timer = measured_profile(rec, self.backend.keeps_host_memory, self.config.link_GBps)
            budget, depth = choose_plan(
                prof,
                self.config.prefetch_groups,
                self.config.max_slowdown * prof.step_s,
                self.config.recompute,
            )
        except Exception as e:  # noqa: BLE001 - a profile that cannot be read must not fail the training step
            warnings.warn(
                f"flowlane offload: adaptive profiling could not set a byte budget ({e}); keeping "
                f"keep_last_k={self._k}",
                RuntimeWarning,
                stacklevel=1,
            )
            self.stats.profile = {"error": str(e)}
            return
        self._allow[rec.family] = list(budget.allow_bytes)
        self._recompute[rec.family] = frozenset(i for i, r in enumerate(budget.recompute) if r)
        if self.config.release == "stream_order":
            self._release_at[rec.family] = release_points(prof, budget.allow_bytes, depth, budget.recompute)
        self._prefetch = depth
        self._k = budget.keep_last_k
        self.stats.keep_last_k = budget.keep_last_k
        self.stats.profile = {
            "timer": timer,
            "sizes": list(prof.group_bytes),
            "fwd_times_s": list(prof.fwd_s),
            "bwd_times_s": list(prof.bwd_s),
            "head_s": prof.head_s,
            "write_bandwidth_Bps": prof.store_Bps,
            "read_bandwidth_Bps": prof.load_Bps,
            "prefetch_groups": depth,
            **budget.as_dict(),
            "release_at": [list(pt) if pt else None for pt in self._release_at.get(rec.family, ())],
        }

    # ------------------------------------------------------------------------------------------ bulk tiers
    def _cuda_streams(self, device: torch.device) -> tuple[Any, Any]:
        """(device-to-host, host-to-device) streams of ``device``, created once."""
        idx = device.index if device.index is not None else torch.cuda.current_device()
        if idx not in self._streams:
            self._streams[idx] = (torch.cuda.Stream(device=idx), torch.cuda.Stream(device=idx))
        return self._streams[idx]

    def _host_pool(self) -> PinnedPool:
        if self._pool is None:
            self._pool = PinnedPool(self.config.pinned_pool_bytes, pin=torch.cuda.is_available())
        return self._pool

    def _store_bulk(self, rec: Record, group: int, sts: list[Stored]) -> None:
        """Copy one layer's storages into one host block: on the device-to-host stream after an event of the compute
        stream (no host wait), ``record_stream`` so their device memory is reused only after the copy ran."""
        sts = [st for st in sts if st.state == "pending" and st.ref is not None and not st.released]
        for st in sts:  # the copies below are queued after everything this thread ran so far
            self._settle_roots(st)
        if not sts:
            return
        dev = sts[0].device
        total = sum(align_up(st.nbytes) for st in sts)
        try:
            blk = self._host_pool().acquire(total)
        except (OSError, RuntimeError) as e:  # pool full, or the host cannot pin more memory
            for st in sts:
                self._on_store_error(rec, st, st.ref, e)  # keeps every byte in device memory
            return
        slab = Slab(f"{_key_str(rec.key)}-g{group}-b{next(self._slab_serial)}", blk, sts)
        rec.slabs.append(slab)
        offsets = []
        off = 0
        for st in sts:
            offsets.append(off)
            off += align_up(st.nbytes)
        point = self._release_point(rec, group)
        if point is not None:  # dropped at ``point`` in the compute stream's order, not by record_stream
            slab.hold = [st.ref for st in sts if st.ref is not None]
            rec.due.setdefault(point, []).append(slab)
        if dev.type == "cuda":
            d2h, _ = self._cuda_streams(dev)
            produced = torch.cuda.Event()
            produced.record(torch.cuda.current_stream(dev))
            with torch.cuda.stream(d2h):
                d2h.wait_event(produced)
                if blk.ready is not None:  # the block's previous reload must have read it
                    d2h.wait_event(blk.ready)
                    blk.ready = None
                start = _timing_event(dev) if rec.profiling else None
                for st, o in zip(sts, offsets, strict=True):
                    blk.buf[o : o + st.nbytes].copy_(st.ref, non_blocking=True)
                    if point is None:
                        st.ref.record_stream(d2h)
                done = torch.cuda.Event(enable_timing=rec.profiling)
                done.record(d2h)
            slab.d2h_done = done
            if start is not None:
                slab.t_copy = (start, done)
        else:
            t0 = _clock()
            for st, o in zip(sts, offsets, strict=True):
                blk.buf[o : o + st.nbytes].copy_(st.ref)
            t1 = _clock()
        for st, o in zip(sts, offsets, strict=True):
            st.slab, st.offset = slab, o
            st.weak = weakref.ref(st.ref.untyped_storage())
            st.ref = None
            st.state = "stored"
            self.stats.storages_offloaded += 1
        self.stats.bulk_stores += 1
        if self.backend.keeps_host_memory:  # pinned_cpu: the host block is the tier
            self.stats.bytes_written += slab.payload
            if rec.profiling and dev.type != "cuda":
                rec.store_io.append((t0, t1, slab.payload))
            return
        for st in sts:
            st.state = "storing"
        slab.writing = True
        fut = self._store_pool.submit(self._write_slab, rec, slab)
        slab.write_fut = fut
        self._track(rec, fut)

    def _write_slab(self, rec: Record, slab: Slab) -> None:
        """Disk thread: one large write of the layer's block, straight from the pool (O_DIRECT where possible)."""
        with self._lock:
            blk = slab.block
            if not slab.alive or blk is None:  # every member forwarded or released before the write began
                self.stats.cancellations += 1
                self.stats.bytes_cancelled += slab.payload
                slab.writing = False
                for m in slab.members:
                    if m.state == "storing":
                        m.state = "stored"
                self._slab_cleanup(slab)
                return
        if slab.d2h_done is not None:
            slab.d2h_done.synchronize()  # a disk thread may wait: the bulk copy into the block must be complete
        t0 = _clock()  # the write's own time (record.busy_rate)
        try:
            handle = self.backend.write_block(slab.key, blk.buf, slab.nbytes)  # type: ignore[attr-defined]
        except Exception as e:  # noqa: BLE001 - the host block still holds the bytes: loads read it from there
            with self._lock:
                slab.writing = False
                for m in slab.members:
                    if m.state == "storing":
                        m.state = "stored"
                self._note_store_error(rec, slab.payload, slab.key, e)
                if (
                    not slab.alive
                ):  # every member was reloaded or released while the write ran: nobody frees it
                    self._slab_cleanup(slab)
            return
        t1 = _clock()
        with self._lock:
            slab.writing = False
            slab.handle = handle
            self.stats.bytes_written += slab.payload
            if rec.profiling:
                rec.store_io.append((t0, t1, slab.payload))
            for m in slab.members:
                if m.state == "storing":
                    m.state = "stored"
            self._slab_release_block(slab)
            if not slab.alive:
                self._slab_cleanup(slab)

    def _note_store_error(self, rec: Record, nbytes: int, where: str, e: BaseException) -> None:
        """A failed write (of one storage, or of a layer's host block): its bytes stay in memory (``keep``) or the
        next hint raises."""
        self.stats.io_errors += 1
        if self.config.on_io_error == "keep":
            self.stats.fallbacks += 1
            if not self._warned_fallback:
                self._warned_fallback = True
                warnings.warn(
                    f"flowlane offload: storing an activation failed ({e}); keeping activations in "
                    f"memory when this happens (offload.on_io_error='keep')",
                    RuntimeWarning,
                    stacklevel=1,
                )
        elif self._error is None:
            self._error = RuntimeError(
                f"flowlane offload: writing saved activations ({nbytes} bytes, {where}) to "
                f"{self.backend.describe()} failed: {e}. Free space in the target directories, add more with "
                f"offload.dirs, or set offload.on_io_error='keep' to keep activations in memory instead"
            )
            self._error.__cause__ = e

    def _load_bulk(self, rec: Record, sts: list[Stored]) -> None:
        """Reload storages, one bulk copy per layer block: from the host block when it is still there (pinned tier,
        or a disk write not yet done), else a disk thread reads the block back and then issues the copy."""
        by_slab: dict[int, tuple[Slab, list[Stored]]] = {}
        for st in sts:
            by_slab.setdefault(id(st.slab), (st.slab, []))[1].append(st)  # type: ignore[arg-type]
        dev = sts[0].device if sts else None
        # the stream backward computes on (this thread's: autograd runs a layer's backward on its forward's stream)
        compute = torch.cuda.current_stream(dev) if dev is not None and dev.type == "cuda" else None
        for slab, members in by_slab.values():
            if slab.block is not None:
                self._h2d(rec, slab, members, compute)
            elif slab.handle is not None:
                fut = self._load_pool.submit(self._read_slab, rec, slab, members, compute)
                for m in members:
                    m.load_fut = fut
                self._track(rec, fut)
            else:
                for m in members:
                    m.error = RuntimeError("no stored copy exists (the write failed or was cancelled)")

    def _h2d(self, rec: Record, slab: Slab, members: list[Stored], compute: Any = None) -> None:
        """Issue the host-to-device copies of ``members`` from ``slab.block`` (caller holds the lock).

        On a GPU the destinations come from ``compute``'s memory pool, where the forward's activations of the same
        sizes went back once their stores ran: allocated on the copy stream, they would come from a pool of their own
        and the allocator would hold both (a reserved peak above keeping everything, measured on an H200,
        results/gpu). The caching allocator hands out a block as soon as the compute stream has *queued* its last use,
        so the copy stream first waits for the compute stream to reach this point."""
        blk = slab.block
        assert blk is not None
        members = [m for m in members if m.ref is None and not m.released]
        if not members:
            return
        dev = members[0].device
        outs: list[torch.Tensor] = []
        ev = None
        if dev.type == "cuda":
            _, h2d = self._cuda_streams(dev)
            compute = compute if compute is not None else torch.cuda.current_stream(dev)
            with torch.cuda.stream(compute):
                outs = [torch.empty(m.nbytes, dtype=torch.uint8, device=dev) for m in members]
                reached = torch.cuda.Event()
                reached.record(compute)
            with torch.cuda.stream(h2d):
                h2d.wait_event(reached)
                if slab.d2h_done is not None:
                    h2d.wait_event(slab.d2h_done)  # the store into the block, in stream order
                start = _timing_event(dev) if rec.profiling else None
                for m, d in zip(members, outs, strict=True):
                    d.copy_(blk.buf[m.offset : m.offset + m.nbytes], non_blocking=True)
                ev = torch.cuda.Event(enable_timing=rec.profiling)
                ev.record(h2d)
            slab.last_use = ev
            if start is not None:
                rec.load_spans.append((start, ev, sum(m.nbytes for m in members)))
        else:
            t0 = _clock()
            outs = [blk.buf[m.offset : m.offset + m.nbytes].clone() for m in members]
            if rec.profiling and self.backend.keeps_host_memory:  # an SSD tier timed its disk read instead
                rec.load_io.append((t0, _clock(), sum(m.nbytes for m in members)))
        self.stats.bulk_loads += 1
        for m, d in zip(members, outs, strict=True):
            m.ref = d
            m.event = ev
            m.state = "loaded"
            m.reloaded = True
            m.load_fut = None
            self._resident.add(d.untyped_storage())
            self._resident_all.add(d.untyped_storage())
            self.stats.loads += 1
            self.stats.bytes_read += m.nbytes
            self._slab_member_done(slab, m.sid)

    def _read_slab(self, rec: Record, slab: Slab, members: list[Stored], compute: Any = None) -> None:
        """Disk thread: read a layer's block back into the pool (O_DIRECT where possible), then issue its reload."""
        blk = None
        try:
            blk = self._host_pool().acquire(slab.nbytes)
            blk.wait_ready_on_host()  # its previous GPU copy must be done before the disk writes into it
            t0 = _clock()
            self.backend.read_block(slab.handle, blk.buf, slab.nbytes)  # type: ignore[attr-defined]
            t1 = _clock()
        except Exception as e:  # noqa: BLE001 - recorded and raised at the unpack that needs the tensor
            if blk is not None:
                self._host_pool().release(blk)
            with self._lock:
                self.stats.io_errors += 1
                for m in members:
                    m.error = e
                    m.load_fut = None
            return
        with self._lock:
            if rec.profiling:  # the disk's read rate (the H2D copy is timed by events on a GPU)
                rec.load_io.append((t0, t1, slab.payload))
            if slab.block is None:
                slab.block = blk
            else:
                self._host_pool().release(blk)
            self._h2d(rec, slab, members, compute)
            for m in members:
                m.load_fut = None
            if not slab.alive:
                self._slab_cleanup(slab)

    def _materialize_bulk(self, rec: Record, st: Stored) -> torch.Tensor:
        """Unpack of a bulk-tier storage that is not in memory yet (caller holds the lock)."""
        if st.load_fut is None:
            self.stats.sync_loads += 1  # not prefetched: a hook did not fire or the order differs
            self._load_bulk(rec, [st])
        fut = st.load_fut
        if st.ref is None and fut is not None:
            self.stats.late_loads += 1  # the disk read is still running: the one wait left (SSD tier)
            return self._await_load(st, fut)
        return self._await_load(st, None)

    def _slab_member_done(self, slab: Slab, sid: int) -> None:
        """``sid`` no longer needs the tier's copy (loaded, forwarded or released)."""
        slab.alive.discard(sid)
        if not slab.alive:
            self._slab_cleanup(slab)

    def _slab_release_block(self, slab: Slab) -> None:
        """The disk holds the bytes: give the host block back (after its last GPU copy, in stream order)."""
        if slab.block is not None and not slab.writing and slab.handle is not None:
            self._host_pool().release(slab.block, slab.last_use or slab.d2h_done)
            slab.block = None

    def _slab_cleanup(self, slab: Slab) -> None:
        """No member needs the tier's copy any more: free the host block and the file."""
        if slab.writing:
            return  # the writer calls back when it is done
        if slab.block is not None:
            self._host_pool().release(slab.block, slab.last_use or slab.d2h_done)
            slab.block = None
        if slab.handle is not None:
            self.backend.delete(slab.handle)
            slab.handle = None


def _subclass_msg(t: Any, what: str) -> str:
    return (
        f"flowlane offload: {what} is a tensor subclass ({type(t).__module__}.{type(t).__qualname__}) without "
        "__tensor_flatten__/__tensor_unflatten__; activation offloading moves plain tensors' storage bytes and "
        "rebuilds a subclass only through that protocol (as DTensor and torchao's float8 tensors implement it), "
        "so it cannot rebuild this one correctly. Implement the protocol, or leave offloading off"
    )


def _key_str(key: Any) -> str:
    s = "_".join(str(k) for k in key) if isinstance(key, tuple) else str(key)
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in s)[:60]


@dataclass
class ScopeSpec:
    """Which modules become scopes: classes by name (digest A7); tensors saved outside any scope are kept. A module
    matches when its class or a base class has one of the names: FSDP2's ``fully_shard`` turns a ``Block`` into an
    ``FSDPBlock`` that subclasses it."""

    class_names: tuple[str, ...] = field(default_factory=tuple)

    def matches(self, module: torch.nn.Module) -> bool:
        return any(c.__name__ in self.class_names for c in type(module).__mro__)


def install(
    model: torch.nn.Module | Iterable[torch.nn.Module],
    config: OffloadConfig,
    scope_classes: Iterable[str],
    rank: int = 0,
    bulk_on_cpu: bool = False,
) -> TensorCache:
    """configure_tensor_cache (Alg. 5.1 lines 1-5) for a framework-neutral model: parameters registered, every
    module whose class name is in ``scope_classes`` made a scope, hooks activated in this thread. ``bulk_on_cpu``
    as for :class:`TensorCache` (CPU smoke tests of the CUDA tiers' logic)."""
    models = [model] if isinstance(model, torch.nn.Module) else list(model)
    spec = ScopeSpec(tuple(scope_classes))
    cache = TensorCache(config, rank=rank, bulk_on_cpu=bulk_on_cpu)
    n = 0
    for m in models:
        cache.register_parameters(m.parameters())
        for mod in m.modules():
            if spec.matches(mod):
                cache.add_scope(mod)
                n += 1
    if n == 0:
        cache.close()
        raise ValueError(
            f"no module of class {sorted(spec.class_names)} found in the model; offloading would do "
            "nothing (set scope classes to the model's layer class names)"
        )
    log_installed(cache, n, spec.class_names)
    return cache.activate()


def log_installed(cache: TensorCache, scopes: int, class_names: Iterable[str], where: str = "") -> None:
    """One ``flowlane.offload`` INFO line saying what an installer put in place: the scope count and classes, the
    tier, the size threshold, the policy (the byte budget, or the layers kept) and ``where`` (the framework's
    hooks it added)."""
    c = cache.config
    policy = (
        f"byte budget from micro-batch {c.profile_step}, max slowdown {c.max_slowdown:g}"
        + (", recompute" if c.recompute else "")
        + (f", release {c.release}" if c.release != "record_stream" else "")
        if c.adaptive
        else f"last {c.keep_last_k} layer(s) kept"
    )
    log.info(
        "flowlane.offload: installed on %d modules (%s; the outermost are the groups), backend %s, saved tensors "
        ">= %d B; %s%s",
        scopes,
        ", ".join(class_names),
        cache.backend.name,
        c.min_bytes,
        policy,
        f"; {where}" if where else "",
    )


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
