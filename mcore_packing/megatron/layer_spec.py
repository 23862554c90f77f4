"""A GPT layer spec with attention that honours packed (THD) batches in every environment."""

from __future__ import annotations

import copy

from ..compat import require_megatron, te_available

__all__ = ["get_packed_gpt_layer_spec", "resolve_attention_backend"]


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
    backend: str = "auto", *, normalization: str | None = None, qk_layernorm: bool = False, attention: str = "auto"
):
    """A transformer-layer ``ModuleSpec`` for ``GPTModel`` that handles ``PackedSeqParams``.

    Args:
        backend: ``te`` uses TransformerEngine's layer spec (fused THD attention); ``local`` uses
            Megatron's local modules with `PackedCoreAttention`; ``auto`` picks ``te`` when importable.
        normalization: ``"LayerNorm"`` or ``"RMSNorm"`` (local spec).
        qk_layernorm: normalize queries and keys.
        attention: `PackedCoreAttention` backend (``auto``, ``sdpa``, ``varlen``) for the local spec.
    """
    require_megatron()
    from megatron.core.models.gpt import gpt_layer_specs
    from megatron.core.transformer.spec_utils import ModuleSpec

    from .attention import PackedCoreAttention

    if resolve_attention_backend(backend) == "te":
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=qk_layernorm)
    spec = copy.deepcopy(
        gpt_layer_specs.get_gpt_layer_local_spec(normalization=normalization, qk_layernorm=qk_layernorm)
    )
    spec.submodules.self_attention.submodules.core_attention = ModuleSpec(
        module=PackedCoreAttention, params={"backend": attention}
    )
    return spec
