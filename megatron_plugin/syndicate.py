"""SYNDICATE's enforcer on Megatron-core's data-parallel gradient all-reduce (seed 004 §5.2; digest §7 "Megatron").

Each dense bucket group's coalesced all-reduce reaches a :class:`flowlane.syndicate.enforcer.Enforcer` through
:mod:`megatron_plugin.dp_collective` (what it refuses is listed there): every bucket is one submitted op, matched to
the plan's op of the same position by signature (all_reduce, element count, dtype), cut into the plan's motifs
(segments of the bucket, each the backend's own all-reduce on a slice), put on its plan path (one process group per
path, a clone of the data-parallel group made at install) and launched in the plan's order, identical on every rank.
The enforcer's handle becomes Megatron's ``grad_reduce_handle``: ``finish_grad_sync`` waits for it. Megatron keeps
its readiness logic and scaling, so results equal Megatron's own run (bitwise on 2 ranks, where a sum of two has one
order; within float tolerance beyond).

The iteration boundary is the end of Megatron's ``config.finalize_model_grads_func`` (wrapped, kept whole: the same
program point on every rank). There the watchdog compares a fingerprint of the iteration's launch sequence and a
rank that launched another one is named (:class:`flowlane.syndicate.enforcer.PlanMismatchError`); at install every
rank's plan digest is compared and differing ranks are named.

With ``overlap_grad_reduce`` Megatron starts each bucket group's reduction as soon as its gradients are final and
waits for all of them in ``finalize_model_grads``, so a plan may order motifs *across* ops (a later bucket's motif
first). In the first iteration Megatron starts and waits for each bucket group in turn inside ``finish_grad_sync``;
a plan that interleaves ops then falls back to FIFO for that iteration, at the same program point on every rank
(recorded in ``enforcer.events``). Without ``overlap_grad_reduce`` that is every iteration, so such a plan is refused
at install. Also refused: plan ops other than all-reduce, ops spanning another number of ranks than the
data-parallel group, and algorithms the enforcer cannot force (``tree``, ``rs_ag``).

With the distributed optimizer every bucket's gradient reduce-scatter is an op (signature: this rank's block), and
so is every bucket's parameter all-gather (``start_param_sync``; signature: this rank's block, the IR's all-gather
payload), unless ``param_gather="passthrough"`` leaves the gathers unshaped on Megatron's own group. Megatron gathers
in the forward pre-hooks (``overlap_param_gather``) or synchronously after the optimizer step (without it, i.e.
after this iteration boundary, so iteration 0 has no gathers and falls back to FIFO at its first reduce-scatter),
and waits for each bucket group's gather before it starts the next: the plan's gathers are its first ops, each one's
motifs launched before any later op's (digest §5 item 9: a host wait point the order must respect). Refused at
install, naming the op: gathers after a reduce-scatter, a gather interleaved with a later op, a plan without gathers
(unless ``passthrough``) or with gathers that are not the buckets' blocks (with the Megatron-LM flags, which attach
each chunk at its first forward step: once the last chunk is attached). A plan whose ops do not match what Megatron
submits at run time falls back to FIFO (logged as a warning, recorded in ``enforcer.events``).

MoE at expert-model-parallel size > 1: the experts' bucket groups get a second enforcer and ``expert_plan``; a
pipeline stage of dense layers only has none, and its expert plan is an empty one (no ops). At EP 1 megatron-core
keeps the experts in the dense bucket groups, so there is no expert plan.

Several data-parallel groups (PP, TP or CP > 1): each group gets its own enforcer, its own path groups (made on
every rank in one order) and its own store namespace, so a group's watchdog compares its own ranks. Each pipeline stage has other
buckets, so each needs its own plan: ``{pp_rank}`` in the plan path is this rank's pipeline stage
(``--syndicate-plan plans/stage{pp_rank}.json``); a path without it is refused when there are several stages.

megatron-core API::

    syn = install(ddp_chunks, SyndicateMegatronConfig(plan="plan.json"), config)  # config: the TransformerConfig
    ... train (config.finalize_model_grads_func set, as Megatron-LM's train() does) ...
    syn.close()

Megatron-LM: ``--syndicate --syndicate-plan plan.json`` (``--syndicate-mode fifo`` runs every op whole and records
the signatures, :attr:`SyndicateMegatron.submitted`, to build a plan from).

From FIFO to a plan: in FIFO mode each enforcer profiles iteration ``profile_iteration`` (the second by default:
:meth:`flowlane.syndicate.enforcer.Enforcer.profile`, each op's signature, ranks, submission and completion time);
:meth:`SyndicateMegatron.write_profile` writes it as JSON (the recipe does, from DP rank 0 of each pipeline stage,
to ``output_dir/syndicate_profile.json`` or ``syndicate_profile_stage{pp_rank}.json``), and the plan search reads it.
"""

