"""Chrome-trace (Perfetto) export of recorded communication ops and compute spans.

Open the written JSON in https://ui.perfetto.dev or chrome://tracing: one process row per rank, one thread row for
compute and one per communication kind.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from flowlane.comm import CommOp, ComputeSpan, get_recorder
from flowlane.launch import heartbeat

_clock = time.perf_counter


@contextmanager
def span(name: str, **args: Any) -> Iterator[None]:
    """Record a compute span (forward, backward, optimizer step, ...) in this process's recorder. A finished span is
    progress: under flowlane.launch it tells the launcher this rank is not stuck."""
    start = _clock()
    try:
        yield
    finally:
        get_recorder().add_span(ComputeSpan(name, start, _clock(), args))
        heartbeat()


def _jsonable(v: Any) -> Any:
    if isinstance(v, str | int | float | bool) or v is None:
        return v
    return str(v)


def chrome_events(rank: int, ops: Iterable[CommOp], spans: Iterable[ComputeSpan], t0: float) -> list[dict]:
    """Trace events ("X" complete events, microseconds since ``t0``) for one rank."""
    events: list[dict] = [{"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"rank {rank}"}}]
    tids: dict[str, int] = {"compute": 0}
    for s in spans:
        events.append(
            {
                "name": s.name,
                "ph": "X",
                "pid": rank,
                "tid": 0,
                "ts": (s.start - t0) * 1e6,
                "dur": (s.end - s.start) * 1e6,
                "args": {k: _jsonable(v) for k, v in s.args.items()},
            }
        )
    for op in ops:
        if op.end is None:
            continue
        tid = tids.setdefault(f"comm:{op.kind}", len(tids))
        events.append(
            {
                "name": f"{op.op}",
                "ph": "X",
                "pid": rank,
                "tid": tid,
                "ts": (op.start - t0) * 1e6,
                "dur": (op.end - op.start) * 1e6,
                "args": {
                    "kind": op.kind,
                    "bytes": op.nbytes,
                    "peers": list(op.peers),
                    "group": list(op.group_ranks),
                    "key": _jsonable(op.key),
                },
            }
        )
    for name, tid in tids.items():
        events.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": tid, "args": {"name": name}})
    return events


def write_chrome_trace(path: str | os.PathLike, events: list[dict]) -> Path:
    """Write events atomically (a crash never leaves half a JSON file behind)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_suffix(p.suffix + ".tmp")
    tmp.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
    tmp.replace(p)
    return p


def rank_events(rank: int, t0: float | None = None) -> list[dict]:
    """Events for everything this process recorded; ``t0`` aligns ranks (pass a shared start time)."""
    rec = get_recorder()
    starts = [o.start for o in rec.ops] + [s.start for s in rec.spans]
    base = t0 if t0 is not None else (min(starts) if starts else 0.0)
    return chrome_events(rank, rec.ops, rec.spans, base)
