"""Megatron-LM launch flags, added through Megatron's ``extra_args_provider`` mechanism.

    from megatron.training import pretrain
    from megatron_plugin.args import add_flowlane_args
    pretrain(..., extra_args_provider=add_flowlane_args)

Each feature module (``megatron_plugin.<feature>``) contributes an argument group through ``add_args(parser)``;
this module only collects them, so features stay independent of each other.
"""

from __future__ import annotations

import argparse
import importlib

# feature modules that contribute flags; each must define add_args(parser: argparse.ArgumentParser) -> None
FEATURES: tuple[str, ...] = (
    "megatron_plugin.hermod",
    "megatron_plugin.ssd_offload",
    "megatron_plugin.aleph",
    "megatron_plugin.syndicate",
)


def add_flowlane_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    for path in FEATURES:
        try:
            mod = importlib.import_module(path)
        except ModuleNotFoundError as e:  # a feature not built yet contributes no flags
            if e.name != path:
                raise
            continue
        mod.add_args(parser)
    return parser