from __future__ import annotations

import argparse
import itertools
import logging
import os
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist

from flowlane import configs
from flowlane.configs import add_dataclass_args, config_from_namespace
from flowlane.syndicate.enforcer import Enforcer, EnforcerConfig, Handle, check_dp_gradient_plan
from flowlane.syndicate.plan import PlanError, SyndicatePlan
from megatron_plugin.undo import Patch, check_all, undo_all

log = logging.getLogger("flowlane.syndicate")

#: installs in this process: each gets its own store namespace (installs are collective, so ranks agree)
_INSTALLS = itertools.count()


@dataclass(frozen=True)
class SyndicateMegatronConfig:
    """SYNDICATE on Megatron-core's DP collectives (the all-reduce; the distributed optimizer's reduce-scatter and
    parameter all-gather)."""

    plan: str = ""
    """Path of a plan JSON (``SyndicatePlan.to_json``); empty only with mode ``fifo``. ``{pp_rank}`` in it is this
    rank's pipeline stage (required with several stages: their buckets differ)."""
    expert_plan: str = ""
    """MoE: the plan for the experts' bucket groups (reduced over the expert-data-parallel group), as ``plan``."""
    mode: Literal["plan", "fifo"] = "plan"
    """``plan``: the plan's motifs, paths and order; ``fifo``: every op whole, at submission (the baseline)."""
    param_gather: Literal["plan", "passthrough"] = "plan"
    """With the distributed optimizer: ``plan`` makes the parameters' all-gathers plan ops (kind all_gather, the
    plan's first ops, recorded in FIFO mode); ``passthrough`` sends them unshaped to Megatron's own group (the plan
    then has none)."""
    check_every: int = 1
    """Compare the iteration's launch sequence across ranks every this many iterations (0: never)."""
    timeout_s: float = 60.0
    """How long the watchdog waits for the other ranks before naming the missing ones."""
    profile_iteration: int = 1
    """FIFO mode: the iteration each enforcer profiles for the plan search (``write_profile``); -1: none. The
    signatures (``submitted``) are kept for iterations 0 to this one only (none at -1), bounded in a long job."""

    def __post_init__(self) -> None:
        # names a bad mode / check_every / timeout / profile_iteration
        EnforcerConfig(self.mode, self.check_every, self.timeout_s, profile_iteration=self.profile_iteration)
        if self.param_gather not in ("plan", "passthrough"):
            raise ValueError(
                f"syndicate param_gather {self.param_gather!r} is not one of ['passthrough', 'plan']"
            )

    def load_plan(self, pp_rank: int = 0, pp_size: int = 1, expert: bool = False) -> SyndicatePlan | None:
        """This pipeline stage's plan, or with ``expert`` its experts' plan (None in FIFO mode without one)."""
        field = "expert_plan" if expert else "plan"
        path = getattr(self, field)
        if not path:
            if self.mode == "plan":
                raise ValueError(
                    f'syndicate {field} is required with mode "plan" (or set mode "fifo")'
                    + (
                        ": the model has experts (MoE) at expert-model-parallel size > 1, whose bucket groups "
                        "need their own plan"
                        if expert
                        else ""
                    )
                )
            return None
        if pp_size > 1 and "{pp_rank}" not in path:
            raise ValueError(
                f"syndicate {field}={path!r}: with {pp_size} pipeline stages each stage's buckets need their own "
                "plan; put {pp_rank} in the path (e.g. plans/stage{pp_rank}.json)"
            )
        p = Path(path.replace("{pp_rank}", str(pp_rank)))
        if not p.is_file():
            raise ValueError(f"syndicate {field}: no plan file at {str(p)!r}")
        return SyndicatePlan.from_json(p.read_text())


