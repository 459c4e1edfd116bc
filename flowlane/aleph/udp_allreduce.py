"""Tier 1 behind the comm hook: the sum of a tensor over a torch.distributed group through the userspace UDP
aggregator (``aleph_dataplane/src/aleph_udp.c``), one aggregation iteration per call (digest §5.4 tier 1).

Per call every rank runs its roles of the plan's tree as processes of the C binary: the rank of the plan's first
head also runs the PS node (|D| children), every head of a cluster with members runs its aggregator node (parent: the
PS), and every rank runs a worker that sends its values to its parent (its aggregator, or the PS when it is a
singleton) and receives the sum. Node ports are exchanged with ``all_gather_object`` on the group. Values travel as
int32 fixed point (:mod:`flowlane.aleph.wire`): integer tensors with exponent 0 (exact; values must fit int32 with
the sum), floats with one exponent per call from the group's max-abs (a MAX all-reduce) leaving log2(n) headroom
bits, so the result is within n * 2^-(k+1) of the float sum. Loss is repaired by the binary's NACK/RETX. The same
MAX all-reduce carries a flag for NaN/inf values, which have no fixed-point code: when any rank has one, every rank
gets NaN (DDP's all-reduce would carry it too, so AMP's GradScaler skips the step) and no process starts. Integers
too big for the sum, floats too big for int32 even at the smallest exponent (2^SCALE_MIN), and an int32 overflow
the nodes count, raise on every rank (decided on all-reduced figures). Those all-reduces run on the group's collective
device (:func:`_collective_device`: the tensor's own, or CUDA on a pure-NCCL group, which refuses CPU tensors).

Several PSs (seed Sec. 7, digest §2.9; ``ps=`` positions that are cluster heads, as tier 0's
``HierarchicalAllReduce``): the tensor is cut into q parts (``split`` fractions, or proportional to
``ps_bandwidths``; :func:`flowlane.aleph.udp.split_bounds`), and part j runs as its own tree under PS j (job id j):
rank ``ps[j]`` runs PS j's node, every aggregator a node per part, every rank a worker per part, so each aggregator
sends PS j exactly its part j.

This is a functional path, not a fast one: processes start per call (tens of ms) and the payload is copied through
files. ``host`` is the address the other ranks reach this rank's nodes at (default loopback: every rank on one
machine, as the tests run).
"""

from __future__ import annotations

import json
import logging
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from flowlane.aleph import wire as W
from flowlane.aleph.cluster import Plan
from flowlane.aleph.model import multi_ps_split
from flowlane.aleph.udp import _start, build, check_split, split_bounds
from flowlane.comm import collective_device

log = logging.getLogger("flowlane.aleph")
_INTS = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


def _collective_device(group: dist.ProcessGroup | None, tensor: torch.Tensor) -> torch.device:
    """Where the call's small all-reduced figures live: the tensor's device (DDP reduces its buckets there on this
    group), or for a CPU tensor the current CUDA device on a pure-NCCL group (NCCL moves CUDA tensors only), else the
    CPU (gloo)."""
    return tensor.device if tensor.device.type != "cpu" else collective_device(group)


