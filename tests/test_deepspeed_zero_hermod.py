"""Hermod on DeepSpeed's own ZeRO communication (2 gloo ranks, CPU accelerator): for ZeRO stages 0-3 the losses and
parameters are bitwise those of DeepSpeed's own run, every gradient reduction DeepSpeed issued is issued by Hermod's
pacer on the bulk-class clone in Hermod's key order, and ZeRO-3's parameter gathers run as keyed critical ops."""

from __future__ import annotations

import os

import pytest

pytestmark = pytest.mark.llm
pytest.importorskip("deepspeed")

H, LAYERS, MB, GAS, STEPS = 16, 4, 2, 2, 2
BUCKET = 300  # elements: one Linear(16, 16) (272) per bucket


def _zero(stage: int) -> dict:
    z = {"stage": stage, "reduce_bucket_size": BUCKET}
    if stage == 2:
        z.update(overlap_comm=True, contiguous_gradients=True, allgather_bucket_size=BUCKET)
    if stage == 3:
        z.update(
            overlap_comm=True,
            stage3_param_persistence_threshold=0,
            stage3_prefetch_bucket_size=BUCKET,
            stage3_max_live_parameters=4 * BUCKET,
        )
    return z


def _ds_config(stage: int, world: int, hermod: dict | None) -> dict:
    cfg = {
        "train_batch_size": MB * GAS * world,
        "train_micro_batch_size_per_gpu": MB,
        "gradient_accumulation_steps": GAS,
        "steps_per_print": 1000,
        "zero_optimization": _zero(stage),
        "zero_allow_untested_optimizer": True,
    }
    if hermod is not None:
        cfg["flowlane"] = {"hermod": hermod}
    return cfg


def _run(rank: int, world: int, stage: int, hermod: dict | None, delay_s: float = 0.0) -> dict:
    import time
    from contextlib import contextmanager

    import deepspeed
    import torch

    from deepspeed_plugin.comm import CommTap
    from deepspeed_plugin.hermod import install

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = torch.nn.ModuleList(torch.nn.Linear(H, H) for _ in range(LAYERS))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for b in self.blocks:
                x = torch.tanh(b(x))
            return x.pow(2).mean()

    torch.manual_seed(0)
    net = Net()
    cfg = _ds_config(stage, world, hermod)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    engine, *_ = deepspeed.initialize(model=net, optimizer=opt, config=cfg)
    h = install(engine, cfg)
    tap = h.tap if h is not None else CommTap(None)  # DeepSpeed's own run: record only
    if h is not None and delay_s:  # fault injection: rank 0's pacer and rank 1's coordinator fetches run late
        slow = h.tap.on_class if rank == 0 else h.sched.critical_section

        @contextmanager
        def late(*a, **k):
            time.sleep(delay_s)
            with slow(*a, **k):
                yield

        if rank == 0:
            h.tap.on_class = late
        else:
            h.sched.critical_section = late
    g = torch.Generator().manual_seed(10 + rank)
    losses = []
    for _ in range(STEPS * GAS):
        loss = engine(torch.randn(MB, H, generator=g))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    records = [
        (r.op, r.numel, r.thread, None if r.meta is None else (r.meta.iteration, r.meta.layer, r.meta.op))
        for r in tap.records
    ]
    sched_log = (
        [(e.event, e.window, e.meta.iteration, e.meta.layer, e.meta.op) for e in h.sched.log] if h else []
    )
    if h is not None:
        h.close()
    else:
        tap.close()
    if stage == 3:
        from deepspeed.utils import safe_get_full_fp32_param

        params = [safe_get_full_fp32_param(p).detach().clone() for p in engine.module.parameters()]
    else:
        params = [p.detach().clone() for p in engine.module.parameters()]
    engine.destroy()
    return {"losses": losses, "params": params, "records": records, "log": sched_log}


