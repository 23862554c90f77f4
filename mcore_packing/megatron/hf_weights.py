"""Hugging Face safetensors <-> Megatron GPTModel parameters, for any TP/PP layout.

Written here rather than taken from Megatron-Bridge, which needs TransformerEngine and CUDA-only
packages to install. Every Megatron parameter has one *kind* that says how it is cut over TP ranks:

    replicated   norms (input, pre-MLP, final, q/k)                 whole tensor on every rank
    vocab_rows   embedding, output layer                            rows; vocabulary padded to a TP multiple
    qkv          linear_qkv weight/bias from q/k/v_proj             whole query groups per rank (below)
    gate_up      linear_fc1 from gate_proj and up_proj              [gate rows of r; up rows of r]
    columns      linear_proj (o_proj), linear_fc2 (down_proj)       columns
    rows         attention sinks (one per head)                     rows (whole heads)

GPT-OSS stores each layer's experts stacked, one tensor for all of them, transposed against Megatron's
``[out, in]`` (``gate_up_proj`` ``[E, hidden, 2 I]`` with gate and up *interleaved* on the last dimension,
``down_proj`` ``[E, I, hidden]``, and their biases ``[E, 2 I]``, ``[E, hidden]``). Megatron holds one
``linear_fc1``/``linear_fc2`` per expert, so those HF names carry the expert, ``gate_up_proj[e]``:

    stacked_gate_up  expert e's fc1 weight or bias: de-interleaved, transposed, cut like gate_up
    stacked_down     expert e's fc2 weight: transposed, cut into columns
    stacked          expert e's fc2 bias: whole on every rank

Fused QKV layout: the rows of ``linear_qkv`` are grouped by query group: for each of the ``ng`` key/value
heads, its ``nq/ng`` query heads, then its key head, then its value head (``head_dim`` rows each), i.e. a
``[ng, nq/ng + 2, head_dim, hidden]`` view. TP rank ``r`` holds groups ``r*ng/TP .. (r+1)*ng/TP``.

Parameter names of both layer specs are mapped: the local spec's separate norms and TransformerEngine's
norms fused into the next linear (``linear_qkv.layer_norm_weight``, ``linear_fc1.layer_norm_weight``).
Import reads, through ``safetensors.safe_open`` (memory-mapped), only the rows or columns a rank owns;
pipeline stages take their layers by Megatron's own global ``layer_number``. Export merges the TP shards
of every stage back into the Hugging Face tensors (padding rows dropped, tied embeddings written once).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from ..planning.model_shape import ModelShape

__all__ = ["HFTensors", "hf_names", "load_hf_weights", "merge_to_hf"]

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_PER_LAYER = {
    "input_layernorm.weight": ("replicated", ["input_layernorm.weight"]),
    "pre_mlp_layernorm.weight": ("replicated", ["post_attention_layernorm.weight"]),
    # TransformerEngine's spec fuses each norm into the linear after it.
    "self_attention.linear_qkv.layer_norm_weight": ("replicated", ["input_layernorm.weight"]),
    "mlp.linear_fc1.layer_norm_weight": ("replicated", ["post_attention_layernorm.weight"]),
    "self_attention.q_layernorm.weight": ("replicated", ["self_attn.q_norm.weight"]),
    "self_attention.k_layernorm.weight": ("replicated", ["self_attn.k_norm.weight"]),
    "self_attention.linear_qkv.weight": ("qkv", [f"self_attn.{p}_proj.weight" for p in "qkv"]),
    "self_attention.linear_qkv.bias": ("qkv", [f"self_attn.{p}_proj.bias" for p in "qkv"]),
    "self_attention.linear_proj.weight": ("columns", ["self_attn.o_proj.weight"]),
    "self_attention.linear_proj.bias": ("replicated", ["self_attn.o_proj.bias"]),  # GPT-OSS
    "self_attention.core_attention.softmax_offset": ("rows", ["self_attn.sinks"]),  # GPT-OSS: a sink per head
    "mlp.linear_fc1.weight": ("gate_up", ["mlp.gate_proj.weight", "mlp.up_proj.weight"]),
    "mlp.linear_fc2.weight": ("columns", ["mlp.down_proj.weight"]),
}
_TOP = {
    "embedding.word_embeddings.weight": ("vocab_rows", ["model.embed_tokens.weight"]),
    "decoder.final_layernorm.weight": ("replicated", ["model.norm.weight"]),
    "output_layer.weight": ("vocab_rows", ["lm_head.weight"]),
    "output_layer.reward_weight": ("replicated", ["score.weight"]),  # a reward model (*ForSequenceClassification)
}


_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc1|linear_fc2)\.(weight|bias)$")
_MOE_BLOCK = {"mixtral": "block_sparse_moe"}  # the HF module holding router and experts (others: mlp)
_EXPERT_PROJ = {"mixtral": ("w1", "w3", "w2")}  # gate, up, down (others: gate_proj, up_proj, down_proj)
_ROUTER = {"gpt_oss": "mlp.router"}  # the HF router (others: {block}.gate)
_STACKED = {  # GPT-OSS: Megatron's per-expert parameter -> (kind, the HF tensor holding every expert's)
    ("linear_fc1", "weight"): ("stacked_gate_up", "gate_up_proj"),
    ("linear_fc1", "bias"): ("stacked_gate_up", "gate_up_proj_bias"),
    ("linear_fc2", "weight"): ("stacked_down", "down_proj"),
    ("linear_fc2", "bias"): ("stacked", "down_proj_bias"),
}
_INDEXED = re.compile(r"^(.+)\[(\d+)\]$")  # "...gate_up_proj[3]": expert 3 of a stacked tensor
_SHARED = {
    "mlp.shared_experts.linear_fc1.weight": ("gate_up", ["mlp.shared_expert.gate_proj.weight",
                                                         "mlp.shared_expert.up_proj.weight"]),
    "mlp.shared_experts.linear_fc2.weight": ("columns", ["mlp.shared_expert.down_proj.weight"]),
    "mlp.shared_experts.gate_weight": ("replicated", ["mlp.shared_expert_gate.weight"]),
}  # fmt: skip
"""Mixture-of-Experts parameters besides the routed experts: the router and Qwen2-MoE's shared expert."""


