"""graph_allgather executor on gloo: forward equals gathering rows, backward equals single-process autograd; each
stage is one batch_isend_irecv on the exchange's own group (a sub-group of the world here too)."""

import numpy as np
import torch
import torch.distributed as dist

from flowlane import comm
from flowlane import topology as T
from flowlane.launch import launch
from flowlane.plan import (
    CommRelation,
    GraphExchange,
    LinkModel,
    build_plan,
    compile_tables,
    graph_allgather,
    mesh_from_matrix,
)

N, DIM, RANKS = 400, 5, 4


def _problem(method):
    rng = np.random.default_rng(1)
    src, dst = rng.integers(0, N, N * 6), rng.integers(0, N, N * 6)
    owner = rng.integers(0, RANKS, N)
    rel = CommRelation.from_edges(src, dst, owner, RANKS)
    # ranks on gpu0, gpu1, gpu5, gpu6 of a DGX-1: some pairs only via PCIe/QPI -> multi-stage plans with relays
    lm = LinkModel.from_topology(T.dgx1(), devices=["gpu0", "gpu1", "gpu5", "gpu6"])
    plan = build_plan(rel, lm, method=method)
    # arbitrary local row order
    local_ids = [rng.permutation(np.nonzero(owner == r)[0]) for r in range(RANKS)]
    return rel, plan, local_ids


def _worker(rank, world):
    out = {m: _one(rank, m) for m in ("spst", "p2p")}  # one launch for every case (spawning is slow)
    sub = dist.new_group(SUB_RANKS)  # collective on the world: every rank creates it
    out["sub"] = _one_sub(rank, sub) if rank in SUB_RANKS else None
    return out


#: world ranks of the sub-group case; its plan's rank i runs on world rank SUB_RANKS[i]
SUB_RANKS = [1, 2, 3]


def _sub_problem():
    """3 plan ranks on a mesh where ranks 0 and 2 have no link: every row between them goes through rank 1."""
    n = 300
    rng = np.random.default_rng(4)
    src, dst = rng.integers(0, n, n * 4), rng.integers(0, n, n * 4)
    owner = rng.integers(0, 3, n)
    rel = CommRelation.from_edges(src, dst, owner, 3)
    bw = np.full((3, 3), 1e9)
    bw[0, 2] = bw[2, 0] = 0.0  # no link
    plan = build_plan(rel, LinkModel.from_topology(mesh_from_matrix(bw)), method="auto")
    local_ids = [np.nonzero(owner == r)[0] for r in range(3)]
    return rel, plan, local_ids, n


