"""A probe for Hector's bf16/fp16 paths (tests/test_hector_*.py): the sums of several terms that run in low precision.

Why an op-level probe and not a numeric comparison: torch's CPU ``index_add_`` happens to sum bf16 accurately (4,096
ones give 4,096), so a CPU test cannot see the loss that CUDA's bf16 ``index_add`` shows (an H200 run measured dx
0.16-0.22 from an fp32 reference with hub sources; results/hector/README.md). The contract checked instead: no
scatter-style sum (``index_add``, ``index_put`` with accumulate, ``scatter_add``) whose index repeats, i.e. that adds
two or more terms into one element, runs on fp16/bf16 tensors. The GPU check ``tests/gpu/hector_ops.py`` measures the
numbers on CUDA.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

LOW = (torch.float16, torch.bfloat16)


def _repeats(index) -> bool:
    if isinstance(index, (list, tuple)):
        return any(_repeats(i) for i in index if i is not None)
    return isinstance(index, torch.Tensor) and index.numel() > 1 and index.unique().numel() < index.numel()


class LowPrecisionSums(TorchDispatchMode):
    """Records ``(op, dtype)`` of every scatter-style sum of two or more terms into one element in fp16/bf16."""

    def __init__(self) -> None:
        super().__init__()
        self.found: list[tuple[str, torch.dtype]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.__name__
        target = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if target is not None and target.dtype in LOW:
            if name.startswith(("index_add", "scatter_add")):
                index = args[2] if len(args) > 2 else kwargs.get("index")
                if _repeats(index):
                    self.found.append((name, target.dtype))
            elif name.startswith(("index_put", "_index_put_impl")):
                accumulate = args[3] if len(args) > 3 else kwargs.get("accumulate", False)
                if accumulate and _repeats(args[1]):
                    self.found.append((name, target.dtype))
            elif name.startswith("embedding_dense_backward"):
                self.found.append((name, target.dtype))
        return func(*args, **kwargs)
