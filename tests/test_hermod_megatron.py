"""Hermod on Megatron-core (tiny GPT, PP2 x DP2 on 4 gloo ranks, Megatron's own 1F1B schedule): losses and
parameters are identical with and without Hermod, PP ops carry microbatch ids from the schedule, DP buckets go out
in chunks keyed (MID M-1, DP, layer); plus the launch flag through Megatron's extra-args mechanism."""

from __future__ import annotations

import argparse
import re
from dataclasses import asdict

import pytest

pytestmark = pytest.mark.llm
pytest.importorskip("megatron.core")

RECIPE = dict(num_ranks=4, pipeline_parallel=2, num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=64,
              seq_length=16, micro_batch_size=2, num_microbatches=3, iterations=2, progress=False, timeout_s=150,
              dp_bucket_bytes=8192)
HERMOD = {"name": "hermod", "chunk_bytes": 4096, "gate_timeout_s": 0.02}


def _both(rank: int, world: int) -> dict:
    from recipes.gpt import GPTRecipe, train_rank

    base = train_rank(rank, world, asdict(GPTRecipe(**RECIPE)))
    herm = train_rank(rank, world, asdict(GPTRecipe(**RECIPE, features={"scheduler": HERMOD})))
    keep = ("losses", "param_digest", "pp_stage", "ops_by_kind")
    ops = lambda r: [e["args"] | {"name": e["name"]} for e in r["trace"] if e.get("ph") == "X" and "kind" in e.get("args", {})]  # noqa: E731
    # the process-wide recorder is append-only: the second run's ops follow the first run's
    base_ops = ops(base)
    herm_ops = ops(herm)[len(base_ops):]
    # the recipe on Megatron-core's own DDP and distributed optimizer with its overlap flags, without and with Hermod
    on_megatron = dict(RECIPE, megatron_ddp=True, distributed_optimizer=True, overlap_grad_reduce=True,
                       overlap_param_gather=True)
    mbase = train_rank(rank, world, asdict(GPTRecipe(**on_megatron)))
    mherm = train_rank(rank, world, asdict(GPTRecipe(**on_megatron, features={"scheduler": HERMOD})))
    return {"base": {k: base[k] for k in keep} | {"ops": base_ops}, "hermod": {k: herm[k] for k in keep} | {"ops": herm_ops},
            "megatron_ddp": [(r["losses"], r["param_digest"]) for r in (mbase, mherm)]}


def test_megatron_losses_and_parameters_equal_with_and_without_hermod_and_ops_are_keyed():
    from flowlane.launch import launch

    res = launch(_both, 4, timeout=280)
    for r in res:
        b, h = r["base"], r["hermod"]
        assert b["losses"] == h["losses"]
        assert b["param_digest"] == h["param_digest"]
        n_dp = lambda ops: sum(o["kind"] == "dp" for o in ops)  # noqa: E731
        assert n_dp(h["ops"]) > n_dp(b["ops"]) > 0  # buckets were chunked
        pp_mbs = {int(m.group(1)) for o in h["ops"] if o["kind"] == "pp"
                  for m in [re.search(r"microbatch=(\d+)", o["key"] or "")] if m}
        assert pp_mbs == set(range(RECIPE["num_microbatches"]))
        dp_keys = [o["key"] for o in h["ops"] if o["kind"] == "dp"]
        assert dp_keys and all(k is not None for k in dp_keys), [(o["name"], o["bytes"]) for o in h["ops"] if o["kind"] == "dp" and o["key"] is None]
        assert all("ctype='dp'" in k and f"microbatch={RECIPE['num_microbatches'] - 1}" in k
                               for k in dp_keys)
    assert any(r["hermod"]["losses"] for r in res)
    for r in res:  # megatron_ddp=true: Hermod under the recipe's Megatron-core DDP gives stock's losses and parameters
        (base_losses, base_digest), (herm_losses, herm_digest) = r["megatron_ddp"]
        assert base_losses == herm_losses and base_digest == herm_digest
    assert len({frozenset(o["name"] for o in r["hermod"]["ops"] if o["kind"] == "ep") for r in res}) == 1


