"""SSD offload on a tiny Megatron-core GPT (CPU, gloo, one rank) driven by Megatron's own schedule."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.llm
pytest.importorskip("megatron.core")

from flowlane.offload.estimate import LayerShape, activation_bytes_per_layer  # noqa: E402

L, HID, HEADS, SEQ, MB, VOCAB = 6, 64, 4, 32, 2, 128
MIN_BYTES = 4096  # below: LN mean/rstd; above: every per-layer activation of this size


def _gpt(recompute: bool = False, dropout: float = 0.0):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_plugin.te_compat import UNFUSED

    torch.manual_seed(0)
    model_parallel_cuda_manual_seed(0)
    extra = (
        dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
        if recompute
        else {}
    )
    cfg = TransformerConfig(
        num_layers=L,
        hidden_size=HID,
        num_attention_heads=HEADS,
        use_cpu_initialization=True,
        attention_dropout=dropout,
        hidden_dropout=dropout,
        **UNFUSED,
        **extra,
    )
    return GPTModel(
        config=cfg,
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
    )


def _batches(n: int) -> list[tuple[torch.Tensor, ...]]:
    g = torch.Generator().manual_seed(1)
    pos = torch.arange(SEQ).unsqueeze(0).expand(MB, SEQ)
    mask = torch.tril(torch.ones(SEQ, SEQ, dtype=torch.bool)).logical_not().view(1, 1, SEQ, SEQ)
    return [(torch.randint(0, VOCAB, (MB, SEQ), generator=g), pos, mask) for _ in range(n)]


def _step(model, n_micro: int = 2) -> list[torch.Tensor]:
    from megatron.core.pipeline_parallel import get_forward_backward_func

    def forward_step_func(data_iterator, m):
        tok, pos, mask = next(data_iterator)
        out = m(tok, pos, mask, labels=tok)
        return out, lambda o: (o.float().mean(), {"loss": o.detach().float().mean()})

    model.zero_grad()
    get_forward_backward_func()(
        forward_step_func=forward_step_func,
        data_iterator=iter(_batches(n_micro)),
        model=[model],
        num_microbatches=n_micro,
        seq_length=SEQ,
        micro_batch_size=MB,
        forward_only=False,
    )
    return [p.grad.clone() for p in model.parameters()]


def test_megatron_gpt_offload_bitwise_grads_bytes_and_dedup(megatron_env, tmp_path: Path) -> None:
    from megatron_plugin.ssd_offload import install_from_config

    model = _gpt()
    ref = _step(model)
    cfg = {
        "enabled": True,
        "backend": "posix",
        "dirs": [str(tmp_path)],
        "min_bytes": MIN_BYTES,
        "keep_last_k": 1,
        "offload_cpu_tensors": True,
    }
    with install_from_config(cfg, model) as h:
        for _ in range(2):
            before = h.stats
            got = _step(model)
            h.wait_io()  # a store still queued counts its bytes when it runs: however loaded the machine is
            after = h.stats
            assert all(torch.equal(a, b) for a, b in zip(ref, got, strict=True))
            per_layer = activation_bytes_per_layer(
                LayerShape(SEQ, MB, HID, HEADS, dropout=False, elem_bytes=4)
            )
            # two micro-batches; each keeps its last layer because its backward follows its forward
            stored = (
                after.bytes_written + after.bytes_cancelled - before.bytes_written - before.bytes_cancelled
            )
            assert stored == 2 * (L - 1) * per_layer  # written, or forwarded before the write began
            assert after.records - before.records == 2
            # per layer: k and v share q's QKV storage (2), softmax output saved by softmax and bmm (1)
            assert after.dedup_hits - before.dedup_hits == 2 * 3 * L
            assert after.sync_loads == 0
    assert not list(tmp_path.iterdir())


#: the bulk tier's settings these tests share (pinned host memory, CPU tensors offloaded, the last layer kept)
_PINNED = {"backend": "pinned_cpu", "min_bytes": MIN_BYTES, "keep_last_k": 1, "offload_cpu_tensors": True}


@pytest.mark.parametrize(
    ("adaptive", "release"), [(False, "record_stream"), (True, "record_stream"), (True, "stream_order")]
)
def test_megatron_gpt_bulk_tier_under_megatron_schedule_bitwise(
    megatron_env, tmp_path: Path, monkeypatch, adaptive: bool, release: str
) -> None:
    """The CUDA tiers' bulk path (one host block per TransformerLayer, reloads in stream order, the byte budget)
    driven by Megatron's own schedule and hints; forced onto CPU tensors, where its copies are synchronous."""
    from flowlane.offload import TensorCache
    from megatron_plugin.ssd_offload import install_from_config

    monkeypatch.setattr(TensorCache, "_is_bulk", lambda self, device: self._bulk_backend)
    model = _gpt()
    ref = _step(model)
    cfg = _PINNED | {
        "adaptive": adaptive,
        "profile_step": 0,
        "link_GBps": 1e6 if adaptive else 0.0,
        "release": release,
    }
    with install_from_config(cfg, model) as h:
        for _ in range(2):
            before = h.stats
            got = _step(model)
            after = h.stats
            assert all(torch.equal(a, b) for a, b in zip(ref, got, strict=True))
        assert after.bulk_stores - before.bulk_stores == 2 * (L - 1)  # two micro-batches, last layer kept
        assert after.sync_loads == 0 and after.late_loads == 0
        # stream order: every stored layer of both micro-batches dropped at its point, none stored too late
        released = after.ordered_releases - before.ordered_releases
        assert released == (2 * (L - 1) if release == "stream_order" else 0)
        assert after.ordered_release_misses == 0
        if adaptive:  # profiled on micro-batch 0: a fast link hides every layer but the last
            assert h.stats.profile["keep_last_k"] == 1 and len(h.stats.profile["allow_bytes"]) == L


