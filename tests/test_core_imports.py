"""The pure core imports alone, in any order, without torch: no import circle, nothing registered on import."""

from __future__ import annotations

import subprocess
import sys

import pytest

# each is imported first in a fresh interpreter, so a circle through it fails here (an import circle only bites when
# one particular module of it is entered first)
PURE = (
    "flowlane.policy",
    "flowlane.policies",
    "flowlane.hermod",
    "flowlane.hermod.order",
    "flowlane.hermod.wire",
    "flowlane.hermod.keys",
    "flowlane.hermod.policy",
    "flowlane.hermod.matching",
    "flowlane.wire_classes",
    "flowlane.sim",
    "flowlane.sim.cli",
    "flowlane.sim.collectives",
)

_BLOCK_TORCH = """
import sys
class _NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError(f"{name} is blocked: the pure core must not import it")
sys.meta_path.insert(0, _NoTorch())
"""


@pytest.mark.parametrize("module", PURE)
def test_module_imports_first_and_without_torch(module: str) -> None:
    code = _BLOCK_TORCH + f"import {module}\nassert 'torch' not in sys.modules\n"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr


def test_every_policy_builds_and_the_simulator_runs_without_torch() -> None:
    code = (
        _BLOCK_TORCH
        + """
from flowlane.policies import POLICIES, make_policy
from flowlane.policy import CoflowMeta
from flowlane.sim import SimConfig, Simulator
from flowlane.sim.workloads import build_workload
keys = {n: make_policy(n, layers_per_stage=4).priority(CoflowMeta("pp", microbatch=1, layer=2)) for n in sorted(POLICIES)}
topo, w = build_workload("qwen-moe-12l", 32, 10.0, num_microbatches=2, iterations=1)
t = Simulator(topo, SimConfig()).run(w, make_policy("hermod")).iteration_time
assert t > 0 and "torch" not in sys.modules
print(" ".join(sorted(keys)))
"""
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [
        "dp-first",
        "ep-first",
        "fifo",
        "hermod",
        "hermod-dscp",
        "hermod-nccl",
        "pp-first",
        "priority",
    ]
