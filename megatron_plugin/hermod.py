"""Hermod coflow scheduling for Megatron-core / Megatron-LM (seed 000 ch.5).

Launch flag (Megatron-LM ``extra_args_provider``, collected by :mod:`megatron_plugin.args`)::

    --coflow-scheduler {none,hermod}  --hermod-schedule {1f1b,interleaved}  --hermod-dp-mid {last,consumer}
    --hermod-launch {auto,pacer,program_order}  --hermod-max-inflight-buckets N  --hermod-gate-timeout-s S
    --hermod-ep-algorithm {bvn,bvn_bottleneck,alg3,plain,auto}  --hermod-ep-auto-candidates plain,bvn
    --hermod-ep-auto-probe-iterations N  --hermod-ep-quantum N

megatron-core API (Megatron-core's own DistributedDataParallel, optimizer, finalize_model_grads and schedules)::

    h = Hermod(HermodConfig(), num_microbatches=M, layers_per_stage=L, stage=pp_rank, num_stages=PP,
               dp_group=parallel_state.get_data_parallel_group(with_context_parallel=True))
    h.attach_pipeline()                       # the schedules' own P2PCommunicator (or h.attach_p2p(p2p))
    h.attach_ddp(model_chunks)                # Megatron DDP bucket groups: grad reductions and param gathers
    h.attach_finalize(config, get_num_microbatches)   # after config.finalize_model_grads_func (kept whole)
    h.patch_moe_dispatcher(config)            # MoE alltoall dispatcher -> matched all-to-all
    ... train ...
    h.close()

Megatron-LM users get the same from the launch flag: :mod:`megatron_plugin.megatron_lm`.

Hooks and what they do:
* **schedules (microbatch ids)**: the 1F1B schedule calls the p2p communicator in microbatch order; Hermod counts
  forward/backward sends and receives per iteration, which gives each PP coflow its MID (no schedule patching).
* **pipeline p2p**: every ``_communicate`` is a *critical* op (launched immediately, gate closed for DP while it
  runs) whose recorded ops carry a :class:`~flowlane.policy.CoflowMeta` key.
* **DDP bucket groups** (:mod:`megatron_plugin.ddp_hooks`): each bucket group's reduction (all-reduce, or
  reduce-scatter with the distributed optimizer) and, with ``overlap_param_gather``, its parameter all-gather is a
  deferred coflow on the bulk-class clone of its group, keyed MID M-1, CType DP, LID = the group's highest layer
  (gathers: the consuming iteration, MID 0, lowest layer) and run by Megatron's own code. Each is sealed as a window
  of its own the moment Megatron starts it, so DP leaves in Megatron's order (backward: highest layer first) and
  keeps its overlap with the rest of backward; what Hermod changes is *when* (held behind PP/EP ops, pacer) and on
  which class. Hence ``dp_mid`` is refused at any value but ``last`` (:data:`NO_EFFECT`), and ``schedule`` only
  has to name the pipeline schedule that runs.
* **MoE token dispatcher**: ``megatron.core.transformer.moe.token_dispatcher.all_to_all`` is replaced by a
  matched (incast-free BvN) all-to-all with the same autograd semantics (one ``all_to_all_single`` in EP groups of
  two, which have no incast: :func:`flowlane.sched.alltoall.needs_matching`; ``ep_algorithm="auto"`` measures
  whether matching pays on this fabric: :class:`flowlane.sched.alltoall.AllToAllRunner`). Its key simplifies
  :mod:`flowlane.hermod.keys`' rule (the issuing MoE layer's microbatch and layer): the dispatcher does not know its
  layer, so every EP all-to-all is keyed with the highest forward microbatch the pipeline p2p has reached and the
  stage's first layer. EP all-to-alls are critical ops the training thread launches at once, so the key labels them
  (trace, scheduler log) and its type (EP) closes the DP gate; no launch order depends on its microbatch or layer.
"""

from __future__ import annotations

import argparse
import logging
import re
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, fields, replace
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.distributed as dist

from flowlane.configs import add_dataclass_args, config_from_namespace
from flowlane.hermod.keys import HermodKeys
from flowlane.hermod.matching import AUTO_CANDIDATES, RUN_ALGORITHMS, check_candidates
from flowlane.hermod.order import HermodOrder, HermodOrderConfig
from flowlane.hermod.policy import HermodPolicy
from flowlane.policy import CoflowMeta
from flowlane.sched import AllToAllRunner, CommScheduler, SchedulerConfig, build_class_groups
from flowlane.sched.alltoall import check_max_phases
from flowlane.versions import check_version_range
from megatron_plugin.undo import Patch, check_all, undo_all

if TYPE_CHECKING:
    from megatron_plugin.ddp_hooks import DDPHooks

log = logging.getLogger("flowlane.hermod")

