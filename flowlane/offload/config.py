"""Configuration of the SSDTrain tensor cache (seed 003 §5.3; digest research/003 §2.2, §2.6, §6)."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
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
    """Profile one micro-batch (``profile_step``) and give each layer a byte allowance by replaying its timeline
    (budget.py, thesis §5.3.5): the bytes the link moves while compute runs, never from the last layer. keep_last_k
    is then only derived (the trailing layers with nothing offloaded); the thesis' bandwidth formula (Fig. 5.9,
    digest §2.2.8, adaptive.py) is not used."""
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
    prefetch_groups: int = 1
    """How many layers ahead of the one in backward are reloaded, in stream order (>= 1). With ``adaptive`` the
    most: the profile picks the shallowest depth up to it that hides the most bytes."""
    max_slowdown: float = 0.0
    """``adaptive``: step time the budget may add, as a fraction of the profiled step (0.03 = 3 %): bytes past what
    the link hides are offloaded while the modelled wait stays below it and below recomputing the layer."""
    recompute: bool = False
    """``adaptive``: spend what ``max_slowdown`` leaves after the byte budget on recomputing layers kept whole (their
    forward runs again in backward under ``torch.utils.checkpoint``), earliest first, never the last, each only while
    it lowers the modelled peak: past the bytes the link moves during forward, only recomputation lowers the memory
    peak where backward begins (budget.py)."""
    link_GBps: float = 0.0
    """``adaptive``: the link's rate in GB/s for the byte budget (pinned_cpu: PCIe; posix: the disk's write rate);
    0 measures it in the profiled micro-batch (CUDA events around the copies, or the store threads' clock on CPU)."""
    release: Literal["record_stream", "stream_order"] = "record_stream"
    """Bulk tiers: when a stored layer's device memory goes back to the allocator. ``record_stream``: the allocator
    reuses a block once the host finds the copy's event complete. ``stream_order`` (needs ``adaptive``; experimental,
    not yet measured on a GPU): at the hook point where the budget's timeline says the copy has ended, the compute
    stream waits for the copy's event and the layer's tensors are dropped, so the blocks are reused in stream order
    (``budget.release_points``)."""

    def __post_init__(self) -> None:
        if isinstance(self.dirs, str):
            self.dirs = (self.dirs,)
        if isinstance(self.dirs, (list, tuple)):
            self.dirs = tuple(str(d) if isinstance(d, os.PathLike) else d for d in self.dirs)
        self.validate()

    def validate(self) -> None:
        """Types and ranges of every field (a string for a flag, 'no' for ``enabled``, a mistyped backend are errors
        naming the value and what is allowed). Directories are checked by :meth:`check_dirs`."""
        if not isinstance(self.enabled, bool):
            raise ValueError(f"offload.enabled={self.enabled!r} must be true or false")
        for name in ("adaptive", "offload_cpu_tensors", "check_versions", "recompute"):
            v = getattr(self, name)
            if not isinstance(v, bool):
                raise ValueError(f"offload.{name}={v!r} must be true or false")
        if self.backend not in BACKENDS:
            raise ValueError(f"offload.backend={self.backend!r} is not one of {BACKENDS}")
        if not isinstance(self.dirs, tuple) or not all(isinstance(d, str) and d for d in self.dirs):
            raise ValueError(
                f"offload.dirs={self.dirs!r} must be a list of directory paths (non-empty strings)"
            )
        for name in ("min_bytes", "keep_last_k", "profile_step", "pinned_pool_bytes"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"offload.{name}={v!r} must be an integer >= 0")
        for name in ("store_workers", "load_workers", "prefetch_groups"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"offload.{name}={v!r} must be an integer >= 1")
        v = self.max_slowdown
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or not 0 <= v < 1:
            raise ValueError(f"offload.max_slowdown={v!r} must be a fraction in [0, 1) of the step time")
        if self.recompute and not (self.adaptive and self.max_slowdown > 0):
            raise ValueError(
                f"offload.recompute=True needs adaptive=true and max_slowdown > 0 (got adaptive={self.adaptive}, "
                f"max_slowdown={self.max_slowdown}): recomputation is paid from the step time max_slowdown allows"
            )
        v = self.link_GBps
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v < 0:
            raise ValueError(f"offload.link_GBps={v!r} must be a finite number >= 0 (0 = measure it)")
        if self.o_direct not in ("auto", "on", "off"):
            raise ValueError(f"offload.o_direct={self.o_direct!r} must be 'auto', 'on' or 'off'")
        if self.on_io_error not in ("keep", "raise"):
            raise ValueError(f"offload.on_io_error={self.on_io_error!r} must be 'keep' or 'raise'")
        if self.release not in ("record_stream", "stream_order"):
            raise ValueError(f"offload.release={self.release!r} must be 'record_stream' or 'stream_order'")
        if self.release == "stream_order" and not self.adaptive:
            raise ValueError(
                "offload.release='stream_order' needs adaptive=true: the release points come from the profiled "
                "step's timeline"
            )
        if self.kvikio_compat_mode not in ("auto", "on", "off"):
            raise ValueError(
                f"offload.kvikio_compat_mode={self.kvikio_compat_mode!r} must be 'auto', 'on' or 'off'"
            )

    def check_dirs(self) -> None:
        """Every ``dirs`` entry is an existing, writable folder: a typo must not become a new directory on another
        disk (the backends never create a target). Call it before any rank starts (the launcher does)."""
        for d in self.dirs:
            if not Path(d).is_dir():
                raise ValueError(
                    f"offload.dirs entry {d!r} is not an existing folder; create it first or fix the path"
                )
            if not os.access(d, os.W_OK | os.X_OK):
                raise ValueError(f"offload.dirs entry {d!r} is not writable")

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> OffloadConfig:
        """Build from a plain mapping (a Hydra/DeepSpeed section); unknown keys are an error naming them."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown offload option(s) {unknown}; known: {sorted(known)}")
        kw = dict(d)
        if isinstance(kw.get("dirs"), list):  # a Hydra/JSON list; anything else is checked by validate()
            kw["dirs"] = tuple(kw["dirs"])
        if kw.get("dirs") is None:
            kw.pop("dirs", None)
        return cls(**kw)
