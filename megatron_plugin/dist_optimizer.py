"""Megatron's distributed optimizer (``--use-distributed-optimizer``, ZeRO-1) on the plugin's bucketed DP path.

Megatron-core's own ``DistributedOptimizer`` needs its CUDA ``DistributedDataParallel`` buffers; this is the same
scheme on the plugin's DP path (:func:`megatron_plugin.comm_hooks.grad_buckets`), so that it runs on gloo too and a
scheduler can take over its two collectives:

* **grad sync** (``finalize_model_grads_func``): each bucket's flat gradient, zero-padded to a multiple of the
  group size W, is reduce-scattered (SUM, then / W); rank r keeps elements [r*S, (r+1)*S) of the bucket, S = N / W.
  ``overlap_grad_reduce=True`` follows megatron-core's ``overlap_grad_reduce``: Megatron's schedules run every
  microbatch but the last inside ``config.no_sync_func`` (:meth:`DistributedOptimizer.no_sync`); in the last one a
  dense bucket's reduce-scatter is launched as soon as its last gradient is accumulated (post-accumulate-grad
  hooks, the same program point on every rank), and ``finalize_model_grads`` launches the rest (expert buckets:
  whether an expert gets a gradient depends on the rank's tokens) and waits for all of them.
* **step**: the wrapped optimizer (Adam) steps only this rank's shard of every bucket (``main`` parameters), so its
  state is 1/W of the model's.
* **param gather**: every bucket's updated shards are all-gathered back into the model's parameters, as Megatron
  does after the step. ``overlap_param_gather=False`` (Megatron's default) gathers everything at the end of
  ``step``. ``True`` follows megatron-core's ``overlap_param_gather``: the first bucket in forward order is
  dispatched at the end of ``step`` and each module's forward pre-hook waits for its bucket and dispatches the next
  one (one bucket ahead). Expert buckets are all dispatched at the end of ``step`` in this mode: whether an expert
  module runs (and so fires its pre-hook) can depend on the rank's tokens, and a collective must not.
* a :class:`ParamGatherScheduler` (Hermod: :meth:`megatron_plugin.hermod.Hermod.attach_distributed_optimizer`)
  replaces both: it receives every bucket's gather, chunked, at the end of ``step`` and launches it when it decides;
  the forward pre-hooks only wait.

Math: Adam is elementwise, so stepping shards equals stepping whole tensors; the reduce-scatter adds the same W
values per element as an all-reduce. Whatever dispatches the gathers, a parameter is written before its module's
forward runs (pre-hook), and every pending gather is finished before the next step, so the math never depends on
when a gather went out (tested bitwise against the synchronous gather, with and without Hermod).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist

from flowlane import comm
from megatron_plugin.comm_hooks import GradBucket, grad_buckets

Launch = Callable[[], Any]
Bounds = list[tuple[int, int]]


class ParamGatherScheduler(Protocol):
    """What a scheduler supplies to take over the parameter gathers (Hermod implements it)."""

    def chunk_bounds(self, numel: int, element_size: int) -> Bounds:
        """[start, end) ranges of one shard that go out as separate collectives."""

    def launch_gather(self, index: int, bucket: ShardedBucket, launches: Sequence[Launch]) -> Any:
        """Take one bucket's chunked gather; return a handle whose ``wait()`` returns when every chunk is done."""

    def gathers_dispatched(self) -> None:
        """Called once after all buckets were handed over, at the same program point on every rank."""


