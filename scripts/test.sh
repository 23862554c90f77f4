#!/usr/bin/env bash
# Run the test suite in the project's virtual environment (created on first use).
# Extra arguments go to pytest, e.g. scripts/test.sh -k packing -x
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$root/scripts/setup_env.sh"
"$root/scripts/setup_system.sh"
venv="${MCORE_PACKING_VENV:-$root/.venv}"
cd "$root"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
"$venv/bin/ruff" check mcore_packing tests benchmarks
"$venv/bin/python" -m pytest "$@"
