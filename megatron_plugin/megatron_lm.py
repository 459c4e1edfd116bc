"""The launch flags in a Megatron-LM ``pretrain`` run: ``--coflow-scheduler hermod``, ``--ssd-offload``, ``--aleph``
and ``--syndicate``.

Megatron-LM's training loop is the user's own checkout (its ``megatron.training`` is not on PyPI), so flowlane
plugs into the two functions every ``pretrain`` script hands over, the model provider and the forward step.
The lines a user adds to ``pretrain_gpt.py``::

    from megatron_plugin.args import add_flowlane_args
    from megatron_plugin.megatron_lm import flowlane_hooks

    provider, step = flowlane_hooks(partial(model_provider, gpt_builder), forward_step)
    pretrain(train_valid_test_datasets_provider, provider, ModelType.encoder_or_decoder, step,
             args_defaults={'tokenizer_type': 'GPT2BPETokenizer'}, extra_args_provider=add_flowlane_args)

(an existing ``extra_args_provider`` composes: ``lambda p: add_flowlane_args(add_modelopt_args(p))``). Then::

    torchrun ... pretrain_gpt.py ... --overlap-grad-reduce --coflow-scheduler hermod --ssd-offload \\
        --ssd-offload-dirs /nvme0 /nvme1

What happens where (every step at the same program point on every rank):

* the first model-provider call (``get_model``, after ``initialize_megatron``): the flags are read and checked, and
  anything the run's configuration does not allow is refused there, before training; Hermod is built (a collective:
  it creates its class communicators) and keys and gates the schedules' pipeline p2p
  (:meth:`~megatron_plugin.hermod.Hermod.attach_pipeline`); with MoE, the all-to-all token dispatcher gets the
  matched all-to-all. After the last model chunk is built, ``--ssd-offload`` installs the activation offload.
  ``--aleph`` (:mod:`megatron_plugin.aleph`) or ``--syndicate`` (:mod:`megatron_plugin.syndicate`) plans and makes
  its process groups for the data-parallel group (collectives); either is refused with Hermod, with the other, or
  with a configuration it cannot carry (:func:`check_dp_collective_args`).
* the first forward step of each model chunk (inside ``train_step``; Megatron's DDP exists by then and no backward
  has run): Hermod hooks the chunk's DDP bucket groups (:mod:`megatron_plugin.ddp_hooks`), and on the first call
  wraps ``config.finalize_model_grads_func`` to end its iteration and read ``get_num_microbatches()`` (ramp-up).
  ALEPH or SYNDICATE takes over the chunk's bucket-group all-reduces (:mod:`megatron_plugin.dp_collective`, local),
  and SYNDICATE's iteration ends after ``finalize_model_grads_func`` likewise; once the last chunk is attached,
  SYNDICATE refuses a plan whose parameter all-gathers are not exactly the chunks' buckets. With MoE the expert lane
  (its groups made in the model provider) exists only at ``--expert-model-parallel-size`` > 1, the only case where
  megatron-core gives the experts bucket groups of their own.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import torch

from megatron_plugin import aleph, hermod, ssd_offload, syndicate
from megatron_plugin.dp_collective import expert_parallel


def _megatron_lm_get_args() -> argparse.Namespace:
    from megatron.training import get_args  # the user's Megatron-LM checkout

    return get_args()


class FlowlaneHooks:
    """The model provider and forward step of a ``pretrain`` call, with flowlane's features (see the module)."""

    def __init__(
        self,
        model_provider: Callable[..., torch.nn.Module],
        forward_step: Callable[..., Any],
        get_args: Callable[[], argparse.Namespace] = _megatron_lm_get_args,
    ) -> None:
        self._model_provider, self._forward_step, self._get_args = model_provider, forward_step, get_args
        self.hermod: hermod.Hermod | None = None
        self.offload: ssd_offload.SSDOffload | None = None
        self.aleph: aleph.AlephMegatron | None = None
        self.syndicate: syndicate.SyndicateMegatron | None = None
        self._chunks: list[torch.nn.Module] = []
        self._expected_chunks = 1
        self._attached: set[int] = set()
        self._finalize_attached = False
        self._args: argparse.Namespace | None = None

    # -- the two functions handed to pretrain ---------------------------------------------------------------------
    def model_provider(self, *args: Any, **kwargs: Any) -> torch.nn.Module:
        if self._args is None:
            self._args = self._get_args()
            self._setup(self._args)
        model = self._model_provider(*args, **kwargs)
        self._chunks.append(model)
        if len(self._chunks) == self._expected_chunks and self._args.ssd_offload:
            self.offload = ssd_offload.install(
                self._chunks,
                ssd_offload.config_from_args(self._args),
                scope_classes=self._args.ssd_offload_scope_classes,
            )
        return model

    def forward_step(self, data_iterator: Any, model: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        dp = self.aleph or self.syndicate  # the DP collective's owner (one at most: _setup refuses both)
        if dp is not None and id(model) not in self._attached:
            try:
                dp.attach([model])  # local: the groups were made in _setup
                self._attached.add(id(model))
                if self.syndicate is not None and len(self._attached) == self._expected_chunks:
                    # every chunk is here: the plan's parameter gathers must be exactly their buckets' (one that
                    # does not match would fall back to FIFO every iteration)
                    self.syndicate.check_all_attached()
            except BaseException:
                self.close()  # never half-installed
                raise
            boundary = self.syndicate is not None or (
                self.aleph is not None and self.aleph.config.replan_every
            )
            # the iteration boundary: the end of finalize_model_grads
            if boundary and not self._finalize_attached:
                from megatron.core.utils import get_model_config

                dp.attach_finalize(get_model_config(model))
                self._finalize_attached = True
        h = self.hermod
        if h is not None and id(model) not in self._attached:
            h.attach_ddp([model])
            self._attached.add(id(model))
            if not self._finalize_attached:
                from megatron.core.num_microbatches_calculator import get_num_microbatches
                from megatron.core.utils import get_model_config

                h.attach_finalize(get_model_config(model), get_num_microbatches)
                self._finalize_attached = True
        return self._forward_step(data_iterator, model, *args, **kwargs)

    # -- set-up ---------------------------------------------------------------------------------------------------
    def _setup(self, args: argparse.Namespace) -> None:
        if not hasattr(args, "coflow_scheduler") or not hasattr(args, "ssd_offload"):
            raise ValueError(
                "flowlane_hooks: the flowlane flags are not in Megatron's args; pass "
                "extra_args_provider=megatron_plugin.args.add_flowlane_args to pretrain"
            )
        cfg = hermod.config_from_args(args)
        vp = getattr(args, "virtual_pipeline_model_parallel_size", None)
        self._expected_chunks = int(vp) if vp else 1
        aleph_cfg, syndicate_cfg = aleph.config_from_args(args), syndicate.config_from_args(args)
        if getattr(args, "syndicate_profile_out", "") and syndicate_cfg is None:
            raise ValueError(
                "--syndicate-profile-out is set but --syndicate is not: nothing would record a profile"
            )
        if aleph_cfg is not None or syndicate_cfg is not None:
            refuse = check_dp_collective_args(args)
            if refuse:
                raise ValueError(f"--aleph / --syndicate cannot run with this configuration: {refuse}")
            from megatron.core import parallel_state as ps

            # collectives (plans, process groups), at the same program point on every rank; the bucket groups are
            # attached at each chunk's first forward step, once Megatron's DDP exists
            dp_group = ps.get_data_parallel_group(with_context_parallel=True)
            # an expert lane only where the experts have bucket groups of their own (EP > 1); every rank makes it,
            # also on a stage of dense layers only, whose chunks then give it nothing
            expert_dp_group = ps.get_expert_data_parallel_group() if expert_parallel(args) else None
            if aleph_cfg is not None:
                self.aleph = aleph.AlephMegatron(aleph_cfg, dp_group, expert_dp_group)
            else:
                if getattr(args, "syndicate_profile_out", ""):  # refused before the enforcer starts
                    syndicate.check_profile_out(
                        args.syndicate_profile_out,
                        syndicate_cfg,  # type: ignore[arg-type]
                        args.pipeline_model_parallel_size,
                    )
                self.syndicate = syndicate.SyndicateMegatron(
                    syndicate_cfg,  # type: ignore[arg-type]
                    dp_group,
                    overlap_grad_reduce=bool(getattr(args, "overlap_grad_reduce", False)),
                    distributed_optimizer=bool(getattr(args, "use_distributed_optimizer", False)),
                    expert_dp_group=expert_dp_group,
                )
        if cfg.name != "hermod":
            return
        refuse = check_hermod_args(args)
        if refuse:
            raise ValueError(f"--coflow-scheduler hermod cannot run with this configuration: {refuse}")
        from megatron.core import parallel_state as ps
        from megatron.core.num_microbatches_calculator import get_num_microbatches

        moe = bool(getattr(args, "num_experts", None))
        self.hermod = h = hermod.Hermod(
            cfg,
            num_microbatches=get_num_microbatches(),
            layers_per_stage=max(1, args.num_layers // args.pipeline_model_parallel_size),
            stage=ps.get_pipeline_model_parallel_rank(),
            num_stages=args.pipeline_model_parallel_size,
            dp_group=ps.get_data_parallel_group(with_context_parallel=True),
            expert_dp_group=ps.get_expert_data_parallel_group() if moe else None,
            virtual_chunks=self._expected_chunks,
            microbatch_group=getattr(args, "microbatch_group_size_per_vp_stage", None),
        )
        h.attach_pipeline()
        if moe:
            h.patch_moe_dispatcher()

    def close(self) -> None:
        """Close the features in the reverse order of their install (offload, ALEPH/SYNDICATE, Hermod): the last
        installed first, as each close requires (:mod:`megatron_plugin.undo`)."""
        if self.hermod is not None:
            self.hermod.close()
            self.hermod = None
        if self.syndicate is not None:
            out = getattr(self._args, "syndicate_profile_out", "") if self._args is not None else ""
            if out:  # FIFO mode's recorded iteration, for `flowlane syndicate-plan` (checked at set-up)
                syndicate.write_stage_profile(self.syndicate, out)
            self.syndicate.close()
            self.syndicate = None
        if self.aleph is not None:
            self.aleph.close()
            self.aleph = None
        if self.offload is not None:
            self.offload.close()
            self.offload = None


def check_hermod_args(args: argparse.Namespace) -> str:
    """Why Hermod cannot schedule this Megatron-LM configuration ('' when it can)."""
    if getattr(args, "use_torch_fsdp2", False) or getattr(args, "use_megatron_fsdp", False):
        return "FSDP is not supported (Hermod hooks Megatron-core's DistributedDataParallel)"
    if not getattr(args, "overlap_grad_reduce", False):
        return (
            "add --overlap-grad-reduce: without it Megatron reduces every bucket synchronously after the "
            "step's pipeline traffic, so there is nothing to schedule"
        )
    vp = getattr(args, "virtual_pipeline_model_parallel_size", None)
    schedule = getattr(args, "hermod_schedule", None)
    if schedule and (schedule == "interleaved") != bool(vp):
        return (
            f"--hermod-schedule {schedule} does not match the pipeline schedule "
            f"({'interleaved' if vp else '1F1B'}); leave the flag out to follow it"
        )
    if (getattr(args, "num_distributed_optimizer_instances", 1) or 1) > 1:
        return "--num-distributed-optimizer-instances > 1 is not supported"
    dispatcher = getattr(args, "moe_token_dispatcher_type", "alltoall")
    if getattr(args, "num_experts", None) and dispatcher != "alltoall":
        return (
            f"--moe-token-dispatcher-type {dispatcher}: Hermod schedules the alltoall dispatcher only "
            "(allgather and flex are not scheduled)"
        )
    return ""


def check_dp_collective_args(args: argparse.Namespace) -> str:
    """Why ``--aleph`` / ``--syndicate`` cannot take over Megatron's DP gradient reduction here ('' when they can:
    the all-reduce, or the distributed optimizer's reduce-scatter, ``--num-distributed-optimizer-instances`` 1); the
    bucket groups themselves are checked again when attached (megatron_plugin.dp_collective)."""
    if getattr(args, "aleph", False) and getattr(args, "syndicate", False):
        return "--aleph and --syndicate both take over the DP all-reduce; use one"
    if getattr(args, "coflow_scheduler", "none") == "hermod":
        return "--coflow-scheduler hermod already defers the DP bucket groups' reductions; use one of them"
    if getattr(args, "use_torch_fsdp2", False) or getattr(args, "use_megatron_fsdp", False):
        return "FSDP is not supported (the DP all-reduce of Megatron-core's DistributedDataParallel is)"
    if (getattr(args, "num_distributed_optimizer_instances", 1) or 1) > 1:
        return "--num-distributed-optimizer-instances > 1 is not supported (1 only)"
    if getattr(args, "ddp_average_in_collective", False):
        return "--ddp-average-in-collective (an AVG reduce op) is not supported; Megatron's default is"
    if getattr(args, "use_distributed_optimizer", False) and getattr(
        args, "ddp_reduce_scatter_with_fp32_accumulation", False
    ):
        return (
            "--ddp-reduce-scatter-with-fp32-accumulation with --use-distributed-optimizer is not supported "
            "(Megatron then reduce-scatters with its own all-to-all, which the taken-over group does not carry); "
            "Megatron's default (off) is"
        )
    return ""


def flowlane_hooks(
    model_provider: Callable[..., torch.nn.Module],
    forward_step: Callable[..., Any],
    get_args: Callable[[], argparse.Namespace] = _megatron_lm_get_args,
) -> tuple[Callable[..., torch.nn.Module], Callable[..., Any]]:
    """``(model_provider, forward_step)`` for ``megatron.training.pretrain`` with the flowlane flags in effect."""
    hooks = FlowlaneHooks(model_provider, forward_step, get_args)
    return hooks.model_provider, hooks.forward_step
