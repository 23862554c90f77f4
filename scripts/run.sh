#!/usr/bin/env bash
# The README's main job: set up the environment (first run only) and run the planning demo on real text
# (19,440 CHAMP conversations, qwen3 tokens; nothing is downloaded). Extra arguments go to the planner,
# e.g. scripts/run.sh --corpus stdlib --capacity 200000
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$root/scripts/setup_env.sh"
venv="${MCORE_PACKING_VENV:-$root/.venv}"
cd "$root"
exec "$venv/bin/python" -m mcore_packing.plan "$@"
