"""The last stage's output layer, as the hooks on it see it.

`output_layers(model)`: the output layers of a model's chunks that compute logits (under DDP and
friends). `DeferredLogits`: what an output layer returns under `chunked_logprobs.chunk_logprobs`
instead of the whole ``[s, b, V/TP]`` logits: its input as it would multiply it and its weight, and the
edits the hooks on the layer ask for (the sampling temperature's scale, the entropy, a shared prompt's
extra targets), applied to each chunk of logits when the loss computes them. The hooks
(`temperature.logits_temperature`, `entropy.capture_entropy`, `shared_prefix.score_extra_rows`) take
either form.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

__all__ = ["DeferredLogits", "output_layers"]


def output_layers(model) -> list:
    """The output layers of ``model``'s chunks (unwrapped from DDP and friends) that compute logits."""
    return [inner.output_layer for inner in language_models(model)]


def language_models(model) -> list:
    """``model``'s chunks (unwrapped from DDP and friends) that hold an output layer computing logits."""
    chunks = model if isinstance(model, (list, tuple)) else [model]
    found = []
    for chunk in chunks:
        inner = chunk
        while hasattr(inner, "module") and not hasattr(inner, "output_layer"):  # DDP, Float16Module
            inner = inner.module
        if getattr(inner, "output_layer", None) is not None and getattr(inner, "post_process", True):
            found.append(inner)
    return found


@dataclass(frozen=True)
class DeferredLogits:
    """The logits of ``hidden @ weight.T * scale``, not yet computed. ``hidden`` ``[s, b, h]``: the whole
    row the output layer multiplies (sequence-parallel shards gathered); ``weight`` ``[V/TP, h]``.
    ``entropy``: ``(capture, fn)``: the per-token entropy ``fn(logits)`` of every chunk, queued ``[b, s]`` on
    ``capture``. ``copy_for_loss``: the cross-entropy writes into its input (fp32 logits, fused kernels), so
    a chunk whose entropy was taken hands it a copy."""

    hidden: torch.Tensor
    weight: torch.Tensor
    chunk_tokens: int
    scale: float = 1.0
    entropy: tuple | None = None
    copy_for_loss: bool = False

    def scaled(self, factor: float) -> DeferredLogits:
        return replace(self, scale=self.scale * factor)

    def with_entropy(self, capture, fn) -> DeferredLogits:
        return replace(self, entropy=(capture, fn))

    def with_rows(self, rows: torch.Tensor) -> DeferredLogits:
        """The positions ``rows`` (``[E]`` int64) scored again after the row's own."""
        return replace(self, hidden=torch.cat([self.hidden, self.hidden.index_select(0, rows)]))

    def transpose(self, *_args):
        raise RuntimeError(
            "the output layer's logits were deferred for chunked log-probs (model.logprob_chunk_size), and this "
            "forward asked for the logits themselves (no labels); run it without chunked log-probs."
        )