def test_coflow_scheduler_flag_is_added_through_the_extra_args_provider():
    from megatron_plugin.args import add_flowlane_args
    from megatron_plugin.hermod import HermodConfig, config_from_args

    p = add_flowlane_args(argparse.ArgumentParser())
    args = p.parse_args(["--coflow-scheduler", "hermod", "--hermod-dp-mid", "consumer", "--hermod-chunk-bytes", "65536"])
    cfg = config_from_args(args)
    assert cfg == HermodConfig(name="hermod", dp_mid="consumer", chunk_bytes=65536)
    assert config_from_args(p.parse_args([])).name == "none"
    with pytest.raises(SystemExit):
        p.parse_args(["--coflow-scheduler", "lina"])
    with pytest.raises(ValueError, match="unknown scheduler config key"):
        HermodConfig.from_dict({"name": "hermod", "chunk": 1})
    with pytest.raises(ValueError, match="chunk_bytes"):
        HermodConfig(chunk_bytes=0)
    assert config_from_args(p.parse_args(["--coflow-scheduler", "hermod", "--hermod-ep-algorithm",
                                          "bvn_bottleneck"])).ep_algorithm == "bvn_bottleneck"
    assert config_from_args(p.parse_args(["--coflow-scheduler", "hermod", "--hermod-ep-algorithm",
                                          "auto"])).ep_algorithm == "auto"
    with pytest.raises(ValueError, match=r"ep_algorithm 'bvm' is not one of \['bvn', 'bvn_bottleneck', 'alg3', "
                                         r"'plain', 'auto'\]"):
        HermodConfig(ep_algorithm="bvm")  # type: ignore[arg-type]
    assert config_from_args(p.parse_args([])).ep_auto_candidates == ("plain", "bvn")
    assert config_from_args(p.parse_args(["--hermod-ep-algorithm", "auto", "--hermod-ep-auto-candidates",
                                          "plain,bvn,alg3"])).ep_auto_candidates == ("plain", "bvn", "alg3")
    assert HermodConfig.from_dict({"ep_auto_candidates": ["alg3", "plain"]}).ep_auto_candidates == ("alg3", "plain")
    assert config_from_args(p.parse_args(["--hermod-ep-auto-probe-iterations", "4"])).ep_auto_probe_iterations == 4
    with pytest.raises(ValueError, match="ep_auto_probe_iterations must be an integer >= 1, got 0"):
        HermodConfig(ep_auto_probe_iterations=0)
    with pytest.raises(ValueError, match=r"auto candidates \['plain', 'bvm'\] must be two or more distinct names"):
        config_from_args(p.parse_args(["--hermod-ep-auto-candidates", "plain,bvm"]))


# -- MoE: expert parameters over the expert-DP group, EP all-to-all through flowlane.comm ---------------------------
MOE = dict(num_ranks=4, pipeline_parallel=2, num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=64,
           seq_length=16, micro_batch_size=2, num_microbatches=3, iterations=2, progress=False, timeout_s=200,
           dp_bucket_bytes=8192, num_moe_experts=4, expert_parallel=2, moe_router_topk=2)


# EP 4 over PP1 x DP4: the matched all-to-all runs as incast-free phases (isend/irecv); EP 2 has no incast to avoid
# (flowlane.sched.alltoall.needs_matching), so each all-to-all is one all_to_all_single (recorded as "all_to_all")
MOE_EP4 = dict(MOE, pipeline_parallel=1, expert_parallel=4)


def _both_moe(rank: int, world: int, cfg: dict, hermod: dict) -> dict:
    from recipes.gpt import GPTRecipe, train_rank

    base = train_rank(rank, world, asdict(GPTRecipe(**cfg)))
    herm = train_rank(rank, world, asdict(GPTRecipe(**cfg, features={"scheduler": hermod})))
    ops = lambda r: [e["args"] | {"name": e["name"]} for e in r["trace"] if e.get("ph") == "X" and "kind" in e.get("args", {})]  # noqa: E731
    base_ops = ops(base)
    herm_ops = ops(herm)[len(base_ops):]
    keep = ("losses", "param_digest", "pp_stage")
    return {"base": {k: base[k] for k in keep} | {"ops": base_ops}, "hermod": {k: herm[k] for k in keep} | {"ops": herm_ops}}


