"""SSDTrain activation offloading for Megatron-core (seed 003 §5.3; flowlane.offload holds the algorithm).

Launch flags (through ``megatron_plugin.args.add_flowlane_args``)::

    --ssd-offload --ssd-offload-dirs /nvme0 /nvme1 --ssd-offload-backend posix --ssd-offload-min-bytes 2097152
    --ssd-offload-keep-last-k 1 | --ssd-offload-adaptive [--ssd-offload-link-gbps 55]
        [--ssd-offload-max-slowdown 0.05 --ssd-offload-recompute] [--ssd-offload-scope-classes SelfAttention MLP]

API::

    handle = install(model, OffloadConfig(...))          # model: a module or Megatron's list of model chunks
    ... forward_backward_func(...) ...                      # schedules get micro-batch hints automatically
    handle.close()

Scopes are ``TransformerLayer`` (the prefetch/keep group) and its ``SelfAttention`` and ``MLP`` submodules (digest
A7). Schedule hints (Alg. 5.1, "the Megatron scheduler is patched similarly"): ``schedules.forward_step`` and
``schedules.backward_step`` are wrapped (digest A13); all three schedules (no pipelining, 1F1B, interleaved) call them
through the module globals. Each forward gets its own record keyed by (model chunk, sequence number); a backward is
matched to its forward through the output tensor it receives. Kept layers stay in memory only when the same
micro-batch's backward comes next (the last stage in 1F1B steady state, every micro-batch without pipelining);
otherwise the next forward or backward of another micro-batch stores them (thesis Fig. 5.5, digest §2.2.10). The
last layer of a micro-batch is prefetched when its backward step begins (Alg. 5.1 lines 12-13).
Megatron's ``deallocate_output_tensor`` swaps a stage output's ``.data``; the cache holds whole storages, so an
offloaded view of that output still reloads correctly (digest A14).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
from collections import deque
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from flowlane.configs import add_dataclass_args, config_from_namespace
from flowlane.offload import OffloadConfig, OffloadHandle, ScopeSpec, TensorCache
from flowlane.offload.cache import log_installed
from megatron_plugin.undo import Patch, undo_all

DEFAULT_SCOPES: tuple[str, ...] = ("TransformerLayer", "SelfAttention", "MLP")


def add_args(parser: argparse.ArgumentParser) -> None:
    """Megatron extra-args provider for SSD offloading: ``--ssd-offload`` (the master switch) and one
    ``--ssd-offload-<field>`` flag per :class:`OffloadConfig` field (generated: names, choices, defaults and help
    from the dataclass, :func:`flowlane.configs.add_dataclass_args`), plus ``--ssd-offload-scope-classes``."""
    g = parser.add_argument_group("flowlane SSD activation offloading (SSDTrain)")
    g.add_argument(
        "--ssd-offload", action="store_true", help="offload saved activations to SSD (or another tier)"
    )
    add_dataclass_args(
        g,
        OffloadConfig,
        "ssd-offload-",
        skip=("enabled",),
        # the names these two flags had before they were generated
        flags={"offload_cpu_tensors": "--ssd-offload-cpu-tensors", "link_GBps": "--ssd-offload-link-gbps"},
        overrides={"dirs": {"nargs": "+", "default": [], "help": "target directories, used round-robin"}},
    )
    g.add_argument(
        "--ssd-offload-scope-classes",
        nargs="+",
        default=list(DEFAULT_SCOPES),
        help="module classes whose outermost instances are the offload groups (SelfAttention MLP: each layer's "
        "halves; with the local spec the layer norms' inputs then stay on the device)",
    )


def config_from_args(args: argparse.Namespace) -> OffloadConfig:
    """The OffloadConfig described by the ``--ssd-offload*`` flags (it validates them)."""
    cfg: OffloadConfig = config_from_namespace(
        OffloadConfig,
        args,
        "ssd_offload_",
        enabled=bool(args.ssd_offload),
        dirs=tuple(args.ssd_offload_dirs),
    )
    return cfg


def _first_tensor(obj: Any) -> torch.Tensor | None:
    if isinstance(obj, torch.Tensor):
        return obj
    if isinstance(obj, (list, tuple)):
        for o in obj:
            t = _first_tensor(o)
            if t is not None:
                return t
    return None


class _ScheduleHints:
    """Wraps ``schedules.forward_step``/``backward_step`` to give the cache micro-batch hints (Alg. 5.1)."""

    def __init__(self, cache: TensorCache) -> None:
        from megatron.core.pipeline_parallel import schedules  # noqa: PLC0415 - plugin-only dependency

        self.cache = cache
        self.schedules = schedules
        self.orig_forward = schedules.forward_step
        self.orig_backward = schedules.backward_step
        self.seq = itertools.count()
        self.by_output: dict[int, Any] = {}
        self.fifo: deque[Any] = deque()
        self.patches = [
            Patch(schedules, "forward_step", self.forward_step, "flowlane.offload"),
            Patch(schedules, "backward_step", self.backward_step, "flowlane.offload"),
        ]

    def forward_step(self, *args: Any, **kwargs: Any) -> Any:
        chunk = kwargs.get("vp_stage")
        key = (0 if chunk is None else int(chunk), next(self.seq))
        grad_on = torch.is_grad_enabled()
        if grad_on:
            self.cache.forward_begin(key)
        out = self.orig_forward(*args, **kwargs)
        if grad_on:
            self.cache.forward_end(key)
            t = _first_tensor(out[0] if isinstance(out, tuple) else out)
            if t is not None:
                self.by_output[id(t)] = key
            self.fifo.append(key)
        return out

    def backward_step(
        self, input_tensor: Any, output_tensor: Any, output_tensor_grad: Any, *rest: Any, **kw: Any
    ) -> Any:
        t = _first_tensor(output_tensor)
        key = self.by_output.pop(id(t), None) if t is not None else None
        if key is None and self.fifo:
            key = self.fifo[0]
        if key is not None:
            with contextlib.suppress(ValueError):
                self.fifo.remove(key)
            self.cache.prefetch_last_module(key)
            self.cache.backward_begin(key)
        try:
            return self.orig_backward(input_tensor, output_tensor, output_tensor_grad, *rest, **kw)
        finally:
            if key is not None:
                self.cache.backward_end(key)

    def remove(self) -> None:
        undo_all(self.patches)


class SSDOffload(OffloadHandle):
    """Handle returned by :func:`install`; a context manager. ``stats`` gives the cache's counters."""

    def __init__(self, cache: TensorCache | None, hints: _ScheduleHints | None) -> None:
        super().__init__(cache)
        self._hints = hints

    def close(self) -> None:
        """Put Megatron's schedule steps back and close the cache; refused, changing nothing, while a feature
        installed after the offload wraps a step again (:mod:`megatron_plugin.undo`). A second close does nothing
        more."""
        if self._hints is not None:
            self._hints.remove()
            self._hints = None
        super().close()


