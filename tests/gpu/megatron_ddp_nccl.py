"""Hermod under stock Megatron-core on NCCL (issue #30 item 6; label: measured on one GPU).

Four ranks (PP 2 x DP 2) of a GPT built by Megatron-core (local layer spec), wrapped in Megatron-core's own
DistributedDataParallel (overlap_grad_reduce; with the distributed optimizer also overlap_param_gather), its own
optimizer (get_megatron_optimizer, Adam, clipping), finalize_model_grads and the stock 1F1B schedule. Each case runs
stock twice (a control: the GPU run must repeat itself bitwise) and once with Hermod attached the way a user does
(``attach_pipeline``, ``attach_ddp``, ``attach_finalize``). Checks: Hermod's losses and parameters bitwise equal
stock's, and Hermod keyed every bucket group's reduction.

Cases: fp32 without the distributed optimizer; bf16 (Float16Module, fp32 main grads and master weights) with it.
Hermod runs twice: ``launch="auto"`` (program order from the training thread on NCCL) and ``launch="pacer"``.

The machine has ONE GPU: every rank gets its own ``NCCL_HOSTID`` so NCCL takes the ranks for hosts of their own and
moves traffic through its socket transport over loopback (see benchmarks/nccl_gpu_check.py); ranks time-share the
GPU, so step times are informational only.

    python3 tests/gpu/megatron_ddp_nccl.py --out $OUT/megatron_ddp_nccl.json
    python3 tests/gpu/megatron_ddp_nccl.py --backend gloo --device cpu --out /tmp/m.json   # the logic, on CPU
"""

from __future__ import annotations

import sys
import time
import traceback
from typing import Any

from harness import CPU_LABEL, check_args, init_rank, run_ranks, skip_reason

WORLD, PP = 4, 2
CASES = {"fp32": dict(bf16=False, dist_opt=False), "bf16_distopt": dict(bf16=True, dist_opt=True)}
MODEL = dict(
    num_layers=4,
    hidden_size=256,
    num_attention_heads=8,
    vocab_size=1024,
    seq_length=128,
    micro_batch_size=2,
    num_microbatches=4,
    iterations=3,
)


def _batches(it: int, dp_rank: int, m: int, device: Any) -> Any:
    import torch

    v, s, b = MODEL["vocab_size"], MODEL["seq_length"], MODEL["micro_batch_size"]
    for mb in range(m):
        g = torch.Generator().manual_seed(1_000_003 * it + 31 * mb + dp_rank)
        tokens = torch.randint(0, v, (b, s + 1), generator=g)
        yield {"tokens": tokens[:, :-1].to(device), "labels": tokens[:, 1:].to(device)}


