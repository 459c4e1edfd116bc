"""Recipe configs checked in the launching process, before any rank starts (issue 33, items 4-6).

Every check names the key as it is written on the command line (``offload.backend``, ``lr``) and what is allowed.
Feature groups are parsed by the same ``from_dict`` the ranks use, so a config that passes here installs there.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import os
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

# timeout_s's upper bound: past ~8.6e13 s datetime.timedelta (the process group's timeout) overflows in every rank;
# a year is past any real job
MAX_TIMEOUT_S = 365 * 86400.0


class ConfigError(ValueError):
    """A recipe value is wrong; the message names the key, the value and what is allowed."""


def _kind(tp: Any) -> tuple[str, Any]:
    """(what the type is, in words, a checker) for the field types the recipe dataclasses use."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        choices = typing.get_args(tp)
        return f"one of {list(choices)}", lambda v: v in choices
    if origin in (typing.Union, types.UnionType):
        parts = [_kind(a) for a in typing.get_args(tp)]
        return " or ".join(p[0] for p in parts), lambda v: any(p[1](v) for p in parts)
    if tp is type(None):
        return "null", lambda v: v is None
    if tp is bool:
        return "true or false", lambda v: isinstance(v, bool)
    if tp is int:
        return "an integer", lambda v: isinstance(v, int) and not isinstance(v, bool)
    if tp is float:
        return (
            "a finite number",
            lambda v: isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v),
        )
    if tp is str:
        return "a string", lambda v: isinstance(v, str)
    if origin in (tuple, list) or tp in (tuple, list):
        args = [a for a in typing.get_args(tp) if a is not Ellipsis]
        item = _kind(args[0]) if args else ("anything", lambda v: True)
        return (
            f"a list of {item[0]}s" if args else "a list",
            lambda v: isinstance(v, list | tuple) and all(item[1](x) for x in v),
        )
    return "anything", lambda v: True  # dicts, Any: the owner's from_dict checks them


