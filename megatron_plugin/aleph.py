"""ALEPH's hierarchical all-reduce on Megatron-core's data-parallel gradient path (seed 002; digest §5.4 tier 0, §6).

Every dense bucket group of Megatron-core's ``DistributedDataParallel`` reduces through
:class:`flowlane.aleph.hook.HierarchicalAllReduce` (members -> aggregator stars, the aggregators' all-reduce or a
PS-rooted tree, results back), planned from :class:`flowlane.aleph.AlephConfig` with M-WCHA over one bandwidth figure
per data-parallel rank, or given as explicit clusters. Megatron keeps its readiness logic, its scaling (it
multiplies by 1/DP before the sum) and ``finish_grad_sync``: only the collective changes hands, through
:mod:`megatron_plugin.dp_collective` (what it refuses is listed there). The hierarchy runs synchronously when
Megatron starts the bucket group's reduction (no overlap between bucket groups, as with the DDP comm hook). With the
distributed optimizer each bucket's reduce-scatter goes up the hierarchy whole and comes back as blocks (a member gets
its own; :meth:`flowlane.aleph.hook.HierarchicalAllReduce.reduce_scatter`); the parameters' all-gather is Megatron's
own.

Also refused here: a plan whose size is not the data-parallel group's, and ``top="allreduce"`` with a hierarchical
plan when there are several data-parallel groups (PP, TP or CP > 1): the aggregators' subgroup is made with
``new_group`` by every rank of the world, which only one data-parallel group can do consistently; ``top="ps"``
makes its groups (one per direction) for every data-parallel group on every rank in one order (NCCL splits them from
the world's communicator, which every rank must join), so it runs on any layout. ``replan_every`` with the default
probe is refused on a data-parallel group whose backend is not gloo (the probe times CPU tensors on the host:
:func:`flowlane.aleph.probe.check_probe_backend`), and ``hysteresis`` / ``probe_bytes`` without ``replan_every``.

megatron-core API::

    aleph = install(ddp_chunks, AlephMegatronConfig(bandwidth_gbps="30,20,20,10"))   # or clusters="0,2;1;3"
    ... train ...
    aleph.close()

Megatron-LM: ``--aleph --aleph-bandwidth-gbps 30,20,20,10`` (or ``--aleph-clusters "0,2;1;3"``) and the planner's
``--aleph-<field>`` flags, through :mod:`megatron_plugin.megatron_lm`.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist

from flowlane import configs
from flowlane.aleph import AlephConfig, Plan, plan_clusters
from flowlane.aleph.config import PLANNER_FIELDS, PROBE_BYTES
from flowlane.aleph.model import ps_head
from flowlane.configs import add_dataclass_args, config_from_namespace
from megatron_plugin.undo import Patch, check_all, undo_all

log = logging.getLogger("flowlane.aleph")


@dataclass(frozen=True)
class AlephMegatronConfig:
    """ALEPH on Megatron-core's DP all-reduce: the plan's source and :class:`flowlane.aleph.AlephConfig`'s planner
    knobs, and re-planning from probed bandwidth (``replan_every``)."""

    bandwidth_gbps: str = ""
    """Comma-separated Gbit/s, one per data-parallel rank (in group order): the plan is made with M-WCHA."""
    clusters: str = ""
    """An explicit plan instead: clusters separated by ';', members by ',', aggregator first ("0,2;1;3")."""
    expert_bandwidth_gbps: str = ""
    """MoE: the expert-data-parallel group's figures (one per rank in that group), for the experts' bucket groups."""
    expert_clusters: str = ""
    """MoE: an explicit plan over the expert-data-parallel group instead."""
    variant: Literal["paper", "fill"] = "fill"
    """M-WCHA's member assignment (AlephConfig.variant)."""
    seed: int = 0
    """Seed of the planner's random choices (AlephConfig.seed)."""
    b_gbps: float = 0.0
    """Bandwidth one aggregation flow needs (AlephConfig.b_gbps); 0 = the slowest rank's."""
    cpu_per_member: float = 0.0
    """CPU one aggregated member costs (AlephConfig.cpu_per_member); only 0 (CPU does not limit capacity): the plugin
    has no per-rank CPU figures, so a nonzero value is refused."""
    max_empty_rounds: int = 5
    """Rounds without a selected aggregator before the rest go straight to the top (AlephConfig.max_empty_rounds)."""
    ps_gbps: float = 0.0
    """Top-tier (PS) Gbit/s P for the check |D|*b <= P (AlephConfig.ps_gbps; 0 = no check): where it fails, b is
    lowered to P/|D| and the plan re-made with bigger clusters, fewer flows into the top. Needs bandwidth figures."""
    top: Literal["allreduce", "ps"] = "allreduce"
    """Top tier: ``allreduce`` among the aggregators, or ``ps`` (a tree rooted at one aggregator: with bandwidth
    figures the one with the most spare bandwidth for the PS's flows, :func:`flowlane.aleph.model.ps_head`; with
    explicit clusters the first)."""
    chunk_bytes: int = 256 << 10
    """``top="ps"``: the tree's pipelining chunk in bytes (>= 1024)."""
    ps: str = ""
    """``top="ps"``, dense groups: the PSs' positions in the data-parallel group, comma-separated (each an aggregator;
    empty: one, :func:`flowlane.aleph.model.ps_head` with figures, else the first aggregator). Several PSs each sum a
    part of every bucket (digest §2.9)."""
    split: str = ""
    """With several PSs: ``equal``, or one fraction per PS (comma-separated, summing to 1); empty: proportional to
    ``ps_bandwidths_gbps``."""
    ps_bandwidths_gbps: str = ""
    """With several PSs and no ``split``: each PS's Gbit/s, comma-separated (the split is proportional)."""
    replan_every: int = 0
    """Every this many iterations, probe the data-parallel group's bandwidth (timed transfers) and re-plan with
    hysteresis (digest §5.1 #13, E10); 0 = the plan is fixed at install. Needs ``bandwidth_gbps`` (the figures the
    first plan comes from) and ``top="ps"`` with one PS (a new plan's PS is its ``ps_head`` under the figures in
    use); dense groups only. The default probe runs on gloo only: refused at install on another backend."""
    hysteresis: float = 0.2
    """Re-planning: a rank's figure changes only when it moves by more than this fraction (AlephConfig.hysteresis)."""
    probe_bytes: int = PROBE_BYTES
    """Re-planning: bytes of each timed transfer of the bandwidth probe (>= 1024)."""

    def __post_init__(self) -> None:
        for prefix in ("", "expert_"):
            if getattr(self, f"{prefix}bandwidth_gbps") and getattr(self, f"{prefix}clusters"):
                raise ValueError(self._one_source(prefix))
        if not (isinstance(self.chunk_bytes, int) and self.chunk_bytes >= 1024):
            raise ValueError(f"aleph chunk_bytes={self.chunk_bytes!r} must be an integer >= 1024")
        self.aleph_config()  # validates the planner's fields
        if self.cpu_per_member:
            raise ValueError(
                f"aleph cpu_per_member={self.cpu_per_member!r} (--aleph-cpu-per-member): the plugin has no per-rank "
                "CPU figures for it to limit capacity with; only 0 is allowed"
            )
        explicit = (self.clusters or self.expert_clusters) and not (
            self.bandwidth_gbps or self.expert_bandwidth_gbps
        )
        if explicit:  # every plan given: nothing is planned
            idle = [
                f"{f.name}={getattr(self, f.name)!r} (--aleph-{f.name.replace('_', '-')})"
                for f in dataclasses.fields(self)
                if f.name in PLANNER_FIELDS and getattr(self, f.name) != f.default
            ]
            if idle:
                raise ValueError(
                    f"aleph {', '.join(idle)}: M-WCHA's settings act only on a plan made from bandwidth figures, "
                    "but every plan here is explicit (clusters): give bandwidth_gbps or leave them at their defaults"
                )
        self._parse("")  # validates the numbers
        self._parse("expert_")
        if (self.ps or self.split or self.ps_bandwidths_gbps) and self.top != "ps":
            raise ValueError(
                f"aleph ps={self.ps!r}, split={self.split!r}, ps_bandwidths_gbps={self.ps_bandwidths_gbps!r} apply "
                f"to top='ps' only, not top={self.top!r}"
            )
        self.multi_ps()  # validates the formats (the plan checks positions and fractions)
        if not (isinstance(self.probe_bytes, int) and self.probe_bytes >= 1024):
            raise ValueError(f"aleph probe_bytes={self.probe_bytes!r} must be an integer >= 1024")
        if not self.replan_every:  # re-planning's own knobs would do nothing (DeepSpeed's REPLAN_KEYS alike)
            idle = [
                f"{f.name}={getattr(self, f.name)!r} (--aleph-{f.name.replace('_', '-')})"
                for f in dataclasses.fields(self)
                if f.name in ("hysteresis", "probe_bytes") and getattr(self, f.name) != f.default
            ]
            if idle:
                raise ValueError(
                    f"aleph {', '.join(idle)} act only with replan_every > 0 (--aleph-replan-every), which is 0 "
                    "here: they would have no effect; remove them or set replan_every"
                )
        else:
            why = [
                w
                for w, bad in (
                    ("bandwidth_gbps (the figures the first plan comes from)", not self.bandwidth_gbps),
                    (
                        "top='ps' (its groups serve any plan; the all-reduce top's subgroup is fixed)",
                        self.top != "ps",
                    ),
                    (
                        "one PS (no ps / split: a new plan's PS is chosen from the figures in use)",
                        bool(self.ps or self.split),
                    ),
                )
                if bad
            ]
            if why:
                raise ValueError(f"aleph replan_every={self.replan_every} needs " + " and ".join(why))

    def multi_ps(self) -> dict[str, Any]:
        """``HierarchicalAllReduce``'s ``ps`` / ``split`` / ``ps_bandwidths`` keywords from the PS fields."""
        out: dict[str, Any] = {}
        for field, key, kind in (
            ("ps", "ps", int),
            ("split", "split", float),
            ("ps_bandwidths_gbps", "ps_bandwidths", float),
        ):
            text = getattr(self, field)
            if not text:
                continue
            if field == "split" and text == "equal":
                out[key] = "equal"
                continue
            try:
                out[key] = [kind(x) for x in text.split(",")]
            except ValueError:
                raise ValueError(
                    f"aleph {field}={text!r} is not comma-separated "
                    + ("integers" if kind is int else "numbers")
                    + (" or 'equal'" if field == "split" else "")
                ) from None
        return out

    @property
    def has_expert_plan(self) -> bool:
        """Whether a plan source for the experts' bucket groups (MoE) is given."""
        return bool(self.expert_bandwidth_gbps or self.expert_clusters)

    def aleph_config(self) -> AlephConfig:
        return AlephConfig(
            variant=self.variant,
            seed=self.seed,
            b_gbps=self.b_gbps or None,
            cpu_per_member=self.cpu_per_member,
            max_empty_rounds=self.max_empty_rounds,
            ps_gbps=self.ps_gbps or None,
            replan_every=self.replan_every,
            hysteresis=self.hysteresis,
            top=self.top,
        )

    def _one_source(self, prefix: str) -> str:
        bw, cl = f"{prefix}bandwidth_gbps", f"{prefix}clusters"
        return (
            f"aleph needs exactly one of {bw} (one figure per {'expert-' if prefix else ''}DP rank, planned with "
            f"M-WCHA) or {cl} (an explicit plan); got {bw}={getattr(self, bw)!r}, {cl}={getattr(self, cl)!r}"
        )

    def _parse(self, prefix: str) -> list[float] | list[list[int]]:
        bw, cl = getattr(self, f"{prefix}bandwidth_gbps"), getattr(self, f"{prefix}clusters")
        if not (bw or cl):
            return []
        try:
            if bw:
                return [float(x) for x in bw.split(",")]
            return [[int(x) for x in c.split(",")] for c in cl.split(";")]
        except ValueError:
            field = f"{prefix}bandwidth_gbps" if bw else f"{prefix}clusters"
            raise ValueError(
                f"aleph {field}={getattr(self, field)!r} is not "
                + ("comma-separated numbers" if bw else "';'-separated lists of ',' ranks")
            ) from None

    def figures(self, expert: bool = False) -> list[float]:
        """The bandwidth figures the plan is made from (empty with explicit clusters)."""
        bw = getattr(self, f"{'expert_' if expert else ''}bandwidth_gbps")
        return [float(x) for x in bw.split(",")] if bw else []

    def plan(self, n: int, expert: bool = False) -> Plan:
        """The plan over ``n`` data-parallel ranks (``expert``: the expert-data-parallel group's); raises naming the
        size when it covers another number."""
        prefix = "expert_" if expert else ""
        bw, cl = getattr(self, f"{prefix}bandwidth_gbps"), getattr(self, f"{prefix}clusters")
        group = "expert-data-parallel" if expert else "data-parallel"
        if not (bw or cl):
            raise ValueError(self._one_source(prefix))
        parsed = self._parse(prefix)
        if bw:
            if len(parsed) != n:
                raise ValueError(
                    f"aleph {prefix}bandwidth_gbps={bw!r} has {len(parsed)} figures; the {group} group has {n} "
                    "ranks (one figure each)"
                )
            return plan_clusters(parsed, config=self.aleph_config())  # type: ignore[arg-type]
        size = sum(len(c) for c in parsed)  # type: ignore[misc]
        if size != n:
            raise ValueError(f"aleph {prefix}clusters={cl!r} cover {size} ranks; the {group} group has {n}")
        return Plan.from_clusters(n, parsed)  # type: ignore[arg-type]


