"""Log-probs at the sampling temperature: the logits divided by the temperature the rollouts were drawn
at, in every pass that scores them (the log-prob passes of the policy and the reference, and training).

A response sampled at temperature T has probability softmax(z / T), so an importance ratio against it, a
KL to it, and the policy gradient all need log softmax(z / T); with T != 1 the plain log-probs are off by
the temperature on every token (the training/inference ratio then drifts from 1 with no bug in either
engine). `logits_temperature` divides the output layer's logits on every model chunk that has one (the
last pipeline stage; vocabulary-parallel logits divide shard by shard), for the duration of a block:

    with logits_temperature(policy.model, 0.7):
        old = compute_logprobs(policy.model, samples, plan, groups)

A forward hook on Megatron's output layer, so the model's own cross-entropy (`compute_language_model_loss`)
sees the scaled logits: no second logits tensor, and no change to a model that runs at T = 1.
"""

from __future__ import annotations

import contextlib
import math

from .output_layer import DeferredLogits, output_layers

__all__ = ["logits_temperature"]


@contextlib.contextmanager
def logits_temperature(model, temperature: float):
    """Within the block, ``model``'s (a chunk or a list of chunks, wrapped or not) logits are divided by
    ``temperature`` (> 0; 1 leaves the model untouched)."""
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not (
        math.isfinite(temperature) and temperature > 0
    ):
        raise ValueError(f"temperature={temperature!r} must be a finite number > 0 (1: the logits as they are).")
    if temperature == 1:
        yield
        return
    scale = 1.0 / temperature

    def divide(_module, _inputs, output):
        logits = output[0] if isinstance(output, tuple) else output
        logits = logits.scaled(scale) if isinstance(logits, DeferredLogits) else logits * scale
        return (logits, *output[1:]) if isinstance(output, tuple) else logits

    handles = [layer.register_forward_hook(divide) for layer in output_layers(model)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
