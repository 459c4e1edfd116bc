"""Workload builders: hybrid-parallel LLM training (seed 000 §5.2), DLRM (seed 004 §3.2) and data-parallel
CNN/BERT (seed 002 §6.1).

LLM DAG (per iteration), Megatron-style:
* ranks ordered tp (fastest), cp, dp, pp; a TP group computes in lockstep and is one *executor*;
* pipeline: 1F1B (Megatron's synchronous p2p: an op waits for the previous op's send) or interleaved 1F1B
  (virtual stages, Megatron's chunk order, non-blocking p2p so "PP coflows are no longer on the critical path",
  seed 000 §5.3.1); each PP coflow = one p2p per TP rank of b*s*h*bytes/tp (scatter-gather) [derived];
* DP: gradient buckets (Megatron default max(40M, 1M*dp) elements [ext]) filled in backward layer order, launched
  when the last microbatch's backward has produced them ("invoked only after the last microbatch completes its
  gradient calculation for the layer", §5.2.2), so they overlap the remaining backward PP/EP traffic (Case II);
  ZeRO: reduce-scatter, a clip-by-norm barrier (decisions.md A6.1 #13), optimizer step, parameter all-gather; else
  all-reduce then step. DP coflows carry microbatch M-1 (§5.3.1);
* iterations: several are chained (default 2); with ZeRO and ``overlap_param_gather`` a bucket's parameter
  all-gather (keyed with the iteration that consumes it) gates only the first forward of its layers in the next
  iteration, so it overlaps that forward's PP/EP coflows (Case III, §5.2.2). An iteration ends when its optimizer
  steps are done; ``SimResult.iteration_time`` is the gap between the last two ends (the steady iteration);
* EP (MoE): per layer and microbatch, attention -> dispatch all-to-all -> experts -> combine all-to-all, mirrored
  in backward; token matrices drawn from a Zipf expert popularity (``moe_skew``), dropless. EP groups follow
  ``ParallelConfig.ep_layout`` (default: across DP replicas, Megatron's order, so the all-to-all crosses the NICs);
* CP: ring-attention KV exchange per stage op, concurrent with that op's compute.
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from flowlane.policy import CoflowMeta
from flowlane.sim import collectives as C
from flowlane.sim.graph import SimSpecError, Workload
from flowlane.sim.models import GPUS, GPUSpec, LLMJob, ModelConfig, ParallelConfig, preset
from flowlane.topology import Topology, gbps, leaf_spine, star


def cluster(
    gpus: int,
    bandwidth_gbps: float = 100.0,
    gpus_per_server: int = 8,
    servers_per_leaf: int = 4,
    oversubscription: float = 1.0,
    nics_per_server: int = 0,
) -> Topology:
    """Hermod's simulated fabric (seed 000 §5.5.1): servers of 8 GPUs, full-bisection, 100 Gbps, 1 us links.

    ``nics_per_server`` (0 = one NIC per GPU, rail-style): the seed's "128-server cluster ... connected via a
    full-bisection fat-tree network with 100Gbps links" does not say how many links a server has. One per GPU is a
    modern DGX reading; 1 is the literal one (TopoOpt's methodology models a server as one network node); its
    testbed had 2 per 8 GPUs (§5.5.1)."""
    if not isinstance(gpus, int) or gpus < 1:
        raise SimSpecError(f"gpus must be an integer >= 1, got {gpus!r}")
    if gpus % gpus_per_server and gpus > gpus_per_server:
        raise SimSpecError(f"gpus={gpus} is not a multiple of gpus_per_server={gpus_per_server}")
    if not (bandwidth_gbps > 0 and math.isfinite(bandwidth_gbps)):
        raise SimSpecError(f"bandwidth must be a finite number > 0 Gbps, got {bandwidth_gbps!r}")
    gps = min(gpus, gpus_per_server)
    topo = leaf_spine(
        servers=max(1, gpus // gps),
        gpus_per_server=gps,
        nic_bw=gbps(bandwidth_gbps),
        oversubscription=oversubscription,
        servers_per_leaf=servers_per_leaf,
        nics_per_server=nics_per_server if gps == gpus_per_server else 0,
    )
    # the GPU-NIC host link (PCIe Gen4 x16, 25 GB/s = 200 Gb/s in leaf_spine) is sized for the NIC it feeds
    # (400 Gb/s NICs sit on PCIe Gen5): the thesis' simulator sweeps the network rate alone (§5.5.3, 40-400 Gb/s)
    nic = gbps(bandwidth_gbps)
    for k, lk in list(topo.links.items()):
        if lk.kind == "pcie" and lk.bandwidth < nic:
            topo.links[k] = dataclasses.replace(lk, bandwidth=nic)
    return topo


def zipf_token_matrix(
    rng: np.random.Generator, ep: int, num_experts: int, tokens: int, top_k: int, skew: float
) -> np.ndarray:
    """An EP group's dispatch matrix: ``out[i, j]`` tokens that rank i routes to the experts rank j holds. Expert
    popularity is Zipf with exponent ``skew`` (0 = uniform; the seed gives no distribution), shuffled over the
    experts; each rank routes ``tokens * top_k`` token copies (dropless). Integer counts."""
    if ep < 1 or num_experts % ep or tokens < 0 or top_k < 1 or not skew >= 0:
        raise SimSpecError(
            f"zipf_token_matrix: need ep >= 1 dividing num_experts, tokens >= 0, top_k >= 1, "
            f"skew >= 0; got ep={ep}, num_experts={num_experts}, tokens={tokens}, top_k={top_k}, "
            f"skew={skew}"
        )
    pop = 1.0 / np.arange(1, num_experts + 1) ** skew
    pop = rng.permutation(pop / pop.sum())
    counts = rng.multinomial(tokens * top_k, pop, size=ep)
    return counts.reshape(ep, ep, num_experts // ep).sum(-1)


def _pipeline_order(p: int, s: int, m: int, v: int, interleaved: bool) -> list[tuple[str, int, int]]:
    """Program order of (kind, chunk, microbatch) on stage s (Megatron-core schedules.py [ext])."""
    if not interleaved:
        warm = min(p - s - 1, m)
        out = [("F", 0, i) for i in range(warm)]
        for i in range(m - warm):
            out += [("F", 0, warm + i), ("B", 0, i)]
        return out + [("B", 0, i) for i in range(m - warm, m)]
    total = m * v

    def mb(k: int) -> int:
        return (k // (p * v)) * p + k % p

    def ch(k: int, fwd: bool) -> int:
        c = (k % (p * v)) // p
        return c if fwd else v - 1 - c

    warm = min((p - s - 1) * 2 + (v - 1) * p, total)
    out = [("F", ch(k, True), mb(k)) for k in range(warm)]
    for i in range(total - warm):
        out += [("F", ch(warm + i, True), mb(warm + i)), ("B", ch(i, False), mb(i))]
    return out + [("B", ch(k, False), mb(k)) for k in range(total - warm, total)]


@dataclass
class _LLMBuilder:
    job: LLMJob
    gpus: int
    topo: Topology
    seed: int = 0
    w: Workload = field(init=False)

    def __post_init__(self) -> None:
        self.m: ModelConfig = self.job.model
        self.p: ParallelConfig = self.job.parallel.resolve(self.gpus, self.m)
        gl = self.topo.gpus
        if len(gl) < self.gpus:
            raise SimSpecError(f"topology {self.topo.name!r} has {len(gl)} GPUs, the job needs {self.gpus}")
        self.w = Workload(gl[: self.gpus], name=f"{self.m.name}@{self.gpus}")
        self.rng = np.random.default_rng(self.seed)
        p, m = self.p, self.m
        self.v = p.virtual_stages if p.schedule == "interleaved" else 1
        self.V = p.pp * self.v
        self.Lv = m.layers // self.V
        self.M = p.microbatches
        self.s_loc = m.seq_len // p.cp
        self.tokens = p.micro_batch * self.s_loc  # per TP group
        self.execs = [(d, c) for d in range(p.dp) for c in range(p.cp)]
        g = self.job.gpu
        self.fl = g.flops
        # analytic TP all-reduce on the intra-node route
        self.tp_ar = 0.0
        if p.tp > 1:
            bw, lat = self.intra_server_route()
            s_bytes = self.tokens * m.hidden * p.bytes_per_elem
            self.tp_ar = 2 * (p.tp - 1) / p.tp * s_bytes / bw + 2 * (p.tp - 1) * lat

    def intra_server_route(self) -> tuple[float, float]:
        """(bandwidth, latency) of the TP group's intra-server fabric (NVLink via the server switch): TP stays on
        NVLink (seed 000 §5.2.2) even when the NIC is faster than NVLink and would win the shortest-path choice."""
        a, b = self.w.devices[0], self.w.devices[1]
        lk = self.topo.links
        for (x, sw), l1 in lk.items():
            if x == a and l1.kind == "nvlink" and (sw, b) in lk and lk[(sw, b)].kind == "nvlink":
                l2 = lk[(sw, b)]
                return min(l1.bandwidth, l2.bandwidth), l1.latency + l2.latency
        r = self.topo.route(a, b)
        return r.bandwidth, r.latency

    # ranks -----------------------------------------------------------------------------------------------
    def rank(self, s: int, d: int, c: int, k: int) -> int:
        p = self.p
        return k + p.tp * (c + p.cp * (d + p.dp * s))

    def gpus_of(self, s: int, x: tuple[int, int]) -> list[int]:
        return [self.rank(s, x[0], x[1], k) for k in range(self.p.tp)]

    def ex(self, s: int, x: tuple[int, int]) -> str:
        return f"st{s}.dp{x[0]}.cp{x[1]}"

    def layers_of(self, vs: int) -> range:
        return range(vs * self.Lv, (vs + 1) * self.Lv)

    # durations -------------------------------------------------------------------------------------------
    def dense_compute(self, vs: int) -> float:
        """Forward compute time of virtual stage ``vs`` (no TP communication)."""
        m, p = self.m, self.p
        per_tok = m.attn_flops_per_token(m.seq_len) + m.dense_mlp_flops_per_token()
        fl = self.Lv * self.tokens * per_tok / p.tp
        if vs == self.V - 1:
            fl += 2 * self.tokens * m.hidden * m.vocab / p.tp
        return fl / self.fl

    def dense_time(self, vs: int, fwd: bool) -> float:
        """Compute (x bwd_factor in backward) plus, with tp_comm="analytic", the layers' TP all-reduces: the TP
        time is added, not multiplied by the backward factor (tp_all_reduces counts the backward's own)."""
        t = self.dense_compute(vs) * (1.0 if fwd else self.bwd_factor())
        if self.p.tp_comm == "analytic":
            t += self.Lv * self.tp_all_reduces(fwd) * self.tp_ar
        return t

    def bwd_factor(self) -> float:
        return 3.0 if self.p.recompute else 2.0

    def tp_all_reduces(self, fwd: bool) -> int:
        """TP all-reduces per layer, Megatron-core's tensor_parallel [ext]: 2 in forward (the attention and MLP
        row-parallel outputs) and 2 in backward (the gradients of the column-parallel inputs), + the forward's 2
        again when backward recomputes the layer (full activation recomputation). With sequence parallelism each is
        a reduce-scatter + all-gather of the same ring bytes; the backward's re-all-gather of each column-parallel
        input (for the weight gradient) is issued asynchronously behind the input-gradient GEMM and not charged."""
        return 2 if fwd or not self.p.recompute else 4

    # build -----------------------------------------------------------------------------------------------
    def build(self) -> Workload:
        p, w = self.p, self.w
        orders = [_pipeline_order(p.pp, s, self.M, self.v, p.schedule == "interleaved") for s in range(p.pp)]
        self.prev: dict[tuple[int, tuple[int, int]], int | None] = {}
        self.pend: dict[tuple[int, tuple[int, int]], int | None] = {}
        ends: list[int] = []
        self.param_ready: dict[int, list[int]] = {}  # stage -> nodes the next iteration's first op waits on
        self.gathers: dict[int, list[int]] = {}  # layer -> previous iteration's param all-gathers (Case III)
        self.ep_setup()
        for it in range(p.iterations):
            self.it = it
            self.started: set[tuple[int, tuple[int, int]]] = set()
            self.sends: dict[tuple[str, int, int, tuple[int, int]], int] = {}
            self.grad_ready: dict[int, dict[tuple[int, int], int | None]] = defaultdict(dict)
            ptr = [0] * p.pp
            done: set[tuple[str, int, int]] = set()
            left = sum(len(o) for o in orders)
            while left:
                progress = False
                for s in range(p.pp):
                    while ptr[s] < len(orders[s]):
                        kind, ch, mb = orders[s][ptr[s]]
                        vs = ch * p.pp + s
                        if kind == "F" and vs > 0 and ("F", vs - 1, mb) not in done:
                            break
                        if kind == "B" and vs < self.V - 1 and ("B", vs + 1, mb) not in done:
                            break
                        self.emit(s, kind, vs, mb)
                        done.add((kind, vs, mb))
                        ptr[s] += 1
                        left -= 1
                        progress = True
                if not progress:  # pragma: no cover - the schedules above are deadlock-free
                    raise SimSpecError("pipeline schedule deadlocked while building the DAG")
            ends.append(self.dp_phase())
        w.info.update(
            iteration_end=ends,
            gpus=self.gpus,
            model=self.m.name,
            parallel=self.p.__dict__,
            schedule=self.p.schedule,  # with microbatches: what a Hermod policy orders by (flowlane.policies)
            microbatches=self.M,
            layers_per_stage=max(
                1, self.m.layers // self.p.pp
            ),  # hermod-dscp's LID buckets (flowlane.policies)
            ep_layout=self.p.ep_layout if self.m.moe else None,
            ep_crosses_servers=self.ep_crosses_servers() if self.m.moe else False,
        )
        return w

    def base_deps(self, s: int, x: tuple[int, int]) -> list[int | None]:
        key = (s, x)
        deps = [self.prev.get(key), self.pend.get(key)]
        if self.it > 0 and key not in self.started:
            deps += self.param_ready.get(s, [])
            self.started.add(key)
        return deps

    def emit(self, s: int, kind: str, vs: int, mb: int) -> None:
        p, w, m = self.p, self.w, self.m
        fwd = kind == "F"
        deps: dict[tuple[int, int], list[int | None]] = {}
        for x in self.execs:
            d = self.base_deps(s, x)
            if fwd and vs > 0:
                d.append(self.sends[("f", vs - 1, mb, x)])
            if not fwd and vs < self.V - 1:
                d.append(self.sends[("b", vs + 1, mb, x)])
            deps[x] = d
        if m.moe:
            done = self.emit_moe(s, vs, mb, fwd, deps)
        else:
            done = {}
            dur = self.dense_time(vs, fwd)
            cpn = self.emit_cp(s, vs, mb, fwd, deps)
            for x in self.execs:
                if not fwd and mb == self.M - 1:
                    node = None
                    dd = deps[x]
                    for layer in reversed(self.layers_of(vs)):
                        node = w.compute(self.ex(s, x), dur / self.Lv, dd, f"B{mb} L{layer}", "bwd")
                        self.grad_ready[layer][x] = node
                        dd = [node]
                elif self.gated(fwd, mb):
                    # first forward after a ZeRO step: layer by layer, each waits for its bucket's all-gather
                    node = None
                    dd = deps[x]
                    for layer in self.layers_of(vs):
                        node = w.compute(
                            self.ex(s, x),
                            dur / self.Lv,
                            [*dd, *self.gathers.get(layer, [])],
                            f"F{mb} L{layer}",
                            "fwd",
                        )
                        dd = [node]
                else:
                    node = w.compute(
                        self.ex(s, x), dur, deps[x], f"{kind}{mb} vs{vs}", "fwd" if fwd else "bwd"
                    )
                node = self.emit_tp(s, x, vs, mb, fwd, node)
                done[x] = w.join([node, cpn[x[0]]]) if cpn else node
        # pipeline sends
        target = vs + 1 if fwd else vs - 1
        for x in self.execs:
            send = None
            if 0 <= target < self.V:
                t_stage = target % p.pp
                layer = self.layers_of(vs)[-1 if fwd else 0]
                meta = CoflowMeta("pp", self.it, mb, layer, vs, "send_fwd" if fwd else "send_bwd")
                nb = self.tokens * m.hidden * p.bytes_per_elem / p.tp
                send = C.p2p(
                    w,
                    self.gpus_of(s, x),
                    self.gpus_of(t_stage, x),
                    nb,
                    meta,
                    [done[x]],
                    name=f"pp:{kind}{mb} vs{vs}->{target}",
                )
                self.sends[("f" if fwd else "b", vs, mb, x)] = send
            self.prev[(s, x)] = done[x]
            self.pend[(s, x)] = send if p.schedule == "1f1b" and not p.async_p2p else None

    def emit_tp(
        self, s: int, x: tuple[int, int], vs: int, mb: int, fwd: bool, node: int | None, layers: int = 0
    ) -> int | None:
        p = self.p
        if p.tp_comm != "flows" or p.tp == 1:
            return node
        n_ar = self.tp_all_reduces(fwd) * (layers or self.Lv)
        s_bytes = self.tokens * self.m.hidden * p.bytes_per_elem
        meta = CoflowMeta("tp", self.it, mb, self.layers_of(vs)[0], vs)
        g = np.array(self.gpus_of(s, x))
        flows = C.ring_flows(g, 2 * (p.tp - 1) / p.tp * s_bytes * n_ar)
        return self.w.coflow(
            flows, meta, [node], f"tp:{'F' if fwd else 'B'}{mb}", steps=2 * (p.tp - 1) * n_ar
        )

    def emit_cp(self, s: int, vs: int, mb: int, fwd: bool, deps: dict) -> dict[int, int]:
        p, m = self.p, self.m
        if p.cp == 1:
            return {}
        out = {}
        kv = 2 * p.micro_batch * self.s_loc * m.h_kv * p.bytes_per_elem / p.tp
        nb = self.Lv * (p.cp - 1) * kv * (1 if fwd else 2)
        for d in range(p.dp):
            src = [self.rank(s, d, c, k) for c in range(p.cp) for k in range(p.tp)]
            dst = [self.rank(s, d, (c + 1) % p.cp, k) for c in range(p.cp) for k in range(p.tp)]
            dd = [y for c in range(p.cp) for y in deps[(d, c)]]
            meta = CoflowMeta("cp", self.it, mb, self.layers_of(vs)[0], vs, "ring_attn")
            out[d] = self.w.coflow(
                (src, dst, np.full(len(src), nb)),
                meta,
                dd,
                f"cp:{'F' if fwd else 'B'}{mb}",
                steps=self.Lv * (p.cp - 1),
            )
        return out

    # MoE -------------------------------------------------------------------------------------------------
    def gated(self, fwd: bool, mb: int) -> bool:
        """Is this the first forward of a chunk after a step whose param all-gathers overlap it (Case III)?"""
        return fwd and mb == 0 and self.it > 0 and bool(self.gathers)

    def ep_setup(self) -> None:
        """EP groups as stage-local GPUs (d, c, k) and each GPU's (group, position) (ParallelConfig.ep_layout)."""
        p = self.p
        self.ep_members: list[list[tuple[int, int, int]]] = []
        if not self.m.moe:
            return
        if p.ep_layout == "dp":  # Megatron order tp-cp-ep-dp-pp: ep consecutive DP replicas, same (c, k)
            for c in range(p.cp):
                for k in range(p.tp):
                    for g in range(p.dp // p.ep):
                        self.ep_members.append([(d, c, k) for d in range(g * p.ep, (g + 1) * p.ep)])
        else:  # fold: ep consecutive ranks of the flat stage index f = k + tp*(c + cp*d)
            for g in range(p.tp * p.cp * p.dp // p.ep):
                grp = []
                for f in range(g * p.ep, (g + 1) * p.ep):
                    k, q = f % p.tp, f // p.tp
                    grp.append((q // p.cp, q % p.cp, k))
                self.ep_members.append(grp)
        self.ep_pos = {gpu: (gi, j) for gi, grp in enumerate(self.ep_members) for j, gpu in enumerate(grp)}

    def ep_crosses_servers(self) -> bool:
        devs = self.w.devices
        srv = [{devs[self.rank(0, d, c, k)].split("/")[0] for d, c, k in grp} for grp in self.ep_members]
        return any(len(x) > 1 for x in srv)

    def ep_groups(self) -> list[list[tuple[int, int]]]:
        """EP group -> executors (d, c) that own its GPUs."""
        groups = []
        for grp in self.ep_members:
            xs: list[tuple[int, int]] = []
            for d, c, _ in grp:
                if (d, c) not in xs:
                    xs.append((d, c))
            groups.append(xs)
        return groups

    def ep_ranks(self, s: int, gi: int) -> np.ndarray:
        return np.array([self.rank(s, d, c, k) for d, c, k in self.ep_members[gi]])

    def token_matrix(self) -> np.ndarray:
        p, m = self.p, self.m
        n_tok = self.tokens // p.tp if p.tp > 1 else self.tokens  # sequence parallel: tokens split over TP
        return zipf_token_matrix(self.rng, p.ep, m.num_experts, n_tok, m.top_k, p.moe_skew).astype(np.float64)

    def emit_moe(self, s: int, vs: int, mb: int, fwd: bool, deps: dict) -> dict:
        p, m, w = self.p, self.m, self.w
        groups = self.ep_groups()
        of_exec: dict[tuple[int, int], list[int]] = defaultdict(list)
        for gi, xs in enumerate(groups):
            for x in xs:
                of_exec[x].append(gi)
        attn = (
            self.tokens * (m.attn_flops_per_token(m.seq_len) + m.dense_mlp_flops_per_token()) / p.tp
        ) / self.fl
        bf = 1.0 if fwd else self.bwd_factor()
        cur = {x: list(deps[x]) for x in self.execs}
        cpn = self.emit_cp(s, vs, mb, fwd, deps)
        layers = list(self.layers_of(vs)) if fwd else list(reversed(self.layers_of(vs)))
        for layer in layers:
            mats = [self.token_matrix() for _ in groups]
            a_nodes = {}
            if fwd:
                for x in self.execs:
                    gate = self.gathers.get(layer, []) if self.gated(fwd, mb) else []
                    a = w.compute(
                        self.ex(s, x),
                        attn + self.tp_all_reduces(fwd) * self.tp_ar * (p.tp_comm == "analytic"),
                        [*cur[x], *gate],
                        f"F{mb} L{layer} attn",
                        "fwd",
                    )
                    a_nodes[x] = self.emit_tp(s, x, vs, mb, fwd, a, 1)
            # forward: attn -> dispatch(T) -> experts -> combine(T^T); backward mirrors it
            before = [[a_nodes[x] for x in xs] if fwd else [y for x in xs for y in cur[x]] for xs in groups]
            a2a1 = self.emit_ep_all_to_alls(s, mats, mb, layer, vs, fwd, True, before)
            exp = {}
            for x in self.execs:
                recv = []
                for k in range(p.tp):
                    gi, j = self.ep_pos[(x[0], x[1], k)]
                    recv.append(mats[gi][:, j].sum())
                # fold: expert-TP 1, the TP group waits for its busiest GPU; dp: expert-TP = TP, the TP group
                # all-gathers its EP ranks' tokens (NVLink) and splits the expert GEMMs evenly
                tok = max(recv) if p.ep_layout == "fold" else sum(recv) / p.tp
                dur = tok * m.expert_flops_per_token() / self.fl * bf
                exp[x] = w.compute(
                    self.ex(s, x),
                    dur,
                    [a2a1[gi] for gi in of_exec[x]],
                    f"{'F' if fwd else 'B'}{mb} L{layer} experts",
                    "fwd" if fwd else "bwd",
                )
            a2a2 = self.emit_ep_all_to_alls(
                s, mats, mb, layer, vs, fwd, False, [[exp[x] for x in xs] for xs in groups]
            )
            for x in self.execs:
                after = [a2a2[gi] for gi in of_exec[x]]
                if fwd:
                    cur[x] = after
                else:
                    b: int | None = w.compute(
                        self.ex(s, x),
                        attn * bf + self.tp_all_reduces(fwd) * self.tp_ar * (p.tp_comm == "analytic"),
                        after,
                        f"B{mb} L{layer} attn",
                        "bwd",
                    )
                    b = self.emit_tp(s, x, vs, mb, fwd, b, 1)
                    if mb == self.M - 1:
                        self.grad_ready[layer][x] = b
                    cur[x] = [b]
        done = {}
        for x in self.execs:
            extra = []
            if fwd and vs == self.V - 1:
                extra = [
                    w.compute(
                        self.ex(s, x),
                        2 * self.tokens * m.hidden * m.vocab / p.tp / self.fl,
                        cur[x],
                        f"F{mb} logits",
                        "fwd",
                    )
                ]
            nodes = extra or cur[x]
            if cpn:
                nodes = [*nodes, cpn[x[0]]]
            done[x] = nodes[0] if len(nodes) == 1 else w.join(nodes)
        return done

    def emit_ep_all_to_alls(
        self, s: int, mats: list, mb: int, layer: int, vs: int, fwd: bool, first: bool, deps: list[list[Any]]
    ) -> list[int]:
        """One all-to-all per EP group of stage ``s``, after ``deps[group]``: a layer's first is the dispatch of the
        token matrix forward and the combine's gradient (its transpose) backward; the second is the other one."""
        p, m = self.p, self.m
        op = "dispatch" if first == fwd else "combine"
        out = []
        for gi in range(len(mats)):
            T = mats[gi] if first == fwd else mats[gi].T
            meta = CoflowMeta("ep", self.it, mb, layer, vs, op)
            out.append(
                C.all_to_all(
                    self.w,
                    self.ep_ranks(s, gi),
                    T,
                    meta,
                    deps[gi],
                    stream=f"ep:{s}:{gi}",
                    name=f"ep:{'F' if fwd else 'B'}{mb} L{layer} {op}",
                    mode=p.ep_a2a,
                    unit_bytes=m.hidden * p.bytes_per_elem,
                )
            )
        return out

    # DP --------------------------------------------------------------------------------------------------
    def buckets(self, s: int) -> list[tuple[list[int], float, bool]]:
        """(layers, params per GPU, expert?) in backward order, Megatron-style, per model chunk."""
        p, m = self.p, self.m
        cap = p.bucket_params or max(40_000_000, 1_000_000 * p.dp)
        out = []
        for ch in reversed(range(self.v)):
            vs = ch * p.pp + s
            for expert in [False, True] if m.moe else [False]:
                cur: list[int] = []
                acc = 0.0
                for layer in reversed(self.layers_of(vs)):
                    if expert:
                        par = m.num_experts // p.ep * m.expert_params() / (p.tp if p.ep_layout == "dp" else 1)
                    else:
                        par = m.dense_params_per_layer() / p.tp
                        if layer in (0, m.layers - 1):
                            par += m.vocab * m.hidden / p.tp
                    cur.append(layer)
                    acc += par
                    if acc >= cap:
                        out.append((cur, acc, expert))
                        cur, acc = [], 0.0
                if cur:
                    out.append((cur, acc, expert))
        return out

    def dp_groups(self, s: int, expert: bool) -> np.ndarray:
        """Rows = DP (or expert-DP) groups of stage s, as rank arrays."""
        p = self.p
        # GPUs holding the same expert shard: same position in their EP group (and same TP rank for dp)
        if expert:
            rows: dict[tuple[int, int], list[int]] = defaultdict(list)
            for (d, c, k), (_, j) in self.ep_pos.items():
                rows[(j, k if p.ep_layout == "dp" else 0)].append(self.rank(s, d, c, k))
            return np.array([sorted(r) for _, r in sorted(rows.items())])
        return np.array(
            [[self.rank(s, d, c, k) for d in range(p.dp)] for c in range(p.cp) for k in range(p.tp)]
        )

    def dp_phase(self) -> int:
        p, w = self.p, self.w
        M1 = self.M - 1
        reduce_nodes: dict[int, list[int]] = defaultdict(list)
        bucket_info = {}
        for s in range(p.pp):
            for bi, (layers, par, expert) in enumerate(self.buckets(s)):
                groups = self.dp_groups(s, expert)
                n = groups.shape[1]
                lo = min(layers)
                # Case II: launched as soon as the bucket's gradients are final; without overlap_grad_reduce only
                # after the stage's whole backward (Megatron's finalize_model_grads)
                deps = [
                    self.grad_ready[lo][x] if p.overlap_grad_reduce else self.prev[(s, x)] for x in self.execs
                ]
                meta = CoflowMeta("dp", self.it, M1, lo, lo // self.Lv % p.pp)
                nb = par * p.grad_bytes
                bucket_info[(s, bi)] = (groups, par, lo, meta, layers)
                if n == 1:
                    continue
                src, dst, sizes, steps = self._dp_flows(
                    groups, nb, "reduce_scatter" if p.zero else "all_reduce"
                )
                op = "reduce_scatter" if p.zero else "all_reduce"
                prev = deps
                for c in range(p.dp_chunks):
                    node = w.coflow(
                        (src, dst, sizes / p.dp_chunks),
                        replace(meta, op=op),
                        prev,
                        f"dp:{op} st{s} b{bi}" + (f"[{c}]" if p.dp_chunks > 1 else ""),
                        stream=f"dp:{s}",
                        steps=steps,
                    )
                    prev = [node]
                reduce_nodes[s].append(node)
        # clip-by-norm barrier: every reduction finishes before any optimizer step (decisions.md A6.1 #13)
        all_red = [n for v in reduce_nodes.values() for n in v]
        last_ops = [self.prev[(s, x)] for s in range(p.pp) for x in self.execs]
        barrier = w.join(all_red + last_ops)
        ends = []
        g = self.job.gpu
        self.param_ready = {}
        overlap = p.zero and p.overlap_param_gather
        self.gathers = {}
        for s in range(p.pp):
            par_gpu = sum(par for (_, par, _) in self.buckets(s))
            shard = par_gpu / (p.dp if p.zero else 1)
            step_nodes: dict[tuple[int, int], int] = {}
            for x in self.execs:
                step_nodes[x] = w.compute(
                    self.ex(s, x), 16 * shard / g.hbm_bw, [barrier], "optimizer", "step"
                )
                self.prev[(s, x)] = step_nodes[x]
                self.pend[(s, x)] = None
            ready = list(step_nodes.values())
            if p.zero:
                ag_nodes = []
                for bi in sorted(range(len(self.buckets(s))), key=lambda b: bucket_info[(s, b)][2]):
                    groups, par, lo, meta, layers = bucket_info[(s, bi)]
                    if groups.shape[1] == 1:
                        continue
                    src, dst, sizes, stp = self._dp_flows(groups, par * p.bytes_per_elem, "all_gather")
                    # keyed with the iteration that consumes the parameters (flowlane.hermod.keys)
                    ag_meta = replace(
                        meta, op="all_gather", iteration=self.it + 1 if overlap else self.it, seq=0
                    )
                    node = w.coflow(
                        (src, dst, sizes),
                        ag_meta,
                        list(step_nodes.values()),
                        f"dp:all_gather st{s} b{bi}",
                        stream=f"dp:{s}",
                        steps=stp,
                    )
                    ag_nodes.append(node)
                    for layer in layers if overlap else ():
                        self.gathers.setdefault(layer, []).append(node)
                if not overlap:
                    ready = ag_nodes or ready
            # Case III: the next forward waits per layer (see gated()), the iteration ends at the step
            if overlap:
                self.param_ready[s] = []
                ends += list(step_nodes.values())
            else:
                self.param_ready[s] = ready
                ends += ready
        return w.join(ends)

    def _dp_flows(
        self, groups: np.ndarray, nb: float, op: str
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
        n = groups.shape[1]
        if op == "all_reduce" and self.p.dp_algo == "tree":
            parts = [C.tree_flows(gr, nb / 2) for gr in groups]
            return (
                np.concatenate([a for a, *_ in parts]),
                np.concatenate([b for _, b, *_ in parts]),
                np.concatenate([c for _, _, c, _ in parts]),
                parts[0][3],
            )
        frac = 2 * (n - 1) / n if op == "all_reduce" else (n - 1) / n
        steps = 2 * (n - 1) if op == "all_reduce" else n - 1
        src = groups.ravel()
        dst = np.roll(groups, -1, axis=1).ravel()
        return src, dst, np.full(src.shape, frac * nb), steps


def build_llm(
    job: LLMJob | str,
    gpus: int,
    bandwidth_gbps: float = 100.0,
    topology: Topology | None = None,
    seed: int = 0,
    **overrides: object,
) -> tuple[Topology, Workload]:
    """Hybrid-parallel LLM iteration(s). ``job`` is an :class:`LLMJob` or a table 5.5 preset name."""
    if isinstance(job, str):
        job = preset(job, **overrides)
    elif overrides:
        raise SimSpecError("overrides are only accepted with a preset name; edit the LLMJob instead")
    topo = topology or cluster(gpus, bandwidth_gbps)
    return topo, _LLMBuilder(job, gpus, topo, seed).build()


# ---------------------------------------------------------------------------------------------------------------
# DLRM (SYNDICATE, seed 004 §3.2 table 2) and data-parallel CNN/BERT (ALEPH, seed 002 §6.1)
# ---------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DLRMConfig:
    """DLRM: data-parallel bottom/top MLPs, model-parallel embedding tables reached by all-to-all.
    Default ~ SYNDICATE A1 (table 2: ~100s tables, avg dim 68, pooling 27, 26 MLP layers of avg 914, batch 512);
    the split into 13 bottom + 13 top layers and fp32 are our assumptions."""

    name: str = "dlrm-a1"
    num_tables: int = 256
    emb_dim: int = 68
    pooling: int = 27
    batch_per_gpu: int = 512
    bottom_mlp: tuple[int, ...] = (914,) * 13
    top_mlp: tuple[int, ...] = (914,) * 13
    dense_features: int = 512
    bytes_per_elem: int = 4


def build_dlrm(
    cfg: DLRMConfig | None = None,
    gpus: int = 16,
    bandwidth_gbps: float = 100.0,
    topology: Topology | None = None,
    gpu: GPUSpec | None = None,
    iterations: int = 1,
    ar_algo: tuple[str, str] = ("ring", "tree"),
) -> tuple[Topology, Workload]:
    """DLRM DAG of seed 004 Fig. 13: a2a-data-prep -> fwd-emb -> a2a-emb-fwd -> interaction/top-MLP fwd+bwd ->
    a2a-emb-bwd -> bwd-emb, bottom MLP in parallel; ar-top-mlp and ar-bottom-mlp (ring for the large bottom,
    tree for the small top, as SYNDICATE's planner chose, §3.5)."""
    cfg = cfg or DLRMConfig()
    g = gpu or GPUS["V100"]
    if gpus < 2:
        raise SimSpecError(f"DLRM needs gpus >= 2, got {gpus}")
    if cfg.num_tables < gpus:
        raise SimSpecError(f"DLRM num_tables={cfg.num_tables} must be >= gpus={gpus} (tables are sharded)")
    topo = topology or cluster(gpus, bandwidth_gbps)
    w = Workload(topo.gpus[:gpus], name=f"{cfg.name}@{gpus}")
    B, be = cfg.batch_per_gpu, cfg.bytes_per_elem

    def mlp(widths: Sequence[int], d_in: int) -> tuple[float, float]:
        fl, par, d = 0.0, 0.0, d_in
        for wd in widths:
            fl += 2 * d * wd
            par += d * wd
            d = wd
        return fl, par

    bf, bp = mlp(cfg.bottom_mlp, cfg.dense_features)
    tf, tp_ = mlp(cfg.top_mlp, cfg.bottom_mlp[-1] + cfg.num_tables * cfg.emb_dim)
    tables_per = cfg.num_tables / gpus
    # B samples per GPU: the owner of a table looks it up for the global batch (B * gpus samples) and sends each GPU
    # the pooled vectors of that GPU's B samples; the data prep sends each owner the int64 indices of B samples
    emb_bytes = B * tables_per * cfg.emb_dim * be  # pooled vectors per (src, dst)
    idx_bytes = B * tables_per * cfg.pooling * 8  # sparse indices per (src, dst)
    lookup = B * gpus * tables_per * cfg.pooling * cfg.emb_dim * be / g.hbm_bw  # memory bound lookups
    ranks = np.arange(gpus)
    full = np.full((gpus, gpus), 1.0)
    prev: dict[Any, int | None] = {r: None for r in range(gpus)}  # keyed by rank (int or numpy int)
    ends = []
    for it in range(iterations):
        mk = lambda op, layer=0, it=it: CoflowMeta("ep", it, 0, layer, 0, op)  # noqa: E731
        prep = C.all_to_all(
            w,
            ranks,
            full * idx_bytes,
            mk("all_to_all"),
            [prev[r] for r in ranks],
            name="a2a-data-prep",
        )
        femb = [w.compute(f"g{r}", lookup, [prep], "fwd-emb", "fwd") for r in ranks]
        a2af = C.all_to_all(w, ranks, full * emb_bytes, mk("dispatch"), femb, name="a2a-emb-fwd")
        bot = [w.compute(f"g{r}", B * bf / g.flops, [prev[r]], "fwd-bottom-mlp", "fwd") for r in ranks]
        top = [
            w.compute(f"g{r}", 3 * B * tf / g.flops, [a2af, bot[r]], "fwd+bwd-top-mlp", "fwd") for r in ranks
        ]
        ar_top = C.all_reduce(
            w,
            ranks,
            tp_ * be,
            CoflowMeta("dp", it, 0, 1, 0),
            top,
            algo=ar_algo[1],
            name="ar-top-mlp",
            stream="dp",
        )
        a2ab = C.all_to_all(w, ranks, full * emb_bytes, mk("combine"), top, name="a2a-emb-bwd")
        bemb = [w.compute(f"g{r}", lookup, [a2ab], "bwd-emb", "bwd") for r in ranks]
        bbot = [w.compute(f"g{r}", 2 * B * bf / g.flops, [top[r]], "bwd-bottom-mlp", "bwd") for r in ranks]
        ar_bot = C.all_reduce(
            w,
            ranks,
            bp * be,
            CoflowMeta("dp", it, 0, 0, 0),
            bbot,
            algo=ar_algo[0],
            name="ar-bottom-mlp",
            stream="dp",
        )
        end = w.join([ar_top, ar_bot, *bemb])
        ends.append(end)
        prev = {r: end for r in ranks}
    w.info.update(iteration_end=ends, gpus=gpus, model=cfg.name)
    return topo, w


@dataclass(frozen=True)
class DPModel:
    name: str
    grad_bytes: float  # seed 002 §6.1.1
    fwd_flops_per_sample: float  # [ext] standard counts
    batch_per_gpu: int


#: ALEPH's models (seed 002 §6.1: sizes and batch sizes); forward FLOPs are the usual ImageNet-224 / seq-128 counts.
DP_MODELS = {
    "resnet50": DPModel("resnet50", 97e6, 4.1e9, 64),
    "vgg19": DPModel("vgg19", 548e6, 19.6e9, 64),
    "bert": DPModel("bert", 438e6, 2 * 110e6 * 128, 16),
}


def build_dp(
    model: DPModel | str = "resnet50",
    gpus: int = 8,
    bandwidths_gbps: Sequence[float] | None = None,
    topology: Topology | None = None,
    gpu: GPUSpec | None = None,
    bucket_bytes: float = 25e6,
    algo: str = "ring",
    iterations: int = 1,
) -> tuple[Topology, Workload]:
    """Data-parallel training with PyTorch-DDP-style 25 MB gradient buckets all-reduced as backward produces them.
    Default topology: ALEPH's heterogeneous star (one host at 30, two at 20, the rest at 10 Gbps, §6.1)."""
    if isinstance(model, str):
        if model not in DP_MODELS:
            raise SimSpecError(f"unknown DP model {model!r}; choose one of {sorted(DP_MODELS)}")
        model = DP_MODELS[model]
    if not isinstance(gpus, int) or gpus < 2:
        raise SimSpecError(f"data-parallel training needs gpus >= 2, got {gpus!r}")
    if topology is None:
        bw = (
            list(bandwidths_gbps)
            if bandwidths_gbps is not None
            else ([30, 20, 20] + [10] * max(0, gpus - 3))[:gpus]
        )
        if len(bw) != gpus:
            raise SimSpecError(f"{len(bw)} bandwidths given for {gpus} workers")
        topology = star([gbps(b) for b in bw], latency=5e-6)
    g = gpu or GPUSpec("RTX3080Ti", 34e12, 0.4)
    w = Workload(topology.gpus[:gpus], name=f"{model.name}@{gpus}")
    nb = max(1, math.ceil(model.grad_bytes / bucket_bytes))
    fwd = model.fwd_flops_per_sample * model.batch_per_gpu / g.flops
    ranks = np.arange(gpus)
    prev: list[int | None] = [None] * gpus
    ends = []
    for it in range(iterations):
        f = [w.compute(f"g{r}", fwd, [prev[r]], "fwd", "fwd") for r in ranks]
        last = list(f)
        ars = []
        for b in range(nb):
            last = [w.compute(f"g{r}", 2 * fwd / nb, [last[r]], f"bwd b{b}", "bwd") for r in ranks]
            size = min(bucket_bytes, model.grad_bytes - b * bucket_bytes)
            ars.append(
                C.all_reduce(
                    w,
                    ranks,
                    size,
                    CoflowMeta("dp", it, 0, nb - 1 - b, 0),
                    last,
                    algo=algo,
                    stream="dp",
                    name=f"ar b{b}",
                )
            )
        end = w.join(ars + last)
        ends.append(end)
        prev = [end] * gpus
    w.info.update(iteration_end=ends, gpus=gpus, model=model.name)
    return topology, w


WORKLOADS = (
    "gpt3-175b",
    "gpt3-13b",
    "mixtral-8x7b",
    "mixtral-8x22b",
    "qwen-moe-12l",
    "qwen-moe-24l",
    "dlrm",
    "resnet50",
    "vgg19",
    "bert",
)


def build_workload(
    name: str, gpus: int, bandwidth_gbps: float = 100.0, seed: int = 0, **overrides: Any
) -> tuple[Topology, Workload]:
    """Any named workload: LLM presets (table 5.5), ``dlrm``, or DP ``resnet50``/``vgg19``/``bert``."""
    if name == "dlrm":
        return build_dlrm(gpus=gpus, bandwidth_gbps=bandwidth_gbps)
    if name in DP_MODELS:
        return build_dp(name, gpus, bandwidths_gbps=[bandwidth_gbps] * gpus)
    if name in WORKLOADS:
        return build_llm(name, gpus, bandwidth_gbps, seed=seed, **overrides)
    raise SimSpecError(f"unknown workload {name!r}; choose one of {list(WORKLOADS)}")
