"""The losses a step can run, as one protocol: each loss object says which per-token weights it needs,
which global count its sum is divided by, and how one micro-batch contributes.

    forward_backward(model, samples, plan, process_groups, loss=TokenMeanNLL())          # SFT default
    forward_backward(..., loss=SequenceMeanNLL())                         # every sequence weighs the same
    forward_backward(..., loss=PerSequence(fn))      # fn(logprobs, mask) -> scalar, mean over sequences
    forward_backward(..., loss=PerSample(fn, normalization="token_mean"))   # fn(sample_id, logprobs, mask)
    forward_backward(..., loss=PerGroup(fn))         # fn(members) per group of the plan, mean over groups
    forward_backward(..., loss=policy_step_loss(ClippedPGLoss(...)))  # PerSample or PerGroup, as it aggregates

The NLL losses use the per-token weights of `thd.token_weights` on the packed row itself. The others run
on the unpacked view (`prepare.per_sample_logprobs`: any mode, CP gathered): ``fn`` sees exactly the
log-probs an unpacked forward gives. Each returns this rank's share of the step loss: the sum divided by
the global count (`StepTotals`, all-reduced once per step over DP x CP) and, for the unpacked view, by
CP, because every CP rank holds the same gathered values and the gather's backward adds their gradients.

A loss function's per-step metrics (`losses.recording`) are recorded on the first rank of each micro-batch's
CP group only, so a metric counts each sample alike whatever CP size its micro-batch ran on.

A loss's normalization is its own (no option elsewhere changes it). `PerGroup` reads the groups from the
plan (``plan_step(..., groups=ids)``), so the ids that keep a group in one micro-batch are the ids it
averages over.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ..losses.recording import muted
from ..thd.loss_weights import LossNormalization, StepTotals
from .prepare import PreparedMicroBatch, per_sample_logprobs, per_sample_values

__all__ = [
    "PerGroup",
    "PerSample",
    "PerSequence",
    "PerSequenceValues",
    "SequenceMeanNLL",
    "StepLoss",
    "TokenMeanNLL",
    "nll_loss",
    "policy_step_loss",
]

DIVISORS = ("tokens", "sequences", "groups")


class StepLoss:
    """The protocol. Subclasses set:

    - ``token_weights``: the `LossNormalization` of the per-token weights the micro-batches carry, or None
      when the loss does not read them (its own per-sample values);
    - ``divisor``: one of `DIVISORS`, the global count the loss's sum is divided by;
    - ``micro_batch_sum(prep, output, process_groups, totals, entropy=None)``: this rank's share of the
      step loss from one micro-batch (``output``: Megatron's per-token losses of this CP shard;
      ``entropy``: the policy's per-token entropy in the same layout, when ``needs_entropy``).
    """

    token_weights: LossNormalization | None = None
    divisor: str = "tokens"
    needs_plan_groups: bool = False
    needs_entropy: bool = False  # the policy's per-token entropy (`megatron.entropy`), passed as ``entropy=``
    entropy_chunk_tokens: int = 1024
    uses_labels: bool = True  # False: the model runs without labels and ``output`` is its per-token values

    def micro_batch_sum(self, prep: PreparedMicroBatch, output: torch.Tensor, process_groups, totals: StepTotals,
                        entropy: torch.Tensor | None = None):  # fmt: skip
        raise NotImplementedError

    def global_count(self, totals: StepTotals) -> int:
        return {"tokens": totals.num_tokens, "sequences": totals.num_sequences, "groups": totals.num_groups}[
            self.divisor
        ]


class _WeightedNLL(StepLoss):
    """The NLL weighted per token on the packed row itself (the weights already hold the divisor)."""

    def micro_batch_sum(self, prep, output, process_groups, totals, entropy=None):
        return (output.float() * prep.weights).sum()


@dataclass(frozen=True)
class TokenMeanNLL(_WeightedNLL):
    """The mean next-token NLL over every learned token of the global batch (SFT's default)."""

    token_weights = LossNormalization.TOKEN_MEAN
    divisor = "tokens"


@dataclass(frozen=True)
class SequenceMeanNLL(_WeightedNLL):
    """Each sequence's mean NLL over its learned tokens, then the mean over sequences."""

    token_weights = LossNormalization.SEQUENCE_MEAN
    divisor = "sequences"


def nll_loss(normalization: LossNormalization | str) -> StepLoss:
    """The NLL loss of a normalization name (``token_mean`` or ``sequence_mean``)."""
    normalization = LossNormalization(normalization)
    return TokenMeanNLL() if normalization is LossNormalization.TOKEN_MEAN else SequenceMeanNLL()


@dataclass(frozen=True)
class PerSequence(StepLoss):
    """``fn(logprobs, loss_mask) -> scalar`` once per sequence with a learned token; the step loss is
    the mean over those sequences."""

    fn: Callable
    divisor = "sequences"

    def micro_batch_sum(self, prep, output, process_groups, totals, entropy=None):
        fn = self.fn
        return _share_of_sum(
            prep, output, lambda _, lp, mask: fn(lp, mask), process_groups, self.global_count(totals), "sequence"
        )


@dataclass(frozen=True)
class PerSample(StepLoss):
    """``fn(sample_id, logprobs, loss_mask) -> scalar`` once per sample with a learned token, with
    per-sample side inputs looked up by ``sample_id`` (RL: advantages, old and reference log-probs;
    `mcore_packing.losses.ClippedPGLoss`). ``token_mean``: ``fn`` returns the sample's token sum and the
    step loss divides by the global token count; ``sequence_mean``: its per-sequence value, divided by
    the global sequence count."""

    fn: Callable
    normalization: str = "token_mean"
    needs_entropy: bool = False  # fn then gets each sample's per-token entropy too: fn(..., entropy=row)
    entropy_chunk_tokens: int = 1024

    def __post_init__(self):
        LossNormalization(self.normalization)  # raises on an unknown name

    @property
    def divisor(self) -> str:
        return "tokens" if LossNormalization(self.normalization) is LossNormalization.TOKEN_MEAN else "sequences"

    def micro_batch_sum(self, prep, output, process_groups, totals, entropy=None):
        return _share_of_sum(prep, output, self.fn, process_groups, self.global_count(totals), "sample",
                             entropy=entropy)  # fmt: skip


@dataclass(frozen=True)
class PerGroup(StepLoss):
    """``fn(members) -> scalar`` once per group of the plan (DPO pairs, GRPO groups), ``members`` =
    ``[(sample_id, logprobs, loss_mask), ...]`` in sample order; the step loss is the mean over the
    groups. Needs a plan made with ``groups=`` (a group shares one micro-batch)."""

    fn: Callable
    needs_entropy: bool = False  # members then carry each sample's entropy row: (id, logprobs, mask, entropy)
    entropy_chunk_tokens: int = 1024
    divisor = "groups"
    needs_plan_groups = True

    def micro_batch_sum(self, prep, output, process_groups, totals, entropy=None):
        rows = _rows(prep, output, process_groups, entropy)
        return _share_of_groups(self.fn, rows, prep, output, process_groups, self.global_count(totals))


@dataclass(frozen=True)
class PerSequenceValues(StepLoss):
    """``fn(members) -> scalar`` once per group of the plan, ``members`` = ``[(sample_id, values), ...]`` in
    sample order, where ``values`` are the model's per-token outputs without labels (a reward model's
    scores, `reward_head`; every position of the sample); the step loss is the mean over the groups (a
    reward model's pairs). Needs a plan made with ``groups=``."""

    fn: Callable
    divisor = "groups"
    needs_plan_groups = True
    uses_labels = False

    def micro_batch_sum(self, prep, output, process_groups, totals, entropy=None):
        rows = per_sample_values(prep, output, process_groups)
        return _share_of_groups(self.fn, rows, prep, output, process_groups, self.global_count(totals))


def _share_of_groups(fn: Callable, rows, prep, output, process_groups, divisor: int) -> torch.Tensor:
    """``fn(members)`` summed over the micro-batch's groups (``rows``: per-sample tuples, sample id first;
    members in sample order), divided by ``divisor`` and by CP."""
    members: dict = {}
    for item in rows:
        members.setdefault(prep.group_ids[item[0]], []).append(item)
    total = output.new_zeros((), dtype=torch.float32)
    with muted(process_groups.cp_rank != 0):  # metrics counted once per CP group
        for items in members.values():
            total = total + _check_scalar(fn(sorted(items, key=lambda item: item[0])), "group")
    return total / (divisor * process_groups.cp_size)


def policy_step_loss(loss, sample_ids: Sequence[int] | None = None) -> StepLoss:
    """The step loss of a per-sample policy loss (`mcore_packing.losses.ClippedPGLoss`) as its aggregation
    asks: `PerSample` divided by the global response tokens (``token_mean``) or responses
    (``sequence_mean``), or `PerGroup` over its ``group_loss`` divided by the global prompts
    (``group_mean``: the plan must keep each prompt's responses in one micro-batch, ``plan_step(...,
    groups=ids)``). ``sample_ids[j]`` is the loss's id of the step's sample ``j`` (a minibatch of a larger
    batch); None: the same."""
    if sample_ids is None:
        fn, group_fn = loss, loss.group_loss
    else:
        ids = list(sample_ids)

        def fn(sample_id, logprobs, mask, **entropy):
            return loss(ids[sample_id], logprobs, mask, **entropy)

        def group_fn(members):
            return loss.group_loss([(ids[item[0]], *item[1:]) for item in members])

    entropy = {"needs_entropy": loss.needs_entropy, "entropy_chunk_tokens": loss.entropy_chunk_tokens}
    if loss.normalization == "group_mean":
        return PerGroup(group_fn, **entropy)
    return PerSample(fn, normalization=loss.normalization, **entropy)


def _check_scalar(value, unit: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor) or value.dim() != 0:
        shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise ValueError(
            f"the loss function must return a scalar (0-d) tensor for each {unit}, got {shape}; reduce over the "
            "tokens inside the function (e.g. .sum() or .mean())."
        )
    return value


def _rows(prep, output, process_groups, entropy) -> list[tuple]:
    """`per_sample_logprobs`, each row with its entropy row appended when ``entropy`` is given (the same
    CP gather and split: entropies travel like negated losses)."""
    rows = per_sample_logprobs(prep, output, process_groups)
    if entropy is None:
        return rows
    entropies = per_sample_logprobs(prep, -entropy, process_groups)
    return [(*row, h) for row, (_, h, _) in zip(rows, entropies, strict=True)]


def _share_of_sum(prep, output, fn: Callable, process_groups, divisor: int, unit: str, entropy=None) -> torch.Tensor:
    """``fn(sample_id, logprobs, mask[, entropy=row])`` summed over the samples with at least one target,
    divided by ``divisor`` and by CP."""
    total = output.new_zeros((), dtype=torch.float32)
    rows = _rows(prep, output, process_groups, entropy)
    with muted(process_groups.cp_rank != 0):  # metrics counted once per CP group (`losses.recording`)
        for row, targets in zip(rows, prep.target_counts, strict=True):
            if targets:  # counted on the host when the micro-batch was built: no device sync
                value = fn(*row[:3]) if entropy is None else fn(*row[:3], entropy=row[3])
                total = total + _check_scalar(value, unit)
    return total / (divisor * process_groups.cp_size)


@contextlib.contextmanager
def entropy_for(loss: StepLoss, model, process_groups):
    """The micro-batches' entropies when ``loss.needs_entropy`` (`megatron.entropy.capture_entropy` over
    the TP group), else None; `micro_batch_share` takes them in order."""
    if not getattr(loss, "needs_entropy", False):
        yield None
        return
    from .entropy import capture_entropy

    with capture_entropy(model, process_groups.tp, loss.entropy_chunk_tokens) as capture:
        yield capture


def micro_batch_share(loss: StepLoss, prep, output, process_groups, totals, capture) -> torch.Tensor:
    """``loss.micro_batch_sum`` of one micro-batch, with its entropy when the loss needs it."""
    if capture is None:
        return loss.micro_batch_sum(prep, output, process_groups, totals)
    return loss.micro_batch_sum(prep, output, process_groups, totals, entropy=capture.pop())
