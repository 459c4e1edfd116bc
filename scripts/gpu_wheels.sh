#!/usr/bin/env bash
# Fill .whl/ (git-ignored) with the wheels tests/gpu/run_all.sh installs on a lent GPU machine, which has python3,
# torch, CUDA and Triton but no network: megatron-core, DeepSpeed, Hydra and their needs, at the llm lane's versions
# (uv.lock), for that machine's Python. run_all.sh installs only those the machine lacks.
#   scripts/gpu_wheels.sh [python version, default 3.12]
set -euo pipefail
cd "$(dirname "$0")/.."
pyv=${1:-3.12}
case "$pyv" in 3.[0-9]|3.[0-9][0-9]) ;; *) echo "gpu_wheels: python version '$pyv' is not of the form 3.N" >&2; exit 2;; esac
scripts/bootstrap.sh llm
version() { .venv-llm/bin/python -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$1"; }
binary=(megatron-core einops hjson msgpack ninja psutil py-cpuinfo pydantic pydantic-core annotated-types
        typing-inspection typing-extensions tqdm hydra-core omegaconf pyyaml)
source_only=(deepspeed antlr4-python3-runtime)  # sdists on PyPI: built here as pure-Python wheels
pins=(); for p in "${binary[@]}"; do pins+=("$p==$(version "$p")"); done
mkdir -p .whl
.tools/bin/pip download -q --disable-pip-version-check --no-deps --only-binary=:all: --dest .whl \
  --python-version "$pyv" --implementation cp --abi "cp${pyv/./}" \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any \
  "${pins[@]}"
pins=(); for p in "${source_only[@]}"; do pins+=("$p==$(version "$p")"); done
DS_BUILD_OPS=0 .tools/bin/pip wheel -q --disable-pip-version-check --no-deps --wheel-dir .whl "${pins[@]}"
ls .whl