def replan_parts(config: AlephMegatronConfig, group: Any, probe: Any, rebuild: Any) -> dict[str, Any]:
    """:class:`_AlephComponent`'s re-planning keywords: a Replanner from ``bandwidth_gbps`` and the probe, the
    caller's ``probe(group)`` as it is (as the DDP hook takes a caller's), else ``probe_bandwidth`` over the group
    confirmed by a second probe where the first moves a rank (:func:`flowlane.aleph.replan.confirmed_probe`; E10: one
    probe slowed by a loaded host re-planned for nothing)."""
    from flowlane.aleph import Replanner
    from flowlane.aleph.replan import confirmed_probe

    replanner = Replanner([float(x) for x in config.bandwidth_gbps.split(",")], config.aleph_config())
    figures = (
        (lambda: probe(group)) if probe is not None else confirmed_probe(replanner, group, config.probe_bytes)
    )
    return {"replanner": replanner, "rebuild": rebuild, "probe": figures}


class _Done:
    def wait(self) -> bool:
        return True


class _AlephComponent:
    """The DP component (:class:`megatron_plugin.dp_collective.DPComponent`): each bucket through the hierarchy.
    With a ``replanner`` (:class:`flowlane.aleph.Replanner`), :meth:`step` re-plans at its due iterations from
    ``probe(group)`` (the group's figures, the same on every rank) and swaps in a new hierarchy when it decides to."""

    def __init__(
        self,
        har: Any,
        rank: int,
        replanner: Any = None,
        rebuild: Any = None,
        probe: Any = None,
    ) -> None:
        self.har, self.rank, self.tensors = har, rank, 0
        self.replanner, self.rebuild, self.probe = replanner, rebuild, probe
        self.iteration = 0
        self.decisions: list[tuple[int, bool, str, int]] = []
        """(iteration, changed, reason, |D| in force) of every re-planning point."""

    def step(self) -> None:
        """The iteration boundary (every rank of the group, at one program point)."""
        self.iteration += 1
        if self.replanner is None or not self.replanner.due(self.iteration):
            return
        d = self.replanner.observe(self.probe())
        if d.changed:
            self.har = self.rebuild(d.plan)
        self.decisions.append((self.iteration, d.changed, d.reason, d.plan.num_flows))
        log.info("flowlane.aleph: re-planning at iteration %d: %s", self.iteration, d.reason)

    def all_reduce(self, tensors: list[torch.Tensor]) -> _Done:
        for t in tensors:
            self.har(t)
            self.tensors += 1
        return _Done()

    def reduce_scatter(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor]) -> _Done:
        """The distributed optimizer's reduce-scatter: the bucket up the hierarchy, each rank's block (with its
        subtree's) back down, then this rank's block (Megatron's output is a view of it: nothing to copy)."""
        for out, inp in zip(outputs, inputs, strict=True):
            self.har.reduce_scatter(inp)
            block = inp.view(-1)[self.rank * out.numel() : (self.rank + 1) * out.numel()]
            if out.data_ptr() != block.data_ptr():
                out.view(-1).copy_(block)
            self.tensors += 1
        return _Done()


