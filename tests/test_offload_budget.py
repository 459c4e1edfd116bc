"""The offload byte budget (flowlane.offload.budget): a timeline of one micro-batch, pure Python, no framework."""

from __future__ import annotations

import random

import pytest

from flowlane.offload.budget import (
    Budget,
    StepProfile,
    choose_budget,
    choose_plan,
    choose_recompute,
    exposed_time,
    peak_resident,
    release_points,
    resident_at_backward_start,
    with_recompute,
)


def _two_layers(**kw) -> StepProfile:
    base = dict(group_bytes=(10, 10), fwd_s=(1.0, 1.0), bwd_s=(2.0, 2.0), store_Bps=10.0, load_Bps=10.0)
    base.update(kw)
    return StepProfile(**base)


def test_timeline_by_hand_first_layer_hidden_second_exposed() -> None:
    p = _two_layers()
    assert exposed_time(p, [0, 0]) == 0.0
    # store 0: t 1-2; backward starts at 2: reload 0 runs 2-3, layer 1's backward 2-4, layer 0 starts at 4
    assert exposed_time(p, [10, 0]) == 0.0
    # store 1 runs 2-3; reload 1 3-4 (layer 1 waits 2 s); reload 0 4-5; layer 0 starts at 6: 2 s exposed
    assert exposed_time(p, [10, 10]) == pytest.approx(2.0)


def test_budget_keeps_resident_the_layer_reloaded_first() -> None:
    b = choose_budget(_two_layers(), granularity=1)
    assert b.allow_bytes == (10, 0) and b.keep_last_k == 1 and b.exposed_s == 0.0 and b.total_bytes == 10
    assert b.step_s == pytest.approx(6.0)


def test_budget_is_everything_on_a_fast_link_and_nothing_on_a_slow_one() -> None:
    sizes = (100 << 20,) * 4
    fast = StepProfile(sizes, (1.0,) * 4, (2.0,) * 4, store_Bps=1e15, load_Bps=1e15)
    # the last layer's reload is issued as its backward begins: any transfer time is exposed, so it stays
    assert choose_budget(fast).allow_bytes == sizes[:3] + (0,)
    slow = StepProfile(sizes, (1e-3,) * 4, (2e-3,) * 4, store_Bps=1e6, load_Bps=1e6)
    assert choose_budget(slow).total_bytes == 0


def test_exposed_time_never_falls_when_bytes_are_added_front_to_back() -> None:
    rng = random.Random(3)
    for _ in range(30):
        n = rng.randint(1, 8)
        p = StepProfile(
            tuple(rng.randint(0, 1000) for _ in range(n)),
            tuple(rng.uniform(0, 2) for _ in range(n)),
            tuple(rng.uniform(0, 4) for _ in range(n)),
            store_Bps=rng.uniform(50, 1000),
            load_Bps=rng.uniform(50, 1000),
            head_s=rng.uniform(0, 1),
        )
        prev = 0.0
        for total in range(0, sum(p.group_bytes) + 1, 37):
            allow, left = [], total
            for s in p.group_bytes:
                allow.append(min(s, left))
                left -= allow[-1]
            e = exposed_time(p, allow, prefetch=rng.randint(1, 3))
            e1 = exposed_time(p, allow, prefetch=1)
            assert e1 >= prev - 1e-9
            assert e <= e1 + 1e-9  # prefetching further ahead never hurts in this model
            prev = e1
        b = choose_budget(p, granularity=1)
        assert b.exposed_s == 0.0


def test_prefetching_two_layers_ahead_hides_more_when_backward_is_short() -> None:
    p = StepProfile((10,) * 6, (1.0,) * 6, (0.5,) * 6, store_Bps=10.0, load_Bps=10.0, head_s=0.0)
    assert (
        choose_budget(p, prefetch=2, granularity=1).total_bytes
        > choose_budget(p, prefetch=1, granularity=1).total_bytes
    )


def test_slack_adds_bytes_only_while_waiting_is_cheaper_than_recompute() -> None:
    p = StepProfile((10,) * 4, (1.0,) * 4, (1.0,) * 4, store_Bps=5.0, load_Bps=5.0)
    assert choose_budget(p, granularity=1).allow_bytes == (5, 0, 0, 0)
    # layers 0 and 1 whole add 2 s of wait, each layer's share below its 1 s forward; layer 2's would add 2 s > 1 s:
    # recomputing it is cheaper. The last layer is never offloaded.
    b = choose_budget(p, slack_s=5.0, granularity=1)
    assert b.allow_bytes == (10, 10, 0, 0) and b.exposed_s == pytest.approx(2.0)
    assert b.recompute_cheaper == (False, False, True, False)
    b3 = choose_budget(p, slack_s=1.0, granularity=1)  # a smaller slack stops part-way through layer 1
    assert b3.allow_bytes == (10, 5, 0, 0) and b3.exposed_s <= 1.0


