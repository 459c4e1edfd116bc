"""Hermod coflow scheduling on DeepSpeed's own communication (seed 000 ch.5): ZeRO 0-3 and the PipelineEngine.

Enabled by the ``"flowlane": {"hermod": {...}}`` section of the DeepSpeed config (keys = the fields of
:class:`HermodDSConfig`)::

    "flowlane": {"hermod": {"enabled": true, "window": "bucket", "gate_timeout_s": 0.05}}

    engine, *_ = deepspeed.initialize(model=model, config=ds_config)
    h = install(engine, ds_config)        # None when the section is absent or "enabled": false
    ... train ...; h.close()               # with other flowlane features: the reverse order of their install

What is hooked (DeepSpeed's classes are not patched; every hook is an attribute of this engine's objects):

* **gradient reductions** (every ZeRO stage, the plain engine and the PipelineEngine's ReduceGrads) and **ZeRO-3
  parameter gathers**: :mod:`deepspeed_plugin.zero_hooks` -- DeepSpeed's own bucket functions run as deferred
  coflows keyed (MID M-1, DP, the bucket's highest layer) in Hermod's order, on the bulk-class clone of their group;
  ZeRO-3's coordinator fetches are critical ops that hold the paced reductions back (the gate).
* **PipelineEngine p2p** (the per-instance ``_INSTRUCTION_MAP``): ``SendActivation`` / ``RecvActivation`` /
  ``SendGrad`` / ``RecvGrad`` are critical ops with keys carrying the microbatch id (counted per instruction type per
  ``train_batch``) and the stage-boundary layer, sent on the critical-class clone of the pipeline group (on NCCL its
  traffic class and a high-priority stream), as Megatron's pipeline p2p is (megatron_plugin.hermod). DeepSpeed's pipe
  p2p is synchronous (DeepSpeed #4738), so on this engine Hermod's effect is ordering, gating and the class, not
  overlap.
* **communicators**: :class:`deepspeed_plugin.comm.CommTap` on ``deepspeed.comm`` records every op with its key and
  sends the pacer's ops to the Hermod class clones built at install (:func:`flowlane.sched.build_class_groups`: NCCL
  traffic classes, or gloo clones).

DeepSpeed versions: the hooks wrap private functions (``reduce_ipg_grads``, ZeRO-3's
``__reduce_and_partition_ipg_grads``, the coordinator's ``fetch_sub_module``, the pipe ``_INSTRUCTION_MAP``) checked on
the range :data:`DEEPSPEED_VERSIONS`; other versions are refused at install. ``install`` is a collective over the
world (it builds the class clones): call it on every rank, in the same order as ``deepspeed.initialize``.
Only the ``hermod`` subsection of ``flowlane`` is read here; ``offload`` belongs to deepspeed_plugin.ssd_offload.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from types import MethodType
from typing import Any, Literal

import torch.distributed as dist

from deepspeed_plugin.comm import CommTap
from deepspeed_plugin.config import DEEPSPEED_VERSIONS, flowlane_subsection, validate_flowlane_section
from deepspeed_plugin.zero_hooks import ZeroHooks
from flowlane.hermod.keys import HermodKeys
from flowlane.hermod.order import HermodOrderConfig
from flowlane.hermod.policy import HermodPolicy
from flowlane.sched import CommScheduler, SchedulerConfig, build_class_groups
from flowlane.versions import check_version_range

log = logging.getLogger("flowlane.hermod")

#: Hermod's critical class (flowlane.hermod.wire: pipeline p2p and the oldest microbatch's traffic)
CRITICAL_CLASS = 0


def check_deepspeed_version() -> str:
    """The installed DeepSpeed version; raises when it is outside :data:`DEEPSPEED_VERSIONS`."""
    return check_version_range("deepspeed", DEEPSPEED_VERSIONS, "flowlane.hermod")


#: keys of the shared Hermod section that nothing on DeepSpeed reads: (the only value accepted, why it has no effect)
NO_EFFECT: dict[str, tuple[Any, str]] = {
    "schedule": (
        "1f1b",
        "it orders EP and PP against DP, and Hermod defers only DeepSpeed's DP reductions (pipeline p2p and "
        "ZeRO-3 gathers are critical ops, launched at once in DeepSpeed's order)",
    ),
    "dp_mid": (
        "last",
        "it moves DP parameter gathers, and DeepSpeed's ZeRO-3 gathers are critical ops, never deferred",
    ),
    "max_inflight_buckets": (
        1,
        "the pacer calls DeepSpeed's own bucket function, one call at a time in its thread, and the call "
        "returns no handle to keep in flight, so buckets go out one after the other whatever this allows",
    ),
    "layers_per_stage": (
        1,
        "it only sets the layer label of the PipelineEngine's p2p keys, which are critical ops launched at "
        "once in DeepSpeed's order",
    ),
}


@dataclass
class HermodDSConfig:
    """The ``flowlane.hermod`` section."""

    enabled: bool = True
    """False: the section is parsed and checked, nothing is installed."""
    schedule: Literal["1f1b", "interleaved"] = "1f1b"
    """CType order: 1f1b = EP & PP > DP; interleaved = EP > PP > DP (seed 000 §5.3.1). Only the default: see
    :data:`NO_EFFECT`."""
    dp_mid: Literal["last", "consumer"] = "last"
    """MID of DP coflows (digest A2.4 / A6.1 #1). Only the default: see :data:`NO_EFFECT`."""
    gate_timeout_s: float = 0.05
    """Longest a paced reduction is held back while a critical op (p2p, ZeRO-3 fetch) is outstanding."""
    window: Literal["bucket", "backward"] = "bucket"
    """When a bucket reduced from a backward hook may go out: ``bucket`` -- at once, a window of its own (keeps
    ``overlap_comm``'s overlap with the rest of backward; the order is DeepSpeed's, Hermod's gate and classes
    apply); ``backward`` -- with the rest of the backward's buckets, sealed at the epilogue and sent in Hermod's
    order (lowest layer first), no overlap with backward. Critical ops (ZeRO-3 fetches, p2p) seal a window too."""
    max_inflight_buckets: int = 1
    """Deferred bucket reductions on the wire at once. Only the default: see :data:`NO_EFFECT`."""
    layers_per_stage: int = 1
    """PipelineEngine: the stage-boundary LID of PP keys. Only the default: see :data:`NO_EFFECT`."""
    gloo_class_ifnames: str = ""
    """gloo only: one interface per class ("eth0,eth0,bulk0") so the bulk class leaves from its own address
    (flowlane.sched.groups); empty = host-side ordering only. NCCL uses traffic classes instead."""

    def __post_init__(self) -> None:
        if not isinstance(self.enabled, bool):
            raise ValueError(f"flowlane.hermod.enabled must be true or false, got {self.enabled!r}")
        if (
            isinstance(self.gate_timeout_s, bool)
            or not isinstance(self.gate_timeout_s, int | float)
            or not (self.gate_timeout_s >= 0)
        ):
            raise ValueError(
                f"flowlane.hermod.gate_timeout_s must be a number of seconds >= 0, "
                f"got {self.gate_timeout_s!r}"
            )
        if (
            isinstance(self.max_inflight_buckets, bool)
            or not isinstance(self.max_inflight_buckets, int)
            or (self.max_inflight_buckets < 1)
        ):
            raise ValueError(
                f"flowlane.hermod.max_inflight_buckets must be an integer >= 1, "
                f"got {self.max_inflight_buckets!r}"
            )
        for name in ("schedule", "dp_mid"):
            allowed = {"schedule": ["1f1b", "interleaved"], "dp_mid": ["consumer", "last"]}[name]
            if getattr(self, name) not in allowed:
                raise ValueError(f"flowlane.hermod.{name} {getattr(self, name)!r} is not one of {allowed}")
        HermodOrderConfig(1, self.schedule, self.dp_mid)
        if self.window not in ("bucket", "backward"):
            raise ValueError(f"flowlane.hermod.window {self.window!r} is not one of ['backward', 'bucket']")
        self.scheduler_config()
        if not isinstance(self.layers_per_stage, int) or self.layers_per_stage < 1:
            raise ValueError(
                f"flowlane.hermod.layers_per_stage must be an integer >= 1, got {self.layers_per_stage!r}"
            )
        if not isinstance(self.gloo_class_ifnames, str):
            raise ValueError(
                f"flowlane.hermod.gloo_class_ifnames must be a string, got {self.gloo_class_ifnames!r}"
            )
        for name, (default, why) in NO_EFFECT.items():
            if getattr(self, name) != default:
                raise ValueError(
                    f"flowlane.hermod.{name} {getattr(self, name)!r} has no effect on DeepSpeed: {why}; leave "
                    f"it out (or {default!r})"
                )

    def scheduler_config(self) -> SchedulerConfig:
        # a bucket is one coflow: DeepSpeed's reduce_bucket_size sets the granularity, Hermod does not split it
        return SchedulerConfig(
            mode="hermod",
            chunk_bytes=1 << 62,
            max_inflight_chunks=self.max_inflight_buckets,
            gate_timeout_s=self.gate_timeout_s,
        )


def parse_hermod_section(ds_config: Mapping[str, Any] | str | Path | None) -> HermodDSConfig | None:
    """``ds_config["flowlane"]["hermod"]`` -> config; None when absent or disabled."""
    sub = flowlane_subsection(ds_config, "hermod")
    if sub is None:
        return None
    known = {f.name for f in fields(HermodDSConfig)}
    bad = sorted(set(sub) - known)
    if bad:
        raise ValueError(
            f'unknown key(s) {bad} in DeepSpeed config "flowlane.hermod"; known: {sorted(known)}'
        )
    cfg = HermodDSConfig(**sub)
    return cfg if cfg.enabled else None


#: PipelineEngine instruction -> the p2p direction of flowlane.hermod.keys
_P2P = {
    "SendActivation": "send_next",
    "RecvActivation": "recv_prev",
    "SendGrad": "send_prev",
    "RecvGrad": "recv_next",
}


def _is_pipeline_engine(engine: Any) -> bool:
    from deepspeed.runtime.pipe.engine import PipelineEngine  # noqa: PLC0415

    return isinstance(engine, PipelineEngine)


class DeepSpeedHermod:
    """Hermod installed on one DeepSpeed engine (see the module docstring); :meth:`close` undoes it."""

    def __init__(self, engine: Any, cfg: HermodDSConfig) -> None:
        from deepspeed.runtime.engine import DeepSpeedEngine  # noqa: PLC0415

        if not isinstance(engine, DeepSpeedEngine):
            raise TypeError(
                f"flowlane.hermod needs a DeepSpeed engine (deepspeed.initialize), got "
                f"{type(engine).__name__}"
            )
        self.engine, self.cfg = engine, cfg
        self.pipeline = _is_pipeline_engine(engine)
        self.M = int(engine.micro_batches) if self.pipeline else int(engine.gradient_accumulation_steps())
        self.stage = int(engine.stage_id) if self.pipeline else 0
        self.policy = HermodPolicy(HermodOrderConfig(self.M, cfg.schedule, cfg.dp_mid))
        self.sched: CommScheduler | None = None
        self.tap: CommTap | None = None
        self.zero = ZeroHooks(self)  # every check first; nothing is patched before the clones exist
        groups = self.zero.groups()
        self.pp_group = engine.grid.get_pipe_parallel_group() if self.pipeline else None
        if self.pp_group is not None:  # pipeline p2p moves to this group's critical-class clone
            groups.append(self.pp_group)
        ranks = [
            tuple(range(dist.get_world_size())) if g is None else tuple(dist.get_process_group_ranks(g))
            for g in groups
        ]
        self.classes = build_class_groups(ranks, gloo_class_ifnames=cfg.gloo_class_ifnames or None)
        self.sched = CommScheduler(self.policy, cfg.scheduler_config())
        self.keys = HermodKeys(
            num_microbatches=self.M,
            layers_per_stage=cfg.layers_per_stage,
            stage=self.stage,
            next_seq=self.sched.next_seq,
        )
        try:
            self.tap = CommTap(self.classes)
            self.zero.attach()
        except BaseException:
            self.close()
            raise
        if self.pipeline:
            self._hook_pipeline()
        else:
            step = engine.step

            def hooked_step(*args: Any, **kwargs: Any) -> Any:
                boundary = engine.is_gradient_accumulation_boundary()
                if boundary:
                    self.zero.flush()
                out = step(*args, **kwargs)
                if boundary:
                    self.keys.end_iteration()
                return out

            # one registry of patches (ZeroHooks): close checks them all before undoing any
            self.zero._set(engine, "step", hooked_step)

    @property
    def iteration(self) -> int:
        return self.keys.iteration

    # -- PipelineEngine ----------------------------------------------------------------------------------------------
    def _hook_pipeline(self) -> None:
        engine = self.engine
        hooked = dict(type(engine)._INSTRUCTION_MAP)
        for instr, fn in type(engine)._INSTRUCTION_MAP.items():
            name = instr.__name__
            if name in _P2P:
                hooked[instr] = self._p2p_hook(name, fn)
            elif name == "OptimizerStep":
                hooked[instr] = self._step_hook(fn)
        self.zero._set(engine, "_INSTRUCTION_MAP", hooked)  # instance attribute shadows the class map
        log.info(
            "Hermod: PipelineEngine p2p keyed (%s), on the critical class's clone of pipeline group %s",
            self.cfg.schedule,
            dist.get_process_group_ranks(self.pp_group),
        )

    def _p2p_hook(self, name: str, fn: Any) -> Any:
        direction = _P2P[name]

        def hook(engine: Any, **kw: Any) -> Any:
            meta = self.keys.pp(direction)
            with (
                self.sched.critical_section(meta),
                self.tap.p2p_on_class(CRITICAL_CLASS, meta, self.pp_group),
            ):
                return MethodType(fn, engine)(**kw)

        return hook

    def _step_hook(self, fn: Any) -> Any:
        def hook(engine: Any, **kw: Any) -> Any:
            self.zero.flush()
            out = MethodType(fn, engine)(**kw)
            self.keys.end_iteration()
            return out

        return hook

    def close(self) -> None:
        """Wait for what is queued, then undo every hook and the tap (the class clones stay: groups are not freed).
        Refused, changing nothing, while a feature installed after Hermod still wraps one of its hooks: close that
        one first (:meth:`deepspeed_plugin.zero_hooks.ZeroHooks.check_removable`, :meth:`CommTap.check_removable`)."""
        self.zero.check_removable()
        if self.tap is not None:
            self.tap.check_removable()  # before anything is undone: a refused close leaves Hermod whole
        if self.sched is not None:
            self.zero.flush()
            self.sched.close()
            self.sched = None
        self.zero.remove()
        if self.tap is not None:
            self.tap.close()
            self.tap = None


def install(engine: Any, ds_config: Mapping[str, Any] | str | Path | None) -> DeepSpeedHermod | None:
    """Hook ``engine`` when ``flowlane.hermod`` is present and enabled; otherwise None. A collective: every rank.
    The whole ``"flowlane"`` section is checked first (:func:`deepspeed_plugin.config.validate_flowlane_section`)."""
    cfg = validate_flowlane_section(ds_config)["hermod"]
    if cfg is None:
        return None
    check_deepspeed_version()
    return DeepSpeedHermod(engine, cfg)
