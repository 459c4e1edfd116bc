"""ALEPH's hierarchical all-reduce on Megatron-core's data-parallel gradient path (seed 002; digest §5.4 tier 0, §6).

Every dense bucket group of Megatron-core's ``DistributedDataParallel`` reduces through
:class:`flowlane.aleph.hook.HierarchicalAllReduce` (members -> aggregator stars, the aggregators' all-reduce or a
PS-rooted tree, results back), planned from :class:`flowlane.aleph.AlephConfig` with M-WCHA over one bandwidth figure
per data-parallel rank, or given as explicit clusters. Megatron keeps its readiness logic, its scaling (it
multiplies by 1/DP before the sum) and ``finish_grad_sync``: only the collective changes hands, through
:mod:`megatron_plugin.dp_collective` (what it refuses is listed there). The hierarchy runs synchronously when
Megatron starts the bucket group's reduction (no overlap between bucket groups, as with the DDP comm hook). With the
distributed optimizer each bucket's reduce-scatter is the hierarchy's sum of the whole bucket, of which the rank keeps
its block (the down phase moves whole buckets); the parameters' all-gather is Megatron's own.

Also refused here: a plan whose size is not the data-parallel group's, and ``top="allreduce"`` with a hierarchical
plan when there are several data-parallel groups (PP, TP or CP > 1): the aggregators' subgroup is made with
``new_group`` by every rank of the world, which only one data-parallel group can do consistently; ``top="ps"``
makes its groups (one per direction) for every data-parallel group on every rank in one order (NCCL splits them from
the world's communicator, which every rank must join), so it runs on any layout.

megatron-core API::

    aleph = install(ddp_chunks, AlephMegatronConfig(bandwidth_gbps="30,20,20,10"))   # or clusters="0,2;1;3"
    ... train ...
    aleph.close()

Megatron-LM: ``--aleph --aleph-bandwidth-gbps 30,20,20,10`` (or ``--aleph-clusters "0,2;1;3"``) and the planner's
``--aleph-<field>`` flags, through :mod:`megatron_plugin.megatron_lm`.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist

from flowlane.aleph import AlephConfig, Plan, plan_clusters
from flowlane.configs import add_dataclass_args, config_from_namespace

log = logging.getLogger("flowlane.aleph")


@dataclass(frozen=True)
class AlephMegatronConfig:
    """ALEPH on Megatron-core's DP all-reduce: the plan's source and :class:`flowlane.aleph.AlephConfig`'s planner
    knobs (re-planning is not wired here: the plan is fixed at install)."""

    bandwidth_gbps: str = ""
    """Comma-separated Gbit/s, one per data-parallel rank (in group order): the plan is made with M-WCHA."""
    clusters: str = ""
    """An explicit plan instead: clusters separated by ';', members by ',', aggregator first ("0,2;1;3")."""
    variant: Literal["paper", "fill"] = "fill"
    """M-WCHA's member assignment (AlephConfig.variant)."""
    seed: int = 0
    """Seed of the planner's random choices (AlephConfig.seed)."""
    b_gbps: float = 0.0
    """Bandwidth one aggregation flow needs (AlephConfig.b_gbps); 0 = the slowest rank's."""
    cpu_per_member: float = 0.0
    """CPU one aggregated member costs (AlephConfig.cpu_per_member); 0 = CPU does not limit capacity."""
    max_empty_rounds: int = 5
    """Rounds without a selected aggregator before the rest go straight to the top (AlephConfig.max_empty_rounds)."""
    ps_gbps: float = 0.0
    """Top-tier bandwidth for the check |D|*b <= P (AlephConfig.ps_gbps); 0 = no check."""
    top: Literal["allreduce", "ps"] = "allreduce"
    """Top tier: ``allreduce`` among the aggregators, or ``ps`` (a tree rooted at the first aggregator)."""
    chunk_bytes: int = 256 << 10
    """``top="ps"``: the tree's pipelining chunk in bytes (>= 1024)."""

    def __post_init__(self) -> None:
        if self.bandwidth_gbps and self.clusters:
            raise ValueError(self._one_source())
        if not (isinstance(self.chunk_bytes, int) and self.chunk_bytes >= 1024):
            raise ValueError(f"aleph chunk_bytes={self.chunk_bytes!r} must be an integer >= 1024")
        self.aleph_config()  # validates the planner's fields
        self._parse()  # validates the numbers

    def aleph_config(self) -> AlephConfig:
        return AlephConfig(
            variant=self.variant,
            seed=self.seed,
            b_gbps=self.b_gbps or None,
            cpu_per_member=self.cpu_per_member,
            max_empty_rounds=self.max_empty_rounds,
            ps_gbps=self.ps_gbps or None,
            replan_every=0,
            top=self.top,
        )

    def _one_source(self) -> str:
        return (
            "aleph needs exactly one of bandwidth_gbps (one figure per DP rank, planned with M-WCHA) or "
            f"clusters (an explicit plan); got bandwidth_gbps={self.bandwidth_gbps!r}, clusters={self.clusters!r}"
        )

    def _parse(self) -> list[float] | list[list[int]]:
        if not (self.bandwidth_gbps or self.clusters):
            return []
        try:
            if self.bandwidth_gbps:
                return [float(x) for x in self.bandwidth_gbps.split(",")]
            return [[int(x) for x in c.split(",")] for c in self.clusters.split(";")]
        except ValueError:
            field = "bandwidth_gbps" if self.bandwidth_gbps else "clusters"
            raise ValueError(
                f"aleph {field}={getattr(self, field)!r} is not "
                + ("comma-separated numbers" if self.bandwidth_gbps else "';'-separated lists of ',' ranks")
            ) from None

    def plan(self, n: int) -> Plan:
        """The plan over ``n`` data-parallel ranks; raises naming the size when it covers another number."""
        if not (self.bandwidth_gbps or self.clusters):
            raise ValueError(self._one_source())
        parsed = self._parse()
        if self.bandwidth_gbps:
            if len(parsed) != n:
                raise ValueError(
                    f"aleph bandwidth_gbps={self.bandwidth_gbps!r} has {len(parsed)} figures; the "
                    f"data-parallel group has {n} ranks (one figure each)"
                )
            return plan_clusters(parsed, config=self.aleph_config())  # type: ignore[arg-type]
        size = sum(len(c) for c in parsed)  # type: ignore[misc]
        if size != n:
            raise ValueError(
                f"aleph clusters={self.clusters!r} cover {size} ranks; the data-parallel group has {n}"
            )
        return Plan.from_clusters(n, parsed)  # type: ignore[arg-type]