#: Hermod's critical class: every pipeline p2p and MoE all-to-all of every microbatch goes out on it, so on the wire
#: the adapter carries the CType alone (critical vs bulk); flowlane.hermod.wire's MID split into classes 0 / 1 is the
#: simulator's and the synthetic workload's (flowlane.testing.workload), not this adapter's
CRITICAL_CLASS = 0
# HermodConfig.ep_algorithm: a planner of flowlane.sched.alltoall, plain or auto
EP_ALGORITHMS = RUN_ALGORITHMS
#: megatron-core versions whose private ``P2PCommunicator._communicate`` and DDP bucket-group methods Hermod wraps
#: ([first, last) by (major, minor)); others are refused at install
MEGATRON_CORE_VERSIONS = ((0, 14), (0, 17))
FEATURE = "flowlane.hermod"
"""How Hermod's errors name it."""


def check_megatron_core_version(what: str) -> None:
    check_version_range("megatron-core", MEGATRON_CORE_VERSIONS, what)


@dataclass
class HermodConfig:
    """``scheduler`` config group (recipes/conf/scheduler/{none,hermod}.yaml mirror these fields)."""

    name: Literal["none", "hermod"] = "hermod"
    """``none`` leaves Megatron's default order untouched."""
    schedule: Literal["1f1b", "interleaved"] = "1f1b"
    """The pipeline schedule that runs: ``interleaved`` with virtual pipeline chunks, else ``1f1b`` (checked
    against them; the launch flag follows ``--num-layers-per-virtual-pipeline-stage``). It sets the CType ranks
    (1f1b: EP & PP > DP; interleaved: EP > PP > DP, seed 000 §5.3.1) of the keys in the scheduler's log; no launch
    order depends on it here, since PP and EP ops are launched at once and every deferred op is DP."""
    dp_mid: Literal["last", "consumer"] = "last"
    """MID of DP coflows (docs/decisions.md A2.4, A6.1 #1). Only ``last``: see :data:`NO_EFFECT`."""
    max_inflight_buckets: int = 2
    """``launch=pacer`` only: DP bucket groups (reduce-scatters / all-reduces, parameter gathers) on the wire at
    once. Two keep the link busy while the next one is launched. On Megatron-core's DDP (dense GPT, 4 CPU ranks, 4
    rounds) one and two were within run-to-run noise: 2.02 / 2.10 s at 100 Mbit/s, 0.91 / 0.93 s at 400
    (results/hermod/real/real_megatron_core_inflight.json); the 11-25 % gain of two measured before was on the
    plugin's former DP path, which sent 256 KiB chunks. There is no chunk size: Megatron-core's DDP sends a bucket group as one coflow, so its ``bucket_size``
    (``--ddp-bucket-size``) sets how long PP/EP traffic can wait behind DP."""
    gate_timeout_s: float = 0.05
    """``launch=pacer`` only: longest a DP bucket group is held back while a PP/EP op is outstanding."""
    ep_algorithm: Literal["bvn", "bvn_bottleneck", "alg3", "plain", "auto"] = "bvn"
    """MoE all-to-all: BvN matching (optimal: flowlane.hermod.matching), ``bvn_bottleneck`` (BvN in fewer, longer
    phases; slower on gloo, see flowlane.hermod.matching), the seed's Algorithm 3 (the digest's matched-min
    reading of its weight rule, A2.6), plain all_to_all_single (EP
    groups of two always run plain: no incast to avoid), or ``auto`` (iterations 1-4 alternate plain and BvN, then
    every rank keeps the one whose iterations were faster: flowlane.sched.alltoall.AllToAllRunner). Matching pays
    where the fabric drops under fan-in: on an emulated switch with 64-128 KiB port buffers it sped the all-to-all up
    0.96-1.7x; with deep buffers its phases cost 16-19 % (results/hermod/intra_real/intra_real*.json), so ``plain`` suits
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
    ep_max_phases: int = 0
    """Cap on the matched all-to-all's phases (0: none). Past it, one last phase sends what is left at once (it may
    incast): bounds planning time (~5 us a phase at EP 32) and the per-phase launch costs. BvN plans only
    (``bvn``, ``bvn_bottleneck``, or ``auto`` with one of them); refused with ``alg3`` or ``plain``."""
    launch: Literal["auto", "pacer", "program_order"] = "auto"
    """Who launches the deferred DP coflows (flowlane.sched.scheduler): ``pacer`` (a thread, host-side gate: the
    measured gloo path), ``program_order`` (the training thread at the seal point, whole windows in key order; PP/EP
    precedence from stream priorities and traffic classes: no cross-rank timing dependence, no host synchronisation
    on NCCL), ``auto`` (program_order on NCCL, pacer otherwise)."""
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
            raise ValueError(
                f"ep_auto_probe_iterations must be an integer >= 1, got {self.ep_auto_probe_iterations!r}"
            )
        check_max_phases(self.ep_algorithm, self.ep_auto_candidates, self.ep_max_phases, "ep_max_phases")
        if not isinstance(self.ep_quantum, int) or self.ep_quantum < 1:
            raise ValueError(f"ep_quantum must be an integer >= 1, got {self.ep_quantum!r}")
        HermodOrderConfig(1, self.schedule, self.dp_mid)  # validates schedule / dp_mid
        for name, (default, why) in NO_EFFECT.items():
            if getattr(self, name) != default:
                raise ValueError(
                    f"scheduler {name}={getattr(self, name)!r} has no effect on Megatron-core: {why}; leave it "
                    f"out (or {default!r})"
                )
        if self.launch not in ("auto", "pacer", "program_order"):
            raise ValueError(f"launch {self.launch!r} is not one of ['auto', 'pacer', 'program_order']")
        if (
            isinstance(self.max_inflight_buckets, bool)
            or not isinstance(self.max_inflight_buckets, int)
            or (self.max_inflight_buckets < 1)
        ):
            raise ValueError(
                f"max_inflight_buckets must be an integer >= 1, got {self.max_inflight_buckets!r}"
            )
        self.scheduler_config()  # validates gate_timeout_s

    def scheduler_config(self, backend: str = "gloo") -> SchedulerConfig:
        """The runtime scheduler's knobs on a process-group ``backend`` (which resolves ``launch="auto"``). Pacer
        knobs set away from their defaults under ``program_order`` are refused: they would have no effect there."""
        launch = self.launch if self.launch != "auto" else ("program_order" if backend == "nccl" else "pacer")
        if launch == "program_order":
            ignored = [
                f"{name}={getattr(self, name)!r}"
                for name in PACER_ONLY
                if getattr(self, name) != getattr(HermodConfig, name)
            ]
            if ignored:
                raise ValueError(
                    f"scheduler {', '.join(ignored)}: these pace the pacer thread and have no effect "
                    f"under launch=program_order (resolved from launch={self.launch!r} on {backend}); "
                    "leave them at their defaults or set launch=pacer"
                )
        # chunk_bytes: never split a bucket group (Megatron's bucket_size is the granularity)
        return SchedulerConfig(
            mode="hermod",
            chunk_bytes=1 << 62,
            launch=launch,
            max_inflight_chunks=self.max_inflight_buckets,
            gate_timeout_s=self.gate_timeout_s,
        )

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> HermodConfig:
        known = {f.name for f in fields(cls)}
        if "chunk_bytes" in d:
            raise ValueError(
                f"scheduler.chunk_bytes={d['chunk_bytes']!r}: Hermod sends each Megatron-core DDP "
                "bucket group as one coflow, never split; set the granularity with Megatron's "
                "bucket_size (--ddp-bucket-size) instead"
            )
        if "max_inflight_chunks" in d:
            raise ValueError(
                "scheduler.max_inflight_chunks is now max_inflight_buckets (bucket groups, not chunks)"
            )
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown scheduler config key(s) {unknown}; known: {sorted(known)}")
        return cls(**d)


PACER_ONLY = ("max_inflight_buckets", "gate_timeout_s")
"""HermodConfig fields that only the pacer thread reads (launch=pacer)."""

#: HermodConfig fields that nothing on Megatron-core reads at another value: (the only value accepted, why); the
#: DeepSpeed adapter refuses the same (deepspeed_plugin.hermod.NO_EFFECT)
NO_EFFECT: dict[str, tuple[Any, str]] = {
    "dp_mid": (
        "last",
        "it ranks parameter gathers against reductions and PP/EP traffic inside a launch window, and here every "
        "window holds one DP op: Hermod seals each bucket group's reduction or gather where Megatron's DDP starts "
        "it, so that it overlaps the rest of backward (or forward), and DP leaves in Megatron's order",
    ),
}


# -- launch flags ------------------------------------------------------------------------------------------------------
def add_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``--coflow-scheduler {none,hermod}`` and one ``--hermod-<field>`` flag per :class:`HermodConfig` field
    (generated: :func:`flowlane.configs.add_dataclass_args`)."""
    g = parser.add_argument_group("flowlane hermod", "Hermod coflow scheduling (seed 000 ch.5)")
    g.add_argument(
        "--coflow-scheduler",
        choices=["none", "hermod"],
        default="none",
        help="cluster-wide coflow priority (MID > CType > LID) + matched all-to-all",
    )
    add_dataclass_args(
        g,
        HermodConfig,
        "hermod-",
        skip=("name",),
        overrides={
            "schedule": {
                "default": None,
                "help": "CType order (default: interleaved with --num-layers-per-virtual-pipeline-stage, "
                "else 1f1b)",
            }
        },
    )
    return parser


