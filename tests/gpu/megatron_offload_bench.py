"""Activation offload on a Megatron-core GPT, one GPU, side by side in one run: stock Megatron-core, its full
recompute, its own fine-grained activation offloading, and flowlane's offload through ``megatron_plugin`` (issue 36,
items 4 and 6: "compare with Megatron-core's fine-grained offloading"; "lower step time than Megatron-core's
offloading at equal memory"). ``offload_bench.py`` measures the same strategies on a plain PyTorch block stack.

Model: Megatron-core's ``GPTModel`` with its local layer spec, bf16 weights, learned positions, a 1024-token
vocabulary, no dropout; the spec's core attention is PyTorch's causal SDPA forced to the flash kernel
(``SDPACoreAttention``, Megatron's ``CoreAttention`` protocol: the local spec's ``DotProductAttention`` would save the
s x s scores that a flash-attention model never holds). Every step runs Megatron's own schedule
(``get_forward_backward_func()``, one micro-batch, no optimizer: weights stay fixed, so every step computes the same
gradients). Each column builds the model from the same weights with its own ``TransformerConfig``:

- ``keep``: stock Megatron-core (run twice: is the baseline itself bitwise reproducible?);
- ``mcore_recompute``: ``recompute_granularity='full', recompute_method='uniform', recompute_num_layers=1``;
- ``mcore_offload``: ``fine_grained_activation_offloading=True`` with every module a dense layer offers
  (``offload_modules=[attn_norm, qkv_linear, core_attn, attn_proj, mlp_norm]``): the inputs of those modules go to
  pinned host memory on Megatron's D2H stream and come back one group ahead in backward; the MLP's inner activations
  (fc1's output, the activation's) stay on the device, as in Megatron-core 0.16.1;
- ``mcore_offload_recompute_mlp``: the same plus ``recompute_granularity='selective', recompute_modules=['mlp']``,
  Megatron's documented pairing of fine-grained offloading with fine-grained recomputation, which frees almost all of
  a layer's activations;
- ``flowlane``: ``megatron_plugin.ssd_offload.install(model, OffloadConfig(backend='pinned_cpu', adaptive=True,
  prefetch_groups=4))`` (TransformerLayer groups, the byte budget from the profiled step 1);
- ``flowlane_recompute``: the budget with 5 % of the step to spend on recomputing the earliest kept layers;
- ``flowlane_sublayer_recompute``: that with each layer's ``SelfAttention`` and ``MLP`` as the groups;
- ``mcore_offload_flowlane``: building on Megatron's offloading: ``mcore_offload``'s config, and flowlane's budget
  (``flowlane``'s) over what Megatron's groups leave on the device (the MLP's input, fc1's and GELU's outputs):
  Megatron's hooks are pushed inside flowlane's, so each tensor is handled by one of the two.

Megatron-core 0.16.1's fine-grained offloading without Transformer Engine: ``PipelineOffloadManager.__enter__`` sets
TE's ``cpu_offload.CPUOffloadEnabled`` flag, which only TE's own layers read (the local spec has none), and raises
"TE CPU offload is not available" where TE is absent. This bench puts a stand-in holding that one flag in its place
(``_te_offload_flag_stand_in``); nothing else of TE is used, and where TE is installed its own module is left alone.

Figures per column as in ``offload_bench.py``: the allocated activation peak (``max_memory_allocated`` during a
step minus what was allocated before it: weights, gradients, the batch), the active and reserved peaks of one more
step after ``empty_cache``, step time from CUDA events (median of the measured steps, after warm-up: Megatron's
offloading learns its groups in its first step, flowlane profiles step 1). Ratios against ``keep``. First a
correctness pass at a small size with the deterministic math SDPA kernel: every column's gradients must be
``torch.equal`` to keep's (exit code 1 otherwise). Reported, not enforced: the issue's memory goals (hidden 4096:
>= 40 % less, 8192: >= 70 %, at <= 5 % step time, on both peaks) and, per Megatron offloading column, whether a
flowlane column holds no more memory (both peaks) at a lower step time.

    python3 tests/gpu/megatron_offload_bench.py --out $OUT/megatron_offload_bench.json     # GPU machine (< 160 s)
    .venv-llm/bin/python tests/gpu/megatron_offload_bench.py --device cpu --out /tmp/mob.json  # logic smoke test
    .venv-llm/bin/python benchmarks/offload_gpu_plot.py $OUT/megatron_offload_bench.json     # memory vs time plot
Without a GPU and without ``--device cpu`` it prints why it skips and exits 0.
"""

