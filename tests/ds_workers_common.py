"""The tiny DeepSpeed run that ALEPH's and SYNDICATE's ZeRO-0 rank functions share (tests/aleph_workers.py,
tests/syndicate_fw_workers.py): DeepSpeed on gloo with the CPU accelerator, a 12-16-3 MLP, SGD, micro-batch 2."""

from __future__ import annotations

import os
import sys
from typing import Any

import torch


def init_deepspeed_gloo() -> None:
    """DeepSpeed's comm on the launcher's gloo process group, without its JIT-built shared-memory all-reduce (a
    test-only stub, as in tests/test_hermod_deepspeed.py: the build cache is shared and a build elsewhere blocks on
    its file lock; by sys.modules because the attribute ``deepspeed.comm.torch`` is the torch package)."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    import deepspeed.comm.torch  # noqa: F401

    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
    deepspeed.init_distributed("gloo")


def tiny_net() -> torch.nn.Module:
    """The MLP, seeded: every call gives the same initial parameters."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))


def tiny_engine(zero: int, flowlane: dict[str, Any] | None = None) -> tuple[Any, dict[str, Any]]:
    """(engine, its config): ZeRO stage ``zero``, batch 8 = micro-batch 2 x the rest, plus ``"flowlane": flowlane``
    when given."""
    import deepspeed

    net = tiny_net()
    cfg: dict[str, Any] = {
        "train_batch_size": 8,
        "train_micro_batch_size_per_gpu": 2,
        "steps_per_print": 1000,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_optimization": {"stage": zero},
        "zero_allow_untested_optimizer": True,
    }
    if flowlane is not None:
        cfg["flowlane"] = flowlane
    engine, *_ = deepspeed.initialize(model=net, model_parameters=net.parameters(), config=cfg)
    return engine, cfg


def train(engine: Any, rank: int, steps: int) -> list[float]:
    """``steps`` micro-steps (forward, backward, step) on this rank's seeded data; the losses."""
    g = torch.Generator().manual_seed(100 + rank)
    losses = []
    for _ in range(steps):
        loss = engine(torch.randn(2, 12, generator=g)).pow(2).mean()
        losses.append(loss.item())
        engine.backward(loss)
        engine.step()
    return losses
