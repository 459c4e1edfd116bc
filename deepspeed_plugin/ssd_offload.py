"""SSDTrain activation offloading for DeepSpeed: PipelineEngine and the plain engine (seed 003 §5.3, Alg. 5.1).

Enabled by the ``"flowlane": {"offload": {...}}`` section of the DeepSpeed config; the keys are the fields of
:class:`flowlane.offload.OffloadConfig` plus ``scope_classes`` (class names of the layers to offload)::

    "flowlane": {"offload": {"backend": "posix", "dirs": ["/nvme0", "/nvme1"], "keep_last_k": 1,
                             "min_bytes": 2097152, "scope_classes": ["ParallelTransformerLayerPipe"]}}

    engine, *_ = deepspeed.initialize(model=..., config=ds_config)
    handle = install(engine, ds_config)          # None section or "enabled": false -> a disabled handle

PipelineEngine: ``_exec_schedule`` is replaced on the engine instance by Alg. 5.1's loop: before each command the
cache learns the stage and micro-batch (``buffer_id``), a RecvGrad followed by a BackwardPass prefetches that
micro-batch's last module (lines 12-13), and a forward whose next compute command is not its own backward stores its
kept layers (Fig. 5.5). Plain engine: ``engine.forward``/``engine.backward`` are wrapped as hints.

ZeRO: parameters are never offloaded (thesis §5.3.3). Under ZeRO-1/2 a parameter keeps its storage (a view of
DeepSpeed's flat buffer), tagged once at install. Under ZeRO-3 every gather gives a parameter a new storage, so the
partitioned-parameter coordinator's ``fetch_sub_module`` is wrapped on this engine: once a module's parameters are
gathered, their storages are tagged, and the views of them that the module saves for backward are kept, not stored.
SSD backend: DeepSpeed's own async I/O (``deepspeed.ops.aio``, the DeepNVMe op its ZeRO-Infinity swapper uses) where
the op builds and loads, else flowlane's posix backend (the ``deepspeed_aio`` key: ``auto`` (default) / ``on`` /
``off``; it applies where the file backend would be posix). The op is JIT-built on first use and needs libaio's
headers and library (Debian: ``apt-get install libaio-dev``; docs/deepspeed.md). Which one runs is logged on the
``flowlane.offload`` logger.

Only the ``offload`` subsection of ``flowlane`` is read here; other subsections belong to other features.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import itertools
import logging
import os
import threading
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import MethodType
from typing import Any

import torch

from deepspeed_plugin.config import DEEPSPEED_VERSIONS, flowlane_subsection, validate_flowlane_section
from flowlane.offload import OffloadConfig, OffloadHandle, ScopeSpec, TensorCache
from flowlane.offload.backends import (
    BackendUnavailableError,
    IOBackend,
    kvikio_usable,
    make_run_dir,
    remove_run_dir,
)
from flowlane.offload.cache import log_installed, recompute_with_rng_tracker
from flowlane.patching import Patch, undo_all
from flowlane.versions import check_version_range

log = logging.getLogger("flowlane.offload")

#: values of the plugin-only ``deepspeed_aio`` key of the offload section
DEEPSPEED_AIO = ("auto", "on", "off")
#: DeepSpeed aio handle settings (its swapper's defaults: deepspeed.runtime.swap_tensor.aio_config)
AIO_BLOCK_SIZE, AIO_QUEUE_DEPTH = 1 << 20, 8


@functools.cache
def libaio_missing() -> str | None:
    """Why DeepSpeed's async I/O op cannot be built here (libaio's headers or library not found; DeepSpeed's own
    check: it compiles and links a call of ``io_submit``), or None when it can."""
    from deepspeed.ops.op_builder import AsyncIOBuilder  # noqa: PLC0415 - plugin-only dependency

    if AsyncIOBuilder().is_compatible(verbose=False):
        return None
    return (
        "deepspeed.ops.aio is not compatible here: libaio's headers and library were not found "
        "(Debian: apt-get install libaio-dev, or scripts/install-aio-deps.sh as root; a libaio outside the "
        "system paths needs CFLAGS=-I<dir> LDFLAGS=-L<dir> for DeepSpeed's check and CPATH=<dir> "
        "LIBRARY_PATH=<dir> for its JIT build)"
    )


def aio_build_dir() -> Path:
    """Where DeepSpeed's JIT build of the op goes, once per machine and version set: ``$FLOWLANE_AIO_CACHE`` (default
    ``~/.cache/flowlane/deepspeed_aio``) / a key of the DeepSpeed, torch and Python versions, the accelerator (a CPU
    and a CUDA build differ) and the machine. torch's own cache would rebuild the op in every fresh clone (its
    build commands name the clone's paths), which is minutes on a 2-core machine."""
    import platform  # noqa: PLC0415
    import sys  # noqa: PLC0415

    import deepspeed  # noqa: PLC0415 - plugin-only dependency
    from deepspeed.accelerator import get_accelerator  # noqa: PLC0415

    key = "-".join(
        (
            f"ds{deepspeed.__version__}",
            f"torch{torch.__version__}",
            f"py{sys.version_info[0]}{sys.version_info[1]}",
            get_accelerator()._name,
            platform.machine(),
        )
    ).replace("+", "_")
    root = os.environ.get("FLOWLANE_AIO_CACHE") or Path.home() / ".cache" / "flowlane" / "deepspeed_aio"
    return Path(root) / key


