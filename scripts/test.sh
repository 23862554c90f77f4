#!/usr/bin/env bash
# Run the test suite in the project's virtual environment (created on first use).
#   scripts/test.sh                 ruff + every test (what CI runs)
#   scripts/test.sh --fast          ruff + the fast tier: no multi-rank and no slow tests (about 8 minutes on 2 cores)
# Other arguments go to pytest, e.g. scripts/test.sh -k packing -x
# The suite runs on MCORE_PACKING_TEST_WORKERS pytest-xdist workers (2 by default; 0 runs it in this
# process), one test file per worker so that a file's module fixtures are built once.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$root/scripts/setup_env.sh"
"$root/scripts/setup_system.sh"
venv="${MCORE_PACKING_VENV:-$root/.venv}"
cd "$root"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
tier=()
if [[ "${1:-}" == "--fast" ]]; then
  shift
  tier=(-m "not multirank and not slow")
fi
"$venv/bin/ruff" check mcore_packing tests benchmarks examples
workers=(-n "${MCORE_PACKING_TEST_WORKERS:-2}" --dist loadfile)
# --durations: the slowest tests in every log, so a CI run that nears its time budget says where it went
"$venv/bin/python" -m pytest "${workers[@]}" "${tier[@]}" --durations=25 "$@"
