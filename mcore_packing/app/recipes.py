"""NeMo-style recipes: plain functions that return a complete, validated `TrainConfig`.

Each takes ``num_nodes`` and ``gpus_per_node`` and picks a parallel layout that fits them. The model is
the real family it names (built from the published config.json fields in `HF_CONFIGS`); a real run
starts from its Hugging Face checkpoint, ``model.hf_path=/path/to/folder`` (a run without it is an error
naming the key; ``--dry-run`` works without). SFT recipes train on the bundled CHAMP conversations, with
the checkpoint's tokenizer and chat template; point ``data=jsonl data.path=...`` at your data. The GRPO
recipe (``algorithm=grpo``) trains on ``grpo.rollouts=/path/rollouts.jsonl``.

    from mcore_packing.app.recipes import llama3_8b_sft_packed, apply_packing
    cfg = llama3_8b_sft_packed(num_nodes=2, gpus_per_node=8)
    cfg = apply_packing(my_cfg, train_mb_tokens=16384)      # add packing to your own config
"""

from __future__ import annotations

import dataclasses

from ..losses import ClippedPGConfig
from ..packing import resolve_algorithm
from ..planning.hf_config import shape_from_hf_config
from .config import (
    ClusterConfig,
    DataConfig,
    GRPOConfig,
    ModelConfig,
    OptimizerConfig,
    ParallelConfig,
    SequencePackingConfig,
    TrainConfig,
    TrainingConfig,
)

__all__ = [
    "HF_CONFIGS",
    "RECIPES",
    "apply_packing",
    "family_model",
    "gpt_oss_20b_grpo",
    "llama3_8b_sft_packed",
    "llama3_70b_sft_long_context",
    "llama32_1b_sft_single_gpu",
    "mixtral_8x7b_sft_packed",
    "qwen2_7b_grpo_cp",
    "qwen3_0_6b_sft_single_gpu",
    "qwen3_8b_sft_packed",
    "qwen3_30b_a3b_grpo",
    "qwen3_30b_a3b_sft_packed",
    "rl_optimizer",
    "sft_optimizer",
    "tiny_cpu_sft",
]


# The published config.json fields of each model (one source: the recipes build their ModelConfig from
# these through the same converter that reads a downloaded checkpoint).
HF_CONFIGS = {
    "Llama-3.1-8B": dict(model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, vocab_size=128256, rms_norm_eps=1e-5,
                         max_position_embeddings=131072, rope_theta=500000.0, rope_scaling=dict(
                             rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                             original_max_position_embeddings=8192)),
    "Llama-3.1-70B": dict(model_type="llama", hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                          num_attention_heads=64, num_key_value_heads=8, vocab_size=128256, rms_norm_eps=1e-5,
                          max_position_embeddings=131072, rope_theta=500000.0, rope_scaling=dict(
                              rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                              original_max_position_embeddings=8192)),
    "Llama-3.2-1B": dict(model_type="llama", hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, vocab_size=128256, rms_norm_eps=1e-5,
                         max_position_embeddings=131072, tie_word_embeddings=True, rope_theta=500000.0,
                         rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0,
                                           high_freq_factor=4.0, original_max_position_embeddings=8192)),
    "Qwen2.5-7B": dict(model_type="qwen2", hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                       num_attention_heads=28, num_key_value_heads=4, vocab_size=152064, rms_norm_eps=1e-6,
                       max_position_embeddings=32768, rope_theta=1000000.0),
    "Qwen3-8B": dict(model_type="qwen3", hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                     rms_norm_eps=1e-6, max_position_embeddings=40960, rope_theta=1000000.0),
    "Qwen3-0.6B": dict(model_type="qwen3", hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                       rms_norm_eps=1e-6, max_position_embeddings=40960, rope_theta=1000000.0,
                       tie_word_embeddings=True),
    "Qwen3-30B-A3B": dict(model_type="qwen3_moe", hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
                          num_attention_heads=32, num_key_value_heads=4, head_dim=128, vocab_size=151936,
                          rms_norm_eps=1e-6, max_position_embeddings=40960, rope_theta=1000000.0, num_experts=128,
                          num_experts_per_tok=8, moe_intermediate_size=768, decoder_sparse_step=1, mlp_only_layers=[],
                          norm_topk_prob=True, router_aux_loss_coef=0.001),
    "Mixtral-8x7B": dict(model_type="mixtral", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, vocab_size=32000, rms_norm_eps=1e-5,
                         max_position_embeddings=32768, rope_theta=1000000.0, num_local_experts=8,
                         num_experts_per_tok=2, router_aux_loss_coef=0.02, sliding_window=None),
    "gpt-oss-20b": dict(model_type="gpt_oss", hidden_size=2880, intermediate_size=2880, num_hidden_layers=24,
                        num_attention_heads=64, num_key_value_heads=8, head_dim=64, vocab_size=201088,
                        rms_norm_eps=1e-5, max_position_embeddings=131072, rope_theta=150000.0,
                        rope_scaling=dict(rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
                                          original_max_position_embeddings=4096),
                        num_local_experts=32, num_experts_per_tok=4, sliding_window=128, swiglu_limit=7.0,
                        attention_bias=True, router_aux_loss_coef=0.9, tie_word_embeddings=False,
                        layer_types=["sliding_attention", "full_attention"] * 12),
}  # fmt: skip


