"""ALEPH on Megatron-core's own data-parallel path (megatron_plugin.aleph over megatron_plugin.dp_collective): a tiny
GPT, DP 4 on 4 gloo ranks, Megatron-core's DistributedDataParallel (overlap_grad_reduce, several bucket groups),
get_megatron_optimizer and finalize_model_grads, against the same run without flowlane. One launch: an all-singleton
plan (API), a two-pair PS tree given by the Megatron-LM flags, an M-WCHA plan from bandwidth figures (API, without
overlap_grad_reduce), and the refusals (an AVG reduce op, a plan of the wrong size, a second install, Hermod's DDP
hooks); the launch flags and their checks are also tested without a launch. PP 2 x DP 2:
tests/test_dp_components_pp.py; the distributed optimizer: tests/test_dp_components_dist_opt.py."""

from __future__ import annotations

import argparse
from typing import Any

import pytest

pytestmark = pytest.mark.llm
pytest.importorskip("megatron.core")

ITERATIONS = 3


def test_aleph_on_megatron_core_ddp_matches_its_own_run_and_refuses_what_it_cannot_carry() -> None:
    from flowlane.launch import launch
    from tests.megatron_dp_workers import aleph_runs

    res = launch(aleph_runs, 4, timeout=600)
    for rank, r in enumerate(res):
        for name in ("singletons", "pairs_ps_flags", "two_ps_flags", "mwcha_no_overlap"):
            x = r[name]
            # the hierarchy carried every bucket group's reduction in every iteration, then gave the groups back
            # (without overlap_grad_reduce Megatron makes one bucket of everything)
            assert x["bucket_groups"] >= (1 if name == "mwcha_no_overlap" else 2), (rank, name, x)
            assert x["calls"] == x["bucket_groups"] * ITERATIONS, (rank, name, x)
            assert x["restored"], (rank, name)
            assert x["maxdiff"] < 1e-5, (rank, name, x)
        # re-planning: the probe's second figures made the plan infeasible, so a new hierarchy took over from
        # iteration 3 on; the sums stay Megatron's (within float reordering)
        x = r["replan"]
        assert [tuple(d[:2]) for d in x["decisions"]] == [(1, False), (2, True), (3, False)], x["decisions"]
        assert "infeasible" in x["decisions"][1][2] and x["restored"] and x["maxdiff"] < 1e-5, (rank, x)
        assert x["calls"] == x["bucket_groups"] * ITERATIONS, (rank, x)
        # one flat level (every rank its own cluster): the aggregators' all-reduce is the same gloo all-reduce as
        # Megatron's, so the run is Megatron's bit for bit
        assert r["singletons"]["bitwise"], (rank, r["singletons"])
        assert r["singletons"]["num_flows"] == 4 and r["mwcha_no_overlap"]["num_flows"] < 4, (
            rank,
            r["mwcha_no_overlap"],
        )
        assert "average_in_collective=True (an AVG reduce op) is not supported" in r["refused_avg"], r[
            "refused_avg"
        ]
        assert "bandwidth_gbps='30,20' has 2 figures" in r["refused_size"], r["refused_size"]
        assert "already taken over by another flowlane feature" in r["refused_twice"], r["refused_twice"]
        assert "already wrapped (Hermod's DDP hooks)" in r["refused_hermod"], r["refused_hermod"]


