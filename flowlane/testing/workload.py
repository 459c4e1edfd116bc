"""A synthetic hybrid-parallel iteration on real ranks: 1F1B pipeline x data (x expert) parallel, ZeRO-style
parameter gathers, per-layer gradient reductions in the last microbatch, optional MoE all-to-alls.

It reproduces the three overlap cases of seed 000 §5.2.2 with real traffic (gloo) and emulated compute (sleep;
a 2-core machine cannot run several ranks' matmuls concurrently -- digest A5 R8), and drives every op through a
:class:`~flowlane.sched.scheduler.CommScheduler`. Used by the runtime tests and by benchmarks/hermod_real.py; with
``mode="fifo"`` it is the default (Megatron-core's) order: everything launched when issued, parameter gathers
dispatched one layer ahead of the first forward (as Megatron's forward pre-hooks do).

Layout: ``rank = dp * pp + stage``; PP groups ``[dp*pp + s]``; DP groups ``[d*pp + stage]``; EP groups = DP groups
(MoE parallel folding). The math is deterministic and identical in every mode: the returned digest must match.
"""

from __future__ import annotations

import random
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from flowlane import comm
from flowlane.hermod.matching import AUTO_CANDIDATES
from flowlane.hermod.order import CoflowKey, HermodOrder, HermodOrderConfig
from flowlane.hermod.policy import HermodPolicy
from flowlane.hermod.wire import WireEncoder
from flowlane.policy import CoflowMeta, FifoPolicy, SchedulingPolicy
from flowlane.sched.alltoall import AllToAllRunner, gather_split_matrix
from flowlane.sched.groups import build_class_groups
from flowlane.sched.scheduler import CommScheduler, SchedulerConfig


@dataclass
class WorkloadConfig:
    pp: int = 2
    layers_per_stage: int = 2
    microbatches: int = 4
    iterations: int = 2
    act_elems: int = 4096
    """Activation elements per microbatch (float32); rows of 64."""
    param_elems: int = 16384
    """Parameters per layer (float32): one DP bucket per layer."""
    moe: bool = False
    ep_algorithm: str = "bvn"
    """The MoE all-to-all (:class:`flowlane.sched.alltoall.AllToAllRunner`): a planner, ``plain`` or ``auto``."""
    ep_auto_candidates: list[str] = field(default_factory=lambda: list(AUTO_CANDIDATES))
    """What ``auto`` compares, in probe order (two or more of the planners and ``plain``)."""
    ep_auto_probe_iterations: int = 2
    """Iterations ``auto`` times each candidate."""
    fwd_s: float = 0.0
    """Emulated forward compute per layer and microbatch (backward = 2x)."""
    opt_s: float = 0.0
    delay_s: float = 0.0
    """Injected random delay (0..delay_s) before every op, per rank (deadlock test)."""
    seed: int = 0
    sched: dict[str, Any] = field(default_factory=dict)
    """SchedulerConfig fields; mode "fifo" = default order."""
    dp_mid: str = "last"
    gloo_class_ifnames: list[str] | None = None
    """One interface per Hermod class for the DP clones (wire classes on gloo, see flowlane.sched.groups)."""
    ep_wire_classes: bool = False
    """Hermod only: each MoE all-to-all runs on its wire class's clone of the EP group (critical: the oldest
    in-flight microbatch; pipeline: later ones -- :meth:`flowlane.hermod.wire.WireEncoder.nccl_class`), so with
    ``gloo_class_ifnames`` the fabric serves the older microbatch's all-to-all first (seed 000 §5.3.1: MID first)."""
    order: str | None = None
    """How deferred DP ops are ordered: ``hermod`` (the Hermod key) or ``fifo`` (issue order); None: FIFO in
    ``sched`` mode "fifo", else Hermod. Lina (seed 000 §5.5.1) = mode "hermod" (chunked, gated) + ``gate_ctypes
    ("ep",)`` + order "fifo"."""
    overlap_dp: bool = True
    """Megatron's ``--overlap-grad-reduce`` / ``--overlap-param-gather``: each layer's reduction starts in the last
    microbatch's backward (Case II) and the first forward waits only for its own layer's gather (Case III). False is
    Megatron-LM's default, the thesis' "vanilla Megatron-LM" baseline (seed 000 §5.5.1): every gather completes
    before the first forward, every reduction starts after the rank's whole backward."""
    device: str = "cpu"
    """Where activations, parameters and gradients live: ``cpu`` (gloo) or ``cuda`` (NCCL: each rank on its current
    CUDA device). Random numbers are drawn on the CPU and moved, so both start from the same values."""

    def __post_init__(self) -> None:
        if self.device != "cpu" and not self.device.startswith("cuda"):
            raise ValueError(f"WorkloadConfig.device {self.device!r} must be 'cpu' or 'cuda' (or 'cuda:N')")


