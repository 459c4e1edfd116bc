"""Activation offload on one GPU, side by side in one run: keep / flowlane offload / PyTorch's save_on_cpu / full
recompute (issue 36, item 6; seed 003 §5.4.3, the thesis' keep-offload-recompute comparison).

Model: a stack of bf16 transformer blocks (LayerNorm, fused QKV, causal SDPA forced to the flash kernel, projection,
GELU MLP 4h; attention and MLP are submodules, as in Megatron's TransformerLayer), the same weights and input for
every strategy. Each strategy runs a few forward+backward steps (no optimizer: weights stay fixed, so every step
computes the same gradients):

- ``keep``: plain autograd (run twice: is the baseline itself bitwise reproducible?);
- ``recompute``: ``torch.utils.checkpoint`` around every block (what Megatron-core's
  ``recompute_granularity='full', recompute_method='uniform', recompute_num_layers=1`` does);
- ``torch_save_on_cpu``: PyTorch's own activation offloading, ``torch.autograd.graph.save_on_cpu(pin_memory=True)``
  around the forward: every saved tensor copied to pinned host memory as it is saved, copied back when backward
  needs it, on the compute stream (no budget, no prefetch);
- ``flowlane``: ``flowlane.offload.install(..., OffloadConfig(backend='pinned_cpu', adaptive=True,
  prefetch_groups=4))``: the CUDA tier (bulk per-layer copies on their own streams, persistent pinned pool, reloads
  in stream order, no host waits) with the byte budget and prefetch depth chosen from the CUDA-event timings of the
  profiled step (step 1);
- ``flowlane_all``: the same tier without the budget (every layer but the last offloaded): the PCIe-bound cost;
- ``flowlane_slow3``: the budget allowed to add 3 % of the step (``max_slowdown=0.03``) for more bytes;
- ``flowlane_recompute``: the budget with 5 % of the step to spend (``max_slowdown=0.05, recompute=True``): what the
  link cannot move during forward is bought by recomputing the earliest kept layers (``budget.choose_recompute``);
- ``flowlane_sublayer``, ``flowlane_sublayer_recompute``, ``flowlane_sublayer_all``: the same three with each
  layer's attention and MLP halves as the offload groups (``scope_classes=["Attention", "MLP"]``) instead of the
  layer: backward holds the group it differentiates plus the group being reloaded, so with 1 GiB layers the
  layer-granular floor is two layers (the 2026-11-27 H200 run: ``flowlane_all`` and ``flowlane_recompute`` both at
  0.345x at hidden 8192), and half-layer groups lower it;
- ``flowlane_ordered``, ``flowlane_sublayer_recompute_ordered``: ``flowlane`` and that column with
  ``release="stream_order"``: each stored layer's device tensors dropped in the compute stream's order where the
  budget's timeline says its copy has ended, instead of by ``record_stream`` (the allocator then reuses them once
  the host finds the copy's event complete);
- a third size, hidden 8192 with 16 layers (where the GPU has the memory: ~75 GB), runs keep, recompute and four
  flowlane columns: the two-group floor is a smaller share of a deeper model;
- ``flowlane_ssd``: hidden 4096 only, the posix tier (layer blocks written with O_DIRECT from the pool) with the budget,
  when time is left;
- ``fsdp2`` (correctness only): the model under FSDP2's ``fully_shard`` on one rank, flowlane offload against FSDP2
  without it, bitwise, with FSDP2's gathered weights never offloaded;
- Megatron-core's own fine-grained offloading hooks Megatron's layers, not this block stack:
  ``megatron_offload_bench.py`` runs it beside flowlane on Megatron-core's GPT.

Figures per strategy: peak activation memory = ``max_memory_allocated`` during a step minus the memory allocated
before it (weights, gradients and the input stay allocated); the active and reserved peaks of one more step after
``empty_cache`` (``_reserved_step``: they also count device blocks whose store copy is still queued); step time from
CUDA events (median of the measured steps, after warm-up and the profiled step). Ratios against ``keep``.
Correctness: gradients of every strategy must be ``torch.equal`` to keep's (when keep is itself reproducible); the exit
code is 1 when one is not, 0 otherwise. Goals (issue 36) are reported, not enforced: hidden 8192 >= 70 % less
activation memory at <= 5 % step time, hidden 4096 >= 40 % at <= 5 %, met only when both the allocated and the
reserved peak show it.

    python3 tests/gpu/offload_bench.py --out $OUT/offload_bench.json          # on the GPU machine (< 170 s)
    .venv-llm/bin/python tests/gpu/offload_bench.py --device cpu --out /tmp/ob.json   # logic smoke test on CPU
Without a GPU and without ``--device cpu`` it prints why it skips and exits 0.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.utils.checkpoint import checkpoint  # noqa: E402

from flowlane.offload import OffloadConfig, TensorCache, install  # noqa: E402

T0 = time.monotonic()
MiB = 1 << 20

# (hidden, heads, seq, batch, layers): GPU sizes (bf16, flash attention), CPU smoke sizes
GPU_SIZES = [(4096, 32, 4096, 2, 8), (8192, 64, 4096, 1, 8), (8192, 64, 4096, 1, 16)]
CPU_SIZES = [(64, 4, 64, 2, 4), (128, 4, 64, 1, 4), (128, 4, 64, 1, 16)]
#: the deep size (16 layers) runs these columns only (time), and only with the memory for it (weights + grads + keep)
DEEP_LAYERS = 16
DEEP_COLUMNS = (
    "keep",
    "recompute",
    "flowlane",
    "flowlane_recompute",
    "flowlane_sublayer_recompute",
    "flowlane_sublayer_recompute_ordered",
)
DEEP_NEEDS_BYTES = 100 << 30
GOALS = {4096: 0.40, 8192: 0.70}  # activation memory saved, at <= 5 % step time (issue 36)


class Attention(nn.Module):
    """Pre-norm causal self-attention with its residual: Megatron's TransformerLayer ``self_attention`` half."""

    def __init__(self, h: int, heads: int, dev: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        kw = {"device": dev, "dtype": dtype}
        self.heads = heads
        self.ln = nn.LayerNorm(h, **kw)
        self.qkv, self.proj = nn.Linear(h, 3 * h, **kw), nn.Linear(h, h, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln(x)).split(h, dim=-1)
        q, k, v = (z.view(b, s, self.heads, h // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, h)
        return x + self.proj(y)


class MLP(nn.Module):
    """Pre-norm GELU MLP (4h) with its residual: the layer's ``mlp`` half."""

    def __init__(self, h: int, dev: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        kw = {"device": dev, "dtype": dtype}
        self.ln = nn.LayerNorm(h, **kw)
        self.fc1, self.fc2 = nn.Linear(h, 4 * h, **kw), nn.Linear(4 * h, h, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.ln(x))))


class Block(nn.Module):
    def __init__(self, h: int, heads: int, dev: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        self.attn, self.mlp = Attention(h, heads, dev, dtype), MLP(h, dev, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.attn(x))


class Net(nn.Module):
    def __init__(self, h: int, heads: int, layers: int, dev: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(h, heads, dev, dtype) for _ in range(layers))
        self.recompute = False
        self.save_on_cpu = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with (
            torch.autograd.graph.save_on_cpu(pin_memory=x.is_cuda)
            if self.save_on_cpu
            else contextlib.nullcontext()
        ):
            for blk in self.blocks:
                x = checkpoint(blk, x, use_reentrant=False) if self.recompute else blk(x)
        return x


def _process_age() -> float:
    """Seconds since this process started (interpreter and imports included); 0 where /proc is missing."""
    try:
        with open("/proc/self/stat") as f:
            start = int(f.read().rsplit(")", 1)[1].split()[19]) / os.sysconf("SC_CLK_TCK")
        with open("/proc/uptime") as f:
            return max(0.0, float(f.read().split()[0]) - start)
    except (OSError, ValueError, IndexError):
        return 0.0


# "math" for the bitwise correctness section (flash's backward may not be deterministic)
SDPA = {"kernel": "flash"}


def _sdpa_ctx(dev: torch.device) -> Any:
    """Forward *and* backward inside it: full recompute re-runs attention in backward with the same kernel."""
    if dev.type != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION if SDPA["kernel"] == "flash" else SDPBackend.MATH])


def _provenance(dev: torch.device) -> dict[str, Any]:
    try:
        from flowlane.testing.provenance import provenance

        return provenance(device=torch.cuda.get_device_name(0) if dev.type == "cuda" else "cpu")
    except Exception:  # noqa: BLE001 - the shared helper may be absent in a copied tree: record the same fields
        commit = os.environ.get("FLOWLANE_COMMIT", "")
        if not commit:
            with contextlib.suppress(Exception):
                commit = subprocess.run(
                    ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10
                ).stdout.strip()
        return {
            "command": " ".join(shlex.quote(a) for a in ["python3", *sys.argv]),
            "commit": commit or "unknown (no .git and no FLOWLANE_COMMIT)",
            "host": platform.node(),
            "device": torch.cuda.get_device_name(0) if dev.type == "cuda" else "cpu",
            "utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }


#: the columns of both the correctness check and the benchmark, in the order they run
STRATEGIES = (
    "keep",
    "keep_repeat",
    "recompute",
    "torch_save_on_cpu",
    "flowlane",
    "flowlane_ordered",
    "flowlane_recompute",
    "flowlane_sublayer",
    "flowlane_sublayer_recompute",
    "flowlane_sublayer_recompute_ordered",
    "flowlane_all",
    "flowlane_sublayer_all",
)
#: the flowlane columns with a byte budget, each judged against the goals (the ``*_all`` ones show a floor)
GOAL_COLUMNS = tuple(n for n in STRATEGIES if n.startswith("flowlane") and not n.endswith("_all"))
#: the offload groups (scope classes): a transformer layer, or its attention and MLP halves (``*_sublayer*``)
LAYER_SCOPES, SUBLAYER_SCOPES = ("Block",), ("Attention", "MLP")


class Timer:
    def __init__(self, dev: torch.device) -> None:
        self.dev = dev
        if dev.type == "cuda":
            self.a, self.b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def start(self) -> None:
        if self.dev.type == "cuda":
            self.a.record()
        else:
            self.t = time.perf_counter()

    def stop(self) -> float:
        if self.dev.type == "cuda":
            self.b.record()
            self.b.synchronize()
            return self.a.elapsed_time(self.b) / 1e3
        return time.perf_counter() - self.t


def _fwd_bwd(model: Net, x: torch.Tensor, dev: torch.device) -> None:
    with _sdpa_ctx(dev):
        model(x).float().pow(2).mean().backward()


def _step(model: Net, x: torch.Tensor, dev: torch.device) -> tuple[float, int]:
    """One forward+backward: (seconds, peak bytes above what was allocated before it)."""
    model.zero_grad(set_to_none=False)
    if dev.type == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    tm = Timer(dev)
    tm.start()
    _fwd_bwd(model, x, dev)
    dt = tm.stop()
    peak = torch.cuda.max_memory_allocated() - base if dev.type == "cuda" else 0
    return dt, peak


def _allocator_view(dev: torch.device) -> dict[str, int]:
    """What the caching allocator holds right now, as the host sees it (its reuse decisions are made on the host),
    summed over ``torch.cuda.memory_snapshot()``'s segments: allocated, freed but waiting for another stream's event
    (``active_size - allocated_size``: a store's copy still queued as far as the host knows) and cached free (the
    rest of the segment); zeros on CPU."""
    view = {"reserved": 0, "allocated": 0, "awaiting_copy": 0, "cached_free": 0}
    if dev.type == "cuda":
        for seg in torch.cuda.memory_snapshot():
            view["reserved"] += seg["total_size"]
            view["allocated"] += seg["allocated_size"]
            view["awaiting_copy"] += seg["active_size"] - seg["allocated_size"]
            view["cached_free"] += seg["total_size"] - seg["active_size"]
    return view


def _reserved_step(
    model: nn.Module, run_step: Callable[[], None], layers: Sequence[nn.Module], dev: torch.device
) -> tuple[int, int, list[dict[str, Any]]]:
    """One more step (``run_step``: forward and backward of ``model``), measuring what the allocator *holds* above
    what it held before: (``max_memory_reserved`` after ``empty_cache``, peak ``active_bytes``, the allocator's view
    at each of ``layers``' forward end and backward begin). A store frees its device tensor as soon as its copy is
    queued (``record_stream``), so ``max_memory_allocated`` no longer counts it, but the allocator reuses that block
    only after the copy ran. Active bytes are the allocated ones plus such blocks; reserved adds what the allocator
    cached but could not hand out (rounding, split blocks), for every column alike. Not timed: the step after
    ``empty_cache`` pays for fresh ``cudaMalloc`` calls, and each view walks the allocator's segments."""
    model.zero_grad(set_to_none=False)
    base = active = 0
    if dev.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        base = torch.cuda.memory_reserved()
        active = torch.cuda.memory_stats().get("active_bytes.all.current", 0)
    timeline: list[dict[str, Any]] = []
    phase = ["forward"]
    before = _allocator_view(dev)  # weights, gradients and the input: every view is taken above them

    def mark(at: str) -> None:
        timeline.append({"at": at, **{k: v - before[k] for k, v in _allocator_view(dev).items()}})

    def begin(i: int) -> Any:
        def hook(_g: torch.Tensor) -> None:
            phase[0] = "backward"
            mark(f"backward begin {i}")

        return hook

    def after_forward(i: int) -> Any:
        def hook(_m: nn.Module, _args: Any, out: Any) -> None:
            out = out[0] if isinstance(out, tuple) else out  # Megatron's TransformerLayer: (hidden, context)
            if phase[0] == "forward" and out.requires_grad:  # not a recomputation (which stops early anyway)
                mark(f"forward end {i}")
                out.register_hook(begin(i))

        return hook

    hooks = [layer.register_forward_hook(after_forward(i)) for i, layer in enumerate(layers)]
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    try:
        run_step()
    finally:
        for h in hooks:
            h.remove()
    if dev.type != "cuda":
        return 0, 0, timeline
    torch.cuda.synchronize()
    return (
        torch.cuda.max_memory_reserved() - base,
        torch.cuda.memory_stats().get("active_bytes.all.peak", 0) - active,
        timeline,
    )


def _grads(model: Net) -> list[torch.Tensor]:
    return [p.grad.detach().clone() for p in model.parameters()]


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> tuple[bool, float]:
    eq = all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    diff = 0.0 if eq else max(float((x.float() - y.float()).abs().max()) for x, y in zip(a, b, strict=True))
    return eq, diff


def _install(
    model: Net, cfg: OffloadConfig, dev: torch.device, scopes: tuple[str, ...] = LAYER_SCOPES
) -> TensorCache:
    # on CPU (smoke test) the CUDA tiers' bulk logic runs with synchronous copies
    return install(model, cfg, scope_classes=scopes, bulk_on_cpu=dev.type != "cuda")


def failed_column(name: str, e: BaseException) -> dict[str, Any]:
    """What the JSON keeps of a column that raised (the other columns' figures are kept)."""
    return {
        "strategy": name,
        "status": "error",
        "error": f"{type(e).__name__}: {e}",
        "traceback": traceback.format_exc()[-3000:],
    }


def flowlane_kwargs(name: str, min_bytes: int) -> dict[str, Any]:
    """The ``OffloadConfig`` fields of a flowlane column, from its name: the pinned CUDA tier with the byte budget
    (``adaptive``, profiled on step 1, 4 groups of prefetch); ``_slow3``: 3 % of the step for more bytes;
    ``_recompute``: 5 % (the goals') spent on recomputation; ``_ordered``: stored layers released in the compute
    stream's order; ``_all``: no budget, every layer but the last offloaded."""
    kw: dict[str, Any] = {
        "backend": "pinned_cpu",
        "min_bytes": min_bytes,
        "offload_cpu_tensors": True,
        "on_io_error": "raise",
    }
    if name.endswith("_all"):
        return kw | {"keep_last_k": 1}
    kw.update(adaptive=True, profile_step=1, prefetch_groups=4)
    if name == "flowlane_slow3":
        kw.update(max_slowdown=0.03)
    if "_recompute" in name:
        kw.update(max_slowdown=0.05, recompute=True)
    if name.endswith("_ordered"):
        kw.update(release="stream_order")
    return kw


def measure_steps(
    r: dict[str, Any],
    step: Callable[[], tuple[float, int]],
    reserved_step: Callable[[], tuple[int, int, list[dict[str, Any]]]],
    warm: int,
    a: argparse.Namespace,
) -> None:
    """``warm`` + ``a.steps`` steps (fewer once the time budget is spent), then one reserved-memory step, into
    ``r``: the median step time, every measured one, the largest allocated peak and ``_reserved_step``'s figures."""
    times, peaks = [], []
    for i in range(warm + a.steps):
        if time.monotonic() - T0 > a.budget_s and i >= warm + 1:
            r["stopped_early_for_time"] = True
            break
        dt, peak = step()
        if i >= warm:
            times.append(dt)
            peaks.append(peak)
    r["step_s"] = statistics.median(times) if times else None
    r["step_s_all"] = times
    r["peak_act_bytes"] = max(peaks) if peaks else None
    if times:
        r["peak_reserved_bytes"], r["peak_active_bytes"], r["allocator_timeline"] = reserved_step()


def run_strategy(
    name: str,
    model: Net,
    x: torch.Tensor,
    dev: torch.device,
    a: argparse.Namespace,
    ref: list[torch.Tensor] | None,
    workdir: str,
) -> dict[str, Any]:
    r: dict[str, Any] = {"strategy": name}
    cache = None
    warm = a.warmup
    try:
        if name == "recompute":
            model.recompute = True
        elif name == "torch_save_on_cpu":
            model.save_on_cpu = True
        elif name.startswith("flowlane"):
            kw = flowlane_kwargs(name, a.min_bytes if dev.type == "cuda" else 4096)
            if name == "flowlane_ssd":
                kw.update(backend="posix", dirs=(workdir,))
            scopes = SUBLAYER_SCOPES if "_sublayer" in name else LAYER_SCOPES
            cache = _install(model, OffloadConfig(**kw), dev, scopes)
            r["config"] = kw | {"scope_classes": list(scopes)}
            if kw.get("adaptive"):
                warm = max(warm, 2)  # step 0 learns the layer count, step 1 is the profiled step
        measure_steps(
            r,
            lambda: _step(model, x, dev),
            lambda: _reserved_step(model, lambda: _fwd_bwd(model, x, dev), model.blocks, dev),
            warm,
            a,
        )
        grads = _grads(model)
        if ref is not None:
            r["grads_equal"], r["grads_max_abs_diff"] = _equal(ref, grads)
        if cache is not None:
            cache.wait_io()
            s = cache.stats_snapshot().as_dict()
            r["stats"] = {
                k: s[k]
                for k in (
                    "bytes_written",
                    "bytes_read",
                    "bulk_stores",
                    "bulk_loads",
                    "forwards",
                    "sync_loads",
                    "late_loads",
                    "unused_loads",
                    "fallbacks",
                    "io_errors",
                    "budget_kept",
                    "storages_offloaded",
                    "keep_last_k",
                    "pool",
                    "recomputed_layers",
                    "ordered_releases",  # release="stream_order": layers dropped in stream order
                    "ordered_release_misses",  # ... and those stored too late, left to record_stream
                )
            }
            r["budget_profile"] = s["profile"]
            r["backend"] = cache.backend.describe()
        return r | {"_grads": grads}
    finally:
        model.recompute = model.save_on_cpu = False
        if cache is not None:
            cache.close()


def correctness(dev: torch.device, dtype: torch.dtype, a: argparse.Namespace, workdir: str) -> dict[str, Any]:
    """Small model, math SDPA (deterministic): gradients of keep (twice), recompute and every flowlane path must be
    ``torch.equal`` after warm-up, profiled and budgeted steps."""
    SDPA["kernel"] = "math"
    h, heads, seq, batch, layers = (1024, 8, 1024, 2, 4) if dev.type == "cuda" else (64, 4, 64, 2, 4)
    out: dict[str, Any] = {
        "size": {"hidden": h, "heads": heads, "seq": seq, "batch": batch, "layers": layers},
        "strategies": {},
        "failed": [],
    }
    a2 = argparse.Namespace(**{**vars(a), "steps": 1, "warmup": 1, "min_bytes": MiB})
    try:
        torch.manual_seed(0)
        model = Net(h, heads, layers, dev, dtype)
        x = torch.randn(batch, seq, h, device=dev, dtype=dtype)
        ref = None
        for name in (*STRATEGIES, "flowlane_ssd"):
            try:
                r = run_strategy(name.replace("keep_repeat", "keep"), model, x, dev, a2, ref, workdir)
            except Exception as e:  # noqa: BLE001
                out["strategies"][name] = failed_column(name, e)
                out["failed"].append(f"correctness:{name}: {out['strategies'][name]['error']}")
                continue
            g = r.pop("_grads")
            if name == "keep":
                ref = g
            out["strategies"][name] = {k: r.get(k) for k in ("grads_equal", "grads_max_abs_diff", "stats")}
        det = out["strategies"].get("keep_repeat", {}).get("grads_equal")
        out["keep_bitwise_reproducible"] = det
        for name, r in out["strategies"].items():
            if r.get("grads_equal") is False:
                out["failed"].append(
                    f"correctness:{name}: gradients differ from keep's (max abs diff "
                    f"{r.get('grads_max_abs_diff')}; keep reproducible: {det})"
                )
        del model, x, ref
    finally:
        SDPA["kernel"] = "flash"
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    out["summary"] = (
        "FAILED: " + "; ".join(out["failed"])
        if out["failed"]
        else f"all {len(out['strategies']) - 1} strategies bitwise equal to keep"
    )
    return out


def fsdp2_correctness(dev: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    """FSDP2 (``fully_shard`` on every block and the root, one rank, weights resharded after forward): flowlane's
    offload against the same FSDP2 model without it, bitwise (math SDPA), and the weights FSDP2 gathers never
    offloaded (they are saved as ``W.t()`` views of storages FSDP2 frees after each block's forward)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    SDPA["kernel"] = "math"
    h, heads, seq, batch, layers = (1024, 8, 1024, 2, 4) if dev.type == "cuda" else (64, 4, 64, 2, 4)
    own = not dist.is_initialized()
    out: dict[str, Any] = {"size": {"hidden": h, "seq": seq, "batch": batch, "layers": layers}, "failed": []}
    try:
        if own:  # one rank: an in-process store, no port
            backend = "nccl" if dev.type == "cuda" else "gloo"
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        mesh = init_device_mesh(dev.type, (1,))
        torch.manual_seed(1)
        x = torch.randn(batch, seq, h, device=dev, dtype=dtype)
        grads = {}
        for name in ("fsdp2_keep", "fsdp2_flowlane"):
            torch.manual_seed(0)
            model = Net(h, heads, layers, dev, dtype)
            for blk in model.blocks:
                fully_shard(blk, mesh=mesh)
            fully_shard(model, mesh=mesh)
            cache = None
            if name == "fsdp2_flowlane":
                cfg = OffloadConfig(
                    backend="pinned_cpu",
                    min_bytes=MiB if dev.type == "cuda" else 4096,
                    offload_cpu_tensors=True,
                    on_io_error="raise",
                    keep_last_k=1,
                )
                cache = _install(model, cfg, dev)
            try:
                for _ in range(3):
                    _step(model, x, dev)
                if cache is not None:
                    cache.wait_io()
                    s = cache.stats_snapshot()
                    out["stats"] = {"bytes_written": s.bytes_written, "param_skips": s.param_skips}
            finally:
                if cache is not None:
                    cache.close()
            grads[name] = [p.grad.to_local().clone() for p in model.parameters()]
            del model
        out["grads_equal"], out["grads_max_abs_diff"] = _equal(grads["fsdp2_keep"], grads["fsdp2_flowlane"])
        if not out["grads_equal"]:
            out["failed"].append(
                f"fsdp2: gradients differ from FSDP2's own (max abs diff {out['grads_max_abs_diff']})"
            )
        if out["stats"]["bytes_written"] == 0 or out["stats"]["param_skips"] == 0:
            out["failed"].append(
                f"fsdp2: expected activations stored and weight views skipped, got {out['stats']}"
            )
    except Exception as e:  # noqa: BLE001 - reported in the JSON; the other sections' figures are kept
        out["failed"].append(f"fsdp2: {type(e).__name__}: {e}")
        out["traceback"] = traceback.format_exc()[-3000:]
    finally:
        SDPA["kernel"] = "flash"
        if own and dist.is_initialized():
            dist.destroy_process_group()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return out


def bench_parser(doc: str | None, out: str, budget_s: float, hard_s: float) -> argparse.ArgumentParser:
    """The flags of this bench and ``megatron_offload_bench.py``."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=out)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--steps", type=int, default=3, help="measured steps per strategy (after warm-up)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--min-bytes", type=int, default=4 * MiB)
    ap.add_argument(
        "--budget-s", type=float, default=budget_s, help="stop starting new work after this many seconds"
    )
    ap.add_argument(
        "--hard-s",
        type=float,
        default=hard_s,
        help="dump stacks and exit this many seconds after the process started",
    )
    ap.add_argument("--only-hidden", type=int, default=None)
    return ap


def result_doc(dev: torch.device, dtype: torch.dtype, **fields: Any) -> dict[str, Any]:
    """A result JSON's opening fields (this bench's and ``megatron_offload_bench.py``'s): its label (measured on
    which GPU, or a CPU smoke test), provenance (command, commit), versions, ``fields``, and the lists and flag the
    run fills in."""
    return {
        "label": f"measured on {torch.cuda.get_device_name(0)}"
        if dev.type == "cuda"
        else "CPU smoke test (logic only; figures meaningless)",
        "provenance": _provenance(dev),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "dtype": str(dtype),
        **fields,
        "sizes": [],
        "failed": [],
        "complete": False,
    }


def json_writer(out: Path, doc: dict[str, Any]) -> Callable[[], None]:
    """A function that writes ``doc`` (with the seconds elapsed) to ``out`` atomically: a reader never sees half a
    file, and what a killed run measured so far is kept."""

    def save() -> None:
        doc["elapsed_s"] = time.monotonic() - T0
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(out.name + ".tmp")
        tmp.write_text(json.dumps(doc, indent=1, default=str))
        tmp.replace(out)

    return save


def ratios_vs_keep(st: dict[str, dict[str, Any]], failed: list[str], tag: str) -> None:
    """Each column's step time and three peaks as ratios of keep's; a column whose gradients differ from keep's is
    a failure when keep repeated itself bitwise, else noted as inconclusive."""
    keep = st.get("keep", {})
    reproducible = st.get("keep_repeat", {}).get("grads_equal")
    for name, r in st.items():
        if name == "keep" or r.get("status") != "ok":
            continue
        for key, ratio in (
            ("step_s", "time_ratio_vs_keep"),
            ("peak_act_bytes", "act_mem_ratio_vs_keep"),
            ("peak_reserved_bytes", "reserved_ratio_vs_keep"),
            ("peak_active_bytes", "active_ratio_vs_keep"),
        ):
            if keep.get(key) and r.get(key) is not None:
                r[ratio] = r[key] / keep[key]
        if r.get("grads_equal") is False:
            if reproducible:
                failed.append(
                    f"{tag}:{name}: gradients differ from keep's (max abs diff {r.get('grads_max_abs_diff')})"
                )
            else:
                r["grads_note"] = "keep itself is not bitwise reproducible here: inconclusive"


def goal_verdict(hidden: int, r: dict[str, Any]) -> dict[str, Any] | None:
    """The issue's goal for a column at this hidden size, or None where there is none or figures are missing: met
    when both the allocated and the reserved peak are that much lower (the allocated one misses blocks whose store
    is still queued, ``_reserved_step``) at <= 5 % step time."""
    if hidden not in GOALS or r.get("act_mem_ratio_vs_keep") is None or r.get("time_ratio_vs_keep") is None:
        return None
    saved, time_ratio = 1 - r["act_mem_ratio_vs_keep"], r["time_ratio_vs_keep"]
    saved_reserved = 1 - r["reserved_ratio_vs_keep"] if "reserved_ratio_vs_keep" in r else None
    return {
        "act_mem_saved_at_least": GOALS[hidden],
        "step_time_ratio_at_most": 1.05,
        "act_mem_saved": saved,
        "reserved_saved": saved_reserved,
        "time_ratio": time_ratio,
        "met": saved >= GOALS[hidden]
        and (saved_reserved is None or saved_reserved >= GOALS[hidden])
        and time_ratio <= 1.05,
    }


def main() -> int:
    ap = bench_parser(__doc__, "offload_bench.json", budget_s=140.0, hard_s=165.0)
    ap.add_argument(
        "--alloc-conf",
        default=None,
        help="PYTORCH_CUDA_ALLOC_CONF for this run (e.g. expandable_segments:True), set before CUDA starts",
    )
    a = ap.parse_args()
    if a.alloc_conf is not None:
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = a.alloc_conf  # read when the allocator first runs
    out = Path(a.out)
    if a.device == "cuda" and not torch.cuda.is_available():
        print("offload_bench: skipped: no CUDA device (run with --device cpu for the logic smoke test)")
        return 0
    faulthandler.dump_traceback_later(max(5.0, a.hard_s - _process_age()), exit=True)
    dev = torch.device(a.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    doc = result_doc(dev, dtype, alloc_conf=os.environ.get("PYTORCH_CUDA_ALLOC_CONF"))
    save = json_writer(out, doc)

    # 1. correctness, bitwise, with the deterministic math attention kernel: keep vs every offload path
    doc["correctness"] = correctness(
        dev,
        dtype,
        a,
        workdir := tempfile.mkdtemp(prefix="flowlane-offload-bench-", dir=os.environ.get("TMPDIR", "/tmp")),
    )
    doc["failed"] += doc["correctness"]["failed"]
    doc["fsdp2"] = fsdp2_correctness(dev, dtype)
    doc["failed"] += doc["fsdp2"]["failed"]
    print(
        f"[{time.monotonic() - T0:5.1f}s] FSDP2 with offload (math SDPA, bitwise): {doc['fsdp2']}", flush=True
    )
    print(
        f"[{time.monotonic() - T0:5.1f}s] correctness (math SDPA, bitwise): {doc['correctness']['summary']}",
        flush=True,
    )
    save()
    # 2. the benchmark, flash attention
    sizes = GPU_SIZES if dev.type == "cuda" else CPU_SIZES
    if a.only_hidden:
        sizes = [s for s in sizes if s[0] == a.only_hidden]
    for h, heads, seq, batch, layers in sizes:
        if layers == DEEP_LAYERS and dev.type == "cuda":
            total = torch.cuda.get_device_properties(0).total_memory
            if total < DEEP_NEEDS_BYTES:
                print(
                    f"h{h} x {layers} layers: not run, needs {DEEP_NEEDS_BYTES >> 30} GiB, this GPU has {total >> 30}"
                )
                continue
        size: dict[str, Any] = {
            "hidden": h,
            "heads": heads,
            "seq": seq,
            "batch": batch,
            "layers": layers,
            "strategies": {},
        }
        doc["sizes"].append(size)
        torch.manual_seed(0)
        model = Net(h, heads, layers, dev, dtype)
        x = torch.randn(batch, seq, h, device=dev, dtype=dtype)
        order = [*STRATEGIES, "flowlane_slow3"]
        if h == 4096 or dev.type == "cpu":
            order.append("flowlane_ssd")
        if layers == DEEP_LAYERS:
            order = list(DEEP_COLUMNS)
        ref = None
        for name in order:
            if time.monotonic() - T0 > a.budget_s:
                size["strategies"][name] = {"strategy": name, "status": "not run: time budget spent"}
                continue
            if name == "flowlane_ssd" and time.monotonic() - T0 > 0.6 * a.budget_s:
                size["strategies"][name] = {
                    "strategy": name,
                    "status": "not run: kept time for the main columns",
                }
                continue
            try:
                r = run_strategy(name.replace("keep_repeat", "keep"), model, x, dev, a, ref, workdir)
                r["status"] = "ok"
            except Exception as e:  # noqa: BLE001 - one failing strategy must not lose the others' figures
                r = failed_column(name, e)
                doc["failed"].append(f"h{h}:{name}: {r['error']}")
            grads = r.pop("_grads", None)
            if name == "keep":
                ref = grads
            size["strategies"][name] = r
            print(
                f"[{time.monotonic() - T0:5.1f}s] h{h} {name}: {r.get('status')} "
                f"step {r.get('step_s')} s, peak act {r.get('peak_act_bytes')} B, grads_equal "
                f"{r.get('grads_equal')}",
                flush=True,
            )
            save()
        del ref
        st = size["strategies"]
        size["keep_bitwise_reproducible"] = st.get("keep_repeat", {}).get("grads_equal")
        ratios_vs_keep(st, doc["failed"], f"h{h}")
        verdicts = {name: goal_verdict(h, st.get(name, {})) for name in GOAL_COLUMNS}
        size["goal"] = {name: v for name, v in verdicts.items() if v is not None}  # per flowlane column
        del model, x
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        save()
    with contextlib.suppress(OSError):
        os.rmdir(workdir)
    doc["complete"] = True
    doc["exit_code"] = 1 if doc["failed"] else 0
    save()
    faulthandler.cancel_dump_traceback_later()
    print(f"wrote {out} ({doc['label']}, commit {doc['provenance'].get('commit')})")
    for size in doc["sizes"]:
        print(
            f"hidden {size['hidden']} seq {size['seq']} batch {size['batch']} layers {size['layers']} "
            f"(keep reproducible: {size.get('keep_bitwise_reproducible')})"
        )
        for name, r in size["strategies"].items():
            if r.get("status") != "ok":
                print(f"  {name:35s} {r.get('status')}: {r.get('error', '')}")
                continue
            print(
                f"  {name:35s} step {r['step_s'] * 1e3:8.2f} ms  x{r.get('time_ratio_vs_keep', 1.0):.3f}   "
                f"peak act {r['peak_act_bytes'] / MiB:9.1f} MiB  x{r.get('act_mem_ratio_vs_keep', 1.0):.3f}   "
                f"active x{r.get('active_ratio_vs_keep', 1.0):.3f}  "
                f"reserved {(r.get('peak_reserved_bytes') or 0) / MiB:9.1f} MiB  "
                f"x{r.get('reserved_ratio_vs_keep', 1.0):.3f}   "
                f"grads equal {r.get('grads_equal')}"
            )
            tl = r.get("allocator_timeline") or []
            top = max(tl, key=lambda v: v["reserved"], default=None)
            if top is not None and top["reserved"]:
                print(
                    f"  {'':35s} allocator at its largest ({top['at']}): reserved {top['reserved'] / MiB:.0f} MiB = "
                    f"allocated {top['allocated'] / MiB:.0f} + awaiting a copy "
                    f"{top['awaiting_copy'] / MiB:.0f} + cached free {top['cached_free'] / MiB:.0f}"
                )
        if size.get("goal"):
            print(f"  goal: {size['goal']}")
    if doc["failed"]:
        print("FAILED: " + "; ".join(doc["failed"]))
    return doc["exit_code"]


if __name__ == "__main__":
    sys.exit(main())
