"""`flowlane-train`: the Hydra entry point. A recipe's ``job`` field picks what runs.

    flowlane-train                          # default recipe: tiny GPT, PP2 x DP2 on 4 CPU ranks
    flowlane-train scheduler=hermod         # + Hermod coflow scheduling
    flowlane-train offload=ssd              # + SSDTrain activation offloading
    flowlane-train --config-name gnn_fullgraph
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any

import hydra
from omegaconf import DictConfig, OmegaConf

# job -> "module:function" taking the resolved config dict and returning metrics
JOBS: dict[str, str] = {
    "gpt": "recipes.train:run_gpt",
    "gnn_fullgraph": "dgl_plugin.train:run_fullgraph",
}
FEATURE_GROUPS = ("scheduler", "offload")


def run_gpt(cfg: dict[str, Any]) -> dict[str, Any]:
    from recipes.gpt import GPTRecipe, run

    fields = {f.name for f in dataclasses.fields(GPTRecipe)}
    unknown = sorted(set(cfg) - fields - set(FEATURE_GROUPS) - {"job"})
    if unknown:
        raise ValueError(f"unknown recipe field(s) {unknown}; allowed: {sorted(fields - {'features'})}")
    recipe = GPTRecipe(**{k: v for k, v in cfg.items() if k in fields},
                       features={g: cfg[g] for g in FEATURE_GROUPS if g in cfg})
    return run(recipe)


def run_job(cfg: DictConfig | dict[str, Any]) -> dict[str, Any]:
    plain = OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else dict(cfg)
    job = plain.get("job")
    if job not in JOBS:
        raise ValueError(f"recipe job {job!r} is not one of {sorted(JOBS)}")
    module, func = JOBS[job].split(":")
    return getattr(importlib.import_module(module), func)(plain)


@hydra.main(config_path="conf", config_name="default", version_base="1.3")
def main(cfg: DictConfig) -> None:
    run_job(cfg)


if __name__ == "__main__":
    main()