def test_slack_buys_bytes_only_while_the_modelled_peak_falls() -> None:
    """Layer 2's 2 s of added wait is below its 5 s forward and within the slack, but with one-layer prefetch the
    peak is already at its floor (a layer in backward plus the reload ahead of it): offloading it buys nothing."""
    p = StepProfile((10,) * 4, (1.0, 1.0, 5.0, 1.0), (1.0,) * 4, store_Bps=5.0, load_Bps=5.0)
    assert peak_resident(p, [10, 10, 0, 0]) == peak_resident(p, [10, 10, 10, 0]) == 20
    assert exposed_time(p, [10, 10, 10, 0]) == pytest.approx(4.0)
    b = choose_budget(p, slack_s=5.0, granularity=1)
    assert b.allow_bytes == (10, 10, 0, 0) and b.peak_bytes == 20 and not any(b.recompute_cheaper)
    # a big first layer sets the peak (its own backward, or the next one's with its reload ahead): the slack buys
    # no more than the hidden bytes
    big = StepProfile((30, 10, 10, 10), (1.0,) * 4, (2.0,) * 4, store_Bps=10.0, load_Bps=10.0)
    hidden = choose_budget(big, granularity=1)
    assert choose_budget(big, slack_s=3.0, granularity=1).allow_bytes == hidden.allow_bytes == (20, 0, 0, 0)


def test_slack_never_offloads_the_last_layer() -> None:
    """The reviewer's case: 4 layers of 100 MiB, 10/20 ms forward/backward, 50 GB/s, the recipe's 5 % slack. The
    last layer's backward follows its forward at once (thesis §5.3.4): offloading it added 2.1 ms of modelled wait
    and left the modelled peak at two layers."""
    mib = 1 << 20
    p = StepProfile((100 * mib,) * 4, (0.01,) * 4, (0.02,) * 4, 50e9, 50e9)
    for slack in (0.0, 0.05 * p.step_s):
        b, depth = choose_plan(p, max_prefetch=1, slack_s=slack)
        assert b.allow_bytes == (100 * mib,) * 3 + (0,) and b.keep_last_k == 1 and b.exposed_s == 0.0
        assert b.peak_bytes == 200 * mib and depth == 1
    assert choose_budget(p, slack_s=1.0, recompute=True).allow_bytes[-1] == 0
    single = StepProfile((10,), (1.0,), (1.0,), 1e9, 1e9)  # one layer: it is the last
    assert choose_budget(single, slack_s=1.0).allow_bytes == (0,)


@pytest.mark.parametrize(
    ("kw", "msg"),
    [
        ({"fwd_s": (1.0,)}, "one entry per layer"),
        ({"store_Bps": 0.0}, "store_Bps=0.0 must be > 0"),
        ({"load_Bps": float("nan")}, "load_Bps=nan must be > 0"),
        ({"bwd_s": (1.0, float("inf"))}, "bwd_s entry inf must be a finite number"),
        ({"group_bytes": (-1, 3)}, "group_bytes entry -1"),
    ],
)
def test_profile_refuses_bad_input_naming_it(kw: dict, msg: str) -> None:
    with pytest.raises(ValueError, match=msg):
        _two_layers(**kw)


def test_resident_at_backward_start_counts_stores_still_queued() -> None:
    p = _two_layers()
    assert resident_at_backward_start(p, [0, 0]) == 20
    assert resident_at_backward_start(p, [10, 0]) == 10  # store of layer 0 ends at t=2 = backward start
    # store of layer 1 runs 2-3: all of it still on the device when backward starts at 2
    assert resident_at_backward_start(p, [10, 10]) == 10
    slow = _two_layers(store_Bps=5.0)  # layer 0's store runs 1-3: half of it done by t=2
    assert resident_at_backward_start(slow, [10, 0]) == pytest.approx(15.0)
    assert choose_budget(p, granularity=1).resident_bytes == 10


def test_budget_dict_round_trip() -> None:
    b = choose_budget(_two_layers(), granularity=1)
    d = b.as_dict()
    assert d["keep_last_k"] == 1 and d["allow_bytes"] == [10, 0]
    assert isinstance(b, Budget)


def _h200_hidden_4096() -> StepProfile:
    """The profiled step of results/gpu/offload_bench.json at hidden 4096 (8 layers of 1 GiB, 55 GB/s)."""
    return StepProfile((1 << 30,) * 8, (0.0055,) * 8, (0.0121,) * 8, 55e9, 55e9, 0.0006)