def _chunks(model: torch.nn.Module | Iterable[torch.nn.Module]) -> list[torch.nn.Module]:
    return [model] if isinstance(model, torch.nn.Module) else list(model)


def checkpoint_with_megatron_rng(forward: Any, *args: Any, **kwargs: Any) -> Any:
    """A recomputed TransformerLayer (``recompute``): ``torch.utils.checkpoint`` (non-reentrant: the layer's keyword
    arguments pass through) with Megatron's model-parallel RNG tracker restored around the second run, as Megatron's
    own ``tensor_parallel.checkpoint`` does (attention dropout draws from the tracker)."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    from flowlane.offload.cache import recompute_with_rng_tracker

    return recompute_with_rng_tracker(get_cuda_rng_tracker)(forward, *args, **kwargs)


def _check_recompute(chunks: Iterable[torch.nn.Module]) -> None:
    """``recompute`` re-runs layers with torch's checkpoint: refused with FP8 (Transformer Engine keeps FP8 scaling
    state per forward, which only TE's own checkpoint restores)."""
    for chunk in chunks:
        cfg = getattr(chunk, "config", None)
        if getattr(cfg, "fp8", None):
            raise ValueError(
                f"--ssd-offload-recompute with fp8={cfg.fp8!r}: FP8 layers must be recomputed by Transformer "
                "Engine's checkpoint; use Megatron's --recompute-granularity instead"
            )


def install(
    model: torch.nn.Module | Iterable[torch.nn.Module],
    config: OffloadConfig,
    scope_classes: Iterable[str] = DEFAULT_SCOPES,
    schedule_hints: bool = True,
    rank: int | None = None,
) -> SSDOffload:
    """Offload ``model``'s activations (configure_tensor_cache, Alg. 5.1 lines 1-5).

    Registers parameters, makes every ``TransformerLayer``/``SelfAttention``/``MLP`` a scope, wraps Megatron's
    schedule steps for micro-batch hints, and installs the saved-tensor hooks in the calling thread (the thread that
    runs forward). With ``config.enabled`` False nothing is installed.
    """
    if not config.enabled:
        return SSDOffload(None, None)
    if rank is None:
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    spec = ScopeSpec(tuple(scope_classes))
    if config.recompute:
        _check_recompute(_chunks(model))
    cache = TensorCache(
        config, rank=rank, checkpoint=checkpoint_with_megatron_rng if config.recompute else None
    )
    found = 0
    for chunk in _chunks(model):
        cache.register_parameters(chunk.parameters())
        for mod in chunk.modules():
            if spec.matches(mod):  # also FSDP2's FSDP<Layer> classes
                cache.add_scope(mod)
                found += 1
    if found == 0:
        cache.close()
        raise ValueError(
            f"--ssd-offload: no module of class {sorted(spec.class_names)} in the model; nothing to offload"
        )
    hints = _ScheduleHints(cache) if schedule_hints else None
    cache.activate()
    where = "schedule hints on Megatron's forward and backward steps" if hints is not None else ""
    log_installed(cache, found, spec.class_names, where)
    return SSDOffload(cache, hints)


def install_from_config(
    cfg: Mapping[str, Any] | None, model: torch.nn.Module | Iterable[torch.nn.Module]
) -> SSDOffload:
    """Entry point for the recipe (``offload=ssd`` / ``offload=none``).

    ``cfg`` is the Hydra ``offload`` group as a plain dict (``OmegaConf.to_container(cfg.offload)``): the
    :class:`OffloadConfig` fields, plus optional ``scope_classes`` (list of class names). ``None`` or
    ``enabled: false`` gives a disabled handle. Call it after building the model and before the first forward, in
    the thread that runs forward; close the returned handle (or use it as a context manager) when training ends.
    """
    if cfg is None:
        return SSDOffload(None, None)
    d = dict(cfg)
    scopes = tuple(d.pop("scope_classes", None) or DEFAULT_SCOPES)
    return install(model, OffloadConfig.from_dict(d), scope_classes=scopes)