@pytest.mark.parametrize(("cfg", "hermod", "ep_ops"), [
    (MOE, HERMOD, {"all_to_all"}), (MOE_EP4, HERMOD, {"isend", "irecv"}),
    # auto over 6 iterations, three candidates timed one iteration each: 0 warms up (not recorded), 1-3 run plain,
    # BvN and Algorithm 3 phases, the end of 3 decides (all-reduce + broadcast, on every rank through
    # Hermod.end_iteration; with the default two probe iterations it would not decide within 6), 4-5 run the choice
    (dict(MOE_EP4, iterations=6), {**HERMOD, "ep_algorithm": "auto", "ep_auto_candidates": "plain,bvn,alg3",
                                   "ep_auto_probe_iterations": 1},
     {"all_to_all", "isend", "irecv", "all_reduce", "broadcast"}),
], ids=["pp2-ep2", "pp1-ep4", "pp1-ep4-auto"])
def test_moe_identical_with_and_without_hermod_experts_stay_off_the_dp_group(cfg: dict, hermod: dict,
                                                                             ep_ops: set) -> None:
    """Bitwise with DP 2. With DP 4 the chunked gradient all-reduce sums in another order (gloo's ring assigns each
    element's order by its position in the buffer; CommScheduler.chunk_bounds), so parameters agree to rounding:
    ~1e-9 relative in the digest was observed, the tolerance is 1e-7 (bitwise runs without chunking)."""
    from flowlane.launch import launch
    from recipes.gpt import GPTRecipe

    recipe = GPTRecipe(**cfg)
    recipe.validate()  # EP folded into DP: expert-DP size 1
    assert recipe.data_parallel == 4 // cfg["pipeline_parallel"]
    res = launch(_both_moe, 4, args=(cfg, hermod), timeout=400)
    for r in res:
        b, h = r["base"], r["hermod"]
        if recipe.data_parallel == 2:
            assert b["losses"] == h["losses"]
            assert b["param_digest"] == h["param_digest"]
        else:
            assert h["losses"] == pytest.approx(b["losses"], rel=1e-6)
            assert h["param_digest"] == pytest.approx(b["param_digest"], rel=1e-7)
        dp_bytes = lambda ops: sum(o["bytes"] for o in ops if o["kind"] == "dp")  # noqa: E731
        # same buckets over the same groups: expert parameters (expert-DP size 1 here) never go over the DP group
        assert dp_bytes(h["ops"]) == dp_bytes(b["ops"]) > 0
        # the MoE dispatcher's all-to-alls go through flowlane.comm, keyed, only with Hermod on
        ep = [o for o in h["ops"] if o["kind"] == "ep"]
        assert ep and all("ctype='ep'" in (o["key"] or "") for o in ep)
        assert {o["name"] for o in ep} == ep_ops
        assert not any(o["kind"] == "ep" for o in b["ops"])
    assert any(r["hermod"]["losses"] for r in res)


# -- HermodGradSync without Megatron's model: an expert with no tokens on one rank in one microbatch ----------------
def _expert_without_tokens(rank: int, world: int) -> dict:
    import torch
    import torch.distributed as dist

    from megatron_plugin.comm_hooks import DataParallelGradSync
    from megatron_plugin.hermod import Hermod, HermodConfig

    M = 2

    def model() -> torch.nn.Module:
        torch.manual_seed(0)
        m = torch.nn.Module()
        m.dense = torch.nn.Linear(64, 64)
        m.expert = torch.nn.Linear(64, 64)
        for p in m.expert.parameters():
            p.allreduce = False  # as Megatron marks expert parameters
        return m

    def step(m: torch.nn.Module, sync: object) -> list:
        for p in m.parameters():
            p.grad = None
        for mb in range(M):
            x = torch.full((4, 64), float(rank + mb + 1))
            y = m.dense(x)
            if not (rank == 1 and mb == 1):  # rank 1's expert gets no tokens in the last microbatch: no hook
                y = y + m.expert(x)
            y.square().mean().backward()
            if hasattr(sync, "h"):  # a pipeline p2p between microbatches seals the scheduler's window
                with sync.h.sched.critical_section(sync.h.keys.meta("pp", mb, 0, "send_prev")):
                    pass
        sync([m])
        return [p.grad.clone() for p in m.parameters()]

    m_ref = model()
    ref_sync = DataParallelGradSync(dist.group.WORLD, bucket_bytes=4096, expert_dp_group=dist.group.WORLD)
    ref = [step(m_ref, ref_sync) for _ in range(2)]
    h = Hermod(HermodConfig(chunk_bytes=2048, gate_timeout_s=0.01), num_microbatches=M, layers_per_stage=1, stage=0,
               dp_group=dist.group.WORLD, expert_dp_group=dist.group.WORLD)
    m = model()
    sync = h.grad_sync(m, 4096)
    got = [step(m, sync) for _ in range(2)]  # twice: the per-iteration state resets
    h.close()
    return {"equal": all(torch.equal(a, b) for it in range(2) for a, b in zip(got[it], ref[it], strict=True)),
            "n_dp_ops": sum(e.event == "chunk" for e in h.sched.log)}


def test_grad_sync_launches_expert_bucket_whose_hook_never_completes():
    from flowlane.launch import launch

    res = launch(_expert_without_tokens, 2, timeout=120)
    assert all(r["equal"] for r in res)
    assert res[0]["n_dp_ops"] == res[1]["n_dp_ops"] > 0


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
    assert "interleaved" in check_hermod_args(args(virtual_pipeline_model_parallel_size=2))
    assert "allgather" in check_hermod_args(args(num_experts=4, moe_token_dispatcher_type="allgather"))
    assert check_hermod_args(args(num_experts=4, moe_token_dispatcher_type="alltoall")) == ""
    assert "--ddp-bucket-size" in check_hermod_args(args(hermod_chunk_bytes=1 << 20))
    built = []
    hooks = FlowlaneHooks(lambda **kw: built.append(kw), lambda *a: None, get_args=lambda: args(overlap_grad_reduce=False))
    with pytest.raises(ValueError, match="cannot run with this configuration: add --overlap-grad-reduce"):
        hooks.model_provider(pre_process=True, post_process=True)
    assert built == []  # refused before the model is built
