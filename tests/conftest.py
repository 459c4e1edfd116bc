"""Shared pytest setup: lane markers and CPU defaults."""

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
os.environ.setdefault("DS_ACCELERATOR", "cpu")

# Multi-rank tests fork their ranks from flowlane.launch's fork server: it imports the frameworks once per pytest
# run instead of ~20 s of CPU per rank per test (names a lane's venv lacks are skipped by the server).
from flowlane.launch import preload  # noqa: E402

preload(
    "megatron.core.models.gpt.gpt_layer_specs",
    "megatron.core.distributed",
    "megatron.core.optimizer",
    "megatron.core.pipeline_parallel",
    "deepspeed",
    "dgl",
)

# Tests of the C net plugin need no Python framework: run them once (llm lane), not in both lanes.
_WIRE_FILES = ("test_nccl_net_plugin.py", "test_nccl_net_plugin_bench.py")
# Hermod's pure model and the simulator import no framework and nothing in the gnn lane (DGL's plugin) uses them:
# run them once too (llm lane); `make test-fast` is these.
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
    "test_sched_gate.py",
    "test_offload_budget.py",
    "test_docs_snippets.py",
    "test_sim_runtime_costs.py",
)


# Core modules that serve only the LLM side (Hermod's scheduler and wire classes, the offload, netem, the launcher's
# fault handling): llm lane only, marked `llm` (about 4.5 min of the gnn lane's time in CI). Most are multi-rank or
# torch-heavy, so not `once` (the edit loop's marker). The core the DGL plugin runs on under the gnn lane's torch (plan executor,
# comm + launch + trace, topology) keeps running in both lanes.
_LLM_SIDE_FILES = (
    "test_launch_faults.py",
    "test_sched_groups.py",
    "test_sched_runtime.py",
    "test_hermod_intra_real.py",
    "test_offload_core.py",
    "test_offload_bulk.py",
    "test_netem.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.name in _WIRE_FILES:
            item.add_marker(pytest.mark.wire)
        if item.path.name in _ONCE_FILES:
            item.add_marker(pytest.mark.once)
        if item.path.name in _LLM_SIDE_FILES:
            item.add_marker(pytest.mark.llm)


@pytest.fixture(scope="module")
def megatron_env():
    """Megatron-core's model-parallel state on one gloo rank in this process (an in-process store), for tests that
    build Megatron objects without collectives; torn down after the module."""
    import torch.distributed as dist

    from megatron_plugin import cpu_shim  # tests only; the plugin never imports it

    cpu_shim.apply()
    from megatron.core import parallel_state

    own = not dist.is_initialized()
    if own:  # one rank: an in-process store, no port to pick
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    yield
    parallel_state.destroy_model_parallel()
    if own:
        dist.destroy_process_group()