def check_plan_for_megatron(
    plan: SyndicatePlan,
    dp_size: int,
    overlap_grad_reduce: bool,
    distributed_optimizer: bool = False,
    param_gather: str = "plan",
) -> None:
    """Refuse what cannot run on Megatron-core's DP path (see the module docstring), naming the op: its ops are the
    buckets' all-reduces, or with the distributed optimizer the parameters' all-gathers (``param_gather="plan"``)
    then the gradients' reduce-scatters."""
    gathers = [i for i, op in enumerate(plan.ops) if op.kind == "all_gather"]
    if distributed_optimizer and param_gather == "passthrough" and gathers:
        i = gathers[0]
        raise PlanError(
            f"plan v{plan.version} op {i} ({plan.ops[i].name!r}) is 'all_gather', but param_gather='passthrough' "
            "sends the parameters' all-gathers to Megatron's own group unshaped (set param_gather='plan' to shape "
            "them)"
        )
    # a plan without ops is the expert plan of a pipeline stage of dense layers only (no expert buckets); whether a
    # plan's gathers are exactly the buckets' is checked once the chunks are attached (check_gathers_match_buckets)
    if distributed_optimizer and param_gather == "plan" and not gathers and plan.ops:
        raise PlanError(
            f"plan v{plan.version} has no 'all_gather' op, but with the distributed optimizer and "
            "param_gather='plan' the parameters' all-gathers are plan ops: add them (FIFO mode records their "
            "signatures) or set param_gather='passthrough' (--syndicate-param-gather passthrough) to leave them "
            "unshaped on Megatron's own group"
        )
    check_dp_gradient_plan(
        plan,
        dp_size,
        "Megatron" + (" with the distributed optimizer" if distributed_optimizer else ""),
        None
        if overlap_grad_reduce
        else "overlap_grad_reduce=False: Megatron then waits for each bucket group before it starts the next "
        "(add --overlap-grad-reduce to interleave them)",
        "reduce_scatter" if distributed_optimizer else "all_reduce",
        "Megatron waits for each bucket group's parameter all-gather before it starts the next one (the forward "
        "pre-hooks with overlap_param_gather, a synchronous call after the optimizer step without)"
        if distributed_optimizer and param_gather == "plan"
        else None,
    )


def check_gathers_match_buckets(
    plan: SyndicatePlan,
    chunks: Sequence[torch.nn.Module],
    dp_size: int,
    expert: bool = False,
    complete: bool = True,
) -> None:
    """Refuse a plan whose all-gather ops are not the chunks' parameter buckets (one op per bucket: this rank's
    block of its ``param_data``, its dtype): a gather the plan lacks would push every later op off its place.
    ``complete``: ``chunks`` are all the model's chunks (the plan's gathers must be exactly theirs); else the chunks
    attached so far (their buckets must be among the plan's gathers)."""
    have = Counter(
        (b.param_data.numel() // dp_size, str(b.param_data.dtype).removeprefix("torch."))
        for c in chunks
        for bg in (c.expert_parallel_bucket_groups if expert else c.bucket_groups)
        for b in bg.buckets
    )
    want = Counter((op.numel, op.dtype) for op in plan.ops if op.kind == "all_gather")
    missing, extra = sorted((have - want).elements()), sorted((want - have).elements())
    if missing or (complete and extra):
        raise PlanError(
            f"plan v{plan.version}'s all-gather ops are not the {'expert ' if expert else ''}parameter buckets' "
            f"blocks (one op per bucket; FIFO mode records them): buckets (numel, dtype) without an op {missing}"
            + (f", ops without a bucket {extra}" if complete else "")
        )


class _Handles:
    def __init__(self, handles: list[Handle]) -> None:
        self.handles = handles

    def wait(self) -> bool:
        for h in self.handles:
            h.wait()
        return True


class _SyndicateComponent:
    """The DP component: each bucket of a coalesced call is one op submitted to the enforcer."""

    def __init__(self, enforcer: Enforcer) -> None:
        self.enforcer = enforcer
        self.submitted: list[tuple[int, str, int, str]] = []

    def _record(self, kind: str, numel: int, t: torch.Tensor) -> None:
        # iterations 0..profile_iteration only: a row per op per step would grow for as long as the job runs
        last = self.enforcer.config.profile_iteration
        if last is not None and self.enforcer.iteration <= last:
            self.submitted.append((self.enforcer.iteration, kind, numel, str(t.dtype).removeprefix("torch.")))

    def all_reduce(self, tensors: list[torch.Tensor]) -> _Handles:
        out = []
        for t in tensors:
            self._record("all_reduce", t.numel(), t)
            out.append(self.enforcer.all_reduce(t))
        return _Handles(out)

    def reduce_scatter(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor]) -> _Handles:
        """The distributed optimizer's buckets: each one op, cut into segments of this rank's block."""
        out = []
        for o, x in zip(outputs, inputs, strict=True):
            self._record("reduce_scatter", o.numel(), x)
            out.append(self.enforcer.reduce_scatter_tensor(o, x))
        return _Handles(out)

    def all_gather(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor]) -> _Handles:
        """The distributed optimizer's parameter buckets (``param_gather="plan"``): each one op, its signature this
        rank's block (the IR's all-gather payload), cut into segments of the block."""
        out = []
        for o, x in zip(outputs, inputs, strict=True):
            self._record("all_gather", x.numel(), x)
            out.append(self.enforcer.all_gather_into_tensor(o, x))
        return _Handles(out)


