"""Configuration of the SSDTrain tensor cache (seed 003 §5.3; digest research/003 §2.2, §2.6, §6)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, Literal

BackendName = Literal["posix", "kvikio", "pinned_cpu", "null", "auto"]
BACKENDS: tuple[str, ...] = ("posix", "kvikio", "pinned_cpu", "null", "auto")

#: thesis Alg. 5.2 line 12 keeps tensors below 2**20 elements (2 MiB in fp16); digest A5 recommends a byte threshold
DEFAULT_MIN_BYTES = 2 * 1024 * 1024


@dataclass
class OffloadConfig:
    """One config for the tensor cache; every field is also a Hydra key (recipes/conf/offload/ssd.yaml)."""

    enabled: bool = True
    """Master switch: when False, installers return a no-op handle."""
    backend: BackendName = "posix"
    """posix (default; O_DIRECT where supported), kvikio (GPUDirect Storage/compat; needs CUDA), pinned_cpu (host
    memory), null (accounting only: data stays in memory), auto (kvikio when CUDA + kvikio are present, else posix)."""
    dirs: tuple[str, ...] = ()
    """Target directories, used round-robin (one file per offloaded storage). Empty: the system temp directory."""
    min_bytes: int = DEFAULT_MIN_BYTES
    """Saved tensors smaller than this (bytes of the view) stay on the autograd graph (Alg. 5.2 line 12)."""
    keep_last_k: int = 1
    """Number of trailing transformer layers (scope groups) kept in memory; their backward follows the forward
    immediately (thesis §5.3.5, Fig. 5.5). With ``adaptive`` this is only the value used until profiling ends."""
    adaptive: bool = False
    """Choose keep_last_k from a profiling micro-batch (thesis §5.3.5, Fig. 5.9; formula in digest §2.2.8)."""
    profile_step: int = 1
    """Index of the micro-batch record that is profiled when ``adaptive`` (0 = the very first; 1 skips warm-up)."""
    store_workers: int = 2
    """Threads in the FIFO store pool (digest A12)."""
    load_workers: int = 2
    """Threads in the FIFO load (prefetch) pool."""
    offload_cpu_tensors: bool = False
    """The thesis returns CPU tensors untouched (Alg. 5.2 line 12); set True to offload them (CPU runs, tests)."""
    check_versions: bool = True
    """A saved tensor modified in place after it was saved raises at unpack instead of giving a wrong gradient."""
    o_direct: Literal["auto", "on", "off"] = "auto"
    """posix backend: O_DIRECT when the target filesystem supports it (auto), always (on; error if unsupported), never."""
    on_io_error: Literal["keep", "raise"] = "keep"
    """Disk full or I/O error while storing: keep the activation in memory (and count it), or raise."""
    pinned_pool_bytes: int = 0
    """pinned_cpu backend: capacity of the host pool in bytes (0 = unbounded); exhausting it behaves like disk full."""
    kvikio_compat_mode: Literal["auto", "on", "off"] = "auto"
    """KVIKIO_COMPAT_MODE for the kvikio backend (on = POSIX I/O inside kvikio, off = GDS only)."""

    def __post_init__(self) -> None:
        if isinstance(self.dirs, str):
            self.dirs = (self.dirs,)
        self.dirs = tuple(str(d) for d in self.dirs)
        self.validate()

    def validate(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"offload.backend={self.backend!r} is not one of {BACKENDS}")
        for name in ("min_bytes", "keep_last_k", "profile_step", "pinned_pool_bytes"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"offload.{name}={v!r} must be an integer >= 0")
        for name in ("store_workers", "load_workers"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"offload.{name}={v!r} must be an integer >= 1")
        if self.o_direct not in ("auto", "on", "off"):
            raise ValueError(f"offload.o_direct={self.o_direct!r} must be 'auto', 'on' or 'off'")
        if self.on_io_error not in ("keep", "raise"):
            raise ValueError(f"offload.on_io_error={self.on_io_error!r} must be 'keep' or 'raise'")
        if self.kvikio_compat_mode not in ("auto", "on", "off"):
            raise ValueError(f"offload.kvikio_compat_mode={self.kvikio_compat_mode!r} must be 'auto', 'on' or 'off'")

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> OffloadConfig:
        """Build from a plain mapping (a Hydra/DeepSpeed section); unknown keys are an error naming them."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown offload option(s) {unknown}; known: {sorted(known)}")
        kw = dict(d)
        if "dirs" in kw and kw["dirs"] is not None and not isinstance(kw["dirs"], str):
            kw["dirs"] = tuple(kw["dirs"])
        if kw.get("dirs") is None:
            kw.pop("dirs", None)
        return cls(**kw)
