#!/usr/bin/env bash
# The checks that need a GPU, in one run (results/nccl_gpu/README.md says what came out of them).
# For a one-GPU machine with python3 + torch (CUDA) already installed and no network: it installs nothing from an
# index. Optional kvikio wheels in .whl/ are installed into /tmp/site first (the SSD offload's GPUDirect backend).
#   OUT=/some/dir scripts/gpu_checks.sh
# 1. tests/gpu/offload_bench.py: activation offload (keep / flowlane / full recompute) on bf16 blocks at hidden
#    4096 and 8192, gradients bitwise equal to keep, peak activation memory and step time.
# 2. benchmarks/nccl_gpu_check.py: NCCL loads libnccl-net-flowlane.so; traffic-class communicators; matched
#    all-to-all and the Hermod runtime scheduler on NCCL; then the same with NCCL's own socket transport.
set -u
OUT=${OUT:-/tmp/flowlane-gpu}
mkdir -p "$OUT"
exec > >(tee "$OUT/gpu_checks_log.txt") 2>&1
export PYTHONUNBUFFERED=1
date -u
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda,
           "nccl", torch.cuda.nccl.version(), "gpus", torch.cuda.device_count())'
make -C nccl_net_plugin build/libnccl-net-flowlane.so || echo "plugin build failed: using the carried build if any"
ls -la nccl_net_plugin/build/ 2>&1
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
python3 -c 'import kvikio; print("kvikio", kvikio.__version__)' 2>&1 | tail -1

if [ -z "${SKIP_OFFLOAD:-}" ]; then
  timeout 120 python3 tests/gpu/offload_bench.py --out "$OUT/offload_bench.json" ${OFFLOAD_CHECK_ARGS:-}
  echo "offload_bench rc=$?"
fi

rm -rf /tmp/nccl_gpu
timeout 330 python3 -m benchmarks.nccl_gpu_check --out /tmp/nccl_gpu --timeout 75 ${NCCL_CHECK_ARGS:-}
echo "nccl_gpu_check rc=$?"
cp /tmp/nccl_gpu/nccl_gpu_check.json "$OUT/" 2>/dev/null
tar czf "$OUT/nccl_logs.tgz" -C /tmp/nccl_gpu logs 2>/dev/null
date -u
