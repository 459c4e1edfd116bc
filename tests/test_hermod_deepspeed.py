"""Hermod on DeepSpeed's PipelineEngine (2 stages x DP 2 on 4 gloo ranks, ZeRO 0 and 1): instruction hooks key every
p2p with its microbatch id and send it on the critical-class clone of the pipeline group, ReduceGrads' reductions are
DeepSpeed's own, issued by Hermod's pacer on the bulk-class clone under DP keys, losses and parameters are bitwise
DeepSpeed's own run, and "flowlane.hermod" is parsed strictly."""

from __future__ import annotations

import os

import pytest

pytestmark = pytest.mark.llm
pytest.importorskip("deepspeed")

from deepspeed_plugin.hermod import CRITICAL_CLASS, parse_hermod_section  # noqa: E402
from deepspeed_plugin.zero_hooks import BULK_CLASS  # noqa: E402


def _ds_config(hermod: bool, zero: int) -> dict:
    cfg = {
        "train_batch_size": 8,
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 4,
        "steps_per_print": 1000,
        "optimizer": {"type": "SGD", "params": {"lr": 0.05}},
        "wall_clock_breakdown": False,
        "zero_optimization": {"stage": zero, "reduce_bucket_size": 200},
        "zero_allow_untested_optimizer": True,
    }
    if hermod:
        cfg["flowlane"] = {"hermod": {"enabled": True, "gate_timeout_s": 0.02}}
    return cfg


def _train(rank: int, world: int) -> dict:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import sys

    import deepspeed
    import deepspeed.comm.torch  # noqa: F401
    import torch
    from deepspeed.pipe import LayerSpec, PipelineModule

    from deepspeed_plugin.comm import CommTap
    from deepspeed_plugin.hermod import install

    # test-only: skip DeepSpeed's JIT-built shared-memory allreduce (a CPU fast path; torch.distributed is used
    # instead). Its build cache is shared and rebuilt by concurrent sessions, which blocks on a file lock here.
    # Patched through sys.modules: the attribute deepspeed.comm.torch is the torch package itself.
    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
    deepspeed.init_distributed("gloo")
    out = {}
    for zero, hermod in ((0, False), (0, True), (1, False), (1, True)):
        torch.manual_seed(0)
        net = PipelineModule(
            [
                LayerSpec(torch.nn.Linear, 8, 16),
                LayerSpec(torch.nn.ReLU),
                LayerSpec(torch.nn.Linear, 16, 16),
                LayerSpec(torch.nn.Linear, 16, 4),
            ],
            num_stages=2,
            loss_fn=torch.nn.CrossEntropyLoss(),
            partition_method="uniform",
        )
        cfg = _ds_config(hermod, zero)
        engine, *_ = deepspeed.initialize(model=net, model_parameters=net.parameters(), config=cfg)
        h = install(engine, cfg)
        tap = h.tap if h else CommTap(None)  # DeepSpeed's own run: record only
        g = torch.Generator().manual_seed(1 + engine.grid.data_parallel_id)
        data = [(torch.randn(1, 8, generator=g), torch.randint(0, 4, (1,), generator=g)) for _ in range(8)]
        it = iter(data * 4)
        losses = [float(engine.train_batch(data_iter=it)) for _ in range(2)]
        params = [p.detach().clone().tolist() for p in engine.module.parameters()]
        log = [(e.event, e.meta.op, e.meta.microbatch, e.meta.iteration) for e in h.sched.log] if h else []
        records = [(r.op, r.numel, r.thread, r.meta and r.meta.ctype, r.hermod_class) for r in tap.records]
        if h:
            h.close()
        else:
            tap.close()
        out[(zero, hermod)] = {"losses": losses, "params": params, "log": log, "records": records}
        engine.destroy()
    return out


@pytest.mark.slow  # 4 ranks x 4 DeepSpeed engines
def test_deepspeed_pipeline_hermod_keeps_the_math_and_keys_p2p_with_microbatch_ids():
    from flowlane.launch import launch

    res = launch(_train, 4, timeout=300, env={"DS_ACCELERATOR": "cpu"})
    for r in res:
        for zero in (0, 1):
            base, herm = r[(zero, False)], r[(zero, True)]
            assert base["losses"] == herm["losses"], zero
            assert base["params"] == herm["params"], zero
            log = herm["log"]
            for it in (0, 1):
                for op in {e[1] for e in log if e[0] == "critical"}:
                    mbs = [e[2] for e in log if e[0] == "critical" and e[1] == op and e[3] == it]
                    assert mbs == list(range(4)), (zero, op, it, mbs)  # microbatch ids in schedule order
                # ReduceGrads went through the pacer
                assert [e for e in log if e[0] == "chunk" and e[3] == it], zero
            # every gradient reduction of DeepSpeed's own run is issued by the pacer under a DP key
            reduce_ops = ("all_reduce", "reduce", "reduce_scatter_tensor")
            ours = sorted(
                (op, n)
                for op, n, t, c, k in herm["records"]
                if op in reduce_ops and t == "pacer" and c == "dp" and k == BULK_CLASS
            )
            theirs = sorted((op, n) for op, n, t, *_ in base["records"] if op in reduce_ops and n > 1)
            assert ours == theirs and ours, zero
            assert not [x for x in herm["records"] if x[0] in reduce_ops and x[2] == "main" and x[1] > 1], (
                zero
            )
            # pipeline p2p: DeepSpeed's own sends and receives in DeepSpeed's order, every one under a PP key on
            # the critical-class clone of the pipeline group (never on the world group DeepSpeed names)
            p2p_ours = [(op, n, c, k) for op, n, t, c, k in herm["records"] if op in ("send", "recv")]
            p2p_theirs = [(op, n) for op, n, *_ in base["records"] if op in ("send", "recv")]
            assert p2p_theirs and [x[:2] for x in p2p_ours] == p2p_theirs, zero
            assert {x[2:] for x in p2p_ours} == {("pp", CRITICAL_CLASS)}, (zero, p2p_ours)


def test_hermod_section_is_parsed_strictly_and_only_its_own_subsection():
    assert parse_hermod_section({"flowlane": {"offload": {"backend": "posix"}}}) is None
    assert parse_hermod_section({"flowlane": {"hermod": {"enabled": False}}}) is None
    assert parse_hermod_section({"flowlane": {"hermod": {"window": "backward"}}}).window == "backward"
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['chunk'\]"):
        parse_hermod_section({"flowlane": {"hermod": {"chunk": 1}}})
    with pytest.raises(ValueError, match="dp_mid"):
        parse_hermod_section({"flowlane": {"hermod": {"dp_mid": "first"}}})


@pytest.mark.parametrize(
    "key, value, default",
    [("schedule", "interleaved", "1f1b"), ("dp_mid", "consumer", "last"), ("max_inflight_buckets", 4, 1)]
    + [("layers_per_stage", 2, 1)],
)
def test_keys_that_change_nothing_on_deepspeed_are_refused_naming_the_key(key, value, default):
    """Every op Hermod defers on DeepSpeed is a DP reduction run by DeepSpeed's own bucket function, and its
    critical ops go out at once: these keys were accepted and changed nothing (review: same order, one bucket in
    flight at 1 or 4). Their defaults stay accepted."""
    with pytest.raises(ValueError, match=rf"flowlane.hermod.{key} {value!r} has no effect on DeepSpeed"):
        parse_hermod_section({"flowlane": {"hermod": {key: value}}})
    assert getattr(parse_hermod_section({"flowlane": {"hermod": {key: default}}}), key) == default
