"""DGS's explainer process outlives nobody (issue 35): when its trainer dies without stopping it (SIGKILL: no
``finally``, no ``atexit``), the explainer notices that its parent changed and exits by itself. A subprocess plays
the trainer, because the explainer watches its own parent's pid and pytest must not be that parent."""

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.gnn
pytest.importorskip("dgl")

ROOT = Path(__file__).resolve().parent.parent

# The trainer: start one explainer, wait until it is in its loop (it set CTL_READY), print its pid, die by SIGKILL.
TRAINER = """
import os, signal, sys, time
import numpy as np, torch
from dgl_plugin.dgs_explainer import CTL_READY, ExplainerHandle, ExplainerSpec
from dgl_plugin.models import build_model
from flowlane.dgs import DGSConfig

rng = np.random.default_rng(0)
kw = {"name": "sage", "in_feats": 8, "hidden": 8, "n_classes": 3, "num_layers": 2, "seed": 0}
spec = ExplainerSpec(rng.integers(0, 40, 120), rng.integers(0, 30, 120), 30, kw, DGSConfig())
h = ExplainerHandle(spec, torch.randn(40, 8), build_model(**kw))
deadline = time.monotonic() + float(sys.argv[1])
while not int(h.sh["ctl"][CTL_READY]):
    if not h.proc.is_alive():
        sys.exit(f"explainer exited with code {h.proc.exitcode} before it was ready")
    if time.monotonic() > deadline:
        h.proc.kill()
        sys.exit("explainer not ready in time")
    time.sleep(0.05)
print(f"explainer pid {h.proc.pid}", flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def _running(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie (an orphan's new parent may reap it late or never)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


@pytest.mark.timeout(400)  # a hard stop above the test's own deadlines (start 300 s, exit 30 s)
def test_an_explainer_whose_trainer_was_killed_exits_by_itself(tmp_path):
    out = tmp_path / "trainer.out"
    with open(out, "w") as fh:
        trainer = subprocess.Popen(
            [sys.executable, "-c", TRAINER, "240"],
            cwd=ROOT,
            stdout=fh,
            stderr=subprocess.STDOUT,
            env=dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1"),
            start_new_session=True,  # its own process group: the cleanup below reaches the explainer too
        )
    pid = None
    try:
        trainer.wait(timeout=300)  # imports torch + DGL twice (trainer, spawned explainer) on a busy host
        text = out.read_text(errors="replace")
        assert trainer.returncode == -signal.SIGKILL, text[-3000:]
        # found by its words: the killed trainer's resource tracker may write its leak warnings after it
        pids = re.findall(r"^explainer pid (\d+)$", text, flags=re.M)
        assert len(pids) == 1, text[-3000:]
        pid = int(pids[0])
        deadline = time.monotonic() + 30  # the explainer checks its parent every 10 ms
        while _running(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _running(pid), f"explainer {pid} still runs 30 s after its trainer was killed"
    finally:
        if trainer.poll() is None or (pid is not None and _running(pid)):
            # the group the trainer and its explainer started in
            with contextlib.suppress(ProcessLookupError):
                os.killpg(trainer.pid, signal.SIGKILL)
            trainer.wait(timeout=30)
