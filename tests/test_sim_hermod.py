"""flowlane.sim fidelity for Hermod's simulation (seed 000 §5.2.2 / §5.5): EP placement, multi-iteration overlap of
DP coflows with PP/EP coflows (Cases II and III), and the hermod policies reachable from the simulator."""

from __future__ import annotations

import json

import numpy as np
import pytest

from flowlane.policies import make_policy
from flowlane.sim import Simulator
from flowlane.sim import cli as sim_cli
from flowlane.sim.models import LLMJob, ModelConfig, ParallelConfig
from flowlane.sim.workloads import build_llm, cluster

TINY_MOE = ModelConfig(
    "tiny-moe", layers=4, hidden=256, heads=4, vocab=1, seq_len=256, num_experts=8, top_k=2
)
TINY_DENSE = ModelConfig("tiny", layers=8, hidden=1024, heads=8, vocab=1, seq_len=512)


def _moe(**kw: object) -> LLMJob:
    return LLMJob(
        TINY_MOE, ParallelConfig(**{"tp": 4, "pp": 2, "ep": 4, "micro_batch": 1, "num_microbatches": 4, **kw})
    )


def _servers(w, idx: np.ndarray) -> np.ndarray:
    return np.array([w.devices[i].split("/")[0] for i in idx])


def test_ep_layout_dp_puts_the_all_to_all_across_servers_and_fold_keeps_it_inside() -> None:
    _, w = build_llm(_moe(), 64, 10.0)  # tp 4, dp 8: two DP replicas per server
    assert w.info["ep_layout"] == "dp" and w.info["ep_crosses_servers"]
    ep = [c for c in w.coflows if c.meta.ctype == "ep"]
    cross = sum(float(c.nbytes[_servers(w, c.src) != _servers(w, c.dst)].sum()) for c in ep)
    assert cross > 0.4 * sum(c.total_bytes for c in ep)  # 2 of 4 peers are in another server
    for c in ep:  # an EP group is DP replicas with the same TP rank (Megatron order tp-cp-ep-dp-pp)
        assert len({w.devices[i].split("gpu")[1] for i in np.r_[c.src, c.dst]}) <= 2
    _, wf = build_llm(_moe(ep_layout="fold"), 64, 10.0)
    assert wf.info["ep_layout"] == "fold" and not wf.info["ep_crosses_servers"]
    for c in (c for c in wf.coflows if c.meta.ctype == "ep"):
        assert (_servers(wf, c.src) == _servers(wf, c.dst)).all()


def test_ep_layout_auto_folds_when_ep_does_not_divide_dp_and_expert_params_are_conserved() -> None:
    job = _moe(ep=8, tp=2)
    p = job.parallel.resolve(32, job.model)  # tp 2, pp 2, dp 8: ep 8 divides dp
    assert p.ep_layout == "dp"
    p = _moe(ep=8, tp=4).parallel.resolve(32, TINY_MOE)  # dp 4 < ep 8
    assert p.ep_layout == "fold"
    with pytest.raises(ValueError, match="ep_layout='dp' needs ep=8 to divide dp=4"):
        _moe(ep=8, tp=4, ep_layout="dp").parallel.resolve(32, TINY_MOE)
    # expert gradient bytes reduced per iteration do not depend on the layout (expert-TP = TP vs 1)
    tot = {}
    for lay in ("dp", "fold"):
        _, w = build_llm(_moe(ep_layout=lay, iterations=1), 64, 10.0)
        n_exp = 0.0
        for c in w.coflows:
            if c.meta.ctype == "dp" and c.meta.op == "reduce_scatter":
                n_exp += c.total_bytes
        tot[lay] = n_exp
    assert tot["dp"] > 0 and tot["fold"] > 0


def test_param_all_gathers_overlap_the_next_forward_case_iii() -> None:
    job = _moe(iterations=2, bucket_params=1)  # one bucket per layer
    topo, w = build_llm(job, 64, 10.0)
    r = Simulator(topo).run(w, make_policy("fifo"))
    nodes = w.nodes
    ag = [k for k, i in enumerate(r.coflow_nodes) if nodes[i].meta.op == "all_gather"]
    ag0 = [k for k in ag if r.coflow_start[k] < r.iteration_ends[1]]  # issued after iteration 0's step
    assert ag0 and all(nodes[r.coflow_nodes[k]].meta.iteration == 1 for k in ag0)  # keyed by the consumer
    ag_end = max(r.coflow_end[k] for k in ag0)
    assert min(r.coflow_start[k] for k in ag0) >= r.iteration_ends[0] - 1e-12  # after the step
    fwd1 = [
        r.compute_start[k]
        for k, i in enumerate(r.compute_nodes)
        if nodes[i].cat == "fwd" and r.compute_start[k] >= r.iteration_ends[0]
    ]
    assert min(fwd1) < ag_end  # iteration 1's forward runs while iteration 0's all-gathers still move
    # without the overlap every all-gather finishes before the stage's next forward: slower
    topo2, w2 = build_llm(_moe(iterations=2, bucket_params=1, overlap_param_gather=False), 64, 10.0)
    r2 = Simulator(topo2).run(w2, make_policy("fifo"))
    assert r.iteration_time < r2.iteration_time


