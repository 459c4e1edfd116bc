"""The default recipe with dp_collective=syndicate in FIFO mode (PP2 x DP2 on 4 gloo ranks, the recipe's own train
loop): data-parallel rank 0 of each pipeline stage writes the profile of iteration 1 for the plan search
(``output_dir/syndicate_profile_stage{pp_rank}.json``), and the recorded signatures stay bounded over the run. That
FIFO mode, profiling included, is bitwise Megatron's own run is tested in tests/test_syndicate_megatron.py."""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest

pytestmark = pytest.mark.llm
pytest.importorskip("megatron.core")

RECIPE = dict(
    world_size=4,
    pipeline_parallel=2,
    num_layers=2,
    hidden_size=32,
    num_attention_heads=4,
    vocab_size=64,
    seq_length=16,
    micro_batch_size=2,
    num_microbatches=2,
    iterations=3,
    progress=False,
    timeout_s=150,
    dp_bucket_bytes=8192,
    features={"dp_collective": {"name": "syndicate", "mode": "fifo"}},
)


def _fifo(rank: int, world: int, out_dir: str) -> dict:
    import megatron_plugin.syndicate as S
    from recipes.gpt import GPTRecipe, train_rank

    kept = []  # the recipe's handle, to read what it kept after the run
    install = S.install_from_config

    def keep(group, ctx):
        kept.append(install(group, ctx))
        return kept[-1]

    S.install_from_config = keep
    try:
        r = train_rank(rank, world, asdict(GPTRecipe(**RECIPE, output_dir=out_dir)))
    finally:
        S.install_from_config = install
    syn = kept[0]
    return {
        "pp_stage": r["pp_stage"],
        "dp_rank": r["dp_rank"],
        "dp_bytes": r["bytes_by_kind"]["dp"],
        "submitted": syn.submitted,
        "iterations": syn.enforcer.iteration,
    }


def test_fifo_mode_writes_each_stages_profile_and_keeps_the_signatures_bounded(tmp_path) -> None:
    from flowlane.launch import launch

    res = launch(_fifo, 4, args=(str(tmp_path),), timeout=400)
    assert sorted(p.name for p in tmp_path.glob("syndicate_profile*")) == [
        "syndicate_profile_stage0.json",
        "syndicate_profile_stage1.json",
    ]
    for stage in (0, 1):
        prof = json.loads((tmp_path / f"syndicate_profile_stage{stage}.json").read_text())
        group = sorted(rank for rank, r in enumerate(res) if r["pp_stage"] == stage)
        writer = next(r for r in res if r["pp_stage"] == stage and r["dp_rank"] == 0)
        assert prof["format"] == "flowlane.syndicate.profile/1" and prof["iteration"] == 1, prof
        assert prof["ranks"] == group and "commit" in prof["provenance"]
        # every bucket's fp32 gradient all-reduce over the stage's DP group (the recipe counts those bytes for the
        # 2 steady iterations), each waited for by finalize_model_grads before the iteration's end
        assert prof["ops"] and {(o["kind"], o["dtype"]) for o in prof["ops"]} == {("all_reduce", "float32")}
        assert sum(o["numel"] for o in prof["ops"]) * 4 * 2 == writer["dp_bytes"]
        for o in prof["ops"]:
            assert o["ranks"] == group
            assert 0 <= o["submit_s"] <= o["done_s"] <= prof["iteration_s"], prof
    for r in res:  # 3 iterations ran; the signatures of iterations 0 and 1 only are kept
        assert r["iterations"] == 3
        assert {it for it, *_ in r["submitted"]} == {0, 1}, r["submitted"]


def test_a_fifo_run_too_short_for_its_profile_is_refused_before_it_starts() -> None:
    from recipes.gpt import GPTRecipe

    fifo = {"name": "syndicate", "mode": "fifo"}
    short = dict(RECIPE, iterations=1)
    with pytest.raises(ValueError, match=r"profile_iteration=1 \(counted from 0\), but iterations=1"):
        GPTRecipe(**short).validate()
    GPTRecipe(**dict(short, features={"dp_collective": {**fifo, "profile_iteration": -1}})).validate()
    GPTRecipe(**dict(short, features={"dp_collective": {**fifo, "profile_iteration": 0}})).validate()
    GPTRecipe(**dict(short, features={"dp_collective": {"name": "syndicate", "plan": "p.json"}})).validate()