def family_model(name: str, *, max_sequence_length: int | None = None) -> ModelConfig:
    """The ModelConfig of a published model (bf16; ``model.hf_path`` still to be set by the user)."""
    shape = shape_from_hf_config(HF_CONFIGS[name])
    fields = shape.to_dict()
    if max_sequence_length is not None:
        fields["max_sequence_length"] = max_sequence_length
    return ModelConfig(**fields, dtype="bfloat16")


def _encoding(model: ModelConfig) -> str:
    """The bundled vocabulary closest to the family's, for --dry-run without the checkpoint."""
    return "llama3" if model.family in ("llama", "mixtral") else "qwen3"


def _ep_for(world: int, model_parallel: int, experts: int, want: int) -> int:
    """The largest power of two <= ``want`` that divides the experts and the DP x CP ranks left by
    ``model_parallel`` (TP x PP) of ``world`` GPUs (1 when ``world`` is not a multiple: `_fits` says why)."""
    ranks = world // model_parallel if world % model_parallel == 0 else 1
    ep = 1
    while ep * 2 <= want and ranks % (ep * 2) == 0 and experts % (ep * 2) == 0:
        ep *= 2
    return ep


def _cluster(num_nodes: int, gpus_per_node: int, backend: str = "nccl") -> ClusterConfig:
    if num_nodes < 1 or gpus_per_node < 1:
        raise ValueError(f"num_nodes and gpus_per_node must be >= 1, got {num_nodes} and {gpus_per_node}.")
    return ClusterConfig(backend=backend, num_nodes=num_nodes, gpus_per_node=gpus_per_node)


def _tp_for(gpus_per_node: int, want: int) -> int:
    """The largest power of two <= ``want`` that divides the GPUs of a node (TP stays inside a node)."""
    tp = 1
    while tp * 2 <= want and gpus_per_node % (tp * 2) == 0:
        tp *= 2
    return tp


def _fits(cfg: TrainConfig) -> TrainConfig:
    """Refuse a cluster the recipe's layout cannot fill, saying what it needs."""
    par, cl = cfg.parallel, cfg.cluster
    model_parallel = par.tp * par.pp * par.cp
    world = cl.num_nodes * cl.gpus_per_node
    if world % model_parallel:
        raise ValueError(
            f"recipe {cfg.run_name!r} needs a multiple of {model_parallel} GPUs "
            f"(TP{par.tp} x PP{par.pp} x CP{par.cp}); got {cl.num_nodes} node(s) x {cl.gpus_per_node} = {world}. "
            "Give it more GPUs or override parallel.*."
        )
    return cfg