def test_reduce_scatters_overlap_the_remaining_backward_case_ii() -> None:
    job = LLMJob(TINY_DENSE, ParallelConfig(tp=2, pp=4, micro_batch=1, num_microbatches=8))
    topo, w = build_llm(job, 32, 10.0)
    r = Simulator(topo).run(w, make_policy("fifo"))
    nodes = w.nodes
    end0 = r.iteration_ends[0]
    rs_start = min(
        r.coflow_start[k]
        for k, i in enumerate(r.coflow_nodes)
        if nodes[i].meta.op == "reduce_scatter" and nodes[i].meta.iteration == 0
    )
    last_bwd = max(
        r.compute_end[k]
        for k, i in enumerate(r.compute_nodes)
        if nodes[i].cat == "bwd" and r.compute_end[k] <= end0
    )
    assert rs_start < last_bwd  # the first bucket is reduced while other stages still run backward


def test_without_overlap_grad_reduce_reductions_wait_for_the_stage_backward() -> None:
    """Megatron-LM's default (--overlap-grad-reduce off): finalize_model_grads reduces after the whole backward."""

    def run(overlap: bool):
        job = LLMJob(
            TINY_DENSE,
            ParallelConfig(
                tp=2, pp=4, micro_batch=1, num_microbatches=8, bucket_params=1, overlap_grad_reduce=overlap
            ),
        )
        topo, w = build_llm(job, 32, 10.0)
        r = Simulator(topo).run(w, make_policy("fifo"))
        nodes = w.nodes
        last_bwd: dict[int, float] = {}  # stage -> end of its iteration-0 backward
        for k, i in enumerate(r.compute_nodes):
            if nodes[i].cat == "bwd" and r.compute_end[k] <= r.iteration_ends[0]:
                st = int(nodes[i].executor.split(".")[0][2:])
                last_bwd[st] = max(last_bwd.get(st, 0.0), r.compute_end[k])
        early = [
            r.coflow_start[k] < last_bwd[nodes[i].meta.stage] - 1e-12
            for k, i in enumerate(r.coflow_nodes)
            if nodes[i].meta.op == "reduce_scatter" and nodes[i].meta.iteration == 0
        ]
        return r.iteration_time, early

    t_off, early_off = run(False)
    t_on, early_on = run(True)
    assert early_off and not any(early_off)  # every bucket waits for its stage's last backward
    assert any(early_on)  # one bucket per layer: the overlapped default starts during the backward
    assert t_on < t_off


def test_steady_iteration_is_reproducible_over_three_iterations() -> None:
    job = LLMJob(TINY_DENSE, ParallelConfig(tp=2, pp=4, micro_batch=1, num_microbatches=8, iterations=3))
    topo, w = build_llm(job, 32, 10.0)
    r = Simulator(topo).run(w, make_policy("fifo"))
    e = r.iteration_ends
    assert len(e) == 3 and e[2] - e[1] == pytest.approx(e[1] - e[0], rel=1e-6)
    assert r.iteration_time == pytest.approx(e[2] - e[1])


def test_the_sim_cli_runs_the_hermod_policies(tmp_path) -> None:
    # that they import without torch: tests/test_core_imports.py
    rc = sim_cli.main(
        [
            "sim",
            "--workload",
            "qwen-moe-12l",
            "--gpus",
            "32",
            "--bandwidth",
            "10",
            "--policy",
            "fifo,hermod,hermod-nccl,hermod-dscp",
            "--microbatches",
            "4",
            "--out",
            str(tmp_path),
            "--no-plot",
        ]
    )
    assert rc == 0
    doc = json.loads((tmp_path / "sim.json").read_text())
    assert set(doc["results"]) == {"fifo", "hermod", "hermod-nccl", "hermod-dscp"}
    assert doc["config"]["iterations"] == 2
    # hermod-dscp takes its LID buckets from the workload (layers per pipeline stage), not a default of 1
    from flowlane.sim.models import MODELS

    job = LLMJob(MODELS["qwen-moe-12l"], ParallelConfig(pp=2, num_microbatches=4))
    _, w = build_llm(job, 32, 10.0)
    (dscp,) = sim_cli._policies("hermod-dscp", w.info)
    assert w.info["layers_per_stage"] == 6 and dscp.quant.layers_per_stage == 6


