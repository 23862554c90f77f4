"""Build a Megatron GPTModel wired for packed/dynamic micro-batches (used by the trainer and benchmarks).

``initialize_parallel`` sets up Megatron's process groups for a `ParallelLayout`; ``transformer_config``
turns a `ModelShape` on a layout into Megatron's ``TransformerConfig``; ``build_gpt_chunks`` returns this
stage's model chunks (one per virtual pipeline stage; ``build_gpt_model`` the one chunk without VPP), each
wrapped in Megatron DDP with ``finalize_model_grads`` and ``no_sync`` hooked into the config,
so `schedule.forward_backward` gets exact gradients. The layout's DP size is what Megatron derives from
the world; model building reads only tp, pp, cp, ep, vpp and sequence_parallel from it.
"""

from __future__ import annotations

import torch

from ..compat import require_megatron
from ..planning.layout import SINGLE_RANK, ParallelLayout
from ..planning.model_shape import ModelShape, padded_vocab_size

__all__ = [
    "INIT_MODES",
    "build_gpt_chunks",
    "build_gpt_model",
    "initialize_parallel",
    "moe_config",
    "padded_vocab_size",
    "transformer_config",
]


INIT_MODES = ("seeded", "megatron", "none")
"""How `build_gpt_chunks` sets the initial weights (see its docstring)."""
HEADS = ("lm", "reward")
"""What the last stage ends in: the vocabulary projection, or a reward model's score head."""


def start_world_of_one(backend: str = "gloo") -> None:
    """Start torch.distributed as a world of one process (rank 0) whose store lives in memory: no
    MASTER_PORT to pick, so no port a neighbouring process can take between the pick and the bind. A no-op
    when torch.distributed is already started. ``backend="nccl"`` wants ``torch.cuda.set_device`` first."""
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)


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
        expert_tensor_parallel_size=layout.expert_tp,
        virtual_pipeline_model_parallel_size=layout.vpp if layout.vpp > 1 else None,
    )
    model_parallel_cuda_manual_seed(seed, inference_rng_tracker=not torch.cuda.is_available())


def transformer_config(
    shape: ModelShape,
    layout: ParallelLayout = SINGLE_RANK,
    *,
    variable_seq_lengths: bool = False,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
    cpu_initialization: bool | None = None,
    recompute: str | None = None,
):
    """Megatron's ``TransformerConfig`` for ``shape`` on a layout (dropout off, as SFT/RL recipes use).

    ``recompute``: Megatron's ``recompute_granularity``: None, "selective" (the core attention, Megatron's
    default module list) or "full" (every layer, one per checkpoint: ``recompute_method="uniform"``,
    ``recompute_num_layers=1``).

    ``device``: the run's device (default: CUDA when present). Megatron makes the parameters on the CPU
    (``use_cpu_initialization``) for a CPU run, on the GPU for a GPU run, unless ``cpu_initialization``
    says otherwise. (Megatron's own draws stay on: they also set the parameters' TP attributes, which
    its optimizer and `seeded_init` read.) ``apply_rope_fusion`` is on where TransformerEngine's fused RoPE
    can run (TE importable and a CUDA run): Megatron's unfused THD RoPE reads cu_seqlens to the host in
    every layer (`tests/test_sync_budget.py`)."""
    require_megatron()
    from megatron.core.transformer.transformer_config import TransformerConfig

    from ..compat import te_available

    on_gpu = torch.device(device).type == "cuda" if device is not None else torch.cuda.is_available()

    extra = {"moe_token_dispatcher_type": "alltoall"} if variable_seq_lengths else {}
    if shape.gated_mlp:
        extra.update(gated_linear_unit=True, activation_func=torch.nn.functional.silu)
    extra.update(_attention_and_activation(shape))
    tp = layout.tp
    layout.check_heads(shape.num_attention_heads, shape.kv_heads)
    layout.check_experts(shape.num_experts, biased=shape.is_moe and shape.linear_bias)
    layout.check_layers(shape.num_layers)
    extra.update(moe_config(shape, layout))
    if layout.vpp > 1:  # P2P as Megatron-LM runs the interleaved schedule: unbatched, overlapped
        extra.update(_interleaved_p2p(layout))
    if recompute not in (None, "selective", "full"):
        raise ValueError(f"recompute={recompute!r} is not one of None, 'selective', 'full' (Megatron's "
                         "recompute_granularity).")  # fmt: skip
    if recompute is not None:
        extra["recompute_granularity"] = recompute
    if recompute == "full":
        extra.update(recompute_method="uniform", recompute_num_layers=1)
    config = TransformerConfig(
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
        use_cpu_initialization=not on_gpu if cpu_initialization is None else cpu_initialization,
        # TE's fused RoPE refuses YaRN's attention factor (Megatron raises on mscale != 1)
        apply_rope_fusion=on_gpu and te_available() and shape.yarn_factor is None,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        variable_seq_lengths=variable_seq_lengths,
        **extra,
    )
    if shape.yarn_factor is not None:  # read by getattr (GPTModel's YarnRotaryEmbedding, Attention's mscale)
        config.yarn_rotary_scaling_factor = shape.yarn_factor
        config.yarn_original_max_position_embeddings = shape.yarn_original_max_position_embeddings
        config.yarn_beta_fast, config.yarn_beta_slow = shape.yarn_beta_fast, shape.yarn_beta_slow
        config.yarn_mscale, config.yarn_mscale_all_dim = 1.0, 0.0  # attention factor 0.1 ln(factor) + 1, as HF's
        config.yarn_correction_range_round_to_int = shape.yarn_truncate
    return config


