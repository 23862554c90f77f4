#!/usr/bin/env bash
# Shared launcher for the sbatch scripts: ONE torchrun per node (srun --ntasks-per-node=1), and torchrun
# starts one rank per GPU. Never combine one srun task per GPU with torchrun: that multiplies the ranks.
#
# Arguments go to `python -m mcore_packing train` (Hydra overrides, or --recipe NAME ...), untouched.
# Environment (all optional):
#   MCORE_PACKING_ROOT    repository root (default: the directory sbatch was called from)
#   MCORE_PACKING_PYTHON  interpreter (default: $MCORE_PACKING_ROOT/.venv/bin/python, else python3)
#   MCORE_PACKING_COMMAND command of `python -m mcore_packing` (default: train)
#   GPUS_PER_NODE         ranks per node (default: $SLURM_GPUS_ON_NODE, else 1)
#   MASTER_ADDR           rendezvous host (default: the first node's address as Slurm knows it, NodeAddr,
#                         so clusters whose node names do not resolve work; its name when Slurm has none)
#   MASTER_PORT           rendezvous port (default: 29500 + job id mod 1000)
#   CONTAINER_IMAGE       run inside this container image (pyxis/enroot srun flags); unset: on the host
#   CONTAINER_MOUNTS      container mounts (default: the repository root)
#   MCORE_PACKING_STOP_FILE  the file that asks the run to save and exit (default: a per-job file in the
#                         submit directory); created when the batch shell gets SIGUSR1 or SIGTERM
#
# Time limits and preemption: with `#SBATCH --signal=B:USR1@<seconds>` Slurm signals this shell that
# long before the limit. The trap creates the stop file; the ranks finish their step, save a checkpoint
# and exit; then this script requeues the job (`#SBATCH --requeue`), which starts again with resume=auto
# (added to the train arguments unless they set resume) and continues from that checkpoint.
# A signal to the job step instead (`scancel --signal=TERM|USR1 <job>`, `#SBATCH --signal=USR1@<s>`, the
# SIGTERM of a time limit or preemption) reaches `python -m mcore_packing launch` (torchrun), which forwards
# it to the ranks: they save after their step and exit 0 the same way (app/stop_request.py).
set -euo pipefail

root="${MCORE_PACKING_ROOT:-${SLURM_SUBMIT_DIR:-$(pwd)}}"
python="${MCORE_PACKING_PYTHON:-}"
if [[ -z "$python" ]]; then
  if [[ -x "$root/.venv/bin/python" ]]; then python="$root/.venv/bin/python"; else python="python3"; fi
fi
command="${MCORE_PACKING_COMMAND:-train}"
nnodes="${SLURM_JOB_NUM_NODES:-${SLURM_NNODES:-1}}"
gpus_per_node="${GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-1}}"
if [[ -z "${MASTER_ADDR:-}" ]]; then
  first_node="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"
  MASTER_ADDR="$(scontrol show node "$first_node" | grep -oE 'NodeAddr=[^ ]+' | head -n 1 | cut -d= -f2 || true)"
  MASTER_ADDR="${MASTER_ADDR:-$first_node}"
fi
MASTER_PORT="${MASTER_PORT:-$((29500 + ${SLURM_JOB_ID:-0} % 1000))}"
export MASTER_ADDR MASTER_PORT

# NCCL and CUDA settings that large Megatron jobs want; override any of them in the environment.
: "${NCCL_DEBUG:=WARN}"
: "${TORCH_NCCL_ASYNC_ERROR_HANDLING:=1}"
: "${NCCL_IB_TIMEOUT:=22}"
: "${CUDA_DEVICE_MAX_CONNECTIONS:=1}"   # Megatron's TP/SP communication overlap needs ordered kernels
: "${OMP_NUM_THREADS:=1}"
export NCCL_DEBUG TORCH_NCCL_ASYNC_ERROR_HANDLING NCCL_IB_TIMEOUT CUDA_DEVICE_MAX_CONNECTIONS OMP_NUM_THREADS

container_flags=()
if [[ -n "${CONTAINER_IMAGE:-}" ]]; then
  container_flags=(--container-image="$CONTAINER_IMAGE" --container-mounts="${CONTAINER_MOUNTS:-$root:$root}"
                   --container-workdir="$root")
fi

args=("$@")
if [[ "$command" == "train" ]]; then
  set_resume=0
  for arg in "$@"; do [[ "$arg" == resume=* ]] && set_resume=1; done
  [[ $set_resume -eq 1 ]] || args+=("resume=auto")  # a requeued job continues from its checkpoint
fi

MCORE_PACKING_STOP_FILE="${MCORE_PACKING_STOP_FILE:-$root/.mcore_packing_stop_${SLURM_JOB_ID:-local}}"
export MCORE_PACKING_STOP_FILE
rm -f "$MCORE_PACKING_STOP_FILE"  # a requeued job keeps its id: forget the previous run's request
# shellcheck disable=SC2317  # called from the traps below
on_signal() {
  echo "[launch] $1 received: the run saves a checkpoint after its current step and exits"
  touch "$MCORE_PACKING_STOP_FILE"
}
trap 'on_signal USR1' USR1
trap 'on_signal TERM' TERM

echo "[launch] job=${SLURM_JOB_ID:-none} restart=${SLURM_RESTART_COUNT:-0} nodes=$nnodes ranks/node=$gpus_per_node" \
     "world=$((nnodes * gpus_per_node)) rendezvous=$MASTER_ADDR:$MASTER_PORT python=$python" \
     "container=${CONTAINER_IMAGE:-none}"
cd "$root"
# In the background: bash runs a trap only between commands, and `wait` returns when one arrives.
srun --ntasks-per-node=1 --kill-on-bad-exit=1 "${container_flags[@]}" \
  "$python" -m mcore_packing launch \
    --nnodes="$nnodes" \
    --nproc_per_node="$gpus_per_node" \
    --rdzv_backend=c10d \
    --rdzv_endpoint="$MASTER_ADDR:$MASTER_PORT" \
    --rdzv_id="${SLURM_JOB_ID:-local}" \
    "$command" "${args[@]}" &
srun_pid=$!
status=0
while true; do
  wait "$srun_pid" && status=0 || status=$?
  kill -0 "$srun_pid" 2>/dev/null || break  # still running: the wait was cut short by a trapped signal
done

if [[ -f "$MCORE_PACKING_STOP_FILE" ]]; then
  rm -f "$MCORE_PACKING_STOP_FILE"
  if [[ $status -eq 0 && -n "${SLURM_JOB_ID:-}" ]]; then
    echo "[launch] the run saved and stopped: requeueing job $SLURM_JOB_ID (it resumes with resume=auto)"
    scontrol requeue "$SLURM_JOB_ID" || echo "[launch] requeue refused: submit with --requeue, or resubmit" >&2
  fi
fi
exit "$status"
