"""Tiny random Hugging Face decoders of each family we convert, saved as safetensors folders.

Every parameter is drawn at random (norm weights around 1, biases around 0): with the library's default
initialization all norm weights are 1 and biases 0, and a converter that swapped two norms or dropped a
bias would still match. GPT-OSS's sinks and router bias are drawn at scale 1 (so a sink or a bias moves
the result well past the tolerance), and the experts' stacked gate/up weights (``gate_up_proj``: GPT-OSS,
and the MoE families as transformers 5 holds them in memory) at scale 1, so that about a third of
GPT-OSS's gate and up values pass the clamp at +-7 (the clamp is exercised, not idle).
"""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 101  # odd on purpose: TP=2 pads it to 102, and the padded row must never count

BASE = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=VOCAB,
    max_position_embeddings=16384,
    rms_norm_eps=1e-5,
)

FAMILIES = {
    # Llama 3.x: RoPE base 500000 with Llama-3 scaling.
    "llama3": (
        "LlamaConfig",
        dict(
            rope_theta=500000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
        ),
    ),
    "qwen2": ("Qwen2Config", dict(rope_theta=1000000.0)),  # q/k/v biases
    "qwen3": ("Qwen3Config", dict(head_dim=32, rope_theta=1000000.0)),  # q/k norms; head_dim != hidden/heads
    "llama_tied": ("LlamaConfig", dict(tie_word_embeddings=True)),
    "mistral": ("MistralConfig", dict(sliding_window=4)),  # every layer sees 4 tokens (the test sequences: up to 25)
    # Mixture-of-Experts: 4 experts, top-2; Qwen3-MoE with a dense second layer, Qwen2-MoE with its gated
    # shared expert and softmax-then-top-k (no renormalization).
    "qwen3_moe": ("Qwen3MoeConfig", dict(head_dim=32, rope_theta=1000000.0, num_experts=4, num_experts_per_tok=2,
                                         moe_intermediate_size=48, norm_topk_prob=True, mlp_only_layers=[1])),
    "mixtral": ("MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=None,
                                      rope_theta=1000000.0)),
    "qwen2_moe": ("Qwen2MoeConfig", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                                         shared_expert_intermediate_size=80, norm_topk_prob=False,
                                         rope_theta=1000000.0)),
    # GPT-OSS: a window of 4 tokens on layer 0 (the test sequences run to 25), full attention on layer 1,
    # YaRN x4 over an original context of 64 (its ramp and attention factor 1.139 both matter), sinks,
    # biases everywhere, clamped SwiGLU experts.
    "gpt_oss": ("GptOssConfig", dict(head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=4,
                                     layer_types=["sliding_attention", "full_attention"], max_position_embeddings=256,
                                     rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, factor=4.0,
                                                          beta_fast=32.0, beta_slow=1.0, truncate=False,
                                                          original_max_position_embeddings=64))),
}  # fmt: skip
_UNIT_SCALE = ("sinks", "router.bias", "gate_up_proj")  # drawn at scale 1 (module docstring)


def make_tiny(family: str, folder: Path, seed: int = 0) -> Path:
    """Save a randomly initialized tiny model of ``family`` (see FAMILIES) to ``folder``."""
    import transformers

    class_name, extra = FAMILIES[family]
    config = getattr(transformers, class_name)(**{**BASE, **extra})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith(_UNIT_SCALE):
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.05 * torch.randn(p.shape, generator=g))
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def hf_logits(folder: Path, sequences: list[list[int]]) -> list[torch.Tensor]:
    """The reference: each sequence alone through the Hugging Face model, fp32 logits [n, V]."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        return [model(torch.tensor([s])).logits[0].float() for s in sequences]


CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + "
    "'\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def make_tokenizer(folder: Path, vocab_size: int) -> Path:
    """A byte-level BPE of ``vocab_size`` tokens trained on CHAMP text, with a ChatML chat template, saved
    as tokenizer.json + tokenizer_config.json (what Hugging Face chat models ship)."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from mcore_packing.data.real_text import champ_conversation_texts

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(champ_conversation_texts()[:300], trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {"chat_template": CHATML, "eos_token": "<|im_end|>", "bos_token": None, "pad_token": "<|endoftext|>"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def make_chat_model(folder: Path, vocab_size: int = 384, family: str = "qwen2") -> Path:
    """A tiny chat model of ``family`` (Qwen2 by default; any of `FAMILIES`): random weights of make_tiny's
    shape with a trained tokenizer."""
    import transformers

    class_name, extra = FAMILIES[family]
    config = getattr(transformers, class_name)(**{**BASE, "vocab_size": vocab_size, **extra})
    torch.manual_seed(1)
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
    return make_tokenizer(folder, vocab_size)