def _moe_names(rest: str, shape: ModelShape, expert_offset: int) -> tuple[str, list[str]] | None:
    """(kind, layer-relative HF names) of an MoE layer's parameter, or None when ``rest`` is not one. Local
    expert ``j`` of this rank is global expert ``expert_offset + j``; experts cut over TP like a dense MLP."""
    block = _MOE_BLOCK.get(shape.family, "mlp")
    expert = _EXPERT.match(rest)
    if expert:
        index, linear, what = expert_offset + int(expert.group(1)), expert.group(2), expert.group(3)
        if shape.family == "gpt_oss":
            kind, stacked = _STACKED[(linear, what)]
            return kind, [f"{block}.experts.{stacked}[{index}]"]
        gate, up, down = _EXPERT_PROJ.get(shape.family, ("gate_proj", "up_proj", "down_proj"))
        prefix = f"{block}.experts.{index}"
        if linear == "linear_fc1":
            return "gate_up", [f"{prefix}.{gate}.{what}", f"{prefix}.{up}.{what}"]
        return "columns", [f"{prefix}.{down}.{what}"]
    if rest in ("mlp.router.weight", "mlp.router.bias"):
        return "replicated", [f"{_ROUTER.get(shape.family, block + '.gate')}.{rest.rsplit('.', 1)[1]}"]
    if rest in _SHARED:
        kind, names = _SHARED[rest]
        return kind, [n.format(block=block) for n in names]
    return None


