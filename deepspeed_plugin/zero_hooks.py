"""Hermod on DeepSpeed's own gradient reductions and ZeRO-3 parameter gathers (seed 000 §5.3.1, §5.4).

DeepSpeed decides *what* a bucket holds and *when* it is ready; Hermod changes only *when it goes on the wire and on
which communicator*, and runs DeepSpeed's own bucket function to do it, so the math is DeepSpeed's (bitwise equal):

* **ZeRO-1/2** (``DeepSpeedZeroOptimizer``): each call of ``reduce_ipg_grads`` -- a full bucket from a backward hook,
  the boundary loop of ``reduce_gradients`` (ZeRO-1, the pipeline's ReduceGrads), what the epilogue finds left --
  detaches the bucket (its params, grads and buffer slot; the live bucket gets a fresh slot) and becomes a deferred
  coflow keyed (MID M-1, DP, the bucket's highest layer: :meth:`flowlane.hermod.keys.HermodKeys.dp_reduce`). The
  pacer runs DeepSpeed's ``reduce_ipg_grads`` on a view of the optimizer whose ``ipg_buckets`` holds that bucket.
* **ZeRO-3** (``DeepSpeedZeroOptimizer_Stage3``): the same for its private ``__reduce_and_partition_ipg_grads``
  (reduce-scatter, then ``partition_grads``). Every ``fetch_sub_module`` of the partitioned-parameter coordinator
  (the all-gather of a module's parameters and the prefetches it issues) is a *critical* op keyed
  (microbatch, DP, the module's lowest layer): the rank is about to wait on it, so the gate holds paced reductions
  back while it runs (seed 000 §5.3.1: the gather feeds the critical path; the reduction can wait).
* **ZeRO-0** (the engine's ``buffered_allreduce_fallback``, also the pipeline's ReduceGrads): each
  ``allreduce_and_copy`` of a bucket of gradients is a deferred coflow.
* The epilogue (``independent_gradient_partition_epilogue``) and the end of ``allreduce_gradients`` seal the window
  and wait for every deferred reduction before DeepSpeed reads a reduced gradient.

Windows: with ``window="bucket"`` (default) a bucket reduced from a backward hook is sealed at once (it may go out
while backward goes on, as DeepSpeed's ``overlap_comm`` intends; the order among buckets stays DeepSpeed's, what
Hermod changes is the gate and the communicator); with ``window="backward"`` the backward's buckets wait for the
epilogue and go out in Hermod's order (lowest layer first: DeepSpeed sends the last layer's first). Buckets issued in
a loop after backward (``allreduce_gradients``: ZeRO-0/1 and ReduceGrads) always form one window. A critical op
(ZeRO-3 fetch, pipeline p2p) seals the open window too (flowlane.sched.scheduler). A deferred bucket keeps its own
buffer until the pacer has reduced it: memory grows by one ``reduce_bucket_size`` buffer per bucket in flight.
The pacer's ops go to the bulk-class clone of their group (:class:`deepspeed_plugin.comm.CommTap`).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable
from dataclasses import fields
from typing import TYPE_CHECKING, Any

import torch

from flowlane.patching import Patch, check_all, undo_all

if TYPE_CHECKING:
    from deepspeed_plugin.hermod import DeepSpeedHermod

#: Hermod's bulk class (flowlane.hermod.wire.WireEncoder.nccl_class: DP traffic)
BULK_CLASS = 2
#: the fields of DeepSpeed's bucket dataclasses that a detach knows how to split (checked at install)
IPG_BUCKET_FIELDS = frozenset(
    {
        "buffer",
        "params",
        "grads",
        "elements",
        "index",
        "has_moe_params",
        "ready_events",
        "reuse_events",
        "copy_streams",
    }
)
IPG_BUCKET_Z3_FIELDS = frozenset({"buffer", "buffer_meta", "params", "elements", "process_group"})
Z3_REDUCE = "_DeepSpeedZeroOptimizer_Stage3__reduce_and_partition_ipg_grads"


def layer_of_parameters(module: torch.nn.Module) -> dict[int, int]:
    """0-based layer id (LID) of every parameter, by ``id(param)``.

    A ``PipelineModule``: the global index of the layer (its ``forward_funcs`` entry plus the stage's first layer).
    Otherwise: the index in the model's longest ``ModuleList`` (the transformer blocks) or, without one, of the
    top-level child. Parameters outside every layer take the lowest layer when they come before the first layer in
    parameter order (embeddings: needed first) and the highest otherwise (final norm, head)."""
    in_layer: dict[int, int] = {}
    funcs = getattr(module, "forward_funcs", None)
    if funcs is not None:
        start = int(getattr(module, "_local_start", 0))
        layers: list[tuple[int, torch.nn.Module]] = [
            (start + i, f) for i, f in enumerate(funcs) if isinstance(f, torch.nn.Module)
        ]
    else:
        lists = [m for m in module.modules() if isinstance(m, torch.nn.ModuleList)]
        blocks = list(max(lists, key=len)) if lists else list(module.children())
        layers = list(enumerate(blocks))
    for lid, m in layers:
        for p in m.parameters():
            in_layer.setdefault(id(p), lid)
    order = [id(p) for p in module.parameters()]
    if not in_layer:
        return dict.fromkeys(order, 0)
    lo, hi = min(in_layer.values()), max(in_layer.values())
    first = next(i for i, pid in enumerate(order) if pid in in_layer)
    return {pid: in_layer.get(pid, lo if i < first else hi) for i, pid in enumerate(order)}


class _BucketView:
    """The optimizer as one deferred bucket reduction sees it: its own ``ipg_buckets`` (and extra-large entry),
    everything else the optimizer's. Methods of the optimizer's class are bound to the view, so DeepSpeed's bucket
    function reads the detached bucket while the training thread fills the live one."""

    def __init__(self, opt: Any, own: dict[str, Any]) -> None:
        object.__setattr__(self, "_opt", opt)
        object.__setattr__(self, "_own", own)

    def __getattr__(self, name: str) -> Any:
        own = object.__getattribute__(self, "_own")
        if name in own:
            return own[name]
        opt = object.__getattribute__(self, "_opt")
        if name not in vars(opt):
            for klass in type(opt).__mro__:
                attr = vars(klass).get(name)
                if attr is not None:
                    return attr.__get__(self, type(opt)) if hasattr(attr, "__get__") else attr
        return getattr(opt, name)

    def __setattr__(self, name: str, value: Any) -> None:
        own = object.__getattribute__(self, "_own")
        if name in own:
            own[name] = value
        else:
            setattr(object.__getattribute__(self, "_opt"), name, value)


class ZeroHooks:
    """Hermod's hooks on one DeepSpeed engine's reductions (see the module docstring). The constructor checks
    (refusing what cannot apply) and patches nothing; :meth:`attach` patches, :meth:`remove` undoes."""

    def __init__(self, h: DeepSpeedHermod) -> None:
        self.h = h
        engine = h.engine
        self.engine, self.opt = engine, engine.optimizer
        self.layers = layer_of_parameters(engine.module)
        self.hi = max(self.layers.values(), default=0)
        self._pending: list[Any] = []
        self._batch = False
        self._grad_layer: dict[int, int] = {}
        #: every attribute Hermod set, undone by :meth:`remove`
        self._patches: list[Patch] = []
        self.stage = int(engine.zero_optimization_stage())
        self._check()

    def attach(self) -> None:
        """Patch the engine's objects (after the checks of the constructor and the class clones are built)."""
        self._hook_engine()
        if self.stage in (1, 2):
            self._hook_zero12()
        elif self.stage == 3:
            self._hook_zero3()

    # -- install-time checks: everything is refused before anything is patched ------------------------------------
    def _check(self) -> None:
        e, opt = self.engine, self.opt
        # "compile": {"deepcompile": true} in the config; "active" turns true only at engine.compile(), after install
        if any(getattr(e, f, lambda: False)() for f in ("is_deepcompile_enabled", "is_deepcompile_active")):
            raise ValueError(
                'flowlane.hermod does not support DeepCompile ("compile": {"deepcompile": true}): it '
                "compiles DeepSpeed's reductions into the graph, where Hermod cannot order them"
            )
        if self.stage in (1, 2):
            from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer, IPGBucket  # noqa: PLC0415

            if not isinstance(opt, DeepSpeedZeroOptimizer):
                raise TypeError(
                    f"flowlane.hermod: ZeRO stage {self.stage} optimizer is a {type(opt).__name__}, "
                    "not deepspeed's DeepSpeedZeroOptimizer"
                )
            got = {f.name for f in fields(IPGBucket)}
            if got != IPG_BUCKET_FIELDS:
                raise RuntimeError(
                    f"flowlane.hermod: DeepSpeed's IPGBucket fields {sorted(got)} differ from the "
                    f"ones it was written for {sorted(IPG_BUCKET_FIELDS)}"
                )
            if opt.cpu_offload or getattr(opt, "zenflow", False):
                raise ValueError(
                    'flowlane.hermod does not support ZeRO "offload_optimizer" or ZenFlow: their '
                    "reductions copy into host buffers on streams Hermod does not order"
                )
        elif self.stage == 3:
            from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3, IPGBucketZ3  # noqa: PLC0415

            if not isinstance(opt, DeepSpeedZeroOptimizer_Stage3) or Z3_REDUCE not in vars(
                DeepSpeedZeroOptimizer_Stage3
            ):
                raise TypeError(
                    f"flowlane.hermod: ZeRO-3 optimizer is a {type(opt).__name__} without "
                    f"{Z3_REDUCE.split('__')[-1]}"
                )
            got = {f.name for f in fields(IPGBucketZ3)}
            if got != IPG_BUCKET_Z3_FIELDS:
                raise RuntimeError(
                    f"flowlane.hermod: DeepSpeed's IPGBucketZ3 fields {sorted(got)} differ from the "
                    f"ones it was written for {sorted(IPG_BUCKET_Z3_FIELDS)}"
                )
            if (
                getattr(opt, "offload_optimizer", False)
                or getattr(opt, "offload_param", False)
                or getattr(opt, "zenflow", False)
            ):
                raise ValueError(
                    'flowlane.hermod does not support ZeRO-3 "offload_param"/"offload_optimizer" or '
                    "ZenFlow: their swaps run on streams Hermod does not order"
                )
            if getattr(opt, "all2all_process_group", None) is not None:
                raise ValueError(
                    'flowlane.hermod does not support "zero_quantized_gradients" (its all-to-all '
                    "reduction uses groups Hermod has no clone of)"
                )
        elif self.stage != 0:
            raise ValueError(f"flowlane.hermod: unknown ZeRO stage {self.stage}")

    def groups(self) -> list[Any]:
        """The process groups DeepSpeed reduces over (cloned per Hermod class at install)."""
        out: list[Any] = [None]  # the world: group=None
        e, opt = self.engine, self.opt
        mpu = getattr(e, "mpu", None)
        if mpu is not None and hasattr(mpu, "get_data_parallel_group"):
            out.append(mpu.get_data_parallel_group())
        else:
            from deepspeed.utils import groups  # noqa: PLC0415

            out.append(groups._get_sequence_data_parallel_group())
        for name in ("dp_process_group", "real_dp_process_group", "expert_dp_process_group"):
            g = getattr(opt, name, None)
            if isinstance(g, dict):
                out.extend(g.values())
            elif isinstance(g, list | tuple):
                out.extend(g)
            elif g is not None:
                out.append(g)
        # ZeRO-0 reduces expert gradients over these (engine._reduce_expert_gradients)
        if getattr(e, "has_moe_layers", False):
            out.extend(getattr(e, "expert_data_parallel_group", {}).values())
        if self.stage == 3:
            out.extend(
                {
                    id(p.ds_process_group): p.ds_process_group
                    for p in e.module.parameters()
                    if getattr(p, "ds_process_group", None) is not None
                }.values()
            )
        return out

    # -- the deferral ----------------------------------------------------------------------------------------------
    def _defer(self, layer: int, op: str, run: Callable[[], Any]) -> None:
        h = self.h
        meta = h.keys.dp_reduce(layer, op)
        once = [run]

        def launch() -> None:
            # one-shot: run holds the detached bucket and its buffer, which must not outlive the reduction in the
            # handle kept in _pending until the epilogue (it held about the whole model's gradients again)
            fn = once.pop()
            with h.tap.on_class(BULK_CLASS, meta):
                fn()

        self._pending.append(h.sched.defer(meta, [launch]))
        if not self._batch and h.cfg.window == "bucket":
            h.sched.seal()  # a backward-hook bucket: the same program point on every DP rank; it may go out now

    def flush(self) -> None:
        """Seal the window and wait for every deferred reduction (before DeepSpeed reads a reduced gradient)."""
        self.h.sched.seal()
        pending, self._pending = self._pending, []
        for handle in pending:
            handle.wait()

    def _set(self, obj: Any, name: str, value: Any) -> None:
        """Set ``obj.name`` on the instance; :meth:`remove` restores what was there."""
        self._patches.append(Patch(obj, name, value, "flowlane.hermod"))

    def _layer_of(self, params: Iterable[Any]) -> int:
        return max((self.layers.get(id(p), self.hi) for p in params), default=self.hi)

    # -- the engine: allreduce_gradients (ZeRO-0 buckets, ZeRO-1 boundary loop, ReduceGrads) -----------------------
    def _hook_engine(self) -> None:
        e = self.engine
        allreduce_gradients, allreduce_and_copy = e.allreduce_gradients, e.allreduce_and_copy

        def hooked_allreduce_gradients(*args: Any, **kwargs: Any) -> Any:
            self._grad_layer = {
                p.grad.data_ptr(): self.layers.get(id(p), self.hi)
                for p in e.module.parameters()
                if p.grad is not None and not p.grad.is_sparse
            }
            self._batch = True
            try:
                out = allreduce_gradients(*args, **kwargs)
            finally:
                self._batch = False
            self.flush()
            return out

        def hooked_allreduce_and_copy(
            small_bucket: list[torch.Tensor], dp_group: Any, dp_world_size: Any = None
        ) -> None:
            layer = max((self._grad_layer.get(t.data_ptr(), self.hi) for t in small_bucket), default=self.hi)
            self._defer(
                layer, "all_reduce", lambda: allreduce_and_copy(small_bucket, dp_group, dp_world_size)
            )

        self._set(e, "allreduce_gradients", hooked_allreduce_gradients)
        self._set(e, "allreduce_and_copy", hooked_allreduce_and_copy)

    def _hook_epilogue(self, defer_leftovers: Callable[[], None]) -> None:
        opt = self.opt
        epilogue = opt.independent_gradient_partition_epilogue

        def hooked_epilogue(*args: Any, **kwargs: Any) -> Any:
            defer_leftovers()
            self.flush()
            return epilogue(*args, **kwargs)  # its own reduction call finds the buckets empty

        self._set(opt, "independent_gradient_partition_epilogue", hooked_epilogue)

    # -- ZeRO-1/2 --------------------------------------------------------------------------------------------------
    def _hook_zero12(self) -> None:
        from deepspeed.runtime.torch_autocast import sort_dtypes  # noqa: PLC0415

        opt = self.opt
        reduce_ipg_grads = type(opt).reduce_ipg_grads
        op = "reduce_scatter" if opt.partition_gradients else "all_reduce"

        def hooked_reduce_ipg_grads(comm_dtype: Any = None) -> None:
            dtypes = sort_dtypes(opt.ipg_buckets.keys()) if comm_dtype is None else [comm_dtype]
            for dt in dtypes:
                bucket = opt.ipg_buckets[dt]
                if not bucket.params:
                    continue
                # the detached bucket keeps the containers and the filled buffer slot
                snap = copy.copy(bucket)
                bucket.params, bucket.grads, bucket.elements, bucket.has_moe_params = [], [], 0, False
                bucket.ready_events, bucket.copy_streams = {}, set()
                if bucket.buffer:
                    bucket.buffer = list(bucket.buffer)
                    bucket.buffer[bucket.index] = torch.empty_like(bucket.buffer[bucket.index])
                xl = opt.extra_large_param_to_reduce.pop(dt, None)
                view = _BucketView(
                    opt,
                    {
                        "ipg_buckets": {dt: snap},
                        "extra_large_param_to_reduce": {} if xl is None else {dt: xl},
                    },
                )
                layer = self._layer_of(opt.bit16_groups[i][j] for i, j, _ in snap.params)
                self._defer(layer, op, lambda view=view, dt=dt: reduce_ipg_grads(view, comm_dtype=dt))

        self._set(opt, "reduce_ipg_grads", hooked_reduce_ipg_grads)
        self._hook_epilogue(hooked_reduce_ipg_grads)

    # -- ZeRO-3 ----------------------------------------------------------------------------------------------------
    def _hook_zero3(self) -> None:
        from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3  # noqa: PLC0415

        opt, h = self.opt, self.h
        reduce_and_partition = vars(DeepSpeedZeroOptimizer_Stage3)[Z3_REDUCE]

        def hooked_reduce(communication_data_type: torch.dtype) -> None:
            bucket = opt.ipg_buckets[communication_data_type]
            if not bucket.params:
                return
            snap = copy.copy(bucket)
            bucket.params, bucket.elements, bucket.process_group = [], 0, None
            if bucket.buffer is not None:
                bucket.buffer = torch.empty_like(bucket.buffer)
            view = _BucketView(opt, {"ipg_buckets": {communication_data_type: snap}})
            self._defer(
                self._layer_of(snap.params),
                "reduce_scatter",
                lambda: reduce_and_partition(view, communication_data_type),
            )

        def defer_leftovers() -> None:
            for dt in list(opt.ipg_buckets):
                hooked_reduce(dt)

        self._set(opt, Z3_REDUCE, hooked_reduce)
        self._hook_epilogue(defer_leftovers)

        # parameter gathers: DeepSpeed's coordinator fetches (and prefetches) as critical ops
        module_layer = {
            id(m): min((self.layers.get(id(p), self.hi) for p in m.parameters()), default=0)
            for m in self.engine.module.modules()
        }
        coordinator = opt.parameter_offload.get_param_coordinator()
        fetch = coordinator.fetch_sub_module
        gas = max(1, int(self.engine.gradient_accumulation_steps()))

        def hooked_fetch(current_submodule: torch.nn.Module, forward: bool) -> Any:
            mb = int(getattr(self.engine, "micro_steps", 0)) % gas
            meta = h.keys.meta("dp", mb, module_layer.get(id(current_submodule), 0), "all_gather")
            with h.sched.critical_section(meta), h.tap.keyed(meta):
                return fetch(current_submodule, forward)

        self._set(coordinator, "fetch_sub_module", hooked_fetch)

    def check_removable(self) -> None:
        """Raise, changing nothing, when an attribute Hermod set was wrapped again since (another feature installed
        after Hermod, e.g. deepspeed_plugin.ssd_offload on ZeRO-3's ``fetch_sub_module``): restoring the value
        Hermod saw would drop that wrapper, and the wrapper would later restore Hermod's closed hook."""
        check_all(self._patches)

    def remove(self) -> None:
        undo_all(self._patches)
