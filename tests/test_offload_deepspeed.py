"""SSD offload on DeepSpeed (CPU accelerator, gloo): a 2-stage PipelineEngine (ZeRO 0 and 1) and the plain engine,
gradients bitwise those of DeepSpeed's own run."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

pytestmark = pytest.mark.llm
pytest.importorskip("deepspeed")

H, S, MB, GAS = 64, 32, 2, 2
A = 16 * MB * S * H * 4  # saved bytes per block (SDPA, no dropout, fp32; digest E3)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(H), nn.LayerNorm(H)
        self.qkv, self.proj = nn.Linear(H, 3 * H), nn.Linear(H, H)
        self.fc1, self.fc2 = nn.Linear(H, 4 * H), nn.Linear(4 * H, H)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(h, dim=-1)
        q, k, v = (z.view(b, t, 4, h // 4).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, h)
        x = x + self.proj(y)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class Plain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x.pow(2).mean()


def _ds_config(offload: dict | None) -> dict:
    cfg = {
        "train_batch_size": MB * GAS,
        "train_micro_batch_size_per_gpu": MB,
        "gradient_accumulation_steps": GAS,
        "steps_per_print": 1000,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
    }
    if offload is not None:
        cfg["flowlane"] = {"offload": offload, "hermod": {"enabled": False}}
    return cfg


def _capture_grads(engine) -> list:
    """The reduced gradients the optimizer steps with: ``p.grad`` (ZeRO-0), else ZeRO's own partition."""
    snaps: list = []
    opt = engine.optimizer
    orig = opt.step

    def step(*a, **k):
        avg = getattr(opt, "averaged_gradients", None)
        if avg:  # ZeRO-1: this rank's partition of the averaged gradients, per parameter group
            groups = avg.values() if isinstance(avg, dict) else avg
            snaps.append([g.clone() for grp in groups for g in grp])
        else:
            snaps.append([p.grad.clone() for p in engine.module.parameters() if p.grad is not None])
        return orig(*a, **k)

    opt.step = step
    return snaps


def _pipeline_run(rank: int, world: int, offload: dict | None, zero: int = 0) -> dict:
    import deepspeed
    from deepspeed.pipe import LayerSpec, PipelineModule

    from deepspeed_plugin.ssd_offload import install

    torch.manual_seed(0)
    layers = [LayerSpec(Block) for _ in range(4)]
    net = PipelineModule(
        layers=layers, num_stages=2, partition_method="type:Block", loss_fn=lambda out, y: F.mse_loss(out, y)
    )
    cfg = _ds_config(offload)
    if zero:
        cfg.update(zero_optimization={"stage": zero}, zero_allow_untested_optimizer=True)
    engine, *_ = deepspeed.initialize(model=net, model_parameters=net.parameters(), config=cfg)
    handle = install(engine, cfg)
    snaps = _capture_grads(engine)
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(MB, S, H, generator=g), torch.randn(MB, S, H, generator=g)) for _ in range(2 * GAS)]
    it = iter(data)
    losses = [float(engine.train_batch(data_iter=it)) for _ in range(2)]
    handle.wait_io()  # a store still queued counts its bytes when it runs: however loaded the machine is
    stats = handle.stats.as_dict()
    handle.close()
    params = [p.detach().clone() for p in engine.module.parameters()]
    engine.destroy()
    return {"grads": snaps, "stats": stats, "stage": engine.stage_id, "losses": losses, "params": params}


def _plain_run(rank: int, world: int, offload: dict | None) -> dict:
    import deepspeed

    from deepspeed_plugin.ssd_offload import install

    torch.manual_seed(0)
    net = Plain()
    cfg = _ds_config(offload)
    cfg["train_batch_size"] = MB * GAS * world
    engine, *_ = deepspeed.initialize(model=net, model_parameters=net.parameters(), config=cfg)
    handle = install(engine, cfg)
    snaps = _capture_grads(engine)
    g = torch.Generator().manual_seed(10 + rank)
    for _ in range(GAS):
        loss = engine(torch.randn(MB, S, H, generator=g))
        engine.backward(loss)
        engine.step()
    handle.wait_io()  # a store still queued counts its bytes when it runs: however loaded the machine is
    stats = handle.stats.as_dict()
    handle.close()
    return {"grads": snaps, "stats": stats}


