"""`flowlane ssd-estimate`: activation bytes per step, write bandwidth to hide offloading, and SSD lifespan.

Activation bytes follow Korthikanti et al. (the thesis' llm-analysis extension, §5.3.6; digest §2.2.11, A16). Per
transformer layer, with s = sequence, b = micro-batch, h = hidden, a = heads, t = tensor parallelism and e = bytes per
element (2 for fp16/bf16), the saved tensors are:
  replicated across TP ranks unless sequence parallel:  LN inputs 2sbh, QKV input sbh, MLP input sbh  (elements)
                                                          + dropout masks 2sbh (bytes)
  split across TP ranks:  Q,K,V 3sbh, proj input sbh, fc1 out 4sbh, GeLU out 4sbh  (elements)
                          + softmax out a*s*s*b, dropout out a*s*s*b (elements), dropout mask a*s*s*b (bytes)
With fp16, dropout and no flash attention this is the paper's s*b*h*(10 + 24/t + 5*a*s/(h*t)); flash attention drops
the s^2 terms. Step model (thesis §5.3.6): the required PCIe write bandwidth per GPU is the activations per step divided
by *half* the step time, and the lifespan is S_endurance * t_step / S_activations = 2 * S_endurance / B_w. With 4x
Solidigm D7-P5620 (65.4 PBW each) and a write amplification 2.5x better than the JESD rating, 12.1 GB/s gives 3.4
years: the thesis' ">= 3 years at <= 12.1 GB/s per GPU" (digest §2.2.11).

It also reports the byte budget that the tensor cache's ``adaptive`` mode would choose (``budget.choose_plan``, the
same function the cache feeds with CUDA-event timings of a profiled step): here on a modelled step with equal layers,
forward a third of the step, and the link of ``--link-gbps`` (or the slower ``--disk-gbps``).
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict, dataclass

from flowlane.offload.budget import StepProfile, choose_plan

SECONDS_PER_YEAR = 365.25 * 24 * 3600

#: endurance (bytes written over the rated life, JESD218) of drives in the thesis' Table 5.1
SSD_ENDURANCE_PBW: dict[str, float] = {"D7-P5620": 65.4, "D7-P5810": 146.0, "FL6": 342.0}


@dataclass(frozen=True)
class LayerShape:
    seq: int
    micro_batch: int
    hidden: int
    heads: int
    tp: int = 1
    sequence_parallel: bool = False
    flash_attention: bool = False
    dropout: bool = True
    elem_bytes: int = 2

    def __post_init__(self) -> None:
        for n in ("seq", "micro_batch", "hidden", "heads", "tp", "elem_bytes"):
            if getattr(self, n) < 1:
                raise ValueError(f"{n}={getattr(self, n)} must be >= 1")


def activation_bytes_per_layer(x: LayerShape) -> float:
    """Saved-activation bytes of one transformer layer on one GPU (Korthikanti et al., see module docstring)."""
    sbh = x.seq * x.micro_batch * x.hidden
    e = x.elem_bytes
    replicated = 4 * sbh * e + (2 * sbh if x.dropout else 0)
    split = 12 * sbh * e
    if not x.flash_attention:
        ass = x.heads * x.seq * x.seq * x.micro_batch
        split += ass * e + ((ass * e + ass) if x.dropout else 0)
    if x.sequence_parallel:
        replicated /= x.tp
    return replicated + split / x.tp


def activation_bytes_per_step(
    x: LayerShape, layers: int, micro_batches: int = 1, kept_layers: int = 0
) -> float:
    """Bytes offloaded per step per GPU: (layers - kept) per micro-batch (the thesis keeps the last module)."""
    if kept_layers > layers:
        raise ValueError(f"kept_layers={kept_layers} > layers={layers}")
    return activation_bytes_per_layer(x) * (layers - kept_layers) * micro_batches


def required_write_bandwidth(act_bytes_per_step: float, step_time_s: float) -> float:
    """Bytes/s that hide offloading: activations per step over half the step time (thesis §5.3.6)."""
    if step_time_s <= 0:
        raise ValueError(f"step_time_s={step_time_s} must be > 0")
    return act_bytes_per_step / (step_time_s / 2.0)


def effective_endurance_bytes(ssd: str = "D7-P5620", ssds_per_gpu: int = 4, waf_gain: float = 2.5) -> float:
    """Writes a GPU's SSDs absorb: rated PBW x count x the gain of large sequential writes over JESD's random
    workload (thesis: WAF 2.5 in the rating, 1 for SSDTrain)."""
    if ssd not in SSD_ENDURANCE_PBW:
        raise ValueError(f"ssd={ssd!r} is not one of {sorted(SSD_ENDURANCE_PBW)}")
    return SSD_ENDURANCE_PBW[ssd] * 1e15 * ssds_per_gpu * waf_gain


def lifespan_years(endurance_bytes: float, write_bandwidth_Bps: float) -> float:
    """t_life = S_endurance * t_step / S_act = 2 * S_endurance / B_w (writes happen in half of each step)."""
    if write_bandwidth_Bps <= 0:
        raise ValueError(f"write bandwidth {write_bandwidth_Bps} must be > 0")
    return 2.0 * endurance_bytes / write_bandwidth_Bps / SECONDS_PER_YEAR


def gpt_model_flops_per_step(x: LayerShape, layers: int, vocab: int, micro_batches: int = 1) -> float:
    """Megatron's model FLOPs per iteration, 72*B*s*L*h^2*(1 + s/(6h) + V/(12hL)) (digest §2.2.12), per TP rank."""
    b = x.micro_batch * micro_batches
    h = x.hidden
    return 72.0 * b * x.seq * layers * h * h * (1 + x.seq / (6 * h) + vocab / (12 * h * layers)) / x.tp


