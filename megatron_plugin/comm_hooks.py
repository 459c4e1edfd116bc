"""Route Megatron-core's pipeline traffic through flowlane.comm (a documented extension point, no monkeypatching).

:class:`FlowlaneP2PCommunicator` is a ``P2PCommunicator`` subclass passed to the pipelined schedules through their
``p2p_communicator=`` keyword. Its ``_communicate`` posts the same sends/receives as Megatron's batched path, but
through :func:`flowlane.comm.batch_isend_irecv` (kind ``"pp"``), so bytes are counted and each op can carry a
scheduling key. Receive buffers are allocated on the model's device, not on ``torch.cuda.current_device()``.

``key_provider`` (optional) is called for every op as ``key_provider(kind, info)`` and returns the key stored with
the op; Hermod (megatron_plugin.hermod) supplies one. Data-parallel traffic stays with Megatron-core's own
DistributedDataParallel (Hermod hooks its bucket groups: megatron_plugin.ddp_hooks).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

from flowlane import comm

KeyProvider = Callable[[str, dict[str, Any]], Any]


class FlowlaneP2PCommunicator(P2PCommunicator):
    """Megatron pipeline p2p through flowlane.comm (fixed sequence lengths; batched-p2p semantics)."""

    def __init__(
        self,
        pp_group: dist.ProcessGroup,
        config: Any,
        device: torch.device | str | None = None,
        key_provider: KeyProvider | None = None,
    ) -> None:
        super().__init__(pp_group, config)
        if getattr(config, "variable_seq_lengths", False):
            raise ValueError(
                "FlowlaneP2PCommunicator supports fixed sequence lengths only "
                "(config.variable_seq_lengths=True is not supported)"
            )
        self.device = (
            torch.device(device)
            if device is not None
            else (
                torch.device("cuda", torch.cuda.current_device())
                if torch.cuda.is_available()
                else torch.device("cpu")
            )
        )
        self.key_provider = key_provider

    def _communicate(
        self,
        *,
        tensor_send_next: torch.Tensor | None,
        tensor_send_prev: torch.Tensor | None,
        recv_prev: bool,
        recv_next: bool,
        tensor_shape: Sequence[int] | None,
        wait_on_reqs: bool = True,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, Any]:
        dtype = self.config.pipeline_dtype
        if (recv_prev or recv_next) and (dtype is None or tensor_shape is None):
            raise RuntimeError(
                f"pipeline_dtype ({dtype}) and tensor_shape ({tensor_shape}) are required to receive"
            )

        def buffer() -> torch.Tensor:
            return torch.empty(tuple(tensor_shape), requires_grad=True, device=self.device, dtype=dtype)

        recv_prev_t = buffer() if recv_prev else None
        recv_next_t = buffer() if recv_next else None
        ops: list[tuple[str, dist.P2POp]] = []
        # same order as Megatron's _batched_p2p_ops: send_prev, recv_prev, send_next, recv_next
        for direction, fn, t, peer in (
            ("send_prev", dist.isend, tensor_send_prev, self.prev_rank),
            ("recv_prev", dist.irecv, recv_prev_t, self.prev_rank),
            ("send_next", dist.isend, tensor_send_next, self.next_rank),
            ("recv_next", dist.irecv, recv_next_t, self.next_rank),
        ):
            if t is not None:
                ops.append((direction, dist.P2POp(fn, t, peer, self.pp_group)))
        keys = (
            [self.key_provider("pp", {"direction": d, "peer": p.peer}) for d, p in ops]
            if self.key_provider
            else None
        )
        works = comm.batch_isend_irecv([p for _, p in ops], kind="pp", keys=keys)
        if wait_on_reqs:
            for w in works:
                w.wait()
            works = []
        return recv_prev_t, recv_next_t, works
