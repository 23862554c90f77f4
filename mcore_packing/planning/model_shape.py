"""`ModelShape`: the one description of a GPT's dimensions.

The same object sizes the cost model (`CostModel.from_shape`), builds Megatron's ``TransformerConfig``
(`mcore_packing.megatron.build_gpt_model`), and is what the planner CLI and the Hydra ``model`` group
turn into. Plain data, no torch.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ..validators import require_choice, require_positive_int, require_positive_number

__all__ = ["FAMILIES", "NORMALIZATIONS", "ModelShape"]

NORMALIZATIONS = ("LayerNorm", "RMSNorm")
FAMILIES = ("gpt", "llama", "mistral", "qwen2", "qwen3")
"""``gpt``: Megatron's defaults (biases on every linear); the others are Hugging Face model types."""


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    """Dimensions of a decoder-only transformer.

    Attributes:
        num_layers: transformer layers.
        hidden_size: model width.
        num_attention_heads: query heads.
        num_query_groups: key/value heads (grouped-query attention); None means one per query head.
        ffn_hidden_size: MLP width; None means 4 x hidden_size.
        vocab_size: vocabulary size (before any padding to a TP multiple).
        max_sequence_length: longest sequence the RoPE tables must cover.
        normalization: ``LayerNorm`` or ``RMSNorm``.
        gated_mlp: SwiGLU-style gated MLP (three matrices, SiLU) as in Llama and Qwen; False is the
            two-matrix GELU MLP.
        head_dim: size of one attention head; None means hidden_size / num_attention_heads (Qwen3 sets
            it explicitly, e.g. 128 at width 1024 with 16 heads).
        norm_epsilon: epsilon of every norm (HF ``rms_norm_eps``).
        rotary_base: RoPE base (HF ``rope_theta``; Llama 3: 500000).
        rope_scaling_factor: Llama-3 RoPE scaling factor (low/high frequency factors 1 and 4, original
            context 8192, as Megatron implements it); None for no scaling.
        linear_bias: biases on the attention output and MLP linears (Megatron's default; HF families: no).
        qkv_bias: biases on the query/key/value projection only (Qwen2).
        qk_norm: RMSNorm of each query and key head (Qwen3).
        tie_embeddings: the output layer shares the input embedding.
        family: ``gpt`` or the Hugging Face model type this shape came from (import/export use it).
    """

    num_layers: int = 2
    hidden_size: int = 128
    num_attention_heads: int = 4
    num_query_groups: int | None = None
    ffn_hidden_size: int | None = None
    vocab_size: int = 1024
    max_sequence_length: int = 4096
    normalization: str = "LayerNorm"
    gated_mlp: bool = False
    head_dim: int | None = None
    norm_epsilon: float = 1e-5
    rotary_base: float = 10000.0
    rope_scaling_factor: float | None = None
    linear_bias: bool = True
    qkv_bias: bool = False
    qk_norm: bool = False
    tie_embeddings: bool = False
    family: str = "gpt"

    def __post_init__(self):
        for name in ("num_layers", "hidden_size", "num_attention_heads", "vocab_size", "max_sequence_length"):
            require_positive_int(f"model.{name}", getattr(self, name))
        for name in ("num_query_groups", "ffn_hidden_size", "head_dim"):
            require_positive_int(f"model.{name}", getattr(self, name), allow_none=True)
        if self.head_dim is None and self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"model.hidden_size={self.hidden_size} is not divisible by num_attention_heads="
                f"{self.num_attention_heads}; pick a head count that divides the width."
            )
        if self.num_query_groups is not None and self.num_attention_heads % self.num_query_groups:
            raise ValueError(
                f"model.num_attention_heads={self.num_attention_heads} is not a multiple of num_query_groups="
                f"{self.num_query_groups}; every key/value head must serve the same number of query heads."
            )
        require_choice("model.normalization", self.normalization, NORMALIZATIONS)
        require_choice("model.family", self.family, FAMILIES)
        require_positive_number("model.norm_epsilon", self.norm_epsilon)
        require_positive_number("model.rotary_base", self.rotary_base)
        if self.rope_scaling_factor is not None:
            require_positive_number("model.rope_scaling_factor", self.rope_scaling_factor)

    @property
    def kv_heads(self) -> int:
        return self.num_query_groups or self.num_attention_heads

    @property
    def head_size(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def ffn_size(self) -> int:
        return self.ffn_hidden_size or 4 * self.hidden_size

    def num_parameters(self) -> int:
        """Parameters of the unpadded model (embeddings once when tied), as the checkpoint counts them."""
        h, hd, f = self.hidden_size, self.head_size, self.ffn_size
        q, kv = self.num_attention_heads * hd, self.kv_heads * hd
        attention = h * (q + 2 * kv) + q * h
        if self.qkv_bias or self.linear_bias:
            attention += q + 2 * kv
        mlp = (3 if self.gated_mlp else 2) * h * f
        if self.linear_bias:
            attention += h
            mlp += ((2 if self.gated_mlp else 1) * f) + h
        norm = h if self.normalization == "RMSNorm" else 2 * h
        layer = attention + mlp + 2 * norm + (2 * hd if self.qk_norm else 0)
        embeddings = self.vocab_size * h * (1 if self.tie_embeddings else 2)
        return self.num_layers * layer + embeddings + norm

    def to_dict(self) -> dict:
        return asdict(self)