@dataclass
class Estimate:
    activation_bytes_per_layer: float
    activation_bytes_per_step: float
    step_time_s: float
    required_write_GBps: float
    endurance_PB: float
    lifespan_years: float


def estimate(
    x: LayerShape,
    layers: int,
    micro_batches: int,
    kept_layers: int,
    step_time_s: float,
    ssd: str,
    ssds_per_gpu: int,
    waf_gain: float,
) -> Estimate:
    per_step = activation_bytes_per_step(x, layers, micro_batches, kept_layers)
    bw = required_write_bandwidth(per_step, step_time_s)
    end = effective_endurance_bytes(ssd, ssds_per_gpu, waf_gain)
    return Estimate(
        activation_bytes_per_layer(x), per_step, step_time_s, bw / 1e9, end / 1e15, lifespan_years(end, bw)
    )


def modelled_budget(
    x: LayerShape,
    layers: int,
    step_time_s: float,
    link_GBps: float,
    disk_GBps: float | None = None,
    prefetch: int = 1,
    max_slowdown: float = 0.0,
    recompute: bool = False,
) -> dict[str, float | int]:
    """The byte budget of ``budget.choose_plan`` for one micro-batch of ``layers`` equal layers: forward is a third
    of the step and backward two thirds (the usual 1:2), split evenly over layers; the store and load links run at
    ``link_GBps`` (PCIe), or at ``disk_GBps`` when the SSD is slower. ``max_slowdown`` and ``recompute`` as in
    ``OffloadConfig`` (``budget.choose_plan``, prefetch up to ``prefetch``). The tensor cache computes the same budget
    from CUDA-event timings of a profiled step (``offload.adaptive``); this is its model before any run."""
    for name, v in (("step_time_s", step_time_s), ("link_GBps", link_GBps)):
        if not (math.isfinite(v) and v > 0):
            raise ValueError(f"{name}={v!r} must be a finite number > 0")
    if disk_GBps is not None and not (math.isfinite(disk_GBps) and disk_GBps > 0):
        raise ValueError(f"disk_GBps={disk_GBps!r} must be a finite number > 0")
    if layers < 1:
        raise ValueError(f"layers={layers} must be >= 1")
    if not (math.isfinite(max_slowdown) and 0 <= max_slowdown < 1):
        raise ValueError(f"max_slowdown={max_slowdown!r} must be a fraction in [0, 1) of the step time")
    if recompute and not max_slowdown > 0:
        raise ValueError("recompute needs max_slowdown > 0: recomputation is paid from that step time")
    rate = min(link_GBps, disk_GBps or link_GBps) * 1e9
    per_layer = int(activation_bytes_per_layer(x))
    prof = StepProfile(
        (per_layer,) * layers,
        (step_time_s / 3 / layers,) * layers,
        (2 * step_time_s / 3 / layers,) * layers,
        rate,
        rate,
    )
    b, depth = choose_plan(prof, prefetch, max_slowdown * prof.step_s, recompute)
    return {
        "budget_link_GBps": rate / 1e9,
        "budget_bytes_per_microbatch": b.total_bytes,
        "budget_share_of_activations": b.total_bytes / (per_layer * layers) if per_layer else 0.0,
        "budget_layers_kept_resident": b.keep_last_k,
        "budget_exposed_s": b.exposed_s,
        "budget_resident_share_at_backward_start": b.resident_bytes / (per_layer * layers)
        if per_layer
        else 0.0,
        "budget_peak_share": b.peak_bytes / (per_layer * layers) if per_layer else 0.0,
        "budget_prefetch_groups": depth,
        "budget_layers_recomputed": sum(b.recompute),
        "budget_added_s": b.exposed_s + b.recompute_s,
    }


