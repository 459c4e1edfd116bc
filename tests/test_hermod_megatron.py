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
    return {"base": {k: base[k] for k in keep} | {"ops": base_ops}, "hermod": {k: herm[k] for k in keep} | {"ops": herm_ops}}


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