def config_from_args(args: argparse.Namespace) -> HermodConfig:
    schedule = args.hermod_schedule or (
        "interleaved" if getattr(args, "virtual_pipeline_model_parallel_size", None) else "1f1b"
    )
    cfg: HermodConfig = config_from_namespace(
        HermodConfig, args, "hermod_", name=args.coflow_scheduler, schedule=schedule
    )
    return cfg


# -- the runtime object ------------------------------------------------------------------------------------------------
_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def _classed_groups(
    dp_group: dist.ProcessGroup | None, expert_dp_group: dist.ProcessGroup | None, num_stages: int
) -> list[list[int]]:
    """The ranks of every group whose traffic gets a clone per traffic class: DP (and expert DP), the pipeline's p2p
    (to the critical class's clone: on NCCL its traffic class and a high-priority stream) and the MoE all-to-alls."""
    from megatron.core import parallel_state as ps

    dp = (
        dist.get_process_group_ranks(dp_group) if dp_group is not None else list(range(dist.get_world_size()))
    )
    groups = [dp]
    if expert_dp_group is not None and dist.get_world_size(expert_dp_group) > 1:
        groups.append(dist.get_process_group_ranks(expert_dp_group))
    if num_stages > 1:
        groups.append(dist.get_process_group_ranks(ps.get_pipeline_model_parallel_group()))
    if expert_dp_group is not None and ps.get_expert_model_parallel_world_size() > 1:
        groups.append(dist.get_process_group_ranks(ps.get_expert_model_parallel_group()))
    return groups