class AlephMegatron:
    """ALEPH for Megatron-core DDP's data-parallel groups: construct it on every rank (a collective: it plans and
    creates process groups), then :meth:`attach` the DDP chunks (local). With ``expert_dp_group`` (MoE) the experts'
    bucket groups reduce through a second hierarchy over the expert-data-parallel group, planned from the config's
    ``expert_*`` source. ``calls`` / ``expert_calls``: bucket-group reductions carried; ``plan`` / ``expert_plan``:
    this rank's groups' plans."""

    def __init__(
        self,
        config: AlephMegatronConfig,
        dp_group: dist.ProcessGroup,
        expert_dp_group: dist.ProcessGroup | None = None,
        probe: Any = None,
    ) -> None:
        from megatron_plugin.dp_collective import DPCollective

        if config.replan_every and probe is None:  # the default probe runs on gloo only
            from flowlane.aleph.probe import check_probe_backend

            check_probe_backend(dp_group, "aleph replan_every (--aleph-replan-every)")
        self.config = config
        self._probe = probe
        """Re-planning's figures: ``probe(group)`` -> one Gbit/s figure per group rank, the same on every rank, used
        as it is (default: :func:`flowlane.aleph.probe.probe_bandwidth` over the group, confirmed by a second probe
        where the first moves a rank, :func:`replan_parts`)."""
        self._undo_finalize: list[Patch] = []
        self.plan: Plan | None = None
        self.expert_plan: Plan | None = None
        if expert_dp_group is not None and not config.has_expert_plan:
            raise ValueError(
                "flowlane.aleph: the model has experts (MoE) at expert-model-parallel size > 1, whose bucket groups "
                "reduce over the expert-data-parallel group: give expert_bandwidth_gbps or expert_clusters "
                "(--aleph-expert-bandwidth-gbps / --aleph-expert-clusters) for it"
            )
        if expert_dp_group is None and config.has_expert_plan:
            raise ValueError(
                "flowlane.aleph: expert_bandwidth_gbps / expert_clusters are set but the model has no expert bucket "
                "groups (no experts, or expert-model-parallel size 1, where megatron-core reduces the experts with "
                "the dense bucket groups over the data-parallel group); leave them out"
            )
        self._dp = DPCollective(dp_group, self._maker(dp_group, False), "flowlane.aleph")
        self._expert = (
            DPCollective(expert_dp_group, self._maker(expert_dp_group, True), "flowlane.aleph", expert=True)
            if expert_dp_group is not None
            else None
        )

    def _maker(self, mine: dist.ProcessGroup, expert: bool) -> Any:
        from flowlane.aleph.hook import HierarchicalAllReduce

        config = self.config
        several = dist.get_world_size(mine) != dist.get_world_size()

        def make(group: dist.ProcessGroup | None, ranks: tuple[int, ...]) -> _AlephComponent | None:
            plan = config.plan(len(ranks), expert)
            if several and plan.num_flows > 1 and config.top == "allreduce":
                raise ValueError(
                    f"aleph top='allreduce' with a hierarchical plan needs one {'expert-' if expert else ''}data-"
                    "parallel group: its aggregators' subgroup is created by every rank of the world; use top='ps'"
                )
            # the tree's up and down groups (one each per PS), for every data-parallel group on every rank (see the
            # module docstring)
            multi = {} if expert else config.multi_ps()
            q = len(multi.get("ps", [0]))
            p2p = (
                tuple([dist.new_group(list(ranks)) for _ in range(q)] for _ in range(2))
                if config.top == "ps"
                else None
            )
            if group is None:  # another data-parallel group's
                return None
            if expert:
                self.expert_plan = plan
            else:
                self.plan = plan
            bw = config.figures(expert)
            replan: dict[str, Any] = {}

            # the groups serve any plan of the group (top="ps")
            def build(plan: Plan) -> HierarchicalAllReduce:
                kw = dict(multi)
                if config.top == "ps" and "ps" not in kw and bw:  # the PS on the head the figures favour
                    figures = (
                        replan["replanner"].bandwidth if replan else bw
                    )  # re-planned: the figures in use
                    kw["ps"] = [ps_head(plan, figures)]
                return HierarchicalAllReduce(
                    plan, group, config.top, config.chunk_bytes, p2p_groups=p2p, **kw
                )

            if config.replan_every and not expert:
                replan = replan_parts(config, group, self._probe, lambda plan: self._replanned(build(plan)))
            return _AlephComponent(build(plan), dist.get_rank(group), **replan)

        return make

    def attach(self, model_chunks: Sequence[torch.nn.Module]) -> None:
        """Put the chunks' bucket groups (dense, and expert with MoE) on the hierarchy (local; before their first
        backward)."""
        from megatron_plugin.dp_collective import check_expert_setup

        chunks = list(model_chunks)
        check_expert_setup(chunks, self._expert is not None, "flowlane.aleph")
        for collective, plan in ((self._dp, self.plan), (self._expert, self.expert_plan)):
            if collective is None:
                continue
            n = collective.attach(chunks)
            assert plan is not None
            log.info(
                "flowlane.aleph: hierarchical reduction on %d Megatron-core DDP %sbucket group(s), |D|=%d of %d "
                "ranks, top=%s",
                n,
                "expert " if collective.expert else "",
                plan.num_flows,
                plan.n,
                self.config.top,
            )

    def _replanned(self, har: Any) -> Any:
        self.plan = har.plan
        return har

    def attach_finalize(self, model_config: Any) -> None:
        """Re-planning (``replan_every``): the end of Megatron's ``model_config.finalize_model_grads_func`` (wrapped,
        kept whole) is the iteration boundary where the group probes and re-plans."""
        from megatron_plugin.dp_collective import after_finalize

        step = self._dp.component.step  # type: ignore[union-attr]
        self._undo_finalize.append(after_finalize(model_config, step, "flowlane.aleph"))

    @property
    def decisions(self) -> list[tuple[int, bool, str, int]]:
        """(iteration, changed, reason, |D|) of every re-planning point of this rank's data-parallel group."""
        return list(getattr(self._dp.component, "decisions", []))

    @property
    def calls(self) -> int:
        return self._dp.calls

    @property
    def expert_calls(self) -> int:
        """The expert bucket groups' reductions carried (MoE)."""
        return self._expert.calls if self._expert is not None else 0

    @property
    def gathers(self) -> int:
        """Parameter all-gathers (distributed optimizer) passed through to Megatron's own group."""
        return self._dp.gathers

    @property
    def bucket_groups(self) -> int:
        return self._dp.bucket_groups

    @property
    def expert_bucket_groups(self) -> int:
        return self._expert.bucket_groups if self._expert is not None else 0

    def close(self) -> None:
        """Put Megatron's groups and ``finalize_model_grads_func`` back; refused, changing nothing, while a feature
        installed after ALEPH wraps one of them again (:mod:`megatron_plugin.undo`). A second close does nothing."""
        for collective in (self._dp, self._expert):
            if collective is not None:
                collective.check_removable()
        check_all(self._undo_finalize)
        if self._expert is not None:
            self._expert.remove()
        self._dp.remove()
        undo_all(self._undo_finalize)


