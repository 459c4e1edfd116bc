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
# Run once too (llm lane): Hermod's pure model and the simulator (no framework; the DGL plugin does not use them),
# and the core modules only the LLM side uses (Hermod's scheduler and wire classes, the offload, netem, launch
# faults: about 4.5 min of the gnn lane's time in CI). The core the DGL plugin runs on under the gnn lane's torch
# (plan executor, comm + launch + trace, topology) keeps running in both lanes.
_ONCE_FILES = (
    "test_launch_faults.py",
    "test_sched_groups.py",
    "test_sched_runtime.py",
    "test_sched_gate.py",
    "test_hermod_intra_real.py",
    "test_offload_core.py",
    "test_offload_bulk.py",
    "test_offload_budget.py",
    "test_netem.py",
    "test_sim_runtime_costs.py",
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