class Hermod:
    """Per-rank Hermod state for one Megatron model chunk (1F1B, non-interleaved)."""

    def __init__(
        self,
        config: HermodConfig,
        *,
        num_microbatches: int,
        layers_per_stage: int,
        stage: int,
        dp_group: dist.ProcessGroup | None,
        num_stages: int = 1,
        expert_dp_group: dist.ProcessGroup | None = None,
        virtual_chunks: int = 1,
        microbatch_group: int | None = None,
    ) -> None:
        """``layers_per_stage``: all layers this stage holds (every model chunk's); ``virtual_chunks`` and
        ``microbatch_group``: Megatron's virtual pipeline size and ``microbatch_group_size_per_vp_stage`` for the
        interleaved schedule (which needs ``HermodConfig(schedule="interleaved")``)."""
        if num_microbatches < 1 or layers_per_stage < 1 or stage < 0:
            raise ValueError(
                f"need num_microbatches >= 1, layers_per_stage >= 1, stage >= 0; got "
                f"{num_microbatches}, {layers_per_stage}, {stage}"
            )
        if (virtual_chunks > 1) != (config.schedule == "interleaved"):
            raise ValueError(
                f"Hermod: virtual_chunks={virtual_chunks} with schedule={config.schedule!r}: the "
                "interleaved pipeline schedule (virtual_chunks > 1) takes schedule='interleaved' "
                "(--hermod-schedule interleaved; CType order EP > PP > DP, seed 000 §5.3.1), and "
                "'interleaved' needs virtual_chunks > 1"
            )
        self.config = config
        self.M, self.L = num_microbatches, layers_per_stage
        self.stage, self.num_stages = stage, num_stages
        self.policy = HermodPolicy(HermodOrderConfig(num_microbatches, config.schedule, config.dp_mid))
        self.sched = CommScheduler(self.policy, config.scheduler_config(dist.get_backend(dp_group)))
        self.a2a = AllToAllRunner(
            config.ep_algorithm,
            quantum=config.ep_quantum,
            max_phases=config.ep_max_phases,
            probe_iterations=config.ep_auto_probe_iterations,
            candidates=config.ep_auto_candidates,
        )
        self.dp_group = dp_group
        self.expert_dp_group = expert_dp_group
        # collective: every rank constructs its Hermod together
        self.classes = build_class_groups(
            _classed_groups(dp_group, expert_dp_group, num_stages),
            gloo_class_ifnames=config.gloo_class_ifnames or None,
        )
        self.bulk_group = self.classes.get(dp_group, 2)
        # one clone per class (NCCL, or gloo with an interface per class): the all-to-alls take the critical one.
        # With a single gloo clone it would be the DP traffic's too, which a pacer thread launches: they stay put.
        self._ep_on_class = self.classes.backend == "nccl" or bool(config.gloo_class_ifnames)
        self.keys = HermodKeys(
            num_microbatches=num_microbatches,
            layers_per_stage=layers_per_stage,
            stage=stage,
            next_seq=self.sched.next_seq,
            num_stages=num_stages,
            virtual_chunks=virtual_chunks,
            microbatch_group=microbatch_group,
        )
        self._held: list[_HeldRequests] = []  # overlapped p2p (wait_on_reqs=False) still holding the gate
        # MoE: the dispatcher's gathered token counts and the direction of the all-to-all now running
        self._capturing: Any = None
        self._ep_counts: tuple[Any, torch.Tensor] | None = None
        self._a2a_direction: str | None = None
        self._keys: dict[str, CoflowMeta] = {}
        self._fwd_mb = 0
        self._restore: list[Patch] = []  # every attribute Hermod set, undone last first by close()

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
        """The end of this rank's iteration (:meth:`attach_finalize` calls it; without it, call it yourself
        once per iteration on every rank, or ``ep_algorithm="auto"`` never leaves its warm-up)."""
        # ep_algorithm=auto: probes whole iterations, then decides on every rank at once
        if self.a2a.choice is None:
            self.a2a.end_iteration(key=self.keys.ep(self.M - 1, self.keys.first_layer, "auto_decision"))
        else:
            self.a2a.end_iteration()
        self.keys.end_iteration()
        self._fwd_mb = 0
        for held in self._held:  # the schedule has waited for every p2p of the step by now
            held.release()
        self._held.clear()

    # hooks --------------------------------------------------------------------------------------------------------
    def attach_p2p(self, p2p: Any) -> Any:
        """Make every pipeline p2p step of one P2PCommunicator (an instance handed to the schedules through
        ``p2p_communicator=``) a critical, keyed op."""
        communicate = self._keyed_communicate(p2p._communicate, p2p)
        self._restore.append(Patch(p2p, "_communicate", communicate, FEATURE))
        if hasattr(p2p, "key_provider"):
            self._restore.append(Patch(p2p, "key_provider", self.key_provider, FEATURE))
        return p2p

    def attach_pipeline(self) -> None:
        """Make every pipeline p2p step of Megatron-core's own schedules a critical, keyed op. The schedules build
        their own ``P2PCommunicator`` when none is passed (Megatron-LM's ``train_step``), so the class's private
        ``_communicate`` is wrapped: megatron-core versions outside :data:`MEGATRON_CORE_VERSIONS` are refused."""
        from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

        check_megatron_core_version("Hermod.attach_pipeline")
        if "_communicate" in vars(P2PCommunicator) and getattr(
            P2PCommunicator._communicate, "_flowlane", False
        ):
            raise RuntimeError("Hermod.attach_pipeline: P2PCommunicator is already hooked by another Hermod")
        original = P2PCommunicator._communicate
        wrapped = self._keyed_communicate(original)
        wrapped._flowlane = True  # type: ignore[attr-defined]
        self._restore.append(Patch(P2PCommunicator, "_communicate", wrapped, FEATURE))
        log.info(
            "Hermod: pipeline p2p of Megatron-core's schedules keyed (%s), on the critical class",
            self.config.schedule,
        )

    def _keyed_communicate(self, original: Callable[..., Any], bound_to: Any = None) -> Callable[..., Any]:
        """``original`` (bound to ``bound_to``, or the class's function taking the communicator first) with keys,
        a critical section (the gate for DP traffic stays closed while the step's sends and receives run) and the
        pipeline group's critical-class clone in place of the group while it runs."""

        def communicate(
            *args: Any,
            tensor_send_next: Any,
            tensor_send_prev: Any,
            recv_prev: bool,
            recv_next: bool,
            **kw: Any,
        ) -> Any:
            p2p = bound_to if bound_to is not None else args[0]
            group = p2p.pp_group
            p2p.pp_group = self.classes.get(group, CRITICAL_CLASS)
            try:
                return keyed(
                    *args,
                    tensor_send_next=tensor_send_next,
                    tensor_send_prev=tensor_send_prev,
                    recv_prev=recv_prev,
                    recv_next=recv_next,
                    **kw,
                )
            finally:
                p2p.pp_group = group

        def keyed(
            *args: Any,
            tensor_send_next: Any,
            tensor_send_prev: Any,
            recv_prev: bool,
            recv_next: bool,
            **kw: Any,
        ) -> Any:
            present = {
                "send_prev": tensor_send_prev is not None,
                "recv_prev": bool(recv_prev),
                "send_next": tensor_send_next is not None,
                "recv_next": bool(recv_next),
            }
            self._keys = {d: self.keys.pp(d) for d, on in present.items() if on}
            if self._keys.get("send_next") is not None or self._keys.get("recv_prev") is not None:
                self._fwd_mb = max(
                    self._fwd_mb,
                    min(m.microbatch for d, m in self._keys.items() if d in ("send_next", "recv_prev")),
                )

            def call():
                return original(
                    *args,
                    tensor_send_next=tensor_send_next,
                    tensor_send_prev=tensor_send_prev,
                    recv_prev=recv_prev,
                    recv_next=recv_next,
                    **kw,
                )

            if not self._keys:
                return call()
            meta = min(self._keys.values(), key=self.policy.order)
            if kw.get("wait_on_reqs", True):
                with self.sched.critical_section(meta):
                    return call()
            # overlapped p2p (the interleaved schedule's overlap_p2p_comm): the schedule waits for the requests
            # later, one by one; the gate stays closed until all of them are waited or seen complete
            self._held = [held for held in self._held if not held.release_if_completed()]
            release = self.sched.hold(meta)
            try:
                recv_prev_t, recv_next_t, reqs = call()
            except BaseException:
                release()
                raise
            held = _HeldRequests(reqs, release)
            self._held.append(held)
            return recv_prev_t, recv_next_t, held.requests

        return communicate

    def attach_ddp(self, model_chunks: Sequence[torch.nn.Module]) -> DDPHooks:
        """Schedule the gradient reductions of Megatron-core's own DistributedDataParallel (every bucket group of
        every chunk, dense and expert): :mod:`megatron_plugin.ddp_hooks`. Chunks may be attached one at a time
        (before each one's first backward); pair it with :meth:`attach_finalize`."""
        from megatron_plugin.ddp_hooks import DDPHooks

        check_megatron_core_version("Hermod.attach_ddp")
        hooks = DDPHooks(self, model_chunks)
        self._restore.extend(hooks.patches)
        log.info(
            "Hermod: %d DDP bucket group(s) and %d parameter gather(s) of Megatron-core scheduled (launch: %s)",
            hooks.bucket_groups,
            hooks.param_gather_groups,
            "program order" if self.sched.program_order else "pacer thread",
        )
        return hooks

    def attach_finalize(self, config: Any, num_microbatches: Callable[[], int] | None = None) -> None:
        """End Hermod's iteration after Megatron's own ``config.finalize_model_grads_func`` (kept whole), the same
        program point on every rank. ``num_microbatches`` (e.g. megatron.core.num_microbatches_calculator's
        ``get_num_microbatches``) is read there, so keys follow a batch-size ramp-up."""
        finalize = getattr(config, "finalize_model_grads_func", None)
        if finalize is None:
            raise ValueError(
                "Hermod.attach_finalize: config.finalize_model_grads_func is not set; set it to "
                "megatron.core.distributed.finalize_model_grads (Megatron-LM's train() does) first"
            )

        def finalize_then_end_iteration(*args: Any, **kwargs: Any) -> Any:
            out = finalize(*args, **kwargs)
            self.end_iteration()
            if num_microbatches is not None:
                self.set_num_microbatches(int(num_microbatches()))
            return out

        self._restore.append(Patch(config, "finalize_model_grads_func", finalize_then_end_iteration, FEATURE))

    def set_num_microbatches(self, num_microbatches: int) -> None:
        """A new microbatch count M from the next iteration on (DP coflows carry MID M-1)."""
        if not isinstance(num_microbatches, int) or num_microbatches < 1:
            raise ValueError(f"num_microbatches must be an integer >= 1, got {num_microbatches!r}")
        if num_microbatches == self.M:
            return
        self.M = self.keys.num_microbatches = num_microbatches
        self.policy.hermod_order = HermodOrder(
            replace(self.policy.hermod_order.config, num_microbatches=num_microbatches)
        )

    def all_to_all(
        self,
        group: dist.ProcessGroup,
        input_: torch.Tensor,
        output_split_sizes: Any = None,
        input_split_sizes: Any = None,
    ) -> torch.Tensor:
        """Drop-in for ``megatron.core.tensor_parallel.all_to_all`` (autograd-aware, matched phases)."""
        return _MatchedAllToAll.apply(self, group, input_, output_split_sizes, input_split_sizes)

    def patch_moe_dispatcher(self, config: Any = None) -> None:
        """The ``alltoall`` token dispatcher's all-to-alls become matched all-to-alls, planned from the token
        counts Megatron's ``preprocess`` already all-gathers (no second gather of the split matrix): its gather over
        the TP x EP group is kept, and ``token_dispatch`` / ``token_combine`` say which way the tokens flow.
        ``config`` (the model's TransformerConfig): a dispatcher other than ``alltoall`` is refused, since Hermod
        would leave its traffic unscheduled."""
        import megatron.core.transformer.moe.token_dispatcher as td

        check_megatron_core_version("Hermod.patch_moe_dispatcher")
        kind = getattr(config, "moe_token_dispatcher_type", "alltoall") if config is not None else "alltoall"
        if kind != "alltoall":
            raise ValueError(
                f"Hermod.patch_moe_dispatcher: moe_token_dispatcher_type={kind!r} is not scheduled; "
                "Hermod schedules the 'alltoall' dispatcher only (allgather and flex are not)"
            )
        cls = td.MoEAlltoAllTokenDispatcher
        if getattr(cls.preprocess, "_flowlane", False):  # two would key, and match, every all-to-all twice
            raise RuntimeError(
                "Hermod.patch_moe_dispatcher: the alltoall token dispatcher is already patched by another Hermod"
            )
        gather, preprocess = td.gather_from_sequence_parallel_region, cls.preprocess
        dispatch, combine = cls.token_dispatch, cls.token_combine
        h = self

        def counting_gather(input_: torch.Tensor, *args: Any, group: Any = None, **kw: Any) -> Any:
            out = gather(input_, *args, group=group, **kw)
            disp = h._capturing
            if disp is not None and group is disp.tp_ep_group and not input_.is_floating_point():
                h._ep_counts, h._capturing = (disp, out), None  # num_local_tokens_per_expert of every rank
            return out

        def counted_preprocess(disp: Any, *args: Any, **kw: Any) -> Any:
            h._capturing, h._ep_counts = disp, None
            try:
                return preprocess(disp, *args, **kw)
            finally:
                h._capturing = None

        counted_preprocess._flowlane = True  # type: ignore[attr-defined]

        def flowing(fn: Callable[..., Any], direction: str) -> Callable[..., Any]:
            def run(disp: Any, *args: Any, **kw: Any) -> Any:
                h._a2a_direction = direction
                try:
                    return fn(disp, *args, **kw)
                finally:
                    h._a2a_direction = None

            return run

        self._restore += [
            Patch(td, "all_to_all", self.all_to_all, FEATURE),
            Patch(td, "gather_from_sequence_parallel_region", counting_gather, FEATURE),
            Patch(cls, "preprocess", counted_preprocess, FEATURE),
            Patch(cls, "token_dispatch", flowing(dispatch, "dispatch"), FEATURE),
            Patch(cls, "token_combine", flowing(combine, "combine"), FEATURE),
        ]
        log.info(
            "Hermod: MoE alltoall dispatcher's all-to-alls matched (%s), planned from its token counts",
            self.config.ep_algorithm,
        )

    def dispatcher_split_matrix(self, group: dist.ProcessGroup) -> list[list[int]] | None:
        """The split matrix of the all-to-all now running on ``group`` (row i: what EP rank i sends to each rank),
        from the token counts the dispatcher gathered, transposed for the combine; None where they do not apply
        (no counts captured, TP > 1, another group), and the runner gathers the matrix itself."""
        if self._ep_counts is None or self._a2a_direction is None:
            return None
        disp, counts = self._ep_counts
        if disp.tp_size != 1 or dist.get_process_group_ranks(disp.ep_group) != dist.get_process_group_ranks(
            group
        ):
            return None
        n, nl = disp.ep_size, disp.num_local_experts
        m = counts.reshape(n, n, nl).sum(-1).tolist()  # experts are laid out by EP rank, nl each
        return m if self._a2a_direction == "dispatch" else [list(col) for col in zip(*m, strict=True)]

    @property
    def stats(self) -> HermodStats:
        return HermodStats(
            ep_matrices_from_dispatcher=self.a2a.matrices_given,
            ep_matrices_gathered=self.a2a.matrices_gathered,
        )

    def close(self) -> None:
        """Stop the scheduler and put back everything Hermod wrapped; refused, changing nothing, while a feature
        installed after Hermod wraps one of those attributes again (e.g. ALEPH or SYNDICATE on
        ``finalize_model_grads_func``: :mod:`megatron_plugin.undo`). A second close does nothing more."""
        check_all(self._restore)
        self.sched.close()
        undo_all(self._restore)


