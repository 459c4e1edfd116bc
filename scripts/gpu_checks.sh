#!/usr/bin/env bash
# The checks that need a GPU, in one run (results/gpu/README.md says what came out of them).
# For a one-GPU machine with python3 + torch (CUDA) already installed and no network: it installs nothing from an
# index. Optional kvikio wheels in .whl/ are installed into a private temporary folder first (the SSD offload's
# GPUDirect backend).
#   OUT=/some/dir scripts/gpu_checks.sh      (without OUT: a new private folder, printed at the start)
# 1. tests/gpu/offload_bench.py: activation offload on CUDA (keep / flowlane / recompute side by side), gradients
#    bitwise equal to no offload, peak memory and step time (tests/gpu/run_all.sh runs it with the other checks).
# 2. benchmarks/nccl_gpu_check.py: NCCL loads libnccl-net-flowlane.so; traffic-class communicators; matched
#    all-to-all and the Hermod runtime scheduler on NCCL; then the same with NCCL's own socket transport.
# Safe on a shared host: every scratch path (wheels put on PYTHONPATH, offload files, NCCL logs) is in one folder
# made by mktemp (0700, an unpredictable name; also TMPDIR for the checks) and removed at exit.
set -u
cd "$(dirname "$0")/.."
umask 077
work=$(mktemp -d "${TMPDIR:-/tmp}/flowlane-gpu-checks.XXXXXXXX") || { echo "mktemp failed" >&2; exit 1; }
trap 'rm -rf "$work"' EXIT
OUT=${OUT:-$(mktemp -d "${TMPDIR:-/tmp}/flowlane-gpu-out.XXXXXXXX")}
mkdir -p "$OUT"
export TMPDIR="$work"
exec > >(tee "$OUT/gpu_checks_log.txt") 2>&1
export PYTHONUNBUFFERED=1
status=0
date -u
echo "results: $OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda,
           "nccl", torch.cuda.nccl.version(), "gpus", torch.cuda.device_count())'
make -C nccl_net_plugin build/libnccl-net-flowlane.so || echo "plugin build failed: using the carried build if any"
ls -la nccl_net_plugin/build/ 2>&1
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$work/site" \
    .whl/*.whl && export PYTHONPATH="$work/site${PYTHONPATH:+:$PYTHONPATH}"
fi
python3 -c 'import kvikio; print("kvikio", kvikio.__version__)' 2>&1 | tail -1

if [ -z "${SKIP_OFFLOAD:-}" ]; then
  if [ -f tests/gpu/offload_bench.py ]; then
    timeout -k 10 130 python3 tests/gpu/offload_bench.py --out "$OUT/offload_bench.json" ${OFFLOAD_CHECK_ARGS:-}
    rc=$?; echo "offload_bench rc=$rc"; [ $rc -eq 0 ] || status=1
  else
    echo "offload_bench: tests/gpu/offload_bench.py is not in this tree, skipped"
  fi
fi

timeout 330 python3 -m benchmarks.nccl_gpu_check --out "$work/nccl_gpu" --timeout 75 ${NCCL_CHECK_ARGS:-}
rc=$?; echo "nccl_gpu_check rc=$rc"; [ $rc -eq 0 ] || status=1
cp "$work/nccl_gpu/nccl_gpu_check.json" "$OUT/" 2>/dev/null
tar czf "$OUT/nccl_logs.tgz" -C "$work/nccl_gpu" logs 2>/dev/null
date -u
exit $status  # 1 when a check failed or timed out
