"""flowlane.sim all-to-all modes: plain vs Hermod's incast-free schedule (seed 000 §5.3.2) under the incast model."""

from __future__ import annotations

import numpy as np
import pytest

from flowlane.policy import CoflowMeta
from flowlane.sim import IncastModel, PhasedAllToAll, SimConfig, SimSpecError, Simulator, Workload
from flowlane.sim import collectives as C
from flowlane.sim.models import ParallelConfig
from flowlane.sim.network import incast_fan_in
from flowlane.topology import gBps, star

B = gBps(1)
UNIT = 1e6  # bytes per token-count unit
INC = IncastModel(threshold=1, alpha=0.25)
# skewed 4x4 token matrix (row = sender); lower bound L = max(row sum, column sum) = 14 (column 0)
T = np.array([[0, 2, 1, 3], [6, 0, 2, 1], [5, 1, 0, 2], [3, 4, 1, 0]])
L = 14


def _run(
    mode: str, incast: IncastModel | None, matrix: np.ndarray = T, op_overhead: float = 0.0
) -> tuple[float, Workload]:
    topo = star([B] * len(matrix), latency=0.0)
    w = Workload(topo.gpus)
    C.all_to_all(w, range(len(matrix)), matrix, CoflowMeta("ep", op="dispatch"), mode=mode, unit_bytes=UNIT)
    return Simulator(topo, SimConfig(incast=incast, launch_overhead=op_overhead)).run(w).makespan, w


def test_all_modes_carry_exactly_the_off_diagonal_bytes() -> None:
    expect = (T.sum() - np.trace(T)) * UNIT
    for mode in C.A2A_MODES:
        _, w = _run(mode, None)
        assert w.total_bytes() == pytest.approx(expect, rel=1e-12), mode


def test_without_incast_plain_fair_sharing_already_reaches_the_lower_bound() -> None:
    # digest A2.6/R6: in a fluid model the plain all-to-all finishes at L; matching cannot help without incast
    for mode in ("plain", "matched"):
        t, _ = _run(mode, None)
        assert t == pytest.approx(L * UNIT / B, rel=1e-9), mode


@pytest.mark.parametrize("phased", ["phases", "phases_bottleneck"])
def test_incast_slows_plain_but_not_the_matched_or_phased_all_to_all(phased: str) -> None:
    t_plain, _ = _run("plain", INC)
    t_matched, _ = _run("matched", INC)
    t_phases, _ = _run(phased, INC)
    assert t_plain > 1.2 * L * UNIT / B  # three senders into column 0 -> capacity / (1 + 2 alpha)
    assert t_matched == pytest.approx(L * UNIT / B, rel=1e-9)
    # BvN phases: each receiver hears one sender at a time, so no penalty; per-rank phase steps add idle gaps
    assert L * UNIT / B * (1 - 1e-9) <= t_phases < t_plain


def _phased(w: Workload) -> PhasedAllToAll:
    (x,) = [n for n in w.nodes if isinstance(n, PhasedAllToAll)]
    return x


@pytest.mark.parametrize("phased", ["phases", "phases_bottleneck"])
def test_phases_mode_sends_each_flow_alone_into_its_receiver(phased: str) -> None:
    _, w = _run(phased, None)
    x = _phased(w)
    assert len(w.coflows) == 1 and x.num_phases > 1
    # in each BvN phase no destination (and no source) appears twice
    for k in np.unique(x.phase):
        sel = x.phase == k
        assert len(set(x.dst[sel].tolist())) == sel.sum()
        assert len(set(x.src[sel].tolist())) == sel.sum()


@pytest.mark.parametrize("phased", ["phases", "phases_bottleneck"])
def test_a_per_op_overhead_is_paid_once_by_plain_and_once_per_phase_by_the_phased_all_to_all(
    phased: str,
) -> None:
    # benchmarks.hermod_intra_sim --op-overhead-us: the phase flows are ops of their own, so a rank that takes part
    # in k phases pays the overhead k times in sequence, where the plain all-to-all pays it once
    o = 1e-3
    t_plain, _ = _run("plain", None)
    assert _run("plain", None, op_overhead=o)[0] == pytest.approx(t_plain + o, rel=1e-9)
    t_phases, w = _run(phased, None)
    x = _phased(w)
    k = max(len(set(x.phase[(x.src == r) | (x.dst == r)].tolist())) for r in range(len(T)))
    assert k > 1
    assert _run(phased, None, op_overhead=o)[0] >= t_phases + k * o * (1 - 1e-9)


def test_bottleneck_phases_are_the_runtime_plan_and_fewer_on_a_zipf_matrix() -> None:
    from flowlane.hermod.matching import bvn_phases
    from flowlane.sim.workloads import zipf_token_matrix

    t = zipf_token_matrix(np.random.default_rng(3), 16, 64, 4096, 4, 0.5)
    np.fill_diagonal(t, 0)
    n_phases = {}
    for mode, matching in (("phases", "first"), ("phases_bottleneck", "bottleneck")):
        _, w = _run(mode, None, t)
        plan = [ph for ph in bvn_phases(t.tolist(), matching=matching) if ph.sends]
        x = _phased(w)
        n_phases[mode] = x.num_phases
        assert n_phases[mode] == len(plan)
        assert len(x.src) == sum(len(ph.sends) for ph in plan)
    assert n_phases["phases_bottleneck"] < n_phases["phases"]


