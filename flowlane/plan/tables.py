"""Per-rank send/receive tables compiled from a plan (DGCL seed 001 §6.1: tuples ``(d_i, d_j, k, T^s, T^r)``).

Buffer layout on rank ``r`` (digest §5 item 13): ``[local (owned, caller's order) | remote (V_r^r, sorted) |
relay-only (sorted)]``. The executor returns ``[local | remote]``; relay rows stay internal. Within one
(stage, sender, receiver) message, vertices are ordered by global id, so both ends agree without exchanging ids.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .relation import CommRelation, PlanError
from .spst import Plan


@dataclass(frozen=True)
class StageTable:
    stage: int
    sends: tuple[tuple[int, np.ndarray], ...]  # (peer, buffer rows to send, in message order)
    recvs: tuple[tuple[int, np.ndarray], ...]  # (peer, buffer rows to fill, in message order)


@dataclass(frozen=True)
class RankTables:
    rank: int
    num_local: int
    num_remote: int
    num_relay: int
    remote_ids: np.ndarray
    relay_ids: np.ndarray
    stages: tuple[StageTable, ...]

    @property
    def num_rows(self) -> int:
        return self.num_local + self.num_remote + self.num_relay

    @property
    def nbytes(self) -> int:
        """Memory of the id tables (DGCL Fig. 11 analogue)."""
        return int(sum(ix.nbytes for st in self.stages for _, ix in (*st.sends, *st.recvs)))


def check_plan(plan: Plan, rel: CommRelation) -> None:
    """One (u, stage >= 1, src, dst) per transfer; every destination receives every needed vertex exactly once;
    every send's data is already present."""
    R = rel.num_ranks
    owner = np.asarray(rel.owner)
    nv = rel.num_vertices
    n = plan.u.size
    for name, a in (("stage", plan.stage), ("src", plan.src), ("dst", plan.dst)):
        if a.shape != (n,):
            raise PlanError(f"plan {name} has shape {a.shape} but u has {n} transfers (one entry each)")
    # compile_tables builds stages 1..num_stages: a send in stage 0 would be dropped
    if n and plan.stage.min() < 1:
        raise PlanError(f"plan has a transfer in stage {int(plan.stage.min())}; stages start at 1")
    if n and (plan.u.min() < 0 or plan.u.max() >= nv):
        raise PlanError(f"plan refers to vertex ids outside [0, {nv})")
    for name, a in (("src", plan.src), ("dst", plan.dst)):
        if a.size and (a.min() < 0 or a.max() >= R):
            raise PlanError(f"plan {name} rank outside [0, {R})")
    key = plan.dst.astype(np.int64) * nv + plan.u
    uniq, cnt = np.unique(key, return_counts=True)
    if (cnt > 1).any():
        k = int(uniq[cnt > 1][0])
        raise PlanError(
            f"rank {k // nv} receives vertex {k % nv} {int(cnt[cnt > 1][0])} times (must be once)"
        )
    if (owner[plan.u] == plan.dst).any():
        i = int(np.nonzero(owner[plan.u] == plan.dst)[0][0])
        raise PlanError(f"vertex {int(plan.u[i])} is sent to its own owner {int(plan.dst[i])}")
    # arrival stage of u at rank d (0 at the owner); a send in stage k needs arrival < k
    arrival = dict(zip(key.tolist(), plan.stage.tolist(), strict=True))
    for u, k, s in zip(plan.u.tolist(), plan.stage.tolist(), plan.src.tolist(), strict=True):
        if owner[u] == s:
            continue
        got = arrival.get(s * nv + u)
        if got is None or got >= k:
            raise PlanError(f"rank {s} forwards vertex {u} in stage {k} but holds it only from stage {got}")
    for d, ids in enumerate(rel.needs):
        got = np.isin(np.asarray(ids, np.int64), plan.u[plan.dst == d])
        if not got.all():
            raise PlanError(f"rank {d} never receives vertex {int(np.asarray(ids)[~got][0])} that it needs")


def compile_tables(
    plan: Plan, rel: CommRelation, local_ids: Sequence[np.ndarray] | None = None, check: bool = True
) -> list[RankTables]:
    """Per-rank tables. ``local_ids[r]``: global ids owned by ``r`` in the caller's row order (default sorted)."""
    if plan.num_ranks != rel.num_ranks:
        raise PlanError(f"plan has {plan.num_ranks} ranks, relation has {rel.num_ranks}")
    if check:
        check_plan(plan, rel)
    R = rel.num_ranks
    owner = np.asarray(rel.owner)
    if local_ids is None:
        local_ids = [np.nonzero(owner == r)[0] for r in range(R)]
    if len(local_ids) != R:
        raise PlanError(f"local_ids has {len(local_ids)} entries for {R} ranks")
    order = np.lexsort((plan.u, plan.dst, plan.src, plan.stage))
    u, st, src, dst = plan.u[order], plan.stage[order], plan.src[order], plan.dst[order]
    out = []
    for r in range(R):
        loc = np.asarray(local_ids[r], np.int64)
        if loc.size and (loc.min() < 0 or loc.max() >= owner.size):  # a negative id would index from the end
            bad = int(loc[(loc < 0) | (loc >= owner.size)][0])
            raise PlanError(f"local_ids[{r}] lists vertex {bad}, outside [0, {owner.size})")
        if loc.size and not (owner[loc] == r).all():
            raise PlanError(
                f"local_ids[{r}] lists vertex {int(loc[owner[loc] != r][0])} not owned by rank {r}"
            )
        if loc.size != int((owner == r).sum()) or np.unique(loc).size != loc.size:
            raise PlanError(
                f"local_ids[{r}] must list each of the {int((owner == r).sum())} owned vertices once"
            )
        remote = np.asarray(rel.needs[r], np.int64)
        relay = np.setdiff1d(u[dst == r], remote)
        ids = np.concatenate([loc, remote, relay])
        sorter = np.argsort(ids, kind="stable")
        sids = ids[sorter]

        def rows(g: np.ndarray, sorter=sorter, sids=sids) -> np.ndarray:
            return sorter[np.searchsorted(sids, g)].astype(np.int64)

        stages = []
        for k in range(1, plan.num_stages + 1):
            sends: list[tuple[int, np.ndarray]] = []
            recvs: list[tuple[int, np.ndarray]] = []
            mk = st == k
            for mask, peer_arr, lst in ((mk & (src == r), dst, sends), (mk & (dst == r), src, recvs)):
                idx = np.nonzero(mask)[0]
                for p in np.unique(peer_arr[idx]):
                    sel = idx[peer_arr[idx] == p]
                    lst.append((int(p), rows(u[sel])))
            stages.append(StageTable(k, tuple(sends), tuple(recvs)))
        out.append(RankTables(r, loc.size, remote.size, relay.size, remote, relay, tuple(stages)))
    return out
