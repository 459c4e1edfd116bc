"""G3 bins under a device memory budget (seed 000 §4.4.1 and §4.4.3 step 2; digest B2.5, B2.8, B6 #8).

A bin is the unit a G3 worker computes at once: destination nodes plus the source rows their in-edges read. The seed
caps every bin at half the device memory ``M`` (one bin computes while the next is copied: double buffering), with the
memory per node estimated from the layer's input and output widths. Here (B6 #8, counted for forward and backward,
since every bin is recomputed in backward):

    bytes(bin) = max_k 2 * (n_src * d_in[k] + n_dst * (d_in[k] + d_out[k]) + n_edges * d_edge[k]) * itemsize  <= M / 2

``n_src``: distinct source rows of the bin's in-edges (the gathered inputs); ``n_dst``: its destination nodes (their
own rows, the neighbour aggregate and the output); ``n_edges``: its in-edges, with ``d_edge[k]`` values per edge
(B6 #8's GAT per-edge attention: one per head for an attention layer, 0 for the others); the factor 2: each value
and its gradient.

Departure from the seed (§4.4.3 step 2, B2.6 "bin sizes adapt per layer"): the seed computes the bin limit per layer;
here one bin layout serves every layer, sized by the layer with the largest estimate. The bins and their DGL blocks
(and gather indices) are built once at install and reused by every layer and every epoch; a layout per layer would
build and hold one set per layer. Every layer still stays within ``M / 2``; a narrower layer only runs in more bins
than its own limit would need. Packing walks the boundary-first BFS order (step 3) and closes a bin when the next
node would exceed the cap or ``max_nodes``. Pure numpy; no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def bin_bytes(
    n_src: int, n_dst: int, widths: Sequence[tuple[int, int, int]], itemsize: int, n_edges: int = 0
) -> int:
    """Estimated device bytes of one bin (formula above); ``widths``: (d_in, d_out, d_edge) of every layer."""
    return max(2 * (n_src * di + n_dst * (di + do) + n_edges * de) * itemsize for di, do, de in widths)


def pack_bins(
    rows: np.ndarray,
    eptr: np.ndarray,
    e_src: np.ndarray,
    max_nodes: int,
    max_bytes: float,
    widths: Sequence[tuple[int, int, int]],
    itemsize: int,
) -> list[np.ndarray]:
    """Split ``rows`` (destination nodes, in order) into consecutive bins of at most ``max_nodes`` nodes whose
    :func:`bin_bytes` stays within ``max_bytes``. ``eptr``/``e_src``: in-edges of node ``v`` are
    ``e_src[eptr[v]:eptr[v + 1]]``. Raises ``ValueError`` naming a node that does not fit in a bin alone."""
    if not widths:
        raise ValueError("widths must list (d_in, d_out, d_edge) for at least one layer")
    if max_nodes < 1:
        raise ValueError(f"max_nodes={max_nodes}: must be >= 1")
    # the bin that last counted each source row: a row is new to bin b unless mark[row] == b
    mark = np.full(int(e_src.max(initial=-1)) + 1, -1, np.int64)
    bins: list[np.ndarray] = []
    start, n_src, n_edges, b = 0, 0, 0, 0
    for i, v in enumerate(rows.tolist()):
        srcs = e_src[eptr[v] : eptr[v + 1]]
        new = np.unique(srcs[mark[srcs] != b])
        n_dst = i - start + 1
        if n_dst > 1 and (
            n_dst > max_nodes
            or bin_bytes(n_src + new.size, n_dst, widths, itemsize, n_edges + srcs.size) > max_bytes
        ):
            bins.append(rows[start:i])
            start, n_src, n_edges, b = i, 0, 0, b + 1
            new = np.unique(srcs)
        if i == start and (alone := bin_bytes(new.size, 1, widths, itemsize, srcs.size)) > max_bytes:
            raise ValueError(
                f"destination row {v} (in-degree {srcs.size}) needs {alone} bytes in a bin alone, over the bin "
                f"cap {max_bytes:.0f} (mem_budget_bytes / 2); raise mem_budget_bytes"
            )
        mark[new] = b
        n_src += new.size
        n_edges += srcs.size
    if rows.size > start:
        bins.append(rows[start:])
    return bins
