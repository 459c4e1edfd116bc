"""Hermod coflow scheduling for Megatron-core / Megatron-LM (seed 000 ch.5).

Launch flag (Megatron-LM ``extra_args_provider``, collected by :mod:`megatron_plugin.args`)::

    --coflow-scheduler {none,hermod}  --hermod-schedule {1f1b,interleaved}  --hermod-dp-mid {last,consumer}
    --hermod-chunk-bytes N  --hermod-max-inflight-chunks N  --hermod-gate-timeout-s S
    --hermod-ep-algorithm {bvn,bvn_bottleneck,alg3,plain,auto}  --hermod-ep-auto-candidates plain,bvn
    --hermod-ep-auto-probe-iterations N  --hermod-ep-quantum N

megatron-core API::

    h = Hermod(HermodConfig(), num_microbatches=M, layers_per_stage=L, stage=pp_rank, dp_group=dp_group)
    h.attach_p2p(p2p_communicator)            # pipeline p2p: critical ops, keys with microbatch ids
    config.finalize_model_grads_func = h.grad_sync(model, bucket_bytes)   # DDP-style bucket sync, deferred
    # or, with the distributed optimizer (ZeRO-1): reduce-scatters + parameter gathers in Hermod order
    opt = DistributedOptimizer(model, lr=lr, dp_group=dp_group, bucket_bytes=bucket_bytes)
    config.finalize_model_grads_func = h.grad_sync(model, bucket_bytes, optimizer=opt)
    h.attach_distributed_optimizer(opt, model)
    h.patch_moe_dispatcher()                  # MoE token-dispatcher all-to-all -> matched all-to-all
    ... train ...
    h.close()

Hooks and what they do:
* **schedules (microbatch ids)**: the 1F1B schedule calls the p2p communicator in microbatch order; Hermod counts
  forward/backward sends and receives per iteration, which gives each PP coflow its MID (no schedule patching).
* **pipeline p2p**: every ``_communicate`` is a *critical* op (launched immediately, gate closed for DP while it
  runs) whose recorded ops carry a :class:`~flowlane.policy.CoflowMeta` key.
* **DDP bucket grad sync**: gradients are bucketed exactly as :class:`megatron_plugin.comm_hooks.DataParallelGradSync`
  (same math: SUM then / dp), but each bucket is launched as soon as its last gradient of the last microbatch is
  accumulated (Megatron's ``overlap_grad_reduce`` semantics), as *deferred* chunks on a cloned DP communicator,
  in Hermod order (MID M-1, CType DP, LID = highest layer in the bucket).
* **param gather** (distributed optimizer, :mod:`megatron_plugin.dist_optimizer`):
  :meth:`Hermod.attach_distributed_optimizer` takes every bucket's all-gather at the end of ``step``, chunked, keyed
  with the consuming iteration, microbatch 0 and the bucket's lowest layer (digest A6.1 #6), so the gathers go out
  lowest layer first while the next forward runs and each module's forward pre-hook waits only for its own bucket
  (Case III); the grad sync then reduce-scatters into the optimizer's shards.
* **MoE token dispatcher**: ``megatron.core.transformer.moe.token_dispatcher.all_to_all`` is replaced by a
  matched (incast-free BvN) all-to-all with the same autograd semantics (one ``all_to_all_single`` in EP groups of
  two, which have no incast: :func:`flowlane.sched.alltoall.needs_matching`; ``ep_algorithm="auto"`` measures
  whether matching pays on this fabric: :class:`flowlane.sched.alltoall.AllToAllRunner`).
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, fields, replace
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.distributed as dist

from flowlane import comm
from flowlane.hermod.keys import HermodKeys
from flowlane.hermod.matching import AUTO_CANDIDATES, RUN_ALGORITHMS, check_candidates
from flowlane.hermod.order import HermodOrder, HermodOrderConfig
from flowlane.hermod.policy import HermodPolicy
from flowlane.policy import CoflowMeta
from flowlane.sched import AllToAllRunner, CommScheduler, SchedulerConfig, build_class_groups

if TYPE_CHECKING:
    from megatron_plugin.ddp_hooks import DDPHooks
    from megatron_plugin.dist_optimizer import DistributedOptimizer

EP_ALGORITHMS = RUN_ALGORITHMS  # HermodConfig.ep_algorithm: a planner of flowlane.sched.alltoall, plain or auto
#: megatron-core versions whose private ``P2PCommunicator._communicate`` and DDP bucket-group methods Hermod wraps
#: ([first, last) by (major, minor)); others are refused at install
MEGATRON_CORE_VERSIONS = ((0, 14), (0, 17))


def check_megatron_core_version(what: str) -> None:
    from importlib.metadata import version

    v = version("megatron-core")
    parts = tuple(int(x) for x in re.findall(r"\d+", v)[:2])
    lo, hi = MEGATRON_CORE_VERSIONS
    if not lo <= parts < hi:
        raise RuntimeError(f"{what}: megatron-core {v} is not supported (it wraps private functions checked on "
                           f"{lo[0]}.{lo[1]} to {hi[0]}.{hi[1] - 1}); pin megatron-core to that range")


@dataclass
class HermodConfig:
    """``scheduler`` config group (recipes/conf/scheduler/{none,hermod}.yaml mirror these fields)."""

    name: Literal["none", "hermod"] = "hermod"
    """``none`` leaves Megatron's default order untouched."""
    schedule: Literal["1f1b", "interleaved"] = "1f1b"
    """CType order: 1f1b = EP & PP > DP; interleaved = EP > PP > DP (seed 000 §5.3.1)."""
    dp_mid: Literal["last", "consumer"] = "last"
    """MID of DP coflows (digest A2.4 / A6.1 #1)."""
    chunk_bytes: int = 256 << 10
    """DP buckets are sent in chunks of this size so PP/EP traffic can pass between them."""
    max_inflight_chunks: int = 2
    """DP chunks in flight at once. Two keep the link busy while the next chunk is launched; with one, each chunk's
    launch gap left the link idle and the dense Megatron GPT was 11-25 % slower at every rate measured
    (results/hermod/real_megatron_defaults.json)."""
    gate_timeout_s: float = 0.05
    """Longest a DP chunk is held back while a PP/EP op is outstanding."""
    ep_algorithm: Literal["bvn", "bvn_bottleneck", "alg3", "plain", "auto"] = "bvn"
    """MoE all-to-all: BvN matching (optimal: flowlane.hermod.matching), ``bvn_bottleneck`` (BvN in fewer, longer
    phases; slower on gloo, see flowlane.hermod.matching), the seed's Algorithm 3, plain all_to_all_single (EP
    groups of two always run plain: no incast to avoid), or ``auto`` (iterations 1-4 alternate plain and BvN, then
    every rank keeps the one whose iterations were faster: flowlane.sched.alltoall.AllToAllRunner). Matching pays
    where the fabric drops under fan-in: on an emulated switch with 64-128 KiB port buffers it sped the all-to-all up
    0.96-1.7x; with deep buffers its phases cost 16-19 % (results/hermod/intra_real*.json), so ``plain`` suits
    deep-buffered or lossless fabrics, and ``auto`` finds out which one it runs on."""
    ep_auto_candidates: tuple[str, ...] = AUTO_CANDIDATES
    """What ``auto`` compares, in probe order (two or more of bvn, bvn_bottleneck, alg3, plain; each costs
    ``ep_auto_probe_iterations`` probe iterations). A list or a comma-separated string is accepted."""
    ep_auto_probe_iterations: int = 2
    """Probe iterations per candidate. Two tell the plain all-to-all from a matching under incast (14-25 % apart on
    the emulated star); neither two nor four told two matchings 1-3 % apart (results/hermod/README.md, "Three
    candidates"). More help where iteration times are noisier than the gap to be found."""
    ep_quantum: int = 1
    """Rows per planning unit for the matched all-to-all (bounds the number of phases)."""
    gloo_class_ifnames: str = ""
    """gloo only: one interface per class ("eth0,eth0,bulk0"), so DP's bulk class leaves from its own address and
    the fabric can queue it behind PP/EP (flowlane.sched.groups); empty = host-side ordering only. NCCL uses
    traffic classes instead."""

    def __post_init__(self) -> None:
        if self.name not in ("none", "hermod"):
            raise ValueError(f"scheduler name {self.name!r} is not one of ['hermod', 'none']")
        if self.ep_algorithm not in EP_ALGORITHMS:
            raise ValueError(f"ep_algorithm {self.ep_algorithm!r} is not one of {list(EP_ALGORITHMS)}")
        self.ep_auto_candidates = check_candidates(self.ep_auto_candidates)
        if not isinstance(self.ep_auto_probe_iterations, int) or self.ep_auto_probe_iterations < 1:
            raise ValueError(f"ep_auto_probe_iterations must be an integer >= 1, got {self.ep_auto_probe_iterations!r}")
        if not isinstance(self.ep_quantum, int) or self.ep_quantum < 1:
            raise ValueError(f"ep_quantum must be an integer >= 1, got {self.ep_quantum!r}")
        HermodOrderConfig(1, self.schedule, self.dp_mid)  # validates schedule / dp_mid
        self.scheduler_config()  # validates chunk / inflight / gate

    def scheduler_config(self) -> SchedulerConfig:
        return SchedulerConfig(mode="hermod", chunk_bytes=self.chunk_bytes,
                               max_inflight_chunks=self.max_inflight_chunks, gate_timeout_s=self.gate_timeout_s)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> HermodConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown scheduler config key(s) {unknown}; known: {sorted(known)}")
        return cls(**d)