def hf_names(name: str, global_layer: int | None, shape: ModelShape, expert_offset: int = 0) -> tuple[str, list[str]]:
    """(kind, HF tensor names) of a Megatron parameter; ``global_layer`` is its layer's 0-based global index,
    ``expert_offset`` the global index of this rank's first expert (expert parallelism)."""
    match = _LAYER.match(name)
    if match:
        found = _PER_LAYER.get(match.group(2))
        if found is None and shape.is_moe:
            found = _moe_names(match.group(2), shape, expert_offset)
        if found is None:
            raise ValueError(f"Megatron parameter {name!r} has no Hugging Face counterpart in this converter.")
        kind, names = found
        return kind, [f"model.layers.{global_layer}.{n}" for n in names]
    if name not in _TOP:
        raise ValueError(f"Megatron parameter {name!r} has no Hugging Face counterpart in this converter.")
    kind, names = _TOP[name]
    if name == "output_layer.weight" and shape.tie_embeddings:
        names = ["model.embed_tokens.weight"]
    return kind, names


class HFTensors:
    """The tensors of a Hugging Face folder (one ``*.safetensors`` file, or shards with their index),
    opened lazily: `read` loads only the requested rows/columns of one tensor."""

    def __init__(self, folder: str | Path):
        from safetensors import safe_open

        self.folder = Path(folder)
        index = self.folder / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
        else:
            files = sorted(self.folder.glob("*.safetensors"))
            if not files:
                raise FileNotFoundError(f"{self.folder} holds no *.safetensors file (nor an index); export the "
                                        "model with save_pretrained(safe_serialization=True).")  # fmt: skip
            weight_map = {}
            for f in files:
                with safe_open(str(f), framework="pt") as handle:
                    weight_map.update(dict.fromkeys(handle.keys(), f.name))
        self.weight_map = weight_map
        self._open = {}
        self._safe_open = safe_open

    def _handle(self, name: str):
        if name not in self.weight_map:
            raise KeyError(name)
        file = self.weight_map[name]
        if file not in self._open:
            self._open[file] = self._safe_open(str(self.folder / file), framework="pt")
        return self._open[file]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handle(name).get_slice(name).get_shape())

    def read(self, name: str, rows: slice | None = None, cols: slice | None = None) -> torch.Tensor:
        sliced = self._handle(name).get_slice(name)
        if cols is not None:
            return sliced[rows or slice(None), cols]
        return sliced[rows] if rows is not None else sliced[:]


@dataclass(frozen=True)
class _Cut:
    """How one TP rank cuts a tensor: ``tp`` ranks, this one ``rank``."""

    rank: int
    tp: int

    def span(self, total: int) -> slice:
        per = total // self.tp
        return slice(self.rank * per, (self.rank + 1) * per)


def _read_rank_slice(hf: HFTensors, kind: str, names: list[str], cut: _Cut, shape: ModelShape, padded_vocab: int):
    if kind.startswith("stacked"):
        return _read_expert(hf, kind, names[0], cut)
    if kind == "replicated":
        return hf.read(names[0])
    if kind == "rows":
        return hf.read(names[0], rows=cut.span(hf.shape(names[0])[0]))
    if kind == "columns":
        return hf.read(names[0], cols=cut.span(hf.shape(names[0])[1]))
    if kind == "gate_up":
        ffn = hf.shape(names[0])[0]
        return torch.cat([hf.read(n, rows=cut.span(ffn)) for n in names])
    if kind == "vocab_rows":
        rows = cut.span(padded_vocab)
        real = hf.read(names[0], rows=slice(rows.start, min(rows.stop, shape.vocab_size)))
        pad = real.new_zeros((rows.stop - rows.start - real.shape[0], *real.shape[1:]))
        return torch.cat([real, pad])
    groups = cut.span(shape.kv_heads)  # qkv: whole query groups
    per_group, hd = shape.num_attention_heads // shape.kv_heads, shape.head_size
    q = hf.read(names[0], rows=slice(groups.start * per_group * hd, groups.stop * per_group * hd))
    k = hf.read(names[1], rows=slice(groups.start * hd, groups.stop * hd))
    v = hf.read(names[2], rows=slice(groups.start * hd, groups.stop * hd))
    local = groups.stop - groups.start
    rest = q.shape[1:]
    fused = torch.cat(
        [q.view(local, per_group, hd, *rest), k.view(local, 1, hd, *rest), v.view(local, 1, hd, *rest)], 1
    )
    return fused.reshape(-1, *rest)


