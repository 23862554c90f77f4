"""Predicted memory per rank: the static terms, each micro-batch's activations, and each pipeline stage's
peak over the schedule in the planner's order. numpy only; bytes throughout.

Static (per rank): the parameters this rank holds (its stage's layers, TP slices; norms and row-parallel
biases whole; the embedding on the first stage, the output layer on the last, padded to a multiple of
TP), their gradients (Megatron DDP's buffer, ``grad_bytes`` each), and the optimizer state (Adam: two fp32
moments; SGD: one; plus fp32 master weights when the parameters are 16-bit), divided over the DP ranks
with the distributed optimizer.

Activations: the bytes autograd saves in a micro-batch's forward and frees in its backward, per term,
for Megatron's local layer spec with the built-in attention (the layouts `PackedCoreAttention` runs;
every term was read from the real model on the CPU and is checked there, `tests/test_memory_model.py`).
With ``n`` tokens on this rank (``T / cp``, and ``/ tp`` for what sequence parallelism shards), width
``h``, ``e`` bytes per element, per layer:

- the two norms: input and output (``2 h e``, RMSNorm also its normalized input) and fp32 statistics;
- the linear layers' inputs: QKV and FC1 ``h e`` (sharded under SP), the projection ``q / tp`` and FC2
  ``f / tp`` (whole tokens);
- RoPE: its cos and sin for queries and keys, ``4 r e`` per position;
- the MLP's activation: FC1's output and its activation's (``5 f / tp`` SwiGLU, ``2 f / tp`` GELU);
- the attention kernel's buffers (``attention``): ``sdpa-math`` (the CPU's SDPA, and any math fallback:
  queries, keys and values at every query head and the ``[heads, q, k]`` probabilities of each piece a
  query span attends to), ``flash`` (FlashAttention / torch's varlen: queries, keys, values at their own
  head counts, the output and fp32 log-sum-exp) or ``te-fused`` (TE's fused attention, assumed to save
  what flash saves: stated, not measured here). Under CP each sequence's two chunks attend to the keys up
  to their end (the local backend gathers them), plus the gather's int64 index (one per micro-batch).

The first stage adds the token ids (int64; a bool mask at TP > 1); the last the final norm, the output
layer's input and the loss: Megatron's cross-entropy keeps an fp32 ``[T, V/TP]`` softmax (plus 9 bytes
per token), the exact entropy keeps the logits once more; with ``logprob_chunk_size`` neither exists
whole (the chunks keep the output layer's whole input). Not in these terms: the pipeline's stage outputs
(one ``[n, h]`` per micro-batch in flight, which the schedule holds, not autograd), the allocator's
fragmentation and the kernels' workspaces (a GPU measures them: the GPU check).

A stage's peak: its static bytes plus the largest sum, over the schedule's operations
(`pipeline.stage_operations`, plain or interleaved, in the planner's order), of the activations of the
(micro-batch, chunk) pairs whose forward has run and whose backward has not.

Recomputation (Megatron's ``recompute_granularity``): ``selective`` keeps, instead of the attention
kernel's buffers, the rotated queries and keys and the QKV output (the values are a view of it); ``full``
(one layer per checkpoint) keeps each layer's input only, plus RoPE's table up to the longest sequence.

Mixture-of-Experts layers (tp = 1, no shared-expert gate): the norm's output once (the router's, the
dispatcher's and the shared expert's input), the router's top-k ids and probabilities, its routing map and
their probabilities, the permutation's order, the tokens routed to this rank's experts (``expert_tokens``;
the planner assumes balanced routing, the rank's tokens x top-k) and each one's SwiGLU in its expert (6
``f_e`` elements, measured with Megatron's ``SequentialMLP``; TE's grouped GEMM is the GPU's to measure),
and a shared expert as a dense SwiGLU. Static: each layer's experts divided over the EP ranks.

Not modeled (refused): MoE with TP > 1 or a shared-expert gate, MTP.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from dataclasses import dataclass

from ..validators import InvalidValue, require_choice, require_positive_int
from .layout import ParallelLayout
from .model_shape import ModelShape, padded_vocab_size
from .pipeline import stage_operations

__all__ = [
    "ATTENTION_KERNELS",
    "RECOMPUTE",
    "MemorySettings",
    "MicroBatchTokens",
    "activation_bytes",
    "check_covered",
    "format_bytes",
    "micro_batch_memory",
    "parse_bytes",
    "recompute_bytes",
    "stage_peak",
    "static_bytes",
]

ATTENTION_KERNELS = ("sdpa-math", "flash", "te-fused")
RECOMPUTE = ("none", "selective", "full")  # Megatron's recompute_granularity (full: uniform, one layer each)
STAT_BYTES = 4  # norms keep their statistics in fp32


@dataclass(frozen=True, kw_only=True)
class MemorySettings:
    """How the run holds its tensors. ``dtype_bytes``: parameters and activations (2: bf16/fp16);
    ``grad_bytes``: the DDP gradient buffer's element (4: grad_reduce_in_fp32); ``optimizer``: adam | sgd;
    ``attention``: one of `ATTENTION_KERNELS`; ``logprob_chunk_size``: tokens per chunk of the output layer
    and the loss (None: whole logits); ``entropy``: the exact entropy is computed (an RL loss's bonus or
    metric)."""

    dtype_bytes: int = 2
    grad_bytes: int = 4
    optimizer: str = "adam"
    distributed_optimizer: bool = False
    attention: str = "flash"
    logprob_chunk_size: int | None = None
    entropy: bool = False
    recompute: str = "none"

    def __post_init__(self):
        require_choice("dtype_bytes", self.dtype_bytes, (2, 4))
        require_choice("grad_bytes", self.grad_bytes, (2, 4))
        require_choice("optimizer", self.optimizer, ("adam", "sgd"))
        require_choice("attention", self.attention, ATTENTION_KERNELS)
        require_positive_int("logprob_chunk_size", self.logprob_chunk_size, allow_none=True)
        require_choice("recompute", self.recompute, RECOMPUTE)


@dataclass(frozen=True, kw_only=True)
class MicroBatchTokens:
    """A micro-batch as the memory model sees it: ``rows`` x ``width`` tokens (a THD row: 1 x its padded
    total), each sequence's real length (``lengths``) and, in a THD row, its padded span (``spans``)."""

    thd: bool
    lengths: tuple[int, ...]
    rows: int
    width: int
    spans: tuple[int, ...] = ()

    @property
    def total(self) -> int:
        return self.rows * self.width


