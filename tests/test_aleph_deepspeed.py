"""ALEPH on DeepSpeed ZeRO 0, 1 and 2: the DP all-reduce through the hierarchy keeps DeepSpeed's math (within
float reordering), also when it re-plans at a step boundary; the "flowlane.aleph" section is parsed strictly; ZeRO 3
is refused at install."""

import pytest

pytestmark = pytest.mark.llm
pytest.importorskip("deepspeed")

from deepspeed_plugin.aleph import parse_section  # noqa: E402
from flowlane.launch import launch  # noqa: E402
from tests import aleph_workers  # noqa: E402


def test_deepspeed_zero0_to_2_with_aleph_match_their_own_runs_and_zero3_is_refused():
    res = launch(aleph_workers.deepspeed_with_and_without, 4, timeout=300, env={"DS_ACCELERATOR": "cpu"})
    for rank, r in enumerate(res):
        for z in ("", "1", "2"):  # one bucket per step at least went through the hierarchy, at every stage
            assert r[f"calls{z}"] >= 3 and r[f"maxdiff{z}"] < 1e-5, (rank, z, r)
        assert r["moved"] > 1e-3, (rank, r)
        # re-planning at every step boundary: the forced probe slowed rank 0 (an aggregator) at step 2, the plan was
        # infeasible, a new one took over there on every rank (below: all ranks alike), still DeepSpeed's sums
        d = r["replan_decisions"]
        assert [x[:2] for x in d] == [(1, False), (2, True), (3, False)] and 0 not in r["replan_heads"], (
            rank,
            d,
        )
        assert r["replan_maxdiff"] < 1e-5, (rank, r["replan_maxdiff"])
        assert (d, r["replan_heads"]) == (res[0]["replan_decisions"], res[0]["replan_heads"]), rank
        assert "supports ZeRO stages 0-2" in r["zero3"], (rank, r["zero3"])


def test_aleph_section_is_parsed_strictly():
    assert parse_section({"flowlane": {}}) is None
    assert parse_section({"flowlane": {"aleph": {"enabled": False, "clusters": [[0]]}}}) is None
    cfg, own = parse_section({"flowlane": {"aleph": {"bandwidth_gbps": [30, 10], "variant": "paper"}}})
    assert cfg.variant == "paper" and own["bandwidth_gbps"] == [30, 10]
    with pytest.raises(ValueError, match="unknown aleph config key"):
        parse_section({"flowlane": {"aleph": {"clusters": [[0]], "bogus": 1}}})
    with pytest.raises(ValueError, match=r"cpu_per_member=0.2: the plugin has no per-rank CPU figures"):
        parse_section({"flowlane": {"aleph": {"bandwidth_gbps": [30, 10], "cpu_per_member": 0.2}}})
    bw = {"bandwidth_gbps": [30, 10], "top": "ps"}
    cfg, own = parse_section(
        {"flowlane": {"aleph": {**bw, "replan_every": 5, "hysteresis": 0.1, "probe_bytes": 4096}}}
    )
    assert (cfg.replan_every, cfg.hysteresis, own["probe_bytes"]) == (5, 0.1, 4096)
    assert parse_section({"flowlane": {"aleph": bw}})[0].replan_every == 0  # off unless asked for
    with pytest.raises(ValueError, match=r"\['hysteresis', 'probe_bytes'\] act only with 'replan_every' > 0"):
        parse_section({"flowlane": {"aleph": {**bw, "hysteresis": 0.1, "probe_bytes": 4096}}})
    with pytest.raises(ValueError, match=r"replan_every=10 needs 'bandwidth_gbps' .* and 'top': 'ps'"):
        parse_section({"flowlane": {"aleph": {"clusters": [[0]], "replan_every": 10}}})
    with pytest.raises(ValueError, match=r"replan_every=2 needs one PS"):
        parse_section({"flowlane": {"aleph": {**bw, "replan_every": 2, "ps": [0, 1], "split": "equal"}}})
    with pytest.raises(ValueError, match=r"probe_bytes=10 must be an integer >= 1024"):
        parse_section({"flowlane": {"aleph": {**bw, "replan_every": 2, "probe_bytes": 10}}})
    with pytest.raises(ValueError, match=r"replan_every=-1 must be an integer >= 0"):
        parse_section({"flowlane": {"aleph": {**bw, "replan_every": -1}}})
    _, own = parse_section(
        {"flowlane": {"aleph": {"clusters": [[0], [1]], "top": "ps", "ps": [0, 1], "split": "equal"}}}
    )
    assert own["ps"] == [0, 1] and own["split"] == "equal"
    with pytest.raises(ValueError, match="exactly one of 'bandwidth_gbps'"):
        parse_section({"flowlane": {"aleph": {"top": "ps"}}})
    # ps_gbps re-plans from the figures (digest §5.1 #12): refused with an explicit plan
    cfg, _ = parse_section(
        {"flowlane": {"aleph": {"bandwidth_gbps": [30, 20, 20, 10, 10, 10, 10, 10], "ps_gbps": 20}}}
    )
    assert cfg.ps_gbps == 20
    with pytest.raises(ValueError, match=r"\['ps_gbps'\] set M-WCHA's planning.*explicit \('clusters'\)"):
        parse_section({"flowlane": {"aleph": {"clusters": [[0, 1]], "ps_gbps": 5}}})
    # so are the planner's other settings: nothing is planned from a given plan (their defaults are accepted)
    parse_section(
        {"flowlane": {"aleph": {"clusters": [[0, 1]], "seed": 0, "variant": "fill", "ps_gbps": None}}}
    )
    with pytest.raises(ValueError, match=r"\['b_gbps', 'seed', 'variant'\] .*no effect"):
        parse_section(
            {"flowlane": {"aleph": {"clusters": [[0, 1]], "seed": 3, "variant": "paper", "b_gbps": 1}}}
        )