def _expanded(w: Workload) -> Workload:
    """The same workload with every phase flow of every PhasedAllToAll as a Coflow node of its own (what the
    simulator built before the phased node existed): the reference the engine's phase stepping must match."""
    out = Workload(list(w.devices), w.name)
    new_id: list[int] = []
    for node, deps in zip(w.nodes, w.deps, strict=True):
        d = [new_id[x] for x in deps]
        if isinstance(node, PhasedAllToAll):
            start = out.join(d)
            ids: list[int] = []
            for f in range(len(node.src)):
                pre = [ids[q] for q in node.pred_idx[node.pred_ptr[f] : node.pred_ptr[f + 1]]]
                ids.append(
                    out.coflow(([node.src[f]], [node.dst[f]], [node.nbytes[f]]), node.meta, pre or [start])
                )
            new_id.append(out.join(ids or [start]))
        else:
            out.nodes.append(node)
            out.deps.append(tuple(d))
            new_id.append(len(out.nodes) - 1)
    out.info = {k: [new_id[i] for i in v] if k == "iteration_end" else v for k, v in w.info.items()}
    return out


@pytest.mark.parametrize("phased", ["phases", "phases_bottleneck"])
@pytest.mark.parametrize("overhead", [0.0, 2e-4])
def test_the_phased_node_steps_exactly_like_one_coflow_per_phase_flow(phased: str, overhead: float) -> None:
    from flowlane.sim.workloads import zipf_token_matrix

    t = zipf_token_matrix(np.random.default_rng(5), 8, 32, 2048, 2, 0.5)
    topo = star([B] * 8, latency=5e-6)
    w = Workload(topo.gpus)
    a = w.compute(topo.gpus[0], 1e-3)
    C.all_to_all(w, range(8), t, CoflowMeta("ep", op="dispatch"), [a], mode=phased, unit_bytes=UNIT)
    cfg = SimConfig(incast=INC, launch_overhead=overhead)
    got = Simulator(topo, cfg).run(w)
    ref = Simulator(topo, cfg).run(_expanded(w))
    assert got.makespan == pytest.approx(ref.makespan, rel=1e-9, abs=1e-12)
    assert got.num_flows == ref.num_flows == len(_phased(w).src)
    assert got.link_bytes == pytest.approx(ref.link_bytes)


def test_a_moe_iteration_with_phased_all_to_alls_matches_its_expanded_form() -> None:
    # whole 1F1B MoE iterations (compute, PP, DP and phased EP all-to-alls interleaved), Hermod's order, incast on;
    # "first" routing so that both forms take the same route for every flow (ECMP hashes by node id)
    from flowlane.policies import make_policy
    from flowlane.sim.workloads import build_workload

    topo, w = build_workload(
        "qwen-moe-12l", 32, 100.0, num_microbatches=2, iterations=2, ep_a2a="phases_bottleneck"
    )
    _, w_plain = build_workload("qwen-moe-12l", 32, 100.0, num_microbatches=2, iterations=2, ep_a2a="plain")
    assert len(w.nodes) == len(w_plain.nodes)  # one node per all-to-all, however many phases
    cfg = SimConfig(routing="first", incast=IncastModel(alpha=0.13), time_quantum=1e-4)
    got = Simulator(topo, cfg).run(w, make_policy("hermod"))
    ref = Simulator(topo, cfg).run(_expanded(w), make_policy("hermod"))
    assert got.num_flows == ref.num_flows > 2 * w_plain.num_flows
    assert got.iteration_time == pytest.approx(ref.iteration_time, rel=1e-6)


def test_bad_phased_all_to_alls_are_refused_by_name() -> None:
    w = Workload(["a", "b", "c"])
    meta = CoflowMeta("ep")
    ok = dict(src=[0, 1], dst=[1, 2], nbytes=[1.0, 2.0], phase=[0, 1], preds=[[], [0]], meta=meta)
    w.phased_all_to_all(**ok)
    with pytest.raises(SimSpecError, match=r"flow 1 waits for \[1\]; a flow may only wait for earlier flows"):
        w.phased_all_to_all(**{**ok, "preds": [[], [1]]})
    with pytest.raises(SimSpecError, match="lengths differ"):
        w.phased_all_to_all(**{**ok, "phase": [0]})
    with pytest.raises(SimSpecError, match="flow sizes must be finite numbers > 0 bytes, got 0.0"):
        w.phased_all_to_all(**{**ok, "nbytes": [1.0, 0.0]})
    with pytest.raises(SimSpecError, match="non-decreasing"):
        w.phased_all_to_all(**{**ok, "phase": [1, 0]})
    with pytest.raises(SimSpecError, match="flow 0 goes from a device to itself"):
        w.phased_all_to_all(**{**ok, "dst": [0, 2]})
    with pytest.raises(SimSpecError, match=r"outside 0..2"):
        w.phased_all_to_all(**{**ok, "dst": [1, 3]})


