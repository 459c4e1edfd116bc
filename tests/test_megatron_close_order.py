"""Two Megatron-core features wrapping the same attribute close only in the reverse order of their install
(megatron_plugin.undo). Hermod without its DDP hooks (pipeline p2p and the iteration end) and SYNDICATE on the DP
bucket groups is an install the refusals allow: both wrap ``config.finalize_model_grads_func``. Closed in install
order, Hermod used to restore the finalize it saw (dropping SYNDICATE's wrapper) and SYNDICATE's close then put back
Hermod's closed one. One gloo rank in this process, a tiny GPT under Megatron-core's own DDP, no collective run."""

from __future__ import annotations

import contextlib

import pytest

pytestmark = pytest.mark.llm
pytest.importorskip("megatron.core")

OUT_OF_ORDER = (
    r"flowlane\.hermod: cannot close: TransformerConfig\.finalize_model_grads_func was wrapped again after it was "
    r"installed \(another flowlane feature or user code\); close the features in the reverse order of their install "
    r"\(the last installed first\)"
)


def _ddp_model():
    import torch
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from recipes.gpt import GPTRecipe, build_model
    from tests.megatron_dp_workers import BUCKET, RECIPE

    torch.manual_seed(0)
    model_parallel_cuda_manual_seed(0)
    module, config = build_model(GPTRecipe(world_size=1, **RECIPE))
    ddp = DistributedDataParallelConfig(overlap_grad_reduce=True, bucket_size=BUCKET)
    model = DistributedDataParallel(config, ddp, module)
    config.finalize_model_grads_func = finalize_model_grads
    return model, config


def test_hermod_and_syndicate_close_only_last_installed_first(megatron_env) -> None:
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

    from megatron_plugin import syndicate
    from megatron_plugin.hermod import Hermod, HermodConfig

    model, config = _ddp_model()
    megatron_communicate = vars(P2PCommunicator)["_communicate"]
    dp_group = ps.get_data_parallel_group(with_context_parallel=True)
    assert model.bucket_groups and all(bg.data_parallel_group is dp_group for bg in model.bucket_groups)

    h = Hermod(HermodConfig(), num_microbatches=1, layers_per_stage=2, stage=0, dp_group=dp_group)
    h.attach_pipeline()
    h.attach_finalize(config)
    hermod_finalize, hermod_communicate = (
        config.finalize_model_grads_func,
        vars(P2PCommunicator)["_communicate"],
    )
    syn = syndicate.install([model], syndicate.SyndicateMegatronConfig(mode="fifo"), config)
    try:
        syn_finalize, syn_groups = (
            config.finalize_model_grads_func,
            [bg.data_parallel_group for bg in model.bucket_groups],
        )
        assert syn_finalize is not hermod_finalize and all(g is not dp_group for g in syn_groups)

        # install order: Hermod first is refused and changes nothing (its p2p wrapper stays too)
        with pytest.raises(RuntimeError, match=OUT_OF_ORDER):
            h.close()
        assert config.finalize_model_grads_func is syn_finalize
        assert vars(P2PCommunicator)["_communicate"] is hermod_communicate

        # reverse order: each close takes off its own wrapper only, and Megatron's own objects come back
        syn.close()
        assert config.finalize_model_grads_func is hermod_finalize
        assert all(bg.data_parallel_group is dp_group for bg in model.bucket_groups)
        syn.close()  # a second close does nothing
        assert config.finalize_model_grads_func is hermod_finalize
        h.close()
        assert config.finalize_model_grads_func is finalize_model_grads
        assert vars(P2PCommunicator)["_communicate"] is megatron_communicate
        h.close()
        assert config.finalize_model_grads_func is finalize_model_grads
        assert vars(P2PCommunicator)["_communicate"] is megatron_communicate
    finally:  # a failed assertion must not leave Megatron's class patched for the next test
        for feature in (syn, h):
            with contextlib.suppress(RuntimeError):
                feature.close()


