"""Hermod on DeepSpeed's PipelineEngine (2 stages x DP 2 on 4 gloo ranks): instruction hooks key every p2p with its
microbatch id, losses are identical with and without Hermod, and the "flowlane.hermod" section is parsed strictly."""

from __future__ import annotations

import os

import pytest

pytestmark = pytest.mark.llm
pytest.importorskip("deepspeed")

from deepspeed_plugin.hermod import parse_hermod_section  # noqa: E402


def _ds_config(hermod: bool) -> dict:
    cfg = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 4,
           "steps_per_print": 1000, "optimizer": {"type": "SGD", "params": {"lr": 0.05}}, "wall_clock_breakdown": False}
    if hermod:
        cfg["flowlane"] = {"hermod": {"enabled": True, "gate_timeout_s": 0.02, "layers_per_stage": 2}}
    return cfg


def _train(rank: int, world: int) -> dict:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    import deepspeed.comm.torch as ds_torch
    import torch
    from deepspeed.pipe import LayerSpec, PipelineModule

    from deepspeed_plugin.hermod import install

    # test-only: skip DeepSpeed's JIT-built shared-memory allreduce (a CPU fast path; torch.distributed is used
    # instead). Its build cache is shared and rebuilt by concurrent sessions, which blocks on a file lock here.
    ds_torch.build_shm_op = lambda: None
    deepspeed.init_distributed("gloo")
    out = {}
    for hermod in (False, True):
        torch.manual_seed(0)
        net = PipelineModule([LayerSpec(torch.nn.Linear, 8, 16), LayerSpec(torch.nn.ReLU),
                              LayerSpec(torch.nn.Linear, 16, 16), LayerSpec(torch.nn.Linear, 16, 4)],
                             num_stages=2, loss_fn=torch.nn.CrossEntropyLoss(), partition_method="uniform")
        cfg = _ds_config(hermod)
        engine, *_ = deepspeed.initialize(model=net, model_parameters=net.parameters(), config=cfg)
        h = install(engine, cfg)
        g = torch.Generator().manual_seed(1 + engine.grid.data_parallel_id)
        data = [(torch.randn(1, 8, generator=g), torch.randint(0, 4, (1,), generator=g)) for _ in range(8)]
        it = iter(data * 4)
        losses = [float(engine.train_batch(data_iter=it)) for _ in range(2)]
        params = [p.detach().clone().tolist() for p in engine.module.parameters()]
        log = [(e.event, e.meta.op, e.meta.microbatch, e.meta.iteration) for e in h.sched.log] if h else []
        if h:
            h.close()
        out["hermod" if hermod else "base"] = {"losses": losses, "params": params, "log": log}
    return out


def test_deepspeed_pipeline_hermod_keeps_the_math_and_keys_p2p_with_microbatch_ids():
    from flowlane.launch import launch

    res = launch(_train, 4, timeout=300, env={"DS_ACCELERATOR": "cpu"})
    for r in res:
        assert r["base"]["losses"] == r["hermod"]["losses"]
        assert r["base"]["params"] == r["hermod"]["params"]
        log = r["hermod"]["log"]
        for it in (0, 1):
            for op in {e[1] for e in log if e[0] == "critical"}:
                mbs = [e[2] for e in log if e[0] == "critical" and e[1] == op and e[3] == it]
                assert mbs == list(range(4)), (op, it, mbs)  # microbatch ids in schedule order
            assert [e for e in log if e[0] == "dp" and e[3] == it]  # one keyed DP coflow per iteration


def test_hermod_section_is_parsed_strictly_and_only_its_own_subsection():
    assert parse_hermod_section({"flowlane": {"offload": {"backend": "posix"}}}) is None
    assert parse_hermod_section({"flowlane": {"hermod": {"enabled": False}}}) is None
    assert parse_hermod_section({"flowlane": {"hermod": {"dp_mid": "consumer"}}}).dp_mid == "consumer"
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['chunk'\]"):
        parse_hermod_section({"flowlane": {"hermod": {"chunk": 1}}})
    with pytest.raises(ValueError, match="dp_mid"):
        parse_hermod_section({"flowlane": {"hermod": {"dp_mid": "first"}}})
