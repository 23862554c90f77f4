"""NeMo-style recipes: plain functions that return a complete, validated-shape `TrainConfig`.

Each takes ``num_nodes`` and ``gpus_per_node`` and picks a parallel layout that fits them. Recipes use
the bundled CHAMP conversations so ``--dry-run`` works anywhere; point ``data=jsonl data.path=...`` at
your data for a real run.

    from mcore_packing.app.recipes import llama3_8b_sft_packed, apply_packing
    cfg = llama3_8b_sft_packed(num_nodes=2, gpus_per_node=8)
    cfg = apply_packing(my_cfg, train_mb_tokens=16384)      # add packing to your own config
"""

from __future__ import annotations

import dataclasses

from ..packing import resolve_algorithm
from .config import (
    ClusterConfig,
    DataConfig,
    ModelConfig,
    ParallelConfig,
    SequencePackingConfig,
    TrainConfig,
    TrainingConfig,
)

__all__ = [
    "RECIPES",
    "apply_packing",
    "llama3_8b_sft_packed",
    "llama3_70b_sft_long_context",
    "qwen2_7b_grpo_cp",
    "tiny_cpu_sft",
]


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


def tiny_cpu_sft(num_nodes: int = 1, gpus_per_node: int = 1) -> TrainConfig:
    """The README's default: a tiny GPT on CHAMP, packed, gloo on CPU."""
    return TrainConfig(cluster=_cluster(num_nodes, gpus_per_node, "auto"), run_name="tiny-cpu-sft")


def llama3_8b_sft_packed(num_nodes: int = 1, gpus_per_node: int = 8) -> TrainConfig:
    """Llama-3-8B SFT with sequence packing: TP within the node with sequence parallelism, DP across."""
    tp = _tp_for(gpus_per_node, 4)
    return _fits(
        TrainConfig(
            model=ModelConfig(
                num_layers=32,
                hidden_size=4096,
                num_attention_heads=32,
                num_query_groups=8,
                ffn_hidden_size=14336,
                normalization="RMSNorm",
                gated_mlp=True,
                max_sequence_length=8192,
                dtype="bfloat16",
            ),
            data=DataConfig(source="champ", vocab_size=128256, num_samples=None, max_sample_tokens=8192),
            sequence_packing=SequencePackingConfig(
                enabled=True, train_mb_tokens=8192, algorithm="modified_first_fit_decreasing"
            ),
            parallel=ParallelConfig(tp=tp, sequence_parallel=tp > 1),
            training=TrainingConfig(global_batch_size=128, steps=1000, lr=1e-5, weight_decay=0.01),
            cluster=_cluster(num_nodes, gpus_per_node),
            run_name="llama3-8b-sft-packed",
        )
    )


def qwen2_7b_grpo_cp(num_nodes: int = 1, gpus_per_node: int = 8) -> TrainConfig:
    """Qwen2.5-7B-style GRPO policy step: long rollouts, CP=2, a larger budget for the logprob pass."""
    tp = _tp_for(gpus_per_node, 4)
    return _fits(
        TrainConfig(
            model=ModelConfig(
                num_layers=28,
                hidden_size=3584,
                num_attention_heads=28,
                num_query_groups=4,
                ffn_hidden_size=18944,
                normalization="RMSNorm",
                gated_mlp=True,
                max_sequence_length=32768,
                dtype="bfloat16",
            ),
            data=DataConfig(source="champ", vocab_size=152064, num_samples=None, max_sample_tokens=16384),
            sequence_packing=SequencePackingConfig(
                enabled=True,
                train_mb_tokens=8192,
                logprob_mb_tokens=16384,
                algorithm="modified_first_fit_decreasing",
                microbatch_order="largest_first",
            ),
            parallel=ParallelConfig(tp=tp, cp=2, sequence_parallel=tp > 1),
            training=TrainingConfig(global_batch_size=512, steps=500, lr=1e-6, loss_normalization="token_mean"),
            cluster=_cluster(num_nodes, gpus_per_node),
            run_name="qwen2-7b-grpo-cp",
        )
    )


def llama3_70b_sft_long_context(num_nodes: int = 8, gpus_per_node: int = 8) -> TrainConfig:
    """Llama-3-70B long-context SFT: TP8 in a node, PP4 with variable lengths, CP2."""
    tp = _tp_for(gpus_per_node, 8)
    return _fits(
        TrainConfig(
            model=ModelConfig(
                num_layers=80,
                hidden_size=8192,
                num_attention_heads=64,
                num_query_groups=8,
                ffn_hidden_size=28672,
                normalization="RMSNorm",
                gated_mlp=True,
                max_sequence_length=32768,
                dtype="bfloat16",
            ),
            data=DataConfig(source="champ", vocab_size=128256, num_samples=None, max_sample_tokens=32768),
            sequence_packing=SequencePackingConfig(enabled=True, train_mb_tokens=16384),
            parallel=ParallelConfig(tp=tp, pp=4, cp=2, sequence_parallel=tp > 1, variable_seq_lengths=True),
            training=TrainingConfig(global_batch_size=64, steps=500, lr=5e-6),
            cluster=_cluster(num_nodes, gpus_per_node),
            run_name="llama3-70b-sft-long-context",
        )
    )


RECIPES = {
    "tiny_cpu_sft": tiny_cpu_sft,
    "llama3_8b_sft_packed": llama3_8b_sft_packed,
    "qwen2_7b_grpo_cp": qwen2_7b_grpo_cp,
    "llama3_70b_sft_long_context": llama3_70b_sft_long_context,
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
