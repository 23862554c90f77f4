"""`ModelShape`: the one description of a GPT's dimensions.

The same object sizes the cost model (`CostModel.from_shape`), builds Megatron's ``TransformerConfig``
(`mcore_packing.megatron.build_gpt_model`), and is what the planner CLI and the Hydra ``model`` group
turn into. Plain data, no torch.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ..validators import require_choice, require_positive_int, require_positive_number

__all__ = [
    "FAMILIES",
    "MOE_LOAD_BALANCING",
    "MOE_SCORES",
    "MOE_TRAINING_FIELDS",
    "NORMALIZATIONS",
    "ModelShape",
    "check_balance_loss",
    "padded_vocab_size",
]

NORMALIZATIONS = ("LayerNorm", "RMSNorm")
FAMILIES = ("gpt", "llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral", "qwen2_moe", "gpt_oss")
"""``gpt``: Megatron's defaults (biases on every linear); the others are Hugging Face model types."""
MOE_SCORES = ("softmax", "sigmoid")
MOE_LOAD_BALANCING = ("seq_aux_loss", "global_aux_loss", "aux_loss", "none")
"""Megatron's names: per sequence, per global batch, per micro-batch (not split-invariant), or none.
Only ``seq_aux_loss`` trains (`mcore_packing.megatron.router_loss`); the others are refused with a
coefficient > 0 (`check_balance_loss`)."""
_SPLIT_DEPENDENT = {
    "aux_loss": "Megatron's aux_loss is computed per micro-batch, so its value and gradients change with which "
    "sequences share a micro-batch (packing, the token budget, DP)",
    "global_aux_loss": "Megatron's global_aux_loss averages the expert counts of the micro-batches seen so far in "
    "the step (an exact global-batch loss needs every token's routing before the first backward), so it also "
    "depends on the batch split",
}
MOE_TRAINING_FIELDS = ("moe_load_balancing", "moe_aux_loss_coeff", "moe_z_loss_coeff")
"""How an MoE model is trained, not what it is: a checkpoint's config.json does not set them (the run's
config does, with or without ``model.hf_path``)."""