def _one_sub(rank, sub):
    rel, plan, local_ids, n = _sub_problem()
    me = SUB_RANKS.index(rank)
    ex = GraphExchange(compile_tables(plan, rel, local_ids)[me], group=sub)
    x = torch.randn(n, DIM, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    w = torch.randn(n, DIM, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    ids = np.concatenate([local_ids[me], rel.needs[me]])
    local = x[torch.from_numpy(local_ids[me])].clone().requires_grad_(True)
    batches, real = [], dist.batch_isend_irecv

    def spy(ops):  # what torch is asked to run: each stage's ops, and the group each carries
        batches.append([(op.op is dist.isend, op.peer, op.group is sub) for op in ops])
        return real(ops)

    dist.batch_isend_irecv = spy
    try:
        with comm.recording() as rec:
            out = graph_allgather(local, ex)
            (out * w[torch.from_numpy(ids)] * (me + 1)).sum().backward()
    finally:
        dist.batch_isend_irecv = real
    p2p = [(op.op, op.group_ranks) for op in rec.ops if op.op in ("isend", "irecv")]
    joins = [op.group_ranks for op in rec.ops if op.op == "all_reduce"]
    return ids, out.detach().numpy(), local.grad.numpy(), batches, p2p, joins


def _one(rank, method):
    rel, plan, local_ids = _problem(method)
    tab = compile_tables(plan, rel, local_ids)[rank]
    x = torch.randn(N, DIM, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    w = torch.randn(N, DIM, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    ids = np.concatenate([local_ids[rank], rel.needs[rank]])
    local = x[torch.from_numpy(local_ids[rank])].clone().requires_grad_(True)
    with comm.recording() as rec:
        out = graph_allgather(local, GraphExchange(tab))
        fwd_bytes = sum(op.nbytes for op in rec.ops if op.op == "isend")
        (out * w[torch.from_numpy(ids)] * (rank + 1)).sum().backward()
    # numpy, not tensors: torch tensors crossing the result queue need the child alive (shared-memory fds)
    return ids, out.detach().numpy(), local.grad.numpy(), fwd_bytes, plan.num_stages, tab.num_relay


def _reference_grad(rel, local_ids, n=N):
    x = torch.randn(n, DIM, generator=torch.Generator().manual_seed(0), dtype=torch.float64).requires_grad_(
        True
    )
    w = torch.randn(n, DIM, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    loss = sum(
        (x[torch.from_numpy(ids)] * w[torch.from_numpy(ids)] * (r + 1)).sum()
        for r, ids in enumerate(np.concatenate([local_ids[r], rel.needs[r]]) for r in range(rel.num_ranks))
    )
    loss.backward()
    return x.detach(), x.grad


_RESULTS = {}


def _results():
    if not _RESULTS:
        _RESULTS.update(enumerate(launch(_worker, RANKS, timeout=90)))
    return _RESULTS


def _check(method):
    rel, plan, local_ids = _problem(method)
    res = [_results()[r][method] for r in range(RANKS)]
    x, gx = _reference_grad(rel, local_ids)
    for r, (ids, out, grad, _fwd_bytes, _stages, _) in enumerate(res):
        assert np.array_equal(out, x[torch.from_numpy(ids)].numpy())  # bit-exact forward
        # summed at relays
        torch.testing.assert_close(torch.from_numpy(grad), gx[torch.from_numpy(local_ids[r])])
    sent = sum(r[3] for r in res)
    assert sent == plan.num_transfers * DIM * 8  # every transfer counted once
    return res


def test_spst_allgather_matches_gather_and_autograd_with_relays():
    res = _check("spst")
    assert res[0][4] >= 2 and sum(r[5] for r in res) > 0  # relays were exercised


def test_p2p_allgather_matches_gather_and_autograd():
    res = _check("p2p")
    assert res[0][4] == 1


def test_exchange_runs_on_its_group_one_batch_per_stage_and_relays_around_a_missing_link():
    rel, plan, local_ids, n = _sub_problem()
    # the planner relays around the missing 0 <-> 2 link: P2P would need it
    assert plan.method == "spst" and plan.info["p2p_cost"] == float("inf")
    assert not ((plan.src == 0) & (plan.dst == 2)).any() and not ((plan.src == 2) & (plan.dst == 0)).any()
    assert plan.num_stages == 2 and ((plan.src == 1) & (plan.stage == 2)).any()
    assert _results()[0]["sub"] is None  # world rank 0 is outside the group and took no part
    res = [_results()[r]["sub"] for r in SUB_RANKS]
    x, gx = _reference_grad(rel, local_ids, n)
    for me, (ids, out, grad, batches, p2p, joins) in enumerate(res):
        assert np.array_equal(
            out, x[torch.from_numpy(ids)].numpy()
        )  # bit-exact forward, relayed rows included
        torch.testing.assert_close(torch.from_numpy(grad), gx[torch.from_numpy(local_ids[me])])
        # every point-to-point op went to torch inside one batch per stage, on the group, to global peer ranks
        assert batches and sum(len(b) for b in batches) == len(p2p) > 0
        assert all(on_sub and peer in SUB_RANKS for b in batches for _, peer, on_sub in b)
        assert {g for _, g in p2p} == {tuple(SUB_RANKS)}
        assert len(batches) <= 2 * plan.num_stages  # forward + backward, at most one batch per stage each
        # the exchange's one-time all-reduce (NCCL: the group's first collective involves all of its ranks)
        assert joins == [tuple(SUB_RANKS)]