# -- launch flags ------------------------------------------------------------------------------------------------------
def add_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    d = HermodConfig()
    g = parser.add_argument_group("flowlane hermod", "Hermod coflow scheduling (seed 000 ch.5)")
    g.add_argument("--coflow-scheduler", choices=["none", "hermod"], default="none",
                   help="cluster-wide coflow priority (MID > CType > LID) + matched all-to-all")
    g.add_argument("--hermod-schedule", choices=["1f1b", "interleaved"], default=d.schedule)
    g.add_argument("--hermod-dp-mid", choices=["last", "consumer"], default=d.dp_mid)
    g.add_argument("--hermod-chunk-bytes", type=int, default=d.chunk_bytes)
    g.add_argument("--hermod-max-inflight-chunks", type=int, default=d.max_inflight_chunks)
    g.add_argument("--hermod-gate-timeout-s", type=float, default=d.gate_timeout_s)
    g.add_argument("--hermod-ep-algorithm", choices=list(EP_ALGORITHMS), default=d.ep_algorithm)
    g.add_argument("--hermod-ep-auto-candidates", default=",".join(d.ep_auto_candidates),
                   help="with --hermod-ep-algorithm auto: comma-separated algorithms it compares, in probe order")
    g.add_argument("--hermod-ep-auto-probe-iterations", type=int, default=d.ep_auto_probe_iterations,
                   help="with --hermod-ep-algorithm auto: iterations each candidate is timed")
    g.add_argument("--hermod-ep-quantum", type=int, default=d.ep_quantum)
    g.add_argument("--hermod-gloo-class-ifnames", default=d.gloo_class_ifnames,
                   help="gloo: comma-separated interface per class (critical,pipeline,bulk) for wire priority")
    return parser