from __future__ import annotations

import argparse
import faulthandler
import gc
import os
import sys
import time
import types
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import offload_bench as ob  # noqa: E402  (also puts the repository root on sys.path)
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

T0 = time.monotonic()
MiB = ob.MiB
VOCAB = 1024
# (hidden, heads, seq, batch, layers): offload_bench's 8-layer sizes (one model at a time on the device; keep's
# weights and gradients wait beside it, or in host memory where the GPU lacks room: ``_stash_device``)
GPU_SIZES = [(4096, 32, 4096, 2, 8), (8192, 64, 4096, 1, 8)]
CPU_SIZES = [(64, 4, 64, 2, 4)]
CORRECTNESS_GPU, CORRECTNESS_CPU = (1024, 8, 1024, 2, 4), (64, 4, 64, 2, 4)
GOALS = ob.GOALS

#: every module a dense layer can offload in Megatron-core 0.16.1 (expert_fc1 and moe_act are MoE-only)
DENSE_OFFLOAD_MODULES = ["attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm"]
#: column -> the TransformerConfig fields it sets (the flowlane columns run on stock Megatron-core)
MEGATRON_CONFIGS: dict[str, dict[str, Any]] = {
    "keep": {},
    "mcore_recompute": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
    "mcore_offload": dict(fine_grained_activation_offloading=True, offload_modules=DENSE_OFFLOAD_MODULES),
    "mcore_offload_recompute_mlp": dict(
        fine_grained_activation_offloading=True,
        offload_modules=DENSE_OFFLOAD_MODULES,
        recompute_granularity="selective",
        recompute_modules=["mlp"],
    ),
}
MEGATRON_CONFIGS["mcore_offload_flowlane"] = MEGATRON_CONFIGS["mcore_offload"]
STRATEGIES = (
    "keep",
    "keep_repeat",
    "mcore_recompute",
    "mcore_offload",
    "mcore_offload_recompute_mlp",
    "flowlane",
    "flowlane_recompute",
    "flowlane_sublayer_recompute",
    "mcore_offload_flowlane",
)
#: Megatron's own offloading alone, and the columns where flowlane offloads (the last on top of Megatron's)
MCORE_OFFLOAD_COLUMNS = ("mcore_offload", "mcore_offload_recompute_mlp")
#: flowlane's groups: the layer (its halves are scopes inside it), or the attention and MLP halves (``_sublayer``)
LAYER_SCOPES, SUBLAYER_SCOPES = ("TransformerLayer", "SelfAttention", "MLP"), ("SelfAttention", "MLP")
FLOWLANE_COLUMNS = tuple(n for n in STRATEGIES if "flowlane" in n)


class SDPACoreAttention(torch.nn.Module):
    """Megatron's ``CoreAttention`` protocol over ``F.scaled_dot_product_attention`` (causal; the kernel is chosen by
    ``offload_bench._sdpa_ctx``): query, key and value ``[s, b, heads, head_dim]`` in, ``[s, b, hidden]`` out."""

    def __init__(
        self, *, config: Any, layer_number: int, attn_mask_type: Any, attention_type: str, **_: Any
    ) -> None:
        super().__init__()
        from megatron.core.transformer.enums import AttnMaskType

        if attn_mask_type != AttnMaskType.causal or config.attention_dropout:
            raise ValueError(
                f"SDPACoreAttention: causal attention without dropout only, got attn_mask_type={attn_mask_type!r}, "
                f"attention_dropout={config.attention_dropout}"
            )
        self.scale = config.softmax_scale

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        /,
        *,
        attn_mask_type: Any = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: Any = None,
    ) -> torch.Tensor:
        if attention_bias is not None or packed_seq_params is not None:
            raise ValueError("SDPACoreAttention: no attention bias and no packed sequences")
        s, b, heads, d = query.shape
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, d]
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
        return out.permute(2, 0, 1, 3).reshape(s, b, heads * d)


