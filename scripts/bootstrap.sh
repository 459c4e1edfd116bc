#!/usr/bin/env bash
# Create (or update) one environment lane from the lock file: scripts/bootstrap.sh llm|gnn
# Needs only python3 (3.11) on the machine; uv itself is installed into .tools/ from PyPI, pinned.
set -euo pipefail
cd "$(dirname "$0")/.."
lane="${1:?usage: scripts/bootstrap.sh llm|gnn}"
case "$lane" in llm|gnn) ;; *) echo "bootstrap: unknown lane '$lane' (allowed: llm, gnn)" >&2; exit 2;; esac
UV_VERSION=0.13.9
if [ ! -x .tools/bin/uv ] || [ "$(.tools/bin/uv --version | cut -d' ' -f2)" != "$UV_VERSION" ]; then
  python3 -m venv .tools
  .tools/bin/pip install --quiet --disable-pip-version-check "uv==$UV_VERSION"
fi
# DS_BUILD_OPS=0: DeepSpeed's ops are JIT-compiled on first use instead of at install (no CUDA toolkit here).
export DS_BUILD_OPS=0
UV_PROJECT_ENVIRONMENT=".venv-$lane" .tools/bin/uv sync --frozen --quiet --extra "$lane" --python python3.11
