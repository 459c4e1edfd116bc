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
# Hermod's pure model and the simulator import no framework and nothing in the gnn lane (DGL's plugin) uses them:
# run them once too (llm lane). The core modules the DGL plugin does use (plan, comm, launch, trace, topology) keep
# running in both lanes.
_ONCE_FILES = (
    "test_core_imports.py",
    "test_hermod_keys.py",
    "test_hermod_order.py",
    "test_hermod_matching.py",
    "test_hermod_bvn_c.py",
    "test_sim_alltoall.py",
    "test_sim_engine.py",
    "test_sim_hermod.py",
    "test_sim_waterfill_c.py",
    "test_sim_workloads.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.name in _WIRE_FILES:
            item.add_marker(pytest.mark.wire)
        if item.path.name in _ONCE_FILES:
            item.add_marker(pytest.mark.once)
