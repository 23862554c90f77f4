"""Exact loss normalization for packed and dynamic micro-batches under Megatron's conventions.

The target is the loss of the whole global batch, computed unpacked and unpadded:

    token_mean:     L = sum_t m_t * l_t / G           G = valid (masked-in) target tokens in the global batch
    sequence_mean:  L = sum_s (sum_{t in s} m_t * l_t / V_s) / S    V_s = valid tokens of s, S = sequences with V_s > 0

Both are ``L = sum_t w_t * l_t`` with a per-token weight ``w_t``. A micro-batch on one rank contributes
``W = sum_{t local} w_t * l_t``; summed over micro-batches, CP ranks and DP ranks this is exactly ``L``,
however the batch was split. G and S are all-reduced over DP x CP once per step (`StepTotals`).

What a Megatron loss function must return so that the final gradient is grad(L):

- ``calculate_per_token_loss=False`` (2-tuple ``(loss, stats)``): Megatron multiplies by cp_size and
  divides by num_microbatches, and DDP averages over DP x CP, so return ``W * dp_size * num_microbatches``.
- ``calculate_per_token_loss=True`` (3-tuple ``(loss, num_tokens, stats)``): Megatron sums, DDP sums,
  and ``finalize_model_grads`` divides by the DP x CP sum of ``num_tokens``. Return ``(W * G,
  local valid tokens)``; the sum of local valid tokens is G.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

__all__ = ["LossNormalization", "StepTotals", "megatron_loss_output", "token_weights"]


class LossNormalization(str, enum.Enum):
    TOKEN_MEAN = "token_mean"
    SEQUENCE_MEAN = "sequence_mean"


@dataclass(frozen=True)
class StepTotals:
    """Global counts of one step: valid target tokens G, sequences with at least one target S, and the
    plan's sample groups (0 when the plan has none)."""

    num_tokens: int
    num_sequences: int
    num_groups: int = 0

    @classmethod
    def all_reduce(cls, local_tokens: int, local_sequences: int, local_groups: int, group) -> StepTotals:
        """Sum the local counts over ``group`` (DP x CP); one small all-reduce per step (on the device the
        group's backend takes: `collectives.all_reduce_values`)."""
        from ..collectives import all_reduce_values

        counts = [local_tokens, local_sequences, local_groups]
        if group is not None:
            counts = all_reduce_values(counts, group, dtype=torch.int64)
        tokens, sequences, groups = (int(x) for x in counts)
        if tokens == 0:
            raise ValueError(
                "The global batch has no valid target token (every loss_mask entry is 0, or every sample has a "
                "single token); there is nothing to learn from this step."
            )
        return cls(tokens, sequences, groups)


def token_weights(
    loss_mask: torch.Tensor, span_lengths: list[int], normalization: LossNormalization | str, totals: StepTotals
) -> torch.Tensor:
    """Per-token weights ``w_t`` for a row whose consecutive spans are the sequences (THD row, or BSHD rows
    flattened with one span per row). ``loss_mask`` is the row's full (pre-CP-split) mask."""
    normalization = LossNormalization(normalization)
    mask = loss_mask.reshape(-1).float()
    if normalization is LossNormalization.TOKEN_MEAN:
        return mask / totals.num_tokens
    valid = torch.stack([s.sum() for s in torch.split(mask, span_lengths)])
    per_sequence = torch.where(valid > 0, 1.0 / (valid.clamp_min(1) * totals.num_sequences), torch.zeros_like(valid))
    return mask * torch.repeat_interleave(per_sequence, torch.tensor(span_lengths))


def megatron_loss_output(
    weighted_sum: torch.Tensor,
    *,
    local_valid_tokens: int,
    totals: StepTotals,
    dp_size: int,
    num_microbatches: int,
    calculate_per_token_loss: bool,
) -> tuple:
    """What the loss function hands back to Megatron's schedule (see the module docstring)."""
    stats = {"weighted_loss": weighted_sum.detach().clone().reshape(1)}
    if calculate_per_token_loss:
        num_tokens = torch.full((), local_valid_tokens, dtype=torch.int, device=weighted_sum.device)  # no copy
        return weighted_sum * totals.num_tokens, num_tokens, stats
    return weighted_sum * (dp_size * num_microbatches), stats
