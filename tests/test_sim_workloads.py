"""flowlane.sim workload builders, presets, policies and CLI."""

from __future__ import annotations

import json

import pytest

from flowlane.policies import make_policy
from flowlane.policy import (
    CTYPES,
    CoflowMeta,
    FifoPolicy,
    PriorityByKeyPolicy,
    SchedulingPolicy,
)
from flowlane.sim import SimConfig, SimSpecError, Simulator, Workload
from flowlane.sim import cli as sim_cli
from flowlane.sim.models import MODELS, STRATEGIES, LLMJob, ModelConfig, ParallelConfig, preset
from flowlane.sim.workloads import _pipeline_order, build_dlrm, build_dp, build_llm, build_workload, cluster
from flowlane.topology import leaf_spine


def test_table_5_5_presets_have_the_seed_degrees() -> None:
    expect = {
        "qwen-moe-12l": (12, 64, 4, 1, 8, 4096, 4),
        "mixtral-8x7b": (32, 8, 2, 1, 8, 4096, 4),
        "gpt3-13b": (40, 0, 4, 4, 1, 2048, 4),
        "qwen-moe-24l": (24, 64, 8, 8, 32, 4096, 8),
        "mixtral-8x22b": (32, 8, 8, 8, 8, 4096, 8),
        "gpt3-175b": (96, 0, 8, 8, 1, 2048, 8),
    }
    for name, (layers, experts, pp, tp, ep, seq, mbs) in expect.items():
        m, p = MODELS[name], STRATEGIES[name]
        assert (m.layers, m.num_experts, p.pp, p.tp, p.ep, m.seq_len, p.micro_batch) == (
            layers,
            experts,
            pp,
            tp,
            ep,
            seq,
            mbs,
        )
    assert MODELS["gpt3-175b"].total_params() == pytest.approx(175e9, rel=0.03)


def test_1f1b_order_matches_megatron() -> None:
    assert _pipeline_order(4, 0, 6, 1, False)[:6] == [
        ("F", 0, 0),
        ("F", 0, 1),
        ("F", 0, 2),
        ("F", 0, 3),
        ("B", 0, 0),
        ("F", 0, 4),
    ]
    assert _pipeline_order(4, 3, 2, 1, False) == [("F", 0, 0), ("B", 0, 0), ("F", 0, 1), ("B", 0, 1)]
    order = _pipeline_order(2, 0, 4, 2, True)
    for ch in range(2):
        for k in "FB":
            assert sorted(m for kk, c, m in order if kk == k and c == ch) == [0, 1, 2, 3]


def _tiny(**kw: object) -> LLMJob:
    m = ModelConfig("tiny", layers=8, hidden=1024, heads=8, vocab=1, seq_len=512)
    return LLMJob(m, ParallelConfig(**{"tp": 2, "pp": 4, "micro_batch": 1, "num_microbatches": 8, **kw}))


def test_pipeline_bubble_matches_1f1b_closed_form_when_the_network_is_fast() -> None:
    job = _tiny(zero=False)
    topo, w = build_llm(job, 8, topology=leaf_spine(servers=1, gpus_per_server=8, intra_bw=1e20, latency=0.0))
    r = Simulator(topo).run(w)
    tf = next(n.duration for n in w.nodes if getattr(n, "cat", "") == "fwd")
    step = next(n.duration for n in w.nodes if getattr(n, "cat", "") == "step")
    tb = 2 * tf
    M, P = 8, 4
    # vocab=1 logits: ~1e-5
    assert r.iteration_time == pytest.approx((M + P - 1) * (tf + tb) + step, rel=1e-4)


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"schedule": "interleaved"},
        {"zero": False, "dp_algo": "tree", "dp_chunks": 2},
        {"cp": 2, "tp_comm": "flows"},
        {"iterations": 2},
        {"async_p2p": True},
    ],
)
def test_llm_builder_variants_run_and_move_the_expected_pp_bytes(kw: dict) -> None:
    job = _tiny(**kw)
    gpus = 32
    topo, w = build_llm(job, gpus)
    p = job.parallel.resolve(gpus, job.model)
    r = Simulator(topo).run(w, make_policy("priority"))
    assert r.iteration_time > 0 and len(r.iteration_ends) == p.iterations
    pp = sum(c.total_bytes for c in w.coflows if c.meta.ctype == "pp")
    v = p.virtual_stages if p.schedule == "interleaved" else 1
    per_send = p.micro_batch * job.model.seq_len // p.cp * job.model.hidden * 2  # all TP ranks together
    assert pp == pytest.approx(2 * (p.pp * v - 1) * p.microbatches * p.dp * p.cp * per_send * p.iterations)
    assert {c.meta.ctype for c in w.coflows} >= {"pp", "dp"}


