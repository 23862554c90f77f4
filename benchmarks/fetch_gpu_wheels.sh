#!/usr/bin/env bash
# Download, on a machine with PyPI access, the wheels the GPU machine lacks (it has Python 3.12, a CUDA
# torch, numpy, pytest and hypothesis, and no network), into .whl/ (git-ignored) for benchmarks/gpu_check.sh.
# The pins and their dependency closure against the GPU image are benchmarks/gpu_wheels.py's.
#
#   bash benchmarks/fetch_gpu_wheels.sh          # about 15 MB
#   bash benchmarks/fetch_gpu_wheels.sh --list   # print what would be fetched; download nothing
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="${PYTHON:-python3}"
if [[ "${1:-}" == "--list" ]]; then
  exec "$python" "$root/benchmarks/gpu_wheels.py" --list
fi
exec "$python" "$root/benchmarks/gpu_wheels.py" --fetch "${MCORE_PACKING_WHEELS:-$root/.whl}"