def test_recompute_buys_with_the_slack_the_earliest_kept_layer_never_the_last() -> None:
    p = _h200_hidden_4096()
    plain = choose_budget(p, prefetch=3, slack_s=0.05 * p.step_s)
    b = choose_budget(p, prefetch=3, slack_s=0.05 * p.step_s, recompute=True)
    assert plain.recompute == () and b.allow_bytes == plain.allow_bytes
    # layers 0-2 and part of 3 are offloaded; 6.5 ms of slack pays one forward (5.5 ms): layer 4, the earliest kept
    assert b.recompute == (False,) * 4 + (True,) + (False,) * 3
    assert b.recompute_s == pytest.approx(0.0055) and b.exposed_s + b.recompute_s <= 0.05 * p.step_s
    assert b.resident_bytes == pytest.approx(plain.resident_bytes - (1 << 30))
    everything = choose_budget(p, prefetch=3, slack_s=0.9 * p.step_s, recompute=True)
    # layers 4 and 5 bring the peak down to layer 3's backward, which holds itself and three reloads (4 GiB):
    # recomputing layer 6 would cost its forward and buy nothing, and the last layer is never a candidate
    assert everything.recompute == (False,) * 4 + (True, True, False, False)
    assert everything.peak_bytes == pytest.approx(4 * (1 << 30))
    assert choose_budget(p, prefetch=3, slack_s=0.005, recompute=True).recompute == ()  # below one forward


def test_recompute_counts_the_wait_it_adds_and_never_a_layer_with_bytes_offloaded() -> None:
    p = _two_layers(fwd_s=(1.0,) * 4, bwd_s=(2.0,) * 4, group_bytes=(10,) * 4)
    allow = [10, 0, 0, 0]
    # layer 1 recomputed: 1 s of forward, and layer 0's reload (issued at layer 1's backward) is still hidden
    assert choose_recompute(p, allow, slack_s=1.0) == (False, True, False, False)
    assert choose_recompute(p, allow, slack_s=0.99) == (False, False, False, False)
    assert choose_recompute(p, [10, 10, 10, 0], slack_s=10.0) == (False,) * 4
    assert with_recompute(p, (False, True, False, False)).bwd_s == (2.0, 3.0, 2.0, 2.0)
    # the peak then sits in layer 1's backward (itself rebuilt, layer 0 reloading: 20): recomputing layer 2 as
    # well would cost a forward and not lower it, so ample slack buys layer 1 only
    assert peak_resident(p, allow) == 30
    assert peak_resident(p, allow, recompute=(False, True, False, False)) == 20
    assert choose_recompute(p, allow, slack_s=10.0) == (False, True, False, False)
    with pytest.raises(ValueError, match="allow has 2 entries for 4 layers"):
        choose_recompute(p, [10, 0], slack_s=1.0)


def test_replay_of_the_h200_profiles_recomputes_one_layer_within_the_slack(tmp_path) -> None:
    """benchmarks/offload_budget_replay.py on the committed H200 result: each size buys one recomputed layer (the
    earliest kept) with 5 % of the profiled step, and the modelled memory at backward start drops by that layer."""
    import json

    from benchmarks.offload_budget_replay import main

    out = tmp_path / "replay.json"
    assert main(["--out", str(out)]) == 0
    rows = {r["hidden"]: r for r in json.loads(out.read_text())["sizes"]}
    assert sorted(rows) == [4096, 8192]
    for h, layer in ((4096, 4), (8192, 6)):
        m = rows[h]["modelled"]
        assert m["budget"]["recomputed_layers"] == [] and m["budget_recompute"]["recomputed_layers"] == [
            layer
        ]
        assert m["budget_recompute"]["added_vs_profiled_step"] <= 0.05
        drop = (
            m["budget"]["resident_GiB_at_backward_start"]
            - m["budget_recompute"]["resident_GiB_at_backward_start"]
        )
        assert drop == pytest.approx(1.0)  # one layer of 1 GiB