def config_from_args(args: argparse.Namespace) -> HermodConfig:
    return HermodConfig(name=args.coflow_scheduler, schedule=args.hermod_schedule, dp_mid=args.hermod_dp_mid,
                        chunk_bytes=args.hermod_chunk_bytes, max_inflight_chunks=args.hermod_max_inflight_chunks,
                        gate_timeout_s=args.hermod_gate_timeout_s, ep_algorithm=args.hermod_ep_algorithm,
                        ep_auto_candidates=args.hermod_ep_auto_candidates,
                        ep_auto_probe_iterations=args.hermod_ep_auto_probe_iterations,
                        ep_quantum=args.hermod_ep_quantum, gloo_class_ifnames=args.hermod_gloo_class_ifnames)


# -- the runtime object ------------------------------------------------------------------------------------------------
_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")


class Hermod:
    """Per-rank Hermod state for one Megatron model chunk (1F1B, non-interleaved)."""

    def __init__(self, config: HermodConfig, *, num_microbatches: int, layers_per_stage: int, stage: int,
                 dp_group: dist.ProcessGroup | None, num_stages: int = 1,
                 expert_dp_group: dist.ProcessGroup | None = None) -> None:
        if num_microbatches < 1 or layers_per_stage < 1 or stage < 0:
            raise ValueError(f"need num_microbatches >= 1, layers_per_stage >= 1, stage >= 0; got "
                             f"{num_microbatches}, {layers_per_stage}, {stage}")
        self.config, self.M, self.L, self.stage, self.num_stages = (config, num_microbatches, layers_per_stage,
                                                                    stage, num_stages)
        self.policy = HermodPolicy(HermodOrderConfig(num_microbatches, config.schedule, config.dp_mid))
        self.sched = CommScheduler(self.policy, config.scheduler_config())
        self.a2a = AllToAllRunner(config.ep_algorithm, quantum=config.ep_quantum,
                                  probe_iterations=config.ep_auto_probe_iterations,
                                  candidates=config.ep_auto_candidates)
        self.dp_group = dp_group
        self.expert_dp_group = expert_dp_group
        ranks = dist.get_process_group_ranks(dp_group) if dp_group is not None else list(range(dist.get_world_size()))
        mine = [ranks]
        if expert_dp_group is not None and dist.get_world_size(expert_dp_group) > 1:
            mine.append(dist.get_process_group_ranks(expert_dp_group))
        # collective: every rank constructs its Hermod together
        self.classes = build_class_groups(mine, gloo_class_ifnames=config.gloo_class_ifnames or None)
        self.bulk_group = self.classes.get(dp_group, 2)
        self.keys = HermodKeys(num_microbatches=num_microbatches, layers_per_stage=layers_per_stage, stage=stage,
                               next_seq=self.sched.next_seq)
        self._keys: dict[str, CoflowMeta] = {}
        self._fwd_mb = 0
        self._restore: list[Callable[[], None]] = []

    # keys ---------------------------------------------------------------------------------------------------------
    @property
    def iteration(self) -> int:
        return self.keys.iteration

    def key_provider(self, kind: str, info: dict[str, Any]) -> Any:
        """For :mod:`megatron_plugin.comm_hooks`: the key of the op being recorded."""
        if kind == "pp":
            return self._keys.get(info.get("direction", ""))
        return None

    def param_layer(self, name: str) -> int:
        """Global layer id (LID) of a parameter of this stage, from its name (embeddings: the stage's first layer;
        output layer / final norm: its last)."""
        m = _LAYER_RE.search(name)
        if m:
            return self.stage * self.L + int(m.group(1))
        return self.stage * self.L + (self.L - 1 if ("output" in name or "final" in name) else 0)

    def end_iteration(self) -> None:
        """The end of this rank's iteration (the grad sync calls it; without :meth:`grad_sync`, call it yourself
        once per iteration on every rank, or ``ep_algorithm="auto"`` never leaves its warm-up)."""
        if self.a2a.choice is None:  # ep_algorithm=auto: probes whole iterations, then decides on every rank at once
            self.a2a.end_iteration(key=self.keys.ep(self.M - 1, self.keys.first_layer, "auto_decision"))
        else:
            self.a2a.end_iteration()
        self.keys.end_iteration()
        self._fwd_mb = 0

    # hooks --------------------------------------------------------------------------------------------------------
    def attach_p2p(self, p2p: Any) -> Any:
        """Make every pipeline p2p step of one P2PCommunicator (an instance handed to the schedules through
        ``p2p_communicator=``) a critical, keyed op."""
        original = p2p._communicate
        p2p._communicate = self._keyed_communicate(original)
        if hasattr(p2p, "key_provider"):
            p2p.key_provider = self.key_provider
        self._restore.append(lambda: vars(p2p).pop("_communicate", None))
        return p2p

    def attach_pipeline(self) -> None:
        """Make every pipeline p2p step of Megatron-core's own schedules a critical, keyed op. The schedules build
        their own ``P2PCommunicator`` when none is passed (Megatron-LM's ``train_step``), so the class's private
        ``_communicate`` is wrapped: megatron-core versions outside :data:`MEGATRON_CORE_VERSIONS` are refused."""
        from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

        check_megatron_core_version("Hermod.attach_pipeline")
        if "_communicate" in vars(P2PCommunicator) and getattr(P2PCommunicator._communicate, "_flowlane", False):
            raise RuntimeError("Hermod.attach_pipeline: P2PCommunicator is already hooked by another Hermod")
        original = P2PCommunicator._communicate
        wrapped = self._keyed_communicate(original)
        wrapped._flowlane = True  # type: ignore[attr-defined]
        P2PCommunicator._communicate = wrapped
        self._restore.append(lambda: setattr(P2PCommunicator, "_communicate", original))

    def _keyed_communicate(self, original: Callable[..., Any]) -> Callable[..., Any]:
        """``original`` (bound, or the class's function taking the communicator first) with keys and a critical
        section: the gate for DP traffic stays closed while the step's sends and receives run."""

        def communicate(*args: Any, tensor_send_next: Any, tensor_send_prev: Any, recv_prev: bool, recv_next: bool,
                        **kw: Any) -> Any:
            if kw.get("wait_on_reqs", True) is False:
                raise NotImplementedError("Hermod: pipeline p2p with wait_on_reqs=False (the interleaved schedule's "
                                          "overlap_p2p_comm) is not supported yet")
            present = {"send_prev": tensor_send_prev is not None, "recv_prev": bool(recv_prev),
                       "send_next": tensor_send_next is not None, "recv_next": bool(recv_next)}
            self._keys = {d: self.keys.pp(d) for d, on in present.items() if on}
            if self._keys.get("send_next") is not None or self._keys.get("recv_prev") is not None:
                self._fwd_mb = max(self._fwd_mb, min(m.microbatch for d, m in self._keys.items()
                                                     if d in ("send_next", "recv_prev")))
            call = lambda: original(*args, tensor_send_next=tensor_send_next,  # noqa: E731
                                    tensor_send_prev=tensor_send_prev, recv_prev=recv_prev, recv_next=recv_next, **kw)
            if not self._keys:
                return call()
            with self.sched.critical_section(min(self._keys.values(), key=self.policy.order)):
                return call()

        return communicate

    def attach_ddp(self, model_chunks: Sequence[torch.nn.Module]) -> DDPHooks:
        """Schedule the gradient reductions of Megatron-core's own DistributedDataParallel (every bucket group of
        every chunk, dense and expert): :mod:`megatron_plugin.ddp_hooks`. Chunks may be attached one at a time
        (before each one's first backward); pair it with :meth:`attach_finalize`."""
        from megatron_plugin.ddp_hooks import DDPHooks

        check_megatron_core_version("Hermod.attach_ddp")
        hooks = DDPHooks(self, model_chunks)
        self._restore.append(hooks.remove)
        return hooks

    def attach_finalize(self, config: Any, num_microbatches: Callable[[], int] | None = None) -> None:
        """End Hermod's iteration after Megatron's own ``config.finalize_model_grads_func`` (kept whole), the same
        program point on every rank. ``num_microbatches`` (e.g. megatron.core.num_microbatches_calculator's
        ``get_num_microbatches``) is read there, so keys follow a batch-size ramp-up."""
        finalize = getattr(config, "finalize_model_grads_func", None)
        if finalize is None:
            raise ValueError("Hermod.attach_finalize: config.finalize_model_grads_func is not set; set it to "
                             "megatron.core.distributed.finalize_model_grads (Megatron-LM's train() does) first")

        def finalize_then_end_iteration(*args: Any, **kwargs: Any) -> Any:
            out = finalize(*args, **kwargs)
            self.end_iteration()
            if num_microbatches is not None:
                self.set_num_microbatches(int(num_microbatches()))
            return out

        config.finalize_model_grads_func = finalize_then_end_iteration
        self._restore.append(lambda: setattr(config, "finalize_model_grads_func", finalize))

    def set_num_microbatches(self, num_microbatches: int) -> None:
        """A new microbatch count M from the next iteration on (DP coflows carry MID M-1)."""
        if not isinstance(num_microbatches, int) or num_microbatches < 1:
            raise ValueError(f"num_microbatches must be an integer >= 1, got {num_microbatches!r}")
        if num_microbatches == self.M:
            return
        self.M = self.keys.num_microbatches = num_microbatches
        self.policy.hermod_order = HermodOrder(replace(self.policy.hermod_order.config,
                                                       num_microbatches=num_microbatches))

    def grad_sync(self, model: torch.nn.Module | Sequence[torch.nn.Module], bucket_bytes: int,
                  expert_dp_group: dist.ProcessGroup | None = None,
                  optimizer: DistributedOptimizer | None = None) -> HermodGradSync:
        """Bucketed DP grad sync (expert parameters over ``expert_dp_group``, default: the Hermod's). With a
        :class:`~megatron_plugin.dist_optimizer.DistributedOptimizer` the buckets are its buckets and each one is
        reduce-scattered into the optimizer's shard instead of all-reduced."""
        sync = HermodGradSync(self, model, bucket_bytes, expert_dp_group, optimizer)
        self._restore.append(sync.remove)  # its gradient hooks hold it (and the model) in a cycle through autograd
        return sync

    def attach_distributed_optimizer(self, optimizer: DistributedOptimizer,
                                     model: torch.nn.Module | Sequence[torch.nn.Module]) -> DistributedOptimizer:
        """Let Hermod launch the distributed optimizer's parameter gathers: all of them are handed over at the end
        of ``step`` (after the grad sync, which ends the iteration), chunked, each keyed with the iteration that
        consumes it, microbatch 0 and its bucket's lowest layer (digest A6.1 #6), and go out in key order (lowest
        layer first) while the next forward runs; each module's forward pre-hook waits only for its own bucket."""
        optimizer.scheduler = _HermodParamGathers(self, optimizer, model)
        overlap = optimizer.overlap_grad_reduce
        optimizer.overlap_grad_reduce = False  # Hermod's grad sync launches the reduce-scatters (from its own hooks)

        def undo() -> None:
            optimizer.scheduler, optimizer.overlap_grad_reduce = None, overlap

        self._restore.append(undo)
        return optimizer

    def all_to_all(self, group: dist.ProcessGroup, input_: torch.Tensor, output_split_sizes: Any = None,
                   input_split_sizes: Any = None) -> torch.Tensor:
        """Drop-in for ``megatron.core.tensor_parallel.all_to_all`` (autograd-aware, matched phases)."""
        return _MatchedAllToAll.apply(self, group, input_, output_split_sizes, input_split_sizes)

    def patch_moe_dispatcher(self) -> None:
        import megatron.core.transformer.moe.token_dispatcher as td

        original = td.all_to_all
        td.all_to_all = self.all_to_all
        self._restore.append(lambda: setattr(td, "all_to_all", original))

    def close(self) -> None:
        self.sched.close()
        for undo in reversed(self._restore):
            undo()
        self._restore.clear()