def _te_offload_flag_stand_in() -> bool:
    """Where Transformer Engine is absent, give Megatron's ``extensions.transformer_engine`` a ``cpu_offload`` that
    holds only the ``CPUOffloadEnabled`` flag its fine-grained offloading sets on entering and leaving a layer (read
    by TE layers alone). True when the stand-in was put in place."""
    from megatron.core.extensions import transformer_engine as te_ext

    if te_ext.cpu_offload is not None:
        return False
    te_ext.cpu_offload = types.SimpleNamespace(CPUOffloadEnabled=False)
    return True


def _megatron_setup(dev: torch.device) -> None:
    """One rank (an in-process store), Megatron's model-parallel state (TP = PP = 1) and RNG tracker."""
    import torch.distributed as dist

    if dev.type == "cpu":
        from megatron_plugin import cpu_shim  # CPU smoke test only

        cpu_shim.apply()
    from megatron.core import parallel_state

    if dev.type == "cuda":
        torch.cuda.set_device(0)  # Megatron's offload summary gathers objects over NCCL
    if not dist.is_initialized():
        backend = "nccl" if dev.type == "cuda" else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)


def build_gpt(
    column: str,
    size: tuple[int, int, int, int, int],
    dev: torch.device,
    dtype: torch.dtype,
    weights: dict[str, torch.Tensor] | None,
) -> torch.nn.Module:
    """The GPT with ``column``'s Megatron config; initialized by Megatron (``weights`` None) or loaded from
    ``weights`` (keep's, ``_stash``), so that every column computes with the same numbers."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.pipeline_parallel.fine_grained_activation_offload import PipelineOffloadManager
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_plugin.te_compat import UNFUSED

    h, heads, seq, _batch, layers = size
    extra = MEGATRON_CONFIGS[column if column in MEGATRON_CONFIGS else "keep"]
    if extra.get("fine_grained_activation_offloading"):
        PipelineOffloadManager.reset_instance()  # a fresh manager (streams, pinned pool) per model
        if dev.type == "cpu":  # smoke test: CPU torch cannot pin; the copies are synchronous there anyway
            PipelineOffloadManager.get_instance().cpu_tensor_pool.pin_memory = False
    torch.manual_seed(0)
    model_parallel_cuda_manual_seed(0)
    cfg = TransformerConfig(
        num_layers=layers,
        hidden_size=h,
        num_attention_heads=heads,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        use_cpu_initialization=dev.type == "cpu",
        perform_initialization=weights is None,
        **UNFUSED,
        # no linear biases (as Llama-style GPTs): with them, 0.16.1's selective "mlp" recompute returns fc2's bias
        # parameter itself from its checkpoint, whose backward then re-enters itself without end (seen on CPU)
        add_bias_linear=False,
        # CPU smoke test: its tensors are far below Megatron's default of 1M elements
        min_offloaded_tensor_size=1024 * 1024 if dev.type == "cuda" else 1024,
        **extra,
    )
    spec = get_gpt_layer_local_spec()
    spec.submodules.self_attention.submodules.core_attention = SDPACoreAttention
    model = GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=VOCAB, max_sequence_length=seq)
    if weights is not None:
        model.load_state_dict(weights, strict=True)
    return model


def _batch(size: tuple[int, int, int, int, int], dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    _h, _heads, seq, batch, _layers = size
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (batch, seq), generator=g).to(dev)
    return tokens, torch.arange(seq, device=dev).unsqueeze(0).expand(batch, seq)


def fwd_bwd(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor], dev: torch.device) -> None:
    """One micro-batch through Megatron's own schedule (no pipelining): forward, loss, backward."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    tokens = batch[0]

    def forward_step_func(data_iterator: Any, m: torch.nn.Module) -> tuple[torch.Tensor, Any]:
        tok, pos = next(data_iterator)
        out = m(tok, pos, None, labels=tok)  # per-token loss; SDPA applies the causal mask itself
        return out, lambda o: (o.float().mean(), {"loss": o.detach().float().mean()})

    with ob._sdpa_ctx(dev):
        get_forward_backward_func()(
            forward_step_func=forward_step_func,
            data_iterator=iter([batch]),
            model=[model],
            num_microbatches=1,
            seq_length=tokens.shape[1],
            micro_batch_size=tokens.shape[0],
            forward_only=False,
        )


