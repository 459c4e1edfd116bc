"""Tier 1 behind the comm hook: the sum of a tensor over a torch.distributed group through the userspace UDP
aggregator (``aleph_dataplane/src/aleph_udp.c``), one aggregation iteration per call (digest §5.4 tier 1).

Per call every rank runs its roles of the plan's tree as processes of the C binary: the rank of the plan's first
head also runs the PS node (|D| children), every head of a cluster with members runs its aggregator node (parent: the
PS), and every rank runs a worker that sends its values to its parent (its aggregator, or the PS when it is a
singleton) and receives the sum. Node ports are exchanged with ``all_gather_object`` on the group. Values travel as
int32 fixed point (:mod:`flowlane.aleph.wire`): integer tensors with exponent 0 (exact; values must fit int32 with
the sum), floats with one exponent per call from the group's max-abs (a MAX all-reduce) leaving log2(n) headroom
bits, so the result is within n * 2^-(k+1) of the float sum. Loss is repaired by the binary's NACK/RETX.

This is a functional path, not a fast one: processes start per call (tens of ms) and the payload is copied through
files. ``host`` is the address the other ranks reach this rank's nodes at (default loopback: every rank on one
machine, as the tests run).
"""

from __future__ import annotations

import json
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from flowlane.aleph import wire as W
from flowlane.aleph.cluster import Plan
from flowlane.aleph.udp import _start, build


class UdpAllReduce:
    """``plan``'s tree over ``group`` (default: the world) through tier 1; call it with a contiguous tensor to sum it
    in place (SUM only). The same plan on every rank (all-gathered and compared, as tier 0 does)."""

    def __init__(
        self,
        plan: Plan,
        group: dist.ProcessGroup | None = None,
        host: str = "127.0.0.1",
        drop: float = 0.0,
        rto_ms: int = 20,
        timeout_s: float = 120.0,
    ) -> None:
        if not dist.is_initialized():
            raise RuntimeError("UdpAllReduce needs an initialised torch.distributed process group")
        if not 0 <= drop < 1:
            raise ValueError(f"drop={drop!r} must be a probability in [0, 1)")
        if plan.num_flows > W.MAX_CHILDREN or any(len(c.members) > W.MAX_CHILDREN for c in plan.clusters):
            raise ValueError(f"a node takes at most {W.MAX_CHILDREN} children (the bitmap's width)")
        self.group = group
        self.ranks = (
            dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
        )
        if plan.n != len(self.ranks):
            raise ValueError(f"plan covers {plan.n} workers but the group has {len(self.ranks)} ranks")
        plans: list[Any] = [None] * len(self.ranks)
        dist.all_gather_object(plans, plan.to_dict(), group=group)
        if any(p != plans[0] for p in plans):
            raise ValueError(f"ranks disagree on the ALEPH plan: {plans}")
        self.plan, self.host, self.drop, self.rto_ms, self.timeout_s = plan, host, drop, rto_ms, timeout_s
        self.me = self.ranks.index(dist.get_rank())
        self.exe = str(build())
        self.calls = 0
        self.stats: list[dict[str, Any]] = []  # the last call's counters of this rank's processes

    def _gather(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * len(self.ranks)
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        if not tensor.is_contiguous():
            raise ValueError("UdpAllReduce needs a contiguous tensor")
        n, plan, me = len(self.ranks), self.plan, self.me
        flat = tensor.view(-1)
        if tensor.dtype.is_floating_point:
            m = flat.abs().max().to(torch.float64) if flat.numel() else torch.zeros((), dtype=torch.float64)
            dist.all_reduce(m, op=dist.ReduceOp.MAX, group=self.group)
            k = W.scale_exponent(float(m), n)
            vals = W.encode(flat.detach().cpu().numpy(), k)
        elif tensor.dtype in (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8):
            k, x = 0, flat.detach().cpu().numpy().astype(np.int64)
            if x.size and np.abs(x).max() > (2**31 - 1) // n:
                raise ValueError(
                    f"integer values up to {int(np.abs(x).max())} do not fit int32 summed over {n} ranks"
                )
            vals = x.astype(np.int32)
        else:
            raise TypeError(f"UdpAllReduce sums integer or floating tensors, not {tensor.dtype}")
        self.calls += 1
        seed = self.calls * 1009 + me
        common = ["--elems", str(max(1, flat.numel())), "--iters", "1", "--rto-ms", str(self.rto_ms)]
        common += ["--drop", repr(self.drop)]
        root = plan.heads[0]
        procs: list[tuple[str, subprocess.Popen[str]]] = []
        try:
            ps_port = 0
            if me == root:
                p, ps_port = _start([self.exe, "node", "--children", str(plan.num_flows), "--seed",
                                     str(seed), *common], None)  # fmt: skip
                procs.append(("ps", p))
            ps_host, ps_port = self._gather((self.host, ps_port))[root]  # root: a position in the group
            ps_addr = f"{ps_host}:{ps_port}"
            c = plan.cluster_of(me)
            agg_port = 0
            if me == c.head and len(c.members) > 1:
                i = next(j for j, q in enumerate(plan.clusters) if q.head == me)
                p, agg_port = _start([self.exe, "node", "--children", str(len(c.members)), "--parent", ps_addr,
                                      "--id", str(i), "--seed", str(seed + 1), *common], None)  # fmt: skip
                procs.append(("aggregator", p))
            addrs = self._gather((self.host, agg_port))
            if len(c.members) > 1:
                parent, lid = f"{addrs[c.head][0]}:{addrs[c.head][1]}", c.members.index(me)
            else:
                parent, lid = ps_addr, next(j for j, q in enumerate(plan.clusters) if q.head == me)
            with tempfile.TemporaryDirectory(prefix="aleph-udp-hook-") as tmp:
                inp, out = Path(tmp) / "in", Path(tmp) / "out"
                np.ascontiguousarray(vals, dtype="<i4").tofile(inp)
                if flat.numel() == 0:
                    np.zeros(1, "<i4").tofile(inp)
                p, _ = _start([self.exe, "worker", "--parent", parent, "--id", str(lid), "--scale", str(k),
                               "--in", str(inp), "--out", str(out), "--seed", str(seed + 2), *common],
                              None)  # fmt: skip
                procs.append(("worker", p))
                stats: list[dict[str, Any]] = []
                for role, q in reversed(procs):  # the worker first: nodes leave after it (linger)
                    text, err = q.communicate(timeout=self.timeout_s)
                    if q.returncode != 0:
                        raise RuntimeError(f"aleph_udp {role} exited {q.returncode}: {err.strip()[-2000:]}")
                    stats.append({"role": role, **_last_json(text)})
                s = np.fromfile(out, dtype="<i4")[: flat.numel()]
        finally:
            for _, q in procs:
                if q.poll() is None:
                    q.kill()
                    q.wait()
        self.stats = stats
        if tensor.dtype.is_floating_point:
            flat.copy_(torch.from_numpy(W.decode(s, k)).to(flat.dtype))
        else:
            flat.copy_(torch.from_numpy(s.astype(np.int64)).to(flat.dtype))
        dist.barrier(group=self.group)  # every rank's nodes have left before the next call opens new ones
        return tensor


def _last_json(text: str) -> dict[str, Any]:
    lines = [x for x in text.strip().splitlines() if x.startswith("{")]
    return json.loads(lines[-1]) if lines else {}