class _Lane:
    """One kind of bucket group (dense, or the experts' with MoE): its DP collective, enforcer, plan and component."""

    def __init__(
        self,
        config: SyndicateMegatronConfig,
        plan: SyndicatePlan | None,
        mine: dist.ProcessGroup,
        store: Any,
        namespace: str,
        overlap_grad_reduce: bool,
        distributed_optimizer: bool,
        expert: bool,
    ) -> None:
        from megatron_plugin.dp_collective import DPCollective

        self.plan, self.expert = plan, expert
        self.enforcer: Enforcer | None = None
        self.chunks: list[torch.nn.Module] = []
        # every rank makes every group's path groups, in one order (NCCL splits them from the world's communicator,
        # which every rank must join): each rank says which paths its own plan uses
        names = sorted({op.option.path for op in plan.ops}) if plan is not None else ["default"]
        names_of: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(names_of, names)

        def make(group: dist.ProcessGroup | None, ranks: tuple[int, ...]) -> _SyndicateComponent | None:
            # one clone of the DP group per path of its plan (its first rank's; the digest check compares the rest)
            paths = {name: dist.new_group(list(ranks)) for name in names_of[ranks[0]]}
            if group is None:  # another data-parallel group's
                return None
            if plan is not None:
                check_plan_for_megatron(
                    plan, len(ranks), overlap_grad_reduce, distributed_optimizer, config.param_gather
                )
            enforcer = Enforcer(
                paths,
                store,
                dist.get_rank(group),
                len(ranks),
                EnforcerConfig(
                    config.mode,
                    config.check_every,
                    config.timeout_s,
                    f"{namespace}/{'-'.join(map(str, ranks))}",
                    profile_iteration=config.profile_iteration,
                ),
            )
            # compares the plan's digest on the group's ranks; names the ones that differ
            enforcer.install(plan)
            self.enforcer = enforcer
            return _SyndicateComponent(enforcer)

        self.param_gather = distributed_optimizer and config.param_gather == "plan"
        self.dp = DPCollective(
            mine, make, "flowlane.syndicate", expert=expert, param_gather=self.param_gather
        )
        self.component: _SyndicateComponent = self.dp.component  # type: ignore[assignment]


