"""flowlane: communication-efficient distributed training. Train with `flowlane-train`; these commands inspect the
machine and model what a cluster would do."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# sub-command -> (module with add_parser/run, one-line help). Only the chosen command's module is imported, so
# `flowlane --help` and `flowlane sim ...` never pay for torch.
COMMANDS: dict[str, tuple[str, str]] = {
    "doctor": ("flowlane.doctor", "show what this machine and environment (lane) can use"),
    "sim": (
        "flowlane.sim.cli",
        "flow-level training simulator: iteration time per scheduling policy (simulated)",
    ),
    "ssd-estimate": (
        "flowlane.offload.estimate",
        "activation bytes, write bandwidth and SSD lifespan (SSDTrain)",
    ),
    "syndicate-plan": (
        "flowlane.syndicate.profile",
        "a SYNDICATE plan JSON from a recorded FIFO iteration (syndicate_profile.json)",
    ),
}

EPILOG = (
    "Examples:\n"
    "  flowlane doctor\n"
    "  flowlane sim --workload gpt3-13b --gpus 32 --policy fifo,hermod\n"
    "  flowlane syndicate-plan outputs/run/syndicate_profile.json --out plan.json\n"
    "  flowlane <command> --help     options of one command, with their defaults"
)


def version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("flowlane")
    except PackageNotFoundError:  # a source tree that was never installed
        return "unknown (not installed)"


def _command(argv: Sequence[str]) -> str | None:
    return next((a for a in argv if not a.startswith("-")), None)


def build_parser(argv: Sequence[str]) -> tuple[argparse.ArgumentParser, dict[str, object]]:
    """The parser for ``argv``: the command it names is built by its module, the others by name only."""
    parser = argparse.ArgumentParser(
        prog="flowlane",
        description=__doc__,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"flowlane {version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    chosen = _command(argv)
    mods: dict[str, object] = {}
    for name, (path, help_) in COMMANDS.items():
        if name != chosen:
            sub.add_parser(name, help=help_)
            continue
        try:
            mods[name] = importlib.import_module(path)
        except ModuleNotFoundError as e:
            if e.name is None or path.startswith(e.name):
                raise
            parser.error(
                f"'{name}' needs the package {e.name!r}, which this environment does not have "
                f"(python: {sys.executable}); use the lane that has it, e.g. .venv-llm/bin/flowlane"
            )
        mods[name].add_parser(sub)  # type: ignore[attr-defined]
    return parser, mods


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser, mods = build_parser(argv)
    args = parser.parse_args(argv)
    try:
        return int(mods[args.command].run(args) or 0)  # type: ignore[attr-defined]
    except SystemExit as e:
        if not isinstance(e.code, str):
            raise
        # a command refusing its input after parsing (SystemExit("<what to give>")): a usage error, argparse's code
        print(f"flowlane {args.command}: error: {e.code.removeprefix(args.command + ': ')}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