def _stored_name(name: str) -> tuple[str, int | None]:
    """(the HF tensor's name, the expert it is indexed at or None): ``"x.gate_up_proj[3]"`` -> (x.gate_up_proj, 3)."""
    indexed = _INDEXED.match(name)
    return (indexed.group(1), int(indexed.group(2))) if indexed else (name, None)


def _read_expert(hf: HFTensors, kind: str, name: str, cut: _Cut) -> torch.Tensor:
    """This TP rank's share of one expert's parameter from a GPT-OSS stacked tensor (module docstring)."""
    stored, expert = _stored_name(name)
    value = hf.read(stored, rows=slice(expert, expert + 1))[0]
    if kind == "stacked":
        return value
    if kind == "stacked_down":  # [I, hidden] -> Megatron's [hidden, I], columns
        return value.t()[:, cut.span(value.shape[0])].contiguous()
    gate, up = value[..., 0::2], value[..., 1::2]  # [hidden, I] each (a bias: [I])
    if gate.dim() == 2:
        gate, up = gate.t(), up.t()
    rows = cut.span(gate.shape[0])
    return torch.cat([gate[rows], up[rows]]).contiguous()


def load_hf_weights(
    model, shape: ModelShape, folder: str | Path, *, tp_rank: int, tp_size: int, ep_rank: int = 0, ep_size: int = 1,
    etp_rank: int | None = None, etp_size: int | None = None,
) -> dict:
    """Copy the Hugging Face weights in ``folder`` into this rank's Megatron model chunk (unwrapped or
    DDP-wrapped); with expert parallelism only this rank's experts are read, cut over ``etp_size`` expert
    tensor-parallel ranks (None: the TP ranks). Every parameter must be found
    with the expected shape, else a ValueError names the tensor. Returns ``{"tensors_read": n,
    "bytes_read": b}``."""
    from ..planning.model_shape import padded_vocab_size

    module = getattr(model, "module", model)
    hf = HFTensors(folder)
    layer_number = {f"decoder.layers.{i}.": layer.layer_number - 1 for i, layer in enumerate(module.decoder.layers)}
    cut, padded = _Cut(tp_rank, tp_size), padded_vocab_size(shape.vocab_size, tp_size)
    expert_cut = cut if etp_size is None else _Cut(etp_rank or 0, etp_size)
    read = nbytes = 0
    with torch.no_grad():
        for name, param in module.named_parameters():
            prefix = next((p for p in layer_number if name.startswith(p)), None)
            offset = ep_rank * (shape.num_experts // ep_size) if shape.is_moe else 0
            kind, names = hf_names(name, layer_number.get(prefix), shape, offset)
            missing = [n for n in names if _stored_name(n)[0] not in hf.weight_map]
            if missing and name == "output_layer.reward_weight":
                continue  # a causal LM's folder: the reward head keeps its seeded start
            if missing:
                raise ValueError(
                    f"{folder}: tensor {missing[0]!r} is missing (needed for Megatron's {name}). The checkpoint "
                    "does not match its config.json; re-download it or point model.hf_path at the right folder."
                )
            value = _read_rank_slice(hf, kind, names, expert_cut if _is_expert(name) else cut, shape, padded)
            if tuple(value.shape) != tuple(param.shape):
                raise ValueError(
                    f"{folder}: {', '.join(names)} gives shape {tuple(value.shape)} for Megatron's {name} "
                    f"{tuple(param.shape)} on TP rank {tp_rank}/{tp_size}; config.json and the weights disagree."
                )
            param.copy_(value.to(param.dtype))
            read, nbytes = read + len(names), nbytes + value.numel() * value.element_size()
    return {"tensors_read": read, "bytes_read": nbytes}


def _is_expert(name: str) -> bool:
    return ".mlp.experts.local_experts." in name


def merge_to_hf(shards: dict[tuple[int, int], dict], layer_numbers: dict[int, list[int]], shape: ModelShape, *,
                expert_tp: int | None = None) -> dict:  # fmt: skip
    """Hugging Face tensors from Megatron state dicts keyed by ``(pp_rank, tp_rank)``; ``layer_numbers[pp]``
    lists the global (0-based) index of each local layer of stage ``pp``; ``expert_tp`` 1: every TP rank
    holds the routed experts whole (None: cut over the TP ranks)."""
    tp = 1 + max(t for _, t in shards)
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, torch.Tensor]] = {}  # GPT-OSS: each stacked tensor's experts, stacked at the end
    for pp in sorted({p for p, _ in shards}):
        parts = [shards[(pp, t)] for t in range(tp)]
        for name, first in parts[0].items():
            if not isinstance(first, torch.Tensor) or name.endswith("_extra_state"):
                continue
            match = _LAYER.match(name)
            layer = layer_numbers[pp][int(match.group(1))] if match else None
            kind, names = hf_names(name, layer, shape)
            if name == "output_layer.weight" and shape.tie_embeddings:
                continue  # the embedding is written once
            pieces = [p[name] for p in parts][: 1 if expert_tp == 1 and _is_expert(name) else None]
            for hf_name, value in _merge(kind, names, pieces, shape).items():
                stored, expert = _stored_name(hf_name)
                if expert is None:
                    out[hf_name] = value
                else:
                    experts.setdefault(stored, {})[expert] = value
    for stored, pieces in experts.items():
        if sorted(pieces) != list(range(shape.num_experts)):
            raise ValueError(f"{stored}: the state dicts hold experts {sorted(pieces)}, not all {shape.num_experts}; "
                             "merge the shards of every expert-parallel rank.")  # fmt: skip
        out[stored] = torch.stack([pieces[e] for e in range(shape.num_experts)])
    return out