def _import_extension(name: str, path: Path) -> Any:
    import importlib.util  # noqa: PLC0415

    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {name} from {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@functools.cache
def deepspeed_aio_op() -> tuple[Any, str]:
    """(the loaded ``async_io`` op module or None, why not). Where libaio is found (:func:`libaio_missing`) the op
    is DeepSpeed's own build (``AsyncIOBuilder().load()``, JIT, into :func:`aio_build_dir`); a build already there is
    imported as torch's loader would import it (its ``pin_memory`` helper first, as DeepSpeed's loader does)."""
    try:
        from deepspeed.ops.op_builder import AsyncIOBuilder  # noqa: PLC0415 - plugin-only dependency

        missing = libaio_missing()
        if missing is not None:
            return None, missing
        d = aio_build_dir()
        built = {n: d / n / f"{n}.so" for n in ("pin_memory", "async_io")}
        if all(p.is_file() for p in built.values()):
            import ctypes  # noqa: PLC0415
            import sys  # noqa: PLC0415

            # as DeepSpeed's own loader does (op_builder/pin_memory_load.py): once per process, its symbols global
            # so that async_io resolves them
            pin = getattr(sys, "_deepspeed_pin_memory_op_module", None)
            if pin is None:
                pin = _import_extension("pin_memory", built["pin_memory"])
                sys._deepspeed_pin_memory_op_module = pin  # type: ignore[attr-defined]
            ctypes.CDLL(pin.__file__, mode=ctypes.RTLD_GLOBAL)
            return _import_extension("async_io", built["async_io"]), f"ok (built in {d})"
        d.mkdir(parents=True, exist_ok=True)
        before = os.environ.get("TORCH_EXTENSIONS_DIR")
        os.environ["TORCH_EXTENSIONS_DIR"] = str(d)  # read by torch's JIT build at call time
        try:
            op = AsyncIOBuilder().load(verbose=False)
        finally:
            if before is None:
                os.environ.pop("TORCH_EXTENSIONS_DIR", None)
            else:
                os.environ["TORCH_EXTENSIONS_DIR"] = before
        return op, f"ok (built now in {d})"
    except Exception as e:  # noqa: BLE001 - a failed JIT build raises anything from the compiler driver
        return None, f"deepspeed.ops.aio did not build/load: {type(e).__name__}: {e}"


@dataclass(frozen=True)
class AioHandle:
    path: str
    nbytes: int


class DeepSpeedAioBackend(IOBackend):
    """Files written and read by DeepSpeed's async I/O op (libaio, O_DIRECT): one file per offloaded storage, round
    robin over the target directories, in the run directories of flowlane's posix backend (0700, removed at exit).
    One aio handle per I/O thread (a handle is not shared across threads). The op's first write in this process is
    made here, by the constructing thread (:meth:`_first_write`), before any I/O thread can write."""

    name = "deepspeed_aio"

    def __init__(self, op: Any, dirs: tuple[str, ...] = (), rank: int = 0) -> None:
        import tempfile  # noqa: PLC0415

        self._op, self.rank = op, rank
        self.run_dirs = [make_run_dir(Path(d)) for d in (dirs or (tempfile.gettempdir(),))]
        self._rr = itertools.cycle(range(len(self.run_dirs)))
        self._lock = threading.Lock()
        self._local = threading.local()
        self._janitor = ThreadPoolExecutor(1, thread_name_prefix="flowlane-unlink")
        try:
            self._first_write()
        except BaseException:
            self._janitor.shutdown(wait=True)
            for d in self.run_dirs:
                remove_run_dir(d)
            raise

    def _first_write(self) -> None:
        """One block written and removed, so that the op's once-per-process write warning runs now, in one thread.

        DeepSpeed 0.19.8's ``sync_pwrite`` binding calls ``warn_consumer_ssd_writes()`` *holding the GIL*, and that
        function runs Python (DeepSpeed's logger) inside a ``std::call_once``. When two I/O threads make the process's
        first writes at once, the first one, inside ``call_once``, gives up the GIL while logging; the second takes it
        and blocks on the once-flag without releasing it; the first can never get the GIL back. The process freezes
        with the GIL held: its training thread and gloo's worker threads (they take the GIL for the saved-tensor
        hooks in the thread-local state they copy) stop, so its peers hang in their next collective (issue 31; the
        lock inversion named in the review of deepspeedai/DeepSpeed#8196). Once the flag is set, ``call_once``
        returns without the GIL or the logger. The write's result is not used: a directory the op cannot write
        fails each store as before (``on_io_error``)."""
        h = self._op.aio_handle(AIO_BLOCK_SIZE, AIO_QUEUE_DEPTH, False, False, 1)
        path = self.run_dirs[0] / f"r{self.rank}-first-write.bin"
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        try:
            h.sync_pwrite(torch.zeros(max(1, int(h.get_alignment())), dtype=torch.uint8), str(path))
        finally:
            os.unlink(path)

    def _handle(self) -> Any:
        h = getattr(self._local, "h", None)
        if h is None:
            h = self._local.h = self._op.aio_handle(AIO_BLOCK_SIZE, AIO_QUEUE_DEPTH, False, False, 1)
        return h

    def describe(self) -> dict[str, Any]:
        return {"backend": self.name, "dirs": [str(d) for d in self.run_dirs]}

    def write(self, key: str, data: torch.Tensor) -> AioHandle:
        with self._lock:
            i = next(self._rr)
        path = self.run_dirs[i] / f"r{self.rank}-{key}.bin"
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))  # private, then aio writes
        host = data if data.device.type == "cpu" else data.cpu()
        size = self._padded(data.numel())
        if size != data.numel():  # O_DIRECT: whole aligned blocks (the op asserts, aborting, on a short file)
            host = torch.cat([host.reshape(-1), torch.zeros(size - data.numel(), dtype=torch.uint8)])
        try:
            n = self._handle().sync_pwrite(host.contiguous(), str(path))
            if n < 0 or os.path.getsize(path) != size:
                raise OSError(
                    errno.EIO, f"deepspeed aio wrote {os.path.getsize(path)} of {size} bytes to {path}"
                )
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(path)
            raise
        return AioHandle(str(path), data.numel())

    def _padded(self, nbytes: int) -> int:
        align = max(1, int(self._handle().get_alignment()))
        return -(-nbytes // align) * align

    def read(self, handle: AioHandle, nbytes: int, device: torch.device) -> torch.Tensor:
        size = self._padded(nbytes)
        if os.path.getsize(handle.path) != size:  # checked here: the op asserts (aborting) on a short file
            raise OSError(errno.EIO, f"{handle.path} holds {os.path.getsize(handle.path)} bytes, not {size}")
        out = torch.empty(size, dtype=torch.uint8)
        if self._handle().sync_pread(out, handle.path) < 0:
            raise OSError(errno.EIO, f"deepspeed aio could not read {handle.path}")
        if size != nbytes:
            out = out[:nbytes].clone()  # a storage of exactly nbytes (the cache keys residency by storage)
        return out if device.type == "cpu" else out.to(device)

    def delete(self, handle: AioHandle) -> None:
        self._janitor.submit(_unlink, handle.path)

    def close(self) -> None:
        self._janitor.shutdown(wait=True)
        for d in self.run_dirs:
            remove_run_dir(d)


def _unlink(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def choose_backend(config: OffloadConfig, deepspeed_aio: str, rank: int = 0) -> IOBackend | None:
    """DeepSpeed's aio backend, or None for flowlane's own choice (``config.backend``); says which in the log.

    ``deepspeed_aio`` applies where the file backend would be posix (``posix``, or ``auto`` without kvikio):
    ``auto`` uses the op when it builds and loads, ``on`` requires it, ``off`` never uses it."""
    if deepspeed_aio not in DEEPSPEED_AIO:
        raise ValueError(
            f'"flowlane.offload.deepspeed_aio" {deepspeed_aio!r} is not one of {list(DEEPSPEED_AIO)}'
        )
    posix = config.backend == "posix" or (
        config.backend == "auto" and not kvikio_usable(config.kvikio_compat_mode)[0]
    )
    if not posix or deepspeed_aio == "off":
        if deepspeed_aio == "on":
            raise ValueError(
                f'"flowlane.offload.deepspeed_aio": "on" needs a file backend written with posix I/O, but '
                f"offload.backend={config.backend!r} resolves to another tier"
            )
        return None
    op, why = deepspeed_aio_op()
    if op is None:
        if deepspeed_aio == "on":
            raise BackendUnavailableError(f'"flowlane.offload.deepspeed_aio": "on" but {why}')
        log.info("flowlane.offload: SSD backend posix (%s)", why)
        return None
    config.check_dirs()
    log.info("flowlane.offload: SSD backend deepspeed.ops.aio (DeepSpeed's async I/O op loaded)")
    return DeepSpeedAioBackend(op, config.dirs, rank)


def parse_offload_section(
    ds_config: Mapping[str, Any] | str | Path | None,
) -> tuple[OffloadConfig, tuple[str, ...], str] | None:
    """(config, scope class names, deepspeed_aio) from ``ds_config["flowlane"]["offload"]``; None when absent or
    disabled. The plugin's own keys: ``scope_classes`` (class names of the layers to offload) and ``deepspeed_aio``
    (``auto``/``on``/``off``: DeepSpeed's async I/O op as the SSD backend, see :func:`choose_backend`).

    ``ds_config`` may be the dict given to ``deepspeed.initialize`` or a path to its JSON file.
    """
    off = flowlane_subsection(ds_config, "offload")
    if off is None:
        return None
    d = dict(off)
    scopes = d.pop("scope_classes", None)
    if scopes is not None and (isinstance(scopes, str) or not all(isinstance(s, str) for s in scopes)):
        raise ValueError(f'"flowlane.offload.scope_classes" must be a list of class names, got {scopes!r}')
    aio = d.pop("deepspeed_aio", "auto")
    if aio not in DEEPSPEED_AIO:
        raise ValueError(f'"flowlane.offload.deepspeed_aio" {aio!r} is not one of {list(DEEPSPEED_AIO)}')
    cfg = OffloadConfig.from_dict(d)
    if not cfg.enabled:
        return None
    return cfg, tuple(scopes or ()), aio


def _is_pipeline_engine(engine: Any) -> bool:
    try:
        from deepspeed.runtime.pipe.engine import PipelineEngine  # noqa: PLC0415 - plugin-only dependency
    except ImportError:
        return False
    return isinstance(engine, PipelineEngine)


def _scope_modules(
    module: torch.nn.Module, scope_classes: tuple[str, ...], pipeline: bool
) -> list[torch.nn.Module]:
    if scope_classes:
        spec = ScopeSpec(scope_classes)
        return [m for m in module.modules() if spec.matches(m)]
    if pipeline:  # a PipelineModule's own layers (built from LayerSpecs)
        return [f for f in getattr(module, "forward_funcs", []) if isinstance(f, torch.nn.Module)]
    lists = [m for m in module.modules() if isinstance(m, torch.nn.ModuleList)]
    return list(max(lists, key=len)) if lists else []


class DSOffload(OffloadHandle):
    """Handle returned by :func:`install` (context manager); undoes the patches on close."""

    def __init__(self, engine: Any, cache: TensorCache | None) -> None:
        super().__init__(cache)
        self.engine = engine
        #: every attribute the offload set, all checked before any is undone
        self._patches: list[Patch] = []

    def close(self) -> None:
        """Undo the patches; refused, changing nothing, while a feature installed after the offload wraps one of
        them again (Hermod on ZeRO-3's ``fetch_sub_module``): restoring what the offload saw at install would drop
        that wrapper, and the other feature's close would then put the offload's back."""
        undo_all(self._patches)
        super().close()


def _zero_stage(engine: Any) -> int:
    stage = getattr(engine, "zero_optimization_stage", None)
    return int(stage()) if callable(stage) else 0


def _tag_gathered_parameters(engine: Any, cache: TensorCache, handle: DSOffload) -> None:
    """ZeRO-3: after the coordinator gathers a module's parameters, tag their (new) storages as parameters."""
    coordinator = engine.optimizer.parameter_offload.get_param_coordinator()
    fetch = coordinator.fetch_sub_module

    def fetch_sub_module(current_submodule: torch.nn.Module, forward: bool) -> Any:
        out = fetch(current_submodule, forward)
        own = list(current_submodule.parameters(recurse=False))
        cache.register_parameters(p for p in (own or current_submodule.parameters()) if p.numel() > 0)
        return out

    handle._patches.append(Patch(coordinator, "fetch_sub_module", fetch_sub_module, "flowlane.offload"))


def _patch_pipeline(engine: Any, cache: TensorCache, handle: DSOffload) -> None:
    from deepspeed.runtime.pipe import schedule as S  # noqa: PLC0415

    def exec_schedule(self: Any, pipe_schedule: Any) -> None:
        # Alg. 5.1 (deepspeed_exec_schedule); lines 6-8 and 14 are DeepSpeed's own loop
        self._reserve_pipe_buffers(pipe_schedule.num_pipe_buffers())
        self.fwd_outputs = []
        cmds = [cmd for step_cmds in pipe_schedule for cmd in step_cmds]
        train = torch.is_grad_enabled()
        for i, cmd in enumerate(cmds):
            if type(cmd) not in self._INSTRUCTION_MAP:
                raise RuntimeError(f"{self.__class__.__name__} does not understand instruction {cmd!r}")
            nxt = cmds[i + 1] if i + 1 < len(cmds) else None
            if train:
                if isinstance(cmd, S.ForwardPass):  # set_stage
                    cache.forward_begin(("pipe", cmd.buffer_id))
                elif isinstance(cmd, S.BackwardPass):
                    cache.backward_begin(("pipe", cmd.buffer_id))
                elif isinstance(cmd, S.RecvGrad) and isinstance(nxt, S.BackwardPass):
                    cache.prefetch_last_module(("pipe", nxt.buffer_id))  # lines 12-13
            self._exec_instr = MethodType(self._INSTRUCTION_MAP[type(cmd)], self)
            self._exec_instr(**cmd.kwargs)
            if not train:
                continue
            if isinstance(cmd, S.ForwardPass):  # set_next_stage: keep only if our own backward is next
                nxt_compute = next(
                    (c for c in cmds[i + 1 :] if isinstance(c, (S.ForwardPass, S.BackwardPass))), None
                )
                own = isinstance(nxt_compute, S.BackwardPass) and nxt_compute.buffer_id == cmd.buffer_id
                cache.forward_end(("pipe", cmd.buffer_id), next_is_own_backward=own)
            elif isinstance(cmd, S.BackwardPass):
                cache.backward_end(("pipe", cmd.buffer_id))  # line 15: this micro-batch's I/O is done

    handle._patches.append(
        Patch(engine, "_exec_schedule", MethodType(exec_schedule, engine), "flowlane.offload")
    )


def _patch_plain(engine: Any, cache: TensorCache, handle: DSOffload) -> None:
    counter = itertools.count()
    state: dict[str, Any] = {"key": None}
    orig_forward, orig_backward = engine.forward, engine.backward

    def forward(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return orig_forward(*args, **kwargs)
        key = ("engine", next(counter))
        cache.forward_begin(key)
        try:
            return orig_forward(*args, **kwargs)
        finally:
            cache.forward_end(key)
            state["key"] = key

    def backward(*args: Any, **kwargs: Any) -> Any:
        key = state["key"]
        if key is not None:
            cache.backward_begin(key)
        try:
            return orig_backward(*args, **kwargs)
        finally:
            if key is not None:
                cache.backward_end(key)
                state["key"] = None

    handle._patches += [
        Patch(engine, "forward", forward, "flowlane.offload"),
        Patch(engine, "backward", backward, "flowlane.offload"),
    ]


def install(
    engine: Any,
    ds_config: Mapping[str, Any] | str | Path | None = None,
    config: OffloadConfig | None = None,
    scope_classes: Iterable[str] = (),
    deepspeed_aio: str = "auto",
) -> DSOffload:
    """Offload ``engine``'s activations as configured by ``ds_config["flowlane"]["offload"]`` (or ``config``,
    ``scope_classes`` and ``deepspeed_aio``).

    Call after ``deepspeed.initialize`` and before training, in the thread that runs forward.
    """
    scopes = tuple(scope_classes)
    if config is None:
        parsed = validate_flowlane_section(
            ds_config
            if ds_config is not None
            else getattr(engine, "_config", None) and getattr(engine._config, "_param_dict", None)
        )["offload"]
        if parsed is None:
            return DSOffload(engine, None)
        config, scopes, deepspeed_aio = parsed[0], scopes or parsed[1], parsed[2]
    if not config.enabled:
        return DSOffload(engine, None)
    # it wraps ZeRO-3's coordinator (fetch_sub_module) and the engines' forward as this range has them
    check_version_range("deepspeed", DEEPSPEED_VERSIONS, "flowlane.offload")
    pipeline = _is_pipeline_engine(engine)
    module = engine.module
    mods = _scope_modules(module, scopes, pipeline)
    if not mods:
        raise ValueError(
            f"flowlane.offload: no scope modules found (scope_classes={list(scopes)}); set "
            '"scope_classes" to the class names of the transformer layers'
        )
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    checkpoint = None
    if config.recompute:  # DeepSpeed's model-parallel RNG tracker restored too, as its own checkpointing does
        from deepspeed.runtime.activation_checkpointing.checkpointing import get_cuda_rng_tracker

        checkpoint = recompute_with_rng_tracker(get_cuda_rng_tracker)
    cache = TensorCache(
        config, rank=rank, backend=choose_backend(config, deepspeed_aio, rank), checkpoint=checkpoint
    )
    cache.register_parameters(module.parameters())
    for m in mods:
        cache.add_scope(m)
    handle = DSOffload(engine, cache)
    if _zero_stage(engine) == 3:
        _tag_gathered_parameters(engine, cache, handle)
    if pipeline:
        _patch_pipeline(engine, cache, handle)
    else:
        _patch_plain(engine, cache, handle)
    log_installed(
        cache,
        len(mods),
        scopes or (("the PipelineModule's layers",) if pipeline else ("the longest ModuleList's entries",)),
        "DeepSpeed's pipeline schedule executor wrapped"
        if pipeline
        else "the engine's forward and backward wrapped",
    )
    cache.activate()
    return handle
