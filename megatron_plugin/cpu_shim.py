"""Run Megatron-core on CPU with gloo — for tests and CPU demos ONLY.

Megatron-core hard-codes CUDA in a few places (see shared research/environment.md §5). This module patches exactly
those, and nothing in megatron_plugin depends on it: on a GPU machine the plugin runs on stock Megatron.

Patched (megatron-core 0.14-0.16):
- ``torch.cuda.current_device/synchronize/get_rng_state/manual_seed`` (p2p buffers, DDP buffers, RNG tracker);
- ``tensor_parallel.random._get/_set_cuda_rng_state`` (``CudaRNGStatesTracker``);
- the literal ``device="cuda"`` in ``pipeline_parallel.schedules`` / ``p2p_communication`` (a torch proxy that
  maps CUDA devices to CPU for ``zeros/empty/tensor``).
"""

from __future__ import annotations

import types
from typing import Any

import torch

_APPLIED = False


def _cpu_device(kwargs: dict[str, Any]) -> dict[str, Any]:
    dev = kwargs.get("device")
    if dev is not None and (str(dev).startswith("cuda") or isinstance(dev, int)):
        kwargs["device"] = "cpu"
    return kwargs


class _TorchOnCpu(types.ModuleType):
    """A stand-in for the ``torch`` module inside the Megatron modules that write ``device="cuda"``."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)

    @staticmethod
    def zeros(*a: Any, **kw: Any) -> torch.Tensor:
        return torch.zeros(*a, **_cpu_device(kw))

    @staticmethod
    def empty(*a: Any, **kw: Any) -> torch.Tensor:
        return torch.empty(*a, **_cpu_device(kw))

    @staticmethod
    def tensor(*a: Any, **kw: Any) -> torch.Tensor:
        return torch.tensor(*a, **_cpu_device(kw))


def apply() -> None:
    """Idempotently patch Megatron-core for CPU execution. Refuses to run where CUDA is available."""
    global _APPLIED
    if _APPLIED:
        return
    if torch.cuda.is_available():
        raise RuntimeError("megatron_plugin.cpu_shim is for machines without a GPU; CUDA is available here")
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    torch.cuda.synchronize = lambda *a, **k: None  # type: ignore[assignment]
    torch.cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()  # type: ignore[assignment]
    torch.cuda.manual_seed = lambda seed: torch.manual_seed(seed)  # type: ignore[assignment]

    import megatron.core.pipeline_parallel.p2p_communication as p2p
    import megatron.core.pipeline_parallel.schedules as schedules
    import megatron.core.tensor_parallel.random as mrandom

    mrandom._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    proxy = _TorchOnCpu("torch_on_cpu")
    schedules.torch = proxy
    p2p.torch = proxy
    _APPLIED = True