def test_aleph_flags_parse_and_bad_values_are_named() -> None:
    from megatron_plugin.aleph import AlephMegatronConfig, config_from_args
    from megatron_plugin.args import add_flowlane_args
    from megatron_plugin.megatron_lm import check_dp_collective_args

    parser = add_flowlane_args(argparse.ArgumentParser())
    assert config_from_args(parser.parse_args([])) is None
    cfg = config_from_args(
        parser.parse_args(["--aleph", "--aleph-bandwidth-gbps", "30,20,10", "--aleph-top", "ps"])
    )
    assert cfg is not None and cfg.top == "ps" and cfg.plan(3).n == 3
    with pytest.raises(ValueError, match="--aleph needs --aleph-bandwidth-gbps"):
        config_from_args(parser.parse_args(["--aleph"]))
    with pytest.raises(ValueError, match="exactly one of bandwidth_gbps"):
        AlephMegatronConfig(bandwidth_gbps="1,2", clusters="0;1")
    with pytest.raises(ValueError, match=r"bandwidth_gbps='30,x' is not comma-separated numbers"):
        AlephMegatronConfig(bandwidth_gbps="30,x")
    with pytest.raises(ValueError, match=r"clusters='0,1' cover 2 ranks; the data-parallel group has 3"):
        AlephMegatronConfig(clusters="0,1").plan(3)
    with pytest.raises(ValueError, match="exactly one of expert_bandwidth_gbps"):
        AlephMegatronConfig(clusters="0", expert_bandwidth_gbps="1,2", expert_clusters="0;1")
    with pytest.raises(
        ValueError, match=r"expert_clusters='0,1' cover 2 ranks; the expert-data-parallel group"
    ):
        AlephMegatronConfig(clusters="0", expert_clusters="0,1").plan(3, expert=True)
    cfg = config_from_args(
        parser.parse_args(["--aleph", "--aleph-clusters", "0;1", "--aleph-expert-bandwidth-gbps", "30,10"])
    )
    assert cfg is not None and cfg.has_expert_plan and cfg.plan(2, expert=True).n == 2
    cfg = config_from_args(
        parser.parse_args(
            [
                "--aleph",
                "--aleph-clusters",
                "0;1",
                "--aleph-top",
                "ps",
                "--aleph-ps",
                "0,1",
                "--aleph-split",
                "0.7,0.3",
            ]
        )
    )
    assert cfg is not None and cfg.multi_ps() == {"ps": [0, 1], "split": [0.7, 0.3]}
    with pytest.raises(ValueError, match="apply to top='ps' only"):
        AlephMegatronConfig(clusters="0;1", ps="0,1", split="equal")
    with pytest.raises(ValueError, match=r"split='half' is not comma-separated numbers or 'equal'"):
        AlephMegatronConfig(clusters="0;1", top="ps", ps="0,1", split="half")
    with pytest.raises(ValueError, match=r"replan_every=5 needs bandwidth_gbps .* and top='ps'"):
        AlephMegatronConfig(clusters="0;1", replan_every=5)
    cfg = config_from_args(
        parser.parse_args(
            ["--aleph", "--aleph-bandwidth-gbps", "30,10", "--aleph-top", "ps", "--aleph-replan-every", "100"]
        )
    )
    assert cfg is not None and cfg.aleph_config().replan_every == 100
    with pytest.raises(ValueError, match="chunk_bytes=10 must be an integer >= 1024"):
        AlephMegatronConfig(clusters="0", chunk_bytes=10)
    with pytest.raises(ValueError, match=r"cpu_per_member=0.2 \(--aleph-cpu-per-member\): the plugin has no"):
        AlephMegatronConfig(bandwidth_gbps="30,10", cpu_per_member=0.2)
    # the PS check (digest §5.1 #12): a tiny budget re-plans the testbed into one cluster; an explicit plan cannot be
    testbed = ["--aleph", "--aleph-bandwidth-gbps", "30,20,20,10,10,10,10,10", "--aleph-top", "ps"]
    cfg = config_from_args(parser.parse_args([*testbed, "--aleph-ps-gbps", "1e-6"]))
    assert cfg is not None and cfg.plan(8).num_flows == 1
    assert config_from_args(parser.parse_args(testbed)).plan(8).num_flows == 4  # type: ignore[union-attr]
    with pytest.raises(ValueError, match=r"ps_gbps=5.0 \(--aleph-ps-gbps\): M-WCHA's settings act only on"):
        AlephMegatronConfig(clusters="0,1;2", ps_gbps=5.0)
    with pytest.raises(
        ValueError, match=r"seed=3 \(--aleph-seed\), max_empty_rounds=1 .*explicit \(clusters\)"
    ):
        AlephMegatronConfig(clusters="0,1;2", seed=3, max_empty_rounds=1)
    AlephMegatronConfig(
        clusters="0,1;2", expert_bandwidth_gbps="10,20", seed=3
    )  # the experts' plan is planned
    with pytest.raises(ValueError, match="aleph variant='x'"):
        AlephMegatronConfig(clusters="0", variant="x")  # type: ignore[arg-type]
    args = parser.parse_args(["--aleph", "--aleph-clusters", "0;1", "--coflow-scheduler", "hermod"])
    assert "--coflow-scheduler hermod" in check_dp_collective_args(args)
    args = parser.parse_args(["--aleph", "--aleph-clusters", "0;1"])
    args.use_distributed_optimizer = True
    assert check_dp_collective_args(args) == ""  # the reduce-scatter is taken over too
    args.ddp_reduce_scatter_with_fp32_accumulation = True  # Megatron's own all-to-all reduce-scatter
    assert (
        "--ddp-reduce-scatter-with-fp32-accumulation with --use-distributed-optimizer"
        in check_dp_collective_args(args)
    )
    args.use_distributed_optimizer = False  # without it the flag changes nothing (Megatron all-reduces)
    assert check_dp_collective_args(args) == ""
    args.use_distributed_optimizer, args.ddp_reduce_scatter_with_fp32_accumulation = True, False
    args.num_distributed_optimizer_instances = 2
    assert "--num-distributed-optimizer-instances > 1" in check_dp_collective_args(args)
    args.use_distributed_optimizer, args.num_distributed_optimizer_instances, args.num_experts = False, 1, 4
    assert check_dp_collective_args(args) == ""  # ALEPH takes the experts' bucket groups too
    args.syndicate = True
    assert "--aleph and --syndicate" in check_dp_collective_args(args)


