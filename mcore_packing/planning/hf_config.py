"""Hugging Face ``config.json`` <-> `ModelShape`, for the decoder families we convert (plain JSON, no torch).

Families: Llama (2, 3.x with Llama-3 RoPE scaling), Mistral (its sliding window on every layer),
Qwen2/Qwen2.5 (biases on q/k/v), Qwen3 (RMSNorm of each query and key head, explicit ``head_dim``), and the
Mixture-of-Experts families Qwen3-MoE (``Qwen3MoeForCausalLM``), Mixtral (its window as Mistral's),
Qwen2-MoE (a shared expert with a sigmoid gate) and GPT-OSS (YaRN RoPE, sliding-window layers, attention
sinks, biases on every linear, the router and the experts, clamped SwiGLU); DeepSeek-V3 is refused naming
the field we cannot reproduce. YaRN RoPE (``rope_type: yarn``) is read for every family (one path, tested
through GPT-OSS). Both config layouts are read: transformers 4 (``rope_theta``, ``rope_scaling``) and 5
(``rope_parameters``). Options that the Megatron model cannot reproduce exactly are refused with an error
that names the field, instead of converting into a model that computes something else.

    shape = shape_from_hf_config(json.load(open("Llama-3.2-1B/config.json")))
    config = hf_config_from_shape(shape, dtype="bfloat16")      # what export writes
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from .model_shape import ModelShape

__all__ = [
    "HF_FAMILIES",
    "check_output_folder",
    "check_safetensors",
    "hf_config_from_shape",
    "read_hf_config",
    "shape_from_hf_config",
]


@dataclass(frozen=True)
class _Family:
    architecture: str
    qkv_bias: bool = False
    qk_norm: bool = False


HF_FAMILIES = {
    "llama": _Family("LlamaForCausalLM"),
    "mistral": _Family("MistralForCausalLM"),
    "qwen2": _Family("Qwen2ForCausalLM", qkv_bias=True),
    "qwen3": _Family("Qwen3ForCausalLM", qk_norm=True),
    "qwen3_moe": _Family("Qwen3MoeForCausalLM", qk_norm=True),
    "mixtral": _Family("MixtralForCausalLM"),
    "qwen2_moe": _Family("Qwen2MoeForCausalLM", qkv_bias=True),
    "gpt_oss": _Family("GptOssForCausalLM", qkv_bias=True),
}
"""HF ``model_type`` -> architecture class and attention options."""

_REFUSED = {
    "deepseek_v3": ("kv_lora_rank", "its multi-head latent attention (kv_lora_rank={}) and grouped, node-limited "
                    "routing are not in our layer spec"),
}  # fmt: skip
"""MoE families people ask for that do not convert exactly: the field, and why."""

# Megatron's Llama-3 RoPE scaling fixes these (megatron.core RotaryEmbedding._apply_scaling defaults).
_LLAMA3_FIXED = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
_MOE_TYPES = ("qwen3_moe", "mixtral", "qwen2_moe", "gpt_oss")
_GPT_OSS_ALPHA = 1.702  # the sigmoid's slope in GPT-OSS's gate: Megatron's quick_gelu fixes it
_WINDOW_KINDS = {"sliding_attention": True, "full_attention": False}  # HF layer_types
_EVERY_LAYER_WINDOW = ("mistral", "mixtral")  # families whose sliding_window is on every layer


def read_hf_config(folder: str | Path) -> dict:
    """``folder/config.json`` as a dict, or an error that says what is missing."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} does not exist: model.hf_path must be a Hugging Face model folder (config.json, "
            "*.safetensors, tokenizer.json), e.g. one saved by save_pretrained or downloaded from the Hub."
        )
    return json.loads(path.read_text())


def _refuse(field: str, value, why: str) -> ValueError:
    return ValueError(f"config.json: {field}={value!r} is not supported: {why}")


