"""Losses computed per sequence, per sample or per group on the unpacked view of a micro-batch (packed
THD rows, or the padded BSHD rows of dynamic batching).

`run_step(sequence_loss=fn)` calls ``fn(logprobs, loss_mask)`` once per sequence, `run_step(group_loss=
fn)` calls ``fn(members)`` once per group (DPO pairs, GRPO groups); both see exactly the log-probs an
unpacked forward would give (`prepare.per_sample_logprobs`). Each returns this rank's share of the step
loss: the sum divided by the global number of sequences (or groups) and by CP, because every CP rank
holds the same gathered values and the gather's backward adds their gradients.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ..thd.loss_weights import StepTotals
from .parallel_groups import ParallelGroups
from .prepare import PreparedMicroBatch, per_sample_logprobs

__all__ = ["group_loss_sum", "sample_loss_sum", "sequence_loss_sum"]


def _check_scalar(value, what: str, unit: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor) or value.dim() != 0:
        shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise ValueError(
            f"{what} must return a scalar (0-d) tensor for each {unit}, got {shape}; reduce over the tokens "
            "inside the function (e.g. .sum() or .mean())."
        )
    return value


def sequence_loss_sum(
    prep: PreparedMicroBatch, output: torch.Tensor, fn: Callable, groups: ParallelGroups, totals: StepTotals
) -> torch.Tensor:
    """``fn`` on every sequence with at least one target; this rank's share of (sum / S)."""

    def per_sequence(_, logprobs, mask):
        return fn(logprobs, mask)

    return _share_of_sum(prep, output, per_sequence, groups, totals.num_sequences, ("sequence_loss", "sequence"))


def sample_loss_sum(
    prep: PreparedMicroBatch,
    output: torch.Tensor,
    fn: Callable,
    groups: ParallelGroups,
    totals: StepTotals,
    *,
    per_token: bool,
) -> torch.Tensor:
    """``fn(sample_id, logprobs, mask)`` on every sample with at least one target; this rank's share of
    (sum / G) when ``per_token`` (``fn`` returns the sample's token sum), else of (sum / S) (``fn`` returns
    its per-sequence value)."""
    divisor = totals.num_tokens if per_token else totals.num_sequences
    return _share_of_sum(prep, output, fn, groups, divisor, ("sample_loss", "sample"))


def _share_of_sum(prep, output, fn: Callable, groups: ParallelGroups, divisor: int, names: tuple[str, str]):
    """``fn(sample_id, logprobs, mask)`` summed over the samples with at least one target, divided by
    ``divisor`` and by CP (``names``: the option and its unit, for the error)."""
    total = output.new_zeros((), dtype=torch.float32)
    for sample_id, logprobs, mask in per_sample_logprobs(prep, output, groups):
        if mask.numel() and mask.sum() > 0:
            total = total + _check_scalar(fn(sample_id, logprobs, mask), *names)
    return total / (divisor * groups.cp_size)


def group_loss_sum(
    prep: PreparedMicroBatch,
    output: torch.Tensor,
    fn: Callable,
    group_ids: Sequence,
    groups: ParallelGroups,
    totals: StepTotals,
) -> torch.Tensor:
    """``fn(members)`` once per group of the micro-batch, ``members`` = ``[(sample_id, logprobs,
    loss_mask), ...]`` in sample order; this rank's share of (sum / number of groups)."""
    members: dict = {}
    for item in per_sample_logprobs(prep, output, groups):
        members.setdefault(group_ids[item[0]], []).append(item)
    total = output.new_zeros((), dtype=torch.float32)
    for items in members.values():
        total = total + _check_scalar(fn(sorted(items, key=lambda item: item[0])), "group_loss", "group")
    return total / (totals.num_sequences * groups.cp_size)
