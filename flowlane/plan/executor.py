"""``graph_allgather``: run a compiled plan stage by stage over torch.distributed (DGCL seed 001 §4.2, §6.1).

Forward: rows ``[local]`` are copied into a buffer ``[local | remote | relay]``; in stage ``k`` every rank posts its
stage-``k`` receives (one fused message per peer), sends one fused message per peer gathered from rows it already
holds, waits, and scatters what it received. There is no global barrier between stages: a rank only waits for its own
messages (digest §5 item 17, the torch.distributed equivalent of the ready/done flags). Returns ``[local | remote]``.

Backward (§6.1: stages reversed, send and receive tables swapped): gradient rows ``[local | remote]`` are placed in a
buffer (relay rows start at zero); in reverse stage order each rank sends the gradient of every row it received in
that stage back to the sender, and adds (``index_add_``) what its children return to the rows it sent. Because children
are deeper in the tree, a relay has summed all of its subtree's gradients before it sends one message to its parent
(digest §5 item 13). On CPU ``index_add_`` is serial and deterministic, so no sub-stage split is needed (item 14).

Each stage's receives and sends are posted together as one ``batch_isend_irecv`` on the exchange's ``group``: NCCL
deadlocks when two ranks exchange through separate, ungrouped send/recv calls (NVIDIA/nccl#479), and the group keeps
the exchange apart from other traffic (e.g. layer all-reduces on another thread). NCCL also requires the first
batched call on a group to involve every rank of it, while a stage may involve only some: so the first exchange of a
:class:`GraphExchange` (forward or backward, the same call on every rank) starts with a one-element all-reduce on the
group (kind ``"setup"``). All bytes go through :mod:`flowlane.comm` (kind ``"graph"``), so they are counted. Works on
gloo and NCCL (tensors on the device of the input; index tables are moved there once).
"""

from __future__ import annotations

import threading
import time
from typing import Any

import torch
import torch.distributed as dist

from flowlane import comm

from .tables import RankTables


