"""Module-level rank functions for the tier-1-behind-the-hook test (spawned processes must import them)."""

import copy

import torch
import torch.distributed as dist

from flowlane.aleph import Plan
from flowlane.aleph.hook import install_aleph_hook
from flowlane.aleph.udp_allreduce import UdpAllReduce


def udp_cases(rank: int, world: int, clusters: list, drop: float) -> dict:
    """Integer sums through tier 1 (exact vs all_reduce, twice: fresh processes per call), a float sum (within the
    fixed-point bound), then DDP with the UDP hook vs DDP's own all-reduce over two SGD steps (two buckets)."""
    plan = Plan.from_clusters(world, clusters)
    u = UdpAllReduce(plan, drop=drop)
    out: dict = {"int_equal": []}
    for it in range(2):
        x = torch.arange(700, dtype=torch.int64) * (rank + 1) + rank**3 - 7 * it
        ref = x.clone()
        dist.all_reduce(ref)
        out["int_equal"].append(bool(torch.equal(u(x), ref)))
    out["nacks"] = sum(s.get("nack_sent", 0) for s in u.stats)
    f = torch.randn(3000, generator=torch.Generator().manual_seed(rank)) * 2
    ref = f.clone()
    dist.all_reduce(ref)
    out["float_maxdiff"] = float((u(f) - ref).abs().max())
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(12, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    res = []
    for hooked in (False, True):
        ddp = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(model), bucket_cap_mb=0.0002)
        if hooked:
            install_aleph_hook(ddp, plan, dataplane="udp", drop=drop)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        g = torch.Generator().manual_seed(100 + rank)
        for _ in range(2):
            loss = ddp(torch.randn(16, 12, generator=g)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        res.append([p.detach().clone() for p in ddp.module.parameters()])
    out["ddp_maxdiff"] = max(float((a - b).abs().max()) for a, b in zip(*res, strict=True))
    out["ddp_moved"] = max(
        float((a - b).abs().max()) for a, b in zip(res[0], model.parameters(), strict=True)
    )
    return out


def udp_multips_cases(rank: int, world: int, clusters: list, cases: list) -> list:
    """Several PSs through tier 1 (Sec. 7): per case (ps, split or None, ps_bandwidths or None, drop), an integer sum
    (exact vs all_reduce) and a float sum (within the fixed-point bound), and this rank's PS processes' counters."""
    plan = Plan.from_clusters(world, clusters)
    out = []
    for ps, split, bw, drop in cases:
        u = UdpAllReduce(plan, drop=drop, ps=ps, split=split, ps_bandwidths=bw)
        x = torch.arange(3000, dtype=torch.int64) * (rank + 1) - 5 * rank**2
        ref = x.clone()
        dist.all_reduce(ref)
        exact = bool(torch.equal(u(x), ref))
        ps_stats = [s for s in u.stats if s["role"] == "ps"]
        f = torch.randn(2000, generator=torch.Generator().manual_seed(rank)) * 3
        ref = f.clone()
        dist.all_reduce(ref)
        out.append(
            {
                "exact": exact,
                "ps_added": [s["data_rx"] - s["dup"] for s in ps_stats],  # DATA added once each
                "split": list(u.split),
                "float_maxdiff": float((u(f) - ref).abs().max()),
                "injected": sum(s["injected_drops"] for s in u.stats),
            }
        )
    return out
