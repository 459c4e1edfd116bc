"""Model and parallelism config schema, presets (seed 000 table 5.5) and the FLOPs/throughput compute model.

Compute model (assumptions, stated once):
* FLOPs of a transformer layer per micro-batch forward (b sequences of s tokens, hidden h, FFN f, kv width h_kv):
  QKV 2bsh(h+2h_kv) + output 2bsh^2 + attention scores and values 4bs^2h + MLP 2bshf*(3 if SwiGLU else 2); an MoE
  layer adds a router 2bshE and runs top_k experts of width f_moe per token (dropless). Logits 2bshV on the last
  stage. Backward = 2x forward (+1x forward with full activation recomputation). These are the standard dense
  counts (Narayanan et al., SC'21) [ext].
* Time = FLOPs / (peak * efficiency). Default GPU: A100 (Hermod's testbed, seed 000 §5.5.1), 312 TFLOP/s bf16 peak
  at 50% efficiency (Megatron reports ~44-52% of peak for GPT-3-class runs [ext]); element size 2 bytes (bf16).
* TP is split evenly over TP ranks; TP communication is either an analytic ring all-reduce time on the intra-node
  route (tp_comm="analytic", default: Hermod does not schedule TP, seed 000 §5.2.2) or explicit flows; either way
  2 all-reduces per layer in forward and 2 in backward, 4 with full activation recomputation (Megatron-core's
  counts; ``flowlane.sim.workloads._LLMBuilder.tp_all_reduces``), added to the compute time, not scaled with it.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

from flowlane.sim.collectives import A2A_MODES as EP_A2A
from flowlane.sim.graph import SimSpecError

SCHEDULES = ("1f1b", "interleaved")
TP_COMM = ("analytic", "flows")
DP_ALGOS = ("ring", "tree")
EP_LAYOUTS = ("auto", "dp", "fold")


def _pos_int(obj: object, name: str, v: object, minimum: int = 1) -> None:
    if not isinstance(v, int) or isinstance(v, bool) or v < minimum:
        raise SimSpecError(f"{type(obj).__name__}.{name} must be an integer >= {minimum}, got {v!r}")


@dataclass(frozen=True)
class GPUSpec:
    name: str = "A100"
    peak_flops: float = 312e12
    efficiency: float = 0.5
    hbm_bw: float = 1.5e12  # bytes/s, for the memory-bound optimizer step

    def __post_init__(self) -> None:
        if not (self.peak_flops > 0):
            raise SimSpecError(f"GPUSpec.peak_flops must be > 0 FLOP/s, got {self.peak_flops!r}")
        if not (0 < self.efficiency <= 1):
            raise SimSpecError(f"GPUSpec.efficiency must be in (0, 1], got {self.efficiency!r}")

    @property
    def flops(self) -> float:
        return self.peak_flops * self.efficiency


GPUS = {
    "A100": GPUSpec(),
    "H100": GPUSpec("H100", 989e12, 0.45, 3.35e12),
    "V100": GPUSpec("V100", 125e12, 0.45, 0.9e12),
}


@dataclass(frozen=True)
class ModelConfig:
    """A decoder-only transformer (dense or MoE)."""

    name: str
    layers: int
    hidden: int
    heads: int
    ffn_hidden: int = 0  # 0 -> 4 * hidden
    kv_heads: int = 0  # 0 -> heads (no GQA)
    vocab: int = 51200
    seq_len: int = 2048
    swiglu: bool = False
    num_experts: int = 0  # 0 = dense
    top_k: int = 2
    moe_ffn_hidden: int = 0  # 0 -> ffn_hidden
    shared_expert_ffn: int = 0

    def __post_init__(self) -> None:
        for nm in ("layers", "hidden", "heads", "vocab", "seq_len"):
            _pos_int(self, nm, getattr(self, nm))
        for nm in ("ffn_hidden", "kv_heads", "num_experts", "moe_ffn_hidden", "shared_expert_ffn"):
            _pos_int(self, nm, getattr(self, nm), 0)
        if self.hidden % self.heads:
            raise SimSpecError(
                f"ModelConfig {self.name!r}: hidden={self.hidden} is not divisible by heads={self.heads}"
            )
        if self.num_experts:
            _pos_int(self, "top_k", self.top_k)
            if self.top_k > self.num_experts:
                raise SimSpecError(
                    f"ModelConfig {self.name!r}: top_k={self.top_k} > num_experts={self.num_experts}"
                )

    @property
    def moe(self) -> bool:
        return self.num_experts > 0

    @property
    def f(self) -> int:
        return self.ffn_hidden or 4 * self.hidden

    @property
    def f_moe(self) -> int:
        return self.moe_ffn_hidden or self.f

    @property
    def h_kv(self) -> float:
        return self.hidden * (self.kv_heads or self.heads) / self.heads

    @property
    def mlp_mats(self) -> int:
        return 3 if self.swiglu else 2

    # FLOPs per token (forward), excluding attention's s^2 term
    def attn_flops_per_token(self, ctx: int) -> float:
        h = self.hidden
        return 2 * h * (h + 2 * self.h_kv) + 2 * h * h + 4 * ctx * h

    def dense_mlp_flops_per_token(self) -> float:
        if self.moe:
            return (
                2 * self.hidden * self.num_experts + 2 * self.hidden * self.shared_expert_ffn * self.mlp_mats
            )
        return 2 * self.hidden * self.f * self.mlp_mats

    def expert_flops_per_token(self) -> float:
        """One expert applied to one token (MoE only)."""
        return 2 * self.hidden * self.f_moe * self.mlp_mats

    # parameters per layer
    def dense_params_per_layer(self) -> float:
        h = self.hidden
        attn = h * (h + 2 * self.h_kv) + h * h
        if self.moe:
            return attn + h * self.num_experts + h * self.shared_expert_ffn * self.mlp_mats
        return attn + h * self.f * self.mlp_mats

    def expert_params(self) -> float:
        return self.hidden * self.f_moe * self.mlp_mats

    def total_params(self) -> float:
        return (
            self.layers * (self.dense_params_per_layer() + self.num_experts * self.expert_params())
            + self.vocab * self.hidden
        )


@dataclass(frozen=True)
class ParallelConfig:
    """Hybrid-parallel strategy. ``dp`` is derived from the GPU count when 0.

    EP placement (``ep_layout``; the thesis does not state it, decisions.md A4.4, A6.1 #8):
    * ``dp``: Megatron-core's default process-group order tp-cp-ep-dp-pp -- an EP group is ``ep`` consecutive DP
      replicas with the same TP and CP rank, experts are tensor-parallel with the dense TP (expert-TP = TP). With
      TP = 8 GPUs per server every EP peer sits in another server, so the all-to-all crosses the NICs and contends
      with PP and DP there (seed 000 §5.1.1: "DP, PP, and EP are typically deployed across multiple nodes"; EP-first
      gains 1.51x in table 5.2, which needs EP on the network). Needs ``dp % ep == 0``.
    * ``fold``: Megatron "MoE parallel folding" -- EP over ``ep`` consecutive ranks of the stage's TP x CP x DP
      ranks, expert-TP = 1 (when ``ep <= tp`` the all-to-all stays inside a server, on NVLink).
    * ``auto`` (default): ``dp`` when ``dp % ep == 0``, else ``fold`` (e.g. Qwen-MoE-24L, EP 32 > DP 16 at 1,024
      GPUs: EP then spans 4 servers).

    ``iterations`` (default 2): the steady-state iteration time is the gap between the last two iteration ends, so
    that iteration i's DP parameter all-gathers overlap iteration i+1's forward (seed 000 §5.2.2 Case III).
    ``overlap_param_gather`` (ZeRO only, default on, Megatron's ``--overlap-param-gather``): the all-gather of a
    bucket gates only the first forward of its layers in the next iteration; off = every all-gather finishes
    before the stage's next forward starts (no Case III overlap). ``overlap_grad_reduce`` (default on, Megatron's
    ``--overlap-grad-reduce``): a bucket's reduction starts when the last microbatch's backward has produced it
    (Case II); off = all reductions start after the stage's whole backward. Both off is Megatron-LM's default,
    the thesis' "vanilla Megatron-LM" baseline (§5.5.1) as far as it is stated."""

    tp: int = 1
    pp: int = 1
    dp: int = 0
    ep: int = 1
    cp: int = 1
    micro_batch: int = 1
    num_microbatches: int = 0  # 0 -> 2 * pp (global batch is not stated in the seed, table 5.5)
    schedule: str = "1f1b"
    virtual_stages: int = 2  # model chunks per device for interleaved 1F1B
    # ZeRO-2 / distributed optimizer: RS + AG (the thesis' default, §5.2.2); False: all-reduce
    zero: bool = True
    bucket_params: int = 0  # 0 -> Megatron's max(40M, 1M * dp) elements per bucket [ext]
    dp_algo: str = "ring"
    dp_chunks: int = 1
    tp_comm: str = "analytic"
    recompute: bool = False
    moe_skew: float = 0.5  # Zipf exponent of expert popularity (0 = uniform); the seed gives no distribution
    iterations: int = 2
    ep_layout: str = "auto"
    async_p2p: bool = False  # 1F1B sends do not block the sender's next op (thesis Case I, FlexFlow task DAG)
    overlap_param_gather: bool = True
    overlap_grad_reduce: bool = True
    # MoE all-to-all: plain (NCCL), matched / phases / phases_bottleneck (Hermod, §5.3.2)
    ep_a2a: str = "plain"
    bytes_per_elem: int = 2
    grad_bytes: int = 2

    def __post_init__(self) -> None:
        for nm in (
            "tp",
            "pp",
            "ep",
            "cp",
            "micro_batch",
            "virtual_stages",
            "dp_chunks",
            "iterations",
            "bytes_per_elem",
            "grad_bytes",
        ):
            _pos_int(self, nm, getattr(self, nm))
        for nm in ("dp", "num_microbatches", "bucket_params"):
            _pos_int(self, nm, getattr(self, nm), 0)
        if self.schedule not in SCHEDULES:
            raise SimSpecError(f"ParallelConfig.schedule {self.schedule!r} is not one of {SCHEDULES}")
        if self.tp_comm not in TP_COMM:
            raise SimSpecError(f"ParallelConfig.tp_comm {self.tp_comm!r} is not one of {TP_COMM}")
        if self.dp_algo not in DP_ALGOS:
            raise SimSpecError(f"ParallelConfig.dp_algo {self.dp_algo!r} is not one of {DP_ALGOS}")
        if self.ep_layout not in EP_LAYOUTS:
            raise SimSpecError(f"ParallelConfig.ep_layout {self.ep_layout!r} is not one of {EP_LAYOUTS}")
        if self.ep_a2a not in EP_A2A:
            raise SimSpecError(f"ParallelConfig.ep_a2a {self.ep_a2a!r} is not one of {EP_A2A}")
        if not (self.moe_skew >= 0):
            raise SimSpecError(f"ParallelConfig.moe_skew must be >= 0, got {self.moe_skew!r}")

    @property
    def microbatches(self) -> int:
        return self.num_microbatches or 2 * self.pp

    def resolve(self, gpus: int, model: ModelConfig) -> ParallelConfig:
        """Fill ``dp`` from the GPU count and check divisibility; errors name the bad value."""
        _pos_int(self, "gpus", gpus)
        per = self.tp * self.pp * self.cp
        if gpus % per:
            raise SimSpecError(
                f"gpus={gpus} is not divisible by tp*pp*cp = {self.tp}*{self.pp}*{self.cp} = {per}"
            )
        dp = gpus // per
        if self.dp and self.dp != dp:
            raise SimSpecError(f"ParallelConfig.dp={self.dp} but gpus/(tp*pp*cp) = {dp}")
        p = replace(self, dp=dp)
        vs = p.pp * (p.virtual_stages if p.schedule == "interleaved" else 1)
        if model.layers % vs:
            raise SimSpecError(
                f"model {model.name!r}: layers={model.layers} is not divisible by the number of "
                f"(virtual) pipeline stages {vs}"
            )
        if p.schedule == "interleaved" and p.microbatches % p.pp:
            raise SimSpecError(
                f"interleaved 1F1B needs num_microbatches ({p.microbatches}) divisible by pp={p.pp}"
            )
        if model.moe:
            ranks = p.tp * p.cp * dp
            if p.ep > ranks or ranks % p.ep:
                raise SimSpecError(
                    f"ep={p.ep} must divide tp*cp*dp = {ranks} (EP is folded into a stage's ranks)"
                )
            if model.num_experts % p.ep:
                raise SimSpecError(
                    f"model {model.name!r}: num_experts={model.num_experts} is not divisible by ep={p.ep}"
                )
            if p.ep_layout == "dp" and dp % p.ep:
                raise SimSpecError(f"ep_layout='dp' needs ep={p.ep} to divide dp={dp}; use ep_layout='fold'")
            if p.ep_layout == "auto":
                p = replace(p, ep_layout="dp" if dp % p.ep == 0 else "fold")
        elif p.ep != 1:
            raise SimSpecError(f"ep={p.ep} given for dense model {model.name!r}; use ep=1")
        if model.seq_len % p.cp:
            raise SimSpecError(f"seq_len={model.seq_len} is not divisible by cp={p.cp}")
        return p


# Seed 000 table 5.5 (exact degrees, layers, experts, sequence length, micro-batch size). Architecture widths are
# from the public model cards [ext]; where the table differs from the card (Mixtral-8x22B has 56 layers, Qwen1.5-MoE
# 60 routed experts) the table wins, since it is what the thesis simulated.
MODELS: dict[str, ModelConfig] = {
    "qwen-moe-12l": ModelConfig(
        "qwen-moe-12l",
        12,
        2048,
        16,
        ffn_hidden=5632,
        vocab=151936,
        seq_len=4096,
        swiglu=True,
        num_experts=64,
        top_k=4,
        moe_ffn_hidden=1408,
        shared_expert_ffn=5632,
    ),
    "qwen-moe-24l": ModelConfig(
        "qwen-moe-24l",
        24,
        2048,
        16,
        ffn_hidden=5632,
        vocab=151936,
        seq_len=4096,
        swiglu=True,
        num_experts=64,
        top_k=4,
        moe_ffn_hidden=1408,
        shared_expert_ffn=5632,
    ),
    "mixtral-8x7b": ModelConfig(
        "mixtral-8x7b",
        32,
        4096,
        32,
        ffn_hidden=14336,
        kv_heads=8,
        vocab=32000,
        seq_len=4096,
        swiglu=True,
        num_experts=8,
        top_k=2,
    ),
    "mixtral-8x22b": ModelConfig(
        "mixtral-8x22b",
        32,
        6144,
        48,
        ffn_hidden=16384,
        kv_heads=8,
        vocab=32768,
        seq_len=4096,
        swiglu=True,
        num_experts=8,
        top_k=2,
    ),
    "gpt3-13b": ModelConfig("gpt3-13b", 40, 5120, 40, seq_len=2048),
    "gpt3-175b": ModelConfig("gpt3-175b", 96, 12288, 96, seq_len=2048),
}

STRATEGIES: dict[str, ParallelConfig] = {
    # testbed (32 GPUs)
    "qwen-moe-12l": ParallelConfig(tp=1, pp=4, ep=8, micro_batch=4),
    "mixtral-8x7b": ParallelConfig(tp=1, pp=2, ep=8, micro_batch=4),
    "gpt3-13b": ParallelConfig(tp=4, pp=4, micro_batch=4),
    # simulation (1024 - 8192 GPUs)
    "qwen-moe-24l": ParallelConfig(tp=8, pp=8, ep=32, micro_batch=8),
    "mixtral-8x22b": ParallelConfig(tp=8, pp=8, ep=8, micro_batch=8),
    "gpt3-175b": ParallelConfig(tp=8, pp=8, micro_batch=8),
}


@dataclass(frozen=True)
class LLMJob:
    model: ModelConfig
    parallel: ParallelConfig
    gpu: GPUSpec = field(default_factory=GPUSpec)


def preset(name: str, **overrides: object) -> LLMJob:
    """Table 5.5 model + its default strategy; ``overrides`` are ParallelConfig fields."""
    if name not in MODELS:
        raise SimSpecError(f"unknown LLM preset {name!r}; choose one of {sorted(MODELS)}")
    allowed = {f.name for f in fields(ParallelConfig)}
    for k in overrides:
        if k not in allowed:
            raise SimSpecError(f"unknown ParallelConfig field {k!r}; allowed: {sorted(allowed)}")
    return LLMJob(MODELS[name], replace(STRATEGIES[name], **overrides))  # type: ignore[arg-type]