class _HermodParamGathers:
    """:class:`~megatron_plugin.dist_optimizer.ParamGatherScheduler` for Hermod (see
    :meth:`Hermod.attach_distributed_optimizer`)."""

    def __init__(self, h: Hermod, optimizer: DistributedOptimizer,
                 model: torch.nn.Module | Sequence[torch.nn.Module]) -> None:
        self.h = h
        models = list(model) if isinstance(model, list | tuple) else [model]
        layer_of = {id(p): h.param_layer(n) for m in models for n, p in m.named_parameters()}
        self.layer_lo = [min(layer_of[id(p)] for p in s.bucket.params) for s in optimizer.shards]

    def chunk_bounds(self, numel: int, element_size: int) -> list[tuple[int, int]]:
        return self.h.sched.chunk_bounds(numel, element_size)

    def launch_gather(self, index: int, bucket: Any, launches: Sequence[Callable[[], Any]]) -> Any:
        meta = self.h.keys.dp_gather(self.layer_lo[index])  # after end_iteration: keyed for the next forward
        grp = self.h.classes.get(bucket.group, 2)
        # the optimizer's launches are bound to the bucket's group; Hermod's gathers go on its bulk-class clone
        return self.h.sched.defer(meta, [lambda fn=fn: fn(group=grp, key=meta) for fn in launches])

    def gathers_dispatched(self) -> None:
        self.h.sched.seal()  # the end of step: the same program point on every rank


