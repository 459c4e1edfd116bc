#!/usr/bin/env bash
# The main job: the default recipe (tiny Megatron-core GPT, PP2 x DP2 on 4 CPU ranks). Hydra overrides pass through.
# A GNN recipe (--config-name gnn_*) runs in the gnn lane, everything else in the llm lane.
set -euo pipefail
cd "$(dirname "$0")/.."
lane=llm
case " $* " in *" --config-name gnn_"*|*" --config-name=gnn_"*|*" -cn gnn_"*) lane=gnn;; esac
scripts/bootstrap.sh "$lane"
export DS_ACCELERATOR=cpu
exec ".venv-$lane/bin/flowlane-train" "$@"
