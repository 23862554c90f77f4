"""Build a Megatron GPTModel wired for packed/dynamic micro-batches (used by the trainer and benchmarks).

``initialize_parallel`` sets up Megatron's process groups for a `ParallelLayout`; ``transformer_config``
turns a `ModelShape` on a layout into Megatron's ``TransformerConfig``; ``build_gpt_model`` returns the
model chunk wrapped in Megatron DDP with ``finalize_model_grads`` and ``no_sync`` hooked into the config,
so `schedule.forward_backward` gets exact gradients. The layout's DP size is what Megatron derives from
the world; model building reads only tp, pp, cp and sequence_parallel from it.
"""

from __future__ import annotations

import torch

from ..compat import require_megatron
from ..planning.layout import SINGLE_RANK, ParallelLayout
from ..planning.model_shape import ModelShape

__all__ = ["build_gpt_model", "initialize_parallel", "moe_config", "padded_vocab_size", "transformer_config"]


def initialize_parallel(layout: ParallelLayout = SINGLE_RANK, *, seed: int = 1234) -> None:
    """Initialize Megatron's model-parallel groups for ``layout`` (torch.distributed must be initialized)."""
    require_megatron()
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        context_parallel_size=layout.cp,
        expert_model_parallel_size=layout.ep,
    )
    model_parallel_cuda_manual_seed(seed, inference_rng_tracker=not torch.cuda.is_available())


def transformer_config(
    shape: ModelShape,
    layout: ParallelLayout = SINGLE_RANK,
    *,
    variable_seq_lengths: bool = False,
    dtype: torch.dtype = torch.float32,
):
    """Megatron's ``TransformerConfig`` for ``shape`` on a layout (dropout off, as SFT/RL recipes use)."""
    require_megatron()
    from megatron.core.transformer.transformer_config import TransformerConfig

    extra = {"moe_token_dispatcher_type": "alltoall"} if variable_seq_lengths else {}
    if shape.gated_mlp:
        extra.update(gated_linear_unit=True, activation_func=torch.nn.functional.silu)
    tp = layout.tp
    layout.check_heads(shape.num_attention_heads, shape.kv_heads)
    layout.check_experts(shape.num_experts)
    extra.update(moe_config(shape, layout))
    return TransformerConfig(
        num_layers=shape.num_layers,
        hidden_size=shape.hidden_size,
        num_attention_heads=shape.num_attention_heads,
        num_query_groups=shape.num_query_groups,
        kv_channels=shape.head_size,
        ffn_hidden_size=shape.ffn_size,
        normalization=shape.normalization,
        layernorm_epsilon=shape.norm_epsilon,
        add_bias_linear=shape.linear_bias,
        add_qkv_bias=shape.qkv_bias,
        qk_layernorm=shape.qk_norm,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=layout.pp,
        context_parallel_size=layout.cp,
        sequence_parallel=layout.sequence_parallel,
        use_cpu_initialization=not torch.cuda.is_available(),
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        variable_seq_lengths=variable_seq_lengths,
        **extra,
    )


def moe_config(shape: ModelShape, layout: ParallelLayout) -> dict:
    """The ``TransformerConfig`` fields of a Mixture-of-Experts shape ({} for a dense one): dropless top-k
    routing in fp32 (no capacity factor: every token reaches its k experts whatever the batch split), the
    all-to-all dispatcher, experts split over ``layout.ep`` ranks (expert TP = TP), per-layer MoE/dense
    pattern. A softmax router with top-k renormalization is Megatron's top-k-then-softmax; without it,
    softmax-then-top-k (``moe_router_pre_softmax``). Megatron's own balance and z-losses stay off: the
    shape's are `router_loss.RouterLoss`, exact under packing (`build_gpt_model` installs it)."""
    if not shape.is_moe:
        return {}
    return dict(
        num_moe_experts=shape.num_experts,
        moe_router_topk=shape.moe_router_topk,
        moe_ffn_hidden_size=shape.expert_size,
        moe_shared_expert_intermediate_size=shape.moe_shared_expert_size,
        moe_shared_expert_gate=shape.moe_shared_expert_gate,
        moe_layer_freq=[int(moe) for moe in shape.moe_layers()],
        moe_router_score_function=shape.moe_router_score,
        moe_router_pre_softmax=shape.moe_router_score == "softmax" and not shape.moe_router_topk_norm,
        moe_router_enable_expert_bias=shape.moe_router_expert_bias,
        moe_router_dtype="fp32",
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        moe_z_loss_coeff=None,
        moe_token_dispatcher_type="alltoall",
        moe_grouped_gemm=False,
        expert_model_parallel_size=layout.ep,
    )