def _merge(kind: str, names: list[str], pieces: list[torch.Tensor], shape: ModelShape) -> dict:
    if kind in ("replicated", "stacked"):
        return {names[0]: pieces[0]}
    if kind == "rows":
        return {names[0]: torch.cat(pieces)}
    if kind == "stacked_down":  # [hidden, I] -> GPT-OSS's [I, hidden]
        return {names[0]: torch.cat(pieces, dim=1).t().contiguous()}
    if kind == "stacked_gate_up":  # [gate; up] rows of every rank -> [hidden, 2 I] (a bias: [2 I]) interleaved
        halves = [p.chunk(2) for p in pieces]
        gate, up = torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])
        both = torch.stack([gate.t(), up.t()] if gate.dim() == 2 else [gate, up], dim=-1)
        return {names[0]: both.reshape(*both.shape[:-2], -1).contiguous()}
    if kind == "columns":
        return {names[0]: torch.cat(pieces, dim=1)}
    if kind == "vocab_rows":
        return {names[0]: torch.cat(pieces)[: shape.vocab_size]}
    if kind == "gate_up":
        halves = [p.chunk(2) for p in pieces]
        return {names[0]: torch.cat([h[0] for h in halves]), names[1]: torch.cat([h[1] for h in halves])}
    per_group, hd = shape.num_attention_heads // shape.kv_heads, shape.head_size
    rest = pieces[0].shape[1:]
    fused = torch.cat([p.reshape(-1, per_group + 2, hd, *rest) for p in pieces])
    return {
        names[0]: fused[:, :per_group].reshape(-1, *rest).contiguous(),
        names[1]: fused[:, per_group].reshape(-1, *rest).contiguous(),
        names[2]: fused[:, per_group + 1].reshape(-1, *rest).contiguous(),
    }
