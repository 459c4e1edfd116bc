"""Triton zero-copy gather kernels (seed 003 §4.4.5; DGL's per-row aligned scheme, digest §3.2.5 [ext] and §3.6 B4).

Imported only when the zero-copy path is chosen (this module imports Triton). A kernel reads the feature table through
the address it is given: on a GPU that is the UVA address of a pinned host table (every load is a PCIe read of host
memory: zero-copy), under ``TRITON_INTERPRET=1`` it is a CPU tensor, which is how CI checks the index arithmetic.

Per-row scheme: each output row is a row of a ``[ROWS, BLOCK]`` tile. Lane ``j`` of chunk ``k`` reads element
``a0 + k*BLOCK + j`` where ``a0`` is the row's first element rounded down to a 128-B line (``aligned``), or the row's
first element itself (naive). Lanes before the row start or past its end are masked, so with ``aligned`` every warp
load covers whole lines: a row of ``B`` bytes costs the minimal ``ceil((B + misalignment) / 128)`` line reads.

``PERMUTED``: the indices arrive sorted and ``pos[r]`` is the output row of the ``r``-th sorted index, so programs walk
the host table in address order (neighbouring rows share host pages and the GPU's translations of them) while each
row still lands where ``table[idx]`` puts it.
"""

from __future__ import annotations

import triton
import triton.language as tl


# sizes and offsets change per call: one compiled kernel per (dtype, tile) instead of one per divisibility pattern
@triton.jit(do_not_specialize=["n_idx", "n_cols", "src_stride", "out_stride", "col0", "base_off", "n_chunks"])
def gather_rows_kernel(
    src,
    idx,
    pos,
    out,
    n_idx,
    n_cols,
    src_stride,
    out_stride,
    col0,
    base_off,
    n_chunks,
    LINE_ELEMS: tl.constexpr,
    ALIGNED: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
    PERMUTED: tl.constexpr,
):
    """out[r, c] = src[idx[r], col0 + c] for r < n_idx, c < n_cols (``out[pos[r], c]`` when ``PERMUTED``).

    ``src`` points ``base_off`` elements past a 128-B boundary (``base_off = (address % 128) / element size``), so
    element ``e`` of the table lies on a line boundary exactly when ``(e + base_off) % LINE_ELEMS == 0``.
    """
    pid = tl.program_id(0)
    r = pid.to(tl.int64) * ROWS + tl.arange(0, ROWS).to(tl.int64)
    rmask = r < n_idx
    row = tl.load(idx + r, mask=rmask, other=0)
    orow = tl.load(pos + r, mask=rmask, other=0) if PERMUTED else r
    # first element of the wanted window, counted from the 128-B boundary just below the table's start
    start = row * src_stride + col0 + base_off
    if ALIGNED:  # noqa: SIM108 - a constexpr branch reads clearer in a kernel
        a0 = start - start % LINE_ELEMS  # round down to a line: every warp load now starts on a line
    else:
        a0 = start
    base = src - base_off
    lanes = tl.arange(0, BLOCK)
    for k in range(0, n_chunks):
        e = a0[:, None] + k * BLOCK + lanes[None, :]
        c = e - start[:, None]
        m = rmask[:, None] & (c >= 0) & (c < n_cols)
        v = tl.load(base + e, mask=m)
        tl.store(out + orow[:, None] * out_stride + c, v, mask=m)


@triton.jit(do_not_specialize=["n_idx", "n_sel", "src_stride", "out_stride", "n_chunks"])
def gather_cols_kernel(
    src,
    idx,
    pos,
    cols,
    out,
    n_idx,
    n_sel,
    src_stride,
    out_stride,
    n_chunks,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
    PERMUTED: tl.constexpr,
):
    """out[r, j] = src[idx[r], cols[j]]: the column-masked gather for an arbitrary column list (rows as above)."""
    pid = tl.program_id(0)
    r = pid.to(tl.int64) * ROWS + tl.arange(0, ROWS).to(tl.int64)
    rmask = r < n_idx
    row = tl.load(idx + r, mask=rmask, other=0)
    orow = tl.load(pos + r, mask=rmask, other=0) if PERMUTED else r
    lanes = tl.arange(0, BLOCK)
    for k in range(0, n_chunks):
        j = k * BLOCK + lanes
        jm = j < n_sel
        col = tl.load(cols + j, mask=jm, other=0)
        m = rmask[:, None] & jm[None, :]
        v = tl.load(src + row[:, None] * src_stride + col[None, :], mask=m)
        tl.store(out + orow[:, None] * out_stride + j[None, :], v, mask=m)