def sft_optimizer(lr: float, steps: int) -> OptimizerConfig:
    """Fine-tuning a pretrained model: AdamW (beta2 0.98), weight decay 0.01, clipping at 1, warmup over
    the first 5% of the steps (at most 50), cosine decay to lr/10; optimizer state sharded over DP."""
    return OptimizerConfig(lr=lr, min_lr=lr / 10, weight_decay=0.01, adam_beta2=0.98, clip_grad=1.0,
                           lr_decay_style="cosine", lr_warmup_iters=min(50, max(1, steps // 20)),
                           use_distributed_optimizer=True)  # fmt: skip


def rl_optimizer(lr: float) -> OptimizerConfig:
    """Policy optimization: a small constant learning rate after a short warmup, weight decay 0.01,
    clipping at 1; optimizer state sharded over DP."""
    return OptimizerConfig(lr=lr, min_lr=lr, weight_decay=0.01, clip_grad=1.0, lr_decay_style="constant",
                           lr_warmup_iters=10, use_distributed_optimizer=True)  # fmt: skip


def _grpo_loss() -> ClippedPGConfig:
    """The GRPO recipes' policy loss: clip 0.2 / 0.28 (DAPO's clip-higher), KL 0.01 to the starting weights,
    token-level, the importance-sampling correction for the inference engine's log-probs."""
    return ClippedPGConfig(ratio_clip_min=0.2, ratio_clip_max=0.28, reference_policy_kl_penalty=0.01,
                           token_level_loss=True, use_importance_sampling_correction=True)  # fmt: skip


def tiny_cpu_sft(num_nodes: int = 1, gpus_per_node: int = 1) -> TrainConfig:
    """The README's main job: a tiny GPT on CHAMP, packed, gloo on CPU; the schema's defaults, so it is
    the same config as the Hydra default (`hydra_configs/config.yaml`, tested)."""
    return TrainConfig(cluster=_cluster(num_nodes, gpus_per_node, "auto"))


def _family_recipe(
    name: str,
    model_name: str,
    *,
    parallel: ParallelConfig,
    packing: SequencePackingConfig,
    training: TrainingConfig,
    optimizer: OptimizerConfig,
    cluster: ClusterConfig,
    max_sample_tokens: int,
) -> TrainConfig:
    model = family_model(model_name)
    data = DataConfig(source="champ_full", encoding=_encoding(model), vocab_size=model.vocab_size,
                      max_sample_tokens=max_sample_tokens)  # fmt: skip
    return _fits(
        TrainConfig(
            model=model,
            optimizer=optimizer,
            data=data,
            sequence_packing=packing,
            parallel=parallel,
            training=training,
            cluster=cluster,
            run_name=name,
        )
    )


def llama3_8b_sft_packed(num_nodes: int = 1, gpus_per_node: int = 8) -> TrainConfig:
    """Llama-3.1-8B SFT with sequence packing: TP within the node with sequence parallelism, DP across."""
    tp = _tp_for(gpus_per_node, 4)
    return _family_recipe(
        "llama3-8b-sft-packed",
        "Llama-3.1-8B",
        parallel=ParallelConfig(tp=tp, sequence_parallel=tp > 1),
        packing=SequencePackingConfig(enabled=True, train_mb_tokens=8192, algorithm="modified_first_fit_decreasing"),
        training=TrainingConfig(global_batch_size=128, steps=1000),
        optimizer=sft_optimizer(1e-5, 1000),
        cluster=_cluster(num_nodes, gpus_per_node),
        max_sample_tokens=8192,
    )


def qwen2_7b_grpo_cp(num_nodes: int = 1, gpus_per_node: int = 8) -> TrainConfig:
    """Qwen2.5-7B GRPO policy step: 64 prompts x 8 responses per step from ``grpo.rollouts`` (your inference
    engine's JSONL, with its log-probs for the importance-sampling correction), long rollouts on CP=2,
    a larger budget for the forward-only log-prob pass, KL to the starting weights."""
    tp = _tp_for(gpus_per_node, 4)
    cfg = _family_recipe(
        "qwen2-7b-grpo-cp",
        "Qwen2.5-7B",
        parallel=ParallelConfig(tp=tp, cp=2, sequence_parallel=tp > 1),
        packing=SequencePackingConfig(
            enabled=True,
            train_mb_tokens=8192,
            logprob_mb_tokens=16384,
            algorithm="modified_first_fit_decreasing",
            microbatch_order="largest_first",
        ),
        training=TrainingConfig(global_batch_size=512, steps=500),  # 64 prompts x 8 responses
        optimizer=rl_optimizer(1e-6),
        cluster=_cluster(num_nodes, gpus_per_node),
        max_sample_tokens=16384,
    )
    grpo = GRPOConfig(num_prompts_per_step=64, num_generations_per_prompt=8)
    loss = _grpo_loss()
    return dataclasses.replace(cfg, algorithm="grpo", grpo=grpo, loss_fn=loss)


def llama3_70b_sft_long_context(num_nodes: int = 8, gpus_per_node: int = 8) -> TrainConfig:
    """Llama-3.1-70B long-context SFT: TP8 in a node, PP4 with variable lengths, CP2."""
    tp = _tp_for(gpus_per_node, 8)
    return _family_recipe(
        "llama3-70b-sft-long-context",
        "Llama-3.1-70B",
        parallel=ParallelConfig(tp=tp, pp=4, cp=2, sequence_parallel=tp > 1, variable_seq_lengths=True),
        packing=SequencePackingConfig(enabled=True, train_mb_tokens=16384),
        training=TrainingConfig(global_batch_size=64, steps=500),
        optimizer=sft_optimizer(5e-6, 500),
        cluster=_cluster(num_nodes, gpus_per_node),
        max_sample_tokens=32768,
    )


def qwen3_8b_sft_packed(num_nodes: int = 1, gpus_per_node: int = 8) -> TrainConfig:
    """Qwen3-8B SFT with packing: TP within the node with sequence parallelism (QK-norm, head_dim 128)."""
    tp = _tp_for(gpus_per_node, 4)
    return _family_recipe(
        "qwen3-8b-sft-packed",
        "Qwen3-8B",
        parallel=ParallelConfig(tp=tp, sequence_parallel=tp > 1),
        packing=SequencePackingConfig(enabled=True, train_mb_tokens=8192),
        training=TrainingConfig(global_batch_size=128, steps=1000),
        optimizer=sft_optimizer(1e-5, 1000),
        cluster=_cluster(num_nodes, gpus_per_node),
        max_sample_tokens=8192,
    )


def qwen3_30b_a3b_sft_packed(num_nodes: int = 1, gpus_per_node: int = 8) -> TrainConfig:
    """Qwen3-30B-A3B SFT with packing: 128 experts (top-8) split over up to 8 expert-parallel ranks, TP2 with
    sequence parallelism, dropless routing (no balance loss until ours is exact under packing)."""
    tp = _tp_for(gpus_per_node, 2)
    ep = _ep_for(num_nodes * gpus_per_node, tp, 128, 8)
    return _family_recipe(
        "qwen3-30b-a3b-sft-packed",
        "Qwen3-30B-A3B",
        parallel=ParallelConfig(tp=tp, ep=ep, sequence_parallel=tp > 1),
        packing=SequencePackingConfig(enabled=True, train_mb_tokens=8192),
        training=TrainingConfig(global_batch_size=128, steps=1000),
        optimizer=sft_optimizer(1e-5, 1000),
        cluster=_cluster(num_nodes, gpus_per_node),
        max_sample_tokens=8192,
    )


def qwen3_30b_a3b_grpo(num_nodes: int = 1, gpus_per_node: int = 8) -> TrainConfig:
    """Qwen3-30B-A3B GRPO policy step: 64 prompts x 8 responses from ``grpo.rollouts`` (with the engine's
    log-probs for the importance-sampling correction), the SFT recipe's layout, KL to the starting weights."""
    cfg = qwen3_30b_a3b_sft_packed(num_nodes, gpus_per_node)
    packing = dataclasses.replace(cfg.sequence_packing, logprob_mb_tokens=16384, microbatch_order="largest_first")
    loss = _grpo_loss()
    return dataclasses.replace(
        cfg, algorithm="grpo", run_name="qwen3-30b-a3b-grpo", sequence_packing=packing, loss_fn=loss,
        training=TrainingConfig(global_batch_size=512, steps=500), optimizer=rl_optimizer(1e-6),
        grpo=GRPOConfig(num_prompts_per_step=64, num_generations_per_prompt=8),
        data=dataclasses.replace(cfg.data, max_sample_tokens=16384),
    )  # fmt: skip


def gpt_oss_20b_grpo(num_nodes: int = 1, gpus_per_node: int = 8) -> TrainConfig:
    """gpt-oss-20b GRPO policy step with router replay (``grpo.router_replay``: the rollouts carry the
    engine's ``routed_experts``): TP1 (at tp > 1 set ``parallel.etp=1``: Megatron-Core has expert biases
    only at expert TP 1), its 32 experts (top-4) over up to 8 expert-parallel ranks, 64 prompts x 8
    responses. The checkpoint must be a bf16 one (the Hub's MXFP4 experts are refused; dequantize and
    save_pretrained first)."""
    ep = _ep_for(num_nodes * gpus_per_node, 1, 32, 8)
    cfg = _family_recipe(
        "gpt-oss-20b-grpo",
        "gpt-oss-20b",
        parallel=ParallelConfig(ep=ep),
        packing=SequencePackingConfig(enabled=True, train_mb_tokens=8192, logprob_mb_tokens=16384,
                                      microbatch_order="largest_first"),
        training=TrainingConfig(global_batch_size=512, steps=500),
        optimizer=rl_optimizer(1e-6),
        cluster=_cluster(num_nodes, gpus_per_node),
        max_sample_tokens=16384,
    )  # fmt: skip
    return dataclasses.replace(cfg, algorithm="grpo", loss_fn=_grpo_loss(),
                               grpo=GRPOConfig(num_prompts_per_step=64, num_generations_per_prompt=8,
                                               router_replay=True))  # fmt: skip


def mixtral_8x7b_sft_packed(num_nodes: int = 2, gpus_per_node: int = 8) -> TrainConfig:
    """Mixtral-8x7B SFT with packing: TP4 with sequence parallelism and PP2 inside the model, its 8 experts
    (top-2) over up to 8 expert-parallel ranks of the DP x CP ranks."""
    tp = _tp_for(gpus_per_node, 4)
    ep = _ep_for(num_nodes * gpus_per_node, tp * 2, 8, 8)
    return _family_recipe(
        "mixtral-8x7b-sft-packed",
        "Mixtral-8x7B",
        parallel=ParallelConfig(tp=tp, pp=2, ep=ep, sequence_parallel=tp > 1),
        packing=SequencePackingConfig(enabled=True, train_mb_tokens=8192),
        training=TrainingConfig(global_batch_size=128, steps=1000),
        optimizer=sft_optimizer(5e-6, 1000),
        cluster=_cluster(num_nodes, gpus_per_node),
        max_sample_tokens=8192,
    )


def _single_gpu_recipe(name: str, model_name: str, num_nodes: int, gpus_per_node: int) -> TrainConfig:
    """A small model on one GPU (data parallel over more): packed 16k-token rows, no model parallelism."""
    return _family_recipe(
        name,
        model_name,
        parallel=ParallelConfig(),
        packing=SequencePackingConfig(enabled=True, train_mb_tokens=16384),
        training=TrainingConfig(global_batch_size=64, steps=500),
        optimizer=sft_optimizer(1e-5, 500),
        cluster=_cluster(num_nodes, gpus_per_node),
        max_sample_tokens=16384,
    )


def qwen3_0_6b_sft_single_gpu(num_nodes: int = 1, gpus_per_node: int = 1) -> TrainConfig:
    """Qwen3-0.6B SFT on one GPU (QK-norm, head_dim 128, tied embeddings)."""
    return _single_gpu_recipe("qwen3-0.6b-sft", "Qwen3-0.6B", num_nodes, gpus_per_node)


def llama32_1b_sft_single_gpu(num_nodes: int = 1, gpus_per_node: int = 1) -> TrainConfig:
    """Llama-3.2-1B SFT on one GPU (tied embeddings, Llama-3 RoPE scaling 32)."""
    return _single_gpu_recipe("llama3.2-1b-sft", "Llama-3.2-1B", num_nodes, gpus_per_node)


RECIPES = {
    "tiny_cpu_sft": tiny_cpu_sft,
    "llama3_8b_sft_packed": llama3_8b_sft_packed,
    "qwen2_7b_grpo_cp": qwen2_7b_grpo_cp,
    "llama3_70b_sft_long_context": llama3_70b_sft_long_context,
    "qwen3_8b_sft_packed": qwen3_8b_sft_packed,
    "qwen3_0_6b_sft_single_gpu": qwen3_0_6b_sft_single_gpu,
    "llama32_1b_sft_single_gpu": llama32_1b_sft_single_gpu,
    "qwen3_30b_a3b_sft_packed": qwen3_30b_a3b_sft_packed,
    "qwen3_30b_a3b_grpo": qwen3_30b_a3b_grpo,
    "mixtral_8x7b_sft_packed": mixtral_8x7b_sft_packed,
    "gpt_oss_20b_grpo": gpt_oss_20b_grpo,
}


def apply_packing(
    cfg: TrainConfig,
    *,
    train_mb_tokens: int | None = None,
    logprob_mb_tokens: int | None = None,
    algorithm: str | None = None,
    microbatch_order: str | None = None,
) -> TrainConfig:
    """Return a copy of ``cfg`` with sequence packing on (and dynamic batching off). Pure and idempotent.

    Unset arguments keep the config's current packing values; the token budget defaults to the dynamic
    batching budget when switching from it, so the memory per micro-batch stays the same.
    """
    current = cfg.sequence_packing
    if algorithm is not None:
        algorithm = resolve_algorithm(algorithm).value
    budget = train_mb_tokens
    if budget is None:
        budget = cfg.dynamic_batching.train_mb_tokens if cfg.dynamic_batching.enabled else current.train_mb_tokens
    packing = dataclasses.replace(
        current,
        enabled=True,
        train_mb_tokens=budget,
        logprob_mb_tokens=logprob_mb_tokens if logprob_mb_tokens is not None else current.logprob_mb_tokens,
        algorithm=algorithm or current.algorithm,
        microbatch_order=microbatch_order or current.microbatch_order,
    )
    dynamic = dataclasses.replace(cfg.dynamic_batching, enabled=False)
    return dataclasses.replace(cfg, sequence_packing=packing, dynamic_batching=dynamic)
