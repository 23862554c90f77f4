"""The DPO step as a framework drives it: (chosen, rejected) pairs in, one optimizer step out.

    reference pass -> plan_step(forward_only, logprob_mb_tokens) -> compute_logprobs(reference)
                      -> each response's reference log-prob (sum, or token mean)
    training pass  -> plan_step(train_mb_tokens, groups=pair ids): each pair in one micro-batch
                      -> train_step(loss=PerGroup(DPOLoss)) -> optimizer, schedule

Samples come in pair order: ``2i`` is pair ``i``'s chosen response, ``2i + 1`` its rejected one (prompt
tokens in both, masked out of the loss). The reference is a frozen `Policy` with the policy's starting
weights (`megatron.build_policy` without an optimizer); on the first step the policy equals it, so the
preference loss is exactly log 2. Metrics are means over the step's pairs on every rank.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from ..data.preference import pair_ids
from ..data.sample import SequenceSample
from ..losses.dpo import METRIC_KEYS, DPOLoss, response_logprob
from ..megatron import PerGroup, Policy, StepOutcome, compute_logprobs, train_step
from ..planning import StepPlan, StepPlanConfig, plan_step
from .config import DPOConfig
from .metrics import sum_over_ranks

__all__ = ["DPOStepResult", "dpo_step", "pair_ids"]


@dataclass(frozen=True)
class DPOStepResult:
    """The step's loss (exact, every rank), its metrics (preference and SFT loss, reward margin, accuracy,
    chosen and rejected rewards: means over pairs), the seconds of each pass, the training plan and the
    `StepOutcome` (for `MetricsLogger.log_step`)."""

    loss: float
    metrics: dict
    reference_seconds: float
    train_seconds: float
    plan: StepPlan
    outcome: StepOutcome


def dpo_step(policy: Policy, reference: Policy, samples: Sequence[SequenceSample], plan_config: StepPlanConfig, *,
             dpo: DPOConfig) -> DPOStepResult:  # fmt: skip
    """One DPO step on ``samples`` in pair order (every rank passes the same list)."""
    pairs = pair_ids(len(samples))
    lengths = [len(s.tokens) for s in samples]
    start = time.perf_counter()
    logprob_plan = plan_step(lengths, plan_config, forward_only=True)
    ref = compute_logprobs(reference.model, samples, logprob_plan, policy.process_groups, device=policy.device)
    ref = ref.cpu()  # one copy: the loss takes the reference's log-probs as host numbers
    reference_logps = {i: float(_response_logprob(ref[i], s, dpo.preference_average_log_probs))
                       for i, s in enumerate(samples)}  # fmt: skip
    reference_seconds = time.perf_counter() - start
    loss = DPOLoss(
        reference_logps,
        beta=dpo.reference_policy_kl_penalty,
        preference_loss_weight=dpo.preference_loss_weight,
        sft_loss_weight=dpo.sft_loss_weight,
        preference_average_log_probs=dpo.preference_average_log_probs,
        sft_average_log_probs=dpo.sft_average_log_probs,
    )
    plan = plan_step(lengths, plan_config, groups=pairs)
    outcome = train_step(policy, samples, plan, loss=PerGroup(loss))
    sums = dict(zip(METRIC_KEYS, sum_over_ranks([loss.metrics[k] for k in METRIC_KEYS]), strict=True))
    count = max(sums.pop("pairs"), 1.0)
    metrics = {k: v / count for k, v in sums.items()}
    metrics.update(grad_norm=outcome.grad_norm, update_applied=outcome.updated)
    return DPOStepResult(outcome.result.loss, metrics, reference_seconds, outcome.seconds, plan, outcome)


def _response_logprob(row, sample: SequenceSample, average: bool):
    """The reference's log-prob of a sample's learned tokens (row ``j`` scores token ``j + 1``)."""
    import torch

    n = len(sample.tokens)
    mask = torch.as_tensor(sample.loss_mask[1:n], dtype=row.dtype)
    return response_logprob(row[: n - 1], mask, average=average)
