"""`flowlane-train`: the Hydra entry point. A recipe's ``job`` field picks what runs.

    flowlane-train                          # default recipe: tiny GPT, PP2 x DP2 on 4 CPU ranks
    flowlane-train scheduler=hermod         # + Hermod coflow scheduling
    flowlane-train offload=ssd              # + SSDTrain activation offloading
    flowlane-train offload=pinned           # + offload to pinned host memory with the byte budget (GPU runs)
    flowlane-train dp_collective=aleph dp_collective.clusters='"0,1"'   # + ALEPH on the DP reduction
    flowlane-train --config-name gnn_fullgraph

Under torchrun or srun (one process per rank, started by them) each process runs its own rank only and rank 0
writes the run's outputs; see docs/train.md for the commands (one node, several nodes, a Slurm job script).
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import sys
import warnings
from collections.abc import MutableMapping
from typing import Any

import hydra
from omegaconf import DictConfig, OmegaConf

from recipes.validate import ConfigError, check_gnn, check_gpt

# job -> "module:function" taking the resolved config dict and returning metrics
JOBS: dict[str, str] = {
    "gpt": "recipes.train:run_gpt",
    "gnn_fullgraph": "recipes.train:run_gnn",
    "gnn_dgs": "dgl_plugin.dgs_train:run_dgs",
}
FEATURE_GROUPS = ("scheduler", "offload", "dp_collective")
# job -> (the framework it runs on, the lane that has it): one environment cannot hold both (DESIGN, "two lanes")
LANES: dict[str, tuple[str, str]] = {
    "gpt": ("megatron.core", "llm"),
    "gnn_fullgraph": ("dgl", "gnn"),
    "gnn_dgs": ("dgl", "gnn"),
}


# Third-party notices every CPU run prints once per rank and module (no Transformer Engine or Apex on CPU; a
# megatron-core deprecation raised by its own defaults): hidden unless FLOWLANE_VERBOSE=1. Each entry is the start
# of the message (PYTHONWARNINGS syntax: no ':' or ',').
KNOWN_NOISE = (
    "Transformer Engine and Apex are not installed",
    "Apex is not installed",
    "full scope is deprecated",
)


def quiet_known_warnings(env: MutableMapping[str, str]) -> None:
    """Filter KNOWN_NOISE here and, through PYTHONWARNINGS in ``env``, in every rank started from it."""
    if env.get("FLOWLANE_VERBOSE", "") not in ("", "0"):
        return
    for m in KNOWN_NOISE:
        warnings.filterwarnings("ignore", message=m, category=UserWarning)
    filters = [f"ignore:{m}:UserWarning" for m in KNOWN_NOISE]
    env["PYTHONWARNINGS"] = ",".join([w for w in (env.get("PYTHONWARNINGS"), *filters) if w])


def check_dgs(cfg: dict[str, Any]) -> None:
    from dgl_plugin.dgs_train import check_config

    try:
        check_config(cfg)
    except ValueError as e:
        raise ConfigError(str(e)) from None


# job -> its parent-side check (every key, feature group and the output folder, before any rank starts)
CHECKS = {"gnn_fullgraph": check_gnn, "gnn_dgs": check_dgs}


def feature_lines(cfg: dict[str, Any], metrics: dict[str, Any]) -> list[str]:
    """What was on, and what did not go as configured (offload writes that fell back to memory), for the summary."""
    on = []
    sched = cfg.get("scheduler") or {}
    if sched.get("name", "none") != "none":
        on.append(f"scheduler={sched['name']} (ep_algorithm={sched.get('ep_algorithm', 'bvn')})")
    dp = cfg.get("dp_collective") or {}
    if dp.get("name", "none") != "none":
        on.append(f"dp_collective={dp['name']}")
    off = cfg.get("offload") or {}
    if off.get("enabled", False):
        backend = off.get("backend", "posix")
        if backend in ("pinned_cpu", "null"):  # host memory, or accounting only: no files, so no folder
            on.append(f"offload={backend}")
        else:
            dirs = ", ".join(off.get("dirs") or []) or "system temp folder"
            on.append(f"offload={backend} ({dirs})")
    lines = [f"features: {'; '.join(on) if on else 'none'}"]
    stats = [
        r["feature_stats"]["SSDOffload"]
        for r in metrics.get("per_rank", [])
        if "SSDOffload" in r.get("feature_stats", {})
    ]
    fallbacks = sum(s.get("fallbacks", 0) for s in stats)
    if fallbacks:
        errors = sum(s.get("io_errors", 0) for s in stats)
        lines.append(
            f"warning: {fallbacks:,} offload writes fell back to memory ({errors:,} I/O errors, e.g. a full "
            "disk; offload.on_io_error=raise makes them errors)"
        )
    return lines


def run_gpt(cfg: dict[str, Any]) -> dict[str, Any]:
    from recipes.gpt import run

    metrics = run(check_gpt(cfg, FEATURE_GROUPS))
    if metrics:  # under torchrun/srun only rank 0 reports
        for line in feature_lines(cfg, metrics):
            print(line)
    return metrics


def run_gnn(cfg: dict[str, Any]) -> dict[str, Any]:
    """gnn_fullgraph: local ranks; this process's rank under torchrun/srun; or, under DistDGL's launcher, a graph
    server (serves until the trainers finish) or a trainer (connects to the servers, then trains its partition)."""
    from dgl_plugin import distdgl
    from dgl_plugin.train import run_fullgraph
    from recipes.validate import check_launch_gnn

    cfg, role = check_launch_gnn(cfg)
    if role is not None and role.role == "server":
        distdgl.serve(role)
        return {}
    if role is not None:
        slot = distdgl.host_slot(role, os.environ)
        distdgl.connect(role)
        if slot is not None:  # a host listed once per trainer: each its own GPU (torchrun gave them all 0)
            os.environ.update(LOCAL_RANK=str(slot[0]), LOCAL_WORLD_SIZE=str(slot[1]))
    return run_fullgraph(cfg)


def check_lane(job: str) -> None:
    """The job's framework is in this Python, or a :class:`ConfigError` names the lane to run it from (a gnn recipe
    in the llm lane was a ModuleNotFoundError in Hydra's traceback; the GPT recipe in the gnn lane started 4 ranks
    that each failed on ``import megatron``)."""
    module, lane = LANES[job]
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a missing parent package ("megatron" of megatron.core)
        found = False
    if not found:
        how = "" if job == "gpt" else f" --config-name {job}"
        raise ConfigError(
            f"recipe job {job!r} needs {module.split('.')[0]}, which this Python ({sys.executable}) does not have: "
            f"run it from the {lane} lane, .venv-{lane}/bin/flowlane-train{how} (make train picks the lane)"
        )


def run_job(cfg: DictConfig | dict[str, Any]) -> dict[str, Any]:
    """Check the whole config in this process (a :class:`ConfigError` names the key), then run the job."""
    plain = OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else dict(cfg)
    job = plain.get("job")
    if job not in JOBS:
        raise ConfigError(f"recipe job {job!r} is not one of {sorted(JOBS)}")
    check_lane(job)
    if job in CHECKS:
        CHECKS[job](plain)
    module, func = JOBS[job].split(":")
    return getattr(importlib.import_module(module), func)(plain)


def _exit_code(e: BaseException) -> int:
    """Print a config or launch error as one readable message (no traceback: the ranks' tracebacks are in it)."""
    from flowlane.launch import LaunchInterrupted

    print(f"flowlane-train: {'error: ' if isinstance(e, ConfigError) else ''}{e}", file=sys.stderr)
    if isinstance(e, LaunchInterrupted):
        return 128 + e.signum
    return 2 if isinstance(e, ConfigError) else 1


@hydra.main(config_path="conf", config_name="default", version_base="1.3")
def _hydra_main(cfg: DictConfig) -> None:
    from flowlane.launch import LaunchError

    log = logging.getLogger("flowlane")
    if not log.handlers:  # the launcher's start-up progress ("ranks ready: 3/4") goes to stderr
        h = logging.StreamHandler()
        h.setFormatter(logging.Formatter("flowlane: %(message)s"))
        log.addHandler(h)
        log.setLevel(logging.INFO)
        log.propagate = False
    quiet_known_warnings(os.environ)
    if os.environ.get("FLOWLANE_VERBOSE", "") in ("", "0"):
        # Hydra sets INFO on the root logger of this process; under torchrun/srun it is also a rank, and
        # Megatron-core would log every parameter name (the local launcher's ranks never had that logging)
        logging.getLogger("megatron").setLevel(logging.WARNING)
    try:
        run_job(cfg)
    except (ConfigError, LaunchError) as e:
        sys.exit(_exit_code(e))


def rank_overrides(argv: list[str], env: MutableMapping[str, str]) -> list[str]:
    """Hydra overrides for one process of an externally launched run: every rank but 0 keeps out of Hydra's run
    folder (no .hydra copy, no log file), so a run has one output folder however many ranks it has. Only the
    rank number is read here; the launcher's whole environment is checked by the job, before any work."""
    rank = env.get("RANK", env.get("SLURM_PROCID") if env.get("SLURM_STEP_ID") is not None else None)
    if rank in (None, "0") or any(a.startswith(("hydra.output_subdir=", "hydra/job_logging=")) for a in argv):
        return []
    return ["hydra.output_subdir=null", "hydra/job_logging=disabled", "hydra.run.dir=."]


def main() -> None:
    """The ``flowlane-train`` command."""
    sys.argv += rank_overrides(sys.argv[1:], os.environ)
    _hydra_main()


if __name__ == "__main__":
    main()