def _rope(config: dict) -> dict:
    """The `ModelShape` RoPE fields (base, Llama-3 or YaRN scaling) from either config layout."""
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    theta = float(params.get("rope_theta", config.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind in (None, "default"):
        return {"rotary_base": theta}
    if kind == "yarn":
        return {"rotary_base": theta, **_yarn(params)}
    if kind != "llama3":
        raise _refuse("rope_type", kind, "only the default RoPE, Llama-3 scaling ('llama3') and YaRN ('yarn') convert "
                      "exactly.")  # fmt: skip
    for key, fixed in _LLAMA3_FIXED.items():
        if float(params.get(key, fixed)) != fixed:
            raise _refuse(
                f"rope {key}", params[key], f"Megatron's Llama-3 RoPE scaling uses {key}={fixed} (Llama 3.1-3.3)."
            )
    return {"rotary_base": theta, "rope_scaling_factor": float(params["factor"])}


def _yarn(params: dict) -> dict:
    """YaRN's fields. Its attention factor must be the one both sides derive from the factor alone
    (``0.1 ln(factor) + 1``: no ``attention_factor``, ``mscale`` or ``mscale_all_dim``, as GPT-OSS and Qwen
    ship), since Megatron's GPT attention reads only that."""
    for key in ("attention_factor", "mscale", "mscale_all_dim"):
        if params.get(key) is not None:
            raise _refuse(f"rope {key}", params[key], "only YaRN's default attention factor, 0.1 ln(factor) + 1, "
                          "converts (DeepSeek's mscale pair does not).")  # fmt: skip
    if "original_max_position_embeddings" not in params or "factor" not in params:
        raise _refuse("rope_parameters", params, "YaRN needs 'factor' and 'original_max_position_embeddings'.")
    return dict(yarn_factor=float(params["factor"]),
                yarn_original_max_position_embeddings=int(params["original_max_position_embeddings"]),
                yarn_beta_fast=float(params.get("beta_fast") or 32.0),
                yarn_beta_slow=float(params.get("beta_slow") or 1.0),
                yarn_truncate=bool(params.get("truncate", True)))  # fmt: skip


def shape_from_hf_config(config: dict) -> ModelShape:
    """The `ModelShape` of a Hugging Face decoder config; unsupported options raise ValueError."""
    model_type = config.get("model_type")
    if model_type in _REFUSED:
        field, why = _REFUSED[model_type]
        raise _refuse("model_type", model_type, why.format(config.get(field)) + "; use a Qwen3-MoE, Mixtral or "
                      "Qwen2-MoE checkpoint.")  # fmt: skip
    if model_type not in HF_FAMILIES:
        raise ValueError(
            f"config.json: model_type={model_type!r} (architectures {config.get('architectures')}) is not a family "
            f"mcore_packing converts. Supported: {', '.join(sorted(HF_FAMILIES))}."
        )
    family = HF_FAMILIES[model_type]
    if config.get("hidden_act", "silu") != "silu":
        raise _refuse("hidden_act", config["hidden_act"], "these families use SiLU-gated MLPs.")
    if config.get("mlp_bias"):
        raise _refuse("mlp_bias", True, "Megatron's linear_bias would also add an attention output bias.")
    if config.get("attention_bias") and not family.qkv_bias:
        raise _refuse("attention_bias", True, f"{model_type} would also need an o_proj bias.")
    if config.get("sliding_window") is not None and config.get("use_sliding_window"):
        raise _refuse("use_sliding_window", True, f"{model_type}'s window on the layers from max_window_layers "
                      "on does not convert yet (Mistral's, Mixtral's and GPT-OSS's do); use a checkpoint without "
                      "it.")  # fmt: skip
    hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
    head_dim = config.get("head_dim")
    layers = int(config["num_hidden_layers"])
    return ModelShape(
        num_layers=layers,
        hidden_size=hidden,
        num_attention_heads=heads,
        num_query_groups=int(config.get("num_key_value_heads") or heads),
        ffn_hidden_size=int(config["intermediate_size"]),
        vocab_size=int(config["vocab_size"]),
        max_sequence_length=int(config.get("max_position_embeddings", 4096)),
        normalization="RMSNorm",
        gated_mlp=True,
        head_dim=int(head_dim) if head_dim and int(head_dim) != hidden // heads else None,
        norm_epsilon=float(config.get("rms_norm_eps", 1e-6)),
        qkv_bias=family.qkv_bias or bool(config.get("attention_bias")),
        qk_norm=family.qk_norm,
        tie_embeddings=bool(config.get("tie_word_embeddings", False)),
        family=model_type,
        **_rope(config),
        **_moe_fields(config, model_type, layers),
        **(_gpt_oss_fields(config, layers) if model_type == "gpt_oss" else _window_fields(config, model_type)),
    )


def _sliding_window(config: dict) -> int | None:
    """``sliding_window``: the tokens a query sees, itself included (an integer >= 1), or None."""
    window = config.get("sliding_window")
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise _refuse("sliding_window", window, "a window is a whole number of tokens >= 1 (null: full attention).")
    return window


def _window_fields(config: dict, model_type: str) -> dict:
    """Mistral's and Mixtral's ``sliding_window``, which Hugging Face applies on every layer (a query sees
    itself and the W - 1 tokens before it); no biases (GPT-OSS's own fields are `_gpt_oss_fields`)."""
    window = _sliding_window(config) if model_type in _EVERY_LAYER_WINDOW else None
    return {"linear_bias": False, **({} if window is None else {"window_size": window})}


def _gpt_oss_fields(config: dict, layers: int) -> dict:
    """GPT-OSS's own parts: biases on every linear (attention output, router, experts), the sliding window on
    the ``sliding_attention`` layers, a learned sink per head, the clamped SwiGLU."""
    quantized = config.get("quantization_config")
    if quantized:
        raise _refuse("quantization_config", quantized.get("quant_method", quantized), "the experts are stored "
                      "quantized (MXFP4 blocks and scales); load the model in transformers with Mxfp4Config("
                      "dequantize=True), save_pretrained it in bfloat16 and import that folder.")  # fmt: skip
    if float(config.get("swiglu_alpha", _GPT_OSS_ALPHA)) != _GPT_OSS_ALPHA:
        raise _refuse("swiglu_alpha", config["swiglu_alpha"], f"Megatron's quick_gelu fixes it at {_GPT_OSS_ALPHA}.")
    kinds = config.get("layer_types") or [("sliding_attention", "full_attention")[i % 2] for i in range(layers)]
    unknown = sorted(set(kinds) - set(_WINDOW_KINDS))
    if unknown or len(kinds) != layers:
        raise _refuse("layer_types", kinds, f"one of {sorted(_WINDOW_KINDS)} per layer ({layers}) converts.")
    window = _sliding_window(config)
    windowed = tuple(i for i, kind in enumerate(kinds) if _WINDOW_KINDS[kind])
    return dict(linear_bias=True, attention_sinks=True, swiglu_limit=float(config.get("swiglu_limit", 7.0)),
                window_size=window if window and windowed else None,
                window_layers=windowed if window and len(windowed) < layers else ())  # fmt: skip


def _moe_fields(config: dict, model_type: str, layers: int) -> dict:
    """The `ModelShape` MoE fields of a Qwen3-MoE, Mixtral or Qwen2-MoE config ({} for dense families)."""
    if model_type not in _MOE_TYPES:
        return {}
    if float(config.get("router_jitter_noise") or 0.0):
        raise _refuse("router_jitter_noise", config["router_jitter_noise"], "routing with noise is not deterministic.")
    experts = int(config.get("num_experts") or config.get("num_local_experts"))
    # router_aux_loss_coef is a training setting (transformers applies it only with output_router_logits):
    # the run's config sets the balance loss (ModelShape.MOE_TRAINING_FIELDS), not the checkpoint
    fields = dict(num_experts=experts, moe_router_topk=int(config["num_experts_per_tok"]))
    if model_type in ("mixtral", "gpt_oss"):  # every layer is MoE, experts of intermediate_size, top-k renormalized
        return {**fields, "moe_ffn_hidden_size": int(config["intermediate_size"]), "moe_router_topk_norm": True}
    step = int(config.get("decoder_sparse_step", 1))
    dense = sorted(set(config.get("mlp_only_layers") or []) | {i for i in range(layers) if (i + 1) % step})
    fields.update(moe_ffn_hidden_size=int(config["moe_intermediate_size"]), moe_dense_layers=tuple(dense),
                  moe_router_topk_norm=bool(config.get("norm_topk_prob", False)))  # fmt: skip
    if model_type == "qwen2_moe" and config.get("shared_expert_intermediate_size"):
        shared = int(config["shared_expert_intermediate_size"])
        fields.update(moe_shared_expert_size=shared, moe_shared_expert_gate=True)
    return fields


def hf_config_from_shape(shape: ModelShape, *, dtype: str = "bfloat16", extra: dict | None = None) -> dict:
    """A ``config.json`` that transformers loads as the same model: ``rope_parameters`` for transformers 5,
    ``rope_theta`` / ``rope_scaling`` for 4.x readers (vLLM releases pin either). ``extra`` keeps fields
    of the source config (token ids, ...)."""
    if shape.family not in HF_FAMILIES:
        raise ValueError(f"model.family={shape.family!r} has no Hugging Face counterpart; export needs one of "
                         f"{', '.join(sorted(HF_FAMILIES))}.")  # fmt: skip
    _check_family_parts(shape)
    rope = _hf_rope(shape)
    config = dict(extra or {})
    config.update(
        architectures=[HF_FAMILIES[shape.family].architecture],
        model_type=shape.family,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.expert_size if shape.family == "gpt_oss" else shape.ffn_size,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.kv_heads,
        head_dim=shape.head_size,
        vocab_size=shape.vocab_size,
        max_position_embeddings=shape.max_sequence_length,
        rms_norm_eps=shape.norm_epsilon,
        rope_parameters=rope,
        rope_theta=shape.rotary_base,
        rope_scaling=rope if rope["rope_type"] != "default" else None,
        hidden_act="silu",
        tie_word_embeddings=shape.tie_embeddings,
        torch_dtype=dtype,  # transformers 4 reads this key, transformers 5 "dtype": one value, the tensors'
        dtype=dtype,
    )
    if shape.family in ("llama", "qwen3", "qwen3_moe"):
        config["attention_bias"] = shape.qkv_bias
    if shape.family in _EVERY_LAYER_WINDOW:
        config["sliding_window"] = shape.window_size
    config.update(_hf_moe_fields(shape))
    if shape.family == "gpt_oss":
        kinds = ["sliding_attention" if w else "full_attention" for w in shape.window_per_layer()]
        config.update(attention_bias=True, sliding_window=shape.window_size, layer_types=kinds,
                      swiglu_limit=shape.swiglu_limit, swiglu_alpha=_GPT_OSS_ALPHA)  # fmt: skip
    return config


def _hf_rope(shape: ModelShape) -> dict:
    if shape.rope_scaling_factor is not None:
        return {"rope_type": "llama3", "rope_theta": shape.rotary_base, "factor": shape.rope_scaling_factor,
                **_LLAMA3_FIXED}  # fmt: skip
    if shape.yarn_factor is not None:
        return {"rope_type": "yarn", "rope_theta": shape.rotary_base, "factor": shape.yarn_factor,
                "beta_fast": shape.yarn_beta_fast, "beta_slow": shape.yarn_beta_slow, "truncate": shape.yarn_truncate,
                "original_max_position_embeddings": shape.yarn_original_max_position_embeddings}  # fmt: skip
    return {"rope_type": "default", "rope_theta": shape.rotary_base}


def _check_family_parts(shape: ModelShape) -> None:
    """A shape whose parts its family's Hugging Face class does not have (a declared ``model.family`` with
    other keys) is refused: the export would load as another model."""
    gpt_oss = dict(linear_bias=True, qkv_bias=True, attention_sinks=True, is_moe=True, moe_router_topk_norm=True)
    if shape.family == "gpt_oss":
        wrong = [k for k, v in gpt_oss.items() if getattr(shape, k) != v]
        wrong += [] if shape.swiglu_limit else ["swiglu_limit"]
    else:
        window = ("window_layers",) if shape.family in _EVERY_LAYER_WINDOW else ("window_size",)
        wrong = [k for k in ("linear_bias", "attention_sinks", "swiglu_limit", *window) if getattr(shape, k)]
    if wrong:
        raise ValueError(f"model.family={shape.family} with model.{wrong[0]}={getattr(shape, wrong[0])!r}: the "
                         f"Hugging Face {HF_FAMILIES[shape.family].architecture} does not have that part; "
                         "export would write another model.")  # fmt: skip


def _hf_moe_fields(shape: ModelShape) -> dict:
    """The config.json MoE keys of a Qwen3-MoE, Mixtral, Qwen2-MoE or GPT-OSS shape ({} for dense families)."""
    if shape.family not in _MOE_TYPES:
        return {}
    fields = {"num_experts_per_tok": shape.moe_router_topk}  # router_aux_loss_coef: the source's, in ``extra``
    if shape.family == "gpt_oss":
        return {**fields, "num_local_experts": shape.num_experts}
    if shape.family == "mixtral":
        if shape.expert_size != shape.ffn_size or not shape.moe_router_topk_norm or shape.moe_dense_layers:
            raise ValueError("a Mixtral config has experts of intermediate_size in every layer, top-k renormalized.")
        return {**fields, "num_local_experts": shape.num_experts, "router_jitter_noise": 0.0}
    fields.update(num_experts=shape.num_experts, moe_intermediate_size=shape.expert_size, decoder_sparse_step=1,
                  mlp_only_layers=list(shape.moe_dense_layers), norm_topk_prob=shape.moe_router_topk_norm)  # fmt: skip
    if shape.family == "qwen2_moe":
        fields["shared_expert_intermediate_size"] = shape.moe_shared_expert_size or 0
    return fields


def check_output_folder(out: str | Path, *, overwrite: bool) -> None:
    """Refuse to write into a folder that holds files, unless ``overwrite`` (an export never mixes with, or
    silently replaces, another model)."""
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not overwrite:
        raise FileExistsError(
            f"{out} exists and is not empty; an export would replace what is there. Choose a new folder, or pass "
            "--overwrite to replace it."
        )


def check_safetensors(folder: str | Path) -> int:
    """Read the header of every ``*.safetensors`` file of an HF folder (and its index, when there is one)
    without loading a tensor: the header must be JSON, every tensor's bytes inside the file, the file no
    shorter than its tensors, and every file the index names present. Returns the number of tensors; a
    `ValueError` names the file and what is wrong (a truncated or partial download, most often)."""
    import struct

    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError, AttributeError) as exc:
            raise ValueError(f"{index} is not a safetensors index ({exc}); re-download it.") from None
        missing = [n for n in names if not (folder / n).is_file()]
        if missing:
            raise ValueError(f"{index} names {missing[:3]} but they are not in {folder}; the download is incomplete.")
        files = [folder / n for n in names]
    else:
        files = sorted(folder.glob("*.safetensors"))
    tensors = 0
    for file in files:
        size = file.stat().st_size
        with file.open("rb") as f:
            head = f.read(8)
            length = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
            if length < 2 or 8 + length > size:
                raise ValueError(f"{file} is not a safetensors file ({size} bytes; its header length does not fit); "
                                 "re-download it.")  # fmt: skip
            try:
                header = json.loads(f.read(length))
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise ValueError(f"{file}: the safetensors header is not JSON ({exc}); re-download the file.") from None
        ends = [entry["data_offsets"][1] for key, entry in header.items() if key != "__metadata__"]
        if 8 + length + max(ends, default=0) > size:
            raise ValueError(
                f"{file} is truncated: its header places {8 + length + max(ends)} bytes of tensors, the file has "
                f"{size}; re-download it."
            )
        tensors += len(ends)
    return tensors