def static_bytes(shape: ModelShape, layout: ParallelLayout, settings: MemorySettings, *, stage: int = 0) -> dict:
    """``{"params", "grads", "optimizer"}``: bytes on a rank of pipeline stage ``stage``."""
    check_covered(shape, layout)
    count = stage_parameters(shape, layout, stage)
    states = 2 if settings.optimizer == "adam" else 1
    master = 1 if settings.dtype_bytes < 4 else 0
    optimizer = count * 4 * (states + master)
    if settings.distributed_optimizer:
        optimizer /= layout.dp * layout.cp
    return {"params": count * settings.dtype_bytes, "grads": count * settings.grad_bytes, "optimizer": optimizer}


def stage_parameters(shape: ModelShape, layout: ParallelLayout, stage: int) -> int:
    """Parameters a TP rank of pipeline stage ``stage`` holds (all its model chunks; an MoE layer's
    experts divided over the EP ranks)."""
    tp, h, hd = layout.tp, shape.hidden_size, shape.head_size
    q, kv, f = shape.num_attention_heads * hd, shape.kv_heads * hd, shape.ffn_size
    norm = h if shape.normalization == "RMSNorm" else 2 * h
    split = h * (q + 2 * kv) + q * h  # column / row parallel weights
    split += (q + 2 * kv) if shape.qkv_bias or shape.linear_bias else 0
    whole = 2 * norm + (h if shape.linear_bias else 0) + (2 * hd if shape.qk_norm else 0)
    mlp = (3 if shape.gated_mlp else 2) * h * f // tp + ((2 if shape.gated_mlp else 1) * f // tp + h
                                                         if shape.linear_bias else 0)  # fmt: skip
    experts = 0
    if shape.is_moe:
        experts = shape.num_experts // layout.ep * 3 * h * shape.expert_size + h * shape.num_experts
        experts += 3 * h * (shape.moe_shared_expert_size or 0)
    moe = shape.moe_layers()
    indices = [i for v in range(layout.vpp) for i in _chunk_layers(shape, layout, stage, v)]
    count = sum(split // tp + whole + (experts if moe[i] else mlp) for i in indices)
    vocab = padded_vocab_size(shape.vocab_size, tp) * h // tp
    if stage == 0:
        count += vocab
    if stage == layout.pp - 1:
        count += norm + (vocab if not shape.tie_embeddings or layout.pp > 1 else 0)
    return count


def activation_bytes(
    shape: ModelShape, layout: ParallelLayout, settings: MemorySettings, mb: MicroBatchTokens, *,
    stage: int = 0, chunk: int = 0, cp_rank: int = 0, expert_tokens: int | None = None,
) -> dict:  # fmt: skip
    """The bytes a micro-batch's forward saves for its backward on a rank of ``stage`` (model chunk
    ``chunk``; CP rank ``cp_rank``), per term (see the module docstring). ``expert_tokens``: the tokens
    routed to this rank's experts, one count or one per MoE layer of the chunk (default: balanced routing,
    the rank's tokens x top-k)."""
    check_covered(shape, layout)
    e, tp, cp, h = settings.dtype_bytes, layout.tp, layout.cp, shape.hidden_size
    tokens = mb.total // cp
    sharded = tokens // tp if layout.sequence_parallel else tokens
    norm = sharded * ((2 if shape.normalization == "RMSNorm" else 1) * h * e
                      + (1 if shape.normalization == "RMSNorm" else 2) * STAT_BYTES)  # fmt: skip
    moe = [shape.moe_layers()[i] for i in _chunk_layers(shape, layout, stage, chunk)]
    if settings.recompute == "full":  # each layer keeps its input; RoPE's table is a checkpoint argument
        terms = {"layer_inputs": len(moe) * sharded * h * e, "rope": _rope_table(shape, layout, settings, mb)}
    else:
        attention = {
            "norms": norm,
            "linear_inputs": sharded * h * e + tokens * shape.num_attention_heads * shape.head_size // tp * e,
            "rope": 4 * (tokens if mb.thd else mb.width // cp) * shape.head_size * e,
            "attention": _attention_bytes(shape, layout, settings, mb, cp_rank),
        }
        routed = _routed(expert_tokens, sum(moe), tokens * shape.moe_router_topk if shape.is_moe else 0)
        blocks = [_mlp_bytes(shape, layout, settings, tokens, sharded, norm, routed.pop(0) if m else None)
                  for m in moe]  # fmt: skip
        terms = {name: len(moe) * value for name, value in attention.items()}
        for name in ("norms", "linear_inputs", "mlp_activation", "moe_dispatch"):
            terms[name] = terms.get(name, 0) + sum(block.get(name, 0) for block in blocks)
    if cp > 1 and mb.thd and settings.attention != "te-fused" and settings.recompute == "none":
        terms["attention"] += 8 * mb.total  # the local backend's key/value gather index, one per micro-batch
    first = stage == 0 and chunk == 0
    last = stage == layout.pp - 1 and chunk == layout.vpp - 1
    terms["embedding"] = tokens * (8 + (1 if tp > 1 else 0)) if first else 0
    terms["logits"] = _logits_bytes(shape, layout, settings, tokens, sharded, norm) if last else 0
    return terms


def _routed(expert_tokens, layers: int, balanced: int) -> list[int]:
    """Tokens routed to this rank's experts in each of ``layers`` MoE layers (balanced by default)."""
    if expert_tokens is None:
        return [balanced] * layers
    counts = [int(expert_tokens)] * layers if isinstance(expert_tokens, int) else [int(n) for n in expert_tokens]
    if len(counts) != layers:
        raise ValueError(f"expert_tokens gives {len(counts)} counts for {layers} MoE layers in this chunk.")
    return counts


def _mlp_bytes(shape, layout, settings, tokens: int, sharded: int, norm: float, routed: int | None) -> dict:
    """One MLP block's saved bytes, per term: dense (``routed`` None) or MoE (``routed`` tokens to this
    rank's experts)."""
    e, h, tp = settings.dtype_bytes, shape.hidden_size, layout.tp
    f = shape.ffn_size // tp
    if routed is None:
        return {"norms": norm, "linear_inputs": sharded * h * e + tokens * f * e,
                "mlp_activation": tokens * f * e * (4 if shape.gated_mlp else 1)}  # fmt: skip
    k = shape.moe_router_topk
    shared = tokens * 5 * (shape.moe_shared_expert_size or 0) * e  # a dense SwiGLU beside the experts
    experts = {
        "norms": norm,
        "linear_inputs": tokens * h * e,  # the norm's output: the router's, the dispatcher's, the shared expert's
        # top-k ids and probabilities, the routing map and its probabilities, the permutation's order
        "moe_dispatch": tokens * k * (8 + 4 + 8) + shape.num_experts * tokens * (1 + 4) + routed * h * e,
        "mlp_activation": routed * (6 * shape.expert_size * e + 4) + shared,  # each routed token's SwiGLU
    }
    return experts


def _chunk_layers(shape: ModelShape, layout: ParallelLayout, stage: int, chunk: int) -> range:
    """The global layer indices of model chunk ``chunk`` of ``stage`` (Megatron's interleaved offsets;
    stage -1: the first chunk's, for one layer's worth)."""
    per = _layers_per_chunk(shape, layout)
    start = (max(chunk, 0) * layout.pp + max(stage, 0)) * per
    return range(start, start + per)


def _attention_bytes(shape, layout, settings, mb: MicroBatchTokens, cp_rank: int) -> float:
    """One layer's attention kernel buffers on this rank (see the module docstring)."""
    e, tp, cp, d = settings.dtype_bytes, layout.tp, layout.cp, shape.head_size
    heads, kv_heads = shape.num_attention_heads // tp, max(1, shape.kv_heads // tp)
    if settings.recompute == "selective":  # the checkpoint keeps the rotated queries and keys, the QKV output
        return mb.total // cp * (2 * heads + 3 * kv_heads) * d * e + 4  # (values are a view of it), max_seqlen
    if mb.thd:
        spans = mb.lengths if cp == 1 else mb.spans  # one CP rank attends over real lengths; CP over spans
    else:
        spans = [mb.width] * mb.rows
    total = 0.0
    for s in spans:
        for q, k in _pieces(s, cp, cp_rank):
            if settings.attention == "sdpa-math":
                total += heads * e * (q * d + 2 * k * d + q * k)
            else:  # flash / TE: queries, output, keys and values at their own heads, fp32 log-sum-exp
                total += 2 * q * heads * d * e + 2 * k * kv_heads * d * e + q * heads * 4
    return total


def _rope_table(shape, layout, settings, mb: MicroBatchTokens) -> int:
    """Full recomputation's RoPE argument: the embedding of every position up to the longest sequence."""
    longest = max(mb.spans or mb.lengths) if mb.thd else mb.width
    return longest * shape.head_size * settings.dtype_bytes


def _pieces(span: int, cp: int, cp_rank: int) -> list[tuple[int, int]]:
    """(queries, keys) of each part of a sequence of ``span`` tokens this CP rank attends for: the whole
    causal span without CP; chunks ``r`` and ``2cp - 1 - r`` over the keys up to their ends with it."""
    if cp == 1:
        return [(span, span)]
    c = span // (2 * cp)
    return [(c, (j + 1) * c) for j in (cp_rank, 2 * cp - 1 - cp_rank)]


def _logits_bytes(shape, layout, settings, tokens: int, sharded: int, norm: float) -> float:
    """The last chunk's final norm, output-layer input and loss buffers."""
    e, h = settings.dtype_bytes, shape.hidden_size
    vocab = padded_vocab_size(shape.vocab_size, layout.tp) // layout.tp
    if settings.logprob_chunk_size is not None:  # the chunks keep the output layer's gathered input only
        return norm + tokens * h * e
    loss = tokens * (vocab * 4 + 9)  # Megatron's cross-entropy: fp32 softmax, target mask and ids
    entropy = tokens * vocab * e if settings.entropy else 0
    return norm + sharded * h * e + loss + entropy


def stage_peak(per_micro_batch: Sequence[Sequence], layout: ParallelLayout, stage: int) -> float:
    """The largest activation total a rank of ``stage`` holds over Megatron's schedule: ``per_micro_batch
    [i][v]`` is micro-batch ``i``'s (in the rank's order) activations in model chunk ``v``, or a pair
    ``(held, transient)``: what its forward keeps, and what its backward makes live on top (a recomputed
    layer, `recompute_bytes`)."""
    m = len(per_micro_batch)
    live = peak = 0.0
    group = layout.microbatch_group_size_per_vp_stage
    for kind, i, v in stage_operations(stage, layout.pp, m, vpp=layout.vpp, group=group):
        entry = per_micro_batch[i][v]
        held, transient = entry if isinstance(entry, (tuple, list)) else (entry, 0.0)
        if kind == "F":
            live += held
            peak = max(peak, live)
        else:
            peak = max(peak, live + transient)
            live -= held
    return peak


def micro_batch_memory(shape: ModelShape, layout: ParallelLayout, settings: MemorySettings, mb: MicroBatchTokens,
                       *, stage: int = 0, chunk: int = 0, cp_rank: int = 0) -> tuple[float, float]:  # fmt: skip
    """``(held, transient)`` of a micro-batch in model chunk ``chunk`` of ``stage``, for `stage_peak`:
    what its forward keeps, and what its backward's recomputation makes live on top at its worst (after
    the loss's buffers, freed first, on the last chunk)."""
    terms = activation_bytes(shape, layout, settings, mb, stage=stage, chunk=chunk, cp_rank=cp_rank)
    transient = recompute_bytes(shape, layout, settings, mb, cp_rank=cp_rank)
    if transient:  # the loss, the output layer and the final norm run their backward before any layer
        transient -= terms["logits"]
    return sum(terms.values()), max(transient, 0.0)


def recompute_bytes(shape: ModelShape, layout: ParallelLayout, settings: MemorySettings, mb: MicroBatchTokens, *,
                    cp_rank: int = 0) -> float:  # fmt: skip
    """What a micro-batch's backward makes live on top of what its forward kept, under recomputation:
    one layer's activations (``full``) or one layer's attention kernel buffers (``selective``); 0 without."""
    if settings.recompute == "none":
        return 0.0
    plain = dataclasses.replace(settings, recompute="none", logprob_chunk_size=None, entropy=False)
    one_layer = dataclasses.replace(shape, num_layers=layout.pp * layout.vpp, moe_dense_layers=[])  # MoE: its layer
    terms = activation_bytes(one_layer, layout, plain, mb, stage=-1, chunk=-1, cp_rank=cp_rank)
    if settings.recompute == "selective":
        return terms["attention"]
    held_input = mb.total // layout.cp // (layout.tp if layout.sequence_parallel else 1) * shape.hidden_size
    return sum(terms.values()) - held_input * settings.dtype_bytes  # the layer's input is already held


def _layers_per_chunk(shape: ModelShape, layout: ParallelLayout) -> int:
    chunks = layout.pp * layout.vpp
    if shape.num_layers % chunks:
        raise ValueError(f"{shape.num_layers} layers do not split evenly over pp x vpp = {chunks} model chunks.")
    return shape.num_layers // chunks


def check_covered(shape: ModelShape, layout: ParallelLayout | None = None) -> None:
    """A ValueError when the memory model does not cover ``shape`` on ``layout``."""
    if not shape.is_moe:
        return
    if layout is not None and layout.tp > 1:
        raise ValueError(f"the memory model covers Mixture-of-Experts layers at parallel.tp=1, not {layout.tp}.")
    if shape.moe_shared_expert_gate:
        raise ValueError("the memory model covers Mixture-of-Experts layers without a shared-expert gate "
                         "(model.moe_shared_expert_gate).")  # fmt: skip


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "kib": 2**10, "mib": 2**20,
          "gib": 2**30, "tib": 2**40}  # fmt: skip


def parse_bytes(text, *, key: str = "memory_budget") -> int:
    """Bytes from an integer or a string such as "72GiB", "80GB", "512 MiB" (a ValueError names ``key``)."""
    if isinstance(text, int) and not isinstance(text, bool) and text > 0:
        return text
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS or float(match.group(1)) <= 0:
        raise InvalidValue(f"{key}={text!r} is not a size: give bytes per GPU such as 72GiB, 80GB or 512MiB.",
                           key=key)  # fmt: skip
    return int(float(match.group(1)) * _UNITS[unit])


def format_bytes(n: float) -> str:
    """``n`` bytes as GiB, MiB or KiB (2 decimals)."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"
