"""Shared driver for the simulation benchmarks: run points on a process pool with a wall budget and a progress bar.

A point that raises is recorded as skipped with its error; points not started before the budget runs out are
skipped with the reason, so a run cut short still leaves everything it has (``after_each`` rewrites the JSON).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from typing import Any


def add_pool_args(ap: argparse.ArgumentParser, budget_s: float, quantum: float = 1e-4) -> None:
    """The options every pool-driven simulation benchmark takes: --quantum, --workers, --budget-s."""
    ap.add_argument(
        "--quantum", type=float, default=quantum, help=f"simulator time quantum (s; default {quantum:g})"
    )
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument(
        "--budget-s", type=float, default=budget_s, help="stop starting new points after this (wall s)"
    )


def run_points(
    tasks: Sequence[tuple],
    fn: Callable[..., dict],
    extra: tuple,
    workers: int,
    budget_s: float,
    label: str,
    describe: Callable[[tuple, dict], str],
    after_each: Callable[[list[dict], list], None],
    points: list[dict] | None = None,
    skipped: list | None = None,
) -> tuple[list[dict], list]:
    """``fn(*task, *extra)`` for every task; returns (points, skipped [(task, why)])."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    t0 = time.time()
    points = [] if points is None else points
    skipped = [] if skipped is None else skipped
    with (
        ProcessPoolExecutor(max_workers=workers) as ex,
        Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            TextColumn("{task.completed}/{task.total}"),
            TimeElapsedColumn(),
        ) as prog,
    ):
        bar = prog.add_task(label, total=len(tasks))
        futs: dict[Any, tuple] = {}
        pending = list(tasks)

        def submit() -> None:
            while pending and len(futs) < workers:
                t = pending.pop(0)
                if time.time() - t0 > budget_s:
                    skipped.append((t, f"wall budget {budget_s:.0f} s spent"))
                    prog.advance(bar)
                    continue
                futs[ex.submit(fn, *t, *extra)] = t

        submit()
        while futs:
            f = next(as_completed(futs))
            t = futs.pop(f)
            try:
                p = f.result()
                points.append(p)
                prog.console.print(describe(t, p))
            except Exception as e:  # noqa: BLE001 - record and go on
                skipped.append((t, f"error: {e}"))
            prog.advance(bar)
            submit()
            after_each(points, skipped)
    return points, skipped
