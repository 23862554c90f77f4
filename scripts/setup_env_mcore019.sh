#!/usr/bin/env bash
# A second environment with megatron-core 0.19.2, the newest release, for the API test lane.
# 0.17+ declare Python >= 3.12 while these machines have 3.11: its source compiles and runs on 3.11, so
# the sdist is installed with --ignore-requires-python, with triton (0.19's MoE code imports it
# unconditionally). Everything else is the main lock, read from the main environment (scripts/setup_env.sh,
# which must exist): a .pth file, processed after this venv's own packages, adds its site-packages, so
# megatron-core 0.19.2 and triton here come first and torch and the rest are the main lock's very files (no
# second install of them: seconds instead of a minute and a half). Users run 0.19 on Python 3.12; this
# lane tests our code against its API on CPU.
# Idempotent like setup_env.sh. Usage: scripts/setup_env_mcore019.sh   (venv at ./.venv-mcore019)
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${MCORE019_VENV:-$root/.venv-mcore019}"
lock="$root/requirements/cpu.lock.txt"
stamp="$venv/.mcore_packing_setup"
python="${PYTHON:-python3}"
megatron="megatron-core==0.19.2"
triton="triton==3.9.0"

main="${MCORE_PACKING_VENV:-$root/.venv}"
if [[ ! -x "$main/bin/python" ]]; then
  echo "[setup] $main is missing: run scripts/setup_env.sh first (this lane reuses its packages)" >&2
  exit 1
fi
main_site="$("$main/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
want="$( (cat "$lock" "$root/pyproject.toml"; echo "$megatron $triton $main_site") | sha256sum | cut -d' ' -f1)"
if [[ -x "$venv/bin/python" && -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then
  exit 0
fi

echo "[setup] creating $venv: $megatron and $triton over the main lock of $main" >&2
rm -rf "$venv"
"$python" -m venv "$venv"
pip=("$venv/bin/python" -m pip install --quiet --disable-pip-version-check)
exec 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)  # this machine's pip index notes
"${pip[@]}" --no-deps --ignore-requires-python "$megatron" "$triton"
"${pip[@]}" --no-deps -e "$root"  # an isolated build: this venv has no setuptools of the lock's
site_dir="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
# "zz": .pth files run in name order, so the main lock's packages join sys.path after this venv's own
echo "import site; site.addsitedir('$main_site')" > "$site_dir/zz_mcore_packing_main_lock.pth"
"$venv/bin/python" -W ignore -c "import megatron.core, sys; v = megatron.core.__version__
sys.exit(not v.startswith('0.19.2') and f'megatron-core {v} was installed, not 0.19.2')"
echo "$want" > "$stamp"
echo "[setup] done: $venv" >&2
