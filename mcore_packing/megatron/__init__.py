# ruff: noqa: E402  (the warning filter must precede the first megatron-core import)
"""The Megatron-Core-facing layer: PackedSeqParams, THD attention, layer specs, model building, the CPU
device adapter, and the schedule driver that runs a step plan through Megatron's pipeline schedule.

Importing this package imports megatron-core; the packing and planning layers do not.

- `packed_seq`: `to_packed_seq_params` (+ the host-side `ThdLayout` attention reads).
- `te_contract`: what TransformerEngine reads of a THD micro-batch, decided per TE and megatron-core
  version (`te_thd_fields`) and checked (`check_te_contract`).
- `seeded_init`: initial weights that are a function of the seed and the shape only (any layout, device).
- `attention`: `PackedCoreAttention`, THD/BSHD causal attention for the local layer spec.
- `layer_spec`: `get_packed_gpt_layer_spec` / `get_packed_gpt_block_spec` (TE's when importable).
- `model`: `start_world_of_one` (a plain process's world, its store in memory), `initialize_parallel`,
  `transformer_config` (from a `ModelShape`), `build_gpt_model`, `build_gpt_chunks` (a stage's chunks under a
  virtual pipeline).
- `dynamic_cp`: the step of a dynamic-CP plan (each planned row on its CP sub-group), reached through
  `forward_backward` / `compute_logprobs`.
- `_patches`: every change to megatron-core's or torch's behaviour, each tied to the megatron-core versions
  it applies to: `cpu_device_adapter()` (Megatron's hard-coded CUDA call sites redirected on CPU), the
  distributed optimizer's torch-Adam load repairs.
- `process_groups`: `ProcessGroups` over Megatron's ``ProcessGroupCollection`` (the one reader of
  ``parallel_state`` on the step path; `with_dynamic_cp` adds dynamic CP's sub-groups, `DynamicCPGroups`),
  `verify_plan_across_ranks`.
- `prepare`: this rank's `PreparedMicroBatch`es, and `per_sample_logprobs` back from the output.
- `step_loss`: the loss protocol: `TokenMeanNLL`, `SequenceMeanNLL`, `PerSequence`, `PerSample`, `PerGroup`;
  `policy_step_loss` (a policy loss as its aggregation asks).
- `output_layer`: `output_layers` and `DeferredLogits`, the last stage's output layer as its hooks see it.
- `temperature`: `logits_temperature`, log-probs at the sampling temperature.
- `chunked_logprobs`: `chunk_logprobs`, the output layer and the cross-entropy a chunk of tokens at a time
  (no whole fp32 ``[T, V/TP]`` logits; ``model.logprob_chunk_size``).
- `reward_head`: `RewardHead`, a reward model's score head in place of the output layer (``head="reward"``).
- `entropy`: `vocab_parallel_entropy` / `capture_entropy`, the policy's exact token entropy, chunked.
- `router_replay`: `install_router_replay` / `RouterReplay`, an MoE model routing each token to the experts its
  sample's ``routed_experts`` name (RL's router replay).
- `schedule`: `forward_backward` (forward and backward of a plan), `compute_logprobs`.
- `policy`: `Policy` (model chunks, optimizer, schedule, process groups, device) and `build_policy`, the
  one builder of a policy and of its frozen reference.
- `train_step`: `train_step`: `forward_backward`, then Megatron's optimizer and LR schedule steps.
"""

from ..compat import quiet_megatron_imports

quiet_megatron_imports()  # before the first megatron-core import below

from ._patches.cpu_device import CpuDeviceAdapter, cpu_device_adapter
from .attention import PackedCoreAttention
from .chunked_logprobs import chunk_logprobs
from .layer_spec import (
    LocalLayerNorm,
    LocalRMSNorm,
    get_packed_gpt_block_spec,
    get_packed_gpt_layer_spec,
    resolve_attention_backend,
)
from .model import build_gpt_chunks, build_gpt_model, initialize_parallel, start_world_of_one, transformer_config
from .packed_seq import ThdLayout, thd_layout, to_packed_seq_params
from .policy import Policy, build_policy
from .prepare import PreparedMicroBatch, per_sample_logprobs, prepare_micro_batch
from .process_groups import ProcessGroups, verify_plan_across_ranks
from .router_replay import RouterReplay, install_router_replay
from .schedule import StepResult, compute_logprobs, forward_backward
from .seeded_init import seeded_init_
from .step_loss import (
    PerGroup,
    PerSample,
    PerSequence,
    PerSequenceValues,
    SequenceMeanNLL,
    StepLoss,
    TokenMeanNLL,
    nll_loss,
    policy_step_loss,
)
from .te_contract import check_te_contract, te_thd_fields
from .temperature import logits_temperature
from .train_step import StepOutcome, train_step

__all__ = [
    "CpuDeviceAdapter",
    "LocalLayerNorm",
    "LocalRMSNorm",
    "PackedCoreAttention",
    "PerGroup",
    "PerSample",
    "PerSequence",
    "PerSequenceValues",
    "Policy",
    "PreparedMicroBatch",
    "ProcessGroups",
    "RouterReplay",
    "SequenceMeanNLL",
    "StepLoss",
    "StepOutcome",
    "StepResult",
    "ThdLayout",
    "TokenMeanNLL",
    "build_gpt_chunks",
    "build_gpt_model",
    "build_policy",
    "check_te_contract",
    "chunk_logprobs",
    "compute_logprobs",
    "cpu_device_adapter",
    "forward_backward",
    "get_packed_gpt_block_spec",
    "get_packed_gpt_layer_spec",
    "initialize_parallel",
    "install_router_replay",
    "logits_temperature",
    "nll_loss",
    "per_sample_logprobs",
    "policy_step_loss",
    "prepare_micro_batch",
    "resolve_attention_backend",
    "seeded_init_",
    "start_world_of_one",
    "te_thd_fields",
    "thd_layout",
    "to_packed_seq_params",
    "train_step",
    "transformer_config",
    "verify_plan_across_ranks",
]