def _step(model: torch.nn.Module, batch: Any, dev: torch.device) -> tuple[float, int]:
    """One step: (seconds, peak bytes above what was allocated before it)."""
    model.zero_grad(set_to_none=False)
    base = 0
    if dev.type == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    tm = ob.Timer(dev)
    tm.start()
    fwd_bwd(model, batch, dev)
    dt = tm.stop()
    return dt, (torch.cuda.max_memory_allocated() - base if dev.type == "cuda" else 0)


def _stash_device(model: torch.nn.Module, keep_peak: int | None, dev: torch.device) -> torch.device:
    """Where keep's weights and gradients wait for the other columns: on the GPU when it holds them twice beside a
    model with its gradients and twice keep's activation peak (every later load and comparison then stays on the
    device), else in host memory."""
    if dev.type != "cuda":
        return dev
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    need = 4 * params + 2 * (keep_peak or 0) + (8 << 30)
    return dev if torch.cuda.get_device_properties(0).total_memory > need else torch.device("cpu")


def _stash(model: torch.nn.Module, to: torch.device) -> tuple[dict[str, torch.Tensor], list[torch.Tensor]]:
    """Copies of ``model``'s weights (its state dict) and gradients on ``to``."""
    weights = {k: v.detach().to(to, copy=True) for k, v in model.state_dict().items() if v is not None}
    return weights, [p.grad.detach().to(to, copy=True) for p in model.parameters()]


def _grads_equal(model: torch.nn.Module, ref: list[torch.Tensor]) -> tuple[bool, float]:
    """``torch.equal`` against ``ref``, one parameter at a time on the gradients' device."""
    eq, diff = True, 0.0
    for p, r in zip(model.parameters(), ref, strict=True):
        r = r.to(p.grad.device)
        if not torch.equal(p.grad, r):
            eq, diff = False, max(diff, float((p.grad.float() - r.float()).abs().max()))
    return eq, diff


def run_column(
    name: str,
    size: tuple[int, int, int, int, int],
    dev: torch.device,
    dtype: torch.dtype,
    weights: dict[str, torch.Tensor] | None,
    ref: list[torch.Tensor] | None,
    a: argparse.Namespace,
) -> tuple[dict[str, Any], torch.nn.Module]:
    """Build ``name``'s model, run warm-up and measured steps, one reserved-memory step, compare gradients."""
    from flowlane.offload import OffloadConfig
    from megatron_plugin.ssd_offload import install

    r: dict[str, Any] = {"strategy": name}
    model = build_gpt(name.replace("keep_repeat", "keep"), size, dev, dtype, weights)
    batch = _batch(size, dev)
    handle = None
    warm = a.warmup
    try:
        if name.startswith("mcore_"):
            r["config"] = {"megatron": MEGATRON_CONFIGS[name]}
            warm = max(warm, 2)  # Megatron's offloading learns its groups in the first step
        if "flowlane" in name:  # on top of Megatron's offloading: the tensors saved outside its groups
            kw = ob.flowlane_kwargs(
                name.removeprefix("mcore_offload_"), a.min_bytes if dev.type == "cuda" else 4096
            )
            scopes = SUBLAYER_SCOPES if "_sublayer" in name else LAYER_SCOPES
            handle = install(model, OffloadConfig(**kw), scope_classes=scopes)
            r["config"] = r.get("config", {}) | {"flowlane": kw | {"scope_classes": list(scopes)}}
            warm = max(warm, 2)  # step 0 learns the layer count, step 1 is the profiled step
        ob.measure_steps(
            r,
            lambda: _step(model, batch, dev),
            lambda: ob._reserved_step(model, lambda: fwd_bwd(model, batch, dev), model.decoder.layers, dev),
            warm,
            a,
        )
        if ref is not None:
            r["grads_equal"], r["grads_max_abs_diff"] = _grads_equal(model, ref)
        if handle is not None:
            handle.wait_io()
            s = handle.stats.as_dict()
            r["stats"] = {
                k: s[k]
                for k in ("bytes_written", "bytes_read", "bulk_stores", "bulk_loads", "budget_kept", "pool")
                + ("recomputed_layers", "sync_loads", "late_loads", "unused_loads", "fallbacks", "io_errors")
            }
            r["budget_profile"] = s["profile"]
        if name.startswith("mcore_offload"):
            from megatron.core.pipeline_parallel.fine_grained_activation_offload import PipelineOffloadManager

            try:  # per offload module, counted after Megatron's warm-up step
                moved = dict(PipelineOffloadManager.get_instance().offload_summary_bytes)
            except AttributeError:
                moved = None
            r["stats"] = r.get("stats", {}) | {"offload_summary_bytes": moved}
        return r, model
    finally:
        if handle is not None:
            handle.close()