class _Done:
    def wait(self) -> bool:
        return True


class _AlephComponent:
    """The DP component (:class:`megatron_plugin.dp_collective.DPComponent`): each bucket through the hierarchy."""

    def __init__(self, har: Any, rank: int) -> None:
        self.har, self.rank, self.tensors = har, rank, 0

    def all_reduce(self, tensors: list[torch.Tensor]) -> _Done:
        for t in tensors:
            self.har(t)
            self.tensors += 1
        return _Done()

    def reduce_scatter(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor]) -> _Done:
        """The distributed optimizer's reduce-scatter: the whole bucket through the hierarchy, then this rank's
        block (Megatron's output is a view of it: nothing to copy). Results go down the tree whole, so the down
        phase moves the bucket, not the block: a shard-only return is not built."""
        for out, inp in zip(outputs, inputs, strict=True):
            self.har(inp)
            block = inp.view(-1)[self.rank * out.numel() : (self.rank + 1) * out.numel()]
            if out.data_ptr() != block.data_ptr():
                out.view(-1).copy_(block)
            self.tensors += 1
        return _Done()


class AlephMegatron:
    """ALEPH for one data-parallel group of Megatron-core DDP: construct it on every rank (a collective: it plans and
    creates process groups), then :meth:`attach` the DDP chunks (local). ``calls``: bucket-group reductions it
    carried; ``plan``: this rank's group's plan."""

    def __init__(self, config: AlephMegatronConfig, dp_group: dist.ProcessGroup) -> None:
        from flowlane.aleph.hook import HierarchicalAllReduce
        from megatron_plugin.dp_collective import DPCollective

        self.config = config
        self.plan: Plan | None = None
        several = dist.get_world_size(dp_group) != dist.get_world_size()

        def make(group: dist.ProcessGroup | None, ranks: tuple[int, ...]) -> _AlephComponent | None:
            plan = config.plan(len(ranks))
            if several and plan.num_flows > 1 and config.top == "allreduce":
                raise ValueError(
                    "aleph top='allreduce' with a hierarchical plan needs one data-parallel group (PP, TP "
                    "and CP 1): its aggregators' subgroup is created by every rank of the world; use top='ps'"
                )
            # the tree's up and down groups, for every data-parallel group on every rank (see the module docstring)
            p2p = (
                ([dist.new_group(list(ranks))], [dist.new_group(list(ranks))]) if config.top == "ps" else None
            )
            if group is None:  # another data-parallel group's
                return None
            self.plan = plan
            return _AlephComponent(
                HierarchicalAllReduce(plan, group, config.top, config.chunk_bytes, p2p_groups=p2p),
                dist.get_rank(group),
            )

        self._dp = DPCollective(dp_group, make, "flowlane.aleph")

    def attach(self, model_chunks: Sequence[torch.nn.Module]) -> None:
        """Put the chunks' dense bucket groups on the hierarchy (local; before their first backward)."""
        n = self._dp.attach(model_chunks)
        plan = self.plan
        assert plan is not None
        log.info(
            "flowlane.aleph: hierarchical all-reduce on %d Megatron-core DDP bucket group(s), |D|=%d of %d "
            "ranks, top=%s",
            n,
            plan.num_flows,
            plan.n,
            self.config.top,
        )

    @property
    def calls(self) -> int:
        return self._dp.calls

    @property
    def gathers(self) -> int:
        """Parameter all-gathers (distributed optimizer) passed through to Megatron's own group."""
        return self._dp.gathers

    @property
    def bucket_groups(self) -> int:
        return self._dp.bucket_groups

    def close(self) -> None:
        self._dp.remove()


def install(model_chunks: Sequence[torch.nn.Module], config: AlephMegatronConfig) -> AlephMegatron:
    """Put every dense bucket group of ``model_chunks`` (Megatron-core DDP) on ALEPH's hierarchy. A collective:
    every rank, after the DDP wrap and before the first backward."""
    from megatron_plugin.dp_collective import check_chunks, data_parallel_group_of

    check_chunks(model_chunks, "flowlane.aleph")  # refuse before anything is created
    aleph = AlephMegatron(config, data_parallel_group_of(model_chunks))
    aleph.attach(model_chunks)
    return aleph


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
