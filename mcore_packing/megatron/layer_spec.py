"""GPT layer and block specs with attention that honours packed (THD) batches in every environment.

Without TransformerEngine the local spec gets `PackedCoreAttention` and torch norms whose parameters are
tagged for sequence parallelism (Megatron's own torch-norm wrapper refuses sequence parallelism, and
``finalize_model_grads`` all-reduces only tagged norm grads over TP). Parameter names are unchanged, so
checkpoints load either way.
"""

from __future__ import annotations

import copy

import torch

from ..compat import require_megatron, te_available

__all__ = [
    "LocalLayerNorm",
    "LocalRMSNorm",
    "get_packed_gpt_block_spec",
    "get_packed_gpt_layer_spec",
    "resolve_attention_backend",
]


def _tag_sequence_parallel(module: torch.nn.Module, config) -> None:
    for param in module.parameters():
        param.sequence_parallel = bool(getattr(config, "sequence_parallel", False))


class LocalLayerNorm(torch.nn.LayerNorm):
    """torch LayerNorm built the way Megatron builds norms (parameters in ``config.params_dtype``, which
    Megatron's mixed-precision optimizers expect of every parameter), usable with sequence parallelism."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5):
        super().__init__(hidden_size, eps=eps, dtype=getattr(config, "params_dtype", None))
        _tag_sequence_parallel(self, config)


class LocalRMSNorm(torch.nn.RMSNorm):
    """torch RMSNorm built the way Megatron builds norms (parameters in ``config.params_dtype``), usable
    with sequence parallelism."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5):
        super().__init__(hidden_size, eps=eps, dtype=getattr(config, "params_dtype", None))
        _tag_sequence_parallel(self, config)


def resolve_attention_backend(backend: str = "auto") -> str:
    """``te`` when TransformerEngine imports (and ``backend`` allows it), else ``local``."""
    if backend not in ("auto", "te", "local"):
        raise ValueError(f"attention backend must be 'auto', 'te' or 'local', got {backend!r}.")
    if backend == "te" and not te_available():
        raise ImportError(
            "attention backend 'te' needs TransformerEngine: pip install 'mcore-packing[te]' on a CUDA machine, "
            "or use backend='auto'/'local'."
        )
    if backend == "auto":
        return "te" if te_available() else "local"
    return backend


def get_packed_gpt_layer_spec(
    backend: str = "auto",
    *,
    normalization: str | None = None,
    qk_layernorm: bool = False,
    attention: str = "auto",
    num_experts: int | None = None,
):
    """A transformer-layer ``ModuleSpec`` for ``GPTModel`` that handles ``PackedSeqParams``.

    Args:
        backend: ``te`` uses TransformerEngine's layer spec (fused THD attention); ``local`` uses
            Megatron's local modules with `PackedCoreAttention`; ``auto`` picks ``te`` when importable.
        normalization: ``"LayerNorm"`` or ``"RMSNorm"`` (local spec).
        qk_layernorm: normalize queries and keys.
        attention: `PackedCoreAttention` backend (``auto``, ``sdpa``, ``varlen``) for the local spec.
        num_experts: a Mixture-of-Experts layer (Megatron's MoE layer: top-k router, all-to-all token
            dispatcher, ``SequentialMLP`` experts and shared experts of local linears) instead of the MLP.
    """
    require_megatron()
    from megatron.core.models.gpt import gpt_layer_specs
    from megatron.core.transformer.spec_utils import ModuleSpec

    from .attention import PackedCoreAttention

    if resolve_attention_backend(backend) == "te":
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(
            num_experts=num_experts, qk_layernorm=qk_layernorm
        )
    spec = copy.deepcopy(
        gpt_layer_specs.get_gpt_layer_local_spec(
            num_experts=num_experts, moe_grouped_gemm=False, normalization=normalization, qk_layernorm=qk_layernorm
        )
    )
    spec.submodules.self_attention.submodules.core_attention = ModuleSpec(
        module=PackedCoreAttention, params={"backend": attention}
    )
    norm = LocalRMSNorm if normalization == "RMSNorm" else LocalLayerNorm
    spec.submodules.input_layernorm = norm
    spec.submodules.pre_mlp_layernorm = norm
    if qk_layernorm:  # per-head norms (Qwen3); Megatron's torch-norm wrapper would refuse sequence parallelism
        spec.submodules.self_attention.submodules.q_layernorm = norm
        spec.submodules.self_attention.submodules.k_layernorm = norm
    return spec


def get_packed_gpt_block_spec(config, backend: str = "auto", *, vp_stage: int | None = None, attention: str = "auto"):
    """The decoder block spec (this pipeline stage's layers plus the final norm) for ``GPTModel``.

    Prefer this over the layer spec with the local backend: it makes the final norm sequence-parallel-safe
    too. ``config.normalization`` picks LayerNorm or RMSNorm.
    """
    require_megatron()
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

    normalization = getattr(config, "normalization", "LayerNorm")
    if resolve_attention_backend(backend) == "te":
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

        return get_gpt_decoder_block_spec(config, use_transformer_engine=True, vp_stage=vp_stage)
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    def layer(num_experts):
        return get_packed_gpt_layer_spec("local", normalization=normalization, attention=attention,
                                         qk_layernorm=bool(getattr(config, "qk_layernorm", False)),
                                         num_experts=num_experts)  # fmt: skip

    num_layers = get_num_layers_to_build(config, vp_stage=vp_stage)
    experts = getattr(config, "num_moe_experts", None)
    if experts:  # this stage's layers, each an MoE or a dense layer as config.moe_layer_freq says
        offset = get_transformer_layer_offset(config, vp_stage=vp_stage)
        pattern = config.moe_layer_freq if isinstance(config.moe_layer_freq, list) else None
        is_moe = [pattern[offset + i] if pattern else (offset + i) % config.moe_layer_freq == 0
                  for i in range(num_layers)]  # fmt: skip
        specs = [layer(experts) if moe else layer(None) for moe in is_moe]
    else:
        specs = [layer(None)] * num_layers
    norm = LocalRMSNorm if normalization == "RMSNorm" else LocalLayerNorm
    return TransformerBlockSubmodules(layer_specs=specs, layer_norm=norm)