def check_balance_loss(kind: str, coeff: float, prefix: str = "model.") -> None:
    """Refuse a balance loss that cannot be exact under packing (a coefficient > 0 on a split-dependent
    type), naming the keys and the fix."""
    if coeff > 0 and kind in _SPLIT_DEPENDENT:
        raise ValueError(
            f"{prefix}moe_load_balancing={kind}: {_SPLIT_DEPENDENT[kind]}; it cannot be exact under packing. Use "
            f"{prefix}moe_load_balancing=seq_aux_loss (per sequence, exact whatever the split), or set "
            f"{prefix}moe_aux_loss_coeff=0."
        )


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
        yarn_factor: YaRN RoPE scaling factor (HF ``rope_type: yarn``; GPT-OSS: 32); None for none. The
            cos/sin carry YaRN's attention factor ``0.1 ln(factor) + 1``, as Hugging Face computes it.
        yarn_original_max_position_embeddings, yarn_beta_fast, yarn_beta_slow: YaRN's pre-scaling context
            and the rotation counts bounding its frequency ramp (HF's keys of the same names).
        yarn_truncate: round the ramp's bounds to whole dimensions (HF ``truncate``; GPT-OSS: false).
        window_size: sliding-window width W (HF ``sliding_window``): a query sees itself and the W - 1
            tokens before it, within its own sequence; None for full causal attention.
        window_layers: the layers (0-based) that use the window (HF ``layer_types`` of
            ``sliding_attention``); empty with a ``window_size`` means every layer.
        attention_sinks: a learned sink logit per head in every softmax's denominator (GPT-OSS ``sinks``,
            Megatron's ``softmax_type="learnable"``).
        swiglu_limit: GPT-OSS's clamped SwiGLU: gate clamped to <= limit, up to [-limit, limit], output
            ``gate * sigmoid(1.702 gate) * (up + 1)`` (Megatron's quick_gelu GLU with offset 1 and its
            clamp); None for the plain SiLU gate.
        linear_bias: biases on the attention output and MLP linears (Megatron's default; HF families: no).
        qkv_bias: biases on the query/key/value projection only (Qwen2).
        qk_norm: RMSNorm of each query and key head (Qwen3).
        tie_embeddings: the output layer shares the input embedding.
        family: ``gpt`` or the Hugging Face model type this shape came from (import/export use it).

    Mixture-of-Experts (all unused while ``num_experts`` is None, a dense model):
        num_experts: routed experts of each MoE layer (HF ``num_experts`` / ``num_local_experts``).
        moe_router_topk: experts each token is routed to (HF ``num_experts_per_tok``).
        moe_ffn_hidden_size: each expert's gated-MLP width; None means ffn_hidden_size (Mixtral).
        moe_shared_expert_size: width of the shared expert every token also passes (Qwen2-MoE's
            ``shared_expert_intermediate_size``); None for none.
        moe_shared_expert_gate: the shared expert's output scaled by sigmoid(x . w) (Qwen2-MoE).
        moe_dense_layers: layers (0-based) with a dense MLP of ffn_hidden_size instead of experts (HF
            ``mlp_only_layers`` and ``decoder_sparse_step``).
        moe_router_score: ``softmax`` or ``sigmoid`` of the router logits.
        moe_router_topk_norm: renormalize the top-k scores to sum to 1 (HF ``norm_topk_prob``; Mixtral
            always); False keeps the softmax over all experts (Qwen2-MoE's default).
        moe_router_expert_bias: a per-expert bias on the routing scores (aux-loss-free balancing).
        moe_load_balancing: the balance loss (`MOE_LOAD_BALANCING`).
        moe_aux_loss_coeff: its coefficient (HF ``router_aux_loss_coef``).
        moe_z_loss_coeff: the router z-loss coefficient; 0 for none.
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
    yarn_factor: float | None = None
    yarn_original_max_position_embeddings: int = 4096
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    yarn_truncate: bool = True
    window_size: int | None = None
    window_layers: tuple[int, ...] = ()
    attention_sinks: bool = False
    swiglu_limit: float | None = None
    linear_bias: bool = True
    qkv_bias: bool = False
    qk_norm: bool = False
    tie_embeddings: bool = False
    family: str = "gpt"
    num_experts: int | None = None
    moe_router_topk: int = 2
    moe_ffn_hidden_size: int | None = None
    moe_shared_expert_size: int | None = None
    moe_shared_expert_gate: bool = False
    moe_dense_layers: tuple[int, ...] = ()
    moe_router_score: str = "softmax"
    moe_router_topk_norm: bool = True
    moe_router_expert_bias: bool = False
    moe_load_balancing: str = "seq_aux_loss"
    moe_aux_loss_coeff: float = 0.0
    moe_z_loss_coeff: float = 0.0

    def __post_init__(self):
        for name in ("moe_dense_layers", "window_layers"):  # Hydra gives a list
            object.__setattr__(self, name, tuple(getattr(self, name)))
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
        self._check_attention()
        self._check_moe()

    def _check_attention(self) -> None:
        """YaRN, the sliding window and the clamped SwiGLU (GPT-OSS's parts)."""
        if self.yarn_factor is not None:
            require_positive_number("model.yarn_factor", self.yarn_factor)
            if self.rope_scaling_factor is not None:
                raise ValueError("model.yarn_factor and model.rope_scaling_factor are both set: a model has one RoPE "
                                 "scaling (YaRN or Llama-3's); unset one.")  # fmt: skip
        require_positive_int("model.yarn_original_max_position_embeddings", self.yarn_original_max_position_embeddings)
        for name in ("yarn_beta_fast", "yarn_beta_slow"):
            require_positive_number(f"model.{name}", getattr(self, name))
        require_positive_int("model.window_size", self.window_size, allow_none=True)
        bad = [i for i in self.window_layers if not (isinstance(i, int) and 0 <= i < self.num_layers)]
        if bad:
            raise ValueError(f"model.window_layers holds {bad}; layers are 0 to {self.num_layers - 1}.")
        if self.window_layers and self.window_size is None:
            raise ValueError("model.window_layers is set but model.window_size is not: set the window's width.")
        if self.swiglu_limit is not None:
            require_positive_number("model.swiglu_limit", self.swiglu_limit)
            if not self.gated_mlp:
                raise ValueError("model.swiglu_limit clamps a gated MLP: set model.gated_mlp=true.")

    def _check_moe(self) -> None:
        require_positive_int("model.num_experts", self.num_experts, allow_none=True)
        for name in ("moe_ffn_hidden_size", "moe_shared_expert_size"):
            require_positive_int(f"model.{name}", getattr(self, name), allow_none=True)
        require_choice("model.moe_router_score", self.moe_router_score, MOE_SCORES)
        require_choice("model.moe_load_balancing", self.moe_load_balancing, MOE_LOAD_BALANCING)
        for name in ("moe_aux_loss_coeff", "moe_z_loss_coeff"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"model.{name}={getattr(self, name)} must be >= 0 (0 turns it off).")
        check_balance_loss(self.moe_load_balancing, self.moe_aux_loss_coeff)
        if self.num_experts is None:
            moe_set = [k for k in ("moe_ffn_hidden_size", "moe_shared_expert_size") if getattr(self, k) is not None]
            if moe_set or self.moe_dense_layers or self.moe_shared_expert_gate:
                raise ValueError(f"model.{(moe_set or ['moe_dense_layers'])[0]} is set but model.num_experts is not: "
                                 "set model.num_experts for a Mixture-of-Experts model.")  # fmt: skip
            return
        if not 1 <= self.moe_router_topk <= self.num_experts:
            raise ValueError(f"model.moe_router_topk={self.moe_router_topk} must be between 1 and model.num_experts="
                             f"{self.num_experts}.")  # fmt: skip
        bad = [i for i in self.moe_dense_layers if not (isinstance(i, int) and 0 <= i < self.num_layers)]
        if bad:
            raise ValueError(f"model.moe_dense_layers holds {bad}; layers are 0 to {self.num_layers - 1}.")
        if self.moe_router_score == "sigmoid" and not self.moe_router_topk_norm:
            raise ValueError("model.moe_router_score=sigmoid renormalizes the top-k scores (Megatron's sigmoid "
                             "router does): set model.moe_router_topk_norm=true.")  # fmt: skip
        if self.moe_router_expert_bias and self.moe_router_score != "sigmoid":
            raise ValueError("model.moe_router_expert_bias balances a sigmoid router (aux-loss-free): set "
                             "model.moe_router_score=sigmoid, or turn the bias off.")  # fmt: skip
        if self.moe_shared_expert_gate and self.moe_shared_expert_size is None:
            raise ValueError("model.moe_shared_expert_gate needs a shared expert: set model.moe_shared_expert_size.")
        if not self.gated_mlp:
            raise ValueError("Mixture-of-Experts shapes use gated (SwiGLU) experts, as Qwen3-MoE, Mixtral, Qwen2-MoE "
                             "and GPT-OSS do: set model.gated_mlp=true.")  # fmt: skip

    @property
    def is_moe(self) -> bool:
        return self.num_experts is not None

    def moe_layers(self) -> list[bool]:
        """Per layer: True where the MLP is the experts (every layer but `moe_dense_layers` in a MoE)."""
        return [self.is_moe and i not in self.moe_dense_layers for i in range(self.num_layers)]

    def window_per_layer(self) -> list[bool]:
        """Per layer: True where attention is the sliding window (`window_layers`; every layer when empty)."""
        if self.window_size is None:
            return [False] * self.num_layers
        return [not self.window_layers or i in self.window_layers for i in range(self.num_layers)]

    @property
    def expert_size(self) -> int:
        return self.moe_ffn_hidden_size or self.ffn_size

    @property
    def kv_heads(self) -> int:
        return self.num_query_groups or self.num_attention_heads

    @property
    def head_size(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def ffn_size(self) -> int:
        return self.ffn_hidden_size or 4 * self.hidden_size

    def num_parameters(self, *, active: bool = False) -> int:
        """Parameters of the unpadded model (embeddings once when tied), as the checkpoint counts them;
        ``active``: those one token uses (its ``moe_router_topk`` experts instead of all of them)."""
        h, hd = self.hidden_size, self.head_size
        q, kv = self.num_attention_heads * hd, self.kv_heads * hd
        attention = h * (q + 2 * kv) + q * h
        if self.qkv_bias or self.linear_bias:
            attention += q + 2 * kv
        if self.linear_bias:
            attention += h
        norm = h if self.normalization == "RMSNorm" else 2 * h
        sinks = self.num_attention_heads if self.attention_sinks else 0
        layer = attention + 2 * norm + (2 * hd if self.qk_norm else 0) + sinks
        mlps = sum(self._mlp_parameters(moe, active) for moe in self.moe_layers())
        embeddings = self.vocab_size * h * (1 if self.tie_embeddings else 2)
        return self.num_layers * layer + mlps + embeddings + norm

    def _mlp_parameters(self, moe: bool, active: bool) -> int:
        h = self.hidden_size
        if not moe:
            f = self.ffn_size
            mlp = (3 if self.gated_mlp else 2) * h * f
            return mlp + (((2 if self.gated_mlp else 1) * f) + h if self.linear_bias else 0)
        experts = self.moe_router_topk if active else self.num_experts
        expert = 3 * h * self.expert_size + (2 * self.expert_size + h if self.linear_bias else 0)
        mlp = experts * expert + (h + 1 if self.linear_bias else h) * self.num_experts  # experts and the router
        if self.moe_shared_expert_size:
            mlp += 3 * h * self.moe_shared_expert_size + (h if self.moe_shared_expert_gate else 0)
        return mlp

    def to_dict(self) -> dict:
        return asdict(self)


def padded_vocab_size(vocab_size: int, tp: int) -> int:
    """The vocabulary rounded up to a multiple of TP (each TP rank holds an equal slice of it)."""
    return -(-vocab_size // tp) * tp