class GraphExchange:
    """Executor of one rank's tables. ``group``: process group whose ranks are the plan's ranks (default world)."""

    def __init__(
        self,
        tables: RankTables,
        group: dist.ProcessGroup | None = None,
        kind: str = "graph",
        emulate_bandwidth: float | None = None,
    ) -> None:
        """``emulate_bandwidth`` (bytes/s, benchmarks only): after each stage, sleep as long as the largest message
        to or from one peer would take on a dedicated link of that speed (an *emulated* link, labelled as such)."""
        if emulate_bandwidth is not None and not emulate_bandwidth > 0:
            raise ValueError(f"emulate_bandwidth must be > 0 bytes/s or None, got {emulate_bandwidth!r}")
        self.tables = tables
        self.group = group
        self.kind = kind
        self.emulate_bandwidth = emulate_bandwidth
        self._idx: dict[torch.device, list[tuple[list, list]]] = {}
        self._bwd_tail: _Background | None = None  # the last deferred backward exchange (GradSlot)
        self._joined = False  # the group's one-time all-reduce done (NCCL's first-batched-call rule)

    @property
    def num_out(self) -> int:
        return self.tables.num_local + self.tables.num_remote

    def _peer(self, r: int) -> int:
        if self.group is None or self.group is dist.GroupMember.WORLD:
            return r
        return dist.get_global_rank(self.group, r)

    def _stages(self, device: torch.device) -> list[tuple[list, list]]:
        if device not in self._idx:
            self._idx[device] = [
                (
                    [(self._peer(p), torch.from_numpy(ix).to(device)) for p, ix in st.sends],
                    [(self._peer(p), torch.from_numpy(ix).to(device)) for p, ix in st.recvs],
                )
                for st in self.tables.stages
            ]
        return self._idx[device]

    def _check(self, x: torch.Tensor, rows: int, what: str) -> None:
        if x.dim() < 1 or x.shape[0] != rows:
            raise ValueError(
                f"{what}: expected {rows} rows on rank {self.tables.rank}, got shape {tuple(x.shape)}"
            )

    def forward_raw(self, local: torch.Tensor, key: Any = None) -> torch.Tensor:
        t = self.tables
        self._check(local, t.num_local, "graph_allgather input")
        buf = local.new_zeros((t.num_rows, *local.shape[1:]))
        buf[: t.num_local] = local
        self._join(buf)
        for sends, recvs in self._stages(local.device):
            if not sends and not recvs:
                continue
            got = [(ix, buf.new_empty((ix.numel(), *buf.shape[1:]))) for _, ix in recvs]
            self._exchange([(p, g) for (p, _), (_, g) in zip(recvs, got, strict=True)], sends, buf, key)
            self._emulate(sends, recvs, buf)
            for ix, g in got:
                buf.index_copy_(0, ix, g)
        return buf[: self.num_out]

    def backward_raw(self, grad: torch.Tensor, key: Any = None) -> torch.Tensor:
        t = self.tables
        self._check(grad, self.num_out, "graph_allgather gradient")
        buf = grad.new_zeros((t.num_rows, *grad.shape[1:]))
        buf[: self.num_out] = grad
        self._join(buf)
        for sends, recvs in reversed(self._stages(grad.device)):
            if not sends and not recvs:
                continue
            got = [(ix, buf.new_empty((ix.numel(), *buf.shape[1:]))) for _, ix in sends]
            self._exchange([(p, g) for (p, _), (_, g) in zip(sends, got, strict=True)], recvs, buf, key)
            self._emulate(sends, recvs, buf)
            for ix, g in got:
                buf.index_add_(0, ix, g)
        return buf[: t.num_local].contiguous()

    def _join(self, buf: torch.Tensor) -> None:
        """Once per exchange, before its first stage: a one-element all-reduce on the group, so that the group's
        first collective involves all of its ranks (NCCL requires it of the first ``batch_isend_irecv``; a stage may
        involve only some ranks). Skipped for a plan without stages (then no rank exchanges anything)."""
        if self._joined or not self.tables.stages:
            return
        comm.all_reduce(torch.zeros(1, device=buf.device), group=self.group, kind="setup")
        self._joined = True

    def _exchange(self, recvs: list, sends: list, buf: torch.Tensor, key: Any) -> None:
        """One stage: receive into ``recvs`` ``(peer, tensor)`` and send ``buf``'s rows ``sends`` ``(peer, rows)``,
        posted as one batch on the group (NCCL: one group call), then wait for all of it."""
        ops = [dist.P2POp(dist.irecv, g, p, group=self.group) for p, g in recvs]
        ops += [dist.P2POp(dist.isend, buf.index_select(0, ix), p, group=self.group) for p, ix in sends]
        for w in comm.batch_isend_irecv(ops, kind=self.kind, key=key):
            w.wait()

    def _emulate(self, sends: list, recvs: list, buf: torch.Tensor) -> None:
        if self.emulate_bandwidth is None:
            return
        row = buf[0].numel() * buf.element_size() if buf.shape[0] else 0
        biggest = max((ix.numel() for _, ix in (*sends, *recvs)), default=0) * row
        time.sleep(biggest / self.emulate_bandwidth)

    def start(self, local: torch.Tensor, key: Any = None) -> PendingExchange:
        """Run the forward exchange in a helper thread (used by pipelined runtimes); ``.wait()`` returns the rows."""
        return PendingExchange(self, local.detach(), key)


class _Background:
    """``fn()`` on a helper thread; ``wait()`` joins it and returns its result (or re-raises its error)."""

    def __init__(self, fn: Any) -> None:
        self._out: Any = None
        self._err: BaseException | None = None

        def run() -> None:
            try:
                self._out = fn()
            except BaseException as e:  # noqa: BLE001 - re-raised in wait()
                self._err = e

        self._thread = threading.Thread(target=run, name="flowlane-graph-exchange", daemon=True)
        self._thread.start()

    def wait(self) -> Any:
        self._thread.join()
        if self._err is not None:
            raise self._err
        return self._out


class PendingExchange(_Background):
    """A forward exchange running on a helper thread (:meth:`GraphExchange.start`)."""

    def __init__(self, ex: GraphExchange, local: torch.Tensor, key: Any) -> None:
        super().__init__(lambda: ex.forward_raw(local, key))

    def wait(self) -> torch.Tensor:
        out = super().wait()
        assert out is not None
        return out


