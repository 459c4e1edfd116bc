#!/usr/bin/env bash
# The main job: the default recipe (tiny Megatron-core GPT, PP2 x DP2 on 4 CPU ranks). Hydra overrides pass through.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh llm
export DS_ACCELERATOR=cpu
exec .venv-llm/bin/flowlane-train "$@"
