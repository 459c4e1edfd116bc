"""The `flowlane` command. Each sub-command lives in its own module with ``add_parser`` and ``run``."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# sub-command -> module; a module is imported only when its command runs (or to build --help)
COMMANDS: dict[str, str] = {
    "doctor": "flowlane.doctor",
    "sim": "flowlane.sim.cli",
    "ssd-estimate": "flowlane.offload.estimate",
}


def _available() -> dict[str, object]:
    mods = {}
    for name, path in COMMANDS.items():
        try:
            mods[name] = importlib.import_module(path)
        except ModuleNotFoundError as e:
            if e.name is None or not path.startswith(e.name):
                raise
    return mods


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="flowlane", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    mods = _available()
    for mod in mods.values():
        mod.add_parser(sub)  # type: ignore[attr-defined]
    args = parser.parse_args(argv)
    return int(mods[args.command].run(args) or 0)  # type: ignore[attr-defined]


if __name__ == "__main__":
    sys.exit(main())
