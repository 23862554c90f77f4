"""The policy's exact token entropy, H_t = -sum_v p_v log p_v over the whole vocabulary, computed from the
output layer's (vocabulary-parallel) logits a chunk of tokens at a time, so no fp32 [T, V] tensor exists at
once (the role of NeMo-RL's ``logprob_chunk_size`` and slime's ``--log-probs-chunk-size``).

`vocab_parallel_entropy(logits, tp_group, chunk_tokens)`: per token, the maximum, sum of exp and sum of
exp * z over this rank's vocabulary shard are all-reduced over TP (three numbers per token), giving
log Z = m + log S and H = log Z - sum exp(z - m) z / S. Its backward recomputes each chunk's softmax from
the saved logits and the saved log Z and H: dH/dz_v = -p_v (log p_v + H), again one chunk at a time, with
no collective (log Z and H are already global).

`capture_entropy(model, chunk_tokens)`: for the duration of a block, a forward hook on each chunk's output
layer computes H of the logits as the cross-entropy sees them (after `logits_temperature`'s hook when that
block encloses this one) and queues it, ``[b, s]`` like Megatron's per-token loss; the step driver takes it
for the micro-batch whose loss it computes next (`pop`). Megatron's cross-entropy works on fp32 logits in
place, and its fused versions write their gradient into the logits: the hook then hands the cross-entropy
a copy, so the logits this function saved stay intact (bf16 logits without fusion need no copy: Megatron
upcasts them first).
"""

from __future__ import annotations

import contextlib
from collections import deque
from functools import partial

import torch

from ..collectives import all_reduce

__all__ = ["EntropyCapture", "capture_entropy", "vocab_parallel_entropy"]


class _VocabParallelEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, group, chunk_tokens: int) -> torch.Tensor:
        vocab = logits.shape[-1]
        flat = logits.reshape(-1, vocab)
        count = flat.shape[0]
        log_z = torch.empty(count, dtype=torch.float32, device=logits.device)
        entropy = torch.empty_like(log_z)
        for start in range(0, count, chunk_tokens):
            z = flat[start : start + chunk_tokens].float()
            peak = z.max(dim=-1).values
            all_reduce(peak, group, op="max")
            shifted = torch.exp(z - peak[:, None])
            sums = torch.stack([shifted.sum(dim=-1), (shifted * z).sum(dim=-1)])
            all_reduce(sums, group)
            log_z[start : start + chunk_tokens] = peak + torch.log(sums[0])
            entropy[start : start + chunk_tokens] = log_z[start : start + chunk_tokens] - sums[1] / sums[0]
        ctx.save_for_backward(logits, log_z, entropy)
        ctx.chunk_tokens = chunk_tokens
        return entropy.reshape(logits.shape[:-1])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        logits, log_z, entropy = ctx.saved_tensors
        vocab, chunk = logits.shape[-1], ctx.chunk_tokens
        flat = logits.reshape(-1, vocab)
        grad = grad.reshape(-1).float()
        out = torch.empty_like(flat)
        for start in range(0, flat.shape[0], chunk):
            part = slice(start, start + chunk)
            log_p = flat[part].float() - log_z[part, None]
            out[part] = (-torch.exp(log_p) * (log_p + entropy[part, None]) * grad[part, None]).to(out.dtype)
        return out.reshape(logits.shape), None, None


def vocab_parallel_entropy(logits: torch.Tensor, group=None, chunk_tokens: int = 1024) -> torch.Tensor:
    """The entropy of softmax(``logits``) over the last dimension, which ``group`` (TP) shards; one value
    per token (float32), differentiable, at most ``chunk_tokens`` tokens' fp32 logits at a time."""
    if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 1:
        raise ValueError(f"chunk_tokens={chunk_tokens!r} must be an integer >= 1.")
    return _VocabParallelEntropy.apply(logits, group, chunk_tokens)


class EntropyCapture:
    """The queue of per-token entropies ``[b, s]`` the output layers computed, oldest first."""

    def __init__(self):
        self._queue: deque = deque()

    def push(self, entropy: torch.Tensor) -> None:
        self._queue.append(entropy)

    def pop(self) -> torch.Tensor:
        if not self._queue:
            raise RuntimeError("no entropy was computed for this micro-batch: run the forward inside capture_entropy.")
        return self._queue.popleft()


@contextlib.contextmanager
def capture_entropy(model, group=None, chunk_tokens: int = 1024):
    """Within the block, every forward of ``model``'s output layers (the last stage's chunks) queues the
    per-token entropy of its logits on the yielded `EntropyCapture`. ``group``: the TP group."""
    from .output_layer import DeferredLogits, output_layers

    capture = EntropyCapture()

    def hook(module, _inputs, output):
        logits = output[0] if isinstance(output, tuple) else output
        if isinstance(logits, DeferredLogits):  # chunked log-probs: each chunk's entropy, queued whole
            chunked = logits.with_entropy(capture, partial(vocab_parallel_entropy, group=group,
                                                           chunk_tokens=chunk_tokens))  # fmt: skip
            return (chunked, *output[1:]) if isinstance(output, tuple) else chunked
        capture.push(vocab_parallel_entropy(logits, group, chunk_tokens).transpose(0, 1))  # [s, b] -> [b, s]
        config = getattr(module, "config", None)
        if logits.dtype == torch.float32 or getattr(config, "cross_entropy_loss_fusion", False):
            logits = logits.clone()  # the cross-entropy may overwrite its input; the saved logits must stay
            return (logits, *output[1:]) if isinstance(output, tuple) else logits
        return None

    handles = [layer.register_forward_hook(hook) for layer in output_layers(model)]
    try:
        yield capture
    finally:
        for handle in handles:
            handle.remove()
