"""Hermod through the default recipe (tiny GPT on Megatron-core's own DDP and optimizer, PP2 x DP2 on 4 gloo
ranks, Megatron's own 1F1B schedule): losses and parameters are identical with and without Hermod, PP ops carry
microbatch ids from the schedule; MoE with the matched all-to-all; the launch flag through Megatron's extra-args
mechanism. The bucket-group keys and Megatron-LM's call sequence: tests/test_hermod_megatron_ddp.py."""

from __future__ import annotations

import argparse
import re
from dataclasses import asdict
from pathlib import Path

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
    num_microbatches=3,
    iterations=2,
    progress=False,
    timeout_s=150,
    dp_bucket_bytes=8192,
)
HERMOD = {"name": "hermod", "gate_timeout_s": 0.02}


def _both(rank: int, world: int) -> dict:
    from torch.distributed import distributed_c10d as c10d

    from recipes.gpt import GPTRecipe, train_rank

    out = {}
    keep = ("losses", "param_digest", "pp_stage", "bytes_by_kind")

    def ops(r):
        return [
            e["args"] | {"name": e["name"]}
            for e in r["trace"]
            if e.get("ph") == "X" and "kind" in e.get("args", {})
        ]

    def left_behind() -> tuple[int, int]:  # (threads, process groups) once a run has returned
        status = Path("/proc/self/status").read_text()
        threads = int(next(line for line in status.splitlines() if line.startswith("Threads")).split()[1])
        return threads, len(c10d._world.pg_map)

    seen = 0  # the process-wide recorder is append-only: each run's ops follow the earlier runs'
    # Megatron-core's DDP with --overlap-grad-reduce (the recipe's default), then with its distributed optimizer
    # and --overlap-param-gather, each without and with Hermod: four trainings in one process
    for name, flags in (
        ("ddp", {}),
        ("dist_opt", {"distributed_optimizer": True, "overlap_param_gather": True}),
    ):
        base = train_rank(rank, world, asdict(GPTRecipe(**RECIPE, **flags)))
        after_base = left_behind()
        herm = train_rank(rank, world, asdict(GPTRecipe(**RECIPE, **flags, features={"scheduler": HERMOD})))
        base_ops, herm_ops = ops(base), ops(herm)
        out[name] = {
            "base": {k: base[k] for k in keep} | {"ops": base_ops[seen:], "left": after_base},
            "hermod": {k: herm[k] for k in keep} | {"ops": herm_ops[len(base_ops) :], "left": left_behind()},
        }
        seen = len(herm_ops)
    return out


def test_recipe_on_megatron_ddp_bitwise_equal_with_and_without_hermod_and_pp_ops_are_keyed():
    """Also: the recipe runs again and again in one process (tests, alternating benchmark variants) and releases its
    process groups and hooks after each run."""
    from flowlane.launch import launch

    res = launch(_both, 4, timeout=280)
    for r in res:
        # Megatron's destroy_model_parallel forgets its groups without destroying them, and Hermod's clones and
        # hooks would keep threads and sockets alive: only the default group is left after each of the four runs
        left = [x[side]["left"] for x in r.values() for side in ("base", "hermod")]
        assert {pgs for _, pgs in left} == {1}, left
        assert len({t for t, _ in left}) == 1, left  # no thread outlives its run
        for name, x in r.items():
            b, h = x["base"], x["hermod"]
            assert b["losses"] == h["losses"], name
            assert b["param_digest"] == h["param_digest"], name
            # Megatron's own buckets (the recorder's pp/ep counts are cumulative over the process's runs)
            assert b["bytes_by_kind"]["dp"] == h["bytes_by_kind"]["dp"] > 0, name
            pp_mbs = {
                int(m.group(1))
                for o in h["ops"]
                if o["kind"] == "pp"
                for m in [re.search(r"microbatch=(\d+)", o["key"] or "")]
                if m
            }
            assert pp_mbs == set(range(RECIPE["num_microbatches"])), name
            assert all(o["key"] is None for o in b["ops"]), name
    assert any(x["hermod"]["losses"] for r in res for x in r.values())