class _HeldRequests:
    """The requests of one overlapped p2p step (a dict by direction or a list, as Megatron returns them), each
    wrapped so that its ``wait()`` counts; ``release`` (the gate hold) runs once all of them have been waited."""

    def __init__(self, reqs: Any, release: Callable[[], None]) -> None:
        self._release = release
        items = list(reqs.values()) if isinstance(reqs, dict) else list(reqs or [])
        self._works = items
        self._left = len(items)
        wrapped = [_GateWork(w, self._one_done) for w in items]
        self.requests: Any = dict(zip(reqs, wrapped, strict=True)) if isinstance(reqs, dict) else wrapped
        if not items:
            release()

    def _one_done(self) -> None:
        self._left -= 1
        if self._left <= 0:
            self._release()

    def release_if_completed(self) -> bool:
        if all(w.is_completed() for w in self._works):
            self._release()
            return True
        return False

    def release(self) -> None:
        self._release()


class _GateWork:
    """A p2p request whose first ``wait()`` also tells its :class:`_HeldRequests`."""

    def __init__(self, work: Any, on_wait: Callable[[], None]) -> None:
        self._work, self._on_wait, self._waited = work, on_wait, False

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return self._work.wait(*args, **kwargs)
        finally:
            if not self._waited:
                self._waited = True
                self._on_wait()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


