"""PCIe request-count model of zero-copy row gathers (seed 003 §4.4.5, Figs. 4.4-4.5; digest research/003 §3.2.5).

A zero-copy load from pinned host memory becomes one PCIe read per distinct 128-B line a warp instruction touches
(thesis §4.4.5). The model counts, for every gathered row, the distinct (warp instruction, line) pairs its elements
need, under four lane mappings:

- ``flat``: PyTorch's indexing kernel, thread ``i`` copies output element ``i`` (``out[i] = in[idx[i // F], i % F]``);
  a warp may span two rows (the thesis' "PyD Naive").
- ``flat_shift``: the thesis' circular shift inside each row's thread group: thread ``t`` of the group that starts at
  thread ``T`` reads column ``(t - T + s) mod F`` with ``s = (T - b) mod warp`` (``b``: the row's first element).
- ``row``: one row per lane group, lane ``j`` reads column ``j`` (flowlane's unshifted kernel, ``aligned=False``).
- ``row_aligned``: DGL's per-row scheme and flowlane's default kernel: lane ``j`` reads column ``j - shift`` where
  ``shift`` is the row start's offset in its line (lanes before the row start idle).

plus ``min``, the lines a row overlaps (no mapping can do better). Assumptions (the thesis is silent): scalar loads (a
warp instruction spans ``warp x element size`` bytes), the table starts ``base_bytes`` past a line boundary, rows
are ``row_elems`` apart. Pure numpy; no GPU.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import numpy as np

Scheme = Literal["flat", "flat_shift", "row", "row_aligned", "min"]
SCHEMES: tuple[str, ...] = ("flat", "flat_shift", "row", "row_aligned", "min")


def _distinct_per_row(row_of: np.ndarray, group: np.ndarray, line: np.ndarray, n_rows: int) -> np.ndarray:
    """Count distinct (group, line) pairs per row; per-lane arrays, ordered by row (every scheme builds them so)."""
    if row_of.size == 0:
        return np.zeros(n_rows, dtype=np.int64)
    # one int64 key per lane: row, then group and line relative to the row's first (both small), then one 1-D unique
    starts = np.flatnonzero(np.r_[True, row_of[1:] != row_of[:-1]])
    sizes = np.diff(np.r_[starts, row_of.size])
    g = group - np.repeat(np.minimum.reduceat(group, starts), sizes)
    ln = line - np.repeat(np.minimum.reduceat(line, starts), sizes)
    gs, ls = int(g.max()) + 1, int(ln.max()) + 1
    uniq = np.unique((row_of * gs + g) * ls + ln)
    return np.bincount(uniq // (gs * ls), minlength=n_rows).astype(np.int64)


def request_counts(
    row_ids: Sequence[int] | np.ndarray,
    row_elems: int,
    elem_bytes: int,
    scheme: Scheme,
    warp: int = 32,
    line_bytes: int = 128,
    base_bytes: int = 0,
    cols: tuple[int, int] | Sequence[int] | np.ndarray | None = None,
) -> np.ndarray:
    """Requests (distinct lines per warp instruction) needed for each gathered row, in gather order.

    ``row_ids``: the gathered rows of a table of ``row_elems`` elements of ``elem_bytes`` each. ``cols``: the
    columns gathered (None: all; ``(start, count)``: a contiguous range; a sequence: a column list, for which only
    ``row`` (lanes read ``cols[j]``) and ``min`` apply).
    """
    if scheme not in SCHEMES:
        raise ValueError(f"scheme={scheme!r} is not one of {SCHEMES}")
    for name, v in (
        ("row_elems", row_elems),
        ("elem_bytes", elem_bytes),
        ("warp", warp),
        ("line_bytes", line_bytes),
    ):
        if not isinstance(v, int | np.integer) or v < 1:
            raise ValueError(f"{name}={v!r} must be an integer >= 1")
    if line_bytes % elem_bytes or base_bytes % elem_bytes or base_bytes < 0:
        raise ValueError(
            f"line_bytes={line_bytes} and base_bytes={base_bytes} must be multiples of elem_bytes="
            f"{elem_bytes} (and base_bytes >= 0)"
        )
    rows = np.asarray(row_ids, dtype=np.int64).reshape(-1)
    n = rows.size
    le = line_bytes // elem_bytes  # elements per line
    base = base_bytes // elem_bytes
    col_list = None
    if cols is None:
        col0, width = 0, row_elems
    elif isinstance(cols, tuple) and len(cols) == 2:
        col0, width = int(cols[0]), int(cols[1])
        if col0 < 0 or width < 0 or col0 + width > row_elems:
            raise ValueError(
                f"cols=(start={col0}, count={width}) must lie within the {row_elems} columns of a row"
            )
    else:
        col_list = np.asarray(cols, dtype=np.int64).reshape(-1)
        if col_list.size and (col_list.min() < 0 or col_list.max() >= row_elems):
            raise ValueError(f"cols must lie in 0..{row_elems - 1}, got {col_list.min()}..{col_list.max()}")
        if scheme not in ("row", "min"):
            raise ValueError(
                f"a column list is gathered by the 'row' lane mapping only (or counted by 'min'), "
                f"not {scheme!r}"
            )
        col0, width = 0, col_list.size
    if n == 0 or width == 0:
        return np.zeros(n, dtype=np.int64)
    start = base + rows * row_elems + col0  # each row window's first element, from a line boundary
    r = np.arange(n, dtype=np.int64)
    if scheme == "min":
        if col_list is not None:
            elem = base + rows[:, None] * row_elems + col_list[None, :]
            return _distinct_per_row(
                np.repeat(r, width), np.zeros(n * width, np.int64), (elem // le).reshape(-1), n
            )
        return (start + width - 1) // le - start // le + 1
    if scheme in ("flat", "flat_shift"):
        t = np.arange(n * width, dtype=np.int64)  # thread t copies output element t
        row_of, tc = t // width, t % width
        if scheme == "flat_shift":
            first = row_of * width  # T: the first thread of the row's group
            s = (first - start[row_of]) % warp
            tc = (tc + s) % width
        elem = start[row_of] + tc
        return _distinct_per_row(row_of, t // warp, elem // le, n)
    if col_list is not None:  # 'row' over a column list: lane j reads cols[j]
        j = np.tile(np.arange(width, dtype=np.int64), n)
        row_of = np.repeat(r, width)
        elem = base + rows[row_of] * row_elems + col_list[j]
        return _distinct_per_row(row_of, j // warp, elem // le, n)
    shift = start % le if scheme == "row_aligned" else np.zeros(n, np.int64)
    lanes = width + (le - 1 if scheme == "row_aligned" else 0)
    j = np.arange(lanes, dtype=np.int64)[None, :]
    c = j - shift[:, None]  # column of lane j
    active = (c >= 0) & (c < width)
    row_of = np.broadcast_to(r[:, None], c.shape)[active]
    elem = (start[:, None] + c)[active]
    group = np.broadcast_to(j, c.shape)[active] // warp
    return _distinct_per_row(row_of, group, elem // le, n)


def mean_requests(
    row_bytes: int,
    elem_bytes: int = 4,
    n_rows: int = 2000,
    table_rows: int = 1_000_000,
    seed: int = 0,
    **kw: object,
) -> dict[str, float]:
    """Mean 128-B requests per gathered row, per scheme, for ``n_rows`` random rows of ``row_bytes`` each."""
    if row_bytes % elem_bytes:
        raise ValueError(f"row_bytes={row_bytes} must be a multiple of elem_bytes={elem_bytes}")
    rows = np.random.default_rng(seed).integers(0, table_rows, n_rows)
    return {
        s: float(request_counts(rows, row_bytes // elem_bytes, elem_bytes, s, **kw).mean())  # type: ignore[arg-type]
        for s in SCHEMES
    }