def test_replanning_confirms_a_probe_that_moves_a_rank_before_it_acts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The default probe (``probe_bandwidth`` over the DP group) is confirmed as the DDP hook's is (E10: one probe on a
    loaded host read unchanged links 41 % low and re-planned for nothing): a reading that moves rank 0 below its
    aggregator's need re-plans only when a second reading agrees. Unit level: the probe's transfers are stubbed, the
    component is Megatron's (its step is the end of finalize_model_grads), no process group."""
    from flowlane.aleph import probe as probe_mod
    from megatron_plugin.aleph import AlephMegatronConfig, _AlephComponent, replan_parts

    cfg = AlephMegatronConfig(bandwidth_gbps="30,20,10,10", top="ps", replan_every=1, probe_bytes=4096)
    steady, low = [30.0, 20.0, 10.0, 10.0], [5.0, 20.0, 10.0, 10.0]  # rank 0 (the aggregator of 0, 2, 3) at 5

    def run(*readings: list[float]) -> tuple[_AlephComponent, list[tuple[int, Any]]]:
        seen: list[tuple[int, Any]] = []

        def stub(nbytes: int, rounds: Any = None, group: Any = None) -> tuple[list[float], list]:
            seen.append((nbytes, group))
            return list(readings[len(seen) - 1]), []

        monkeypatch.setattr(probe_mod, "probe_bandwidth", stub)
        parts = replan_parts(cfg, "dp-group", None, lambda plan: ("rebuilt", plan))
        comp = _AlephComponent("first", 0, **parts)
        assert comp.replanner.plan.num_flows == 2
        comp.step()
        return comp, seen

    once, seen = run(low, steady)  # low, then confirmed back: each rank's best reading is the steady one
    assert seen == [(4096, "dp-group")] * 2 and once.har == "first" and not once.decisions[0][1], (
        once.decisions
    )
    twice, seen = run(low, low)
    assert len(seen) == 2 and twice.decisions[0][1] and "infeasible" in twice.decisions[0][2], twice.decisions
    assert twice.har[0] == "rebuilt" and 0 not in twice.har[1].heads
    calm, seen = run(steady)  # nothing moved: one probe
    assert len(seen) == 1 and not calm.decisions[0][1]
    with pytest.raises(ValueError, match="probe_bytes=10 must be an integer >= 1024"):
        AlephMegatronConfig(bandwidth_gbps="30,10", top="ps", replan_every=1, probe_bytes=10)


