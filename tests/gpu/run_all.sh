#!/usr/bin/env bash
# Every prepared GPU check in one short run, for a one-GPU machine lent for a few minutes (python3 with torch,
# CUDA and Triton already there; no network). Framework wheels not on that machine (megatron-core, deepspeed and
# their needs) travel in .whl/ and are installed into a fresh private directory first.
#   OUT=/some/dir FLOWLANE_COMMIT=$(git rev-parse HEAD) tests/gpu/run_all.sh [check ...]
# Each check writes $OUT/<check>.json; everything printed goes to $OUT/gpu_log.txt. A check that is missing from the
# tree is reported and skipped; each runs under its own time limit so one hang cannot eat the others' time. The exit
# status is 1 when any named check failed (its rc), timed out, or was unknown or missing, else 0.
set -u
OUT=${OUT:?set OUT to the result directory}
mkdir -p "$OUT"
exec > >(tee "$OUT/gpu_log.txt") 2>&1
export PYTHONUNBUFFERED=1 FLOWLANE_COMMIT=${FLOWLANE_COMMIT:-unknown}
cd "$(dirname "$0")/../.."
date -u
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c 'import torch, triton; print("torch", torch.__version__, "cuda", torch.version.cuda, "nccl",
           torch.cuda.nccl.version(), "triton", triton.__version__)'
# Only the wheels whose project the machine lacks: a carried typing_extensions or numpy must not shadow torch's own.
missing=$(python3 - .whl/*.whl <<'PY'
import importlib.metadata as md, sys
for path in sys.argv[1:]:
    if not path.endswith(".whl"):
        continue
    name = path.rsplit("/", 1)[-1].split("-")[0]
    try:
        md.version(name)
    except md.PackageNotFoundError:
        print(path)
PY
)
if [ -n "$missing" ]; then
  site=$(mktemp -d)  # private, unpredictable: nothing another user planted is imported
  echo "installing from .whl/:" $(basename -a $missing)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" $missing \
    && export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
python3 -c 'import megatron.core as m; print("megatron-core", m.__version__)' 2>&1 | tail -1
python3 -c 'import deepspeed as d; print("deepspeed", d.__version__)' 2>&1 | tail -1

# check name, seconds allowed
CHECKS=("megatron_ddp_nccl 150" "deepspeed_zero3_nccl 100" "offload_bench 185" "megatron_offload_bench 170" "offload_bench_expandable 150" "direct_gather 100" "hector_ops 100"
        "recipe_torchrun_nccl 150" "syndicate_nccl 90" "megatron_dp_nccl 200" "megatron_dp_pp_nccl 260"
        "graph_exchange_nccl 120")
failed=()
want=("$@")  # named checks run in the order given (most wanted first), else all in CHECKS order
if [ ${#want[@]} -eq 0 ]; then for entry in "${CHECKS[@]}"; do want+=("${entry%% *}"); done; fi
for name in "${want[@]}"; do
  limit=""
  for entry in "${CHECKS[@]}"; do [ "${entry%% *}" = "$name" ] && limit=${entry##* }; done
  if [ -z "$limit" ]; then echo "== $name: not a known check, skipped"; failed+=("$name(unknown)"); continue; fi
  if [ ! -f "tests/gpu/$name.py" ]; then echo "== $name: not in this tree, skipped"; failed+=("$name(missing)"); continue; fi
  echo "== $name (limit ${limit}s) $(date -u +%T)"
  t0=$(date +%s)
  timeout -k 10 "$limit" python3 "tests/gpu/$name.py" --out "$OUT/$name.json"
  rc=$?
  echo "== $name rc=$rc in $(( $(date +%s) - t0 ))s"
  [ $rc -ne 0 ] && failed+=("$name(rc=$rc)")
done
date -u
# non-zero when any check failed, timed out or was unknown: a caller sees it without reading the log
if [ ${#failed[@]} -gt 0 ]; then echo "failed: ${failed[*]}"; exit 1; fi
