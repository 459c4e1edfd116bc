"""SYNDICATE's enforcer on DeepSpeed's data-parallel gradient all-reduce (seed 004 §5.2; digest §7 "DeepSpeed").

DeepSpeed routes its communication through the backend object ``deepspeed.comm.comm.cdb``; with ZeRO stage 0 the
engine sums each gradient bucket with ``cdb.all_reduce(bucket, SUM, dp_group)`` (``allreduce_bucket``), scaling
before and after as it always does; ZeRO 1 and 2 sum their buckets of gradient slices with the same call (and the
gradient norm's partial sums too), then each rank keeps its partition. :class:`SyndicateDeepSpeed` wraps that one method on the instance (the class is
not patched; :meth:`SyndicateDeepSpeed.close` restores it): a SUM all-reduce of a contiguous tensor on the engine's
data-parallel ranks goes through a :class:`flowlane.syndicate.enforcer.Enforcer`, which cuts it into the plan's
motifs, puts each op on its plan path (one process group per path, each a clone of the DP group's ranks made at
install) and launches the motifs in the plan's order. Every other call goes to DeepSpeed's own. The iteration
boundary is the engine's ``step()`` at a gradient-accumulation boundary (the enforcer's watchdog compares the
iteration's launch sequence across ranks there, and a committed plan switch takes effect there).

DeepSpeed's math is unchanged: the sums are the backend's own all-reduce on slices, so results are equal to
DeepSpeed's own run (bitwise on 2 ranks, where a sum of two has one order; within float tolerance beyond).

Config: ``"flowlane": {"syndicate": {...}}`` (:class:`SyndicateDSConfig`): ``plan`` (a path to a plan JSON written
by :meth:`flowlane.syndicate.plan.SyndicatePlan.to_json`, or the plan's dict), ``mode`` (``plan`` or ``fifo``: every
op whole, the baseline, and the way to learn the op signatures with :attr:`SyndicateDeepSpeed.submitted`),
``check_every``, ``timeout_s``, ``profile_iteration``, ``profile_out``, ``enabled``. Unknown keys are an error
naming them.

From FIFO to a plan: in FIFO mode the enforcer profiles iteration ``profile_iteration`` (optimizer steps, counted
from 0; the second by default). With ``profile_out`` set, data-parallel rank 0 writes it there as JSON, for
``flowlane syndicate-plan``, at the ``step()`` that ends that iteration; :meth:`SyndicateDeepSpeed.write_profile`
writes it from code
(:meth:`flowlane.syndicate.enforcer.Enforcer.profile`: each op's signature, ranks, submission and completion time;
a synchronous all-reduce is waited for at once, so on gloo its ``done_s`` is when it completed).

Refused at install (never silently skipped): ZeRO 3 and the ZeRO 1/2 settings whose reductions are not bucket
all-reduces (:func:`deepspeed_plugin.comm.check_zero_all_reduce`), pipeline engines, a backend another flowlane
feature already wraps (Hermod's tap, ALEPH), a plan whose ops span another number of ranks than the DP group, plan
options the enforcer cannot force (``tree``, ``rs_ag``; :data:`flowlane.syndicate.enforcer.RUNNABLE_ALGOS`), ops
other than all-reduce, and an order that interleaves ops: DeepSpeed waits for each bucket's all-reduce before it
submits the next (a synchronous call), so only the order *within* an op can apply here.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Literal

import torch.distributed as dist

from deepspeed_plugin.comm import (
    after_iteration,
    check_zero_all_reduce,
    route_dp_all_reduce,
    unwrapped_backend,
)
from deepspeed_plugin.config import DEEPSPEED_VERSIONS, flowlane_subsection, validate_flowlane_section
from flowlane.patching import undo_all
from flowlane.syndicate.enforcer import Enforcer, EnforcerConfig, check_dp_gradient_plan
from flowlane.syndicate.plan import SyndicatePlan
from flowlane.versions import check_version_range

log = logging.getLogger("flowlane.syndicate")

#: installs in this process: each gets its own store namespace (installs are collective, so ranks agree)
_INSTALLS = itertools.count()


@dataclass(frozen=True)
class SyndicateDSConfig:
    """The ``flowlane.syndicate`` section of a DeepSpeed config."""

    enabled: bool = True
    """False: the section is read and checked, nothing is installed."""
    plan: str | dict[str, Any] | None = None
    """A plan JSON file path, or the plan as a dict (``SyndicatePlan.to_dict()``); None only with mode ``fifo``."""
    mode: Literal["plan", "fifo"] = "plan"
    """``plan``: the plan's motifs, paths and order; ``fifo``: every op whole, at submission (the baseline)."""
    check_every: int = 1
    """Compare the iteration's launch sequence across ranks every this many iterations (0: never)."""
    timeout_s: float = 60.0
    """How long the watchdog waits for the other ranks before naming the missing ones."""
    profile_iteration: int = 1
    """FIFO mode: the iteration the enforcer profiles for the plan search (``write_profile``); -1: none.
    :attr:`SyndicateDeepSpeed.submitted` keeps iterations 0 to this one only (none at -1)."""
    profile_out: str | None = None
    """FIFO mode: data-parallel rank 0 writes the profile to this JSON path at the ``step()`` that ends
    ``profile_iteration`` (the input of ``flowlane syndicate-plan``); None: only :meth:`SyndicateDeepSpeed.write_profile`."""

    def __post_init__(self) -> None:
        if not isinstance(self.enabled, bool):
            raise ValueError(f"flowlane.syndicate.enabled must be true or false, got {self.enabled!r}")
        if self.plan is not None and not isinstance(self.plan, str | dict):
            raise ValueError(
                f"flowlane.syndicate.plan must be a plan JSON path or a plan object, got "
                f"{type(self.plan).__name__}"
            )
        if self.mode == "plan" and self.plan is None and self.enabled:
            raise ValueError('flowlane.syndicate.plan is required with mode "plan" (or set mode "fifo")')
        # names a bad mode / check_every / timeout / profile_iteration
        enf = EnforcerConfig(
            self.mode, self.check_every, self.timeout_s, profile_iteration=self.profile_iteration
        )
        if self.profile_out is not None:
            if not isinstance(self.profile_out, str) or not self.profile_out:
                raise ValueError(
                    f"flowlane.syndicate.profile_out must be a file path, got {self.profile_out!r}"
                )
            if why := enf.why_nothing_recorded():
                raise ValueError(
                    f"flowlane.syndicate.profile_out={self.profile_out!r}: {why} (mode {self.mode!r}, "
                    f"profile_iteration {self.profile_iteration})"
                )

    def load_plan(self) -> SyndicatePlan | None:
        if self.plan is None:
            return None
        if isinstance(self.plan, dict):
            return SyndicatePlan.from_json(json.dumps(self.plan))
        p = Path(self.plan)
        if not p.is_file():
            raise ValueError(f"flowlane.syndicate.plan: no plan file at {str(p)!r}")
        return SyndicatePlan.from_json(p.read_text())


