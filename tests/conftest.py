"""Shared pytest setup: lane markers and CPU defaults."""

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
os.environ.setdefault("DS_ACCELERATOR", "cpu")

# Tests of the C net plugin need no Python framework: run them once (llm lane), not in both lanes.
_WIRE_FILES = ("test_nccl_net_plugin.py",)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.name in _WIRE_FILES:
            item.add_marker(pytest.mark.wire)