class _MatchedAllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, h: Hermod, group: Any, input_: torch.Tensor, out_splits: Any, in_splits: Any) -> Any:
        ctx.h, ctx.group, ctx.splits = h, group, (out_splits, in_splits)
        return _run_a2a(h, group, input_, out_splits, in_splits, "dispatch")

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        out_splits, in_splits = ctx.splits
        return None, None, _run_a2a(ctx.h, ctx.group, grad.contiguous(), in_splits, out_splits, "combine"), None, None


def _run_a2a(h: Hermod, group: Any, x: torch.Tensor, out_splits: Any, in_splits: Any, op: str) -> torch.Tensor:
    n = dist.get_world_size(group)
    x = x.contiguous()
    if in_splits is None:
        in_splits = [x.shape[0] // n] * n
    if out_splits is None:
        out_splits = [x.shape[0] // n] * n
    in_splits, out_splits = [int(v) for v in in_splits], [int(v) for v in out_splits]
    out = torch.empty((sum(out_splits), *x.shape[1:]), dtype=x.dtype, device=x.device)
    meta = h.keys.ep(h._fwd_mb, h.keys.first_layer, op)
    with h.sched.critical_section(meta):
        h.a2a(out, x, out_splits, in_splits, group=group, kind="ep", key=meta)
    return out


class HermodGradSync:
    """``finalize_model_grads_func`` with per-bucket deferred all-reduce started during the last backward.

    Buckets and groups are those of :class:`megatron_plugin.comm_hooks.DataParallelGradSync` (dense parameters over
    the DP group, expert parameters over the expert-DP group; SUM then / group size; ``None`` gradients count as
    zeros and every parameter gets a gradient back), so the math is identical; only *when* and in what order the
    buckets go out differs.

    Determinism (every rank of a group must issue the same deferred ops in the same program order):
    * a **dense** bucket is launched from the post-accumulate-grad hook of its last parameter in the last
      microbatch (``overlap_grad_reduce``). Dense parameters are in every rank's graph alike (SPMD), so the hook
      fires at the same program point on every rank of the DP group.
    * an **expert** bucket is launched only in ``__call__``: whether an expert gets tokens (and so a gradient and a
      hook) in a microbatch depends on the rank's data, so a hook-driven launch could differ between ranks.
    * ``__call__`` then launches every bucket not launched yet, in bucket order, on every rank (dense buckets whose
      parameters got no gradient in some microbatch included), seals, and waits for all of them in bucket order.
    """

    def __init__(self, h: Hermod, model: torch.nn.Module | Sequence[torch.nn.Module], bucket_bytes: int,
                 expert_dp_group: dist.ProcessGroup | None = None,
                 optimizer: DistributedOptimizer | None = None) -> None:
        self.h = h
        models = list(model) if isinstance(model, list | tuple) else [model]
        named = [(n, p) for m in models for n, p in m.named_parameters()]
        from megatron_plugin.comm_hooks import grad_buckets

        egroup = expert_dp_group if expert_dp_group is not None else h.expert_dp_group
        self.optimizer = optimizer
        self.buckets = ([s.bucket for s in optimizer.shards] if optimizer is not None
                        else grad_buckets([p for _, p in named], bucket_bytes, h.dp_group, egroup))
        self.worlds = [dist.get_world_size(b.group) for b in self.buckets]
        self.groups = [h.classes.get(b.group, 2) for b in self.buckets]  # deferred traffic on cloned groups
        layer_of = {id(p): h.param_layer(n) for n, p in named}
        self.bucket_layer = [max(layer_of[id(p)] for p in b.params) for b in self.buckets]
        self.bucket_of = {id(p): i for i, b in enumerate(self.buckets) for p in b.params}
        self._counts: dict[int, int] = {}
        self._ready: list[int] = [0] * len(self.buckets)
        self._handles: dict[int, tuple[Any, torch.Tensor]] = {}
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad)
                       for b in self.buckets if not b.expert for p in b.params]

    def _on_grad(self, p: torch.Tensor) -> None:
        n = self._counts.get(id(p), 0) + 1
        self._counts[id(p)] = n
        if n == self.h.M:  # this parameter's gradient is final (last microbatch)
            b = self.bucket_of[id(p)]
            self._ready[b] += 1
            if self._ready[b] == len(self.buckets[b].params):
                self._launch(b)
                # seal at this program point (the same on every DP rank): an open window would keep the ready
                # bucket off the link through the following compute, until the next critical op
                self.h.sched.seal()

    def _launch(self, b: int) -> None:
        if b in self._handles:
            return
        if self.optimizer is not None:
            self._launch_reduce_scatter(b)
            return
        bucket = self.buckets[b]
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in bucket.params])
        if self.worlds[b] == 1:  # nothing to reduce; the gradient is written back as DataParallelGradSync does
            self._handles[b] = (None, flat)
            return
        meta = self.h.keys.dp_reduce(self.bucket_layer[b], "all_reduce")
        grp = self.groups[b]
        launches = []
        for a, e in self.h.sched.chunk_bounds(flat.numel(), flat.element_size()):
            launches.append(lambda a=a, e=e: comm.all_reduce(flat[a:e], group=grp, kind="dp", key=meta,
                                                             async_op=True))
        self._handles[b] = (self.h.sched.defer(meta, launches), flat)

    def _launch_reduce_scatter(self, b: int) -> None:
        """Distributed optimizer: the bucket is reduce-scattered into this rank's shard, chunk by chunk."""
        s = self.optimizer.shards[b]
        flat = s.flat_grad()
        out = torch.empty(s.shard_numel, dtype=flat.dtype, device=flat.device)
        if s.world == 1:
            out.copy_(flat)
            self._handles[b] = (None, out)
            return
        meta = self.h.keys.dp_reduce(self.bucket_layer[b], "reduce_scatter")
        bounds = self.h.sched.chunk_bounds(s.shard_numel, flat.element_size())
        self._handles[b] = (self.h.sched.defer(meta, s.reduce_scatter_launches(flat, out, bounds, meta,
                                                                               self.groups[b])), out)

    def __call__(self, model: Any, *args: Any, **kwargs: Any) -> None:
        for b in range(len(self.buckets)):  # expert buckets; buckets whose params got no gradient in a microbatch
            self._launch(b)
        self.h.sched.seal()
        for b, bucket in enumerate(self.buckets):
            handle, flat = self._handles[b]
            if handle is not None:
                handle.wait()
            if self.optimizer is not None:
                self.optimizer.set_shard_grad(self.optimizer.shards[b], flat)
                continue
            if handle is not None:
                flat.div_(self.worlds[b])
            offset = 0
            for p in bucket.params:
                k = p.numel()
                p.grad = flat[offset:offset + k].view_as(p).clone()
                offset += k
        self._counts.clear()
        self._ready = [0] * len(self.buckets)
        self._handles.clear()
        self.h.end_iteration()

    def remove(self) -> None:
        for hk in self._hooks:
            hk.remove()
        self._hooks.clear()