@dataclass
class HermodStats:
    """What Hermod did on this rank (the recipe reports it per feature)."""

    ep_matrices_from_dispatcher: int = 0
    """Matched all-to-alls planned from the token counts Megatron's dispatcher had gathered."""
    ep_matrices_gathered: int = 0
    """Matched all-to-alls that had to all-gather their split matrix first."""


class _MatchedAllToAll(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, h: Hermod, group: Any, input_: torch.Tensor, out_splits: Any, in_splits: Any
    ) -> Any:
        matrix = h.dispatcher_split_matrix(group)
        if (
            matrix is not None
            and in_splits is not None
            and matrix[dist.get_rank(group)] != [int(v) for v in in_splits]
        ):
            raise RuntimeError(
                f"Hermod: the MoE dispatcher's token counts give this rank the input splits "
                f"{matrix[dist.get_rank(group)]}, the all-to-all has {list(in_splits)}; the "
                "dispatcher changed in a way Hermod does not know (megatron-core version?)"
            )
        op = h._a2a_direction or "all_to_all"
        ctx.h, ctx.group, ctx.splits, ctx.op = h, group, (out_splits, in_splits), op
        ctx.matrix_t = None if matrix is None else [list(col) for col in zip(*matrix, strict=True)]
        return _run_a2a(h, group, input_, out_splits, in_splits, op, matrix)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        out_splits, in_splits = ctx.splits
        return (
            None,
            None,
            _run_a2a(
                ctx.h, ctx.group, grad.contiguous(), in_splits, out_splits, f"{ctx.op}_backward", ctx.matrix_t
            ),
            None,
            None,
        )