def _judge(size: dict[str, Any]) -> None:
    """The issue's goals per flowlane column, and each Megatron offloading column against flowlane's."""
    st, h = size["strategies"], size["hidden"]

    def peaks(r: dict[str, Any]) -> tuple[float, float] | None:
        if r.get("act_mem_ratio_vs_keep") is None or r.get("reserved_ratio_vs_keep") is None:
            return None
        return r["act_mem_ratio_vs_keep"], r["reserved_ratio_vs_keep"]

    verdicts = {name: ob.goal_verdict(h, st.get(name, {})) for name in FLOWLANE_COLUMNS}
    size["goal"] = {name: v for name, v in verdicts.items() if v is not None}
    size["vs_megatron_offload"] = {}
    for m in MCORE_OFFLOAD_COLUMNS:
        mr = st.get(m, {})
        if peaks(mr) is None or not mr.get("step_s"):
            continue
        # flowlane columns holding no more memory than Megatron's on both peaks; the fastest of them
        fits = [
            n
            for n in FLOWLANE_COLUMNS
            if peaks(st.get(n, {})) is not None
            and st[n].get("step_s")
            and all(f <= g for f, g in zip(peaks(st[n]), peaks(mr), strict=True))
        ]
        best = min(fits, key=lambda n: st[n]["step_s"], default=None)
        size["vs_megatron_offload"][m] = {
            "megatron": {"time_ratio": mr.get("time_ratio_vs_keep"), "peaks": peaks(mr)},
            "flowlane_at_no_more_memory": best,
            "flowlane": None
            if best is None
            else {"time_ratio": st[best]["time_ratio_vs_keep"], "peaks": peaks(st[best])},
            "faster_at_equal_memory": best is not None and st[best]["step_s"] < mr["step_s"],
        }


def run_size(
    size: tuple[int, int, int, int, int],
    dev: torch.device,
    dtype: torch.dtype,
    a: argparse.Namespace,
    tag: str,
    save: Any,
) -> dict[str, Any]:
    h, heads, seq, batch, layers = size
    out: dict[str, Any] = {
        "hidden": h,
        "heads": heads,
        "seq": seq,
        "batch": batch,
        "layers": layers,
        "strategies": {},
        "failed": [],
    }
    weights: dict[str, torch.Tensor] | None = None
    ref: list[torch.Tensor] | None = None
    for name in STRATEGIES:
        if tag != "correctness" and time.monotonic() - T0 > a.budget_s:
            out["strategies"][name] = {"strategy": name, "status": "not run: time budget spent"}
            continue
        model = None
        try:
            r, model = run_column(name, size, dev, dtype, weights, ref, a)
            r["status"] = "ok"
            if name == "keep":
                out["stash"] = str(to := _stash_device(model, r.get("peak_act_bytes"), dev))
                weights, ref = _stash(model, to)
        except Exception as e:  # noqa: BLE001 - one failing column must not lose the others' figures
            r = ob.failed_column(name, e)
            out["failed"].append(f"{tag}:{name}: {r['error']}")
        finally:
            del model
            gc.collect()
            if dev.type == "cuda":
                torch.cuda.empty_cache()
        out["strategies"][name] = r
        print(
            f"[{time.monotonic() - T0:5.1f}s] {tag} h{h} {name}: {r.get('status')} step {r.get('step_s')} s, "
            f"peak act {r.get('peak_act_bytes')} B, grads_equal {r.get('grads_equal')}",
            flush=True,
        )
        save()
    out["keep_bitwise_reproducible"] = out["strategies"].get("keep_repeat", {}).get("grads_equal")
    ob.ratios_vs_keep(out["strategies"], out["failed"], tag)  # a difference fails only if keep repeats itself
    return out