def check_types(cls: type, values: Mapping[str, Any], prefix: str = "") -> None:
    """Each value given for a field of dataclass ``cls`` has that field's type (a string for a number, true for an
    integer and 'no' for a flag are errors, not a TypeError in a rank or a feature silently on)."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name not in values:
            continue
        what, ok = _kind(hints[f.name])
        if not ok(values[f.name]):
            raise ConfigError(f"{prefix}{f.name}={values[f.name]!r} must be {what}")


def check_output_dir(path: Any, key: str) -> Path:
    """Create the folder and prove it takes a file (flowlane.launch.check_output_dir), so results are never lost."""
    from flowlane.launch import check_output_dir as probe

    try:
        return probe(path, key)
    except ValueError as e:
        raise ConfigError(str(e).replace(f"with {key} <folder>", f"with {key}=<folder>")) from None


def _as_config_error(fn: Any, *a: Any) -> Any:
    try:
        return fn(*a)
    except ConfigError:
        raise
    except (ValueError, TypeError) as e:
        raise ConfigError(str(e)) from None


def _options(group: str) -> list[str]:
    """The Hydra options that turn feature group ``group`` on: recipes/conf/<group>/*.yaml but ``none``."""
    return sorted(p.stem for p in (Path(__file__).parent / "conf" / group).glob("*.yaml") if p.stem != "none")


def check_group_off(group: str, values: Mapping[str, Any], selector: str, off: str) -> None:
    """A feature group that is off takes its selector only: any other key would be accepted and ignored (a run
    with ``+offload.min_bytes=5`` and offload off trained without offload and exited 0)."""
    extra = sorted(k for k in values if k != selector)
    if extra:
        keys = ", ".join(f"{group}.{k}={values[k]!r}" for k in extra)
        choose = " or ".join(f"{group}={o}" for o in _options(group))
        raise ConfigError(
            f"{keys} {'is' if len(extra) == 1 else 'are'} set but {group} is off ({group}.{selector}={off}): "
            f"choose {choose}"
        )


def check_offload(group: Mapping[str, Any]) -> None:
    from flowlane.offload.config import OffloadConfig

    if group.get("enabled", OffloadConfig.enabled) is False:
        check_group_off("offload", group, "enabled", "false")
        return
    d = {k: v for k, v in group.items() if k != "scope_classes"}
    check_types(OffloadConfig, d, "offload.")
    scopes = group.get("scope_classes")
    if scopes is not None and not (
        isinstance(scopes, list | tuple) and all(isinstance(s, str) for s in scopes)
    ):
        raise ConfigError(f"offload.scope_classes={scopes!r} must be a list of class names")
    cfg = _as_config_error(OffloadConfig.from_dict, d)
    if cfg.enabled:  # a typo must not become a new directory on some other disk
        _as_config_error(cfg.check_dirs)


def check_scheduler(group: Mapping[str, Any]) -> None:
    from megatron_plugin.hermod import HermodConfig

    if group.get("name", HermodConfig.name) == "none":
        check_group_off("scheduler", group, "name", "none")
        return
    check_types(HermodConfig, group, "scheduler.")
    _as_config_error(HermodConfig.from_dict, dict(group))


def check_dp_collective(group: Mapping[str, Any], scheduler: Mapping[str, Any] | None) -> None:
    name = group.get("name", "none")
    if name == "none":
        check_group_off("dp_collective", group, "name", "none")
        return
    if name not in ("aleph", "syndicate"):
        raise ConfigError(f"dp_collective={name!r} must be one of ['none', 'aleph', 'syndicate']")
    if (scheduler or {}).get("name", "none") != "none":
        raise ConfigError(
            f"dp_collective={name} and scheduler={scheduler['name']} both take Megatron's DP bucket reductions; "  # type: ignore[index]
            "use one"
        )
    if name == "aleph":
        from megatron_plugin.aleph import AlephMegatronConfig, config_from_group
    else:
        from megatron_plugin.syndicate import SyndicateMegatronConfig, config_from_group
    cls = AlephMegatronConfig if name == "aleph" else SyndicateMegatronConfig
    check_types(cls, {k: v for k, v in group.items() if k != "name"}, "dp_collective.")
    cfg = _as_config_error(config_from_group, dict(group))
    if name == "aleph" and not (cfg.bandwidth_gbps or cfg.clusters):
        raise ConfigError(
            "dp_collective=aleph needs dp_collective.bandwidth_gbps (one figure per DP rank) or "
            """dp_collective.clusters (e.g. dp_collective.clusters='"0,1"')"""
        )


def check_aleph_groups(group: Mapping[str, Any], recipe: Any) -> None:
    """ALEPH's plans against the data-parallel groups this recipe makes: the checks megatron_plugin.aleph makes in
    every rank at install (AlephMegatronConfig.plan, the expert plan, top='allreduce' with one group), here before
    any rank starts. Megatron-core folds expert parallelism into data parallelism: an expert-data-parallel group
    has data-parallel size / expert_parallel ranks (expert tensor-parallel size 1, which the MoE recipe needs)."""
    from megatron_plugin.aleph import config_from_group

    cfg = _as_config_error(config_from_group, dict(group))
    dp, ws = recipe.data_parallel, recipe.world_size
    groups = [
        (
            False,
            dp,
            f"world_size={ws} / (pipeline_parallel={recipe.pipeline_parallel} x "
            f"tensor_parallel={recipe.tensor_parallel})",
        )
    ]
    if recipe.num_moe_experts is not None:
        groups.append(
            (True, dp // recipe.expert_parallel, f"{dp} / expert_parallel={recipe.expert_parallel}")
        )
        if not cfg.has_expert_plan:
            raise ConfigError(
                f"dp_collective=aleph on a MoE model (num_moe_experts={recipe.num_moe_experts}) needs "
                "dp_collective.expert_bandwidth_gbps or dp_collective.expert_clusters for the experts' bucket "
                f"groups (expert-data-parallel groups of {groups[1][1]} ranks)"
            )
    elif cfg.has_expert_plan:
        raise ConfigError(
            "dp_collective.expert_bandwidth_gbps / dp_collective.expert_clusters are set but the model has no "
            "experts (num_moe_experts=null)"
        )
    for expert, n, why in groups:
        try:
            plan = cfg.plan(n, expert=expert)
        except ValueError as e:  # "aleph clusters='0,1,2' cover 3 ranks; the data-parallel group has 2"
            raise ConfigError(f"dp_collective.{str(e).removeprefix('aleph ')} ({why})") from None
        if plan.num_flows > 1 and cfg.top == "allreduce" and n != ws:
            kind = "expert-data-parallel" if expert else "data-parallel"
            raise ConfigError(
                f"dp_collective.top='allreduce' with a hierarchical plan needs a single {kind} group, but the "
                f"recipe has {ws // n} groups of {n} ranks ({why}): use dp_collective.top=ps"
            )


def check_gpt(cfg: Mapping[str, Any], feature_groups: tuple[str, ...]) -> Any:
    """The default/moe recipe: returns the validated :class:`recipes.gpt.GPTRecipe`."""
    from recipes.gpt import GPTRecipe

    # features is filled from the feature groups, never a key of its own (it was a TypeError in GPTRecipe)
    fields = {f.name for f in dataclasses.fields(GPTRecipe)} - {"features"}
    unknown = sorted(set(cfg) - fields - set(feature_groups) - {"job"})
    if unknown:
        raise ConfigError(f"unknown recipe field(s) {unknown}; allowed: {sorted(fields)}")
    values = {k: v for k, v in cfg.items() if k in fields}
    check_types(GPTRecipe, values)
    if cfg.get("offload"):
        check_offload(cfg["offload"])
    if cfg.get("scheduler"):
        check_scheduler(cfg["scheduler"])
    if cfg.get("dp_collective"):
        check_dp_collective(cfg["dp_collective"], cfg.get("scheduler"))
    recipe = GPTRecipe(**values, features={g: cfg[g] for g in feature_groups if g in cfg})
    _as_config_error(recipe.validate)
    if (cfg.get("dp_collective") or {}).get("name") == "aleph":
        check_aleph_groups(cfg["dp_collective"], recipe)
    check_launch_gpt(recipe)
    check_output_dir(recipe.output_dir, "output_dir")
    return recipe


def check_launch_gpt(recipe: Any) -> None:
    """An external launcher's environment (torchrun, srun) against the recipe: its world size is ``world_size``,
    its rendezvous is complete, each rank has a GPU for device=cuda (recipes.gpt.launch_mode)."""
    from recipes.gpt import launch_mode

    _as_config_error(launch_mode, recipe)


# the gnn_fullgraph recipe: top-level keys and their checks (recipes/conf/gnn_fullgraph.yaml)
_GNN_KEYS = (
    "job",
    "world_size",
    "epochs",
    "lr",
    "seed",
    "timeout_s",
    "output_dir",
    "data",
    "model",
    "flowlane",
)
_GNN_MODEL_KEYS = ("name", "hidden", "num_layers")
# data.name values dgl_plugin.datasets.load_graph takes besides synthetic, dgl-bin:<path> and ogbn-<name>: DGL's
# offline datasets (a dict inside load_graph; tests/test_validate_gnn_data.py pins this copy to it)
DGL_OFFLINE_DATASETS = ("bacommunity", "bashape", "karate", "treecycle")
# data.* keys besides the synthetic generator's fields (dgl_plugin.synthetic.SyntheticSpec, less its seed: the
# graph's seed is the recipe's)
_GNN_DATA_KEYS = ("name", "root", "part_config")


def check_gnn_data(data: Any) -> None:
    """gnn_fullgraph's ``data`` group as dgl_plugin.train reads it: the partitions of ``part_config``, or
    ``load_graph(name, seed=<the recipe's seed>, **rest)``, which passes ``rest`` to the generator (an unknown key
    was a TypeError, an unknown name a ValueError, in every rank). The partition count is checked with the launch
    (:func:`check_launch_gnn`), which knows the ranks and DistDGL's partitioning."""
    from dgl_plugin.synthetic import SyntheticSpec

    if not isinstance(data, Mapping):
        raise ConfigError(f"data={data!r} must be a group (data.name, data.num_nodes, ...)")
    spec = [f.name for f in dataclasses.fields(SyntheticSpec) if f.name != "seed"]
    allowed = [*_GNN_DATA_KEYS, *spec]
    unknown = sorted(set(data) - set(allowed))
    if unknown:
        why = " (the graph's seed is the recipe's seed)" if "seed" in unknown else ""
        raise ConfigError(f"unknown data key(s) {unknown}{why}; allowed: {allowed}")
    gen = {k: v for k, v in data.items() if k in spec}
    check_types(SyntheticSpec, gen, "data.")
    name, root, pc = data.get("name", "synthetic"), data.get("root"), data.get("part_config")
    for key, v in (("data.root", root), ("data.part_config", pc)):
        if v is not None and not isinstance(v, str):
            raise ConfigError(f"{key}={v!r} must be a string (a path) or null")
    forms = "'synthetic', 'dgl-bin:<path>', 'ogbn-<name>' (already on disk) or one of"
    if not (
        isinstance(name, str)
        and (name in ("synthetic", *DGL_OFFLINE_DATASETS) or name.startswith(("dgl-bin:", "ogbn-")))
    ):
        raise ConfigError(f"data.name={name!r} must be {forms} {list(DGL_OFFLINE_DATASETS)}")
    if pc is not None:
        if not os.path.isfile(pc):
            raise ConfigError(
                f"data.part_config={pc!r} is not a file (the JSON written by dgl.distributed.partition_graph)"
            )
        return  # each rank loads its partition: data.name and the generator are not used
    if root is not None and not name.startswith("ogbn-"):
        raise ConfigError(f"data.root={root!r} applies to data.name='ogbn-<name>' only; data.name={name!r}")
    if name == "synthetic":
        try:
            SyntheticSpec(**gen).validate()
        except ValueError as e:  # "synthetic graph: bad num_classes=1 (num_nodes=..., num_classes=1)"
            raise ConfigError(str(e).replace("bad ", "bad data.", 1)) from None
    elif name.startswith("dgl-bin:") and not os.path.isfile(name.split(":", 1)[1]):
        raise ConfigError(
            f"data.name={name!r}: no file at {name.split(':', 1)[1]!r} (a graph saved with dgl.save_graphs; "
            "nothing is downloaded)"
        )
    elif name.startswith("ogbn-"):
        base = root or os.environ.get("OGB_ROOT", "dataset")  # load_graph's lookup
        folder = os.path.join(base, name.replace("-", "_"))
        if not os.path.isdir(folder):
            raise ConfigError(
                f"data.name={name!r} is not on disk under {folder!r} (data.root, else $OGB_ROOT, else ./dataset): "
                "nothing is downloaded"
            )
        if importlib.util.find_spec("ogb") is None:
            raise ConfigError(f"data.name={name!r} needs the ogb package, which this Python does not have")


def partition_count(pc: str) -> int:
    """``num_parts`` of a dgl.distributed.partition_graph JSON."""
    try:
        with open(pc) as f:
            meta = json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(f"data.part_config={pc!r} cannot be read as a partition JSON: {e}") from None
    parts = meta.get("num_parts") if isinstance(meta, dict) else None
    if not isinstance(parts, int) or isinstance(parts, bool):
        raise ConfigError(
            f"data.part_config={pc!r} has no integer num_parts: not a JSON written by "
            "dgl.distributed.partition_graph"
        )
    return parts


def check_gnn(cfg: Mapping[str, Any]) -> None:
    from dgl_plugin.fullgraph import FullGraphConfig
    from dgl_plugin.models import MODELS

    unknown = sorted(set(cfg) - set(_GNN_KEYS))
    if unknown:
        raise ConfigError(f"unknown gnn_fullgraph key(s) {unknown}; allowed: {sorted(_GNN_KEYS)}")

    def integer(key: str, v: Any, low: int, why: str = "") -> None:
        if not (isinstance(v, int) and not isinstance(v, bool) and v >= low):
            raise ConfigError(f"{key}={v!r} must be an integer >= {low}{why}")

    def positive(key: str, v: Any) -> None:
        if not (isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) and v > 0):
            raise ConfigError(f"{key}={v!r} must be a number > 0")

    integer("world_size", cfg.get("world_size", 2), 1)
    integer("epochs", cfg.get("epochs", 20), 1)
    integer("seed", cfg.get("seed", 0), 0)
    positive("lr", cfg.get("lr", 0.01))
    positive("timeout_s", cfg.get("timeout_s", 1800))
    if cfg.get("timeout_s", 1800) > MAX_TIMEOUT_S:
        raise ConfigError(
            f"timeout_s={cfg['timeout_s']!r} must be > 0 and at most {MAX_TIMEOUT_S:.0f} seconds (a year)"
        )
    model = cfg.get("model") or {}
    if not isinstance(model, Mapping):
        raise ConfigError(f"model={model!r} must be a group of {list(_GNN_MODEL_KEYS)}")
    unknown = sorted(set(model) - set(_GNN_MODEL_KEYS))
    if unknown:
        raise ConfigError(f"unknown model key(s) {unknown}; allowed: {list(_GNN_MODEL_KEYS)}")
    if model.get("name", "sage") not in MODELS:
        raise ConfigError(f"model.name={model.get('name')!r} is not one of {sorted(MODELS)}")
    integer("model.hidden", model.get("hidden", 64), 1)
    integer("model.num_layers", model.get("num_layers", 2), 1)
    check_gnn_data(cfg.get("data") or {})
    fl = cfg.get("flowlane") or {}
    unknown = sorted(set(fl) - {"fullgraph"}) if isinstance(fl, Mapping) else ["<not a group>"]
    if unknown:
        raise ConfigError(f"unknown flowlane key(s) {unknown}; allowed: ['fullgraph']")
    fg = fl.get("fullgraph") or {}
    check_types(FullGraphConfig, fg, "flowlane.fullgraph.")
    _as_config_error(FullGraphConfig.from_dict, fg)
    if cfg.get("output_dir"):
        check_output_dir(cfg["output_dir"], "output_dir")


def check_launch_gnn(cfg: Mapping[str, Any]) -> tuple[dict[str, Any], Any]:
    """gnn_fullgraph's launch, local or external: (the config, with ``data.part_config`` taken from DistDGL's
    DGL_CONF_PATH where that launcher started the process, and its :class:`dgl_plugin.distdgl.DistDGLRole` or
    None). Checks, before any rank, server or connection: an external launcher's environment, world_size against
    the trainers it started, one trainer per line of DistDGL's ip_config; and, however the ranks start, the
    partition count against world_size (one partition per rank)."""
    from dgl_plugin.distdgl import (
        check_full_graph_trainers,
        check_trainers_per_machine,
        distdgl_role,
        host_slot,
    )
    from flowlane.launch_external import check_world, detect_launcher

    cfg = dict(cfg)
    role = _as_config_error(distdgl_role)
    if role is not None:
        data = dict(cfg.get("data") or {})
        pc = data.get("part_config")
        if pc is None:
            data["part_config"] = role.part_config
        elif os.path.realpath(pc) != os.path.realpath(role.part_config):
            raise ConfigError(
                f"data.part_config={pc!r} but DistDGL's launcher gave DGL_CONF_PATH="
                f"{role.part_config!r}: servers and trainers must read one partitioning"
            )
        cfg["data"] = data
        if role.role == "server":
            return cfg, role
    ext = _as_config_error(detect_launcher)
    if role is not None and ext is None:
        raise ConfigError(
            "DGL_ROLE=client without torchrun's variables (RANK, WORLD_SIZE, MASTER_ADDR...): "
            "DistDGL's launch.py starts trainers with python -m torch.distributed.run"
        )
    world = cfg.get("world_size", 2)
    if ext is not None:
        _as_config_error(check_world, ext, world, "world_size")
    pc = (cfg.get("data") or {}).get("part_config")
    parts = None if pc is None else partition_count(pc)
    if ext is not None and role is not None:
        _as_config_error(check_full_graph_trainers, role, world)
        _as_config_error(check_trainers_per_machine, role, ext.local_world_size, parts)
        _as_config_error(host_slot, role, os.environ)
    # local ranks too (no launcher): a 2-part partitioning with world_size=4 failed in all four ranks
    if parts is not None and parts != world:
        raise ConfigError(
            f"data.part_config={pc!r} has num_parts={parts} but world_size={world}: full-graph training needs one "
            f"partition per rank (world_size={parts}, or a partitioning into {world} parts)"
        )
    return cfg, role
