"""The SYNDICATE enforcer's FIFO fallback is logged, not only recorded: a plan that never fits what is submitted would
otherwise run as FIFO every iteration unnoticed. One gloo rank in a subprocess of its own (the world is
process-global)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.once

SCRIPT = textwrap.dedent(
    """
    import logging, os, socket, torch, torch.distributed as dist
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    from torch.distributed.distributed_c10d import _get_default_store
    from flowlane.syndicate.cost import Option
    from flowlane.syndicate.enforcer import Enforcer, EnforcerConfig
    from flowlane.syndicate.plan import PlanOp, SyndicatePlan

    got = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: got.append(record.getMessage())
    logging.getLogger("flowlane.syndicate").addHandler(handler)
    plan = SyndicatePlan(1, (PlanOp("a", "all_reduce", 8, "float32", 1, Option("S", "ring", 1)),), ((0, 0),))
    e = Enforcer({"S": dist.group.WORLD}, _get_default_store(), 0, 1, EnforcerConfig("plan", 1, 30.0))
    e.install(plan)
    for it in range(3):
        t = torch.ones(4)  # not the plan's 8 elements: every iteration falls back, for one reason
        e.all_reduce(t).wait()
        assert t.tolist() == [1.0] * 4
        e.step()
    assert [ev[:2] for ev in e.events] == [(0, "fallback"), (1, "fallback"), (2, "fallback")], e.events
    assert len(got) == 1, got  # once per reason
    assert "iteration 0 runs as FIFO, not the plan: submission 0 is (all_reduce, 4, float32)" in got[0], got
    dist.destroy_process_group()
    print("OK")
    """
)


def test_a_fallback_to_fifo_is_logged_once_per_reason() -> None:
    root = Path(__file__).resolve().parents[1]
    r = subprocess.run([sys.executable, "-c", SCRIPT], cwd=root, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip().endswith("OK"), r.stdout + r.stderr