_ROW = 64


class _Rank:
    def __init__(
        self, rank: int, world: int, cfg: WorkloadConfig, policy: SchedulingPolicy, order: str
    ) -> None:
        self.cfg, self.rank, self.world, self.order = cfg, rank, world, order
        self.pp, self.dp = cfg.pp, world // cfg.pp
        self.stage, self.dp_rank = rank % cfg.pp, rank // cfg.pp
        self.pp_groups = [dist.new_group([d * self.pp + s for s in range(self.pp)]) for d in range(self.dp)]
        self.dp_groups = [dist.new_group([d * self.pp + s for d in range(self.dp)]) for s in range(self.pp)]
        self.pp_group, self.dp_group = self.pp_groups[self.dp_rank], self.dp_groups[self.stage]
        self.classes = build_class_groups(
            [dist.get_process_group_ranks(self.dp_group)], gloo_class_ifnames=cfg.gloo_class_ifnames
        )
        # deferred DP traffic runs on its own communicator: Hermod's bulk class; the default order has no classes,
        # so FIFO's DP stays in the first (highest, i.e. unmarked) class when wire classes exist
        self.bulk = self.classes.get(self.dp_group, 2 if cfg.sched.get("mode", "hermod") == "hermod" else 0)
        self.sched = CommScheduler(policy, SchedulerConfig(**cfg.sched))
        self.a2a = AllToAllRunner(
            cfg.ep_algorithm,  # type: ignore[arg-type]
            probe_iterations=cfg.ep_auto_probe_iterations,
            candidates=cfg.ep_auto_candidates,
        )
        hermod = cfg.sched.get("mode", "hermod") == "hermod"
        self.encoder = (
            WireEncoder(HermodOrder(HermodOrderConfig(cfg.microbatches, "1f1b", cfg.dp_mid)))
            if cfg.ep_wire_classes and hermod
            else None
        )  # type: ignore[arg-type]
        self.oldest_mid = 0  # oldest microbatch forwarded but not yet backwarded on this rank
        # (iteration, mb, layer, pass, class) per a2a
        self.ep_classes: list[tuple[int, int, int, str, int]] = []
        if self.encoder is not None and dist.get_backend() == "gloo" and not cfg.gloo_class_ifnames:
            # without interfaces gloo has one clone, shared with the deferred DP traffic: nothing to gain, and an
            # all-to-all would queue behind DP chunks on the same communicator
            raise ValueError(
                "ep_wire_classes on gloo needs gloo_class_ifnames (one interface per Hermod class)"
            )
        self.rng = random.Random(cfg.seed * 7919 + rank)
        g = torch.Generator().manual_seed(cfg.seed * 1000 + self.stage)  # same params on every DP replica
        self.dev = torch.device(cfg.device)
        self.params = [
            (torch.randn(cfg.param_elems, generator=g) * 0.1).to(self.dev)
            for _ in range(cfg.layers_per_stage)
        ]
        self.it = 0

    # -- helpers ------------------------------------------------------------------------------------------------
    def layer_id(self, local: int) -> int:
        return self.stage * self.cfg.layers_per_stage + local

    def meta(self, ctype: str, mb: int, layer: int, op: str, iteration: int | None = None) -> CoflowMeta:
        return CoflowMeta(
            ctype,
            iteration=self.it if iteration is None else iteration,
            microbatch=mb,
            layer=layer,
            stage=self.stage,
            op=op,
            seq=self.sched.next_seq(),
        )

    def jitter(self) -> None:
        if self.cfg.delay_s > 0:
            time.sleep(self.rng.random() * self.cfg.delay_s)

    def deferred_all_reduce(self, flat: torch.Tensor, meta: CoflowMeta) -> Any:
        launches = []
        for a, b in self.sched.chunk_bounds(flat.numel(), flat.element_size()):

            def launch(a: int = a, b: int = b) -> Any:
                return comm.all_reduce(flat[a:b], group=self.bulk, kind="dp", key=meta, async_op=True)

            launches.append(launch)
        return self.sched.defer(meta, launches)

    def p2p(
        self,
        send: torch.Tensor | None,
        send_to: int | None,
        recv_shape: bool,
        recv_from: int | None,
        meta: CoflowMeta,
    ) -> torch.Tensor | None:
        """One Megatron-style combined p2p step (sends and receives posted together, then all waited)."""
        self.jitter()
        buf = torch.empty(self.cfg.act_elems, device=self.dev) if recv_shape else None
        ops = []
        if send is not None and send_to is not None:
            ops.append(dist.P2POp(dist.isend, send, send_to, self.pp_group))
        if buf is not None and recv_from is not None:
            ops.append(dist.P2POp(dist.irecv, buf, recv_from, self.pp_group))
        if not ops:
            return None
        with self.sched.critical_section(meta):
            for w in comm.batch_isend_irecv(ops, kind="pp", key=meta):
                w.wait()
        return buf

    def routing(self, mb: int, layer: int, n_rows: int) -> list[int]:
        """Skewed, deterministic token splits of this rank's rows over the EP group."""
        r = random.Random(hash((self.cfg.seed, self.it, mb, layer, self.dp_rank)) & 0xFFFFFFFF)
        weights = [r.paretovariate(1.2) for _ in range(self.dp)]
        raw = [int(n_rows * w / sum(weights)) for w in weights]
        raw[r.randrange(self.dp)] += n_rows - sum(raw)
        return raw

    def ep_group(self, meta: CoflowMeta, backward: bool) -> Any:
        """The EP group's communicator for this all-to-all: its wire class's clone with ``ep_wire_classes``. Every
        rank of an EP group (the same stage in every DP replica) runs the same 1F1B program, so it has the same
        oldest in-flight microbatch here and picks the same clone -- the class is a deterministic function of the
        program point, never of timing."""
        if self.encoder is None:
            return self.dp_group
        c = self.encoder.nccl_class(CoflowKey.from_meta(meta), self.oldest_mid)
        self.ep_classes.append((meta.iteration, meta.microbatch, meta.layer, "bwd" if backward else "fwd", c))
        return self.classes.get(self.dp_group, c)

    def moe(self, x: torch.Tensor, mb: int, layer: int, backward: bool) -> torch.Tensor:
        if not self.cfg.moe or self.dp == 1:
            return x
        rows = x.view(-1, _ROW)
        splits = self.routing(mb, layer + (1000 if backward else 0), rows.shape[0])
        matrix = gather_split_matrix(splits, self.dp_group)  # the dispatcher's metadata all-gather (A2.5)
        recv_splits = [matrix[i][self.dp_rank] for i in range(self.dp)]
        meta = self.meta("ep", mb, self.layer_id(layer), "dispatch")
        group = self.ep_group(meta, backward)
        out = torch.empty(sum(recv_splits), _ROW, device=self.dev)
        self.jitter()
        with self.sched.critical_section(meta):
            self.a2a(out, rows, recv_splits, splits, group=group, matrix=matrix, key=meta)
        out = out * (1.0 + 0.01 * (self.dp_rank + 1))  # the "expert"
        back = torch.empty_like(rows)
        tmatrix = [[matrix[j][i] for j in range(self.dp)] for i in range(self.dp)]
        meta = self.meta("ep", mb, self.layer_id(layer), "combine")
        with self.sched.critical_section(meta):
            self.a2a(back, out, splits, recv_splits, group=group, matrix=tmatrix, key=meta)
        return back.view(-1)

    # -- one iteration ----------------------------------------------------------------------------------------------
    def iteration(self) -> None:
        cfg, L, M = self.cfg, self.cfg.layers_per_stage, self.cfg.microbatches
        # Case III: ZeRO parameter gathers. Megatron-core (0.16, overlap_param_gather) dispatches them lazily: the
        # first bucket's at zero_grad, then each forward pre-hook waits for its layer's and dispatches the next one
        # (one ahead, forward order) -- the default order, and Lina's, which is built on it. Hermod's runtime takes
        # them all at once and orders them by key (lowest layer first, behind the critical ops).
        shard = cfg.param_elems // self.dp
        gathers: dict[int, Any] = {}
        full: dict[int, torch.Tensor] = {}
        lazy = cfg.overlap_dp and self.order == "fifo"

        def gather(local: int) -> None:
            buf = torch.zeros(cfg.param_elems, device=self.dev)
            lo = self.dp_rank * shard
            buf[lo : lo + shard] = self.params[local][lo : lo + shard]
            buf[self.dp * shard :] = self.params[local][self.dp * shard :] / self.dp
            full[local] = buf
            gathers[local] = self.deferred_all_reduce(
                buf, self.meta("dp", 0, self.layer_id(local), "all_gather")
            )

        for local in [0] if lazy else reversed(range(L)):  # not lazy: all at once, in bucket (reverse) order
            gather(local)
        self.sched.seal()  # one window: Hermod sorts the gathers by key
        # gathered before the forward starts, as in the optimizer step of Megatron's default
        if not cfg.overlap_dp:
            for local in reversed(range(L)):
                gathers.pop(local).wait()
                self.params[local] = full[local]
        grads = [torch.zeros(cfg.param_elems, device=self.dev) for _ in range(L)]
        reductions: list[Any] = []
        acts: dict[int, list[torch.Tensor]] = {}
        prev, nxt = self.stage - 1, self.stage + 1
        pp_ranks = dist.get_process_group_ranks(self.pp_group)
        prev_r = pp_ranks[prev] if prev >= 0 else None
        next_r = pp_ranks[nxt] if nxt < self.pp else None

        def input_for(mb: int) -> torch.Tensor:
            g = torch.Generator().manual_seed(cfg.seed * 31 + self.it * 1009 + mb * 17 + self.dp_rank)
            return torch.randn(cfg.act_elems, generator=g).to(self.dev)

        def forward(mb: int, x: torch.Tensor) -> torch.Tensor:
            saved = []
            for local in range(L):
                if local in gathers:
                    gathers.pop(local).wait()
                    self.params[local] = full[local]
                    if lazy and local + 1 < L:
                        gather(local + 1)
                        self.sched.seal()
                saved.append(x)
                time.sleep(cfg.fwd_s)
                w = self.params[local][: cfg.act_elems]
                x = x + 0.1 * torch.tanh(x * w)
                x = self.moe(x, mb, local, backward=False)
            acts[mb] = saved
            return x

        def backward(mb: int, g: torch.Tensor) -> torch.Tensor:
            saved = acts.pop(mb)
            for local in reversed(range(L)):
                time.sleep(2 * cfg.fwd_s)
                g = self.moe(g, mb, local, backward=True)
                grads[local][: cfg.act_elems] += g * saved[local] * 0.01
                grads[local][cfg.act_elems :] += float(g.mean()) * 1e-3
                g = g * 0.9
                # Case II: a layer's reduction starts after the last microbatch
                if mb == M - 1 and cfg.overlap_dp:
                    reduce(local)
            return g

        def reduce(local: int) -> None:
            reductions.append(
                (
                    local,
                    self.deferred_all_reduce(
                        grads[local], self.meta("dp", M - 1, self.layer_id(local), "reduce_scatter")
                    ),
                )
            )
            # seal now (a program-order point, so deterministic): an open window would keep the ready reduction
            # off the link through the next layer's compute, until the next critical op
            self.sched.seal()

        warm = min(self.pp - self.stage - 1, M)
        rem = M - warm
        fwd_mb = bwd_mb = self.oldest_mid = 0
        for _ in range(warm):
            x = self.p2p(
                None, None, prev_r is not None, prev_r, self.meta("pp", fwd_mb, self.layer_id(0), "recv")
            )
            y = forward(fwd_mb, x if x is not None else input_for(fwd_mb))
            self.p2p(y, next_r, False, None, self.meta("pp", fwd_mb, self.layer_id(L - 1), "send_fwd"))
            fwd_mb += 1
        x = (
            self.p2p(
                None, None, prev_r is not None, prev_r, self.meta("pp", fwd_mb, self.layer_id(0), "recv")
            )
            if rem
            else None
        )
        for i in range(rem):
            y = forward(fwd_mb, x if x is not None else input_for(fwd_mb))
            fwd_mb += 1
            if next_r is not None:
                g = self.p2p(
                    y, next_r, True, next_r, self.meta("pp", fwd_mb - 1, self.layer_id(L - 1), "send_fwd")
                )
            else:
                g = torch.ones_like(y) / (M * y.numel())
            gin = backward(bwd_mb, g)
            bwd_mb += 1
            self.oldest_mid = bwd_mb
            meta = self.meta("pp", bwd_mb - 1, self.layer_id(0), "send_bwd")
            if i == rem - 1:
                self.p2p(gin if prev_r is not None else None, prev_r, False, None, meta)
            else:
                x = self.p2p(gin if prev_r is not None else None, prev_r, prev_r is not None, prev_r, meta)
        for _ in range(warm):
            g = self.p2p(None, None, True, next_r, self.meta("pp", bwd_mb, self.layer_id(L - 1), "recv"))
            gin = backward(bwd_mb, g)
            bwd_mb += 1
            self.oldest_mid = bwd_mb
            self.p2p(
                gin if prev_r is not None else None,
                prev_r,
                False,
                None,
                self.meta("pp", bwd_mb - 1, self.layer_id(0), "send_bwd"),
            )
        # Megatron's default: finalize_model_grads after the whole backward, bucket order
        if not cfg.overlap_dp:
            for local in reversed(range(L)):
                reduce(local)
        for local, h in reductions:
            h.wait()
            self.params[local] = self.params[local] - 0.1 * grads[local] / self.dp
        time.sleep(cfg.opt_s)
        self.it += 1
        self.a2a.end_iteration()  # ep_algorithm=auto probes whole iterations