def _attention_and_activation(shape: ModelShape) -> dict:
    """GPT-OSS's parts as Megatron's fields: the sliding window ``(W - 1, 0)`` on the listed layers
    (``window_attn_skip_freq`` as a per-layer list), learned sinks (``softmax_type="learnable"``), and the
    clamped SwiGLU (quick_gelu gate, ``glu_linear_offset=1`` on the up half, both halves clamped)."""
    extra = {}
    if shape.window_size is not None:
        extra.update(window_size=(shape.window_size - 1, 0),
                     window_attn_skip_freq=[int(w) for w in shape.window_per_layer()])  # fmt: skip
    if shape.attention_sinks:
        extra["softmax_type"] = "learnable"
    if shape.swiglu_limit is not None:
        from megatron.core.fusions.fused_bias_geglu import quick_gelu

        extra.update(activation_func=quick_gelu, glu_linear_offset=1.0, activation_func_clamp_value=shape.swiglu_limit)
    return extra


def _interleaved_p2p(layout: ParallelLayout) -> dict:
    """The interleaved schedule's fields. P2P goes unbatched and overlapped (Megatron-LM's default under a
    virtual pipeline): the batched path posts a send to the previous and one to the next stage in one
    order on every rank, so at pp=2, where both are the same peer, an activation meets a gradient's
    receive (measured on gloo: gradients off by 40x at fixed shapes, a hang or a shape error with
    variable ones; `tests/test_interleaved.py` keeps it as a negative control)."""
    return dict(
        virtual_pipeline_model_parallel_size=layout.vpp,
        microbatch_group_size_per_vp_stage=layout.microbatch_group,
        overlap_p2p_comm=True,
        batch_p2p_comm=False,
    )


