"""The reward-model step: (chosen, rejected) pairs in, one optimizer step out, and pairs scored.

    training pass -> plan_step(train_mb_tokens, groups=pair ids): each pair in one micro-batch
                     -> train_step(loss=PerSequenceValues(RewardPairLoss)) -> optimizer, schedule
    scoring       -> plan_step(forward_only, logprob_mb_tokens, groups=pair ids) -> forward only

Samples come in pair order, as for DPO (``2i`` chosen, ``2i + 1`` rejected, prompt in both). The policy is
a reward model: `megatron.build_policy(..., head="reward")` (one score per token; a response's reward is
its last token's). Metrics are means over the step's pairs on every rank.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..data.preference import pair_ids
from ..data.sample import SequenceSample
from ..losses.reward import METRIC_KEYS, RewardPairLoss
from ..megatron import PerSequenceValues, Policy, StepOutcome, forward_backward, train_step
from ..planning import StepPlan, StepPlanConfig, plan_step
from .config import RMConfig
from .metrics import sum_over_ranks

__all__ = ["RMStepResult", "pair_rewards", "rm_step"]


@dataclass(frozen=True)
class RMStepResult:
    """The step's loss (exact, every rank), its metrics (preference loss, accuracy, reward margin, chosen
    and rejected rewards: means over pairs; grad norm), the training pass's seconds, plan and outcome."""

    loss: float
    metrics: dict
    train_seconds: float
    plan: StepPlan
    outcome: StepOutcome


def rm_step(policy: Policy, samples: Sequence[SequenceSample], plan_config: StepPlanConfig, *,
            rm: RMConfig | None = None) -> RMStepResult:  # fmt: skip
    """One reward-model step on ``samples`` in pair order (every rank passes the same list)."""
    rm = rm or RMConfig()
    loss = RewardPairLoss(margin=rm.margin, center_rewards_coefficient=rm.center_rewards_coefficient)
    plan = plan_step([len(s.tokens) for s in samples], plan_config, groups=pair_ids(len(samples)))
    outcome = train_step(policy, samples, plan, loss=PerSequenceValues(loss))
    metrics = _means(loss)
    metrics.update(grad_norm=outcome.grad_norm, update_applied=outcome.updated)
    return RMStepResult(outcome.result.loss, metrics, outcome.seconds, plan, outcome)


def pair_rewards(policy: Policy, samples: Sequence[SequenceSample], plan_config: StepPlanConfig) -> dict:
    """Score ``samples`` (pair order) with the reward model, forward only: ``{"chosen": [...], "rejected":
    [...], "accuracy": a, "loss": l}`` on every rank (rewards in pair order; ``loss`` the plain
    Bradley-Terry loss, -log sigmoid(r_chosen - r_rejected), without margin or centering)."""
    from ..collectives import all_gather_object

    scores: dict = {}  # sample id -> its reward, a 0-d tensor on the device until the pass is over

    def record(members):
        (chosen, scores_c), (rejected, scores_r) = members
        scores[chosen], scores[rejected] = scores_c[-1].detach(), scores_r[-1].detach()
        return scores_c.new_zeros(())

    plan = plan_step([len(s.tokens) for s in samples], plan_config, forward_only=True,
                     groups=pair_ids(len(samples)))  # fmt: skip
    start = time.perf_counter()
    forward_backward(policy.model, samples, plan, policy.process_groups, loss=PerSequenceValues(record),
                     forward_only=True, device=policy.device)  # fmt: skip
    ids = list(scores)
    mine = dict(zip(ids, torch.stack([scores[i] for i in ids]).tolist() if ids else [], strict=True))  # one copy
    merged: dict[int, float] = {}
    for part in all_gather_object(mine):  # every rank: the last pipeline stage's DP x CP ranks scored them
        merged.update(part)
    chosen = [merged[2 * i] for i in range(len(samples) // 2)]
    rejected = [merged[2 * i + 1] for i in range(len(samples) // 2)]
    losses = [_softplus(r - c) for c, r in zip(chosen, rejected, strict=True)]  # -log sigmoid(c - r)
    return {"chosen": chosen, "rejected": rejected, "seconds": time.perf_counter() - start,
            "accuracy": sum(c > r for c, r in zip(chosen, rejected, strict=True)) / max(len(chosen), 1),
            "loss": sum(losses) / max(len(losses), 1)}  # fmt: skip


def _softplus(x: float) -> float:
    """log(1 + exp(x)) without overflow for large ``x``."""
    return max(x, 0.0) + math.log1p(math.exp(-abs(x)))


def _means(loss: RewardPairLoss) -> dict:
    sums = dict(zip(METRIC_KEYS, sum_over_ranks([loss.metrics[k] for k in METRIC_KEYS]), strict=True))
    count = max(sums.pop("pairs"), 1.0)
    return {k: v / count for k, v in sums.items()}
