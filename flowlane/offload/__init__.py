"""SSDTrain activation offloading (seed 003 ch. 5): a tensor cache on saved-tensor hooks with pluggable I/O backends.

Public API::

    from flowlane.offload import OffloadConfig, TensorCache, install
    cache = install(model, OffloadConfig(dirs=("/nvme0", "/nvme1")), scope_classes=["Block"])
    loss = model(x).sum(); loss.backward()      # activations of all but the last block go to disk and come back
    print(cache.stats_snapshot()); cache.close()

On CUDA, ``backend="pinned_cpu"`` (and ``posix``, staged through it) copies each layer in bulk on its own streams
into a persistent host pool, with no host waits; ``adaptive=True`` offloads only the byte budget that the link can
move while compute runs (``choose_budget``, from CUDA-event timings of a profiled micro-batch).

Framework adapters (megatron_plugin.ssd_offload, deepspeed_plugin.ssd_offload) add scope classes and schedule hints.
"""

from importlib import import_module
from typing import TYPE_CHECKING, Any

# Names load on first use (PEP 562), so the torch-free parts (``flowlane ssd-estimate``, config, budget) do not
# import torch. Each public name and the module that defines it:
_HOME = {
    "ProfileResult": "adaptive",
    "choose_last_offloaded": "adaptive",
    "keep_last_k_from_profile": "adaptive",
    "BackendUnavailableError": "backends",
    "IOBackend": "backends",
    "KvikioBackend": "backends",
    "NullBackend": "backends",
    "PinnedCpuBackend": "backends",
    "PosixBackend": "backends",
    "cleanup_stale": "backends",
    "kvikio_usable": "backends",
    "make_backend": "backends",
    "Budget": "budget",
    "StepProfile": "budget",
    "choose_budget": "budget",
    "choose_plan": "budget",
    "choose_recompute": "budget",
    "exposed_time": "budget",
    "OffloadHandle": "cache",
    "OffloadStats": "cache",
    "SavedHandle": "cache",
    "ScopeSpec": "cache",
    "TensorCache": "cache",
    "install": "cache",
    "OffloadConfig": "config",
    "PinnedPool": "pool",
    "Residency": "residency",
    "track_saved_tensors": "residency",
}

if TYPE_CHECKING:
    from flowlane.offload.adaptive import ProfileResult, choose_last_offloaded, keep_last_k_from_profile
    from flowlane.offload.backends import (
        BackendUnavailableError,
        IOBackend,
        KvikioBackend,
        NullBackend,
        PinnedCpuBackend,
        PosixBackend,
        cleanup_stale,
        kvikio_usable,
        make_backend,
    )
    from flowlane.offload.budget import (
        Budget,
        StepProfile,
        choose_budget,
        choose_plan,
        choose_recompute,
        exposed_time,
    )
    from flowlane.offload.cache import (
        OffloadHandle,
        OffloadStats,
        SavedHandle,
        ScopeSpec,
        TensorCache,
        install,
    )
    from flowlane.offload.config import OffloadConfig
    from flowlane.offload.pool import PinnedPool
    from flowlane.offload.residency import Residency, track_saved_tensors


def __getattr__(name: str) -> Any:
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module 'flowlane.offload' has no attribute {name!r}")
    value = getattr(import_module(f"flowlane.offload.{home}"), name)
    globals()[name] = value
    return value


__all__ = [
    "BackendUnavailableError",
    "Budget",
    "IOBackend",
    "KvikioBackend",
    "NullBackend",
    "OffloadConfig",
    "OffloadHandle",
    "OffloadStats",
    "PinnedCpuBackend",
    "PinnedPool",
    "PosixBackend",
    "ProfileResult",
    "Residency",
    "SavedHandle",
    "ScopeSpec",
    "StepProfile",
    "TensorCache",
    "choose_budget",
    "choose_plan",
    "choose_recompute",
    "choose_last_offloaded",
    "cleanup_stale",
    "exposed_time",
    "install",
    "keep_last_k_from_profile",
    "kvikio_usable",
    "make_backend",
    "track_saved_tensors",
]