# -- recipe entry point ------------------------------------------------------------------------------------------------
def install_from_config(cfg: dict[str, Any], ctx: Any) -> Hermod | None:
    """Called by the train loop on every rank, after the model, p2p communicator and grad sync are built and
    before the first iteration. ``ctx`` needs: ``recipe`` (num_microbatches, num_layers, pipeline_parallel,
    dp_bucket_bytes), ``model``, ``config`` (Megatron TransformerConfig), ``p2p_communicator``, optionally
    ``optimizer`` (a :class:`~megatron_plugin.dist_optimizer.DistributedOptimizer` gets Hermod's reduce-scatters and
    parameter gathers). Replaces ``ctx.config.finalize_model_grads_func`` and ``ctx.grad_sync``; returns the
    :class:`Hermod` (call ``close()`` at the end) or None for ``name: none``. Collective: every rank must call it (it creates communicators)."""
    hc = HermodConfig.from_dict(dict(cfg))
    if hc.name == "none":
        return None
    from megatron.core import parallel_state as ps

    r = ctx.recipe
    megatron_ddp = bool(getattr(r, "megatron_ddp", False))
    h = Hermod(hc, num_microbatches=r.num_microbatches, layers_per_stage=r.num_layers // r.pipeline_parallel,
               stage=ps.get_pipeline_model_parallel_rank(), num_stages=r.pipeline_parallel,
               dp_group=ps.get_data_parallel_group(with_context_parallel=True) if megatron_ddp
               else ps.get_data_parallel_group(),
               expert_dp_group=ps.get_expert_data_parallel_group() if getattr(r, "num_moe_experts", None) else None)
    h.attach_p2p(ctx.p2p_communicator)
    if megatron_ddp:  # Megatron-core's own DDP: hook its bucket groups and its finalize_model_grads
        h.attach_ddp([ctx.model])
        h.attach_finalize(ctx.config)
        if getattr(r, "num_moe_experts", None):
            h.patch_moe_dispatcher()
        return h
    from megatron_plugin.dist_optimizer import DistributedOptimizer

    opt = getattr(ctx, "optimizer", None)
    opt = opt if isinstance(opt, DistributedOptimizer) else None
    sync = h.grad_sync(ctx.model, r.dp_bucket_bytes, optimizer=opt)
    if opt is not None:  # --use-distributed-optimizer: Hermod also launches the parameter gathers
        h.attach_distributed_optimizer(opt, ctx.model)
    ctx.config.finalize_model_grads_func = sync
    ctx.grad_sync = sync
    if getattr(r, "num_moe_experts", None):
        h.patch_moe_dispatcher()
    return h


def describe(cfg: HermodConfig) -> dict[str, Any]:
    return asdict(cfg)