def parse_syndicate_section(ds_config: Mapping[str, Any] | str | Path | None) -> SyndicateDSConfig | None:
    """``ds_config["flowlane"]["syndicate"]`` as a config, or None when absent or disabled."""
    sub = flowlane_subsection(ds_config, "syndicate")
    if sub is None:
        return None
    known = [f.name for f in fields(SyndicateDSConfig)]
    unknown = sorted(set(sub) - set(known))
    if unknown:
        raise ValueError(f"unknown key(s) {unknown} in flowlane.syndicate; known: {known}")
    cfg = SyndicateDSConfig(**sub)
    return cfg if cfg.enabled else None


def check_plan_for_deepspeed(plan: SyndicatePlan, dp_size: int) -> None:
    """Refuse what cannot run on DeepSpeed's DP all-reduce, naming the op (DeepSpeed waits for each op before it
    submits the next, so ops cannot interleave)."""
    check_dp_gradient_plan(
        plan,
        dp_size,
        "DeepSpeed",
        "DeepSpeed waits for each bucket's all-reduce before it submits the next",
    )


class SyndicateDeepSpeed:
    """The enforcer installed on one DeepSpeed engine (see the module docstring); :meth:`close` undoes it."""

    def __init__(self, engine: Any, cfg: SyndicateDSConfig, store: Any = None) -> None:
        from deepspeed.runtime.engine import DeepSpeedEngine  # noqa: PLC0415
        from deepspeed.runtime.pipe.engine import PipelineEngine  # noqa: PLC0415

        if not isinstance(engine, DeepSpeedEngine):
            raise TypeError(f"flowlane.syndicate needs a DeepSpeed engine, got {type(engine).__name__}")
        if isinstance(engine, PipelineEngine):
            raise ValueError(
                "flowlane.syndicate on DeepSpeed does not support PipelineEngine (DP engines only)"
            )
        check_zero_all_reduce(engine, "flowlane.syndicate")
        cdb = unwrapped_backend("syndicate")
        dp_group = engine.seq_data_parallel_group  # the group allreduce_bucket reduces over (engine.py)
        self.ranks = tuple(dist.get_process_group_ranks(dp_group))
        plan = cfg.load_plan()
        if plan is not None:
            check_plan_for_deepspeed(plan, len(self.ranks))
        rank = dist.get_rank(dp_group)
        if (
            cfg.profile_out is not None
        ):  # refused on every rank, before any group is made, if rank 0 cannot write
            why = [_why_unwritable(cfg.profile_out) if rank == 0 else ""]
            dist.broadcast_object_list(why, src=self.ranks[0], group=dp_group)
            if why[0]:
                raise ValueError(
                    f"flowlane.syndicate.profile_out={cfg.profile_out!r} on data-parallel rank 0: {why[0]}"
                )
        path_names = sorted({op.option.path for op in plan.ops}) if plan is not None else ["default"]
        # one clone of the DP group per path, made in name order on every rank (group creation is collective)
        self.paths = {name: dist.new_group(list(self.ranks)) for name in path_names}
        if store is None:
            # torch.distributed's own store (every rank has it after init_process_group); the enforcer prefixes
            # its keys with the namespace
            try:
                from torch.distributed.distributed_c10d import _get_default_store  # noqa: PLC0415
            except ImportError:
                raise RuntimeError(
                    "flowlane.syndicate: this torch has no default store to share; pass install(store=...)"
                ) from None
            store = _get_default_store()
        self.enforcer = Enforcer(
            self.paths,
            store,
            rank,
            len(self.ranks),
            EnforcerConfig(
                cfg.mode,
                cfg.check_every,
                cfg.timeout_s,
                f"flowlane-ds-syndicate/{next(_INSTALLS)}",
                profile_iteration=cfg.profile_iteration,
            ),
        )
        self.enforcer.install(plan)  # refuses options it cannot run; compares the plan's digest on every rank
        self.submitted: list[tuple[int, str, int, str]] = []
        """(iteration, kind, numel, dtype) of every op routed through the enforcer in iterations 0 to
        ``profile_iteration`` (none at -1; later ones are not kept, bounded in a long job): the plan's
        signatures."""
        self.engine, self.cfg = engine, cfg

        def reduce(tensor: Any, async_op: bool) -> Any:
            last = self.enforcer.config.profile_iteration
            if last is not None and self.enforcer.iteration <= last:  # bounded: not a row per op per step
                self.submitted.append(
                    (self.enforcer.iteration, "all_reduce", tensor.numel(), str(tensor.dtype)[6:])
                )
            handle = self.enforcer.all_reduce(tensor)
            if async_op:
                return handle
            handle.wait()
            return None

        self.profile_written: Path | None = None
        """Where ``profile_out`` was written on this rank (data-parallel rank 0 only), once it has been."""
        write_out = cfg.profile_out if rank == 0 else None
        self._profile_failed = False

        def step() -> None:
            self.enforcer.step()
            if write_out is None or self.profile_written is not None or self._profile_failed:
                return
            if self.enforcer.profile() is None:
                return
            try:
                self.profile_written = self.write_profile(write_out)
            except OSError as e:
                # rank 0 alone writes: raising here would leave the other ranks in the next all-reduce until the
                # backend's timeout; the job goes on without the file, said once, loudly
                self._profile_failed = True
                log.error(
                    "flowlane.syndicate: could not write the profile to %s (the job goes on): %s",
                    write_out,
                    e,
                )
                return
            log.info(
                "flowlane.syndicate: wrote the profile of iteration %d to %s",
                cfg.profile_iteration,
                write_out,
            )

        self._undo = route_dp_all_reduce(cdb, self.ranks, reduce, "flowlane.syndicate")
        self._undo_step = after_iteration(engine, step, "flowlane.syndicate")
        log.info(
            "flowlane.syndicate: enforcer on DeepSpeed's DP all-reduce (%d ranks, mode %s, plan %s)",
            len(self.ranks),
            cfg.mode,
            f"v{plan.version}" if plan is not None else "none",
        )

    def write_profile(self, path: str | os.PathLike[str]) -> Path:
        """Write the enforcer's profile (FIFO mode; :meth:`flowlane.syndicate.enforcer.Enforcer.profile`, format
        :data:`flowlane.syndicate.enforcer.PROFILE_FORMAT`) to ``path`` as JSON with a ``provenance`` envelope,
        atomically. Local: one rank of the data-parallel group is enough (every rank records the same ops).
        Refused, writing nothing, while there is no profile (naming why). Returns the path."""
        from flowlane.testing.provenance import write_result

        prof = self.enforcer.profile()
        if prof is None:
            why = self.enforcer.why_no_profile()
            raise ValueError(f"flowlane.syndicate: no profile to write to {str(path)!r}: {why}")
        return write_result(path, prof)

    def close(self) -> None:
        """Undo the wraps (refused, changing nothing, while a later install wraps one of them: close that first),
        then close the enforcer."""
        undo_all([w for w in (self._undo, self._undo_step) if w is not None])
        self.enforcer.close()


def _why_unwritable(path: str) -> str:
    """Why the profile cannot be written to ``path`` here ('' when it can): its folder is made now, as
    :func:`flowlane.testing.provenance.write_result` would at the end of the profiled iteration."""
    p = Path(path)
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        return f"cannot make its folder: {e}"
    if p.is_dir():
        return "it is a folder; give a file path"
    if not os.access(p.parent, os.W_OK):
        return f"its folder {str(p.parent)!r} is not writable"
    return ""


def install(
    engine: Any, ds_config: Mapping[str, Any] | str | Path | None, store: Any = None
) -> SyndicateDeepSpeed | None:
    """Install the enforcer on ``engine`` from ``flowlane.syndicate`` (None when absent or disabled). A collective:
    every rank, after ``deepspeed.initialize``. ``store``: a store every rank shares (default: torch's own)."""
    # the whole section (parse_syndicate_section included): a typo in another sub-section is not silently ignored
    cfg: SyndicateDSConfig | None = validate_flowlane_section(ds_config)["syndicate"]
    if cfg is None:
        return None
    check_version_range("deepspeed", DEEPSPEED_VERSIONS, "flowlane.syndicate")
    return SyndicateDeepSpeed(engine, cfg, store)