def run_rank(rank: int, world: int, cfg_dict: dict[str, Any]) -> dict[str, Any]:
    """Entry point for flowlane.launch: run the iterations, return timings, digest and the scheduler log. The
    groups it creates are destroyed when it returns (benchmarks run it many times in one process)."""
    with comm.owned_process_groups():
        return _run_rank(rank, world, WorkloadConfig(**cfg_dict))


def _run_rank(rank: int, world: int, cfg: WorkloadConfig) -> dict[str, Any]:
    order = cfg.order or ("fifo" if cfg.sched.get("mode", "hermod") == "fifo" else "hermod")
    if order not in ("fifo", "hermod"):
        raise ValueError(f"WorkloadConfig.order {order!r} is not one of ['fifo', 'hermod'] (or None)")
    policy: SchedulingPolicy = (
        FifoPolicy()
        if order == "fifo"
        else HermodPolicy(HermodOrderConfig(cfg.microbatches, "1f1b", cfg.dp_mid))
    )  # type: ignore[arg-type]
    r = _Rank(rank, world, cfg, policy, order)
    times, starts = [], []
    with comm.recording() as rec:
        for _ in range(cfg.iterations):
            dist.barrier()
            t0 = time.perf_counter()
            starts.append(t0)
            r.iteration()
            times.append(time.perf_counter() - t0)
        r.sched.close()
    digest = float(sum(p.double().sum() for p in r.params))
    log = [
        (
            e.event,
            e.meta.ctype,
            e.meta.op,
            e.meta.iteration,
            e.meta.microbatch,
            e.meta.layer,
            e.chunk,
            e.window,
        )
        for e in r.sched.log
    ]
    return {
        "rank": rank,
        "stage": r.stage,
        "dp_rank": r.dp_rank,
        "times": times,
        "digest": digest,
        "log": log,
        "params": [p.tolist() for p in r.params],
        "bytes": rec.bytes_by_kind(),
        "config": asdict(cfg),
        "iter_starts": starts,
        "ep_classes": r.ep_classes,
        "ep_auto": {
            "choice": r.a2a.choice,
            "probe_seconds": r.a2a.probe_seconds,
            "probe_iterations": r.a2a.probe_iterations,
            "candidates": list(r.a2a.candidates),
        }
        if cfg.ep_algorithm == "auto"
        else None,
        "ops": [(o.kind, o.op, o.nbytes, o.start, o.duration) for o in rec.ops],
    }