def _stages(
    rank: int, world: int, stages: tuple[int, ...], hermod: dict, delayed: tuple[dict, float] | None = None
) -> dict:
    """Each stage with and without ``hermod``; then, given ``delayed`` (hermod config, delay), ZeRO-3 with injected
    delays against the same ZeRO-3 run of DeepSpeed's own (one launch for both tests: the set-up is shared)."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import sys

    import deepspeed
    import deepspeed.comm.torch  # noqa: F401
    import torch

    # test-only: skip the JIT shm allreduce (shared build cache, file lock). By sys.modules: the attribute
    # deepspeed.comm.torch is the torch package (deepspeed.comm imports it), so "import ... as" would patch torch.
    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
    deepspeed.init_distributed("gloo")

    def compare(base: dict, herm: dict) -> dict:
        return {
            "equal_losses": base["losses"] == herm["losses"],
            "equal_params": len(base["params"]) == len(herm["params"])
            and all(torch.equal(a, b) for a, b in zip(base["params"], herm["params"], strict=True)),
            "base": base["records"],
            "hermod": herm["records"],
            "log": herm["log"],
        }

    out, base = {}, {}
    for stage in stages:
        base[stage] = _run(rank, world, stage, None)
        out[stage] = compare(base[stage], _run(rank, world, stage, hermod))
    if delayed is not None:
        out["delayed"] = compare(base[3], _run(rank, world, 3, delayed[0], delayed[1]))
    return out


_REDUCE_OPS = {"all_reduce", "reduce", "reduce_scatter_tensor", "reduce_scatter", "all_reduce_coalesced"}


def _reductions(records: list, thread: str | None = None) -> list:
    return [
        (op, n) for op, n, t, _ in records if op in _REDUCE_OPS and n > 1 and (thread is None or t == thread)
    ]


@pytest.fixture(scope="module")
def zero_runs() -> list:
    """2 ranks x 9 DeepSpeed engines: ZeRO 0-3 with and without Hermod (window=backward), then ZeRO-3 with Hermod
    (window=bucket) where rank 0's deferred reduce-scatters and rank 1's parameter fetches each start 30 ms late,
    past the gate timeout."""
    from flowlane.launch import launch

    hermod = {"window": "backward", "gate_timeout_s": 0.05}
    delayed = ({"window": "bucket", "gate_timeout_s": 0.01}, 0.03)
    return launch(
        _stages, 2, args=((0, 1, 2, 3), hermod, delayed), timeout=400, env={"DS_ACCELERATOR": "cpu"}
    )


@pytest.mark.slow  # the zero_runs launch
def test_hermod_on_zero_0_to_3_is_bitwise_deepspeed_and_reorders_backward_buckets_by_layer(zero_runs):
    res = zero_runs
    for rank, r in enumerate(res):
        for stage in (0, 1, 2, 3):
            s = r[stage]
            assert s["equal_losses"] and s["equal_params"], (rank, stage)
            # the same gradient reductions, now all from Hermod's pacer, each under a DP key
            base = sorted(_reductions(s["base"]))
            paced = [x for x in s["hermod"] if x[2] == "pacer"]
            assert sorted(_reductions(paced)) == base, (rank, stage)
            assert all(m is not None and m[2] in ("all_reduce", "reduce_scatter") for *_, m in paced)
            assert not _reductions(s["hermod"], "main"), (rank, stage)
            # the pacer's order follows Hermod's keys inside every sealed window: lowest layer first
            chunks = [e for e in s["log"] if e[0] == "chunk"]
            for w in {e[1] for e in chunks}:
                layers = [e[3] for e in chunks if e[1] == w]
                assert layers == sorted(layers), (rank, stage, w, layers)
        # ZeRO-2 reduces in backward: DeepSpeed goes from the last layer down; Hermod's backward window goes up
        z2 = [e for e in r[2]["log"] if e[0] == "chunk"]
        for w in {e[1] for e in z2}:
            assert [e[3] for e in z2 if e[1] == w] == list(range(LAYERS))
        sizes_base = [n for _, n in _reductions(r[2]["base"])]
        sizes_hermod = [n for _, n in _reductions(r[2]["hermod"], "pacer")]
        assert sizes_base[:LAYERS] == sizes_hermod[:LAYERS][::-1] != sizes_hermod[:LAYERS], (
            sizes_base,
            sizes_hermod,
        )
        # ZeRO-3: every coordinator fetch is a keyed critical op; its gathers are issued under a gather key
        assert any(e[0] == "critical" and e[4] == "all_gather" for e in r[3]["log"])
        gathers = [x for x in r[3]["hermod"] if x[0] in ("all_gather_into_tensor", "all_gather")]
        assert gathers and all(
            t == "main" and m is not None and m[2] == "all_gather" for _, _, t, m in gathers
        )
    # the same launch sequence on both ranks (no mismatched collectives)
    assert [[e for e in r[s]["log"] if e[0] == "chunk"] for s in (0, 1, 2, 3) for r in res[:1]] == [
        [e for e in r[s]["log"] if e[0] == "chunk"] for s in (0, 1, 2, 3) for r in res[1:]
    ]


@pytest.mark.slow  # the zero_runs launch
def test_hermod_on_zero3_with_injected_delays_neither_deadlocks_nor_changes_the_math(zero_runs):
    # rank 0's deferred reduce-scatters and rank 1's parameter fetches each start 30 ms late, past the gate timeout
    res = zero_runs
    for r in res:
        s = r["delayed"]
        assert s["equal_losses"] and s["equal_params"]
        assert sorted(_reductions([x for x in s["hermod"] if x[2] == "pacer"])) == sorted(
            _reductions(s["base"])
        )
    assert [e for e in res[0]["delayed"]["log"] if e[0] == "chunk"] == [
        e for e in res[1]["delayed"]["log"] if e[0] == "chunk"
    ]