def test_hermod_policies_order_for_the_workloads_schedule_and_refuse_another() -> None:
    from flowlane.policy import CoflowMeta
    from flowlane.sim import SimSpecError

    pp, ep = CoflowMeta("pp", microbatch=1, layer=2), CoflowMeta("ep", microbatch=1, layer=2)
    for name in ("hermod", "hermod-dscp", "hermod-nccl"):
        cfg = make_policy(name, "interleaved", 4, layers_per_stage=4).hermod_order.config  # type: ignore[attr-defined]
        assert (cfg.schedule, cfg.num_microbatches) == ("interleaved", 4), name
    for name in ("hermod", "hermod-dscp"):  # (3 NCCL classes put EP and PP in one either way)
        # interleaved 1F1B: EP > PP > DP (seed 000 §5.3.1); 1F1B: EP and PP share a rank
        inter = make_policy(name, schedule="interleaved", num_microbatches=4, layers_per_stage=4)
        assert inter.priority(ep) < inter.priority(pp), name
        one = make_policy(name, layers_per_stage=4)
        assert one.priority(ep)[:2] == one.priority(pp)[:2], name
    job = LLMJob(
        TINY_DENSE, ParallelConfig(tp=2, pp=2, num_microbatches=4, schedule="interleaved", iterations=1)
    )
    topo, w = build_llm(job, 8)
    assert (w.info["schedule"], w.info["microbatches"]) == ("interleaved", 4)
    with pytest.raises(SimSpecError, match=r"'1f1b' pipeline schedule but workload .* runs 'interleaved'"):
        Simulator(topo).run(w, make_policy("hermod"))
    with pytest.raises(SimSpecError, match="orders coflows for 8 microbatches but workload .* runs 4"):
        Simulator(topo).run(w, make_policy("hermod-nccl", "interleaved", 8))
    assert Simulator(topo).run(w, make_policy("hermod", "interleaved", 4)).iteration_time > 0
    assert Simulator(topo).run(w, make_policy("fifo", "interleaved", 4)).iteration_time > 0


def test_hermod_beats_fifo_and_dp_first_loses_when_the_network_is_the_bottleneck() -> None:
    topo, w = build_llm(_moe(num_microbatches=4), 64, 2.0)
    t = {n: Simulator(topo).run(w, make_policy(n)).iteration_time for n in ("fifo", "dp-first", "hermod")}
    assert t["hermod"] <= t["fifo"] * (1 + 1e-9)
    assert t["dp-first"] >= t["hermod"]


def test_cluster_host_link_keeps_up_with_the_nic() -> None:
    topo = cluster(16, bandwidth_gbps=400.0)
    r = topo.route("s0/gpu0", "s1/gpu0")
    assert r.bandwidth == pytest.approx(400e9 / 8)


def test_tp_all_reduce_stays_on_nvlink_when_the_nic_is_faster() -> None:
    job = LLMJob(TINY_DENSE, ParallelConfig(tp=2, pp=4, micro_batch=1, num_microbatches=8))
    durs = []
    for bw in (100.0, 1e6):  # 1e6 Gb/s NIC beats NVLink in the shortest-path choice; TP must not follow it
        _, w = build_llm(job, 32, bw)
        durs.append([n.duration for n in w.nodes if getattr(n, "cat", "") == "fwd"])
    assert durs[0] == durs[1]


def test_hermod_sim_analysis_ep_cct_alone_and_with_its_set() -> None:
    """benchmarks.hermod_sim's analysis (it backs the README's "FIFO's all-to-alls run 1.5-2.3 % slower than alone"):
    an all-to-all alone is never slower than with its set; with one NIC per GPU the sets barely share NICs, with one
    NIC per 8-GPU server the 8 EP groups of a server share it, while each all-to-all alone is unchanged (one GPU per
    server in each EP group)."""
    from benchmarks.hermod_sim import isolated_ep_cct_s

    rail = isolated_ep_cct_s("mixtral-8x22b", 512, 100.0, 8, 2, 0)
    one_nic = isolated_ep_cct_s("mixtral-8x22b", 512, 100.0, 8, 2, 1)
    assert 0 < rail[0] <= rail[1] < 1.1 * rail[0]
    assert one_nic[0] == pytest.approx(rail[0])
    assert one_nic[1] > 4 * one_nic[0]
    # 100 -> 50 Gb/s doubles every CCT (same bytes)
    assert isolated_ep_cct_s("mixtral-8x22b", 512, 50.0, 8, 2, 0)[0] == pytest.approx(2 * rail[0])