def _run_a2a(
    h: Hermod,
    group: Any,
    x: torch.Tensor,
    out_splits: Any,
    in_splits: Any,
    op: str,
    matrix: list[list[int]] | None = None,
) -> torch.Tensor:
    n = dist.get_world_size(group)
    x = x.contiguous()
    if in_splits is None:
        in_splits = [x.shape[0] // n] * n
    if out_splits is None:
        out_splits = [x.shape[0] // n] * n
    in_splits, out_splits = [int(v) for v in in_splits], [int(v) for v in out_splits]
    out = torch.empty((sum(out_splits), *x.shape[1:]), dtype=x.dtype, device=x.device)
    # not the issuing layer's microbatch and layer (keys.py's rule): a label only, see the module docstring
    meta = h.keys.ep(h._fwd_mb, h.keys.first_layer, op)
    with h.sched.critical_section(meta):
        grp = h.classes.get(group, CRITICAL_CLASS) if h._ep_on_class else group
        h.a2a(out, x, out_splits, in_splits, group=grp, matrix=matrix, kind="ep", key=meta)
    return out


# -- recipe entry point ------------------------------------------------------------------------------------------------
def install_from_config(cfg: dict[str, Any], ctx: Any) -> Hermod | None:
    """Called by the train loop on every rank, after the model is wrapped in Megatron-core's DDP and its optimizer and
    config hooks are set, before the first iteration. ``ctx`` needs: ``recipe`` (num_microbatches, num_layers,
    pipeline_parallel, num_moe_experts), ``model`` (Megatron's DistributedDataParallel), ``config`` (its
    TransformerConfig, with ``finalize_model_grads_func`` set) and ``p2p_communicator`` (the one the recipe hands
    the schedules). Returns the :class:`Hermod` (call ``close()`` at the end) or None for ``name: none``.
    Collective: every rank must call it (it creates communicators)."""
    hc = HermodConfig.from_dict(dict(cfg))
    if hc.name == "none":
        return None
    from megatron.core import parallel_state as ps

    r = ctx.recipe
    moe = bool(getattr(r, "num_moe_experts", None))
    h = Hermod(
        hc,
        num_microbatches=r.num_microbatches,
        layers_per_stage=r.num_layers // r.pipeline_parallel,
        stage=ps.get_pipeline_model_parallel_rank(),
        num_stages=r.pipeline_parallel,
        dp_group=ps.get_data_parallel_group(with_context_parallel=True),
        expert_dp_group=ps.get_expert_data_parallel_group() if moe else None,
    )
    try:
        h.attach_p2p(ctx.p2p_communicator)
        h.attach_ddp([ctx.model])
        h.attach_finalize(ctx.config)
        if moe:
            h.patch_moe_dispatcher(ctx.config)
    except BaseException:
        h.close()  # never half-installed
        raise
    return h


def describe(cfg: HermodConfig) -> dict[str, Any]:
    return asdict(cfg)