def test_moe_all_to_all_volume_equals_routed_tokens() -> None:
    job = preset("qwen-moe-12l", num_microbatches=4)
    topo, w = build_llm(job, 32)
    ep = [c for c in w.coflows if c.meta.ctype == "ep"]
    assert {c.meta.op for c in ep} == {"dispatch", "combine"}
    m, p = job.model, job.parallel
    per_rank = p.micro_batch * m.seq_len * m.top_k * m.hidden * 2
    total_sent = sum(c.total_bytes for c in ep)
    n_a2a = 4 * 4 * 3 * 4  # microbatches * layers per stage * (stages) ... counted below
    n_a2a = len(ep)
    # each a2a moves the off-diagonal share of every rank's tokens: ~ (ep-1)/ep of per_rank * ep, up to skew
    assert total_sent == pytest.approx(n_a2a * per_rank * p.ep * (p.ep - 1) / p.ep, rel=0.15)
    r = Simulator(topo).run(w)
    assert r.cct_by_ctype()["ep"]["count"] == len(ep)


def test_dlrm_and_dp_workloads_run() -> None:
    topo, w = build_dlrm(gpus=8, bandwidth_gbps=50)
    names = {c.name for c in w.coflows}
    assert {"a2a-data-prep", "a2a-emb-fwd", "a2a-emb-bwd", "ar-top-mlp", "ar-bottom-mlp"} <= names
    assert Simulator(topo).run(w).iteration_time > 0
    for model in ("resnet50", "vgg19", "bert"):
        topo, w = build_dp(model, 8)
        r = Simulator(topo).run(w)
        slowest = 10e9 / 8  # ALEPH's slowest worker, 10 Gbps
        assert (
            r.iteration_time
            >= 2 * 7 / 8 * sum(c.total_bytes for c in w.coflows) / 8 / (2 * 7 / 8) / slowest * 0.99
        )


@pytest.mark.parametrize("gpus", [16, 64])
def test_dlrm_all_to_alls_carry_every_gpus_batch_for_each_table_owner(gpus: int) -> None:
    from flowlane.sim.workloads import DLRMConfig

    cfg = DLRMConfig()
    _, w = build_dlrm(cfg, gpus=gpus, bandwidth_gbps=25)
    by = {c.name: c for c in w.coflows}
    tables = cfg.num_tables / gpus
    # B samples per GPU: each owner sends each GPU the pooled vectors of its B samples, and gets their indices
    emb = by["a2a-emb-fwd"]
    assert emb.nbytes == pytest.approx(cfg.batch_per_gpu * tables * cfg.emb_dim * cfg.bytes_per_elem)
    assert by["a2a-emb-bwd"].total_bytes == pytest.approx(emb.total_bytes)
    assert by["a2a-data-prep"].nbytes == pytest.approx(cfg.batch_per_gpu * tables * cfg.pooling * 8)
    # what one owner sends (+ keeps for its own samples) is what its lookups pooled: the global batch's vectors
    pooled = cfg.batch_per_gpu * gpus * tables * cfg.emb_dim * cfg.bytes_per_elem
    assert emb.nbytes[emb.src == 0].sum() == pytest.approx(pooled * (gpus - 1) / gpus)
    if gpus == 16:
        assert emb.total_bytes == pytest.approx(534.77376e6)


