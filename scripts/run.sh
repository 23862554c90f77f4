#!/usr/bin/env bash
# The README's main job: set up the environment (first run only), then train a tiny GPT (a real
# Megatron GPTModel) on real CHAMP conversations with sequence packing, on this machine (CPU without a
# GPU; nothing is downloaded). Extra arguments are Hydra overrides, e.g.
#   scripts/run.sh sequence_packing.enabled=false dynamic_batching.enabled=true training.steps=5
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$root/scripts/setup_env.sh"
venv="${MCORE_PACKING_VENV:-$root/.venv}"
cd "$root"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}"
exec "$venv/bin/python" -m mcore_packing train "$@"
