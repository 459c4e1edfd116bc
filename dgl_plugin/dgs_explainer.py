"""The DGS explainer process (digest A2.6 steps 4-6, A2.10 explainer loop): a separate CPU process per worker that
takes a model snapshot every T_ex iterations, infers the local nodes' predictions on the worker's partition, pools
them at the explanation graph's super-node and trains the node and feature masks (:func:`flowlane.dgs.train_masks`).

Shared memory (torch tensors in shared memory replace the seed's sysv_ipc segments): the flat model parameters and
the masks, each with a version counter, under one lock. The trainer writes a snapshot; the explainer answers with
new masks; the sampler picks them up without waiting.

Lifetimes: the explainer stops when the trainer sets ``stop``, and exits by itself if the trainer disappears (its
parent pid changes). A dead explainer is an error in the trainer (:meth:`ExplainerHandle.poll` raises with the exit
code), never a hang: nothing in the trainer waits on the explainer except :meth:`ExplainerHandle.stop`, which is
bounded by ``explainer_timeout_s``.

Decisions (A6): #1 the explanation graph's remote nodes are the 1-hop halo; #3 v_G's features are the mean of the
local input features; #4 the halo rows come from one setup pull (counted as ``setup`` bytes); #5 the soft target is
the mean local softmax; #6 GNN weights frozen, masks only; #7 ℒ tests the fidelity term; #13 the newest snapshot at
each T_ex boundary; #14 inference runs on the partition's own in-edges with the halo rows (halo nodes see no
in-edges of their own, which their layer-1 embedding then lacks: a cheap approximation).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

CTL_MODEL, CTL_MASK, CTL_STOP, CTL_READY, CTL_EXPLAINED, CTL_EARLY = range(6)


@dataclass
class ExplainerSpec:
    """What the explainer needs to rebuild the worker's view: the partition ([inner | halo] rows) and the model."""

    e_src: np.ndarray
    e_dst: np.ndarray
    n_inner: int
    model_kw: dict
    cfg: Any
    seed: int = 0


def _flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _load_flat(model: torch.nn.Module, flat: torch.Tensor) -> None:
    off = 0
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(flat[off : off + p.numel()].view_as(p))
            off += p.numel()


def _star_forward(model, sg):
    """v_G's logits on the explanation graph with per-edge weights (SAGEConv / GraphConv take ``edge_weight``)."""
    import torch.nn.functional as F

    def forward(x, ew):
        h = x
        for k, layer in enumerate(model.layers):
            h = layer(sg, h, edge_weight=ew)
            if k < len(model.layers) - 1:
                h = F.relu(h)
        return h[0]

    return forward


def explainer_main(spec: ExplainerSpec, sh: dict, lock, parent: int) -> None:
    import dgl

    from dgl_plugin.models import build_model
    from flowlane.dgs import pooled_target, star_edges, train_masks

    torch.set_num_threads(spec.cfg.explainer_threads)
    x_all = sh["x"]  # [inner | halo] input features
    n_inner, n_halo = spec.n_inner, x_all.shape[0] - spec.n_inner
    part_g = dgl.graph((torch.from_numpy(spec.e_src), torch.from_numpy(spec.e_dst)), num_nodes=x_all.shape[0])
    s, d = star_edges(n_halo)
    sg = dgl.graph((s, d), num_nodes=n_halo + 1)
    # A6 #3: v_G = mean of local rows
    x_e = torch.cat([x_all[:n_inner].mean(0, keepdim=True), x_all[n_inner:]])
    model = build_model(**spec.model_kw)
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    ctl = sh["ctl"]
    seen, warm, cpu0 = 0, None, time.process_time()
    ctl[CTL_READY] = 1
    while not int(ctl[CTL_STOP]):
        if os.getppid() != parent:  # the trainer is gone: nobody will read the masks
            os._exit(3)
        if int(ctl[CTL_MODEL]) == seen:
            time.sleep(0.01)
            continue
        with lock:
            seen = int(ctl[CTL_MODEL])
            flat = sh["params"].clone()
        _load_flat(model, flat)
        with torch.no_grad():  # Alg. 1 l. 19: inference on the whole partition, CPU
            target = pooled_target(model(part_g, x_all)[:n_inner])
        ex = train_masks(
            _star_forward(model, sg),
            x_e,
            target,
            n_halo,
            epochs=spec.cfg.explainer_epochs,
            min_epochs=spec.cfg.explainer_min_epochs,
            lr=spec.cfg.explainer_lr,
            loss_threshold=spec.cfg.loss_threshold,
            alpha1=spec.cfg.alpha1,
            alpha2=spec.cfg.alpha2,
            beta1=spec.cfg.beta1,
            beta2=spec.cfg.beta2,
            warm=warm,
        )
        warm = (ex.edge_logits, ex.feat_logits)
        with lock:
            sh["sn"].copy_(ex.sn)
            sh["sf"].copy_(ex.sf)
            ctl[CTL_MASK] = seen
            ctl[CTL_EXPLAINED] += 1
            ctl[CTL_EARLY] += int(ex.early_stop)
            sh["stats"][0] = time.process_time() - cpu0
            sh["stats"][1] = ex.fidelity
            sh["stats"][2] = _rss_bytes()
            spread = ex.sn_spread()  # can the node weights matter? (A6 #8; a flat mask picks as uniform does)
            sh["stats"][3:6] = torch.tensor(
                [spread["min"], spread["max"], spread["rel_spread"]], dtype=torch.float64
            )
    sh["stats"][0] = time.process_time() - cpu0