def test_fan_in_counts_a_matched_coflow_once_per_link() -> None:
    hops = np.array([[0, 3], [1, 3], [2, 3], [1, 4]])  # three flows into link 3 (pad index 4)
    assert incast_fan_in(hops, 5).tolist() == [1, 2, 1, 3, 1]
    grp = np.array([7, 7, -1, 7])  # flows 0, 1, 3 belong to matched coflow 7
    assert incast_fan_in(hops, 5, grp)[:4].tolist() == [1, 1, 1, 2]


def test_bad_all_to_all_modes_are_rejected_with_the_allowed_values() -> None:
    w = Workload(["a", "b"])
    allowed = r"\('plain', 'matched', 'phases', 'phases_bottleneck'\)"
    with pytest.raises(SimSpecError, match=rf"mode 'bogus' is not one of {allowed}"):
        C.all_to_all(w, [0, 1], np.ones((2, 2)), CoflowMeta("ep"), mode="bogus")
    with pytest.raises(SimSpecError, match="needs an integer matrix"):
        C.all_to_all(w, [0, 1], np.full((2, 2), 0.5), CoflowMeta("ep"), mode="phases")
    with pytest.raises(SimSpecError, match="unit_bytes must be a finite number > 0"):
        C.all_to_all(w, [0, 1], np.ones((2, 2)), CoflowMeta("ep"), unit_bytes=0)
    with pytest.raises(SimSpecError, match="ParallelConfig.ep_a2a 'bvn' is not one of"):
        ParallelConfig(ep_a2a="bvn")


def test_moe_workload_carries_the_same_bytes_in_every_all_to_all_mode() -> None:
    from flowlane.sim.workloads import build_workload

    totals = {}
    for mode in C.A2A_MODES:
        _, w = build_workload("qwen-moe-12l", 32, 100.0, num_microbatches=4, iterations=1, ep_a2a=mode)
        totals[mode] = w.total_bytes()
    assert totals["matched"] == totals["plain"]
    assert totals["phases"] == pytest.approx(totals["plain"], rel=1e-12)
    assert totals["phases_bottleneck"] == pytest.approx(totals["plain"], rel=1e-12)


def test_sim_cli_takes_the_all_to_all_mode_and_records_it(tmp_path) -> None:
    import json

    from flowlane.sim import cli as sim_cli

    args = [
        "sim",
        "--workload",
        "qwen-moe-12l",
        "--gpus",
        "32",
        "--bandwidth",
        "10",
        "--policy",
        "fifo,hermod",
        "--microbatches",
        "2",
        "--iterations",
        "1",
        "--incast-alpha",
        "0.1",
        "--no-plot",
    ]
    rc = sim_cli.main([*args, "--ep-a2a", "matched", "--out", str(tmp_path / "m")])
    assert rc == 0
    doc = json.loads((tmp_path / "m" / "sim.json").read_text())
    assert doc["config"]["ep_a2a"] == "matched"
    with pytest.raises(SystemExit):  # argparse names the allowed choices
        sim_cli.main([*args, "--ep-a2a", "bvn", "--out", str(tmp_path / "x")])
    assert (
        sim_cli.main(["sim", "--workload", "dlrm", "--ep-a2a", "matched", "--out", str(tmp_path / "d")]) == 2
    )


def test_sim_cli_shared_nics_and_megatron_defaults_cost_time(tmp_path) -> None:
    import json

    from flowlane.sim import cli as sim_cli

    args = [
        "sim",
        "--workload",
        "gpt3-13b",
        "--gpus",
        "32",
        "--bandwidth",
        "10",
        "--policy",
        "fifo",
        "--microbatches",
        "4",
        "--no-plot",
    ]
    times = {}
    for name, extra in (
        ("rail", []),
        ("nic1", ["--nics-per-server", "1"]),
        ("nic1_megatron", ["--nics-per-server", "1", "--no-overlap"]),
    ):
        assert sim_cli.main([*args, *extra, "--out", str(tmp_path / name)]) == 0
        doc = json.loads((tmp_path / name / "sim.json").read_text())
        times[name] = doc["results"]["fifo"]["iteration_time_s"]
    assert doc["config"]["nics_per_server"] == 1 and doc["config"]["overlap_grad_reduce"] is False
    # 8 GPUs share one 10 Gb/s NIC: slower than one NIC per GPU; no DP overlap: slower still
    assert times["rail"] < times["nic1"] < times["nic1_megatron"]
    assert (
        sim_cli.main(["sim", "--workload", "dlrm", "--nics-per-server", "1", "--out", str(tmp_path / "d")])
        == 2
    )
    assert sim_cli.main([*args, "--nics-per-server", "3", "--out", str(tmp_path / "bad")]) == 2