def test_coflow_scheduler_flag_is_added_through_the_extra_args_provider():
    from megatron_plugin.args import add_flowlane_args
    from megatron_plugin.hermod import HermodConfig, config_from_args

    p = add_flowlane_args(argparse.ArgumentParser())
    args = p.parse_args(
        ["--coflow-scheduler", "hermod", "--hermod-dp-mid", "last", "--hermod-max-inflight-buckets", "1"]
    )
    cfg = config_from_args(args)
    assert cfg == HermodConfig(name="hermod", dp_mid="last", max_inflight_buckets=1)
    # every DP window holds one bucket group (sealed where Megatron starts it): dp_mid could reorder nothing
    with pytest.raises(ValueError, match=r"dp_mid='consumer' has no effect on Megatron-core: .* one DP op"):
        config_from_args(p.parse_args(["--coflow-scheduler", "hermod", "--hermod-dp-mid", "consumer"]))
    # the phase cap applies to BvN plans only
    for alg in ("alg3", "plain"):
        with pytest.raises(
            ValueError, match=rf"ep_max_phases=8 has no effect with '{alg}': .*\(bvn, bvn_bottleneck\)"
        ):
            HermodConfig(ep_algorithm=alg, ep_max_phases=8)
    with pytest.raises(
        ValueError, match=r"ep_max_phases=8 has no effect with auto with candidates \['plain', 'alg3'\]"
    ):
        HermodConfig(ep_algorithm="auto", ep_auto_candidates=("plain", "alg3"), ep_max_phases=8)
    assert (
        HermodConfig(ep_algorithm="auto", ep_max_phases=8).ep_max_phases == 8
    )  # auto's bvn candidate is capped
    with pytest.raises(SystemExit):  # a bucket group is never split: there is no chunk size to set
        p.parse_args(["--coflow-scheduler", "hermod", "--hermod-chunk-bytes", "65536"])
    assert config_from_args(p.parse_args([])).name == "none"
    with pytest.raises(SystemExit):
        p.parse_args(["--coflow-scheduler", "lina"])
    with pytest.raises(ValueError, match="unknown scheduler config key"):
        HermodConfig.from_dict({"name": "hermod", "chunk": 1})
    with pytest.raises(ValueError, match=r"scheduler.chunk_bytes=4096: .* bucket group as one coflow"):
        HermodConfig.from_dict({"name": "hermod", "chunk_bytes": 4096})
    with pytest.raises(ValueError, match="max_inflight_buckets must be an integer >= 1, got 0"):
        HermodConfig(max_inflight_buckets=0)
    # pacer knobs have no effect where NCCL's program-order launch runs: refused, not ignored
    assert HermodConfig().scheduler_config("nccl").launch == "program_order"
    with pytest.raises(
        ValueError, match=r"gate_timeout_s=0.02: .* no effect under launch=program_order .*auto.*nccl"
    ):
        HermodConfig(gate_timeout_s=0.02).scheduler_config("nccl")
    assert HermodConfig(gate_timeout_s=0.02, launch="pacer").scheduler_config("nccl").gate_timeout_s == 0.02
    assert HermodConfig(gate_timeout_s=0.02).scheduler_config("gloo").launch == "pacer"
    assert (
        config_from_args(
            p.parse_args(["--coflow-scheduler", "hermod", "--hermod-ep-algorithm", "bvn_bottleneck"])
        ).ep_algorithm
        == "bvn_bottleneck"
    )
    assert (
        config_from_args(
            p.parse_args(["--coflow-scheduler", "hermod", "--hermod-ep-algorithm", "auto"])
        ).ep_algorithm
        == "auto"
    )
    with pytest.raises(
        ValueError,
        match=r"ep_algorithm 'bvm' is not one of \['bvn', 'bvn_bottleneck', 'alg3', "
        r"'plain', 'auto'\]",
    ):
        HermodConfig(ep_algorithm="bvm")  # type: ignore[arg-type]
    assert config_from_args(p.parse_args([])).ep_auto_candidates == ("plain", "bvn")
    assert config_from_args(
        p.parse_args(["--hermod-ep-algorithm", "auto", "--hermod-ep-auto-candidates", "plain,bvn,alg3"])
    ).ep_auto_candidates == ("plain", "bvn", "alg3")
    assert HermodConfig.from_dict({"ep_auto_candidates": ["alg3", "plain"]}).ep_auto_candidates == (
        "alg3",
        "plain",
    )
    assert (
        config_from_args(p.parse_args(["--hermod-ep-auto-probe-iterations", "4"])).ep_auto_probe_iterations
        == 4
    )
    with pytest.raises(ValueError, match="ep_auto_probe_iterations must be an integer >= 1, got 0"):
        HermodConfig(ep_auto_probe_iterations=0)
    with pytest.raises(
        ValueError, match=r"auto candidates \['plain', 'bvm'\] must be two or more distinct names"
    ):
        config_from_args(p.parse_args(["--hermod-ep-auto-candidates", "plain,bvm"]))


