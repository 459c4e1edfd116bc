"""graph_allgather executor on gloo: forward equals gathering rows, backward equals single-process autograd."""

import numpy as np
import torch

from flowlane import comm
from flowlane import topology as T
from flowlane.launch import launch
from flowlane.plan import CommRelation, GraphExchange, LinkModel, build_plan, compile_tables, graph_allgather

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
    return {m: _one(rank, m) for m in ("spst", "p2p")}  # one launch for both plans (spawning is slow)


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


def _reference_grad(rel, local_ids):
    x = torch.randn(N, DIM, generator=torch.Generator().manual_seed(0), dtype=torch.float64).requires_grad_(
        True
    )
    w = torch.randn(N, DIM, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    loss = sum(
        (x[torch.from_numpy(ids)] * w[torch.from_numpy(ids)] * (r + 1)).sum()
        for r, ids in enumerate(np.concatenate([local_ids[r], rel.needs[r]]) for r in range(RANKS))
    )
    loss.backward()
    return x.detach(), x.grad


_RESULTS = {}


def _check(method):
    rel, plan, local_ids = _problem(method)
    if not _RESULTS:
        _RESULTS.update(enumerate(launch(_worker, RANKS, timeout=90)))
    res = [_RESULTS[r][method] for r in range(RANKS)]
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
