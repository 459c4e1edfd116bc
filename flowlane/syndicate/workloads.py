"""Training DAGs for SYNDICATE's experiments (digest §4.2): the two-path toy (E1), a DLRM-like DAG (E2), a
data-parallel linear chain (E3) and random layered DAGs small enough to enumerate (E8).

Every duration and size here is **our own** choice, stated in the builder, not the paper's (its cost table is an
image that did not survive OCR; digest §1.4).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from flowlane.syndicate.cost import CostModel, Option, PathCost, option_space
from flowlane.syndicate.motif import CommOp
from flowlane.syndicate.optsched import Comm, Compute, TrainingDAG


def two_path_toy(
    t_b: float = 2.0,
    t_c: float = 2.0,
    t_d: float = 3.5,
    t_a_fast: float = 3.5,
    t_a_slow: float = 9.5,
    delta: float = 0.0,
) -> tuple[TrainingDAG, CostModel]:
    """E1: comm-ops a (all-to-all) and b, c, d (all-reduce), submitted b, c, d, a; all-reduce runs on path F only,
    the all-to-all on F or S. Greedy + FIFO gives ``t_b + t_c + t_d + t_a^F``; running a on S beside the
    all-reduces gives ``max(t_a^S, t_b + t_c + t_d)``. Defaults: 11 vs 9.5 units (our fixture, not the paper's).
    Durations are in units; 1000 bytes = 1 unit on F (2 ranks, so a ring all-reduce sends its payload once)."""
    unit = 1000
    cost = CostModel(
        {"F": PathCost(0.0, 1.0 / unit, delta), "S": PathCost(0.0, t_a_slow / (t_a_fast * unit), delta)},
        allowed={"all_reduce": ("F",)},
    )

    def ar(name: str, t: float) -> Comm:
        return Comm(
            CommOp(name, "all_reduce", round(t * unit), 2, align=1), ("start",), (Option("F", "ring"),)
        )

    a = CommOp("a", "all_to_all", 2 * round(t_a_fast * unit), 2, align=1)
    steps: list[Compute | Comm] = [
        Compute("start", 0.0),
        ar("b", t_b),
        ar("c", t_c),
        ar("d", t_d),
        Comm(a, ("start",), (Option("F", "direct"), Option("S", "direct"))),
        Compute("end", 0.0, ("a", "b", "c", "d")),
    ]
    return TrainingDAG("two-path-toy", steps, carry=[("end", "start")]), cost


@dataclass(frozen=True)
class DLRMSpec:
    """Sizes and compute times of the DLRM-like DAG (our choice: comm/compute near 1 on the fast path, the range
    the digest recommends for E2; the all-to-alls dominate as in seed 004 §3.2). Compute is 8.5 ms an iteration;
    the comm-ops take ~10 ms on F alone."""

    ranks: int = 16
    """Processes in every collective."""
    a2a_data_mb: float = 16.0
    """Per-rank send buffer of the data-prep all-to-all (sparse ids)."""
    a2a_emb_mb: float = 32.0
    """Per-rank send buffer of the forward and backward embedding all-to-alls."""
    ar_top_mb: float = 8.0
    """Top-MLP gradient all-reduce (O(MB), tree-friendly)."""
    ar_bottom_mb: float = 32.0
    """Bottom-MLP gradient all-reduce (the larger, ring-friendly one)."""
    compute_ms: tuple[float, float, float, float, float, float] = (1.0, 1.0, 1.5, 2.5, 1.5, 1.0)
    """fwd-bottom-mlp, fwd-emb, fwd-top-mlp (with interaction), bwd-top-mlp, bwd-bottom-mlp, bwd-emb."""


def dlrm_paths(incast: float = 0.5) -> CostModel:
    """Two paths (seed 004 Fig. 18): F, GPU-driven NVLink + RDMA (12.5 GB/s per GPU, 100 Gb/s RoCE), and S,
    CPU-driven PCIe + TCP (10 GB/s per GPU); all-reduce stays on F. Alphas, deltas and the incast penalty are
    assumed (labelled so in every result)."""
    return CostModel(
        {"F": PathCost(5e-6, 1 / 12.5e9, 20e-6, incast), "S": PathCost(20e-6, 1 / 10e9, 50e-6, incast)},
        allowed={"all_reduce": ("F",), "reduce_scatter": ("F",)},
    )


def dlrm_dag(
    spec: DLRMSpec | None = None,
    cost: CostModel | None = None,
    segments: Sequence[int] = (1, 2, 4),
    splines: Sequence[int] = (1, 4),
) -> tuple[TrainingDAG, CostModel]:
    """E2: seed 004 Fig. 13's DLRM skeleton. Program order: a2a-data-prep, fwd-emb, a2a-emb-fwd, fwd-bottom-mlp,
    fwd-top-mlp, bwd-top-mlp, ar-top-mlp, a2a-emb-bwd, bwd-bottom-mlp, ar-bottom-mlp, bwd-emb. Across iterations:
    the next forward waits for the MLP all-reduces and the embedding update (optimizer step), and the next data-prep
    all-to-all waits for nothing (it can be prefetched, seed §6.5)."""
    s = spec or DLRMSpec()
    cost = cost or dlrm_paths()
    mb = 1 << 20
    n = s.ranks

    def comm(name: str, kind: str, size_mb: float, deps: tuple[str, ...]) -> Comm:
        nbytes = int(size_mb * mb) // (4 * n) * 4 * n
        op = CommOp(name, kind, nbytes, n)
        return Comm(op, deps, option_space(op, cost, segments=segments, splines=splines))

    fb, fe, ft, bt, bb, be = (x / 1e3 for x in s.compute_ms)
    steps: list[Compute | Comm] = [
        comm("a2a-data-prep", "all_to_all", s.a2a_data_mb, ()),
        Compute("fwd-emb", fe, ("a2a-data-prep",)),
        comm("a2a-emb-fwd", "all_to_all", s.a2a_emb_mb, ("fwd-emb",)),
        Compute("fwd-bottom-mlp", fb),
        Compute("fwd-top-mlp", ft, ("a2a-emb-fwd", "fwd-bottom-mlp")),
        Compute("bwd-top-mlp", bt, ("fwd-top-mlp",)),
        comm("ar-top-mlp", "all_reduce", s.ar_top_mb, ("bwd-top-mlp",)),
        comm("a2a-emb-bwd", "all_to_all", s.a2a_emb_mb, ("bwd-top-mlp",)),
        Compute("bwd-bottom-mlp", bb, ("bwd-top-mlp",)),
        comm("ar-bottom-mlp", "all_reduce", s.ar_bottom_mb, ("bwd-bottom-mlp",)),
        Compute("bwd-emb", be, ("a2a-emb-bwd",)),
    ]
    carry = [("ar-bottom-mlp", "fwd-bottom-mlp"), ("ar-top-mlp", "fwd-top-mlp"), ("bwd-emb", "fwd-emb")]
    return TrainingDAG("dlrm-like", steps, carry), cost


def linear_chain(
    layers: int = 6,
    grad_mb: float = 8.0,
    compute_ms: float = 1.0,
    ranks: int = 8,
    cost: CostModel | None = None,
    segments: Sequence[int] = (1, 2, 4),
) -> tuple[TrainingDAG, CostModel]:
    """E3: data parallelism only. Backward of layer L..1 in program order, each followed by the all-reduce of its
    gradients; the next iteration's forward of layer k waits for all-reduce k. One path: nothing can overlap but
    compute with communication, so ByteScheduler's LIFO with segmentation is already the best order."""
    cost = cost or CostModel({"F": PathCost(5e-6, 1 / 12.5e9, 20e-6)})
    n = ranks
    nbytes = int(grad_mb * (1 << 20)) // (4 * n) * 4 * n
    steps: list[Compute | Comm] = [
        Compute(f"fwd-{k}", compute_ms / 1e3, (f"fwd-{k - 1}",) if k > 1 else ())
        for k in range(1, layers + 1)
    ]
    prev = f"fwd-{layers}"
    for k in range(layers, 0, -1):
        steps.append(Compute(f"bwd-{k}", 2 * compute_ms / 1e3, (prev,)))
        op = CommOp(f"ar-{k}", "all_reduce", nbytes, n)
        steps.append(Comm(op, (f"bwd-{k}",), option_space(op, cost, segments=segments)))
        prev = f"bwd-{k}"
    carry = [(f"ar-{k}", f"fwd-{k}") for k in range(1, layers + 1)]
    return TrainingDAG("linear-chain", steps, carry), cost


def random_dag(seed: int, comms: int = 4, options: int = 3, ranks: int = 4) -> tuple[TrainingDAG, CostModel]:
    """E8: a random layered DAG of ``comms`` comm-ops with ``options`` options each (paths F/S, segments), with
    compute between; small enough to enumerate."""
    rng = random.Random(seed)
    cost = CostModel(
        {"F": PathCost(10e-6, 1 / 10e9, 20e-6, 0.3), "S": PathCost(30e-6, 1 / 4e9, 40e-6, 0.3)},
        allowed={"all_reduce": ("F",)},
    )
    steps: list[Compute | Comm] = []
    names: list[str] = []
    for k in range(comms):
        deps = tuple(rng.sample(names, min(len(names), rng.randint(0, 2))))
        cname = f"c{k}"
        steps.append(Compute(cname, rng.uniform(0.2, 2.0) / 1e3, deps))
        names.append(cname)
        kind = rng.choice(("all_reduce", "all_to_all"))
        op = CommOp(f"x{k}", kind, rng.randint(1, 16) * (1 << 20) // (4 * ranks) * 4 * ranks, ranks)
        space = option_space(op, cost, segments=(1, 2, 4), splines=(1, 2))
        opts = tuple(rng.sample(space, min(options, len(space))))
        steps.append(Comm(op, (cname,), opts))
        names.append(op.name)
    steps.append(Compute("step", 0.1 / 1e3, tuple(n for n in names if n.startswith("x"))))
    return TrainingDAG(f"random-{seed}", steps, carry=[("step", "c0")]), cost


def llm_dp_chain(
    preset: str, dp: int, buckets: int = 4, cost: CostModel | None = None, segments: Sequence[int] = (1, 2, 4)
) -> tuple[TrainingDAG, CostModel]:
    """One pipeline stage of an LLM preset (flowlane.sim.models, seed 000 table 5.5) as SYNDICATE sees its data
    parallelism: forward and backward of the stage's layers in ``buckets`` groups, each backward group followed by
    the DP all-reduce of its bf16 gradients (Megatron's overlapped buckets) over ``dp`` ranks. Per-layer parameters
    12 h^2 / tp (dense); compute 2 (forward) and 4 (backward) FLOPs per parameter per token of one micro-batch, at
    the preset GPU's effective FLOP/s. A linear chain: the E3 control at LLM sizes."""
    from flowlane.sim.models import preset as llm_preset

    job = llm_preset(preset)
    m, par = job.model, job.parallel
    if m.num_experts:
        raise ValueError(f"llm_dp_chain models dense presets; {preset!r} is a mixture of experts")
    layers = m.layers // par.pp
    if not 1 <= buckets <= layers:
        raise ValueError(f"buckets={buckets} must be in [1, {layers}] (the stage's layers)")
    params = 12 * m.hidden**2 / par.tp * layers / buckets
    tokens = par.micro_batch * m.seq_len
    fwd = 2 * params * tokens / job.gpu.flops
    cost = cost or CostModel({"F": PathCost(5e-6, 1 / 12.5e9, 20e-6)})
    nbytes = int(params * 2) // (4 * dp) * 4 * dp
    steps: list[Compute | Comm] = [
        Compute(f"fwd-{k}", fwd, (f"fwd-{k - 1}",) if k > 1 else ()) for k in range(1, buckets + 1)
    ]
    prev = f"fwd-{buckets}"
    for k in range(buckets, 0, -1):
        steps.append(Compute(f"bwd-{k}", 2 * fwd, (prev,)))
        op = CommOp(f"ar-{k}", "all_reduce", nbytes, dp)
        steps.append(Comm(op, (f"bwd-{k}",), option_space(op, cost, segments=segments)))
        prev = f"bwd-{k}"
    return TrainingDAG(
        f"{preset}-dp{dp}", steps, [(f"ar-{k}", f"fwd-{k}") for k in range(1, buckets + 1)]
    ), cost


def llm_moe_stage(
    preset: str,
    ranks: int,
    groups: int = 2,
    cost: CostModel | None = None,
    segments: Sequence[int] = (1, 2),
    splines: Sequence[int] = (1, 2),
) -> tuple[TrainingDAG, CostModel]:
    """One pipeline stage of a mixture-of-experts LLM preset (flowlane.sim.models, seed 000 table 5.5) as SYNDICATE
    sees it: the stage's layers in ``groups`` groups. Forward of a group: attention and router (``attn-fwd``), the
    token dispatch all-to-all (``a2a-disp-fwd``), the experts (``exp-fwd``), the combine all-to-all
    (``a2a-comb-fwd``). Backward mirrors it (``a2a-comb-bwd``, ``exp-bwd``, ``a2a-disp-bwd``, ``attn-bwd``), then
    the data-parallel all-reduce of the group's dense (non-expert) bf16 gradients (``ar``). The next forward of a
    group waits for its all-reduce. Paths F and S as in E2 (:func:`dlrm_paths`; all-reduce on F only).

    Our assumptions (labelled in every result): every collective spans ``ranks`` (EP degree = DP degree, so the
    simulator can map ranks to GPUs); one micro-batch per iteration; a dispatch all-to-all sends
    ``tokens x top_k x hidden`` bf16 values per rank (dropless, the local share not subtracted); the expert
    gradients' reduction over the expert-data-parallel group is left out; compute is FLOPs (forward 2 per
    parameter per token, backward twice that) at the preset GPU's effective FLOP/s."""
    from flowlane.sim.models import preset as llm_preset

    job = llm_preset(preset)
    m, par = job.model, job.parallel
    if not m.num_experts:
        raise ValueError(f"llm_moe_stage models mixture-of-experts presets; {preset!r} is dense")
    layers = m.layers // par.pp
    if not 1 <= groups <= layers:
        raise ValueError(f"groups={groups} must be in [1, {layers}] (the stage's layers)")
    per = layers / groups
    tokens = par.micro_batch * m.seq_len
    flops = job.gpu.flops
    attn_s = (
        per * tokens * (m.attn_flops_per_token(m.seq_len) + m.dense_mlp_flops_per_token()) / par.tp / flops
    )
    exp_s = per * tokens * m.top_k * m.expert_flops_per_token() / par.tp / flops
    cost = cost or dlrm_paths()
    n = ranks

    def comm(name: str, kind: str, nbytes: float, deps: tuple[str, ...]) -> Comm:
        op = CommOp(name, kind, max(4 * n, int(nbytes) // (4 * n) * 4 * n), n)
        return Comm(op, deps, option_space(op, cost, segments=segments, splines=splines))

    a2a = per * tokens * m.top_k * m.hidden * 2 / par.tp
    grads = per * m.dense_params_per_layer() * 2 / par.tp
    steps: list[Compute | Comm] = []
    prev: tuple[str, ...] = ()
    for k in range(1, groups + 1):
        steps += [
            Compute(f"attn-fwd-{k}", attn_s, prev),
            comm(f"a2a-disp-fwd-{k}", "all_to_all", a2a, (f"attn-fwd-{k}",)),
            Compute(f"exp-fwd-{k}", exp_s, (f"a2a-disp-fwd-{k}",)),
            comm(f"a2a-comb-fwd-{k}", "all_to_all", a2a, (f"exp-fwd-{k}",)),
        ]
        prev = (f"a2a-comb-fwd-{k}",)
    for k in range(groups, 0, -1):
        steps += [
            comm(f"a2a-comb-bwd-{k}", "all_to_all", a2a, prev),
            Compute(f"exp-bwd-{k}", 2 * exp_s, (f"a2a-comb-bwd-{k}",)),
            comm(f"a2a-disp-bwd-{k}", "all_to_all", a2a, (f"exp-bwd-{k}",)),
            Compute(f"attn-bwd-{k}", 2 * attn_s, (f"a2a-disp-bwd-{k}",)),
            comm(f"ar-{k}", "all_reduce", grads, (f"attn-bwd-{k}",)),
        ]
        prev = (f"attn-bwd-{k}",)
    carry = [(f"ar-{k}", f"attn-fwd-{k}") for k in range(1, groups + 1)]
    return TrainingDAG(f"{preset}-moe-ep{n}", steps, carry), cost