def test_megatron_half_layer_groups_bitwise_layer_norm_inputs_kept(megatron_env, monkeypatch) -> None:
    """``scope_classes=["SelfAttention", "MLP"]``: each layer's attention and MLP are the offload groups (the H200
    bench's half-layer groups lowered the floor backward holds, results/gpu). Under Megatron's own schedule the
    gradients stay bitwise, every group but the last MLP is stored, and the two layer norms that the local spec keeps
    in TransformerLayer itself save their inputs outside both groups, so those stay on the device (docs/offload.md)."""
    from flowlane.offload import TensorCache
    from megatron_plugin.ssd_offload import install_from_config

    monkeypatch.setattr(TensorCache, "_is_bulk", lambda self, device: self._bulk_backend)
    model = _gpt()
    ref = _step(model)
    cfg = _PINNED | {"scope_classes": ["SelfAttention", "MLP"]}
    with install_from_config(cfg, model) as h:
        before = h.stats
        got = _step(model)
        after = h.stats
    assert all(torch.equal(a, b) for a, b in zip(ref, got, strict=True))
    assert after.bulk_stores - before.bulk_stores == 2 * (2 * L - 1)  # two micro-batches, the last MLP kept
    per_layer = activation_bytes_per_layer(LayerShape(SEQ, MB, HID, HEADS, dropout=False, elem_bytes=4))
    sbh = MB * SEQ * HID * 4  # one fp32 [s, b, h] tensor: what each layer norm saves
    last_mlp = (1 + 4 + 4) * sbh  # its norm's output (fc1's input), fc1's output and the activation's
    assert after.bytes_written - before.bytes_written == 2 * (L * (per_layer - 2 * sbh) - last_mlp)


def _seeded_step(model) -> list[torch.Tensor]:
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    torch.manual_seed(0)
    model_parallel_cuda_manual_seed(0)
    return _step(model)


@pytest.mark.parametrize("rng", ["megatron", "torch_only"])
def test_megatron_recompute_under_the_budget_with_dropout_bitwise(
    megatron_env, tmp_path: Path, monkeypatch, rng: str
) -> None:
    """``recompute`` on Megatron's own schedule with dropout: the recomputed TransformerLayers draw the same
    dropout masks (torch's RNG and Megatron's model-parallel tracker restored), so gradients are bitwise those
    without offload. ``torch_only`` shows the tracker matters: restoring only torch's state gives other grads."""
    from flowlane.offload import TensorCache
    from flowlane.offload.cache import recompute_forward
    from megatron_plugin import ssd_offload

    monkeypatch.setattr(TensorCache, "_is_bulk", lambda self, device: self._bulk_backend)
    if rng == "torch_only":
        monkeypatch.setattr(ssd_offload, "checkpoint_with_megatron_rng", recompute_forward)
    model = _gpt(dropout=0.2)
    ref = _seeded_step(model)
    cfg = {
        "backend": "pinned_cpu",
        "min_bytes": MIN_BYTES,
        "offload_cpu_tensors": True,
        "adaptive": True,
        "profile_step": 0,
        "link_GBps": 1e-6,  # hides nothing: every layer is kept, and the slack goes to recomputation
        "max_slowdown": 0.99,
        "recompute": True,
    }
    with ssd_offload.install_from_config(cfg, model) as h:
        got = [_seeded_step(model) for _ in range(2)]  # profiled on micro-batch 0, then recomputing
        recomputed = h.stats.recomputed_layers
    assert recomputed >= 3  # micro-batch 1 of step 0 and both of step 1, one layer or more each
    same = [all(torch.equal(a, b) for a, b in zip(ref, g, strict=True)) for g in got]
    assert same == [True, True] if rng == "megatron" else same == [False, False]


