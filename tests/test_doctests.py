"""The examples in the public entry points' docstrings run, and print what they say (``doctest``).

Each package's ``__init__`` opens with the few lines a newcomer would type first; a renamed function or a changed
result fails here instead of misleading the reader."""

from __future__ import annotations

import doctest
import importlib

import pytest

# torch and the core only (no training framework); the llm lane has both
pytestmark = pytest.mark.llm

MODULES = (
    "flowlane.sim",
    "flowlane.hermod",
    "flowlane.plan",
    "flowlane.aleph",
    "flowlane.syndicate",
    "flowlane.dgs",
    "flowlane.offload",
    "flowlane.hector",
    "flowlane.direct",
)


@pytest.mark.parametrize("name", MODULES)
def test_the_entry_points_example_runs_as_written(name: str) -> None:
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0, f"{name} has no runnable example in its docstring"
    assert result.failed == 0, (
        f"{name}: {result.failed} of {result.attempted} example lines failed (printed above)"
    )
