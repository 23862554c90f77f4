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
#   MASTER_ADDR           rendezvous host (default: the job's first node, from scontrol show hostnames)
#   MASTER_PORT           rendezvous port (default: 29500 + job id mod 1000)
#   CONTAINER_IMAGE       run inside this container image (pyxis/enroot srun flags); unset: on the host
#   CONTAINER_MOUNTS      container mounts (default: the repository root)
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
  MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"
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

echo "[launch] job=${SLURM_JOB_ID:-none} nodes=$nnodes ranks/node=$gpus_per_node world=$((nnodes * gpus_per_node))" \
     "rendezvous=$MASTER_ADDR:$MASTER_PORT python=$python container=${CONTAINER_IMAGE:-none}"
cd "$root"
srun --ntasks-per-node=1 --kill-on-bad-exit=1 "${container_flags[@]}" \
  "$python" -m torch.distributed.run \
    --nnodes="$nnodes" \
    --nproc_per_node="$gpus_per_node" \
    --rdzv_backend=c10d \
    --rdzv_endpoint="$MASTER_ADDR:$MASTER_PORT" \
    --rdzv_id="${SLURM_JOB_ID:-local}" \
    -m mcore_packing "$command" "$@"
