#!/usr/bin/env bash
# Download, on a machine with PyPI access, the wheels the GPU machine lacks (it has Python 3.12, a CUDA
# torch, numpy, pytest and hypothesis, and no network), into .whl/ (git-ignored) for benchmarks/gpu_check.sh.
#
#   bash benchmarks/fetch_gpu_wheels.sh          # about 15 MB
#   bash benchmarks/fetch_gpu_wheels.sh --list   # print what would be fetched; download nothing
#
# megatron-core is the newest release for Python 3.12 (0.17+ need 3.12, so CPU CI cannot test them);
# hydra-core/omegaconf/antlr4 and the real-text packages are the versions requirements/cpu.lock.txt pins.
# TransformerEngine is not fetched: its CUDA 13 wheels are larger than what a device call may carry.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
dest="${MCORE_PACKING_WHEELS:-$root/.whl}"
python="${PYTHON:-python3}"

pinned() {  # NAME==VERSION from the CPU lock file
  grep -i "^$1==" "$root/requirements/cpu.lock.txt"
}
binary=("megatron-core==${MEGATRON_CORE_VERSION:-0.19.2}" "$(pinned hydra-core)" "$(pinned omegaconf)"
        "$(pinned quicktok-v1)" "$(pinned champ-dataset)")
source_only=("$(pinned antlr4-python3-runtime)")  # an sdist only: built into a pure-Python wheel here

if [[ "${1:-}" == "--list" ]]; then
  printf '%s\n' "${binary[@]}" "${source_only[@]}"
  exit 0
fi
mkdir -p "$dest"
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 \
         manylinux2014_x86_64 manylinux1_x86_64; do
  platforms+=(--platform "$p")
done
"$python" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${platforms[@]}" -d "$dest" "${binary[@]}"
"$python" -m pip wheel --quiet --no-deps -w "$dest" "${source_only[@]}"
ls -l "$dest"
du -sh "$dest"