@dataclass
class ShardedBucket:
    """One DP bucket: its parameters, their group, and this rank's shard of the flat (padded) bucket."""

    bucket: GradBucket
    world: int
    rank: int
    numel: int
    """Elements of the bucket's parameters (unpadded)."""
    shard_numel: int
    """S: elements per rank; the padded bucket has S * world elements."""
    main: torch.nn.Parameter
    """This rank's shard of the parameters: what the wrapped optimizer steps."""
    gathered: torch.Tensor = field(repr=False)
    """The padded flat bucket the all-gather writes."""

    @property
    def group(self) -> dist.ProcessGroup | None:
        return self.bucket.group

    def flat_grad(self) -> torch.Tensor:
        """The bucket's gradients, flat and zero-padded to S * world (``None`` gradients count as zeros)."""
        flat = torch.zeros(self.shard_numel * self.world, dtype=self.main.dtype, device=self.main.device)
        offset = 0
        for p in self.bucket.params:
            n = p.numel()
            if p.grad is not None:
                flat[offset:offset + n].copy_(p.grad.reshape(-1))
            offset += n
        return flat

    def reduce_scatter_launches(self, flat: torch.Tensor, out: torch.Tensor, bounds: Bounds, key: Any = None,
                                group: dist.ProcessGroup | None = None) -> list[Launch]:
        """One async reduce-scatter per chunk [a, e) of the shard: input = elements [a, e) of every rank's part of
        ``flat`` (a contiguous copy), output = ``out[a:e]``."""
        parts = flat.view(self.world, self.shard_numel)

        def launch(a: int, e: int) -> Any:
            src = flat if (a, e) == (0, self.shard_numel) else parts[:, a:e].reshape(-1)
            return comm.reduce_scatter_tensor(out[a:e], src, group=self.group if group is None else group, kind="dp",
                                              key=key, async_op=True)

        return [lambda a=a, e=e: launch(a, e) for a, e in bounds]

    def gather_launches(self, bounds: Bounds, key: Any = None) -> tuple[list[Launch], Callable[[], None]]:
        """One async all-gather per chunk [a, e) of the shard, and the function that, once they are done, puts the
        chunks in place in ``gathered`` and copies it into the parameters. A launch takes optional ``group=`` (a
        clone of the bucket's group, e.g. a scheduler's traffic class) and ``key=`` overrides."""
        parts = self.gathered.view(self.world, self.shard_numel)
        whole = [(0, self.shard_numel)] == list(bounds)
        bufs = {(a, e): self.gathered if whole else torch.empty(self.world * (e - a), dtype=self.gathered.dtype,
                                                                device=self.gathered.device)
                for a, e in bounds}
        src = self.main.detach()

        def launch(a: int, e: int, group: dist.ProcessGroup | None = None, key: Any = key) -> Any:
            return comm.all_gather_into_tensor(bufs[(a, e)], src[a:e].contiguous(), kind="dp", key=key,
                                               group=self.group if group is None else group, async_op=True)

        def complete() -> None:
            if not whole:
                for (a, e), buf in bufs.items():
                    parts[:, a:e].copy_(buf.view(self.world, e - a))
            self.write_params()

        return [lambda a=a, e=e, **kw: launch(a, e, **kw) for a, e in bounds], complete

    def write_params(self) -> None:
        offset = 0
        with torch.no_grad():
            for p in self.bucket.params:
                n = p.numel()
                p.copy_(self.gathered[offset:offset + n].view_as(p))
                offset += n


@dataclass
class _InFlight:
    handle: Any
    complete: Callable[[], None]


def _wait(handle: Any) -> None:
    for w in handle if isinstance(handle, list) else [handle]:
        if w is not None:
            w.wait()