def test_peak_resident_counts_the_group_in_backward_and_the_reloads_ahead() -> None:
    """Every layer but the last offloaded over a link that stores each layer within the next one's forward: the peak
    is not where backward begins (one layer) but in backward, a layer plus the reloads issued ahead of it, as measured
    on an H200 (hidden 8192: every layer but the last and one-layer prefetch stopped at two of eight layers)."""
    g = 1 << 30
    p = StepProfile((g,) * 4, (1.0,) * 4, (2.0,) * 4, store_Bps=4.0 * g, load_Bps=4.0 * g)
    allow = [g, g, g, 0]
    assert resident_at_backward_start(p, allow) == pytest.approx(g)
    assert peak_resident(p, allow, prefetch=1) == pytest.approx(2 * g)
    assert peak_resident(p, allow, prefetch=2) == pytest.approx(3 * g)
    # nothing offloaded: everything resident where backward begins, recomputed layers excluded there
    assert peak_resident(p, [0, 0, 0, 0]) == pytest.approx(4 * g)
    assert peak_resident(p, [0, 0, 0, 0], recompute=(True, True, False, False)) == pytest.approx(2 * g)
    with pytest.raises(ValueError, match="recompute has 2 entries for 4 layers"):
        peak_resident(p, allow, recompute=(True, False))
    with pytest.raises(ValueError, match="allow has 3 entries for 4 layers"):
        peak_resident(p, allow[:3])


def test_release_points_are_the_first_hooks_after_each_store_ends() -> None:
    """Three layers of 10 bytes, forward 1 s and backward 2 s each. At 10 B/s layer 0's store runs 1-2 s, ending as
    layer 2's forward starts; layer 1's runs 2-3 s, past every forward start, and ends as backward begins (layer 2,
    at 3 s). At 2.5 B/s the stores end at 5 s and 9 s: layer 0's at layer 1's backward begin (13 s, after waiting
    for layer 1's reload), layer 1's only at its own."""
    fast = _two_layers(fwd_s=(1.0,) * 3, bwd_s=(2.0,) * 3, group_bytes=(10,) * 3)
    assert release_points(fast, [10, 10, 0]) == (("forward", 2), ("backward", 2), None)
    slow = _two_layers(fwd_s=(1.0,) * 3, bwd_s=(2.0,) * 3, group_bytes=(10,) * 3, store_Bps=2.5, load_Bps=2.5)
    assert release_points(slow, [10, 10, 0]) == (("backward", 1), ("backward", 1), None)
    assert release_points(slow, [0, 0, 0]) == (None, None, None)


def test_gpu_run_plot_draws_every_measured_strategy(tmp_path) -> None:
    """benchmarks/offload_gpu_plot.py on the committed H200 run: one panel per size, a point per strategy that ran
    (reserved peaks since 2026-11-27), and a clear refusal of a run without sizes."""
    import json

    from benchmarks.offload_gpu_plot import ROOT, main, points, source_script

    bench = ROOT / "results/gpu/offload_bench.json"
    doc = json.loads(bench.read_text())
    panels = points(doc)
    assert [(p["hidden"], p["layers"]) for p in panels] == [(4096, 8), (8192, 8), (8192, 16)]
    assert [p["goal"] for p in panels] == [(0.4, 1.05), (0.7, 1.05), (0.7, 1.05)]  # as the bench judged them
    ran = {n for n, r in doc["sizes"][1]["strategies"].items() if r.get("status") == "ok" and n != "keep"}
    assert set(panels[1]["rows"]) == ran and all(res is not None for _, _, res in panels[1]["rows"].values())
    out = tmp_path / "plot.png"
    assert main([str(bench), "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    empty = tmp_path / "empty.json"
    empty.write_text(json.dumps({"sizes": []}))
    assert main([str(empty)]) == 2
    assert source_script(doc).endswith("tests/gpu/offload_bench.py")
    mcore = {"provenance": {"command": "python3 tests/gpu/megatron_offload_bench.py --out /o/m.json"}}
    # the Megatron bench's runs plot alike
    assert source_script(mcore) == "tests/gpu/megatron_offload_bench.py"


def test_the_docs_gpu_table_is_the_one_the_committed_run_gives() -> None:
    """docs/offload.md's H200 table is benchmarks/offload_gpu_table.py's output for results/gpu/offload_bench.json
    (hand-copied cells had drifted by double rounding: 0.345 written as 0.35); cells say when a column did not run."""
    import json

    from benchmarks.offload_gpu_plot import ROOT
    from benchmarks.offload_gpu_table import cell, table

    doc = json.loads((ROOT / "results/gpu/offload_bench.json").read_text())
    cols = "recompute,torch_save_on_cpu,flowlane,flowlane_recompute,flowlane_sublayer_recompute,flowlane_sublayer_all"
    rows = table(doc, cols.split(",")).split("\n\n")[0]
    assert rows in (ROOT / "docs/offload.md").read_text()
    assert "| h8192, 16 layers (keep 566.5 ms, 17.0 GiB) | 1.21x; 0.16 / 0.08 | not run |" in rows
    assert cell({"status": "error"}) == "error" and cell({}) == "not run"
    assert cell({"status": "ok", "time_ratio_vs_keep": 1.0, "act_mem_ratio_vs_keep": 0.5}) == "1.00x; 0.50"
