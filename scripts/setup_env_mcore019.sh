#!/usr/bin/env bash
# A second environment with megatron-core 0.19.2, the newest release, for the API test lane.
# 0.17+ declare Python >= 3.12 while these machines have 3.11: its source compiles and runs on 3.11, so
# the sdist is installed with --ignore-requires-python, with triton (0.19's MoE code imports it
# unconditionally). Everything else is the main lock. Users run 0.19 on Python 3.12; this lane tests
# our code against its API on CPU.
# Idempotent like setup_env.sh. Usage: scripts/setup_env_mcore019.sh   (venv at ./.venv-mcore019)
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${MCORE019_VENV:-$root/.venv-mcore019}"
lock="$root/requirements/cpu.lock.txt"
stamp="$venv/.mcore_packing_setup"
python="${PYTHON:-python3}"
megatron="megatron-core==0.19.2"
triton="triton==3.9.0"

want="$( (cat "$lock" "$root/pyproject.toml"; echo "$megatron $triton") | sha256sum | cut -d' ' -f1)"
if [[ -x "$venv/bin/python" && -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then
  exit 0
fi

echo "[setup] creating $venv: the main lock with $megatron and $triton (a few minutes)" >&2
"$python" -m venv "$venv"
pip=("$venv/bin/python" -m pip install --quiet --disable-pip-version-check)
exec 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)  # this machine's pip index notes
"${pip[@]}" -r <(grep -v '^megatron-core==' "$lock")
"${pip[@]}" --no-deps --ignore-requires-python "$megatron" "$triton"
"${pip[@]}" --no-deps --no-build-isolation -e "$root" || "${pip[@]}" --no-deps -e "$root"
"$venv/bin/python" -W ignore -c "import megatron.core, sys; v = megatron.core.__version__
sys.exit(not v.startswith('0.19.2') and f'megatron-core {v} was installed, not 0.19.2')"
echo "$want" > "$stamp"
echo "[setup] done: $venv" >&2
