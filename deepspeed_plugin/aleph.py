"""ALEPH on DeepSpeed's data-parallel gradient all-reduce (seed 002; digest §6 "DeepSpeed plugin").

DeepSpeed routes all communication through the backend object ``deepspeed.comm.comm.cdb``; with ZeRO stage 0 the
engine sums gradient buckets with ``cdb.all_reduce(bucket, SUM, dp_group)`` (``allreduce_bucket``), scaling before
and after as it always does. ZeRO stages 1 and 2 sum them with the same call: ``average_tensor`` all-reduces each
bucket of gradient slices (``allreduce_and_scatter``, the default ``use_multi_rank_bucket_allreduce``) or the whole
bucket (``"reduce_scatter": false``), and each rank keeps its partition's slices. :class:`AlephDeepSpeed` wraps that one method on the instance (the class is not
patched; :meth:`close` restores it): a SUM all-reduce on the engine's data-parallel group runs through
:class:`flowlane.aleph.hook.HierarchicalAllReduce` instead; every other call (other groups, MAX/MIN, other ops) goes
to DeepSpeed's own. An ``async_op`` caller gets a completed handle (the hierarchy runs synchronously).

Refused at install (never silently skipped): ZeRO stage 3 (partitioned parameters: its reductions are
reduce-scatters), ZeRO 1/2 with ``use_multi_rank_bucket_allreduce`` off (a ``reduce`` to each partition's owner) or
MoE layers (expert gradients reduce over expert groups), pipeline engines (their DP group is the mpu's; not
tested), a backend another flowlane tap already wraps (Hermod), a plan whose size is not the DP group's, and
DeepSpeed versions other than 0.19 (:data:`DEEPSPEED_VERSIONS`).

Config: the ``"flowlane": {"aleph": {...}}`` section of the DeepSpeed config holds :class:`flowlane.aleph.AlephConfig`
keys plus ``"enabled"`` and ``"bandwidth_gbps"`` (one figure per DP rank; the plan is made from it with M-WCHA) or
``"clusters"`` (an explicit plan: a list of member lists, aggregator first), and with ``"top": "ps"`` several PSs:
``"ps"`` (their positions, aggregators), ``"split"`` (``"equal"`` or one fraction each) or ``"ps_bandwidths"`` (a
proportional split; digest §2.9). :func:`install` reads it, after checking the whole ``"flowlane"`` section
(:func:`deepspeed_plugin.config.validate_flowlane_section`).

Re-planning (digest §5.1 #13, E10): ``"replan_every": K`` (default 0, off), ``"hysteresis"`` (0.2) and
``"probe_bytes"`` (each timed transfer, default 4 MiB). The iteration boundary is the one DeepSpeed gives: the
engine's ``step()`` at a gradient-accumulation boundary (wrapped on the instance, as the SYNDICATE plugin does).
Every K-th boundary the DP group probes its bandwidth (``probe_bandwidth``; figures all-gathered, so every rank
decides alike; a probe that moves a rank is confirmed by a second one, :func:`flowlane.aleph.replan.confirmed_probe`)
and :class:`flowlane.aleph.hook.ReplanningAllReduce` swaps in a new hierarchy when the ``Replanner`` decides to.
Needs ``bandwidth_gbps`` (the first plan's figures) and ``"top": "ps"`` with one PS (its groups serve any plan);
``hysteresis`` / ``probe_bytes`` without ``replan_every`` are refused (they would have no effect), and so is
``replan_every`` on a group whose backend is not gloo (the probe's CPU tensors and host timing,
:func:`flowlane.aleph.probe.check_probe_backend`).

With ``"top": "ps"`` and ``bandwidth_gbps`` the PS (one of the heads: the seed's PS is a separate machine) is the head
with the most bandwidth left for the PS's extra flows (:func:`flowlane.aleph.model.ps_head`), after re-planning too;
with ``clusters`` it is the first head unless ``"ps"`` names it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch.distributed as dist

from deepspeed_plugin.comm import (
    after_iteration,
    check_zero_all_reduce,
    route_dp_all_reduce,
    unwrapped_backend,
)
from deepspeed_plugin.config import DEEPSPEED_VERSIONS, validate_flowlane_section
from flowlane.aleph import AlephConfig, Plan, Replanner, plan_clusters
from flowlane.aleph.config import PLANNER_FIELDS, PROBE_BYTES
from flowlane.aleph.hook import HierarchicalAllReduce, ReplanningAllReduce
from flowlane.aleph.model import ps_head
from flowlane.aleph.probe import check_probe_backend
from flowlane.patching import Patch, undo_all
from flowlane.versions import check_version_range

SECTION_KEYS = ("enabled", "bandwidth_gbps", "clusters", "ps", "split", "ps_bandwidths", "probe_bytes")
REPLAN_KEYS = ("hysteresis", "probe_bytes")
"""Keys that act only with ``replan_every`` > 0 (refused without it: they would have no effect)."""


class _Done:
    """A finished work handle for ``async_op=True`` callers."""

    def wait(self, timeout: Any = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


class AlephDeepSpeed:
    """The wrap on ``cdb.all_reduce`` (see the module docstring); ``calls`` counts the all-reduces it took."""

    def __init__(
        self,
        engine: Any,
        plan: Plan,
        top: str = "allreduce",
        multi_ps: dict[str, Any] | None = None,
        replanner: Any = None,
        probe: Any = None,
        probe_bytes: int = PROBE_BYTES,
    ) -> None:
        from deepspeed.runtime.pipe.engine import PipelineEngine  # noqa: PLC0415

        if replanner is not None and probe is None:  # the default probe runs on gloo only
            check_probe_backend(engine.seq_data_parallel_group, "flowlane.aleph replan_every")
        cdb = unwrapped_backend("aleph")
        check_zero_all_reduce(engine, "flowlane.aleph")
        if isinstance(engine, PipelineEngine):
            raise ValueError(
                "flowlane.aleph on DeepSpeed does not support PipelineEngine yet (its DP group is the "
                "pipeline grid's); use a plain engine or torch DDP with flowlane.aleph.hook"
            )
        dp_group = engine.seq_data_parallel_group  # the group allreduce_bucket reduces over (engine.py)
        self.ranks = tuple(dist.get_process_group_ranks(dp_group))
        self.har: Any = HierarchicalAllReduce(plan, dp_group, top, **(multi_ps or {}))
        self.calls = 0
        self.engine = engine
        self._undo_step: Patch | None = None
        if replanner is not None:
            from flowlane.aleph.replan import confirmed_probe

            # a caller's probe() is used as it is (tests); the real one is confirmed where it moves a rank (E10)
            figures = probe or confirmed_probe(replanner, dp_group, probe_bytes)
            self.har = ReplanningAllReduce(self.har, replanner, figures)
            self._undo_step = after_iteration(engine, self.har.end_iteration, "flowlane.aleph")

        def reduce(tensor: Any, async_op: bool) -> Any:
            self.calls += 1
            self.har(tensor)
            return _Done() if async_op else None

        self._undo = route_dp_all_reduce(cdb, self.ranks, reduce, "flowlane.aleph")

    @property
    def plan(self) -> Plan:
        """The plan in force."""
        return self.har.har.plan if isinstance(self.har, ReplanningAllReduce) else self.har.plan

    @property
    def decisions(self) -> list[tuple[int, bool, str, int]]:
        """(iteration, changed, reason, |D|) of every re-planning point (empty without ``replan_every``)."""
        return list(getattr(self.har, "decisions", []))

    def close(self) -> None:
        """Undo the wraps (refused, changing nothing, while a later install wraps one of them: close that first)."""
        undo_all([w for w in (self._undo, self._undo_step) if w is not None])


def parse_section(ds_config: dict[str, Any]) -> tuple[AlephConfig, dict[str, Any]] | None:
    """``ds_config["flowlane"]["aleph"]`` as (AlephConfig, the section's own keys), or None when absent/disabled.
    Unknown keys are an error naming them and the allowed ones."""
    section = (ds_config.get("flowlane") or {}).get("aleph")
    if section is None:
        return None
    if not isinstance(section, dict):
        raise ValueError(f"flowlane.aleph must be a mapping, got {type(section).__name__}")
    own = {k: section[k] for k in SECTION_KEYS if k in section}
    if not isinstance(own.get("enabled", True), bool):  # "false" is a true string: it would install
        raise ValueError(f"flowlane.aleph.enabled must be true or false, got {own['enabled']!r}")
    if not own.get("enabled", True):  # off: its values are not read, but a misspelt key is still an error
        allowed = set(SECTION_KEYS) | {f.name for f in dataclasses.fields(AlephConfig)}
        if bad := sorted(set(section) - allowed):
            raise ValueError(f"flowlane.aleph: unknown key(s) {bad}; allowed: {sorted(allowed)}")
        return None
    rest = {k: v for k, v in section.items() if k not in SECTION_KEYS}
    rest.setdefault("replan_every", 0)  # off unless asked for (AlephConfig's own default is 100)
    try:
        cfg = AlephConfig.from_dict(rest)
    except ValueError as e:
        raise ValueError(f"flowlane.aleph: {e} (section keys also allowed: {list(SECTION_KEYS)})") from None
    if cfg.cpu_per_member:
        raise ValueError(
            f"flowlane.aleph: cpu_per_member={cfg.cpu_per_member!r}: the plugin has no per-rank CPU figures for it "
            "to limit capacity with; only 0 is allowed"
        )
    if ("bandwidth_gbps" in own) == ("clusters" in own):
        raise ValueError(
            "flowlane.aleph needs exactly one of 'bandwidth_gbps' (one figure per DP rank, planned with "
            "M-WCHA) or 'clusters' (an explicit plan)"
        )
    defaults = AlephConfig()
    if "clusters" in own and (
        idle := sorted(k for k in PLANNER_FIELDS if k in section and getattr(cfg, k) != getattr(defaults, k))
    ):
        raise ValueError(
            f"flowlane.aleph: {idle} set M-WCHA's planning (ps_gbps: its PS check, digest §5.1 #12) from "
            "'bandwidth_gbps', but the plan here is explicit ('clusters'): they would have no effect; give "
            "'bandwidth_gbps' or remove them"
        )
    if not cfg.replan_every:
        idle = sorted(k for k in REPLAN_KEYS if k in section)
        if idle:
            raise ValueError(
                f"flowlane.aleph: {idle} act only with 'replan_every' > 0 (re-planning), which is "
                f"{section.get('replan_every', 0)!r} here: they would have no effect; remove them or set "
                "'replan_every'"
            )
        return cfg, own
    nbytes = own.get("probe_bytes", PROBE_BYTES)
    if not (isinstance(nbytes, int) and not isinstance(nbytes, bool) and nbytes >= 1024):
        raise ValueError(f"flowlane.aleph: probe_bytes={nbytes!r} must be an integer >= 1024")
    why = [
        w
        for w, bad in (
            ("'bandwidth_gbps' (the figures the first plan comes from)", "bandwidth_gbps" not in own),
            (
                "'top': 'ps' (its groups serve any plan; the all-reduce top's subgroup is fixed)",
                cfg.top != "ps",
            ),
            (
                "one PS (no 'ps' / 'split' / 'ps_bandwidths': a new plan's PS is chosen from the figures in use)",
                any(k in own for k in ("ps", "split", "ps_bandwidths")),
            ),
        )
        if bad
    ]
    if why:
        raise ValueError(f"flowlane.aleph: replan_every={cfg.replan_every} needs " + " and ".join(why))
    return cfg, own


def install(
    engine: Any, ds_config: Mapping[str, Any] | str | Path | None, probe: Any = None
) -> AlephDeepSpeed | None:
    """Install ALEPH on ``engine`` from its DeepSpeed config's ``flowlane.aleph`` section (None when absent or
    disabled). The whole ``"flowlane"`` section is checked first
    (:func:`deepspeed_plugin.config.validate_flowlane_section`: a typo in another feature's sub-section is not
    silently ignored), then the DeepSpeed version (:data:`DEEPSPEED_VERSIONS`). ``probe``: with ``replan_every``,
    re-planning's figures (``probe()`` -> one Gbit/s figure per DP rank, the same on every rank), used as it is;
    default: the DP group's confirmed ``probe_bandwidth``."""
    parsed = validate_flowlane_section(ds_config)["aleph"]
    if parsed is None:
        return None
    check_version_range("deepspeed", DEEPSPEED_VERSIONS, "flowlane.aleph")
    cfg, own = parsed
    n = dist.get_world_size(engine.seq_data_parallel_group)
    replanner = None
    if "clusters" in own:
        clusters: Sequence[Sequence[int]] = own["clusters"]
        plan = Plan.from_clusters(sum(len(c) for c in clusters), clusters)
    elif cfg.replan_every:
        replanner = Replanner([float(b) for b in own["bandwidth_gbps"]], cfg)
        plan = replanner.plan
    else:
        plan = plan_clusters(own["bandwidth_gbps"], config=cfg)
    if plan.n != n:
        raise ValueError(f"flowlane.aleph plans {plan.n} ranks but DeepSpeed's data-parallel group has {n}")
    multi = {k: own[k] for k in ("ps", "split", "ps_bandwidths") if k in own}
    # the PS on the head the figures favour
    if cfg.top == "ps" and "ps" not in multi and "bandwidth_gbps" in own:
        multi["ps"] = [ps_head(plan, [float(b) for b in own["bandwidth_gbps"]])]
    return AlephDeepSpeed(engine, plan, cfg.top, multi, replanner, probe, own.get("probe_bytes", PROBE_BYTES))
