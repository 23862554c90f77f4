#!/usr/bin/env bash
# Create (or refresh) the project's virtual environment with the pinned CPU dependencies.
# Idempotent: does nothing when the lock file and pyproject.toml are unchanged since the last setup.
# Usage: scripts/setup_env.sh            (venv at ./.venv, or $MCORE_PACKING_VENV)
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${MCORE_PACKING_VENV:-$root/.venv}"
lock="$root/requirements/cpu.lock.txt"
stamp="$venv/.mcore_packing_setup"
python="${PYTHON:-python3}"

want="$(cat "$lock" "$root/pyproject.toml" | sha256sum | cut -d' ' -f1)"
if [[ -x "$venv/bin/python" && -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then
  exit 0
fi

echo "[setup] creating $venv with pinned CPU dependencies (first run takes a few minutes)" >&2
"$python" -m venv "$venv"
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check -r "$lock"
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps --no-build-isolation -e "$root" \
  || "$venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps -e "$root"
echo "$want" > "$stamp"
echo "[setup] done: $venv" >&2