def thesis_check() -> dict[str, float]:
    """The thesis' Fig. 5.10 bound: the worst case of 12.1 GB/s per GPU with 4x D7-P5620 -> ~3.4 years (>= 3)."""
    end = effective_endurance_bytes("D7-P5620", 4, 2.5)
    return {"endurance_PB": end / 1e15, "write_GBps": 12.1, "lifespan_years": lifespan_years(end, 12.1e9)}


def _positive_float(v: str) -> float:
    try:
        x = float(v)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{v!r} is not a number") from None
    if not (math.isfinite(x) and x > 0):
        raise argparse.ArgumentTypeError(f"{v!r} must be a finite number > 0")
    return x


def _fraction(v: str) -> float:
    try:
        x = float(v)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{v!r} is not a number") from None
    if not (math.isfinite(x) and 0 <= x < 1):
        raise argparse.ArgumentTypeError(f"{v!r} must be a fraction in [0, 1) of the step time")
    return x


def _int_at_least(v: str, low: int) -> int:
    try:
        x = int(v)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{v!r} is not an integer") from None
    if x < low:
        raise argparse.ArgumentTypeError(f"{v!r} must be >= {low}")
    return x


def _positive_int(v: str) -> int:
    return _int_at_least(v, 1)


def _nonneg_int(v: str) -> int:
    return _int_at_least(v, 0)


