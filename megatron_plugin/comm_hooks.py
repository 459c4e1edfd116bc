"""Route Megatron-core's pipeline and data-parallel traffic through flowlane.comm.

Two documented Megatron extension points, no monkeypatching:

* :class:`FlowlaneP2PCommunicator` — a ``P2PCommunicator`` subclass passed to the pipelined schedules through their
  ``p2p_communicator=`` keyword. Its ``_communicate`` posts the same sends/receives as Megatron's batched path, but
  through :func:`flowlane.comm.batch_isend_irecv` (kind ``"pp"``), so bytes are counted and each op can carry a
  scheduling key. Receive buffers are allocated on the model's device, not on ``torch.cuda.current_device()``.
* :class:`DataParallelGradSync` — a ``finalize_model_grads_func`` (``ModelParallelConfig`` hook) that all-reduces
  gradients over the data-parallel group in fixed-size flat buckets (kind ``"dp"``) and averages them.

``key_provider`` (optional) is called for every op as ``key_provider(kind, info)`` and returns the key stored with
the op; Hermod (megatron_plugin.hermod) supplies one. ``bucket_hook`` lets a scheduler reorder or chunk DP buckets.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

from flowlane import comm

KeyProvider = Callable[[str, dict[str, Any]], Any]


class FlowlaneP2PCommunicator(P2PCommunicator):
    """Megatron pipeline p2p through flowlane.comm (fixed sequence lengths; batched-p2p semantics)."""

    def __init__(self, pp_group: dist.ProcessGroup, config: Any, device: torch.device | str | None = None,
                 key_provider: KeyProvider | None = None) -> None:
        super().__init__(pp_group, config)
        if getattr(config, "variable_seq_lengths", False):
            raise ValueError("FlowlaneP2PCommunicator supports fixed sequence lengths only "
                             "(config.variable_seq_lengths=True is not supported)")
        self.device = torch.device(device) if device is not None else (
            torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu"))
        self.key_provider = key_provider

    def _communicate(self, *, tensor_send_next: torch.Tensor | None, tensor_send_prev: torch.Tensor | None,
                     recv_prev: bool, recv_next: bool, tensor_shape: Sequence[int] | None,
                     wait_on_reqs: bool = True) -> tuple[torch.Tensor | None, torch.Tensor | None, Any]:
        dtype = self.config.pipeline_dtype
        if (recv_prev or recv_next) and (dtype is None or tensor_shape is None):
            raise RuntimeError(f"pipeline_dtype ({dtype}) and tensor_shape ({tensor_shape}) are required to receive")

        def buffer() -> torch.Tensor:
            return torch.empty(tuple(tensor_shape), requires_grad=True, device=self.device, dtype=dtype)

        recv_prev_t = buffer() if recv_prev else None
        recv_next_t = buffer() if recv_next else None
        ops: list[tuple[str, dist.P2POp]] = []
        # same order as Megatron's _batched_p2p_ops: send_prev, recv_prev, send_next, recv_next
        for direction, fn, t, peer in (("send_prev", dist.isend, tensor_send_prev, self.prev_rank),
                                       ("recv_prev", dist.irecv, recv_prev_t, self.prev_rank),
                                       ("send_next", dist.isend, tensor_send_next, self.next_rank),
                                       ("recv_next", dist.irecv, recv_next_t, self.next_rank)):
            if t is not None:
                ops.append((direction, dist.P2POp(fn, t, peer, self.pp_group)))
        keys = ([self.key_provider("pp", {"direction": d, "peer": p.peer}) for d, p in ops]
                if self.key_provider else None)
        works = comm.batch_isend_irecv([p for _, p in ops], kind="pp", keys=keys)
        if wait_on_reqs:
            for w in works:
                w.wait()
            works = []
        return recv_prev_t, recv_next_t, works


def _flat_buckets(params: Iterable[torch.nn.Parameter], bucket_bytes: int) -> list[list[torch.nn.Parameter]]:
    """Group parameters with gradients into buckets of at most ``bucket_bytes`` (a larger param gets its own),
    in reverse registration order — the order backward produces gradients, as in Megatron's DDP."""
    buckets: list[list[torch.nn.Parameter]] = [[]]
    size = 0
    for p in reversed([p for p in params if p.requires_grad]):
        nbytes = p.numel() * p.element_size()
        if buckets[-1] and size + nbytes > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(p)
        size += nbytes
    return [b for b in buckets if b]


@dataclass
class GradBucket:
    """Parameters whose gradients are reduced together, and the group they are reduced over."""

    params: list[torch.nn.Parameter]
    group: dist.ProcessGroup | None
    expert: bool


def grad_buckets(params: Sequence[torch.nn.Parameter], bucket_bytes: int, dp_group: dist.ProcessGroup | None,
                 expert_dp_group: dist.ProcessGroup | None) -> list[GradBucket]:
    """Dense parameters in buckets over the DP group, then expert parameters over the expert-data-parallel group.

    Megatron marks expert parameters with ``allreduce=False``: they are averaged over the expert-data-parallel group
    only (ranks holding the same experts), never over the full DP group. Every DP path of the plugin (this module's
    all-reduce, Hermod's deferred sync, the distributed optimizer) buckets with this function: identical buckets and
    groups, identical math."""
    expert = [p for p in params if getattr(p, "allreduce", True) is False]
    if expert and expert_dp_group is None:
        raise ValueError(f"{len(expert)} expert parameters (allreduce=False) but no expert_dp_group was given")
    dense = [p for p in params if getattr(p, "allreduce", True) is not False]
    return ([GradBucket(b, dp_group, False) for b in _flat_buckets(dense, bucket_bytes)]
            + [GradBucket(b, expert_dp_group, True) for b in _flat_buckets(expert, bucket_bytes)])


class DataParallelGradSync:
    """``config.finalize_model_grads_func``: bucketed gradient all-reduce (SUM, then / dp size) over the DP group.

    gloo on older torch lacks ReduceOp.AVG, so averaging is a division after a SUM on every backend; with a
    power-of-two DP size the division is exact in floating point.
    """

    def __init__(self, dp_group: dist.ProcessGroup, bucket_bytes: int = 4 << 20,
                 expert_dp_group: dist.ProcessGroup | None = None, key_provider: KeyProvider | None = None,
                 bucket_hook: Callable[[list[GradBucket]], list[GradBucket]] | None = None,
                 ) -> None:
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
        self.dp_group = dp_group
        self.expert_dp_group = expert_dp_group
        self.bucket_bytes = bucket_bytes
        self.key_provider = key_provider
        self.bucket_hook = bucket_hook

    def __call__(self, model: Sequence[torch.nn.Module] | torch.nn.Module, *args: Any, **kwargs: Any) -> None:
        models = model if isinstance(model, list | tuple) else [model]
        buckets = grad_buckets([p for m in models for p in m.parameters()], self.bucket_bytes, self.dp_group,
                               self.expert_dp_group)
        if self.bucket_hook is not None:
            buckets = self.bucket_hook(buckets)
        for i, bucket in enumerate(buckets):
            world = dist.get_world_size(bucket.group)
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in bucket.params]
            flat = torch.cat([g.reshape(-1) for g in grads])
            if world > 1:
                info = {"bucket": i, "expert": bucket.expert}
                key = self.key_provider("dp", info) if self.key_provider else None
                comm.all_reduce(flat, group=bucket.group, kind="dp", key=key)
                flat.div_(world)
            offset = 0
            for p in bucket.params:
                n = p.numel()
                p.grad = flat[offset:offset + n].view_as(p).clone()
                offset += n
