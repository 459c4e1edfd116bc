"""megatron_plugin.dp_collective's process group where Megatron-LM puts it: a world initialised with a bound
``device_id`` (Megatron-LM binds each rank's GPU). ``new_group`` then asks the new group's per-device backend whether
it splits; the H200 run of tests/gpu/megatron_dp_nccl.py failed there ("No backend type associated with device type
cuda"). The same question is asked of a CPU-bound gloo world, so CI checks it without a GPU, in a subprocess of its
own (one rank; the world is process-global)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.llm

SCRIPT = textwrap.dedent(
    """
    import os, socket, torch, torch.distributed as dist
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=0, world_size=1, device_id=torch.device("cpu", 0))
    from megatron_plugin.dp_collective import DPCollective

    seen = []

    class Component:
        def all_reduce(self, tensors):
            seen.append([t.clone() for t in tensors])
            for t in tensors:
                t.mul_(2)  # a visible effect: the group's all-reduce ran the component

            class Done:
                def wait(self):
                    return True

            return Done()

    dp = DPCollective(dist.group.WORLD, lambda group, ranks: Component(), "test")
    a, b = torch.ones(3), torch.arange(4.0)
    with dist._coalescing_manager(dp.group, async_ops=True) as cm:  # as Megatron's start_grad_sync issues them
        dist.all_reduce(a, group=dp.group, async_op=True)
        dist.all_reduce(b, group=dp.group, async_op=True)
    cm.wait()
    assert dp.calls == 1 and len(seen) == 1 and len(seen[0]) == 2, (dp.calls, seen)
    assert a.tolist() == [2.0] * 3 and b.tolist() == [0.0, 2.0, 4.0, 6.0]
    dist.destroy_process_group()
    print("OK")
    """
)


def test_the_group_is_made_and_carries_a_coalesced_all_reduce_in_a_device_bound_world() -> None:
    root = Path(__file__).resolve().parents[1]
    r = subprocess.run([sys.executable, "-c", SCRIPT], cwd=root, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip().endswith("OK"), r.stdout + r.stderr


def test_a_collective_whose_blocks_do_not_fit_the_group_is_refused_naming_it() -> None:
    """Megatron's reduce-scatter input and all-gather output hold one block per rank; anything else is an error
    naming the op, its index and the sizes (no process group needed: the check runs before the component)."""
    torch = pytest.importorskip("torch")
    from megatron_plugin.dp_collective import _DPGroup

    g = _DPGroup(0, 2, component=None, ranks=(0, 1))  # type: ignore[arg-type]
    g._check_blocks("reduce-scatter", [torch.zeros(4)], "input", [torch.zeros(2)], "output")  # fits
    with pytest.raises(
        RuntimeError, match=r"reduce-scatter 1 has 5 input elements, not 2 x 2 \(the output's\)"
    ):
        g._check_blocks(
            "reduce-scatter", [torch.zeros(4), torch.zeros(5)], "input", [torch.zeros(2)] * 2, "output"
        )
    with pytest.raises(RuntimeError, match=r"all-gather 0 has 3 output elements, not 2 x 2 \(the input's\)"):
        g._check_blocks("all-gather", [torch.zeros(3)], "output", [torch.zeros(2)], "input")
