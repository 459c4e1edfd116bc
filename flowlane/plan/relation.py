"""The communication relation of embedding passing (DGCL seed 001 §4.1 step 3, §5.1).

For every vertex ``u``: its owner ``s_u`` (the rank that computes its embedding) and the destination set ``D_u`` (the
ranks that need ``u``'s embedding because ``u`` is an in-neighbour of one of their vertices). DGCL writes the same thing
as tuples ``(d_i, d_j, V_ij)``. Directed graphs: a rank needs the *in*-neighbours (message sources) of its vertices,
which is what aggregation reads and what backward returns gradients for (digest §5 item 10).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


class PlanError(ValueError):
    """A bad relation, topology mapping, plan or option; the message names the bad value."""


@dataclass(frozen=True)
class CommRelation:
    """Who owns each vertex and which remote vertices every rank needs.

    ``owner[u]`` is the rank owning global vertex ``u``; ``needs[d]`` is the sorted array of global ids that rank ``d``
    needs but does not own (DGCL's ``V_d^r``).
    """

    owner: np.ndarray
    needs: tuple[np.ndarray, ...]

    def __post_init__(self) -> None:
        owner = np.asarray(self.owner)
        if owner.ndim != 1 or not np.issubdtype(owner.dtype, np.integer):
            raise PlanError(f"owner must be a 1-D integer array, got shape {owner.shape} dtype {owner.dtype}")
        n = len(self.needs)
        if n < 1:
            raise PlanError("needs must list at least one rank")
        if owner.size and (owner.min() < 0 or owner.max() >= n):
            bad = int(owner[(owner < 0) | (owner >= n)][0])
            raise PlanError(f"owner contains rank {bad}, outside [0, {n}) for {n} ranks")
        for d, ids in enumerate(self.needs):
            ids = np.asarray(ids)
            if ids.ndim != 1 or (ids.size and not np.issubdtype(ids.dtype, np.integer)):
                raise PlanError(
                    f"needs[{d}] must be a 1-D integer array, got shape {ids.shape} dtype {ids.dtype}"
                )
            if ids.size == 0:
                continue
            if ids.min() < 0 or ids.max() >= owner.size:
                bad = int(ids[(ids < 0) | (ids >= owner.size)][0])
                raise PlanError(f"needs[{d}] contains vertex {bad}, outside [0, {owner.size})")
            if np.any(np.diff(ids) <= 0):
                raise PlanError(f"needs[{d}] must be sorted and free of duplicates")
            own = owner[ids] == d
            if own.any():
                raise PlanError(f"needs[{d}] lists vertex {int(ids[own][0])}, which rank {d} owns itself")

    @property
    def num_ranks(self) -> int:
        return len(self.needs)

    @property
    def num_vertices(self) -> int:
        return int(np.asarray(self.owner).size)

    @property
    def num_pairs(self) -> int:
        """``Σ_u |D_u|``: the number of (vertex, destination) deliveries; planning time is linear in it."""
        return int(sum(len(x) for x in self.needs))

    @classmethod
    def from_edges(
        cls, src: np.ndarray, dst: np.ndarray, owner: np.ndarray, num_ranks: int | None = None
    ) -> CommRelation:
        """Relation of a graph with edges ``src[i] -> dst[i]`` (messages flow src to dst) under ``owner``."""
        owner = np.asarray(owner)
        src = np.asarray(src, dtype=np.int64)
        dst = np.asarray(dst, dtype=np.int64)
        if src.shape != dst.shape or src.ndim != 1:
            raise PlanError(
                f"src and dst must be 1-D arrays of equal length, got {src.shape} and {dst.shape}"
            )
        if owner.ndim != 1 or not np.issubdtype(owner.dtype, np.integer):
            raise PlanError(f"owner must be a 1-D integer array, got shape {owner.shape} dtype {owner.dtype}")
        nv = owner.size
        if src.size and (min(src.min(), dst.min()) < 0 or max(src.max(), dst.max()) >= nv):
            raise PlanError(f"edge endpoints must lie in [0, {nv}) (the length of owner)")
        n = int(num_ranks if num_ranks is not None else (owner.max() + 1 if nv else 1))
        if owner.size and (owner.min() < 0 or owner.max() >= n):
            raise PlanError(f"owner contains rank {int(owner.max())}, outside [0, {n}) for num_ranks={n}")
        ds, dd = owner[src], owner[dst]
        cross = ds != dd
        key = np.unique(dd[cross].astype(np.int64) * nv + src[cross])
        ranks, verts = key // max(nv, 1), key % max(nv, 1)
        bounds = np.searchsorted(ranks, np.arange(n + 1))
        needs = tuple(verts[bounds[d] : bounds[d + 1]].astype(np.int64) for d in range(n))
        return cls(owner.astype(np.int64), needs)

    def destinations(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """CSR of ``D_u`` over vertices with at least one destination: (vertices, ptr, dest ranks)."""
        if self.num_pairs == 0:
            return np.zeros(0, np.int64), np.zeros(1, np.int64), np.zeros(0, np.int64)
        u = np.concatenate([np.asarray(x, np.int64) for x in self.needs])
        d = np.concatenate([np.full(len(x), r, np.int64) for r, x in enumerate(self.needs)])
        order = np.lexsort((d, u))
        u, d = u[order], d[order]
        verts, start = np.unique(u, return_index=True)
        ptr = np.append(start, u.size).astype(np.int64)
        return verts, ptr, d