def install(
    model_chunks: Sequence[torch.nn.Module],
    config: AlephMegatronConfig,
    model_config: Any = None,
    probe: Any = None,
) -> AlephMegatron:
    """Put every bucket group of ``model_chunks`` (Megatron-core DDP; the experts' too with MoE) on ALEPH's
    hierarchy. A collective: every rank, after the DDP wrap and before the first backward. ``model_config`` (the
    chunks' TransformerConfig) is needed with ``replan_every``: its ``finalize_model_grads_func`` ends each
    iteration; ``probe``: re-planning's figures (see :class:`AlephMegatron`)."""
    from megatron_plugin.dp_collective import FINALIZE_UNSET, groups_of

    chunks = list(model_chunks)
    dp_group, expert_dp_group = groups_of(chunks, "flowlane.aleph")  # refuse before anything is created
    if config.replan_every and getattr(model_config, "finalize_model_grads_func", None) is None:
        raise ValueError(f"flowlane.aleph: replan_every needs the model config: {FINALIZE_UNSET}")
    aleph = AlephMegatron(config, dp_group, expert_dp_group, probe)
    aleph.attach(chunks)
    if config.replan_every:
        aleph.attach_finalize(model_config)
    return aleph


def config_from_group(group: dict[str, Any]) -> AlephMegatronConfig:
    """The recipe's ``dp_collective=aleph`` group (Hydra; ``name`` plus the config's fields) as the config; unknown
    keys and bad values are named."""
    return configs.config_from_group(AlephMegatronConfig, group, "dp_collective=aleph")