class GradSlot:
    """A deferred backward exchange (pipelined backward, G3 §4.4.3 run in reverse).

    The backward of :func:`attach` given a slot does not block: it starts the reversed-plan exchange of the halo
    rows' gradient on a helper thread and returns only the gradient of the local rows' own use. The gradients other
    ranks return for this rank's rows are added where they are needed, by :func:`add_deferred_grad` (placed in the
    forward before the layer that produced the rows), so the backward compute in between overlaps the exchange.
    The sum is the same as the blocking backward's (float addition order differs)."""

    def __init__(self, exchange: GraphExchange, like: torch.Tensor) -> None:
        """``like``: a tensor of the exchanged rows (its row shape, dtype and device are used)."""
        self.exchange = exchange
        self._like = like.detach()[:0]
        self._pending: _Background | None = None
        self._result: torch.Tensor | None = None
        self.consumed = False

    @property
    def started(self) -> bool:
        return self._pending is not None

    def start(self, grad: torch.Tensor) -> None:
        """Begin the exchange of ``grad`` (``[local | remote]`` rows); the local rows are not sent (zeroed here)."""
        if self._pending is not None:
            raise RuntimeError("GradSlot.start called twice (one backward exchange per slot)")
        g = grad.detach().clone()
        g[: self.exchange.tables.num_local] = 0
        ex, prev = self.exchange, getattr(self.exchange, "_bwd_tail", None)

        def run() -> torch.Tensor:
            if prev is not None:  # one backward exchange at a time, in start order (the same on every rank)
                prev.wait()
            return ex.backward_raw(g)

        self._pending = ex._bwd_tail = _Background(run)

    def result(self) -> torch.Tensor:
        """What the other ranks returned for this rank's local rows (``num_local`` rows). A slot whose backward never
        started (this rank's halo rows got no gradient) still joins the exchange, with zeros, so peers do not
        wait forever."""
        if self._result is None:
            if self._pending is None:
                self.start(self._like.new_zeros((self.exchange.num_out, *self._like.shape[1:])))
            assert self._pending is not None
            self._result = self._pending.wait()
        return self._result


class _GraphAllgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, ex: GraphExchange, key: Any) -> torch.Tensor:  # type: ignore[override]
        ctx.ex, ctx.key = ex, key
        return ex.forward_raw(local, key)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # type: ignore[override]
        return ctx.ex.backward_raw(grad.contiguous(), ctx.key), None, None


class _Attach(torch.autograd.Function):
    """Differentiable ``[local | remote]`` from rows an asynchronous exchange already delivered."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, local: torch.Tensor, full: torch.Tensor, ex: GraphExchange, slot: GradSlot | None
    ) -> torch.Tensor:
        ctx.ex, ctx.slot, ctx.n = ex, slot, local.shape[0]
        return torch.cat([local.detach(), full[local.shape[0] :]])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:  # type: ignore[override]
        if ctx.slot is None:
            return ctx.ex.backward_raw(grad.contiguous()), None, None, None
        ctx.slot.start(grad.contiguous())  # the returned halo gradients are added by add_deferred_grad
        return grad[: ctx.n], None, None, None


class _AddDeferredGrad(torch.autograd.Function):
    """Identity forward; backward adds what ``slot``'s exchange returned for ``rows`` (waiting for it here)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, slot: GradSlot, rows: torch.Tensor | None) -> torch.Tensor:  # type: ignore[override]
        ctx.slot, ctx.rows = slot, rows
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # type: ignore[override]
        got = ctx.slot.result().to(grad.device)
        ctx.slot.consumed = True
        return grad + (got if ctx.rows is None else got[ctx.rows.to(got.device)]), None, None


def add_deferred_grad(x: torch.Tensor, slot: GradSlot, rows: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` unchanged; in backward, ``x``'s gradient gains the rows other ranks returned through ``slot``
    (``rows``: which of this rank's local rows ``x`` holds, in order; None: all of them)."""
    if not (torch.is_grad_enabled() and x.requires_grad):
        return x
    return _AddDeferredGrad.apply(x, slot, rows)


def attach(
    local: torch.Tensor, pending: PendingExchange, exchange: GraphExchange, slot: GradSlot | None = None
) -> torch.Tensor:
    """Wait for ``pending`` (started with ``exchange.start`` on rows whose *sent* rows equal ``local``'s) and return
    ``[local | remote]`` with the same backward as :func:`graph_allgather`; with ``slot``, that backward runs in the
    background (see :class:`GradSlot`)."""
    full = pending.wait()
    if local.requires_grad and torch.is_grad_enabled():
        return _Attach.apply(local, full, exchange, slot)
    return torch.cat([local, full[local.shape[0] :]])


def graph_allgather(local_embeddings: torch.Tensor, exchange: GraphExchange, key: Any = None) -> torch.Tensor:
    """``[local | remote]`` rows for this rank (DGCL's ``graphAllgather``); differentiable."""
    if local_embeddings.requires_grad:
        return _GraphAllgather.apply(local_embeddings, exchange, key)
    return exchange.forward_raw(local_embeddings, key)