def _both(rank: int, world: int, tmp: str) -> dict:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import sys

    import deepspeed
    import deepspeed.comm.torch  # noqa: F401

    # test-only: skip DeepSpeed's JIT-built shared-memory allreduce; its build cache is shared with other sessions
    # and a build in progress elsewhere blocks here on a file lock (sys.modules: the attribute is the torch package)
    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
    deepspeed.init_distributed(dist_backend="gloo")  # adopts the launcher's process group
    tmp = os.path.join(tmp, f"rank{rank}")  # one target per rank: a peer's live run dir is not a leftover
    os.makedirs(tmp, exist_ok=True)  # offload dirs must exist (flowlane.offload.OffloadConfig.check_dirs)
    off = {
        "backend": "posix",
        "dirs": [tmp],
        "min_bytes": 4096,
        "keep_last_k": 1,
        "offload_cpu_tensors": True,
        "deepspeed_aio": "off",  # flowlane's posix backend (tests/test_deepspeed_aio.py: the aio op)
    }
    # the plain engine first: a PipelineEngine leaves DeepSpeed's global model-parallel groups behind
    off_plain = dict(off, scope_classes=["Block"])
    out = {"plain_ref": _plain_run(rank, world, None), "plain_off": _plain_run(rank, world, off_plain)}
    out["pipe_ref"] = _pipeline_run(rank, world, None)
    out["pipe_off"] = _pipeline_run(rank, world, off)
    out["pipe_z1_ref"] = _pipeline_run(rank, world, None, zero=1)
    out["pipe_z1_off"] = _pipeline_run(rank, world, off, zero=1)
    left = os.listdir(tmp)
    z1_ref, z1_off = out["pipe_z1_ref"], out["pipe_z1_off"]
    # compare in the rank (tensors do not survive the trip through the launcher's queue after the rank exits)
    return {
        "pipe_equal": _equal(out["pipe_ref"]["grads"], out["pipe_off"]["grads"]),
        "plain_equal": _equal(out["plain_ref"]["grads"], out["plain_off"]["grads"]),
        "pipe_z1_equal": _equal(z1_ref["grads"], z1_off["grads"])
        and z1_ref["losses"] == z1_off["losses"]
        and _equal([z1_ref["params"]], [z1_off["params"]]),
        "n_snaps": (len(out["pipe_ref"]["grads"]), len(out["plain_ref"]["grads"]), len(z1_ref["grads"])),
        "z1_grads": sum(len(x) for x in z1_ref["grads"]),
        "pipe_stats": out["pipe_off"]["stats"],
        "pipe_z1_stats": z1_off["stats"],
        "plain_stats": out["plain_off"]["stats"],
        "stage": out["pipe_off"]["stage"],
        "left": left,
    }


def _equal(a: list, b: list) -> bool:
    return len(a) == len(b) and all(
        len(x) == len(y) and all(torch.equal(p, q) for p, q in zip(x, y, strict=True))
        for x, y in zip(a, b, strict=True)
    )


@pytest.mark.slow  # 2 ranks x 4 DeepSpeed engines: ~60 s on a 2-core machine
def test_deepspeed_pipeline_and_engine_offload_bitwise_grads() -> None:
    from flowlane.launch import launch

    with tempfile.TemporaryDirectory() as tmp:
        res = launch(_both, 2, args=(tmp,), timeout=300, env={"DS_ACCELERATOR": "cpu"})
    for r in res:
        assert r["n_snaps"] == (2, 1, 2) and r["z1_grads"] > 0
        assert r["pipe_equal"] and r["plain_equal"] and r["pipe_z1_equal"]
        # ZeRO-1: the parameters are views of DeepSpeed's flat buffers, never stored; the same blocks as ZeRO-0
        assert r["pipe_z1_stats"]["bytes_written"] + r["pipe_z1_stats"]["bytes_cancelled"] == (
            r["pipe_stats"]["bytes_written"] + r["pipe_stats"]["bytes_cancelled"]
        )
        assert r["left"] == []
        # the plain engine: every micro-batch's backward follows its forward -> 3 of 4 blocks written
        ps = r["plain_stats"]
        assert ps["bytes_written"] + ps["bytes_cancelled"] == GAS * 3 * A
    by_stage = {r["stage"]: r["pipe_stats"] for r in res}
    # 2 train_batch calls x GAS micro-batches. Stage 0 runs F0 F1 B0 B1: no forward is followed by its own
    # backward, so both of its blocks are written. The last stage runs F B F B: its last block is kept.
    stored = {k: v["bytes_written"] + v["bytes_cancelled"] for k, v in by_stage.items()}
    assert stored[0] == 2 * GAS * 2 * A
    assert stored[1] == 2 * GAS * 1 * A
    assert by_stage[0]["dedup_hits"] == 2 * GAS * 2 * 3


def test_flowlane_section_parser_reads_only_offload() -> None:
    from deepspeed_plugin.ssd_offload import parse_offload_section

    assert parse_offload_section({"train_batch_size": 1}) is None
    assert parse_offload_section({"flowlane": {"hermod": {}}}) is None
    assert parse_offload_section({"flowlane": {"offload": {"enabled": False}}}) is None
    cfg, scopes, aio = parse_offload_section(
        {"flowlane": {"offload": {"keep_last_k": 2, "scope_classes": ["Block"]}}}
    )
    assert cfg.keep_last_k == 2 and scopes == ("Block",) and aio == "auto"
    with pytest.raises(ValueError, match=r"deepspeed_aio.*'yes' is not one of \['auto', 'on', 'off'\]"):
        parse_offload_section({"flowlane": {"offload": {"deepspeed_aio": "yes"}}})
    with pytest.raises(ValueError, match=r"unknown offload option\(s\) \['dir'\]"):
        parse_offload_section({"flowlane": {"offload": {"dir": "/x"}}})
    with pytest.raises(ValueError, match="scope_classes"):
        parse_offload_section({"flowlane": {"offload": {"scope_classes": "Block"}}})


def test_scope_classes_match_subclasses_by_name_as_fully_shard_makes_them() -> None:
    from deepspeed_plugin.ssd_offload import _scope_modules

    class Layer(nn.Linear):
        pass

    class FSDPLayer(Layer):  # what FSDP2's fully_shard makes of a Layer
        pass

    model = nn.Sequential(Layer(4, 4), FSDPLayer(4, 4), nn.Linear(4, 4))
    assert _scope_modules(model, ("Layer",), pipeline=False) == [model[0], model[1]]
