"""A persistent host-memory pool for the CUDA tiers of the tensor cache (seed 003 §5.3.1: "a pre-allocated pinned
host memory pool whose size is found by profiling the first step").

One block holds one layer's offloaded storages back to back (bulk per-layer copies), each at a 4 KiB-aligned
offset, and its capacity is a multiple of 4 KiB: the SSD tier writes a whole block with one O_DIRECT ``pwrite``
straight from it. Blocks are kept after use and handed out again by size class, so a training run allocates (and
pins) its host memory in the first steps only. A block's last GPU use (a device-to-host or host-to-device copy) is
an event: the next copy into it waits for that event *in stream order*, and a disk thread waits for it on the host.

``pin=False`` gives page-aligned, unpinned memory (``mmap``): the same logic on a machine without CUDA (tests).
"""

from __future__ import annotations

import errno
import mmap
import threading
from typing import Any

import torch

ALIGN = 4096
"""O_DIRECT alignment (logical block size of common NVMe/ext4/xfs) of block starts, offsets and capacities."""


def align_up(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


def size_class(n: int) -> int:
    """Capacity handed out for a request of ``n`` bytes: 4 KiB multiples up to 1 MiB, then 1 MiB multiples (a
    transformer's layers ask for the same size every step, so classes only need to absorb small differences)."""
    if n <= 0:
        raise ValueError(f"a host block of {n} bytes: the size must be > 0")
    return align_up(n, ALIGN) if n <= (1 << 20) else align_up(n, 1 << 20)


class HostBlock:
    """``buf``: a 1-D uint8 tensor of ``capacity`` bytes (pinned when the pool pins); ``ready``: a CUDA event after
    which no GPU copy touches it any more (None: free now)."""

    __slots__ = ("buf", "capacity", "ready", "_keep")

    def __init__(self, buf: torch.Tensor, capacity: int, keep: Any = None) -> None:
        self.buf = buf
        self.capacity = capacity
        self.ready: Any = None
        self._keep = keep  # the mmap behind an unpinned block

    def wait_ready_on_host(self) -> None:
        """For disk threads: block until the last GPU copy touching this block has finished."""
        ev, self.ready = self.ready, None
        if ev is not None:
            ev.synchronize()


class PinnedPool:
    """Size-classed free lists of :class:`HostBlock`; ``capacity`` bytes in all (0 = unbounded). ``acquire`` past the
    capacity raises ``OSError(ENOSPC)``, which the cache treats like a full disk (keep in memory, or raise)."""

    def __init__(self, capacity: int = 0, pin: bool = True) -> None:
        if capacity < 0:
            raise ValueError(f"pool capacity {capacity} must be >= 0 (0 = unbounded)")
        self.capacity = capacity
        self.pin = pin
        self._free: dict[int, list[HostBlock]] = {}
        self._lock = threading.Lock()
        self.allocated = 0
        """bytes of host memory the pool holds (free or in use)"""
        self.in_use = 0
        self.peak_in_use = 0
        self.hits = 0
        self.misses = 0

    def _new(self, cap: int) -> HostBlock:
        if self.pin:
            buf = torch.empty(cap, dtype=torch.uint8, pin_memory=True)
            # the caching host allocator returns page-aligned blocks; never assume it
            if buf.data_ptr() % ALIGN:
                raw = torch.empty(cap + ALIGN, dtype=torch.uint8, pin_memory=True)
                shift = (-raw.data_ptr()) % ALIGN
                buf = raw[shift : shift + cap]
            return HostBlock(buf, cap)
        m = mmap.mmap(-1, cap)
        return HostBlock(torch.frombuffer(m, dtype=torch.uint8), cap, keep=m)

    def acquire(self, nbytes: int) -> HostBlock:
        cap = size_class(nbytes)
        with self._lock:
            free = self._free.get(cap)
            if free:
                blk = free.pop()
                self.hits += 1
            else:
                if self.capacity and self.allocated + cap > self.capacity:
                    # give back free blocks of other sizes before refusing
                    for c in list(self._free):
                        while self._free[c] and self.allocated + cap > self.capacity:
                            self._free[c].pop()
                            self.allocated -= c
                if self.capacity and self.allocated + cap > self.capacity:
                    raise OSError(
                        errno.ENOSPC,
                        f"host pool full: {self.in_use} bytes in use + {cap} > "
                        f"{self.capacity} bytes (raise offload.pinned_pool_bytes)",
                    )
                self.allocated += cap
                self.misses += 1
                blk = None
            self.in_use += cap
            self.peak_in_use = max(self.peak_in_use, self.in_use)
        if blk is None:
            try:
                blk = self._new(cap)
            except BaseException:
                with self._lock:
                    self.allocated -= cap
                    self.in_use -= cap
                raise
        return blk

    def release(self, blk: HostBlock, ready: Any = None) -> None:
        """Return ``blk``; ``ready`` is the event of its last GPU copy (the next user waits for it)."""
        blk.ready = ready
        with self._lock:
            self.in_use -= blk.capacity
            self._free.setdefault(blk.capacity, []).append(blk)

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {
                "allocated_bytes": self.allocated,
                "in_use_bytes": self.in_use,
                "peak_in_use_bytes": self.peak_in_use,
                "hits": self.hits,
                "misses": self.misses,
            }

    def clear(self) -> None:
        with self._lock:
            for c, blocks in self._free.items():
                self.allocated -= c * len(blocks)
            self._free.clear()
