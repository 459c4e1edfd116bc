"""Module-level rank function for the multi-PS tests of ALEPH's tier 0 (spawned processes must import it)."""

import torch
import torch.distributed as dist

from flowlane.aleph import Plan
from flowlane.aleph.hook import HierarchicalAllReduce, install_aleph_hook


def _ordered_sum(xs: list[torch.Tensor], plan: Plan, root: int, skip: set[int]) -> torch.Tensor:
    """The tree's order of additions with PS ``root``: its own partial (itself, then its members), then every other
    aggregator's partial in plan order; positions in ``skip`` (dedicated PSs) are left out."""

    def partial(h: int) -> torch.Tensor:
        c = plan.cluster_of(h)
        t = torch.zeros_like(xs[h]) if h in skip else xs[h].clone()
        for m in c.members[1:]:
            t.add_(xs[m])
        return t

    total = partial(root)
    for h in plan.heads:
        if h != root and h not in skip:
            total.add_(partial(h))
    return total


class _RecordP2P:
    """Records every isend / irecv the hook issues, in issue order: (op, group name, peer, tag). NCCL matches a pair's
    messages by order, not by tag, and runs them on one ordered stream per pair and group: the test checks the order
    a backend like that needs (tests/test_aleph_multips.py, ``_check_p2p_order``)."""

    def __init__(self) -> None:
        self.log: list[tuple[str, str, int, int]] = []
        self.received = 0
        """Elements this rank received."""

    def __enter__(self) -> "_RecordP2P":
        self.real = dist.isend, dist.irecv
        real_send, real_recv = self.real

        def name(group: object) -> str:
            return "default" if group is None else str(group.group_name)  # type: ignore[attr-defined]

        def isend(t: torch.Tensor, dst: int, group: object = None, tag: int = 0, **kw: object) -> object:
            self.log.append(("send", name(group), dst, tag))
            return real_send(t, dst=dst, group=group, tag=tag, **kw)

        def irecv(t: torch.Tensor, src: int, group: object = None, tag: int = 0, **kw: object) -> object:
            self.log.append(("recv", name(group), src, tag))
            self.received += t.numel()
            return real_recv(t, src=src, group=group, tag=tag, **kw)

        dist.isend, dist.irecv = isend, irecv
        return self

    def __exit__(self, *exc: object) -> None:
        dist.isend, dist.irecv = self.real


def multi_ps_cases(rank: int, world: int, clusters: list, cases: list) -> list[dict]:
    """For each keyword set of HierarchicalAllReduce(top="ps"): int64 sums against all_reduce (exact), float32 sums
    against all_reduce (close) and against the tree's own order of additions computed here from all inputs, part by
    part (bitwise). Dedicated PSs: the others' sum excludes them, a PS holds its own part's sum and zeros elsewhere."""
    plan = Plan.from_clusters(world, clusters)
    out = []
    for kw in cases:
        # 20 KB int64 / 40 KB: several chunks
        h = HierarchicalAllReduce(plan, top="ps", chunk_bytes=4096, **kw)
        ded = set(h.ps) if h.dedicated_ps else set()
        xi = torch.arange(5003, dtype=torch.int64) * (rank + 1) + rank**3 - 7
        xf = torch.randn(5003, generator=torch.Generator().manual_seed(rank))
        # 5005 = 5 x 1001 = 7 x 715: equal blocks
        xr = torch.arange(5005, dtype=torch.int64) * (rank + 2) - rank
        with _RecordP2P() as rec:
            got_i, got_f = h(xi.clone()), h(xf.clone())
        # the reduce-scatter's blocks come down the same tree (dedicated PSs: refused)
        with _RecordP2P() as rec_r:
            got_r = None if h.dedicated_ps else h.reduce_scatter(xr.clone())
        with _RecordP2P() as rec_a:  # the same tensor all-reduced, to compare what came down
            h(xr.clone()) if not h.dedicated_ps else None
        ref_r = xr.clone()
        dist.all_reduce(ref_r)
        blk = slice(rank * (5005 // world), (rank + 1) * (5005 // world))
        alli = [torch.empty_like(xi) for _ in range(world)]
        allf = [torch.empty_like(xf) for _ in range(world)]
        dist.all_gather(alli, xi)
        dist.all_gather(allf, xf)
        # the part of each PS: reconstructed from the pieces the hook itself cut (same offsets on every rank)
        owner = torch.empty(5003, dtype=torch.int64)
        for view, j in h._pieces(owner):
            view.fill_(j)
        want_f = torch.zeros_like(xf)
        want_i = torch.zeros_like(xi)
        for j, p in enumerate(h.ps):
            sel = owner == j
            want_f[sel] = _ordered_sum(allf, plan, p, ded)[sel]
            want_i[sel] = _ordered_sum(alli, plan, p, ded)[sel]
        if rank in ded:  # a dedicated PS: its own part's sum, zeros elsewhere
            mine = owner == h.ps.index(rank)
            want_f[~mine] = 0
            want_i[~mine] = 0
        ref_i = torch.stack([a for r, a in enumerate(alli) if r not in ded]).sum(0)
        ref_f = torch.stack([a for r, a in enumerate(allf) if r not in ded]).sum(0)
        keep = torch.ones(5003, dtype=torch.bool) if rank not in ded else owner == h.ps.index(rank)
        out.append(
            {
                "split": list(h.split),
                "parts": [int((owner == j).sum()) for j in range(len(h.ps))],
                "int_exact": bool(torch.equal(got_i[keep], ref_i[keep])) and bool(torch.equal(got_i, want_i)),
                "float_maxdiff": float((got_f[keep] - ref_f[keep]).abs().max()),
                "float_bitwise_tree_order": bool(torch.equal(got_f, want_f)),
                "rs_block_exact": got_r is None or bool(torch.equal(got_r[blk], ref_r[blk])),
                "p2p": rec.log + rec_r.log,
                "received": (rec_r.received, rec_a.received),
            }
        )
    return out


def ddp_multi_ps(rank: int, world: int, clusters: list, kw: dict) -> float:
    """DDP with the ALEPH hook on several PSs against DDP's own all-reduce: max parameter difference after 2 steps."""
    import copy

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    runs = []
    for hook in (False, True):
        # one bucket: one hook call a step
        ddp = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(model))
        if hook:
            install_aleph_hook(ddp, Plan.from_clusters(world, clusters), top="ps", chunk_bytes=1024, **kw)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        g = torch.Generator().manual_seed(100 + rank)
        for _ in range(2):
            loss = ddp(torch.randn(16, 12, generator=g)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        runs.append([p.detach().clone() for p in ddp.module.parameters()])
    moved = max(float((a - b).abs().max()) for a, b in zip(runs[0], model.parameters(), strict=True))
    assert moved > 1e-3, moved  # training changed the parameters: the comparison is not vacuous
    return max(float((a - b).abs().max()) for a, b in zip(*runs, strict=True))
