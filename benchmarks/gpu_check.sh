#!/usr/bin/env bash
# The one prepared GPU check: run it on a machine with one NVIDIA GPU (H100/H200), from the repo root.
#
#   bash benchmarks/fetch_gpu_wheels.sh     # first, where PyPI is reachable: wheels into .whl/ (~15 MB)
#   bash benchmarks/gpu_check.sh            # on the GPU machine (under 10 minutes), .whl/ carried along
#   bash benchmarks/gpu_check.sh --dry-run  # anywhere: what it would install and run, and the CPU parts (CI)
#
# The machine is bare and offline: the wheels it lacks (benchmarks/gpu_wheels.py: megatron-core, Hydra,
# the real-text packages; their closure against the image is tested) come in .whl/. TransformerEngine is
# not carried (its CUDA 13 core wheel is over what a device call carries): its rows skip with that reason.
# Steps: install the carried wheels into a private folder; record versions; (a) tests/test_gpu.py:
# packed THD forward/backward vs per-sequence in fp32 and bf16 (bound 2e-2) with our varlen backend and
# TE's when present, the step's syncs under CUDA's sync debug mode (none of ours), and with 2+ GPUs the
# DP2 and CP2 steps over NCCL equal to the single GPU's; (b) the unit, TE-contract, collectives and
# single/two-rank equivalence tests with the newest megatron-core, CUDA hidden (CPU/gloo tests: this
# exercises the version gates of a newer release for real); (c) benchmarks/gpu_step.py: a ~1B bf16 model
# on CHAMP lengths, packing vs dynamic vs padding (tokens/s, peak memory); (d) everything as JSON/XML in
# $MCORE_PACKING_GPU_RESULTS (default benchmarks/results/gpu/), summarized by benchmarks/gpu_summary.py.
# A failing step is recorded and the next one still runs; the exit code is the number of failed steps.
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root" || exit 1
dry_run=0
[[ "${1:-}" == "--dry-run" ]] && dry_run=1
python="${PYTHON:-python3}"
results="${MCORE_PACKING_GPU_RESULTS:-$root/benchmarks/results/gpu}"
mkdir -p "$results"
export MCORE_PACKING_GPU_RESULTS="$results" PYTHONUNBUFFERED=1 OMP_NUM_THREADS="${OMP_NUM_THREADS:-8}"
failed=0

step() {  # step NAME SECONDS COMMAND...: run (or, in a dry run, print) one timed step and record its status
  local name=$1 seconds=$2
  shift 2
  echo "=== $name (limit ${seconds}s): $*"
  if [[ $dry_run -eq 1 ]]; then
    echo "$name: dry run" > "$results/$name.status"
    return 0
  fi
  local start=$SECONDS
  timeout "$seconds" "$@" 2>&1 | tee "$results/$name.log"
  local rc=${PIPESTATUS[0]}
  echo "$name: exit $rc after $((SECONDS - start))s" | tee "$results/$name.status"
  [[ $rc -eq 0 ]] || failed=$((failed + 1))
}

site=/tmp/mcore_packing_site
if compgen -G ".whl/*.whl" > /dev/null; then
  step install 60 "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$site" .whl/*.whl
  export PYTHONPATH="$site:$root${PYTHONPATH:+:$PYTHONPATH}"
else
  echo "=== no wheels in .whl/: using what is installed (bash benchmarks/fetch_gpu_wheels.sh fetches them)"
  export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
fi
if [[ $dry_run -eq 1 ]]; then  # what a real run would carry and install
  echo "=== would install (benchmarks/gpu_wheels.py --list):"
  "$python" benchmarks/gpu_wheels.py --list || failed=$((failed + 1))
fi
"$python" -c "import transformer_engine" 2> /dev/null \
  || echo "=== TransformerEngine: not installed; its rows skip ($("$python" -c "import sys; sys.path.insert(0, 'benchmarks'); import gpu_wheels; print(gpu_wheels.TE_SKIP_REASON)"))"

"$python" benchmarks/gpu_summary.py --versions > "$results/versions.json" && cat "$results/versions.json"
pytest=("$python" -m pytest -p no:cacheprovider -q -rA)
if [[ $dry_run -eq 1 ]]; then  # the selections must exist: collect them here
  "${pytest[@]}" --collect-only tests/test_gpu.py tests/test_megatron_units.py tests/test_te_contract.py \
    tests/test_collectives.py \
    "tests/test_step_equivalence.py::test_single_rank_matches_reference" \
    "tests/test_step_equivalence.py::test_two_ranks_match_reference" > "$results/collected.txt" || failed=$((failed + 1))
  "$python" benchmarks/gpu_step.py --plan-only --steps 2 --out "$results/gpu_step_plan.json" > /dev/null \
    || failed=$((failed + 1))
fi
step gpu_tests 200 "${pytest[@]}" tests/test_gpu.py --junitxml="$results/gpu_tests.xml"
step newest_megatron_cpu_tests 150 env CUDA_VISIBLE_DEVICES= "${pytest[@]}" tests/test_megatron_units.py \
  tests/test_batch.py tests/test_context_parallel.py tests/test_te_contract.py tests/test_collectives.py \
  "tests/test_step_equivalence.py::test_single_rank_matches_reference" \
  "tests/test_step_equivalence.py::test_two_ranks_match_reference" --junitxml="$results/newest_megatron.xml"
step gpu_step 150 "$python" benchmarks/gpu_step.py --out "$results/gpu_step.json"
"$python" benchmarks/gpu_summary.py "$results" || failed=$((failed + 1))
echo "gpu_check: $failed failed step(s); results in $results"
exit "$failed"
