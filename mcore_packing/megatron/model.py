"""Build a Megatron GPTModel wired for packed/dynamic micro-batches (used by the trainer and benchmarks).

``initialize_parallel`` sets up Megatron's process groups; ``build_gpt_model`` returns the model chunk
wrapped in Megatron DDP with ``finalize_model_grads`` and ``no_sync`` hooked into the config, so
`schedule.run_step` gets exact gradients.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..compat import require_megatron

__all__ = ["GPTShape", "build_gpt_model", "initialize_parallel"]


@dataclass(frozen=True, kw_only=True)
class GPTShape:
    """Model shape.

    Attributes:
        num_layers: transformer layers.
        hidden_size: model width.
        num_attention_heads: query heads.
        num_query_groups: key/value heads (grouped-query attention); None means one per query head.
        ffn_hidden_size: MLP width; None means 4 x hidden_size.
        vocab_size: vocabulary size (padded by the caller if needed).
        max_sequence_length: longest sequence the RoPE tables must cover.
        normalization: ``LayerNorm`` or ``RMSNorm``.
    """

    num_layers: int = 2
    hidden_size: int = 128
    num_attention_heads: int = 4
    num_query_groups: int | None = None
    ffn_hidden_size: int | None = None
    vocab_size: int = 1024
    max_sequence_length: int = 4096
    normalization: str = "LayerNorm"

    def __post_init__(self):
        for name in ("num_layers", "hidden_size", "num_attention_heads", "vocab_size", "max_sequence_length"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"model.{name} must be a positive integer, got {value!r}.")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"model.hidden_size={self.hidden_size} is not divisible by num_attention_heads="
                f"{self.num_attention_heads}; pick a head count that divides the width."
            )
        if self.normalization not in ("LayerNorm", "RMSNorm"):
            raise ValueError(f"model.normalization must be 'LayerNorm' or 'RMSNorm', got {self.normalization!r}.")


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


def build_gpt_model(
    shape: GPTShape,
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
    from megatron.core.transformer.transformer_config import TransformerConfig

    from .layer_spec import get_packed_gpt_block_spec

    extra = {"moe_token_dispatcher_type": "alltoall"} if variable_seq_lengths else {}
    on_cpu = not torch.cuda.is_available()
    config = TransformerConfig(
        num_layers=shape.num_layers,
        hidden_size=shape.hidden_size,
        num_attention_heads=shape.num_attention_heads,
        num_query_groups=shape.num_query_groups,
        ffn_hidden_size=shape.ffn_hidden_size or 4 * shape.hidden_size,
        normalization=shape.normalization,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        context_parallel_size=cp,
        sequence_parallel=sequence_parallel,
        use_cpu_initialization=on_cpu,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        variable_seq_lengths=variable_seq_lengths,
        **extra,
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
