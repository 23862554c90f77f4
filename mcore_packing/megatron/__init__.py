"""The Megatron-Core-facing layer: PackedSeqParams, THD attention, layer specs, model building, the CPU
device adapter, and the schedule driver that runs a step plan through Megatron's pipeline schedule.

Importing this package imports megatron-core; the packing and planning layers do not.

- `packed_seq`: `to_packed_seq_params` (+ the host-side `ThdLayout` attention reads).
- `attention`: `PackedCoreAttention`, THD/BSHD causal attention for the local layer spec.
- `layer_spec`: `get_packed_gpt_layer_spec` / `get_packed_gpt_block_spec` (TE's when importable).
- `model`: `initialize_parallel`, `transformer_config` (from a `ModelShape`), `build_gpt_model`.
- `cpu_device`: `cpu_device_adapter()`, Megatron's hard-coded CUDA call sites redirected on CPU.
- `parallel_groups`: `ParallelGroups` (the one reader of ``parallel_state``), `verify_plan_across_ranks`.
- `prepare`: this rank's `PreparedMicroBatch`es, and `per_sample_logprobs` back from the output.
- `unpacked_losses`: per-sequence and per-group losses on the unpacked view.
- `schedule`: `run_step`, `compute_logprobs`.
"""

from .attention import PackedCoreAttention
from .cpu_device import CpuDeviceAdapter, cpu_device_adapter
from .layer_spec import (
    LocalLayerNorm,
    LocalRMSNorm,
    get_packed_gpt_block_spec,
    get_packed_gpt_layer_spec,
    resolve_attention_backend,
)
from .model import build_gpt_model, initialize_parallel, transformer_config
from .packed_seq import ThdLayout, thd_layout, to_packed_seq_params
from .parallel_groups import ParallelGroups, verify_plan_across_ranks
from .prepare import PreparedMicroBatch, per_sample_logprobs, prepare_micro_batch
from .schedule import StepResult, compute_logprobs, run_step

__all__ = [
    "CpuDeviceAdapter",
    "LocalLayerNorm",
    "LocalRMSNorm",
    "PackedCoreAttention",
    "ParallelGroups",
    "PreparedMicroBatch",
    "StepResult",
    "ThdLayout",
    "build_gpt_model",
    "compute_logprobs",
    "cpu_device_adapter",
    "get_packed_gpt_block_spec",
    "get_packed_gpt_layer_spec",
    "initialize_parallel",
    "per_sample_logprobs",
    "prepare_micro_batch",
    "resolve_attention_backend",
    "run_step",
    "thd_layout",
    "to_packed_seq_params",
    "transformer_config",
    "verify_plan_across_ranks",
]