# -- MoE: expert parameters over the expert-DP group, EP all-to-all through flowlane.comm ---------------------------
MOE = dict(
    world_size=4,
    pipeline_parallel=2,
    num_layers=2,
    hidden_size=32,
    num_attention_heads=4,
    vocab_size=64,
    seq_length=16,
    micro_batch_size=2,
    num_microbatches=3,
    iterations=2,
    progress=False,
    timeout_s=200,
    dp_bucket_bytes=8192,
    num_moe_experts=4,
    expert_parallel=2,
    moe_router_topk=2,
)


# EP 4 over PP1 x DP4: the matched all-to-all runs as incast-free phases (isend/irecv); EP 2 has no incast to avoid
# (flowlane.sched.alltoall.needs_matching), so each all-to-all is one all_to_all_single (recorded as "all_to_all")
MOE_EP4 = dict(MOE, pipeline_parallel=1, expert_parallel=4)


def _both_moe(rank: int, world: int, cfg: dict, hermod: dict) -> dict:
    from recipes.gpt import GPTRecipe, train_rank

    base = train_rank(rank, world, asdict(GPTRecipe(**cfg)))
    herm = train_rank(rank, world, asdict(GPTRecipe(**cfg, features={"scheduler": hermod})))

    def ops(r):
        return [
            e["args"] | {"name": e["name"]}
            for e in r["trace"]
            if e.get("ph") == "X" and "kind" in e.get("args", {})
        ]

    base_ops = ops(base)
    herm_ops = ops(herm)[len(base_ops) :]
    keep = ("losses", "param_digest", "pp_stage", "bytes_by_kind", "feature_stats")
    return {
        "base": {k: base[k] for k in keep} | {"ops": base_ops},
        "hermod": {k: herm[k] for k in keep} | {"ops": herm_ops},
    }


