"""The DGL config option ``flowlane.dgs`` (seed 000 ch. 3; digest 000-dgs-g3.md A2.11 defaults, A6 decisions)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Literal

from flowlane.dgs.sampling import SN_TRANSFORMS

SAMPLERS = ("uniform", "labor")


@dataclass(frozen=True)
class DGSConfig:
    """Explanation-guided node + feature sampling. ``node_sampling`` / ``feature_sampling`` off give the seed's
    NS-only / FS-only ablations (Table 3.3); both off is the conventional sampler with flowlane's byte counting."""

    node_sampling: bool = True
    """Draw remote neighbours by the explainer's node importance 𝒮𝒩 with the ε quota shift (Alg. 1 l. 9-10)."""
    feature_sampling: bool = True
    """Pull only the top ``n_f`` fraction of feature columns (by 𝒮ℱ) for remote rows; the rest are zero-filled."""
    n_f: float = 0.85
    """Fraction of feature dimensions pulled for remote rows (seed default 0.85; flat accuracy down to 0.7)."""
    epsilon: float = 0.1
    """Fraction of each seed's fanout moved from the remote quota to the local one (A6 #9 quota scheme; seed: 0-0.1)."""
    t_ex: int = 30
    """Iterations between model snapshots to the explainer (seed default 30)."""
    base_sampler: Literal["uniform", "labor"] = "uniform"
    """How picks are drawn inside each quota: weighted without replacement (uniform when no masks yet), or LABOR-0's
    shared per-vertex variates (Balin & Catalyurek, NeurIPS'23), which DistGraph lacks in DGL 2.1, with LABOR's scale
    solved so the expected count is the quota (:func:`flowlane.dgs.labor_inclusion`)."""
    prob_floor: float = 1e-6
    """Added to every node probability so a near-zero mask never starves a node (A6 #8)."""
    sn_transform: Literal["sigmoid", "minmax"] = "sigmoid"
    """Node mask to sampling weight (A6 #8, "option for temperature or normalisation"): ``sigmoid`` is the mask value
    σ(M) itself (the seed's); ``minmax`` rescales each explanation's 𝒮𝒩 to [0, 1] by its min and max, so the ranking
    drives the picks even when the mask values sit close together (the explainer's spread is in its stats,
    ``last_sn_rel_spread``). ``minmax`` gives the least important remote node only ``prob_floor``."""
    explainer_epochs: int = 50
    """Most mask-training epochs per explanation (seed 𝒯_E = 50)."""
    explainer_min_epochs: int = 25
    """Epochs before the ℒ test applies (A6 #7 decision: an untrained mask usually matches the target already,
    measured fidelity 0.002 at epoch 1, and would stop before learning anything)."""
    explainer_lr: float = 0.01
    """Adam learning rate of the mask parameters (DGL GNNExplainer's default)."""
    loss_threshold: float = 0.01
    """Early stop when the fidelity term (KL of the pooled target vs the masked prediction) is at most this (seed ℒ;
    applied to fidelity only, A6 #7)."""
    alpha1: float = 0.005
    """Node-mask size penalty (DGL GNNExplainer default)."""
    alpha2: float = 1.0
    """Node-mask entropy penalty (DGL GNNExplainer default)."""
    beta1: float = 1.0
    """Feature-mask size penalty, on the mean mask value (DGL GNNExplainer default)."""
    beta2: float = 0.1
    """Feature-mask entropy penalty (DGL GNNExplainer default)."""
    explainer_timeout_s: float = 300.0
    """How long the trainer waits for the explainer (a synchronous explanation, or the stop at the end) before it
    is an error; it covers the process's start (importing torch + DGL takes tens of seconds on a busy host)."""
    synchronous: bool = False
    """Wait for each snapshot's masks before the next iteration: reproducible runs (tests, benchmarks). The seed's
    explainer runs asynchronously (False)."""
    explainer_threads: int = 1
    """torch threads in the explainer process (the seed runs it on spare CPU cores)."""

    def validate(self) -> None:
        def bad(name: str, value: Any, why: str) -> None:
            raise ValueError(f"flowlane.dgs: bad {name}={value!r}: {why}")

        for name in ("node_sampling", "feature_sampling", "synchronous"):
            if not isinstance(getattr(self, name), bool):
                bad(name, getattr(self, name), "must be true or false")
        for name in (
            "n_f",
            "epsilon",
            "prob_floor",
            "explainer_lr",
            "loss_threshold",
            "alpha1",
            "alpha2",
            "beta1",
            "beta2",
            "explainer_timeout_s",
        ):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
                bad(name, v, "must be a finite number")
        if not 0.0 < self.n_f <= 1.0:
            bad("n_f", self.n_f, "must be in (0, 1] (fraction of feature dimensions kept)")
        if not 0.0 <= self.epsilon <= 1.0:
            bad(
                "epsilon",
                self.epsilon,
                "must be in [0, 1] (fraction of the fanout moved to local; seed 0-0.1)",
            )
        for name in ("t_ex", "explainer_epochs", "explainer_threads"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                bad(name, v, "must be an integer >= 1")
        v = self.explainer_min_epochs
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= self.explainer_epochs:
            bad(
                "explainer_min_epochs",
                v,
                f"must be an integer in [0, explainer_epochs={self.explainer_epochs}]",
            )
        if self.base_sampler not in SAMPLERS:
            bad("base_sampler", self.base_sampler, f"choose one of {list(SAMPLERS)}")
        if self.sn_transform not in SN_TRANSFORMS:
            bad("sn_transform", self.sn_transform, f"choose one of {list(SN_TRANSFORMS)}")
        if not 0.0 < self.prob_floor < 1.0:
            bad("prob_floor", self.prob_floor, "must be in (0, 1)")
        for name in ("explainer_lr", "explainer_timeout_s"):
            if not getattr(self, name) > 0:
                bad(name, getattr(self, name), "must be > 0")
        if (
            self.explainer_timeout_s > 365 * 86400.0
        ):  # a join() timeout past ~8.6e13 s overflows; a year is plenty
            bad("explainer_timeout_s", self.explainer_timeout_s, "must be at most 31536000 seconds (a year)")
        for name in ("loss_threshold", "alpha1", "alpha2", "beta1", "beta2"):
            if getattr(self, name) < 0:
                bad(name, getattr(self, name), "must be >= 0")

    @property
    def needs_explainer(self) -> bool:
        return self.node_sampling or self.feature_sampling

    @classmethod
    def from_dict(cls, d: dict | None) -> DGSConfig:
        """Build and validate from a recipe section; unknown keys are rejected by name."""
        d = dict(d or {})
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"flowlane.dgs: unknown option(s) {unknown}; known: {sorted(known)}")
        cfg = cls(**d)
        cfg.validate()
        return cfg
