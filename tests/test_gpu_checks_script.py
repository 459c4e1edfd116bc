"""scripts/gpu_checks.sh is safe on a shared host (issue 33, item 8): its scratch paths (the wheels it puts on
PYTHONPATH, the checks' temporary files, the NCCL logs) live in one private folder with an unpredictable name, which
is gone afterwards; nothing is read from a fixed /tmp path another user could have planted. The GPU tools are
stand-ins that record what they were given."""

import os
import stat
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.once  # a shell script: no framework, one lane is enough

ROOT = Path(__file__).resolve().parent.parent

STUB = """#!/usr/bin/env bash
{{ echo "$(basename "$0") $*"; echo "  PYTHONPATH=${{PYTHONPATH:-}} TMPDIR=${{TMPDIR:-}}"; }} >> {log}
case "$*" in
  *pip\\ install*) for a in "$@"; do [ "$prev" = --target ] && mkdir -p "$a"; prev=$a; done ;;
  *nccl_gpu_check*) mkdir -p "$4/logs"; echo '{{}}' > "$4/nccl_gpu_check.json"
                    stat -c '%a' "$(dirname "$4")" >> {log} ;;
esac
exit 0
"""


def test_scratch_paths_are_private_unpredictable_and_removed(tmp_path):
    bin_dir, tmp, out = tmp_path / "bin", tmp_path / "tmp", tmp_path / "out"
    for d in (bin_dir, tmp):
        d.mkdir()
    log = tmp_path / "calls.log"
    for tool in ("python3", "nvidia-smi", "make", "timeout"):
        (bin_dir / tool).write_text(STUB.format(log=log))
        (bin_dir / tool).chmod(0o755)
    # `timeout N cmd ...` runs the stub for timeout itself; make it run cmd so the python3 stub sees the arguments
    (bin_dir / "timeout").write_text(
        '#!/usr/bin/env bash\nwhile [[ $1 == -* ]]; do shift 2; done\nshift\nexec "$@"\n'
    )
    wheels = ROOT / ".whl"
    made_wheel_dir = not wheels.exists()
    wheels.mkdir(exist_ok=True)
    wheel = wheels / "zz_flowlane_test_stub-0-py3-none-any.whl"
    wheel.write_text("")
    try:
        env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "TMPDIR": str(tmp), "OUT": str(out)}
        env.pop("PYTHONPATH", None)
        r = subprocess.run(
            ["bash", str(ROOT / "scripts" / "gpu_checks.sh")],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        wheel.unlink()
        if made_wheel_dir:
            wheels.rmdir()
    calls = log.read_text()
    assert r.returncode == 0, r.stdout + r.stderr
    assert (
        "/tmp/site" not in calls and "/tmp/nccl_gpu" not in calls and "/tmp/flowlane-offload" not in calls
    ), calls
    (site,) = {
        w.split("=", 1)[1].split(":")[0]
        for w in calls.split()
        if w.startswith("PYTHONPATH=") and w[-1] != "="
    }
    scratch = Path(site).parent
    assert scratch.parent == tmp and scratch.name.startswith("flowlane-gpu-checks."), calls
    assert f"TMPDIR={scratch}" in calls  # the checks' own temporary files go there too
    assert "\n700\n" in calls, calls  # the scratch folder was private while the checks ran
    assert not scratch.exists(), "scratch folder left behind"
    assert (out / "nccl_gpu_check.json").exists() and (out / "gpu_checks_log.txt").exists()
    assert not stat.S_IMODE(out.stat().st_mode) & 0o002
