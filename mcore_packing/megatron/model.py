"""Build a Megatron GPTModel wired for packed/dynamic micro-batches (used by the trainer and benchmarks).

``initialize_parallel`` sets up Megatron's process groups; ``transformer_config`` turns a `ModelShape`
into Megatron's ``TransformerConfig``; ``build_gpt_model`` returns the model chunk wrapped in Megatron
DDP with ``finalize_model_grads`` and ``no_sync`` hooked into the config, so `schedule.run_step` gets
exact gradients.
"""

from __future__ import annotations

import torch

from ..compat import require_megatron
from ..planning.model_shape import ModelShape

__all__ = ["build_gpt_model", "initialize_parallel", "transformer_config"]


def initialize_parallel(*, tp: int = 1, pp: int = 1, cp: int = 1, seed: int = 1234) -> None:
    """Initialize Megatron's model-parallel groups (torch.distributed must be initialized)."""
    require_megatron()
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, context_parallel_size=cp
    )
    model_parallel_cuda_manual_seed(seed, inference_rng_tracker=not torch.cuda.is_available())


def transformer_config(
    shape: ModelShape,
    *,
    tp: int = 1,
    pp: int = 1,
    cp: int = 1,
    sequence_parallel: bool = False,
    variable_seq_lengths: bool = False,
    dtype: torch.dtype = torch.float32,
):
    """Megatron's ``TransformerConfig`` for ``shape`` on a layout (dropout off, as SFT/RL recipes use)."""
    require_megatron()
    from megatron.core.transformer.transformer_config import TransformerConfig

    extra = {"moe_token_dispatcher_type": "alltoall"} if variable_seq_lengths else {}
    if shape.gated_mlp:
        extra.update(gated_linear_unit=True, activation_func=torch.nn.functional.silu)
    return TransformerConfig(
        num_layers=shape.num_layers,
        hidden_size=shape.hidden_size,
        num_attention_heads=shape.num_attention_heads,
        num_query_groups=shape.num_query_groups,
        ffn_hidden_size=shape.ffn_size,
        normalization=shape.normalization,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        context_parallel_size=cp,
        sequence_parallel=sequence_parallel,
        use_cpu_initialization=not torch.cuda.is_available(),
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        variable_seq_lengths=variable_seq_lengths,
        **extra,
    )


def build_gpt_model(
    shape: ModelShape,
    *,
    tp: int = 1,
    pp: int = 1,
    cp: int = 1,
    sequence_parallel: bool = False,
    variable_seq_lengths: bool = False,
    dtype: torch.dtype = torch.float32,
    attention_backend: str = "auto",
    seed: int = 0,
    device: torch.device | str | None = None,
):
    """A DDP-wrapped GPTModel chunk for this pipeline stage and its TransformerConfig."""
    require_megatron()
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.models.gpt import GPTModel

    from .layer_spec import get_packed_gpt_block_spec

    config = transformer_config(
        shape,
        tp=tp,
        pp=pp,
        cp=cp,
        sequence_parallel=sequence_parallel,
        variable_seq_lengths=variable_seq_lengths,
        dtype=dtype,
    )
    torch.manual_seed(seed)
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_packed_gpt_block_spec(config, attention_backend),
        vocab_size=shape.vocab_size,
        max_sequence_length=shape.max_sequence_length,
        position_embedding_type="rope",
        share_embeddings_and_output_weights=False,
        pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(),
    )
    if device is not None:
        model = model.to(device)
    ddp = DistributedDataParallel(
        config,
        DistributedDataParallelConfig(overlap_grad_reduce=False, use_distributed_optimizer=False),
        model,
    )
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = ddp.no_sync
    return ddp, config
