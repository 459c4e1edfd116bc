"""Configuration of the Hector relational-GNN operators (seed 003 ch. 3; digest research/003 §4.2, §4.6)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, Literal

Materialization = Literal["auto", "compact", "vanilla"]
Reorder = Literal["auto", "always", "never"]
Gemm = Literal["auto", "grouped_mm", "loop"]
MATERIALIZATIONS: tuple[str, ...] = ("auto", "compact", "vanilla")
REORDERS: tuple[str, ...] = ("auto", "always", "never")
GEMMS: tuple[str, ...] = ("auto", "grouped_mm", "loop")


@dataclass
class HectorConfig:
    """One config for the Hector ops and the DGL layers built on them. Its fields are the keys of the plain mapping
    that :func:`dgl_plugin.hector.install_hector` and :meth:`from_dict` take; no recipe group holds them (the recipe
    validator knows no ``hector`` group), so a job passes them in its own code."""

    enabled: bool = True
    """Swap Hector layers in for DGL's modules at install (:func:`dgl_plugin.hector.install_hector`). With True, a
    model that holds no module Hector can replace is refused at install."""
    materialization: Materialization = "auto"
    """Edgewise tensors that depend only on (source node, edge type): ``compact`` computes one row per unique
    (source, edge type) pair and gathers to edges (thesis §3.3.2 "compact materialization"); ``vanilla`` one row per
    edge in edge-type order; ``auto`` picks compact when #unique / #edges <= ``compact_max_ratio``."""
    compact_max_ratio: float = 0.9
    """``auto`` materialization: the largest compaction ratio (unique rows / edges) at which compact rows are used;
    above it the extra gather level costs more than the rows it saves."""
    reorder: Reorder = "auto"
    """Linear-operator reordering (thesis §3.3.2): ``always`` folds the attention vector into the relation weight
    (``h (W_r w_r)``) as Hector does, ``never`` keeps ``(h W_r) w_r``, ``auto`` decides per layer and per term by
    counting multiply-adds (the thesis assumes reordering always pays; digest §4.6)."""
    gemm: Gemm = "auto"
    """Segment GEMM over type-sorted rows: ``grouped_mm`` (``torch._grouped_mm``: one call for all types; it needs
    16-byte-aligned feature sizes and bf16 on CUDA, float32/bf16/fp16 on the CPU), ``loop`` (one matmul per type),
    ``auto`` (grouped_mm on CUDA where the torch has it and the operands qualify, else loop)."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        if not isinstance(self.enabled, bool):
            raise ValueError(f"hector.enabled={self.enabled!r} must be true or false")
        for name, allowed in (("materialization", MATERIALIZATIONS), ("reorder", REORDERS), ("gemm", GEMMS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"hector.{name}={getattr(self, name)!r} is not one of {allowed}")
        r = self.compact_max_ratio
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not 0.0 <= r <= 1.0:
            raise ValueError(f"hector.compact_max_ratio={r!r} must be a number in [0, 1]")

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> HectorConfig:
        """Build from a plain mapping; unknown keys are an error naming them and the allowed ones."""
        d = dict(d or {})
        known = [f.name for f in fields(cls)]
        unknown = sorted(set(d) - set(known))
        if unknown:
            raise ValueError(f"unknown hector key(s) {unknown}; allowed: {known}")
        return cls(**d)