SN_STATS = ("last_sn_min", "last_sn_max", "last_sn_rel_spread")


def _number(x: torch.Tensor) -> float | None:
    v = float(x)
    return v if v == v else None  # nan (no remote nodes) -> None: summaries stay plain JSON


def _rss_bytes() -> float:
    try:
        with open("/proc/self/statm") as f:
            return float(int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE"))
    except OSError:
        return float("nan")


class ExplainerError(RuntimeError):
    """The explainer process died or did not stop in time."""


def shared_state(spec: ExplainerSpec, x_all: torch.Tensor, model: torch.nn.Module) -> dict:
    """The tensors trainer and explainer share: input rows, model snapshot, masks, control counters, stats (cpu s,
    fidelity, rss, and the last node mask's min, max and relative spread)."""
    return {
        "x": x_all.float().contiguous().share_memory_(),
        "params": _flat(model).clone().share_memory_(),
        "sn": torch.zeros(x_all.shape[0] - spec.n_inner).share_memory_(),
        "sf": torch.zeros(x_all.shape[1]).share_memory_(),
        "ctl": torch.zeros(6, dtype=torch.int64).share_memory_(),
        "stats": torch.zeros(6, dtype=torch.float64).share_memory_(),
    }


class ExplainerHandle:
    """Trainer side of one explainer process (spawned, CPU)."""

    def __init__(self, spec: ExplainerSpec, x_all: torch.Tensor, model: torch.nn.Module):
        import torch.multiprocessing as mp

        self.cfg = spec.cfg
        ctx = mp.get_context("spawn")
        self.sh = shared_state(spec, x_all, model)
        self.lock = ctx.Lock()
        self.proc = ctx.Process(
            target=explainer_main,
            args=(spec, self.sh, self.lock, os.getpid()),
            daemon=True,
            name="dgs-explainer",
        )
        self.proc.start()
        self.published = 0
        self.taken = 0

    def _check_alive(self) -> None:
        if not self.proc.is_alive():
            raise ExplainerError(
                f"DGS explainer (pid {self.proc.pid}) exited with code {self.proc.exitcode} while "
                f"the trainer runs; see its traceback above"
            )

    def publish(self, model: torch.nn.Module) -> None:
        """Alg. 1 l. 18: the newest model snapshot (A6 #13), without waiting for the explainer."""
        self._check_alive()
        flat = _flat(model)
        with self.lock:
            self.sh["params"].copy_(flat)
            self.published += 1
            self.sh["ctl"][CTL_MODEL] = self.published

    def poll(self) -> tuple[torch.Tensor, torch.Tensor, int] | None:
        """New masks (𝒮𝒩 over the halo rows, 𝒮ℱ, version) if the explainer finished one since the last poll."""
        self._check_alive()
        ctl = self.sh["ctl"]
        if int(ctl[CTL_MASK]) == self.taken:
            return None
        with self.lock:
            self.taken = int(ctl[CTL_MASK])
            return self.sh["sn"].clone(), self.sh["sf"].clone(), self.taken

    def wait(self) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Block until the masks of the newest snapshot are back (``synchronous``), bounded by
        ``explainer_timeout_s``; a dead explainer raises at once."""
        deadline = time.monotonic() + self.cfg.explainer_timeout_s
        while int(self.sh["ctl"][CTL_MASK]) < self.published:
            self._check_alive()
            if time.monotonic() > deadline:
                raise ExplainerError(
                    f"DGS explainer (pid {self.proc.pid}) gave no masks for snapshot "
                    f"{self.published} within explainer_timeout_s={self.cfg.explainer_timeout_s}"
                )
            time.sleep(0.01)
        new = self.poll()
        assert new is not None
        return new

    def stats(self) -> dict:
        ctl, st = self.sh["ctl"], self.sh["stats"]
        return {
            "explanations": int(ctl[CTL_EXPLAINED]),
            "early_stops": int(ctl[CTL_EARLY]),
            "snapshots": self.published,
            "explainer_cpu_s": float(st[0]),
            "last_fidelity": float(st[1]),
            "explainer_rss_bytes": float(st[2]),
            # the last explanation's node mask: min, max and (max - min) / mean (None before the first one, or
            # without remote nodes)
            **{k: _number(st[i]) if int(ctl[CTL_EXPLAINED]) else None for i, k in enumerate(SN_STATS, 3)},
        }

    def stop(self) -> dict:
        """Stop with the trainer; an explainer that does not exit within ``explainer_timeout_s`` is killed and an
        error. Returns :meth:`stats`."""
        self.sh["ctl"][CTL_STOP] = 1
        self.proc.join(self.cfg.explainer_timeout_s)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(10)
            raise ExplainerError(
                f"DGS explainer (pid {self.proc.pid}) did not stop within "
                f"{self.cfg.explainer_timeout_s} s; killed"
            )
        if self.proc.exitcode != 0:
            raise ExplainerError(f"DGS explainer (pid {self.proc.pid}) exited with code {self.proc.exitcode}")
        return self.stats()
