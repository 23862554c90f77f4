"""Initial weights that are a function of the seed and the model's shape only, on any layout and device.

Megatron draws its initial weights in construction order from an RNG that depends on where they are made:
with ``use_cpu_initialization`` from torch's CPU generator (so a pipeline stage that builds only its own
layers draws other numbers than a single stage), on a GPU from its model-parallel RNG tracker, seeded per
TP rank (so TP1 and TP2 differ) and not reset by ``torch.manual_seed`` (so a GRPO/DPO reference built
after the policy starts from other weights). `seeded_init_` replaces all that: every parameter is drawn
whole, at its TP1 shape, from a generator of its own seeded by ``(seed, its global name)``, then cut to
this rank's shard the way Megatron shards it. So the policy and its reference, TP1 and TP2 (gathered),
one pipeline stage or several, expert parallelism or none, CPU or GPU, the local layer spec or
TransformerEngine's, all start from the same weights (`tests/test_seeded_init.py`).

The global name is the TP1, single-stage name: the layer's global index (``layer_number - 1``), a routed
expert's global index, TransformerEngine's fused norm names read as the local spec's. The distributions
are Megatron's defaults: normal(0, ``init_method_std``) for weights, the output projections of each layer
(``linear_proj``, ``linear_fc2``) scaled by ``1 / sqrt(2 num_layers)``, biases zero, norm weights one
(zero with ``layernorm_zero_centered_gamma``). The vocabulary's padding rows (a TP multiple) are zero,
so padded logits, which `model` masks, start from nothing.

Cost: each rank draws the whole of every tensor it holds a shard of, on the CPU. Starting from a
checkpoint (``hf_path``) draws nothing.
"""

from __future__ import annotations

import hashlib
import math
import re

import torch

__all__ = ["global_parameter_name", "seeded_init_", "seeded_tensor"]

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_EXPERT = re.compile(r"\.local_experts\.(\d+)\.")
_TE_NORMS = {  # TransformerEngine's spec fuses each norm into the linear after it
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "self_attention.linear_qkv.layer_norm_bias": "input_layernorm.bias",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
    "mlp.linear_fc1.layer_norm_bias": "pre_mlp_layernorm.bias",
}
_VOCAB = ("embedding.word_embeddings.weight", "output_layer.weight")
_OUTPUT_PROJECTIONS = ("linear_proj.weight", "linear_fc2.weight")


def global_parameter_name(name: str, global_layers: dict[int, int], expert_offset: int = 0) -> str:
    """``name`` of a chunk's parameter as the TP1, single-stage local-spec model names it."""
    match = _LAYER.match(name)
    if match:
        rest = name[match.end() :]
        rest = _TE_NORMS.get(rest, rest)
        rest = _EXPERT.sub(lambda m: f".local_experts.{expert_offset + int(m.group(1))}.", rest)
        name = f"decoder.layers.{global_layers[int(match.group(1))]}.{rest}"
    return name


def _generator(seed: int, name: str) -> torch.Generator:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))


def _draw(name: str, full_shape: tuple[int, ...], *, seed: int, std: float, num_layers: int,
          zero_centered_gamma: bool) -> torch.Tensor:  # fmt: skip
    """The TP1 tensor of the parameter ``name`` (a global name)."""
    if name.endswith("bias"):
        return torch.zeros(full_shape)
    if "norm" in name.rsplit(".", 1)[0].rsplit(".", 1)[-1]:  # input_layernorm, q_layernorm, final_layernorm
        return torch.zeros(full_shape) if zero_centered_gamma else torch.ones(full_shape)
    scale = std / math.sqrt(2.0 * num_layers) if name.endswith(_OUTPUT_PROJECTIONS) else std
    return torch.empty(full_shape).normal_(0.0, scale, generator=_generator(seed, name))


def seeded_tensor(name: str, shape: tuple[int, ...], *, seed: int, std: float) -> torch.Tensor:
    """normal(0, ``std``) of ``shape`` from the generator of ``(seed, name)``: what `seeded_init_` draws for a
    weight of that global name (a module that makes its own parameter, `reward_head`, starts from it)."""
    return torch.empty(shape).normal_(0.0, std, generator=_generator(seed, name))


def _shard(full: torch.Tensor, param, tp_rank: int, tp_size: int) -> torch.Tensor:
    """This TP rank's part of ``full`` as Megatron shards ``param`` (its ``partition_dim`` and
    ``partition_stride``: a gated MLP's fc1 holds [gate rows of r; up rows of r])."""
    if not getattr(param, "tensor_model_parallel", False) or tp_size == 1:
        return full
    dim, stride = param.partition_dim, getattr(param, "partition_stride", 1)
    pieces = torch.chunk(full, stride * tp_size, dim=dim)
    return torch.cat(pieces[tp_rank::tp_size], dim=dim)


def seeded_init_(model, *, seed: int, num_layers: int, vocab_size: int, tp_rank: int = 0, tp_size: int = 1,
                 expert_offset: int = 0, etp_rank: int | None = None, etp_size: int | None = None) -> int:  # fmt: skip
    """Overwrite every parameter of a model chunk (unwrapped or DDP-wrapped) with its seeded value (see the
    module docstring); returns the number of parameters written. ``expert_offset``: the global index of
    this rank's first routed expert (expert parallelism); ``etp_rank``/``etp_size``: the routed experts'
    tensor-parallel place (None: the TP one)."""
    module = getattr(model, "module", model)
    config = module.config
    std = float(getattr(config, "init_method_std", 0.02))
    zero_gamma = bool(getattr(config, "layernorm_zero_centered_gamma", False))
    global_layers = {i: layer.layer_number - 1 for i, layer in enumerate(getattr(module.decoder, "layers", []))}
    written = 0
    with torch.no_grad():
        for name, param in module.named_parameters():
            key = global_parameter_name(name, global_layers, expert_offset)
            rank, size = (tp_rank, tp_size)
            if _EXPERT.search(name) and etp_size is not None:
                rank, size = etp_rank, etp_size
            shape = list(param.shape)
            if getattr(param, "tensor_model_parallel", False):
                shape[param.partition_dim] *= size
            if name in _VOCAB:  # the real vocabulary drawn, the TP padding rows zero
                full = torch.zeros(shape)
                full[:vocab_size] = _draw(key, (vocab_size, *shape[1:]), seed=seed, std=std, num_layers=num_layers,
                                          zero_centered_gamma=zero_gamma)  # fmt: skip
            else:
                full = _draw(key, tuple(shape), seed=seed, std=std, num_layers=num_layers,
                             zero_centered_gamma=zero_gamma)  # fmt: skip
            param.copy_(_shard(full, param, rank, size).to(param.dtype))
            written += 1
    return written