def test_hermod_sim_plan_runs_the_thesis_baselines_in_the_sweeps_and_filters_name_bad_values(
    tmp_path,
) -> None:
    """Figs. 5.12/5.13 compare Hermod with vanilla Megatron-LM and Lina: the sweeps carry ``megatron`` for every
    model and ``ep-first`` (Lina's rule) for the MoE ones only (without EP it equals FIFO by construction)."""
    from benchmarks.hermod_sim import MOE, main, plan

    sweep = {(m, g, b, p) for s, m, g, b, p in plan(False) if s in ("bandwidth", "scaling")}
    for m, g, b, _ in list(sweep):
        assert (m, g, b, "megatron") in sweep
        assert ((m, g, b, "ep-first") in sweep) == (m in MOE)
    for bad in (
        ["--models", "gpt3-13x"],
        ["--gpus", "3000"],
        ["--policies", "lina"],
        ["--bandwidths", "300"],
        ["--bandwidths", "fast"],
    ):
        with pytest.raises(SystemExit) as e:
            main([*bad, "--out", str(tmp_path)])
        assert e.value.code == 2


def test_hermod_intra_sim_runs_qwen_phases_only_when_named_and_filters_name_bad_values(tmp_path) -> None:
    """Qwen-MoE-24L's EP-32 phases do not fit this machine at 1,024 GPUs, so they are opt-in (module docstring);
    Mixtral's run by default; --scale-models / --scale-gpus pick the points."""
    from benchmarks.hermod_intra_sim import main, plan

    default = {(m, v) for _, m, _, _, _, v, _ in plan([0.1], {"scale"})}
    assert ("mixtral-8x22b", "hermod-phases-bn") in default
    assert not {v for m, v in default if m == "qwen-moe-24l"} & {
        "hermod-phases",
        "hermod-phases-bn",
        "hermod-nccl-phases-bn",
    }
    assert ("mixtral-8x22b", "hermod-nccl-phases-bn") not in default  # a per-class-queue experiment: opt-in
    named = plan([0.13], {"scale"}, {"fifo", "hermod-phases-bn"}, {"qwen-moe-24l"}, 256)
    assert named == [("scale", "qwen-moe-24l", 256, 8, 100.0, v, 0.13) for v in ("fifo", "hermod-phases-bn")]
    for bad in (["--scale-models", "qwen"], ["--scale-gpus", "0"], ["--scale-variants", "phases"]):
        with pytest.raises(SystemExit) as e:
            main(["--only", "scale", *bad, "--out", str(tmp_path)])
        assert e.value.code == 2


def test_hermod_intra_sim_refuses_a_bad_op_overhead_and_a_resume_at_another_setting(tmp_path, capsys) -> None:
    """Points simulated at another quantum, op overhead or incast count are not comparable, so --resume will not
    mix them."""
    import json

    from benchmarks.hermod_intra_sim import main

    for bad in ("-1", "nan"):
        with pytest.raises(SystemExit) as e:
            main(["--only", "scale", "--op-overhead-us", bad, "--out", str(tmp_path)])
        assert e.value.code == 2
    (tmp_path / "old.json").write_text(json.dumps({"config": {"time_quantum_s": 1e-4}, "points": []}))
    with pytest.raises(SystemExit) as e:
        main(
            [
                "--only",
                "scale",
                "--scale-models",
                "mixtral-8x22b",
                "--scale-variants",
                "fifo",
                "--scale-gpus",
                "64",
                "--op-overhead-us",
                "20",
                "--resume",
                "--name",
                "old",
                "--out",
                str(tmp_path),
            ]
        )
    assert e.value.code == 2
    assert "op overhead 0 s and incast count port, not 1e-05 s, 2e-05 s and port" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(
            [
                "--only",
                "scale",
                "--scale-models",
                "mixtral-8x22b",
                "--scale-variants",
                "fifo",
                "--scale-gpus",
                "64",
                "--incast-count",
                "class",
                "--resume",
                "--name",
                "old",
                "--out",
                str(tmp_path),
            ]
        )
    assert e.value.code == 2
    assert "incast count port, not 1e-05 s, 0 s and class" in capsys.readouterr().err


def test_hermod_intra_sim_plots_only_ratios_it_has_and_says_so(tmp_path) -> None:
    from benchmarks.hermod_intra_sim import _plot

    def res(times: dict[str, float]) -> dict:
        row = {"model": "qwen-moe-24l", "gpus": 256, "incast_alpha": 0.13, "iteration_time_s": times}
        if "fifo" in times:
            row["speedup_vs_fifo"] = {v: times["fifo"] / t for v, t in times.items()}
        return {"rows": [row], "config": {"op_overhead_s": 0.0}}

    for times in ({"fifo": 7.3}, {"hermod-phases-bn": 5.2}):  # FIFO alone, or no FIFO to divide by
        assert _plot(res(times), tmp_path / "none.png") is False
        assert not (tmp_path / "none.png").exists()
    assert _plot(res({"fifo": 7.3, "hermod-phases-bn": 5.2}), tmp_path / "both.png") is True
    assert (tmp_path / "both.png").stat().st_size > 0