class UdpAllReduce:
    """``plan``'s tree over ``group`` (default: the world) through tier 1; call it with a contiguous tensor to sum it
    in place (SUM only). The same plan on every rank (all-gathered and compared, as tier 0 does). ``ps``: the PS
    positions (cluster heads; default the first head), with ``split`` (one fraction per PS, or ``"equal"``) or
    ``ps_bandwidths`` (proportional, Sec. 7) when there are several."""

    def __init__(
        self,
        plan: Plan,
        group: dist.ProcessGroup | None = None,
        host: str = "127.0.0.1",
        drop: float = 0.0,
        rto_ms: int = 20,
        timeout_s: float = 120.0,
        ps: Sequence[int] | None = None,
        split: Sequence[float] | str | None = None,
        ps_bandwidths: Sequence[float] | None = None,
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
        self.ps, self.split = _check_ps(plan, ps, split, ps_bandwidths)
        plans: list[Any] = [None] * len(self.ranks)
        dist.all_gather_object(plans, (plan.to_dict(), self.ps, self.split), group=group)
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
        if not (tensor.dtype.is_floating_point or tensor.dtype in _INTS):
            raise TypeError(f"UdpAllReduce sums integer or floating tensors, not {tensor.dtype}")
        x = flat.detach().cpu().to(torch.float64)
        finite = torch.isfinite(x)
        # one MAX all-reduce carries the group's max-abs (the exponent, digest §5.2 #1) and a non-finite flag, so every
        # rank takes the same branch below before any starts a process or raises: a check on one rank alone would
        # leave the others waiting in the next collective. Only finite values enter the max (gloo's MAX with a NaN
        # gives NaN or a finite value depending on the rank that holds it).
        device = _collective_device(self.group, tensor)
        stat = torch.tensor(
            [float(x[finite].abs().max()) if bool(finite.any()) else 0.0, float(not bool(finite.all()))],
            dtype=torch.float64,
            device=device,
        )
        dist.all_reduce(stat, op=dist.ReduceOp.MAX, group=self.group)
        top = float(stat[0])
        if stat[1] > 0:
            # a NaN/inf has no fixed-point code; DDP's own all-reduce would carry it into the sum, so AMP's GradScaler
            # sees it and skips the step: every rank gets NaN (not finite garbage), no processes start
            log.warning(
                "flowlane.aleph: a rank's tensor has NaN/inf values; UdpAllReduce returns NaN on every rank"
            )
            flat.fill_(float("nan"))
            self.stats = []
            return tensor
        if tensor.dtype.is_floating_point:
            k = W.scale_exponent(top, n)
            # k is clamped at SCALE_MIN: a finite max-abs above ~2^131 does not fit int32 even at 2^-100, and W.encode
            # would refuse it on the rank holding it only (the others would wait in _gather): top is the group's, so
            # this is W.encode's own test on every rank
            if np.rint(top * 2.0**k) > 2**31 - 1:
                raise ValueError(
                    f"floating values up to {top!r} (the group's max-abs) do not fit int32 even at the smallest "
                    f"fixed-point scale 2^{k}"
                )
            vals = W.encode(x.numpy(), k)
        else:
            k = 0
            if top > (2**31 - 1) // n:  # every rank sees the group's max: every rank raises
                raise ValueError(
                    f"integer values up to {int(top)} (the group's max-abs) do not fit int32 summed over {n} ranks"
                )
            vals = flat.detach().cpu().numpy().astype(np.int64).astype(np.int32)
        self.calls += 1
        seed = self.calls * 1009 + me
        n_el = max(1, flat.numel())
        if flat.numel() == 0:
            vals = np.zeros(1, np.int32)
        bounds = split_bounds(n_el, self.split)
        parts = [j for j in range(len(self.ps)) if bounds[j + 1] > bounds[j]]

        def common(j: int) -> list[str]:
            return ["--elems", str(bounds[j + 1] - bounds[j]), "--iters", "1", "--rto-ms", str(self.rto_ms),
                    "--drop", repr(self.drop), "--job", str(j)]  # fmt: skip

        head_id = {q.head: i for i, q in enumerate(plan.clusters)}  # a head's child id at a PS
        procs: list[tuple[str, subprocess.Popen[str]]] = []
        try:
            ps_ports: dict[int, int] = {}
            for j in parts:
                if me == self.ps[j]:
                    p, ps_ports[j] = _start([self.exe, "node", "--children", str(plan.num_flows), "--seed",
                                             str(seed + 10 * j), *common(j)], None)  # fmt: skip
                    procs.append(("ps", p))
            got = self._gather((self.host, ps_ports))  # self.ps[j]: a position in the group
            ps_addr = {j: f"{got[self.ps[j]][0]}:{got[self.ps[j]][1][j]}" for j in parts}
            c = plan.cluster_of(me)
            agg_ports: dict[int, int] = {}
            if me == c.head and len(c.members) > 1:
                for j in parts:
                    p, agg_ports[j] = _start([self.exe, "node", "--children", str(len(c.members)), "--parent",
                                              ps_addr[j], "--id", str(head_id[me]), "--seed", str(seed + 10 * j + 1),
                                              *common(j)], None)  # fmt: skip
                    procs.append(("aggregator", p))
            addrs = self._gather((self.host, agg_ports))
            with tempfile.TemporaryDirectory(prefix="aleph-udp-hook-") as tmp:
                outs = {}
                for j in parts:
                    if len(c.members) > 1:
                        parent = f"{addrs[c.head][0]}:{addrs[c.head][1][j]}"
                        lid = c.members.index(me)
                    else:
                        parent, lid = ps_addr[j], head_id[me]
                    inp, outs[j] = Path(tmp) / f"in{j}", Path(tmp) / f"out{j}"
                    np.ascontiguousarray(vals[bounds[j] : bounds[j + 1]], dtype="<i4").tofile(inp)
                    p, _ = _start([self.exe, "worker", "--parent", parent, "--id", str(lid), "--scale", str(k),
                                   "--in", str(inp), "--out", str(outs[j]), "--seed", str(seed + 10 * j + 2),
                                   *common(j)], None)  # fmt: skip
                    procs.append(("worker", p))
                stats: list[dict[str, Any]] = []
                for role, q in reversed(procs):  # the workers first: nodes leave after them (linger)
                    text, err = q.communicate(timeout=self.timeout_s)
                    if q.returncode != 0:
                        raise RuntimeError(f"aleph_udp {role} exited {q.returncode}: {err.strip()[-2000:]}")
                    stats.append({"role": role, **_last_json(text)})
                s = np.concatenate([np.fromfile(outs[j], dtype="<i4") for j in parts])[: flat.numel()]
        finally:
            for _, q in procs:
                if q.poll() is None:
                    q.kill()
                    q.wait()
        self.stats = stats
        # the nodes count int32 overflows of their sums (wrapped, like int32); the exponent's headroom should make it
        # impossible, so one means a wrong sum: all-reduced (also the barrier: every rank's nodes have left before the
        # next call opens new ones), so every rank raises, and the tensor is left as it was
        over = torch.tensor(
            [sum(int(st.get("overflow", 0)) for st in stats)], dtype=torch.int64, device=device
        )
        dist.all_reduce(over, group=self.group)
        if int(over):
            raise RuntimeError(
                f"aleph_udp nodes counted {int(over)} int32 overflow(s) in the sums (fixed-point exponent {k} over "
                f"{n} ranks): the sum would be wrong, so it is not returned"
            )
        if tensor.dtype.is_floating_point:
            flat.copy_(torch.from_numpy(W.decode(s, k)).to(flat.dtype))
        else:
            flat.copy_(torch.from_numpy(s.astype(np.int64)).to(flat.dtype))
        return tensor


def _last_json(text: str) -> dict[str, Any]:
    lines = [x for x in text.strip().splitlines() if x.startswith("{")]
    return json.loads(lines[-1]) if lines else {}


def _check_ps(
    plan: Plan,
    ps: Sequence[int] | None,
    split: Sequence[float] | str | None,
    ps_bandwidths: Sequence[float] | None,
) -> tuple[tuple[int, ...], tuple[float, ...]]:
    """(PS positions, fractions); refuses bad values by name (the rules of tier 0's several PSs)."""
    pos = (plan.heads[0],) if ps is None else tuple(int(p) for p in ps)
    if not pos or len(set(pos)) != len(pos) or any(p not in plan.heads for p in pos):
        raise ValueError(
            f"ps={list(pos)} must be distinct aggregator positions (cluster heads: {list(plan.heads)})"
        )
    q = len(pos)
    if split is not None and ps_bandwidths is not None:
        raise ValueError("give split= or ps_bandwidths=, not both")
    if ps_bandwidths is not None:
        if len(ps_bandwidths) != q:
            raise ValueError(
                f"ps_bandwidths={list(ps_bandwidths)} has {len(ps_bandwidths)} values for {q} PSs {pos}"
            )
        return pos, tuple(multi_ps_split(list(ps_bandwidths)))
    if split is None:
        if q > 1:
            raise ValueError(f"{q} PSs {list(pos)}: give split= (fractions or 'equal') or ps_bandwidths=")
        return pos, (1.0,)
    if isinstance(split, str):
        if split != "equal":
            raise ValueError(f"split={split!r}: a string split must be 'equal' (or give fractions)")
        return pos, tuple([1.0 / q] * q)
    fr = check_split(split)
    if len(fr) != q:
        raise ValueError(f"split={list(split)} has {len(fr)} fractions for {q} PSs {list(pos)}")
    return pos, fr
