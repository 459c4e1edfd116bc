"""Placement rules of the unified tensor (seed 003 Table 4.2, reconstructed in digest research/003 §3.2.3).

A pure function of operand kinds: where an operator with at least one unified (pinned host, GPU-addressable) operand
computes, and what its output is. Rows are tried top-down. Choices where the garbled table is silent (digest §3.2.3):
"GPU-affinitive operand" counts unified GPU-affinity operands and CUDA tensors (the thesis' rationale: "if a CUDA
tensor participates, only the GPU can compute"); a CPU scalar is a 0-dim CPU tensor or a Python number.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

Operand = Literal["cpu", "cpu_scalar", "cuda", "unified_gpu", "unified_host"]
OPERANDS: tuple[str, ...] = ("cpu", "cpu_scalar", "cuda", "unified_gpu", "unified_host")


@dataclass(frozen=True)
class Placement:
    """Where an operator computes and the type of its output."""

    compute: Literal["gpu", "cpu"]
    """Device that runs the operator."""
    output: Literal["cuda", "unified_host"]
    """'cuda' (a GPU tensor) or 'unified_host' (a host-affinitive unified tensor, stays in host memory)."""
    rule: str
    """Which row of Table 4.2 applied, e.g. 'A1'."""


def place(operands: Iterable[Operand]) -> Placement:
    """Table 4.2: compute device and output type for an operator over ``operands`` (at least one unified).

    Case A (every unified operand is GPU-affinitive): A1 a non-scalar CPU operand -> GPU, host-affinitive unified
    output; A2 else a CUDA operand -> GPU, CUDA output; A3 else (unified + CPU scalars only) -> GPU, CUDA output.
    Case B (some unified operand is host-affinitive): the output is always host-affinitive unified; B1 a non-scalar CPU
    operand -> CPU unless a GPU-affinitive operand is present; B2 else a CUDA operand -> GPU; B3 else -> CPU unless a
    GPU-affinitive operand is present.
    """
    ops = list(operands)
    bad = [o for o in ops if o not in OPERANDS]
    if bad:
        raise ValueError(f"operand kind(s) {bad} not allowed; allowed: {OPERANDS}")
    if not any(o.startswith("unified") for o in ops):
        raise ValueError(
            f"Table 4.2 places operators with at least one unified operand; got {ops} (plain PyTorch "
            f"dispatch applies)"
        )
    cpu, cuda = "cpu" in ops, "cuda" in ops
    gpu_affine = cuda or "unified_gpu" in ops
    if "unified_host" not in ops:  # case A
        if cpu:
            return Placement("gpu", "unified_host", "A1")
        return Placement("gpu", "cuda", "A2" if cuda else "A3")
    if cpu:
        return Placement("gpu" if gpu_affine else "cpu", "unified_host", "B1")
    if cuda:
        return Placement("gpu", "unified_host", "B2")
    return Placement("gpu" if gpu_affine else "cpu", "unified_host", "B3")
