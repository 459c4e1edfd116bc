"""The Hydra config groups that mirror a config dataclass, generated from it (issue 29 item 5): a field is written
once, with its docstring, and its YAML follows.

    python -m recipes.mirrors           # rewrite the generated files
    python -m recipes.mirrors --check   # exit 1 naming each file that differs from its dataclass (tests run this)

The default recipe (recipes/conf/default.yaml) is generated from recipes.gpt.GPTRecipe the same way; its Hydra
``defaults:`` list and ``job`` key are the only lines written here.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

from flowlane.configs import yaml_mirror

CONF = Path(__file__).resolve().parent / "conf"


def _hermod() -> str:
    from megatron_plugin.hermod import HermodConfig

    return yaml_mirror(
        HermodConfig,
        "Hermod coflow scheduling (seed 000 ch.5). Generated from megatron_plugin.hermod.HermodConfig by\n"
        "`python -m recipes.mirrors`: edit the dataclass, not this file. Select with `scheduler=hermod`.",
    )


def _ssd() -> str:
    from flowlane.offload import OffloadConfig

    return yaml_mirror(
        OffloadConfig,
        "SSDTrain activation offloading (seed 003 ch.5). Generated from flowlane.offload.OffloadConfig by\n"
        "`python -m recipes.mirrors`: edit the dataclass, not this file. Select with `offload=ssd`; the train loop\n"
        "passes this group to megatron_plugin.ssd_offload.install_from_config(cfg, model). The recipe offloads CPU\n"
        "tensors too (the dataclass default follows the thesis, which skips them), so CPU runs offload.",
        {"offload_cpu_tensors": True},
    )


def _aleph() -> str:
    from megatron_plugin.aleph import AlephMegatronConfig

    return yaml_mirror(
        AlephMegatronConfig,
        "ALEPH hierarchical aggregation on Megatron-core's DP reduction (seed 002). Generated from\n"
        "megatron_plugin.aleph.AlephMegatronConfig by `python -m recipes.mirrors`: edit the dataclass, not this file.\n"
        "Select with `dp_collective=aleph` and give the plan: dp_collective.clusters='\"0,1\"' (or bandwidth_gbps).\n"
        "The recipe's top is the PS tree, which runs with several DP groups (the default recipe has one per stage).",
        {"top": "ps"},
        preamble="name: aleph",
    )


def _syndicate() -> str:
    from megatron_plugin.syndicate import SyndicateMegatronConfig

    return yaml_mirror(
        SyndicateMegatronConfig,
        "SYNDICATE motifs and launch order on Megatron-core's DP reduction (seed 004). Generated from\n"
        "megatron_plugin.syndicate.SyndicateMegatronConfig by `python -m recipes.mirrors`: edit the dataclass, not\n"
        "this file. Select with `dp_collective=syndicate`; the recipe starts in FIFO mode (every op whole; it writes\n"
        "output_dir/syndicate_profile[_stage<pp>].json), `flowlane syndicate-plan <profile>` makes a plan from it, and\n"
        "dp_collective.mode=plan 'dp_collective.plan=\"<plan JSON>\"' enforces it (docs/syndicate.md).",
        {"mode": "fifo"},
        preamble="name: syndicate",
    )


def _default() -> str:
    from recipes.gpt import GPTRecipe

    return yaml_mirror(
        GPTRecipe,
        "Default recipe: a tiny GPT built with Megatron-core, pipeline 2 x data 2 on 4 CPU ranks, synthetic tokens.\n"
        "Generated from recipes.gpt.GPTRecipe by `python -m recipes.mirrors`: edit the dataclass, not this file.\n"
        "Feature groups: scheduler=none|hermod, offload=none|ssd|pinned, dp_collective=none|aleph|syndicate.",
        preamble="defaults:\n  - scheduler: none\n  - offload: none\n  - dp_collective: none\n  - _self_\n\njob: gpt",
        skip=("features",),
    )


#: generated file (relative to recipes/conf) -> its text
MIRRORS: dict[str, Callable[[], str]] = {
    "default.yaml": _default,
    "scheduler/hermod.yaml": _hermod,
    "offload/ssd.yaml": _ssd,
    "dp_collective/aleph.yaml": _aleph,
    "dp_collective/syndicate.yaml": _syndicate,
}


def stale() -> list[str]:
    """The generated files whose text differs from what their dataclass gives now."""
    return [name for name, make in MIRRORS.items() if (CONF / name).read_text() != make()]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m recipes.mirrors", description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="exit 1 if a generated file differs; write nothing")
    args = p.parse_args(argv)
    if args.check:
        names = stale()
        for name in names:
            print(f"recipes/conf/{name} differs from its dataclass: run `python -m recipes.mirrors`")
        return 1 if names else 0
    for name, make in MIRRORS.items():
        path = CONF / name
        tmp = path.with_suffix(".yaml.tmp")
        tmp.write_text(make())
        tmp.replace(path)
        print(f"wrote recipes/conf/{name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