class SyndicateMegatron:
    """The enforcer for Megatron-core's data-parallel groups: construct it on every rank (a collective: path groups,
    the plan digest check), then :meth:`attach` the DDP chunks and :meth:`attach_finalize` the model config (both
    local). With ``expert_dp_group`` (MoE) the experts' bucket groups get their own enforcer and ``expert_plan``.
    :meth:`close` undoes it."""

    def __init__(
        self,
        config: SyndicateMegatronConfig,
        dp_group: dist.ProcessGroup,
        overlap_grad_reduce: bool = True,
        store: Any = None,
        distributed_optimizer: bool = False,
        expert_dp_group: dist.ProcessGroup | None = None,
    ) -> None:
        from megatron.core import parallel_state as ps

        stage = (ps.get_pipeline_model_parallel_rank(), ps.get_pipeline_model_parallel_world_size())
        plan = config.load_plan(*stage)
        expert_plan = config.load_plan(*stage, expert=True) if expert_dp_group is not None else None
        if expert_dp_group is None and config.expert_plan:
            raise ValueError(
                f"syndicate expert_plan={config.expert_plan!r} is set but the model has no expert bucket groups (no "
                "experts, or expert-model-parallel size 1, where megatron-core reduces the experts with the dense "
                "bucket groups over the data-parallel group); leave it out"
            )
        if store is None:
            try:  # torch.distributed's own store (every rank has it after init_process_group)
                from torch.distributed.distributed_c10d import _get_default_store  # noqa: PLC0415
            except ImportError:
                raise RuntimeError(
                    "flowlane.syndicate: this torch has no default store to share; pass store=..."
                ) from None
            store = _get_default_store()
        namespace = f"flowlane-mcore-syndicate/{next(_INSTALLS)}"
        flags = (overlap_grad_reduce, distributed_optimizer)
        self._lane = _Lane(config, plan, dp_group, store, namespace, *flags, expert=False)
        self._expert = (
            _Lane(config, expert_plan, expert_dp_group, store, f"{namespace}/expert", *flags, expert=True)
            if expert_dp_group is not None
            else None
        )
        self.enforcer = self._lane.enforcer
        self.expert_enforcer = self._expert.enforcer if self._expert is not None else None
        self.component = self._lane.component
        self.config, self.plan, self.expert_plan = config, plan, expert_plan
        self._distributed_optimizer = distributed_optimizer
        self._undo_finalize: list[Patch] = []

    def attach(self, model_chunks: Sequence[torch.nn.Module]) -> None:
        """Route the chunks' bucket groups (dense, and expert with MoE) through the enforcers (local; before their
        first backward)."""
        from megatron_plugin.dp_collective import check_chunks, check_expert_setup

        chunks = list(model_chunks)
        if not chunks:
            raise ValueError("flowlane.syndicate: no model chunks given")
        check_expert_setup(chunks, self._expert is not None, "flowlane.syndicate")
        dist_opt = _distributed_optimizer(chunks)
        # the groups route the parameters' gathers by the setup's flag
        if dist_opt != self._distributed_optimizer:
            raise ValueError(
                f"flowlane.syndicate: set up with distributed_optimizer={self._distributed_optimizer}, but the "
                f"chunks have use_distributed_optimizer={dist_opt}"
            )
        for lane in (self._lane, self._expert):
            if lane is None:
                continue
            if lane.plan is not None:
                check_chunks(chunks, "flowlane.syndicate", lane.expert)
                overlap = all(c.ddp_config.overlap_grad_reduce for c in chunks)
                check_plan_for_megatron(
                    lane.plan, len(lane.dp.ranks), overlap, dist_opt, self.config.param_gather
                )
                if lane.param_gather:  # every chunk attached so far (Megatron-LM attaches them one by one)
                    lane.chunks += chunks
                    check_gathers_match_buckets(
                        lane.plan, lane.chunks, len(lane.dp.ranks), lane.expert, complete=False
                    )
            n = lane.dp.attach(chunks)
            log.info(
                "flowlane.syndicate: enforcer on %d Megatron-core DDP %sbucket group(s) (mode %s, plan %s)",
                n,
                "expert " if lane.expert else "",
                self.config.mode,
                f"v{lane.plan.version}" if lane.plan is not None else "none",
            )

    def check_all_attached(self) -> None:
        """Every model chunk is attached: refuse a plan whose parameter all-gathers are not exactly the attached
        chunks' buckets (:func:`check_gathers_match_buckets`), naming the difference; it would otherwise fall back to
        FIFO every iteration."""
        for lane in (self._lane, self._expert):
            if lane is not None and lane.param_gather and lane.plan is not None:
                check_gathers_match_buckets(lane.plan, lane.chunks, len(lane.dp.ranks), lane.expert)

    def attach_finalize(self, model_config: Any) -> None:
        """End the enforcers' iteration after Megatron's ``model_config.finalize_model_grads_func`` (kept whole)."""
        from megatron_plugin.dp_collective import after_finalize

        enforcers = [e for e in (self.enforcer, self.expert_enforcer) if e is not None]

        def step() -> None:
            for enforcer in enforcers:
                enforcer.step()

        self._undo_finalize.append(after_finalize(model_config, step, "flowlane.syndicate"))

    @property
    def submitted(self) -> list[tuple[int, str, int, str]]:
        """(iteration, kind, numel, dtype) of every op routed through the enforcer in iterations 0 to
        ``config.profile_iteration`` (none at -1; later ones are not kept): the plan's signatures."""
        return list(self.component.submitted) if self.component is not None else []

    @property
    def expert_submitted(self) -> list[tuple[int, str, int, str]]:
        """The same for the experts' bucket groups (MoE): the expert plan's signatures."""
        return list(self._expert.component.submitted) if self._expert is not None else []

    def write_profile(self, path: str | os.PathLike[str]) -> list[Path]:
        """Write each enforcer's profile (FIFO mode; :meth:`flowlane.syndicate.enforcer.Enforcer.profile`, the
        format is :data:`flowlane.syndicate.enforcer.PROFILE_FORMAT`) as JSON with a ``provenance`` envelope,
        atomically: the dense bucket groups' to ``path``, and with MoE's expert enforcer the experts' to
        ``<stem>_expert<suffix>`` beside it (one file per enforcer: each is planned on its own, as ``plan`` and
        ``expert_plan``). Local: call it on one rank of each data-parallel group (every rank of a group records the
        same ops). Refused, writing nothing, while an enforcer has no profile (naming why). Returns the paths."""
        from flowlane.testing.provenance import write_result

        out = Path(path)
        lanes = [(self.enforcer, out)]
        if self._expert is not None:
            lanes.append((self.expert_enforcer, out.with_name(f"{out.stem}_expert{out.suffix}")))
        docs = []
        for enforcer, where in lanes:
            prof = enforcer.profile() if enforcer is not None else None
            if prof is None:
                why = enforcer.why_no_profile() if enforcer is not None else "no enforcer on this rank"
                raise ValueError(f"flowlane.syndicate: no profile to write to {str(where)!r}: {why}")
            docs.append((where, prof))
        return [write_result(where, prof) for where, prof in docs]

    @property
    def calls(self) -> int:
        return self._lane.dp.calls

    @property
    def expert_calls(self) -> int:
        """The expert bucket groups' reductions carried (MoE)."""
        return self._expert.dp.calls if self._expert is not None else 0

    @property
    def gathers(self) -> int:
        """Coalesced parameter all-gathers (distributed optimizer): through the enforcer with ``param_gather="plan"``,
        else passed through to Megatron's own group."""
        return self._lane.dp.gathers

    @property
    def expert_gathers(self) -> int:
        """The same for the experts' bucket groups (MoE)."""
        return self._expert.dp.gathers if self._expert is not None else 0

    def close(self) -> None:
        """Put Megatron's groups and ``finalize_model_grads_func`` back and stop the enforcers; refused, changing
        nothing, while a feature installed after SYNDICATE wraps one of them again (:mod:`megatron_plugin.undo`). A
        second close does nothing."""
        lanes = [lane for lane in (self._expert, self._lane) if lane is not None]
        for lane in lanes:
            lane.dp.check_removable()
        check_all(self._undo_finalize)
        for lane in lanes:
            lane.dp.remove()
        undo_all(self._undo_finalize)
        for enforcer in (self.enforcer, self.expert_enforcer):
            if enforcer is not None:
                enforcer.close()


