"""SSDTrain activation offloading (seed 003 ch. 5): a tensor cache on saved-tensor hooks with pluggable I/O backends.

Saved activations of a tiny 3-block model go to files in a temporary folder and come back for backward; the gradients
are bitwise those of the run without offloading (on CPU, ``offload_cpu_tensors=True`` is needed: the thesis leaves CPU
tensors alone)::

    >>> import tempfile, torch
    >>> from flowlane.offload import OffloadConfig, install
    >>> class Block(torch.nn.Sequential):  # the layer class: each instance is one scope
    ...     def __init__(self):
    ...         super().__init__(torch.nn.Linear(64, 64), torch.nn.ReLU())
    >>> _ = torch.manual_seed(0)
    >>> model, x = torch.nn.Sequential(Block(), Block(), Block()), torch.randn(32, 64)
    >>> model(x).square().sum().backward()  # the reference: no offloading
    >>> ref = [p.grad.clone() for p in model.parameters()]; model.zero_grad()
    >>> tmp = tempfile.TemporaryDirectory()
    >>> cfg = OffloadConfig(dirs=(tmp.name,), min_bytes=1024, offload_cpu_tensors=True)  # backend="posix"
    >>> cache = install(model, cfg, scope_classes=["Block"])
    >>> loss = model(x).square().sum()
    >>> cache.wait_io(); loss.backward()  # waits for the stores only so that the counts below are exact
    >>> all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), ref))
    True
    >>> # x and the first two blocks' outputs (32 x 64 fp32 each) went to disk; the last block stays (keep_last_k=1)
    >>> s = cache.stats_snapshot(); s.storages_offloaded, s.bytes_written
    (3, 24576)
    >>> cache.close(); tmp.cleanup()

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
    "ScopeSpec": "cache",
    "TensorCache": "cache",
    "install": "cache",
    "OffloadConfig": "config",
    "PinnedPool": "pool",
    "OffloadStats": "record",
    "SavedHandle": "record",
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
    from flowlane.offload.cache import OffloadHandle, ScopeSpec, TensorCache, install
    from flowlane.offload.config import OffloadConfig
    from flowlane.offload.pool import PinnedPool
    from flowlane.offload.record import OffloadStats, SavedHandle
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
