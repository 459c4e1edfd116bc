"""Peak bytes held by PyTorch's CPU allocator during a block, from the profiler's memory events.

With ``profile_memory=True`` the profiler reports every CPU allocation and free made while it runs, each with the
allocator's running total ("Total Allocated"). The peak above the block's start is the largest total minus the total
before the block's first allocation. Allocations made before the block are not counted (nor are their frees), so the
figure is what the block itself added at its worst moment: for a training step, its activations, gradients and
temporaries. All threads count (the allocator's total is process-wide). ``mark(name)`` notes the bytes held at a
point of the block (e.g. where a forward ends). Measurement only; nothing is changed but a 64 KB sentinel per mark.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field


@dataclass
class AllocationPeak:
    """Filled when the ``with`` block ends."""

    peak_bytes: int = 0
    """Largest bytes held above the block's start."""
    allocations: int = 0
    """CPU allocations seen."""
    at_marks: dict[str, int] = field(default_factory=dict)
    """Bytes held above the block's start at each :meth:`mark` (e.g. what a forward leaves for backward)."""
    _marks: list[str] = field(default_factory=list)

    def mark(self, name: str) -> None:
        """Note the bytes held now, under ``name`` (read from ``at_marks`` after the block). The mark allocates and
        frees a sentinel of a size of its own, found among the allocator's events afterwards (events are ordered;
        timestamps may tie)."""
        import torch

        self._marks.append(name)
        torch.empty(_sentinel_bytes(len(self._marks) - 1), dtype=torch.uint8)


@contextmanager
def cpu_allocation_peak() -> Iterator[AllocationPeak]:
    """``with cpu_allocation_peak() as p: step()`` then ``p.peak_bytes``."""
    from torch.profiler import ProfilerActivity, profile

    res = AllocationPeak()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        yield res
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    finally:
        os.unlink(path)
    mem = sorted(
        (e for e in events if e.get("name") == "[memory]" and e["args"].get("Device Type") == 0),
        key=lambda e: e["args"]["Ev Idx"],  # the allocator's order
    )
    if not mem:
        return
    # the allocator's running total carries allocations of earlier profiled blocks: measure from this block's start
    base = mem[0]["args"]["Total Allocated"] - mem[0]["args"]["Bytes"]
    res.peak_bytes = max(0, max(e["args"]["Total Allocated"] for e in mem) - base)
    res.allocations = sum(1 for e in mem if e["args"]["Bytes"] > 0)
    for i, name in enumerate(res._marks):
        size = _sentinel_bytes(i)
        hit = next((e for e in mem if e["args"]["Bytes"] == size), None)
        if hit is None:
            raise RuntimeError(f"cpu_allocation_peak: mark {name!r} not found among the allocator's events")
        res.at_marks[name] = hit["args"]["Total Allocated"] - size - base


def _sentinel_bytes(i: int) -> int:
    """The size of mark ``i``'s sentinel allocation: odd, so no tensor of the block has it by chance."""
    return 65_521 - 2 * i
