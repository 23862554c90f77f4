"""config.json <-> ModelShape: every family's options, both transformers layouts, clear refusals."""

from __future__ import annotations

import copy

import pytest

from mcore_packing.planning import CostModel, ModelShape
from mcore_packing.planning.hf_config import hf_config_from_shape, shape_from_hf_config

LLAMA3_V4 = {  # the transformers-4 layout, as Meta's Llama-3.2-1B config.json has it
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-05,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "factor": 32.0,
        "high_freq_factor": 4.0,
        "low_freq_factor": 1.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "tie_word_embeddings": True,
    "hidden_act": "silu",
    "attention_bias": False,
    "mlp_bias": False,
}
QWEN3_V5 = {
    "model_type": "qwen3",
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 151936,
    "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-06,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
    "tie_word_embeddings": True,
    "sliding_window": None,
    "use_sliding_window": False,
}


def test_llama32_1b_in_the_v4_layout():
    shape = shape_from_hf_config(LLAMA3_V4)
    assert shape.family == "llama" and shape.rotary_base == 500000.0 and shape.rope_scaling_factor == 32.0
    assert shape.tie_embeddings and shape.gated_mlp and not shape.linear_bias and shape.head_dim is None
    assert (shape.kv_heads, shape.head_size, shape.norm_epsilon) == (8, 64, 1e-5)
    assert CostModel.from_shape(shape).linear > 0


def test_qwen3_06b_in_the_v5_layout_keeps_its_head_dim():
    shape = shape_from_hf_config(QWEN3_V5)
    assert shape.qk_norm and not shape.qkv_bias and shape.head_dim == 128 and shape.head_size == 128
    assert shape.rotary_base == 1e6 and shape.rope_scaling_factor is None


def test_qwen2_has_qkv_bias_without_a_config_key():
    shape = shape_from_hf_config({**QWEN3_V5, "model_type": "qwen2", "head_dim": None})
    assert shape.qkv_bias and not shape.qk_norm and shape.head_dim is None


@pytest.mark.parametrize("config", [LLAMA3_V4, QWEN3_V5, {**QWEN3_V5, "model_type": "mistral", "head_dim": 64}])
def test_written_config_reads_back_as_the_same_shape(config):
    shape = shape_from_hf_config(config)
    written = hf_config_from_shape(shape, dtype="bfloat16", extra={"bos_token_id": 7})
    assert shape_from_hf_config(written) == shape
    assert written["torch_dtype"] == "bfloat16" and written["bos_token_id"] == 7
    assert written["architectures"] == [{"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM",
                                         "mistral": "MistralForCausalLM"}[shape.family]]  # fmt: skip


def _with(config, **changes):
    out = copy.deepcopy(config)
    for key, value in changes.items():
        if key.startswith("rope_"):
            out["rope_scaling"][key[5:]] = value
        else:
            out[key] = value
    return out


@pytest.mark.parametrize(
    "config, fragment",
    [
        ({**LLAMA3_V4, "model_type": "gpt2"}, "model_type='gpt2'"),
        (_with(LLAMA3_V4, rope_rope_type="longrope"), "rope_type='longrope' is not supported"),
        (_with(LLAMA3_V4, rope_low_freq_factor=2.0), "low_freq_factor=1.0"),
        (_with(LLAMA3_V4, hidden_act="gelu"), "hidden_act='gelu'"),
        (_with(LLAMA3_V4, mlp_bias=True), "mlp_bias=True"),
        (_with(LLAMA3_V4, attention_bias=True), "attention_bias=True"),
        ({**QWEN3_V5, "model_type": "qwen2", "sliding_window": 4096, "use_sliding_window": True},
         "use_sliding_window=True"),
        ({**QWEN3_V5, "model_type": "mistral", "sliding_window": 2.5}, "sliding_window=2.5 is not supported"),
        ({**QWEN3_V5, "model_type": "mistral", "sliding_window": 0}, "sliding_window=0 is not supported"),
        ({**QWEN3_V5, "model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 2,
          "sliding_window": "4096"}, "sliding_window='4096' is not supported"),
        ({**QWEN3_V5, "num_key_value_heads": 5}, "not a multiple of num_query_groups=5"),
    ],
)
def test_what_would_not_convert_exactly_is_refused(config, fragment):
    with pytest.raises(ValueError) as err:
        shape_from_hf_config(config)
    assert fragment in str(err.value), str(err.value)


def test_mistrals_window_is_every_layers_and_writes_back():
    """Mistral's ``sliding_window`` (Hugging Face applies it on every layer) is the shape's window on every
    layer, and export writes it back; a window on some layers only has no Mistral counterpart."""
    import dataclasses

    shape = shape_from_hf_config({**QWEN3_V5, "model_type": "mistral", "sliding_window": 4096})
    assert (shape.window_size, shape.window_layers) == (4096, ())
    assert all(shape.window_per_layer())
    assert hf_config_from_shape(shape)["sliding_window"] == 4096
    assert shape_from_hf_config({**QWEN3_V5, "model_type": "mistral", "sliding_window": None}).window_size is None
    assert shape_from_hf_config({**QWEN3_V5, "model_type": "qwen2", "sliding_window": 4096}).window_size is None
    with pytest.raises(ValueError, match=r"model\.window_layers=\(0,\)"):
        hf_config_from_shape(dataclasses.replace(shape, window_layers=(0,)))


def test_gpt_family_has_no_hf_config():
    with pytest.raises(ValueError, match="no Hugging Face counterpart"):
        hf_config_from_shape(ModelShape())


def test_both_layer_specs_parameter_names_map_to_the_same_hf_tensors():
    """The local spec's norms and TransformerEngine's norms fused into the next linear name one HF tensor."""
    from mcore_packing.megatron.hf_weights import hf_names

    shape = shape_from_hf_config(QWEN3_V5)
    pairs = [
        ("input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight", "input_layernorm.weight"),
        ("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight", "post_attention_layernorm.weight"),
    ]
    for local, te, hf in pairs:
        want = ("replicated", [f"model.layers.7.{hf}"])
        assert hf_names(f"decoder.layers.0.{local}", 7, shape) == hf_names(f"decoder.layers.0.{te}", 7, shape) == want
    with pytest.raises(ValueError, match="no Hugging Face counterpart"):
        hf_names("decoder.layers.0.mlp.router.weight", 7, shape)