def test_replanning_with_the_default_probe_is_refused_off_gloo(monkeypatch: pytest.MonkeyPatch) -> None:
    """The default probe needs gloo (flowlane.aleph.probe.check_probe_backend): on an NCCL data-parallel group (faked:
    no GPU here) replan_every is refused when the wrap is made, before DeepSpeed's backend is touched."""
    from types import SimpleNamespace

    import torch.distributed as dist

    from deepspeed_plugin.aleph import AlephDeepSpeed
    from flowlane.aleph import AlephConfig, Replanner

    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    rp = Replanner([30.0, 20.0, 10.0, 10.0], AlephConfig(replan_every=1, top="ps"))
    engine = SimpleNamespace(seq_data_parallel_group="dp")
    with pytest.raises(ValueError, match=r"flowlane.aleph replan_every: .* which is 'nccl'; it needs gloo"):
        AlephDeepSpeed(engine, rp.plan, "ps", None, rp)


def test_the_ps_of_a_plan_made_from_figures_is_the_head_they_favour(monkeypatch: pytest.MonkeyPatch) -> None:
    """With top "ps" and bandwidth_gbps the PS is flowlane.aleph.model.ps_head (the head with the most bandwidth left
    for the PS's flows), not the first head; with clusters the first (ReplanningAllReduce re-picks it after a re-plan:
    tests/test_aleph_hook.py). Unit level: the wrap's constructor is recorded."""
    from types import SimpleNamespace

    import torch.distributed as dist

    import deepspeed_plugin.aleph as ds_aleph

    monkeypatch.setattr(ds_aleph, "AlephDeepSpeed", lambda engine, plan, top, multi, *rest: (plan, multi))
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 7)
    engine = SimpleNamespace(seq_data_parallel_group="dp")
    section = {"bandwidth_gbps": [20, 40, 10, 10, 10, 10, 10], "b_gbps": 10.0, "top": "ps"}
    plan, multi = ds_aleph.install(engine, {"flowlane": {"aleph": section}})
    # clusters (0, 5), (1, 2, 4, 6), (3): head 1: 40 / (3 + 2) = 8 beats the first head 0: 20 / (1 + 2)
    assert plan.heads == (0, 1, 3) and multi == {"ps": [1]}
    plan, multi = ds_aleph.install(
        engine, {"flowlane": {"aleph": {"clusters": [[0, 5], [1, 2, 4, 6], [3]], "top": "ps"}}}
    )
    assert multi == {}