def test_megatron_recompute_is_refused_with_fp8(megatron_env) -> None:
    from flowlane.offload import OffloadConfig
    from megatron_plugin.ssd_offload import install

    model = _gpt()
    model.config.fp8 = "hybrid"
    try:
        cfg = OffloadConfig(adaptive=True, max_slowdown=0.05, recompute=True, backend="null")
        with pytest.raises(ValueError, match=r"--ssd-offload-recompute with fp8='hybrid'"):
            install(model, cfg)
    finally:
        model.config.fp8 = None


def test_megatron_recompute_baseline_runs_with_same_grads(megatron_env) -> None:
    """The benchmark's third column: Megatron full activation recomputation gives the same gradients."""
    ref = _step(_gpt())
    got = _step(_gpt(recompute=True))
    assert all(torch.allclose(a, b, rtol=0, atol=1e-6) for a, b in zip(ref, got, strict=True))


def test_megatron_install_says_what_it_installed(megatron_env, caplog) -> None:
    import logging

    from flowlane.offload import OffloadConfig
    from megatron_plugin.ssd_offload import install

    cfg = OffloadConfig(backend="null", min_bytes=MIN_BYTES, adaptive=True, max_slowdown=0.05, recompute=True)
    with caplog.at_level(logging.INFO, logger="flowlane.offload"), install(_gpt(), cfg):
        pass
    (line,) = [r.getMessage() for r in caplog.records if "installed on" in r.getMessage()]
    assert f"installed on {3 * L} modules (TransformerLayer, SelfAttention, MLP;" in line, line
    assert "backend null" in line and f">= {MIN_BYTES} B" in line and "max slowdown 0.05, recompute" in line
    assert "schedule hints" in line


def test_megatron_flags_build_the_config() -> None:
    from flowlane.offload import OffloadConfig
    from megatron_plugin.args import add_flowlane_args
    from megatron_plugin.ssd_offload import config_from_args

    p = add_flowlane_args(argparse.ArgumentParser())
    a = p.parse_args(
        [
            "--ssd-offload",
            "--ssd-offload-dirs",
            "/a",
            "/b",
            "--ssd-offload-keep-last-k",
            "2",
            "--ssd-offload-adaptive",
            "--ssd-offload-min-bytes",
            "1024",
        ]
    )
    c = config_from_args(a)
    assert c.enabled and c.dirs == ("/a", "/b") and c.keep_last_k == 2 and c.adaptive and c.min_bytes == 1024
    a = p.parse_args(
        [
            "--ssd-offload",
            "--ssd-offload-backend",
            "pinned_cpu",
            "--ssd-offload-prefetch-groups",
            "2",
            "--ssd-offload-link-gbps",
            "55",
            "--ssd-offload-pinned-pool-bytes",
            "1048576",
            "--ssd-offload-max-slowdown",
            "0.03",
        ]
    )
    c = config_from_args(a)
    assert (
        c.backend == "pinned_cpu"
        and c.prefetch_groups == 2
        and c.link_GBps == 55.0
        and c.max_slowdown == 0.03
    )
    assert c.pinned_pool_bytes == 1 << 20 and not c.recompute
    a = p.parse_args(
        [
            "--ssd-offload",
            "--ssd-offload-adaptive",
            "--ssd-offload-max-slowdown",
            "0.05",
            "--ssd-offload-recompute",
        ]
    )
    c = config_from_args(a)
    assert c.recompute and c.adaptive and c.max_slowdown == 0.05 and c.release == "record_stream"
    assert a.ssd_offload_scope_classes == ["TransformerLayer", "SelfAttention", "MLP"]
    a = p.parse_args(
        [
            "--ssd-offload",
            "--ssd-offload-adaptive",
            "--ssd-offload-release",
            "stream_order",
            "--ssd-offload-scope-classes",
            "SelfAttention",
            "MLP",
        ]
    )
    assert config_from_args(a).release == "stream_order"
    assert a.ssd_offload_scope_classes == ["SelfAttention", "MLP"]
    with pytest.raises(ValueError, match="offload.release='stream_order' needs adaptive=true"):
        config_from_args(p.parse_args(["--ssd-offload", "--ssd-offload-release", "stream_order"]))
    with pytest.raises(ValueError, match="offload.recompute=True needs adaptive=true and max_slowdown > 0"):
        config_from_args(p.parse_args(["--ssd-offload", "--ssd-offload-recompute"]))
    with pytest.raises(SystemExit):
        p.parse_args(["--ssd-offload-backend", "gds"])
    # every OffloadConfig field has its flag (generated from the dataclass): these two had none when hand-written
    c = config_from_args(
        p.parse_args(
            ["--ssd-offload", "--ssd-offload-kvikio-compat-mode", "off", "--no-ssd-offload-check-versions"]
        )
    )
    assert c.kvikio_compat_mode == "off" and c.check_versions is False
    # the flags' defaults: the dataclass's
    assert config_from_args(p.parse_args([])) == OffloadConfig(enabled=False)