def test_replanning_knobs_without_replan_every_are_refused() -> None:
    """hysteresis / probe_bytes act only when re-planning (as DeepSpeed's REPLAN_KEYS): without replan_every they
    would do nothing, so they are refused by flag name; probe_bytes is range-checked either way."""
    from megatron_plugin.aleph import AlephMegatronConfig, config_from_args
    from megatron_plugin.args import add_flowlane_args

    with pytest.raises(
        ValueError,
        match=r"hysteresis=0.5 \(--aleph-hysteresis\), probe_bytes=2048 \(--aleph-probe-bytes\) act only with "
        r"replan_every > 0",
    ):
        AlephMegatronConfig(bandwidth_gbps="30,10", hysteresis=0.5, probe_bytes=2048)
    parser = add_flowlane_args(argparse.ArgumentParser())
    with pytest.raises(ValueError, match=r"hysteresis=0.3 \(--aleph-hysteresis\) act only with replan_every"):
        config_from_args(
            parser.parse_args(["--aleph", "--aleph-clusters", "0;1", "--aleph-hysteresis", "0.3"])
        )
    with pytest.raises(ValueError, match="probe_bytes=10 must be an integer >= 1024"):
        AlephMegatronConfig(bandwidth_gbps="30,10", probe_bytes=10)
    cfg = AlephMegatronConfig(
        bandwidth_gbps="30,10", top="ps", replan_every=3, hysteresis=0.5, probe_bytes=2048
    )
    assert (cfg.aleph_config().hysteresis, cfg.probe_bytes) == (0.5, 2048)


def test_replanning_with_the_default_probe_is_refused_off_gloo(monkeypatch: pytest.MonkeyPatch) -> None:
    """The default probe needs gloo (flowlane.aleph.probe.check_probe_backend): on an NCCL data-parallel group (faked:
    no GPU here) --aleph-replan-every is refused when AlephMegatron is made, before any group is created."""
    import torch.distributed as dist

    from megatron_plugin.aleph import AlephMegatron, AlephMegatronConfig

    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    cfg = AlephMegatronConfig(bandwidth_gbps="30,20,10,10", top="ps", replan_every=2)
    with pytest.raises(
        ValueError, match=r"replan_every \(--aleph-replan-every\): .* which is 'nccl'; it needs gloo"
    ):
        AlephMegatron(cfg, "dp-group")  # type: ignore[arg-type]


def test_the_ps_of_a_plan_made_from_figures_is_the_head_they_favour(monkeypatch: pytest.MonkeyPatch) -> None:
    """top="ps" with bandwidth_gbps: each hierarchy's PS is flowlane.aleph.model.ps_head (the head with the most
    bandwidth left for the PS's flows), at install and after a re-plan; with explicit clusters the first head. Unit
    level: the hierarchy's constructor and the process groups are stubbed."""
    from types import SimpleNamespace

    import torch.distributed as dist

    import flowlane.aleph.hook as hook_mod
    from flowlane.aleph.model import ps_head
    from megatron_plugin.aleph import AlephMegatron, AlephMegatronConfig

    made: list[tuple] = []
    monkeypatch.setattr(
        hook_mod,
        "HierarchicalAllReduce",
        lambda plan, group, top, chunk, **kw: made.append((plan, kw.get("ps"))) or SimpleNamespace(plan=plan),
    )
    monkeypatch.setattr(dist, "new_group", lambda ranks, **kw: "pg")
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 7)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)

    def component(cfg: AlephMegatronConfig, probe: Any = None) -> Any:
        aleph = AlephMegatron.__new__(AlephMegatron)
        aleph.config, aleph._probe, aleph.plan, aleph.expert_plan = cfg, probe, None, None
        return aleph._maker("dp", False)("dp", tuple(range(7)))

    bw = [20.0, 40.0, 10.0, 10.0, 10.0, 10.0, 10.0]  # clusters (0, 5), (1, 2, 4, 6), (3)
    component(AlephMegatronConfig(bandwidth_gbps=",".join(map(str, bw)), b_gbps=10.0, top="ps"))
    plan = made[-1][0]
    # head 1: 40 / (3 + 2) = 8 beats the first head 0: 20 / (1 + 2)
    assert plan.heads == (0, 1, 3) and made[-1][1] == [1] == [ps_head(plan, bw)]
    component(AlephMegatronConfig(clusters="0,5;1,2,4,6;3", top="ps"))
    assert made[-1][1] is None  # no figures: HierarchicalAllReduce's default, the first head
    slow = [20.0, 10.0, 40.0, 10.0, 10.0, 10.0, 10.0]  # rank 1 slows, rank 2 speeds up: re-planned
    comp = component(
        AlephMegatronConfig(bandwidth_gbps=",".join(map(str, bw)), b_gbps=10.0, top="ps", replan_every=1),
        probe=lambda group: slow,
    )
    comp.step()
    assert comp.decisions[0][1] and made[-1][1] == [ps_head(made[-1][0], slow)] == [2]