def moe_config(shape: ModelShape, layout: ParallelLayout) -> dict:
    """The ``TransformerConfig`` fields of a Mixture-of-Experts shape ({} for a dense one): dropless top-k
    routing in fp32 (no capacity factor: every token reaches its k experts whatever the batch split), the
    all-to-all dispatcher, experts split over ``layout.ep`` ranks (expert TP: ``layout.expert_tp``), per-layer MoE/dense
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
        expert_tensor_parallel_size=layout.expert_tp,
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


def build_gpt_model(shape: ModelShape, layout: ParallelLayout = SINGLE_RANK, **options):
    """A DDP-wrapped GPTModel chunk for this pipeline stage and its TransformerConfig (`build_gpt_chunks`
    with one chunk per stage; under ``layout.vpp > 1`` use `build_gpt_chunks`)."""
    if layout.vpp > 1:
        raise ValueError(f"layout.vpp={layout.vpp} builds {layout.vpp} model chunks per stage: call build_gpt_chunks.")
    chunks, config = build_gpt_chunks(shape, layout, **options)
    return chunks[0], config


def build_gpt_chunks(
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
    init: str = "seeded",
    cpu_initialization: bool | None = None,
    head: str = "lm",
    recompute: str | None = None,
):
    """This pipeline stage's model chunks (``layout.vpp`` of them, Megatron's virtual pipeline; one
    without it), each a GPTModel wrapped in Megatron DDP, and their TransformerConfig. GPTModel and DDP
    get ``process_groups``' collection explicitly (default `ProcessGroups.from_megatron()`). Chunk ``v``
    of stage ``s`` holds model chunk ``v * pp + s`` (Megatron's layer offsets); the embedding sits in
    chunk 0 of the first stage, the head in the last chunk of the last stage.

    ``use_distributed_optimizer`` lays the gradient buffer out for Megatron's distributed optimizer
    (optimizer state sharded over DP); ``grad_reduce_in_fp32`` keeps the gradient buffer (and its
    all-reduce) in fp32 when the parameters are bf16.

    ``init``: "seeded" (default) draws every weight from ``seed`` and the parameter's global name
    (`seeded_init`: the same weights on every layout and device, for the policy and its reference);
    "megatron" keeps Megatron's own draws (which depend on TP, the stage and the device's RNG); "none"
    keeps them too, for a caller that then loads every parameter (a checkpoint): no seeded draw.
    ``cpu_initialization`` overrides where Megatron makes the parameters (default: on the run's device;
    tests drive the GPU branch on a CPU with False).
    ``head``: "lm" (the vocabulary projection) or "reward" (a reward model: `reward_head.RewardHead`, one
    score per token, the embedding untied from it). ``recompute``: as in `transformer_config`.
    """
    if init not in INIT_MODES:
        raise ValueError(f"init={init!r} is not one of {INIT_MODES}.")
    if head not in HEADS:
        raise ValueError(f"head={head!r} is not one of {HEADS}.")
    require_megatron()
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads

    from .process_groups import ProcessGroups

    pgs = process_groups or ProcessGroups.from_megatron()
    if shape.is_moe:
        from ._patches.moe_without_te import define_missing_te_gemm

        define_missing_te_gemm()
    config = transformer_config(shape, layout, variable_seq_lengths=variable_seq_lengths, dtype=dtype, device=device,
                                cpu_initialization=cpu_initialization, recompute=recompute)  # fmt: skip
    torch.manual_seed(seed)
    ddp_config = DistributedDataParallelConfig(
        overlap_grad_reduce=False, use_distributed_optimizer=use_distributed_optimizer,
        grad_reduce_in_fp32=grad_reduce_in_fp32,
    )  # fmt: skip
    chunks = []
    for vp_stage in range(layout.vpp):
        model = _gpt_chunk(shape, layout, config, pgs, attention_backend, vp_stage, head=head, seed=seed)
        if init == "seeded":
            _seeded(model, shape, layout, pgs, seed)
        if device is not None:
            model = model.to(device)
        chunks.append(DistributedDataParallel(config, ddp_config, model, pg_collection=pgs.collection,
                                              disable_bucketing=vp_stage > 0))  # fmt: skip
    config.finalize_model_grads_func = finalize_model_grads
    config.mcore_packing_head = head  # every stage's config says what the last stage ends in (`schedule`)
    config.no_sync_func = chunks[0].no_sync if len(chunks) == 1 else [chunk.no_sync for chunk in chunks]
    return chunks, config


def _seeded(model, shape: ModelShape, layout: ParallelLayout, pgs, seed: int) -> None:
    """`seeded_init.seeded_init_` with this rank's TP and EP place."""
    from .process_groups import group_rank
    from .seeded_init import seeded_init_

    offset = group_rank(pgs.ep) * (shape.num_experts // layout.ep) if shape.is_moe else 0
    seeded_init_(model, seed=seed, num_layers=shape.num_layers, vocab_size=shape.vocab_size,
                 tp_rank=group_rank(pgs.tp), tp_size=layout.tp, expert_offset=offset,
                 etp_rank=group_rank(pgs.expert_tp), etp_size=layout.expert_tp)  # fmt: skip


def _gpt_chunk(shape: ModelShape, layout: ParallelLayout, config, pgs, attention_backend: str, vp_stage: int, *,
               head: str = "lm", seed: int = 0):  # fmt: skip
    """Model chunk ``vp_stage`` of this stage: a GPTModel with the packed layer spec, the padded
    vocabulary masked on the head (or, ``head="reward"``, the reward head in its place), and, for
    Mixture-of-Experts, the router loss installed."""
    from megatron.core.models.gpt import GPTModel

    from .layer_spec import get_packed_gpt_block_spec
    from .process_groups import group_rank

    tp, vpp = layout.tp, layout.vpp
    stage = vp_stage if vpp > 1 else None
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_packed_gpt_block_spec(config, attention_backend, vp_stage=stage),
        vocab_size=padded_vocab_size(shape.vocab_size, tp),
        max_sequence_length=shape.max_sequence_length,
        position_embedding_type="rope" if shape.yarn_factor is None else "yarn",
        rotary_base=shape.rotary_base,
        rope_scaling=shape.rope_scaling_factor is not None,
        rope_scaling_factor=shape.rope_scaling_factor or 8.0,
        share_embeddings_and_output_weights=shape.tie_embeddings and head == "lm",
        pre_process=pgs.is_first_stage and vp_stage == 0,
        post_process=pgs.is_last_stage and vp_stage == vpp - 1,
        pg_collection=pgs.collection,
        vp_stage=stage,
    )
    if model.post_process and head == "reward":
        from .reward_head import install_reward_head

        install_reward_head(model, seed=seed, tp_group=pgs.tp)
    elif model.post_process and padded_vocab_size(shape.vocab_size, tp) != shape.vocab_size:
        _mask_padded_vocab(model.output_layer, shape.vocab_size, tp, group_rank(pgs.tp))
    if shape.is_moe:
        from .router_loss import RouterLoss, RouterLossConfig

        if shape.linear_bias:
            from ._patches.expert_bias_add import install

            install(model)
        _experts_apart(model)
        RouterLoss.install(model, RouterLossConfig.from_shape(shape), reduce_group=pgs.collection.tp_cp,
                           num_moe_layers=sum(shape.moe_layers()))  # fmt: skip
    return model