def install_from_config(group: dict[str, Any], ctx: Any) -> Any:
    """Called by the recipe's train loop on every rank (a collective) after Megatron-core's DDP wrap, with
    ``ctx.model`` (the DDP chunk) and ``ctx.config`` (its TransformerConfig, ``finalize_model_grads_func`` set)."""
    return install([ctx.model], config_from_group(group), ctx.config)


# -- launch flags ------------------------------------------------------------------------------------------------------
def add_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``--aleph`` and one ``--aleph-<field>`` flag per :class:`AlephMegatronConfig` field."""
    g = parser.add_argument_group("flowlane aleph", "ALEPH hierarchical DP all-reduce (seed 002)")
    g.add_argument(
        "--aleph",
        action="store_true",
        help="reduce Megatron-core DDP's gradient buckets through ALEPH's aggregator hierarchy",
    )
    add_dataclass_args(g, AlephMegatronConfig, "aleph-")
    return parser


def config_from_args(args: argparse.Namespace) -> AlephMegatronConfig | None:
    """The config the flags give, or None without ``--aleph``."""
    if not getattr(args, "aleph", False):
        return None
    cfg: AlephMegatronConfig = config_from_namespace(AlephMegatronConfig, args, "aleph_")
    if not (cfg.bandwidth_gbps or cfg.clusters):
        raise ValueError("--aleph needs --aleph-bandwidth-gbps (one figure per DP rank) or --aleph-clusters")
    return cfg
