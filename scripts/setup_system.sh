#!/usr/bin/env bash
# System packages some tests use: shellcheck (script linting) and Debian's Slurm + munge (the sbatch
# scripts are tested on a real local Slurm). Installed with apt-get when running as root; otherwise the
# tests that need them skip with a reason (never in CI, where they must run).
set -uo pipefail
missing=()
command -v shellcheck >/dev/null || missing+=(shellcheck)
for pair in slurmctld:slurmctld slurmd:slurmd sbatch:slurm-client munged:munge; do
  command -v "${pair%%:*}" >/dev/null || missing+=("${pair##*:}")
done
[[ ${#missing[@]} -eq 0 ]] && exit 0
if [[ $(id -u) -ne 0 ]] || ! command -v apt-get >/dev/null; then
  echo "[setup] not root or no apt-get: skipping ${missing[*]} (their tests will skip)" >&2
  exit 0
fi
echo "[setup] installing ${missing[*]}" >&2
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq >/dev/null 2>&1
apt-get install -y -qq "${missing[@]}" >/dev/null 2>&1 || echo "[setup] apt-get install ${missing[*]} failed" >&2
exit 0
