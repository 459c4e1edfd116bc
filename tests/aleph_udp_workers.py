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


def udp_guard_cases(rank: int, world: int) -> dict:
    """What tier 1 cannot carry, decided alike on every rank: a NaN on rank 1 only and an inf on rank 0 only (every
    rank gets NaN, as DDP's all-reduce gives non-finite sums; DDP with the UDP hook against DDP's own), an int32
    overflow in the nodes' sums (forced: the exponent without headroom), integers too big on one rank only, a float64
    too big for int32 at the smallest exponent on one rank only; then an ordinary sum (the group is still in step)."""
    import flowlane.aleph.wire as W

    plan = Plan.from_clusters(world, [list(range(world))])  # rank 0 aggregates the others, and is the PS
    u = UdpAllReduce(plan)
    out: dict = {}
    for name, bad_rank, value in (("nan", 1, float("nan")), ("inf", 0, float("inf"))):
        x = torch.ones(300)
        if rank == bad_rank:
            x[7] = value
        out[name] = bool(torch.isfinite(u(x)).any())  # False: nothing finite came back
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    for hooked in (False, True):
        ddp = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(model))
        if hooked:
            install_aleph_hook(ddp, plan, dataplane="udp")
        inp = torch.ones(3, 4)
        if rank == 1:
            inp[0, 0] = float("nan")
        ddp(inp).sum().backward()
        # what AMP's GradScaler checks: are all gradients finite (rank 1's NaN input: the weight's are not)
        grads = [p.grad for p in ddp.parameters()]
        out[f"ddp_finite_{'udp' if hooked else 'own'}"] = all(bool(torch.isfinite(g).all()) for g in grads)
    orig = W.scale_exponent
    W.scale_exponent = lambda m, n: orig(m, 1)  # no log2(n) headroom: 2^30 + 2^30 overflows int32
    try:
        x = torch.ones(300)
        try:
            u(x)
            out["overflow"] = "returned"
        except RuntimeError as e:
            out["overflow"] = str(e)
        out["overflow_untouched"] = bool(torch.equal(x, torch.ones(300)))
    finally:
        W.scale_exponent = orig
    big = torch.full((50,), 2**30 if rank == 1 else 5, dtype=torch.int64)  # > (2^31 - 1) // 2 on rank 1 only
    try:
        u(big)
        out["int_range"] = "returned"
    except ValueError as e:
        out["int_range"] = str(e)
    # a finite float64 above 2^131 on rank 1 only: the exponent clamps at 2^-100 and still leaves 2^40
    huge = torch.full((40,), 2.0**140 if rank == 1 else 1.0, dtype=torch.float64)
    try:
        u(huge)
        out["float_range"] = "returned"
    except ValueError as e:
        out["float_range"] = str(e)
    f = torch.full((200,), float(rank + 1))
    out["after"] = float(u(f)[0])
    return out