def test_install_from_config_disabled_is_a_noop(megatron_env) -> None:
    from megatron_plugin.ssd_offload import install_from_config

    model = _gpt()
    for cfg in (None, {"enabled": False}):
        with install_from_config(cfg, model) as h:
            assert not h.enabled
    with pytest.raises(ValueError, match="keep_lastk"):
        install_from_config({"keep_lastk": 1}, model)


def _pp_rank(rank: int, world: int, tmp: str) -> dict:
    """One rank of a PP=2 Megatron GPT driven by the 1F1B schedule, with and without offload."""
    from megatron_plugin import cpu_shim

    cpu_shim.apply()
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_plugin.ssd_offload import install_from_config
    from megatron_plugin.te_compat import UNFUSED

    parallel_state.initialize_model_parallel(1, 2)
    first, last = parallel_state.is_pipeline_first_stage(), parallel_state.is_pipeline_last_stage()

    def build():
        torch.manual_seed(0)
        model_parallel_cuda_manual_seed(0)
        cfg = TransformerConfig(
            num_layers=4,
            hidden_size=HID,
            num_attention_heads=HEADS,
            use_cpu_initialization=True,
            attention_dropout=0.0,
            hidden_dropout=0.0,
            **UNFUSED,
            pipeline_model_parallel_size=2,
            pipeline_dtype=torch.float32,
        )
        return GPTModel(
            config=cfg,
            transformer_layer_spec=get_gpt_layer_local_spec(),
            vocab_size=VOCAB,
            max_sequence_length=SEQ,
            pre_process=first,
            post_process=last,
        )

    def run(model):
        def fsf(it, m):
            tok, pos, mask = next(it)
            return m(tok, pos, mask, labels=tok), lambda o: (
                o.float().mean(),
                {"l": o.detach().float().mean()},
            )

        model.zero_grad()
        get_forward_backward_func()(
            forward_step_func=fsf,
            data_iterator=iter(_batches(4)),
            model=[model],
            num_microbatches=4,
            seq_length=SEQ,
            micro_batch_size=MB,
            forward_only=False,
        )
        return [p.grad.clone() for p in model.parameters()]

    model = build()
    ref = run(model)
    cfg = {"dirs": [tmp], "min_bytes": MIN_BYTES, "keep_last_k": 1, "offload_cpu_tensors": True}
    with install_from_config(cfg, model) as h:
        got = run(model)
        h.wait_io()
        stats = h.stats.as_dict()
    parallel_state.destroy_model_parallel()
    return {
        "equal": all(torch.equal(a, b) for a, b in zip(ref, got, strict=True)),
        "last": last,
        "written": stats["bytes_written"] + stats["bytes_cancelled"],
        "records": stats["records"],
        "sync_loads": stats["sync_loads"],
    }


@pytest.mark.slow  # 2 spawned ranks importing Megatron: ~30 s on a 2-core machine
def test_megatron_1f1b_pp2_records_per_microbatch(tmp_path: Path) -> None:
    from flowlane.launch import launch

    res = launch(_pp_rank, 2, args=(str(tmp_path),), timeout=300)
    per_layer = activation_bytes_per_layer(LayerShape(SEQ, MB, HID, HEADS, dropout=False, elem_bytes=4))
    for r in res:
        assert r["equal"] and r["records"] == 4 and r["sync_loads"] == 0
        # 1F1B with 2 stages and 4 micro-batches: the first stage runs F F B F B F B B, so no forward is followed
        # by its own backward (all 2 layers written); the last stage runs F B F B ...: its last layer is kept
        assert r["written"] == 4 * (1 if r["last"] else 2) * per_layer