def _train(case: dict[str, Any], hermod: str | None, device: Any) -> dict[str, Any]:
    """``hermod``: None (stock) or HermodConfig.launch ("auto": program order on NCCL; "pacer")."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_plugin.hermod import Hermod, HermodConfig
    from megatron_plugin.te_compat import UNFUSED

    bf16, dist_opt, cuda = case["bf16"], case["dist_opt"], device.type == "cuda"
    dtype = torch.bfloat16 if bf16 else torch.float32
    ps.initialize_model_parallel(pipeline_model_parallel_size=PP)
    h = None
    try:
        torch.manual_seed(0)
        model_parallel_cuda_manual_seed(0)
        config = TransformerConfig(
            num_layers=MODEL["num_layers"],
            hidden_size=MODEL["hidden_size"],
            num_attention_heads=MODEL["num_attention_heads"],
            pipeline_model_parallel_size=PP,
            use_cpu_initialization=not cuda,
            pipeline_dtype=dtype,
            params_dtype=dtype,
            bf16=bf16,
            **UNFUSED,
            hidden_dropout=0.0,
            attention_dropout=0.0,
        )
        module = GPTModel(
            config=config,
            transformer_layer_spec=get_gpt_layer_local_spec(),
            vocab_size=MODEL["vocab_size"],
            max_sequence_length=MODEL["seq_length"],
            pre_process=ps.is_pipeline_first_stage(),
            post_process=ps.is_pipeline_last_stage(),
            share_embeddings_and_output_weights=False,
            position_embedding_type="learned_absolute",
        )
        if cuda:
            module.cuda()
        if bf16:
            module = Float16Module(config, module)  # what Megatron-LM's get_model does for --bf16
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=True,
            use_distributed_optimizer=dist_opt,
            overlap_param_gather=dist_opt,
            bucket_size=200_000,
        )
        model = DistributedDataParallel(config, ddp_config, module)
        opt = get_megatron_optimizer(
            OptimizerConfig(
                optimizer="adam", lr=1e-3, clip_grad=1.0, bf16=bf16, use_distributed_optimizer=dist_opt
            ),
            [model],
        )
        config.no_sync_func = model.no_sync
        config.finalize_model_grads_func = finalize_model_grads
        if dist_opt:
            config.param_sync_func = model.start_param_sync
        m, iterations = MODEL["num_microbatches"], MODEL["iterations"]
        if hermod:
            # gate_timeout_s paces the pacer thread only (refused under program_order, where it has no effect)
            cfg = HermodConfig(launch=hermod, **({"gate_timeout_s": 0.02} if hermod == "pacer" else {}))
            h = Hermod(
                cfg,
                num_microbatches=m,
                layers_per_stage=MODEL["num_layers"] // PP,
                stage=ps.get_pipeline_model_parallel_rank(),
                num_stages=PP,
                dp_group=ps.get_data_parallel_group(with_context_parallel=True),
            )
            h.attach_pipeline()
            h.attach_ddp([model])
            h.attach_finalize(config, lambda: m)
        s = MODEL["seq_length"]
        mask = torch.triu(torch.ones(s, s, dtype=torch.bool, device=device), diagonal=1).view(1, 1, s, s)
        pos = torch.arange(s, device=device).unsqueeze(0).expand(MODEL["micro_batch_size"], s)

        def forward_step(data_iterator: Any, model: Any) -> Any:
            batch = next(data_iterator)
            out = model(batch["tokens"], pos, mask, labels=batch["labels"])
            return out, lambda t: (t.float().mean(), {"lm loss": t.float().mean().detach().clone()})

        fwd_bwd = get_forward_backward_func()
        losses, times = [], []
        for it in range(iterations):
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            model.zero_grad_buffer()
            opt.zero_grad()
            res = fwd_bwd(
                forward_step_func=forward_step,
                data_iterator=_batches(it, ps.get_data_parallel_rank(), m, device),
                model=[model],
                num_microbatches=m,
                seq_length=s,
                micro_batch_size=MODEL["micro_batch_size"],
                forward_only=False,
            )
            opt.step()
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
            if res:
                losses.append(float(torch.stack([o["lm loss"] for o in res]).mean()))
        if dist_opt:
            model.start_param_sync(force_sync=True)  # the last step's shards, gathered
        out: dict[str, Any] = {
            "params": [p.detach().clone() for p in model.parameters()],
            "losses": losses,
            "iteration_s": times,
            "bucket_groups": len(model.bucket_groups),
        }
        if h is not None:
            out["dp_coflows"] = sum(
                1
                for e in h.sched.log
                if e.event == "chunk" and e.meta.ctype == "dp" and e.meta.op != "all_gather"
            )
            out["pp_ops"] = sum(1 for e in h.sched.log if e.meta.ctype == "pp")
            out["launch"] = "program_order" if h.sched.program_order else "pacer"
        dist.barrier()
        return out
    finally:
        if h is not None:
            h.close()
        ps.destroy_model_parallel()


def rank_main(rank: int, world: int, backend: str, device_name: str, model: dict[str, int]) -> dict[str, Any]:
    import torch

    MODEL.update(model)

    def cpu_shim() -> None:
        from megatron_plugin import cpu_shim

        cpu_shim.apply()

    init_rank(rank, world, backend, "flowlane-mcore-host", 120, cpu_setup=cpu_shim)
    device = torch.device(device_name)
    res: dict[str, Any] = {}
    for name, case in CASES.items():
        try:
            a, b = _train(case, None, device), _train(case, None, device)
            c, d = _train(case, "auto", device), _train(case, "pacer", device)

            def same(x: dict[str, Any], y: dict[str, Any]) -> bool:
                return (
                    x["losses"] == y["losses"]
                    and len(x["params"]) == len(y["params"])
                    and all(torch.equal(p, q) for p, q in zip(x["params"], y["params"], strict=True))
                )

            res[name] = {
                "stock_repeats_bitwise": same(a, b),
                "hermod_bitwise_equal_stock": same(a, c) and same(a, d),
                "hermod_launch": c["launch"],
                "iteration_s_hermod_pacer": d["iteration_s"],
                "losses_stock": a["losses"],
                "losses_hermod": c["losses"],
                "bucket_groups": c["bucket_groups"],
                "hermod_dp_chunks": c["dp_coflows"],
                "hermod_pp_ops": c["pp_ops"],
                "iteration_s_stock": b["iteration_s"],
                "iteration_s_hermod": c["iteration_s"],
            }
        except Exception:  # noqa: BLE001 - one case failing must not lose the other's result
            res[name] = {"error": traceback.format_exc()[-3000:]}
    return res


def _ok(ranks: list[dict[str, Any]]) -> bool:
    """Stock repeats itself and Hermod equals stock bitwise on every rank, and Hermod keyed DP chunks on the first
    stage's ranks (the last stage's DP reductions are keyed too, but ranks 0-1 always have some)."""
    return all(
        c.get("stock_repeats_bitwise")
        and c.get("hermod_bitwise_equal_stock")
        and c.get("hermod_dp_chunks", 0) > 0
        for r in ranks[:2]
        for c in r.values()
    ) and all(c.get("hermod_bitwise_equal_stock") for r in ranks for c in r.values())


def main() -> int:
    a = check_args(__doc__, timeout_s=240.0)
    skip = skip_reason(a.backend, "megatron.core")
    if skip is not None:
        print(skip)
        return 0
    if a.backend == "gloo":  # the CPU dry run: the same steps on a model small enough for two cores
        MODEL.update(hidden_size=32, num_attention_heads=4, vocab_size=64, seq_length=16, iterations=2)
    label = (
        "measured on one GPU (ranks time-share it; NCCL socket transport over loopback)"
        if a.backend == "nccl"
        else CPU_LABEL
    )
    out, ranks = run_ranks(
        "megatron_ddp_nccl",
        rank_main,
        WORLD,
        a,
        {"label": label, "model": MODEL, "pp": PP},
        _ok,
        args=(a.backend, a.device, MODEL),
    )
    for r, res in enumerate(ranks):
        for name, c in res.items():
            print(
                f"  rank {r} {name}: "
                + (
                    c["error"].strip().splitlines()[-1][:300]
                    if "error" in c
                    else f"stock repeats {c['stock_repeats_bitwise']}, hermod == stock {c['hermod_bitwise_equal_stock']}, "
                    f"dp chunks {c['hermod_dp_chunks']}, pp ops {c['hermod_pp_ops']}, loss {c['losses_hermod'][-1:]}, "
                    f"steady ms stock / {c['hermod_launch']} / pacer: "
                    + " / ".join(
                        f"{1e3 * sum(x[1:]) / max(1, len(x) - 1):.0f}"
                        for x in (
                            c["iteration_s_stock"],
                            c["iteration_s_hermod"],
                            c["iteration_s_hermod_pacer"],
                        )
                    )
                )
            )
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