def _distributed_optimizer(chunks: Sequence[torch.nn.Module]) -> bool:
    """Whether the chunks reduce-scatter (distributed optimizer); chunks that differ are refused."""
    kinds = {bool(c.ddp_config.use_distributed_optimizer) for c in chunks}  # type: ignore[union-attr]
    if len(kinds) > 1:
        raise ValueError(
            "flowlane.syndicate: some model chunks use the distributed optimizer and some do not; one plan cannot "
            "hold both all-reduces and reduce-scatters"
        )
    return kinds.pop()


def install(
    model_chunks: Sequence[torch.nn.Module],
    config: SyndicateMegatronConfig,
    model_config: Any,
    store: Any = None,
) -> SyndicateMegatron:
    """Put the enforcer on every dense bucket group of ``model_chunks`` (Megatron-core DDP); ``model_config`` is
    the chunks' TransformerConfig, whose ``finalize_model_grads_func`` ends each iteration. A collective: every
    rank, after the DDP wrap and before the first backward."""
    from megatron_plugin.dp_collective import FINALIZE_UNSET, groups_of

    chunks = list(model_chunks)
    dp_group, expert_dp_group = groups_of(chunks, "flowlane.syndicate")  # refuse before anything is created
    if getattr(model_config, "finalize_model_grads_func", None) is None:
        raise ValueError(f"flowlane.syndicate: {FINALIZE_UNSET}")
    overlap = all(c.ddp_config.overlap_grad_reduce for c in chunks)
    syn = SyndicateMegatron(config, dp_group, overlap, store, _distributed_optimizer(chunks), expert_dp_group)
    try:
        syn.attach(chunks)
        syn.check_all_attached()  # every chunk is here: the plan's gathers must be exactly theirs
    except BaseException:
        syn.close()
        raise
    syn.attach_finalize(model_config)
    return syn


