"""Per-token log-probs without the whole fp32 logits: the output layer and the cross-entropy a chunk of tokens
at a time (``model.logprob_chunk_size``, NeMo-RL's ``logprob_chunk_size``).

Megatron's GPTModel computes a micro-batch's logits whole, ``[s, b, V/TP]`` in the model's dtype, and its
vocabulary-parallel cross-entropy upcasts them to fp32 and keeps a softmax of that size for the backward:
for 32k tokens and a 152k vocabulary at TP1 that is 20 GB of fp32 beside the model's dtype's copy, in the
loss and in every log-prob pass. `chunk_logprobs(model, chunk_tokens)` changes two things on each of the
model's last-stage chunks, until `undo` is called:

- the output layer returns `output_layer.DeferredLogits` (its input as it would multiply it, sequence-
  parallel shards gathered, and its weight) instead of computing the logits;
- the model's ``compute_language_model_loss`` computes, for each chunk of about ``chunk_tokens`` tokens
  (whole positions of the ``b`` rows), that chunk's logits and its per-token loss with the model's own
  ``compute_language_model_loss`` (the same kernel, fused or not), and, when `entropy.capture_entropy`
  asked, its entropy. Under autograd each chunk runs under non-reentrant activation checkpointing: its
  logits are freed after its forward and recomputed in its backward, so at most one chunk's logits and
  softmax exist at once, for one more output-layer matmul per chunk in training (none in a log-prob pass).

The gradient flows as through Megatron's ``ColumnParallelLinear``: into the weight (and from there to its
main grad through Megatron's DDP hooks) and into the input through the same tensor-parallel region
(all-reduced without SP, reduce-scattered with it). Each position's logits are the same matmul of the
same row, so the values equal the unchunked computation up to the matmul's summation order.

Refused (named): the output layer with a bias or gathered output, MuP's logit scaling, deferred
embedding wgrad; a forward that asks for the logits themselves (no labels) raises.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
from torch.utils.checkpoint import checkpoint

from .output_layer import DeferredLogits, language_models

__all__ = ["ChunkedLogprobs", "chunk_logprobs"]


@dataclass
class ChunkedLogprobs:
    """The installed change (`chunk_logprobs`); `undo` restores the model."""

    models: list
    chunk_tokens: int

    def undo(self) -> None:
        for inner in self.models:
            inner.output_layer.__dict__.pop("forward", None)
            inner.__dict__.pop("compute_language_model_loss", None)
        self.models = []

    def __enter__(self) -> ChunkedLogprobs:
        return self

    def __exit__(self, *_exc) -> None:
        self.undo()


def chunk_logprobs(model, chunk_tokens: int) -> ChunkedLogprobs:
    """Compute ``model``'s (a chunk or a list of chunks, wrapped or not) per-token losses ``chunk_tokens``
    tokens at a time (see the module docstring). Also a context manager."""
    if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 1:
        raise ValueError(
            f"logprob_chunk_size={chunk_tokens!r} must be an integer >= 1 (tokens per chunk), or null to compute "
            "the logits whole."
        )
    models = language_models(model)
    for inner in models:
        _check(inner)
    for inner in models:
        layer = inner.output_layer
        layer.forward = partial(_deferred_forward, layer, chunk_tokens)
        own = type(inner).compute_language_model_loss.__get__(inner)  # the class's, bound: Megatron's loss
        inner.compute_language_model_loss = partial(_chunked_loss, own)
    return ChunkedLogprobs(models=models, chunk_tokens=chunk_tokens)


def _check(inner) -> None:
    layer, config = inner.output_layer, inner.config
    problems = {
        "the output layer has a bias": getattr(layer, "bias", None) is not None,
        "the output layer gathers its output": bool(getattr(layer, "gather_output", False)),
        "MuP scales the logits (use_mup)": bool(getattr(config, "use_mup", False)),
        "defer_embedding_wgrad_compute is set": bool(getattr(config, "defer_embedding_wgrad_compute", False)),
    }
    found = [why for why, bad in problems.items() if bad]
    if found:
        raise ValueError(f"chunked log-probs (model.logprob_chunk_size) cannot run here: {'; '.join(found)}. Set "
                         "model.logprob_chunk_size=null.")  # fmt: skip


def _deferred_forward(layer, chunk_tokens: int, input_, weight=None, runtime_gather_output=None, **_kwargs):
    """The output layer's forward under chunked log-probs: the input through the layer's tensor-parallel
    region (as ``ColumnParallelLinear`` would), the logits deferred."""
    from megatron.core.tensor_parallel.mappings import (
        copy_to_tensor_model_parallel_region,
        gather_from_sequence_parallel_region,
    )

    if runtime_gather_output:
        raise ValueError("chunked log-probs (model.logprob_chunk_size) keep the logits vocabulary-parallel; "
                         "runtime_gather_output is not supported.")  # fmt: skip
    group = layer.tp_group
    if layer.sequence_parallel:
        hidden = gather_from_sequence_parallel_region(input_, tensor_parallel_output_grad=True, group=group)
    elif group is not None and group.size() > 1:
        hidden = copy_to_tensor_model_parallel_region(input_, group=group)
    else:
        hidden = input_
    config = getattr(layer, "config", None)
    copy = getattr(config, "cross_entropy_loss_fusion", False)
    deferred = DeferredLogits(hidden=hidden, weight=layer.weight if weight is None else weight,
                              chunk_tokens=chunk_tokens, copy_for_loss=bool(copy))  # fmt: skip
    return deferred, None


def _chunked_loss(original, labels: torch.Tensor, logits) -> torch.Tensor:
    """The model's ``compute_language_model_loss`` under chunked log-probs: ``[b, s]`` per-token losses,
    a chunk of positions at a time (whole logits go to ``original``)."""
    if not isinstance(logits, DeferredLogits):
        return original(labels, logits)
    positions = logits.hidden.shape[0]
    step = max(1, logits.chunk_tokens // max(1, logits.hidden.shape[1]))
    run = partial(_chunk, original, logits)
    losses, entropies = [], []
    for start in range(0, positions, step):
        args = (logits.hidden[start : start + step], logits.weight, labels[:, start : start + step])
        loss, entropy = checkpoint(run, *args, use_reentrant=False) if torch.is_grad_enabled() else run(*args)
        losses.append(loss)
        entropies.append(entropy)
    if logits.entropy is not None:
        logits.entropy[0].push(torch.cat(entropies, dim=1))
    return torch.cat(losses, dim=1)


def _chunk(original, deferred: DeferredLogits, hidden, weight, labels):
    """One chunk's per-token loss ``[b, n]`` (and entropy ``[b, n]`` when asked, else None)."""
    logits = torch.matmul(hidden, weight.t())
    if deferred.scale != 1:
        logits = logits * deferred.scale
    entropy = None
    if deferred.entropy is not None:
        entropy = deferred.entropy[1](logits).transpose(0, 1)
        if logits.dtype == torch.float32 or deferred.copy_for_loss:
            logits = logits.clone()  # the cross-entropy may write into its input; the entropy saved it
    return original(labels, logits), entropy