def test_two_offloads_close_only_last_installed_first(megatron_env) -> None:
    """Two activation offloads may stack (flowlane.offload's caches do); both wrap Megatron's schedule steps."""
    from megatron.core.pipeline_parallel import schedules

    from flowlane.offload import OffloadConfig
    from megatron_plugin.ssd_offload import install

    model, _ = _ddp_model()
    forward, backward = schedules.forward_step, schedules.backward_step
    cfg = OffloadConfig(backend="null")
    first = install(model, cfg)
    first_forward = schedules.forward_step
    second = install(model, cfg)
    try:
        with pytest.raises(
            RuntimeError, match=r"flowlane\.offload: cannot close: .*forward_step was wrapped again"
        ):
            first.close()
        assert schedules.forward_step is not first_forward  # the second's wrapper, untouched
        second.close()
        assert schedules.forward_step is first_forward
        first.close()
        first.close()
        assert schedules.forward_step is forward and schedules.backward_step is backward
    finally:
        for handle in (second, first):
            with contextlib.suppress(RuntimeError):
                handle.close()


def test_hermods_ddp_hooks_and_a_dp_collective_cannot_share_bucket_groups(megatron_env) -> None:
    """At DP 1 Hermod's attach_ddp took SYNDICATE's group for Megatron's (no clone needed) and wrapped it; now it is
    refused, changing nothing (the other order was refused already: Hermod's start_grad_sync is seen), and once the
    first feature is closed the bucket groups are free again."""
    from megatron.core import parallel_state as ps

    from megatron_plugin import syndicate
    from megatron_plugin.hermod import Hermod, HermodConfig

    model, config = _ddp_model()
    dp_group = ps.get_data_parallel_group(with_context_parallel=True)
    shared = r"already taken over by flowlane\.{}; Hermod's DDP hooks, ALEPH and SYNDICATE cannot share"
    syn = syndicate.install([model], syndicate.SyndicateMegatronConfig(mode="fifo"), config)
    h = Hermod(HermodConfig(), num_microbatches=1, layers_per_stage=2, stage=0, dp_group=dp_group)
    try:
        groups = [bg.data_parallel_group for bg in model.bucket_groups]
        with pytest.raises(ValueError, match=shared.format("syndicate")):
            h.attach_ddp([model])
        assert [bg.data_parallel_group for bg in model.bucket_groups] == groups  # nothing patched
        syn.close()
        h.attach_ddp([model])
        with pytest.raises(RuntimeError, match=r"flowlane\.syndicate: .*Hermod's DDP hooks.*cannot share"):
            syndicate.install([model], syndicate.SyndicateMegatronConfig(mode="fifo"), config)
    finally:
        for feature in (syn, h):
            with contextlib.suppress(RuntimeError):
                feature.close()
    assert all(bg.data_parallel_group is dp_group for bg in model.bucket_groups)


def test_a_second_hermod_on_the_moe_dispatcher_is_refused(megatron_env) -> None:
    """attach_pipeline refused a second Hermod; patch_moe_dispatcher wrapped the dispatcher twice."""
    import megatron.core.transformer.moe.token_dispatcher as td
    from megatron.core import parallel_state as ps

    from megatron_plugin.hermod import Hermod, HermodConfig

    dp_group = ps.get_data_parallel_group(with_context_parallel=True)
    first, second = (
        Hermod(HermodConfig(), num_microbatches=1, layers_per_stage=2, stage=0, dp_group=dp_group)
        for _ in "ab"
    )
    preprocess = td.MoEAlltoAllTokenDispatcher.preprocess
    first.patch_moe_dispatcher()
    try:
        patched = td.MoEAlltoAllTokenDispatcher.preprocess
        with pytest.raises(RuntimeError, match="already patched by another Hermod"):
            second.patch_moe_dispatcher()
        assert td.MoEAlltoAllTokenDispatcher.preprocess is patched  # nothing changed
    finally:
        first.close()
        second.close()
    assert td.MoEAlltoAllTokenDispatcher.preprocess is preprocess