class DistributedOptimizer:
    """ZeRO-1 over the plugin's DP buckets (see the module docstring). Use it as both the optimizer and
    ``config.finalize_model_grads_func``::

        opt = DistributedOptimizer(model, lr=1e-3, dp_group=dp, bucket_bytes=4 << 20)
        config.finalize_model_grads_func = opt
        config.no_sync_func = opt.no_sync          # with overlap_grad_reduce=True
        for it in ...:  opt.zero_grad(); forward_backward(...); opt.step()
        opt.close()                 # the last gathers, hooks removed (or finish_param_gather() to go on)
    """

    def __init__(self, model: torch.nn.Module | Sequence[torch.nn.Module], *, lr: float,
                 dp_group: dist.ProcessGroup | None, bucket_bytes: int,
                 expert_dp_group: dist.ProcessGroup | None = None, overlap_grad_reduce: bool = False,
                 overlap_param_gather: bool = False,
                 optimizer: Callable[..., torch.optim.Optimizer] = torch.optim.Adam) -> None:
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
        if lr <= 0:
            raise ValueError(f"lr must be > 0, got {lr}")
        self.models = list(model) if isinstance(model, list | tuple) else [model]
        params = [p for m in self.models for p in m.parameters()]
        self.shards = [self._shard(b) for b in grad_buckets(params, bucket_bytes, dp_group, expert_dp_group)]
        self.optimizer = optimizer([s.main for s in self.shards], lr=lr)
        self.overlap_param_gather = overlap_param_gather
        self.overlap_grad_reduce = overlap_grad_reduce
        """Set to False by a scheduler that launches the reduce-scatters itself (Hermod's grad sync)."""
        self._sync_enabled = True
        self._ready = [0] * len(self.shards)
        self._reducing: dict[int, tuple[Any, torch.Tensor]] = {}
        self.scheduler: ParamGatherScheduler | None = None
        # forward order: buckets by the registration index of their first parameter (the forward runs the model
        # in registration order; buckets are built in reverse, the order backward produces gradients)
        index = {id(p): i for i, p in enumerate(params)}
        self.forward_order = sorted(range(len(self.shards)),
                                    key=lambda b: min(index[id(p)] for p in self.shards[b].bucket.params))
        self._bucket_of = {id(p): b for b, s in enumerate(self.shards) for p in s.bucket.params}
        dense = [b for b in self.forward_order if not self.shards[b].bucket.expert]
        self._next_dense = dict(zip(dense, dense[1:], strict=False))  # the one-ahead chain of overlap_param_gather
        self._pending: dict[int, _InFlight] = {}
        self._stale: set[int] = set()  # buckets whose parameters do not hold the last step's values yet
        self._hooks = [m.register_forward_pre_hook(self._pre_forward) for model_ in self.models
                       for m in model_.modules() if any(True for _ in m.parameters(recurse=False))]
        self._hooks += [p.register_post_accumulate_grad_hook(self._on_grad) for s in self.shards
                        if not s.bucket.expert for p in s.bucket.params]

    @staticmethod
    def _shard(bucket: GradBucket) -> ShardedBucket:
        world = dist.get_world_size(bucket.group)
        rank = dist.get_rank(bucket.group)
        numel = sum(p.numel() for p in bucket.params)
        shard = -(-numel // world)
        flat = torch.zeros(shard * world, dtype=bucket.params[0].dtype, device=bucket.params[0].device)
        flat[:numel] = torch.cat([p.detach().reshape(-1) for p in bucket.params])
        main = torch.nn.Parameter(flat[rank * shard:(rank + 1) * shard].clone())
        return ShardedBucket(bucket, world, rank, numel, shard, main, flat)

    # -- grad sync ----------------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """``config.no_sync_func``: Megatron's schedules run all microbatches but the last inside it."""
        self._sync_enabled = False
        try:
            yield
        finally:
            self._sync_enabled = True

    def _on_grad(self, p: torch.Tensor) -> None:
        if not (self.overlap_grad_reduce and self._sync_enabled):
            return
        b = self._bucket_of[id(p)]
        self._ready[b] += 1
        if self._ready[b] == len(self.shards[b].bucket.params):
            self._launch_reduce_scatter(b)

    def _launch_reduce_scatter(self, b: int) -> None:
        if b in self._reducing:
            return
        s = self.shards[b]
        out = torch.empty(s.shard_numel, dtype=s.main.dtype, device=s.main.device)
        flat = s.flat_grad()
        if s.world == 1:
            out.copy_(flat)
            self._reducing[b] = (None, out)
        else:
            self._reducing[b] = ([fn() for fn in s.reduce_scatter_launches(flat, out, [(0, s.shard_numel)])], out)

    def __call__(self, model: Any = None, *args: Any, **kwargs: Any) -> None:
        """``finalize_model_grads_func``: reduce-scatter every bucket not launched yet, in bucket order, and wait."""
        for b in range(len(self.shards)):
            self._launch_reduce_scatter(b)
            if not self.overlap_grad_reduce:  # Megatron's default: one bucket after the other
                _wait(self._reducing[b][0])
        for b, s in enumerate(self.shards):
            handle, out = self._reducing[b]
            _wait(handle)
            self.set_shard_grad(s, out)
        self._reducing.clear()
        self._ready = [0] * len(self.shards)

    @staticmethod
    def set_shard_grad(s: ShardedBucket, summed: torch.Tensor) -> None:
        """Give the optimizer this rank's shard of the averaged gradient (``summed`` = the SUM over the group)."""
        s.main.grad = summed.div_(s.world) if s.world > 1 else summed

    # -- optimizer ----------------------------------------------------------------------------------------------
    def zero_grad(self, set_to_none: bool = True) -> None:
        for s in self.shards:
            for p in s.bucket.params:
                p.grad = None
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        self.finish_param_gather()
        self.optimizer.step()
        self._start_param_gather()

    # -- param gather -------------------------------------------------------------------------------------------
    def _dispatch(self, b: int) -> None:
        if b in self._pending:
            return
        s = self.shards[b]
        if s.world == 1:  # nothing to gather: the shard is the bucket
            s.gathered[:s.shard_numel].copy_(s.main.detach())
            self._pending[b] = _InFlight(None, s.write_params)
            return
        if self.scheduler is not None:
            launches, complete = s.gather_launches(self.scheduler.chunk_bounds(s.shard_numel, s.main.element_size()))
            self._pending[b] = _InFlight(self.scheduler.launch_gather(b, s, launches), complete)
        else:
            launches, complete = s.gather_launches([(0, s.shard_numel)])
            self._pending[b] = _InFlight([fn() for fn in launches], complete)

    def _finish(self, b: int) -> None:
        if b not in self._stale:
            return
        self._dispatch(b)  # (Megatron: a bucket group not dispatched yet is dispatched by its own wait)
        inflight = self._pending.pop(b)
        _wait(inflight.handle)
        inflight.complete()
        self._stale.discard(b)

    def _start_param_gather(self) -> None:
        self._stale = set(range(len(self.shards)))
        if self.scheduler is not None:
            for b in self.forward_order:
                self._dispatch(b)
            self.scheduler.gathers_dispatched()
        elif not self.overlap_param_gather:
            for b in self.forward_order:
                self._dispatch(b)
            self.finish_param_gather()
        else:  # Megatron's overlap: first dense bucket now, the rest one ahead from the pre-hooks; experts now
            dense = [b for b in self.forward_order if not self.shards[b].bucket.expert]
            for b in dense[:1] + [b for b in self.forward_order if self.shards[b].bucket.expert]:
                self._dispatch(b)

    def _pre_forward(self, module: torch.nn.Module, args: Any) -> None:
        for b in dict.fromkeys(self._bucket_of[id(p)] for p in module.parameters(recurse=False)
                               if id(p) in self._bucket_of):
            if b not in self._stale:
                continue
            if self.scheduler is None and self.overlap_param_gather and b in self._next_dense:
                self._dispatch(self._next_dense[b])
            self._finish(b)

    @property
    def reductions_in_flight(self) -> tuple[int, ...]:
        """Buckets whose reduce-scatter was launched and not yet consumed by ``finalize_model_grads``."""
        return tuple(sorted(self._reducing))

    @property
    def gathers_in_flight(self) -> tuple[int, ...]:
        """Buckets whose gather was dispatched and not yet finished (indices into ``shards``)."""
        return tuple(sorted(self._pending))

    @property
    def stale_buckets(self) -> tuple[int, ...]:
        """Buckets whose parameters do not hold the last step's values yet (their gather is not finished)."""
        return tuple(sorted(self._stale))

    def finish_param_gather(self) -> None:
        """Wait for every gather still in flight, in forward order, and write the parameters."""
        for b in self.forward_order:
            self._finish(b)

    def close(self) -> None:
        """Finish the gathers in flight and remove the hooks: gradient hooks live in autograd, where the cycle
        collector cannot see the cycle they close (optimizer -> model -> parameter -> hook -> optimizer), so
        without this the optimizer, the model and the buckets' process groups would outlive the run."""
        self.finish_param_gather()
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