def config_from_group(group: dict[str, Any]) -> SyndicateMegatronConfig:
    """The recipe's ``dp_collective=syndicate`` group (Hydra; ``name`` plus the config's fields) as the config; unknown
    keys and bad values are named."""
    return configs.config_from_group(SyndicateMegatronConfig, group, "dp_collective=syndicate")


def install_from_config(group: dict[str, Any], ctx: Any) -> Any:
    """Called by the recipe's train loop on every rank (a collective) after Megatron-core's DDP wrap, with
    ``ctx.model`` (the DDP chunk) and ``ctx.config`` (its TransformerConfig, ``finalize_model_grads_func`` set)."""
    return install([ctx.model], config_from_group(group), ctx.config)


# -- launch flags ------------------------------------------------------------------------------------------------------
def check_profile_out(path: str, cfg: SyndicateMegatronConfig, pp_size: int) -> None:
    """Refuse a profile path that cannot apply: plan mode records nothing, ``profile_iteration=-1`` turns recording
    off, and with several pipeline stages each needs its own file (``{pp_rank}`` in the path, as the plan's)."""
    enf = EnforcerConfig(cfg.mode, profile_iteration=cfg.profile_iteration)
    if why := enf.why_nothing_recorded():
        raise ValueError(
            f"--syndicate-profile-out={path!r}: {why} (--syndicate-mode {cfg.mode}, --syndicate-profile-iteration "
            f"{cfg.profile_iteration})"
        )
    if pp_size > 1 and "{pp_rank}" not in path:
        raise ValueError(
            f"--syndicate-profile-out={path!r}: with {pp_size} pipeline stages each stage records its own buckets; "
            "put {pp_rank} in the path (e.g. out/syndicate_profile_stage{pp_rank}.json)"
        )


def write_stage_profile(feature: SyndicateMegatron, path: str) -> list[Path]:
    """On data-parallel rank 0 (tensor-parallel rank 0) of each pipeline stage, :meth:`SyndicateMegatron.write_profile`
    to ``path`` with ``{pp_rank}`` replaced by the stage; nothing on the other ranks (every rank of a DP group
    records the same ops). Returns the paths written here."""
    from megatron.core import parallel_state as ps

    if ps.get_data_parallel_rank() != 0 or ps.get_tensor_model_parallel_rank() != 0:
        return []
    return feature.write_profile(path.replace("{pp_rank}", str(ps.get_pipeline_model_parallel_rank())))


def add_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``--syndicate``, one ``--syndicate-<field>`` flag per :class:`SyndicateMegatronConfig` field, and
    ``--syndicate-profile-out``."""
    g = parser.add_argument_group("flowlane syndicate", "SYNDICATE motifs and launch order (seed 004)")
    g.add_argument(
        "--syndicate",
        action="store_true",
        help="cut Megatron-core DDP's gradient all-reduces into a plan's motifs, launched in its order",
    )
    add_dataclass_args(g, SyndicateMegatronConfig, "syndicate-")
    g.add_argument(
        "--syndicate-profile-out",
        default="",
        help="FIFO mode: where the recorded iteration's profile is written at the end of training (DP rank 0 of "
        "each stage; {pp_rank} in the path is the stage), the input of `flowlane syndicate-plan`",
    )
    return parser


def config_from_args(args: argparse.Namespace) -> SyndicateMegatronConfig | None:
    """The config the flags give, or None without ``--syndicate``."""
    if not getattr(args, "syndicate", False):
        return None
    cfg: SyndicateMegatronConfig = config_from_namespace(SyndicateMegatronConfig, args, "syndicate_")
    from megatron_plugin.dp_collective import expert_parallel

    cfg.load_plan()  # a missing plan or file is named before training
    if expert_parallel(args):  # at EP 1 the experts are in the dense bucket groups: no expert plan
        cfg.load_plan(expert=True)
    return cfg
