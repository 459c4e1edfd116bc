"""Hermod coflow scheduling for DeepSpeed's PipelineEngine (seed 000 ch.5), through instruction hooks.

Enabled by the ``"flowlane": {"hermod": {...}}`` section of the DeepSpeed config (keys = the fields of
:class:`HermodDSConfig`)::

    "flowlane": {"hermod": {"enabled": true, "schedule": "1f1b", "dp_mid": "last", "gate_timeout_s": 0.05}}

    engine, *_ = deepspeed.initialize(model=pipe_module, config=ds_config)
    h = install(engine, ds_config)        # None when the section is absent or "enabled": false
    engine.train_batch(...); ...; h.close()

Hooks (the engine's per-instance ``_INSTRUCTION_MAP``; DeepSpeed itself is not patched):
* ``SendActivation`` / ``RecvActivation`` / ``SendGrad`` / ``RecvGrad``: critical ops with keys carrying the
  microbatch id (counted per instruction type per ``train_batch``) and the stage-boundary layer; the gate for
  deferred traffic is closed while they run.
* ``ReduceGrads``: keyed DP coflow (MID M-1, CType DP); the window of deferred ops is sealed first. DeepSpeed's own
  gradient all-reduce runs unchanged (same math). DeepSpeed's pipe p2p is synchronous (DeepSpeed #4738), so on this
  engine Hermod's effect is ordering and gating, not overlap.
Only the ``hermod`` subsection of ``flowlane`` is read here; ``offload`` belongs to deepspeed_plugin.ssd_offload.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from types import MethodType
from typing import Any, Literal

from deepspeed_plugin.config import flowlane_subsection
from flowlane.hermod.keys import HermodKeys
from flowlane.hermod.order import HermodOrderConfig
from flowlane.hermod.policy import HermodPolicy
from flowlane.sched import CommScheduler, SchedulerConfig
from flowlane.sched.scheduler import LogEntry


@dataclass
class HermodDSConfig:
    """The ``flowlane.hermod`` section."""

    enabled: bool = True
    schedule: Literal["1f1b", "interleaved"] = "1f1b"
    dp_mid: Literal["last", "consumer"] = "last"
    gate_timeout_s: float = 0.05
    layers_per_stage: int = 1
    """Used for the stage-boundary LID of PP keys."""

    def __post_init__(self) -> None:
        HermodOrderConfig(1, self.schedule, self.dp_mid)
        SchedulerConfig(gate_timeout_s=self.gate_timeout_s)
        if not isinstance(self.layers_per_stage, int) or self.layers_per_stage < 1:
            raise ValueError(f"flowlane.hermod.layers_per_stage must be an integer >= 1, got {self.layers_per_stage!r}")


def parse_hermod_section(ds_config: Mapping[str, Any] | str | Path | None) -> HermodDSConfig | None:
    """``ds_config["flowlane"]["hermod"]`` -> config; None when absent or disabled."""
    sub = flowlane_subsection(ds_config, "hermod")
    if sub is None:
        return None
    known = {f.name for f in fields(HermodDSConfig)}
    bad = sorted(set(sub) - known)
    if bad:
        raise ValueError(f'unknown key(s) {bad} in DeepSpeed config "flowlane.hermod"; known: {sorted(known)}')
    cfg = HermodDSConfig(**sub)
    return cfg if cfg.enabled else None


#: PipelineEngine instruction -> the p2p direction of flowlane.hermod.keys
_P2P = {"SendActivation": "send_next", "RecvActivation": "recv_prev", "SendGrad": "send_prev", "RecvGrad": "recv_next"}


class DeepSpeedHermod:
    """Installed instruction hooks of one PipelineEngine."""

    def __init__(self, engine: Any, cfg: HermodDSConfig) -> None:
        self.engine, self.cfg = engine, cfg
        self.M = int(engine.micro_batches)
        self.stage = int(engine.stage_id)
        self.policy = HermodPolicy(HermodOrderConfig(self.M, cfg.schedule, cfg.dp_mid))
        self.sched = CommScheduler(self.policy, SchedulerConfig(gate_timeout_s=cfg.gate_timeout_s))
        self.keys = HermodKeys(num_microbatches=self.M, layers_per_stage=cfg.layers_per_stage, stage=self.stage,
                               next_seq=self.sched.next_seq)
        original = dict(type(engine)._INSTRUCTION_MAP)
        hooked = dict(original)
        for instr, fn in original.items():
            name = instr.__name__
            if name in _P2P:
                hooked[instr] = self._p2p_hook(name, fn)
            elif name == "ReduceGrads":
                hooked[instr] = self._reduce_hook(fn)
            elif name == "OptimizerStep":
                hooked[instr] = self._step_hook(fn)
        engine._INSTRUCTION_MAP = hooked  # instance attribute shadows the class map

    @property
    def iteration(self) -> int:
        return self.keys.iteration

    def _p2p_hook(self, name: str, fn: Any) -> Any:
        direction = _P2P[name]

        def hook(engine: Any, **kw: Any) -> Any:
            with self.sched.critical_section(self.keys.pp(direction)):
                return MethodType(fn, engine)(**kw)
        return hook

    def _reduce_hook(self, fn: Any) -> Any:
        def hook(engine: Any, **kw: Any) -> Any:
            self.sched.seal()
            meta = self.keys.dp_reduce(self.keys.last_layer)  # one bucket: the whole stage
            self.sched.log.append(LogEntry("dp", meta, 0, time.perf_counter()))
            return MethodType(fn, engine)(**kw)
        return hook

    def _step_hook(self, fn: Any) -> Any:
        def hook(engine: Any, **kw: Any) -> Any:
            out = MethodType(fn, engine)(**kw)
            self.keys.end_iteration()
            return out
        return hook

    def close(self) -> None:
        self.sched.close()
        if "_INSTRUCTION_MAP" in vars(self.engine):
            del self.engine._INSTRUCTION_MAP


def install(engine: Any, ds_config: Mapping[str, Any] | str | Path | None) -> DeepSpeedHermod | None:
    """Hook a PipelineEngine when ``flowlane.hermod`` is present and enabled; otherwise None."""
    cfg = parse_hermod_section(ds_config)
    if cfg is None:
        return None
    if not hasattr(type(engine), "_INSTRUCTION_MAP"):
        raise TypeError(f"flowlane.hermod needs a DeepSpeed PipelineEngine, got {type(engine).__name__}")
    return DeepSpeedHermod(engine, cfg)