class _HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The module docstring as written, and every option's default after its help."""


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "ssd-estimate",
        help="activation bytes, write bandwidth and SSD lifespan (SSDTrain)",
        description=__doc__,
        formatter_class=_HelpFormatter,
    )
    p.add_argument("--hidden", type=_positive_int, default=8192, help="hidden size h")
    p.add_argument("--heads", type=_positive_int, default=64, help="attention heads a")
    p.add_argument(
        "--layers", type=_positive_int, default=4, help="transformer layers on this GPU (its pipeline stage)"
    )
    p.add_argument("--seq", type=_positive_int, default=1024, help="sequence length s")
    p.add_argument("--micro-batch", type=_positive_int, default=16, help="micro-batch size b")
    p.add_argument("--micro-batches", type=_positive_int, default=1, help="micro-batches per step")
    p.add_argument("--tp", type=_positive_int, default=2, help="tensor-parallel size t")
    p.add_argument(
        "--sequence-parallel", action="store_true", help="LN and dropout tensors split across TP ranks"
    )
    p.add_argument("--flash-attention", action="store_true", help="no s^2 attention terms (FlashAttention)")
    p.add_argument("--no-dropout", action="store_true", help="no dropout masks or outputs saved")
    p.add_argument("--elem-bytes", type=_positive_int, default=2, help="2 for fp16/bf16, 4 for fp32")
    p.add_argument(
        "--kept-layers", type=_nonneg_int, default=0, help="layers kept in GPU memory (not written)"
    )
    p.add_argument("--step-time", type=_positive_float, default=None, help="measured step time in seconds")
    p.add_argument(
        "--tflops",
        type=_positive_float,
        default=None,
        help="achieved model TFLOP/s per GPU, to model the step time when --step-time is not given",
    )
    p.add_argument(
        "--vocab", type=_positive_int, default=50257, help="vocabulary size (FLOPs of the step model)"
    )
    p.add_argument(
        "--ssd",
        choices=sorted(SSD_ENDURANCE_PBW),
        default="D7-P5620",
        help="drive model, for its rated endurance (thesis Table 5.1)",
    )
    p.add_argument("--ssds-per-gpu", type=_positive_int, default=4, help="drives sharing one GPU's writes")
    p.add_argument(
        "--waf-gain",
        type=_positive_float,
        default=2.5,
        help="how much lower the write amplification is than the JESD rating's",
    )
    p.add_argument(
        "--link-gbps",
        type=_positive_float,
        default=55.0,
        help="GPU-host link for the byte budget, GB/s (55: PCIe D2H measured on an H200)",
    )
    p.add_argument(
        "--disk-gbps",
        type=_positive_float,
        default=None,
        help="the SSDs' write rate per GPU, GB/s: the budget uses the slower of it and --link-gbps",
    )
    p.add_argument(
        "--prefetch-groups",
        type=_positive_int,
        default=1,
        help="layers reloaded ahead, at most (offload config)",
    )
    p.add_argument(
        "--max-slowdown",
        type=_fraction,
        default=0.0,
        help="step time the budget may add, as a fraction (offload config max_slowdown)",
    )
    p.add_argument(
        "--recompute",
        action="store_true",
        help="spend --max-slowdown on recomputing kept layers too (offload config recompute)",
    )
    p.add_argument("--thesis", action="store_true", help="print the thesis' 12.1 GB/s -> >= 3 years check")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")


def run(args: argparse.Namespace) -> int:
    if args.recompute and not args.max_slowdown > 0:
        raise SystemExit(
            "ssd-estimate: --recompute needs --max-slowdown > 0 (recomputation is paid from that time)"
        )
    if args.thesis:
        out: dict = {"thesis_check": thesis_check()}
    else:
        x = LayerShape(
            args.seq,
            args.micro_batch,
            args.hidden,
            args.heads,
            args.tp,
            args.sequence_parallel,
            args.flash_attention,
            not args.no_dropout,
            args.elem_bytes,
        )
        step = args.step_time
        if step is None:
            if args.tflops is None:
                raise SystemExit(
                    "ssd-estimate: give --step-time (seconds) or --tflops (achieved TFLOP/s per GPU)"
                )
            step = gpt_model_flops_per_step(x, args.layers, args.vocab, args.micro_batches) / (
                args.tflops * 1e12
            )
        if args.kept_layers > args.layers:
            raise SystemExit(
                f"ssd-estimate: --kept-layers {args.kept_layers} is more than --layers {args.layers}"
            )
        out = asdict(
            estimate(
                x,
                args.layers,
                args.micro_batches,
                args.kept_layers,
                step,
                args.ssd,
                args.ssds_per_gpu,
                args.waf_gain,
            )
        )
        out.update(
            modelled_budget(
                x,
                args.layers,
                step / args.micro_batches,
                args.link_gbps,
                args.disk_gbps,
                args.prefetch_groups,
                args.max_slowdown,
                args.recompute,
            )
        )
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        flat = out.get("thesis_check", out)
        for k, v in flat.items():
            print(f"{k:28s} {v:,.4g}")
    return 0
