"""Configuration of the PyTorch-Direct feature store (seed 003 ch. 4; digest research/003 §3.2, §3.6)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, Literal

PathName = Literal["auto", "zero-copy", "cpu-gather"]
PATHS: tuple[str, ...] = ("auto", "zero-copy", "cpu-gather")

#: PCIe read-request granularity the alignment targets (thesis §4.4.5: one zero-copy access = one 128-B cacheline)
LINE_BYTES = 128


@dataclass
class DirectConfig:
    """One config for :class:`flowlane.direct.FeatureStore`; every field is also a key of a ``direct`` config group."""

    path: PathName = "auto"
    """auto (zero-copy when the target device is CUDA and Triton imports, else cpu-gather), zero-copy (a GPU kernel
    reads the pinned host table through its UVA address; refused where it cannot run), cpu-gather (CPU index_select
    into a pinned buffer, then a non_blocking H2D copy: the path PyTorch-Direct replaces, thesis §4.5.1 "Py")."""
    aligned: bool = True
    """Zero-copy kernel: shift each row's lanes so every warp load starts on a 128-B line (DGL's per-row scheme,
    digest §3.6 B4). False gives the unshifted ("naive") kernel, kept for the alignment measurement (Fig. 4.7)."""
    pin: bool = True
    """Pin the host table in place (cudaHostRegister, no second copy; digest B3) when CUDA is present. False: the store
    neither pins the table nor reads it zero-copy, even one pinned already (auto takes cpu-gather; path='zero-copy'
    with pin=False is refused)."""
    check_indices: bool = True
    """Refuse indices outside [0, rows) with the first bad index named. Costs one min/max reduction per gather
    (and a device sync for CUDA indices); with False a bad index is undefined behaviour on the zero-copy path."""
    rows_per_program: int = 0
    """Zero-copy kernel: rows per Triton program (0 = chosen from the row width, about 4096 elements per tile)."""
    sort_indices: bool = True
    """Zero-copy kernel: sort the indices on the GPU first and read the rows in host-address order, writing each to its
    own output row (same result). Neighbouring reads then share host pages and the GPU's address translations: on an
    H200, 256-B rows went from 12.9 to 45.1 GB/s and 2-KiB rows from 44.1 to 47.9 (results/direct/README.md)."""
    num_warps: int = 4
    """Zero-copy kernel: warps per Triton program (1, 2, 4, 8 or 16)."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        if self.path not in PATHS:
            raise ValueError(f"direct.path={self.path!r} is not one of {PATHS}")
        for name in ("aligned", "pin", "check_indices", "sort_indices"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"direct.{name}={getattr(self, name)!r} must be true or false")
        r = self.rows_per_program
        if not isinstance(r, int) or isinstance(r, bool) or r < 0 or (r & (r - 1)):
            raise ValueError(f"direct.rows_per_program={r!r} must be 0 (auto) or a power of two")
        if self.num_warps not in (1, 2, 4, 8, 16) or isinstance(self.num_warps, bool):
            raise ValueError(f"direct.num_warps={self.num_warps!r} must be one of 1, 2, 4, 8, 16")

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> DirectConfig:
        """Build from a plain mapping (a Hydra group); unknown keys are an error naming them and the allowed ones."""
        d = dict(d or {})
        known = [f.name for f in fields(cls)]
        unknown = sorted(set(d) - set(known))
        if unknown:
            raise ValueError(f"unknown direct key(s) {unknown}; allowed: {known}")
        return cls(**d)