def _experts_apart(model) -> None:
    """Mark the routed experts' parameters as expert-parallel at every EP size (Megatron does only at
    EP > 1): DDP then reduces their gradients over the expert-data-parallel group (at EP 1 the same ranks
    as DP x CP, so the gradients are unchanged) and Megatron's optimizer keeps them in an optimizer of
    their own, so the optimizer state is laid out alike at every EP and a checkpoint reshards across EP."""
    for module in model.modules():
        if getattr(module, "is_expert", False):
            for param in module.parameters(recurse=False):
                param.allreduce = False


def padded_vocab_size(vocab_size: int, tp: int) -> int:
    """The vocabulary rounded up to a multiple of TP (each TP rank holds an equal slice of it)."""
    return -(-vocab_size // tp) * tp


def _mask_padded_vocab(output_layer, vocab_size: int, tp: int, tp_rank: int) -> None:
    """Logits of the padding rows (past the real vocabulary) become the dtype's minimum, so softmax and
    the loss are those of the real vocabulary: zero rows alone would still add exp(0) per row."""
    per_rank = padded_vocab_size(vocab_size, tp) // tp
    first_padded = vocab_size - tp_rank * per_rank  # local column index
    if first_padded >= per_rank:
        return

    def mask(module, args, output):
        logits, bias = output
        return logits.masked_fill(_column_mask(logits, max(first_padded, 0)), torch.finfo(logits.dtype).min), bias

    output_layer.register_forward_hook(mask)


def _column_mask(logits: torch.Tensor, first: int) -> torch.Tensor:
    column = torch.arange(logits.shape[-1], device=logits.device)
    return column >= first


def build_gpt_model(
    shape: ModelShape,
    layout: ParallelLayout = SINGLE_RANK,
    *,
    variable_seq_lengths: bool = False,
    dtype: torch.dtype = torch.float32,
    attention_backend: str = "auto",
    seed: int = 0,
    device: torch.device | str | None = None,
    use_distributed_optimizer: bool = False,
    grad_reduce_in_fp32: bool = False,
    process_groups=None,
):
    """A DDP-wrapped GPTModel chunk for this pipeline stage and its TransformerConfig. GPTModel and DDP get
    ``process_groups``' collection explicitly (default `ProcessGroups.from_megatron()`).

    ``use_distributed_optimizer`` lays the gradient buffer out for Megatron's distributed optimizer
    (optimizer state sharded over DP); ``grad_reduce_in_fp32`` keeps the gradient buffer (and its
    all-reduce) in fp32 when the parameters are bf16.
    """
    require_megatron()
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.models.gpt import GPTModel

    from .layer_spec import get_packed_gpt_block_spec
    from .process_groups import ProcessGroups, group_rank

    pgs = process_groups or ProcessGroups.from_megatron()
    if shape.is_moe:
        from ._patches.moe_without_te import define_missing_te_gemm

        define_missing_te_gemm()

    tp = layout.tp
    config = transformer_config(shape, layout, variable_seq_lengths=variable_seq_lengths, dtype=dtype)
    torch.manual_seed(seed)
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_packed_gpt_block_spec(config, attention_backend),
        vocab_size=padded_vocab_size(shape.vocab_size, tp),
        max_sequence_length=shape.max_sequence_length,
        position_embedding_type="rope",
        rotary_base=shape.rotary_base,
        rope_scaling=shape.rope_scaling_factor is not None,
        rope_scaling_factor=shape.rope_scaling_factor or 8.0,
        share_embeddings_and_output_weights=shape.tie_embeddings,
        pre_process=pgs.is_first_stage,
        post_process=pgs.is_last_stage,
        pg_collection=pgs.collection,
    )
    if model.post_process and padded_vocab_size(shape.vocab_size, tp) != shape.vocab_size:
        _mask_padded_vocab(model.output_layer, shape.vocab_size, tp, group_rank(pgs.tp))
    if shape.is_moe:
        from .router_loss import RouterLoss, RouterLossConfig

        _experts_apart(model)
        RouterLoss.install(model, RouterLossConfig.from_shape(shape), reduce_group=pgs.collection.tp_cp,
                           num_moe_layers=sum(shape.moe_layers()))  # fmt: skip
    if device is not None:
        model = model.to(device)
    ddp = DistributedDataParallel(
        config,
        DistributedDataParallelConfig(
            overlap_grad_reduce=False,
            use_distributed_optimizer=use_distributed_optimizer,
            grad_reduce_in_fp32=grad_reduce_in_fp32,
        ),
        model,
        pg_collection=pgs.collection,
    )
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = ddp.no_sync
    return ddp, config