@pytest.mark.parametrize("recompute", [False, True])
def test_tp_all_reduces_are_two_per_layer_each_way_plus_the_recomputed_two(recompute: bool) -> None:
    """Megatron's TP: 2 all-reduces per layer forward, 2 backward, and the forward's 2 again when backward
    recomputes the layer; the analytic time and the explicit flows charge the same count."""

    def durations(tp_comm: str) -> dict[str, float]:
        _, w = build_llm(_tiny(recompute=recompute, tp_comm=tp_comm, iterations=1), 8)
        out: dict[str, float] = {}
        for n in w.nodes:
            out.setdefault(getattr(n, "name", ""), getattr(n, "duration", 0.0))
        return out

    analytic, compute_only = durations("analytic"), durations("flows")  # flows: TP is not in the durations
    tp_fwd = analytic["F0 vs0"] - compute_only["F0 vs0"]
    tp_bwd = analytic["B0 vs0"] - compute_only["B0 vs0"]
    assert tp_fwd > 0
    assert tp_bwd == pytest.approx(tp_fwd * (2 if recompute else 1), rel=1e-9)
    _, w = build_llm(_tiny(recompute=recompute, tp_comm="flows", iterations=1), 8)
    tp = {c.name: c.total_bytes for c in w.coflows if c.meta.ctype == "tp"}
    assert tp["tp:B0"] == pytest.approx(tp["tp:F0"] * (2 if recompute else 1))


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: build_llm("gpt3-175b", 1000), r"gpus=1000 is not divisible by tp\*pp\*cp"),
        (lambda: build_llm("gpt3-13b", 32, tp=3), r"gpus=32 is not divisible by tp\*pp\*cp = 3"),
        (lambda: build_llm("gpt3-13b", 32, ep=2), r"ep=2 given for dense model"),
        (lambda: build_llm("mixtral-8x7b", 32, ep=3), r"ep=3 must divide"),
        (lambda: build_llm("gpt3-13b", 32, schedule="zb"), r"schedule 'zb' is not one of"),
        (lambda: build_llm("gpt3-13b", 48, pp=3), r"layers=40 is not divisible .* 3"),
        (lambda: build_llm("gpt3-13b", 32, micro_batch=0), r"micro_batch must be an integer >= 1, got 0"),
        (lambda: build_llm("gpt3-13b", 32, bogus=1), r"unknown ParallelConfig field 'bogus'"),
        (lambda: build_workload("llama", 8), r"unknown workload 'llama'"),
        (lambda: cluster(16, bandwidth_gbps=-1), r"bandwidth must be .* got -1"),
        (lambda: ModelConfig("m", layers=2, hidden=100, heads=3), r"hidden=100 is not divisible by heads=3"),
        (lambda: SimConfig(routing="ospf"), r"routing 'ospf' is not one of"),
        (lambda: make_policy("lifo"), r"unknown scheduling policy 'lifo'"),
        (lambda: CoflowMeta("xp"), r"ctype 'xp' is not one of"),
        (lambda: CoflowMeta("dp", layer=-1), r"layer must be an integer >= 0, got -1"),
    ],
)
def test_bad_specs_are_rejected_naming_the_bad_value(call, match: str) -> None:
    with pytest.raises((SimSpecError, ValueError), match=match):
        call()


def test_bad_workload_graph_is_rejected() -> None:
    w = Workload(["a", "b"])
    with pytest.raises(SimSpecError, match="duration must be a finite number >= 0 s, got -1"):
        w.compute("a", -1)
    with pytest.raises(SimSpecError, match="from device 'a' to itself"):
        w.coflow(([0], [0], [1.0]), "dp")
    with pytest.raises(SimSpecError, match="device index 5 out of range"):
        w.coflow(([0], [5], [1.0]), "dp")
    with pytest.raises(SimSpecError, match="dependency 9 is not an existing node"):
        w.compute("a", 1.0, [9])
    with pytest.raises(SimSpecError, match="got -3.0"):
        w.coflow(([0], [1], [-3.0]), "pp")


def test_policies_interface() -> None:
    a = CoflowMeta("ep", iteration=0, microbatch=1, layer=3)
    b = CoflowMeta("dp", iteration=0, microbatch=0, layer=9)
    c = CoflowMeta("pp", iteration=0, microbatch=1, layer=2)
    assert a.key() == (0, 1, "ep", 3)
    fifo, pri = FifoPolicy(), PriorityByKeyPolicy()
    assert fifo.priority(a) == fifo.priority(b) == ()
    assert sorted([a, b, c], key=pri.priority) == [
        b,
        c,
        a,
    ]  # microbatch first, then ctype (ep=pp), then layer
    assert make_policy("dp-first").priority(b) < make_policy("dp-first").priority(a)

    class Reverse(SchedulingPolicy):
        name = "reverse-layer"

        def priority(self, meta: CoflowMeta) -> tuple:
            return (-meta.layer,)

    assert Reverse().order(a) == (-3, a.seq)  # a policy of one's own: priority, then issue order
    assert set(CTYPES) == {"dp", "pp", "ep", "tp", "cp"}


def test_cli_prints_table_and_writes_json(tmp_path, capsys) -> None:
    rc = sim_cli.main(
        [
            "sim",
            "--workload",
            "gpt3-13b",
            "--gpus",
            "32",
            "--bandwidth",
            "10",
            "--policy",
            "fifo,priority,dp-first",
            "--microbatches",
            "4",
            "--out",
            str(tmp_path),
            "--trace",
        ]
    )
    assert rc == 0
    doc = json.loads((tmp_path / "sim.json").read_text())
    assert doc["simulated"] and set(doc["results"]) == {"fifo", "priority", "dp-first"}
    assert doc["results"]["fifo"]["speedup"] == 1.0
    assert (tmp_path / "sim.png").stat().st_size > 1000
    tr = json.loads((tmp_path / "trace_fifo.json").read_text())
    assert any(e.get("ph") == "X" for e in tr["traceEvents"])
    assert "speedup" in capsys.readouterr().out
    assert sim_cli.main(["sim", "--policy", "nope", "--out", str(tmp_path)]) == 2
    assert sim_cli.main(["sim", "--gpus", "30", "--out", str(tmp_path)]) == 2
