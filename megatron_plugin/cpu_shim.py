"""Run Megatron-core on CPU with gloo — for tests and CPU demos ONLY.

Megatron-core hard-codes CUDA in a few places (see shared research/environment.md §5). This module patches exactly
those, and nothing in megatron_plugin depends on it: on a GPU machine the plugin runs on stock Megatron.

Patched (megatron-core 0.14-0.16):
- ``torch.cuda.current_device/synchronize/get_rng_state/manual_seed`` (p2p buffers, DDP buffers, RNG tracker);
- ``tensor_parallel.random._get/_set_cuda_rng_state`` (``CudaRNGStatesTracker``);
- ``torch.cuda.Stream/Event/stream/current_stream`` and ``Tensor.record_stream`` (MoE token dispatcher);
- the literal ``device="cuda"`` in ``pipeline_parallel.schedules`` / ``p2p_communication``, the MoE router / utils
  and the optimizers (``optimizer.optimizer``, ``optimizer.clip_grads``, ``optimizer.distrib_optimizer``: loss
  scale, found-inf and norm buffers; ``optimizer.grad_scaler``: the fp16 loss scalers' scale, min-scale, growth and
  backoff tensors) and ``megatron.core.utils`` (the gradient norm without Apex), through a torch proxy that maps CUDA devices to CPU for ``zeros/empty/tensor``.
  With it Megatron-core's own ``DistributedDataParallel`` and ``get_megatron_optimizer`` run on gloo;
- ``Tensor.cuda()`` returns the tensor itself (the tied-embedding set-up moves the shared weight with it);
- ``Tensor.type()`` (no arguments) names a CPU tensor as its CUDA twin (``torch.cuda.FloatTensor``): the optimizers
  and gradient clipping check parameter types against those strings.
"""

from __future__ import annotations

import contextlib
import types
from typing import Any

import torch

_APPLIED = False


def _cpu_device(kwargs: dict[str, Any]) -> dict[str, Any]:
    dev = kwargs.get("device")
    if dev is not None and (str(dev).startswith("cuda") or isinstance(dev, int)):
        kwargs["device"] = "cpu"
    return kwargs


class _CpuStream:
    """Stands in for ``torch.cuda.Stream``/``Event`` (the MoE token dispatcher's D2H side stream): CPU work is
    synchronous, so every wait is a no-op."""

    def __init__(self, *a: Any, **k: Any) -> None:
        pass

    def wait_stream(self, other: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> _CpuStream:
        return self

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def record(self, stream: Any = None) -> None:
        pass

    def wait(self, stream: Any = None) -> None:
        pass


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
    torch.cuda.Stream = _CpuStream  # type: ignore[assignment,misc]
    torch.cuda.Event = _CpuStream  # type: ignore[assignment,misc]
    _default_stream = _CpuStream()
    torch.cuda.current_stream = lambda *a, **k: _default_stream  # type: ignore[assignment]
    torch.cuda.default_stream = lambda *a, **k: _default_stream  # type: ignore[assignment]
    torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()  # type: ignore[assignment]
    torch.Tensor.record_stream = lambda self, stream: None  # type: ignore[method-assign]
    torch.Tensor.cuda = lambda self, *a, **k: self  # type: ignore[method-assign,assignment]
    tensor_type = torch.Tensor.type

    def type_as_on_cuda(self: torch.Tensor, dtype: Any = None, non_blocking: bool = False, **kw: Any) -> Any:
        if dtype is None and not kw and self.device.type == "cpu":
            return tensor_type(self).replace("torch.", "torch.cuda.", 1)
        return tensor_type(self, dtype, non_blocking, **kw)

    torch.Tensor.type = type_as_on_cuda  # type: ignore[method-assign,assignment]

    import megatron.core.pipeline_parallel.p2p_communication as p2p
    import megatron.core.pipeline_parallel.schedules as schedules
    import megatron.core.tensor_parallel.random as mrandom
    import megatron.core.transformer.moe.moe_utils as moe_utils
    import megatron.core.transformer.moe.router as moe_router

    mrandom._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    proxy = _TorchOnCpu("torch_on_cpu")
    schedules.torch = proxy
    p2p.torch = proxy
    moe_utils.torch = proxy
    # the all-to-all dispatcher turns split sizes into numpy only for CUDA tensors; on CPU they stayed tensors
    import megatron.core.transformer.moe.token_dispatcher as dispatcher

    def move_to_cpu(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
        if torch.is_tensor(tensor) and as_numpy:
            return tensor.cpu().numpy()
        return tensor

    moe_utils.maybe_move_tensor_to_cpu = move_to_cpu
    dispatcher.maybe_move_tensor_to_cpu = move_to_cpu
    from megatron_plugin import te_compat  # not CPU-specific: the GPU paths apply it too

    te_compat.apply()
    moe_router.torch = proxy
    import megatron.core.optimizer.clip_grads as clip_grads
    import megatron.core.optimizer.distrib_optimizer as distrib_optimizer
    import megatron.core.optimizer.grad_scaler as grad_scaler
    import megatron.core.optimizer.optimizer as optimizer
    import megatron.core.utils as mutils

    optimizer.torch = proxy
    clip_grads.torch = proxy
    distrib_optimizer.torch = proxy
    grad_scaler.torch = proxy  # Constant/DynamicGradScaler (--fp16 without --loss-scale: the dynamic one)
    mutils.torch = proxy  # local_multi_tensor_l2_norm (the gradient norm without Apex)
    _APPLIED = True