@pytest.mark.parametrize(
    ("cfg", "hermod", "ep_ops"),
    [
        # EP 4 with one gloo communicator per Hermod class (all on loopback): the all-to-alls on the critical clone
        (MOE, HERMOD, {"all_to_all"}),
        (MOE_EP4, {**HERMOD, "gloo_class_ifnames": "lo,lo,lo"}, {"isend", "irecv"}),
        # auto over 6 iterations, three candidates timed one iteration each: 0 warms up (not recorded), 1-3 run plain,
        # BvN and Algorithm 3 phases, the end of 3 decides (all-reduce + broadcast, on every rank through
        # Hermod.end_iteration; with the default two probe iterations it would not decide within 6), 4-5 run the choice
        (
            dict(MOE_EP4, iterations=6),
            {
                **HERMOD,
                "ep_algorithm": "auto",
                "ep_auto_candidates": "plain,bvn,alg3",
                "ep_auto_probe_iterations": 1,
            },
            {"all_to_all", "isend", "irecv", "all_reduce", "broadcast"},
        ),
    ],
    ids=["pp2-ep2", "pp1-ep4", "pp1-ep4-auto"],
)
def test_moe_identical_with_and_without_hermod_experts_stay_off_the_dp_group(
    cfg: dict, hermod: dict, ep_ops: set
) -> None:
    """Bitwise at DP 2 and DP 4: Hermod defers Megatron's own bucket-group reductions, it does not re-chunk them."""
    from flowlane.launch import launch
    from recipes.gpt import GPTRecipe

    recipe = GPTRecipe(**cfg)
    recipe.validate()  # EP folded into DP: expert-DP size 1
    assert recipe.data_parallel == 4 // cfg["pipeline_parallel"]
    res = launch(_both_moe, 4, args=(cfg, hermod), timeout=400)
    for r in res:
        b, h = r["base"], r["hermod"]
        assert b["losses"] == h["losses"]
        assert b["param_digest"] == h["param_digest"]
        # Megatron's own buckets over its own groups, with and without Hermod
        assert h["bytes_by_kind"]["dp"] == b["bytes_by_kind"]["dp"] > 0
        # the MoE dispatcher's all-to-alls go through flowlane.comm, keyed, only with Hermod on
        ep = [o for o in h["ops"] if o["kind"] == "ep"]
        assert ep and all("ctype='ep'" in (o["key"] or "") for o in ep)
        assert {o["name"] for o in ep} == ep_ops
        assert not any(o["kind"] == "ep" for o in b["ops"])
        # matched all-to-alls plan from the token counts Megatron's dispatcher gathered: no second gather
        stats = h["feature_stats"]["Hermod"]
        assert stats["ep_matrices_gathered"] == 0, stats
        assert (stats["ep_matrices_from_dispatcher"] > 0) == ("isend" in ep_ops), stats
    assert any(r["hermod"]["losses"] for r in res)


def test_megatron_lm_configurations_hermod_cannot_schedule_are_refused_with_the_reason() -> None:
    from megatron_plugin.args import add_flowlane_args
    from megatron_plugin.megatron_lm import FlowlaneHooks, check_hermod_args

    def args(**kw):
        a = add_flowlane_args(argparse.ArgumentParser()).parse_args(["--coflow-scheduler", "hermod"])
        a.overlap_grad_reduce = True
        for k, v in kw.items():
            setattr(a, k, v)
        return a

    assert check_hermod_args(args()) == ""
    assert "--overlap-grad-reduce" in check_hermod_args(args(overlap_grad_reduce=False))
    assert "FSDP" in check_hermod_args(args(use_torch_fsdp2=True))
    assert check_hermod_args(args(virtual_pipeline_model_parallel_size=2)) == ""  # the interleaved schedule
    assert "does not match the pipeline schedule (interleaved)" in check_hermod_args(
        args(virtual_pipeline_model_parallel_size=2, hermod_schedule="1f1b")
    )
    assert "does not match the pipeline schedule (1F1B)" in check_hermod_args(
        args(hermod_schedule="interleaved")
    )
    assert "allgather" in check_hermod_args(args(num_experts=4, moe_token_dispatcher_type="allgather"))
    assert check_hermod_args(args(num_experts=4, moe_token_dispatcher_type="alltoall")) == ""
    from types import SimpleNamespace

    from megatron_plugin.hermod import Hermod

    # the megatron-core API refuses the same dispatchers (checked before anything is patched)
    with pytest.raises(ValueError, match="moe_token_dispatcher_type='flex' is not scheduled"):
        Hermod.patch_moe_dispatcher(object(), SimpleNamespace(moe_token_dispatcher_type="flex"))  # type: ignore[arg-type]
    built = []
    hooks = FlowlaneHooks(
        lambda **kw: built.append(kw), lambda *a: None, get_args=lambda: args(overlap_grad_reduce=False)
    )
    with pytest.raises(ValueError, match="cannot run with this configuration: add --overlap-grad-reduce"):
        hooks.model_provider(pre_process=True, post_process=True)
    assert built == []  # refused before the model is built
