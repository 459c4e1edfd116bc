#!/usr/bin/env bash
# DeepSpeed's async I/O op (deepspeed.ops.aio: the DeepSpeed offload's SSD backend) needs libaio's headers and
# library: Debian's libaio-dev. Called by scripts/test.sh; a no-op when they are there. Without root or apt it says so
# and exits 0: the aio tests then skip naming the reason (deepspeed_plugin/ssd_offload.py), everything else runs.
# With libaio present, `--build` also JIT-builds the op (DeepSpeed's own build) once per machine and version set into
# deepspeed_plugin.ssd_offload.aio_build_dir() (~/.cache/flowlane/deepspeed_aio/<versions>) and prints how long it
# took (a cache hit: a second), so the tests load it instead of building it.
set -uo pipefail
cd "$(dirname "$0")/.."
have() { [ -f /usr/include/libaio.h ] && compgen -G "/usr/lib/*/libaio.so" >/dev/null; }
if ! have; then
  if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
    echo "install-aio-deps: not root or no apt-get; the deepspeed.ops.aio tests will skip (needs libaio-dev)" >&2
    exit 0
  fi
  export DEBIAN_FRONTEND=noninteractive
  if ! { apt-get update -qq && apt-get install -y -qq --no-install-recommends libaio-dev; } \
    >/tmp/flowlane-aio-deps.log 2>&1; then
    echo "install-aio-deps: apt-get failed (log: /tmp/flowlane-aio-deps.log); the aio tests will skip" >&2
    exit 0
  fi
fi
if [ "${1:-}" = --build ] && [ -x .venv-llm/bin/python ]; then
  # a failed build is not hidden here: the aio tests then fail naming the compiler's error
  DS_ACCELERATOR=cpu .venv-llm/bin/python -c '
import time
from deepspeed_plugin.ssd_offload import deepspeed_aio_op
t = time.perf_counter()
op, why = deepspeed_aio_op()
print(f"install-aio-deps: deepspeed.ops.aio {why} in {time.perf_counter() - t:.1f} s")
' || true
fi
exit 0