def main() -> int:
    ap = ob.bench_parser(__doc__, "megatron_offload_bench.json", budget_s=130.0, hard_s=160.0)
    a = ap.parse_args()
    out = Path(a.out)
    if a.device == "cuda" and not torch.cuda.is_available():
        print(
            "megatron_offload_bench: skipped: no CUDA device (run with --device cpu for the logic smoke test)"
        )
        return 0
    try:
        import megatron.core  # noqa: F401
    except ImportError as e:
        print(f"megatron_offload_bench: skipped: megatron-core is not importable here ({e})")
        return 0
    faulthandler.dump_traceback_later(max(5.0, a.hard_s - ob._process_age()), exit=True)
    # deterministic cuBLAS (read when CUDA starts)
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    dev = torch.device(a.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    _megatron_setup(dev)
    import megatron.core as mc

    doc = ob.result_doc(
        dev,
        dtype,
        megatron_core=getattr(mc, "__version__", "unknown"),
        te_offload_flag_stand_in=_te_offload_flag_stand_in(),
    )

    save = ob.json_writer(out, doc)

    # 1. correctness, bitwise, with the math attention kernel and PyTorch's deterministic algorithms (the embedding's
    # backward accumulates repeated tokens with atomics otherwise; warn_only: an op without a deterministic
    # version warns; uninitialized memory is filled, so a read of it shows)
    ob.SDPA["kernel"] = "math"
    torch.use_deterministic_algorithms(True, warn_only=True)
    a_correct = argparse.Namespace(**{**vars(a), "steps": 1, "warmup": 1, "min_bytes": MiB})
    try:
        doc["correctness"] = run_size(
            CORRECTNESS_GPU if dev.type == "cuda" else CORRECTNESS_CPU,
            dev,
            dtype,
            a_correct,
            "correctness",
            save,
        )
    finally:
        torch.use_deterministic_algorithms(False)
        ob.SDPA["kernel"] = "flash"
    doc["failed"] += doc["correctness"]["failed"]
    save()
    # 2. the benchmark, flash attention
    sizes = GPU_SIZES if dev.type == "cuda" else CPU_SIZES
    for size in [s for s in sizes if a.only_hidden in (None, s[0])]:
        r = run_size(size, dev, dtype, a, f"h{size[0]}", save)
        doc["sizes"].append(r)
        doc["failed"] += r["failed"]
        _judge(r)
        save()
    doc["complete"] = True
    doc["exit_code"] = 1 if doc["failed"] else 0
    save()
    faulthandler.cancel_dump_traceback_later()
    print(f"wrote {out} ({doc['label']}, commit {doc['provenance'].get('commit')})")
    for size in doc["sizes"]:
        print(f"hidden {size['hidden']} seq {size['seq']} batch {size['batch']} layers {size['layers']}")
        for name, r in size["strategies"].items():
            if r.get("status") != "ok":
                print(f"  {name:30s} {r.get('status')}: {r.get('error', '')}")
                continue
            print(
                f"  {name:30s} step {r['step_s'] * 1e3:8.2f} ms x{r.get('time_ratio_vs_keep', 1.0):.3f}  "
                f"allocated x{r.get('act_mem_ratio_vs_keep', 1.0):.3f}  "
                f"reserved x{r.get('reserved_ratio_vs_keep', 1.0):.3f}  grads equal {r.get('grads_equal')}"
            )
        print(f"  goals: {size.get('goal')}")
        print(f"  against Megatron-core's offloading: {size.get('vs_megatron_offload')}")
    if doc["failed"]:
        print("FAILED: " + "; ".join(doc["failed"]))
    return doc["exit_code"]


if __name__ == "__main__":
    sys.exit(main())
