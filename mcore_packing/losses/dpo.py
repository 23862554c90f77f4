"""The DPO loss on one (chosen, rejected) pair, for `megatron.PerGroup` on packed pairs.

    margin = (log pi(chosen) - ref(chosen)) - (log pi(rejected) - ref(rejected))
    loss   = preference_loss_weight * -log sigmoid(beta * margin) + sft_loss_weight * NLL(chosen)

A response's log-prob is summed over its target tokens (its token mean with ``average_log_probs``), the
reference's the same way. The pair shares a micro-batch (plan with ``groups=pair_ids``); `PerGroup`
averages over the pairs of the global batch. With the policy equal to the reference the margin is 0 and
the preference loss is exactly log 2. `DPOLoss.metrics` accumulates the reward margin (``beta *
margin``), the accuracy (margin > 0) and both loss terms as sums over the pairs this rank scored (one
rank of each CP group records: `recording`), on the device until read.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F

from .recording import MetricSums, recording

__all__ = ["METRIC_KEYS", "DPOLoss", "dpo_pair_loss"]

METRIC_KEYS = ("pairs", "preference_loss", "sft_loss", "reward_margin", "accuracy", "chosen_reward", "rejected_reward")


class DPOLoss(MetricSums):
    """``loss(members) -> scalar`` for one pair; ``members`` = ``[(sample_id, logprobs, loss_mask)] * 2``,
    chosen first (sample order). ``reference_logps[sample_id]`` is the reference policy's log-prob of that
    response, reduced the same way (sum, or token mean with ``preference_average_log_probs``)."""

    METRIC_KEYS = METRIC_KEYS

    def __init__(
        self,
        reference_logps: Mapping[int, float],
        *,
        beta: float = 0.1,
        preference_loss_weight: float = 1.0,
        sft_loss_weight: float = 0.0,
        preference_average_log_probs: bool = False,
        sft_average_log_probs: bool = False,
    ):
        self.reference_logps = reference_logps
        self.beta = beta
        self.preference_loss_weight = preference_loss_weight
        self.sft_loss_weight = sft_loss_weight
        self.preference_average = preference_average_log_probs
        self.sft_average = sft_average_log_probs

    def __call__(self, members) -> torch.Tensor:
        if len(members) != 2:
            raise ValueError(f"a DPO group holds a (chosen, rejected) pair; got {len(members)} samples in one group.")
        (chosen, lp_c, mask_c), (rejected, lp_r, mask_r) = members
        policy_c = response_logprob(lp_c, mask_c, average=self.preference_average)
        policy_r = response_logprob(lp_r, mask_r, average=self.preference_average)
        reward_c = self.beta * (policy_c - self.reference_logps[chosen])
        reward_r = self.beta * (policy_r - self.reference_logps[rejected])
        preference = -F.logsigmoid(reward_c - reward_r)
        loss = self.preference_loss_weight * preference
        sft = -response_logprob(lp_c, mask_c, average=self.sft_average)
        if self.sft_loss_weight:
            loss = loss + self.sft_loss_weight * sft
        if recording():  # another rank of this micro-batch's CP group records it otherwise
            self._record(preference, sft, reward_c, reward_r)
        return loss

    def _record(self, preference, sft, reward_c, reward_r) -> None:
        """Adds this pair's values on the device (no host copy: the step reads `metrics` once at its end)."""
        margin = (reward_c - reward_r).detach()
        self._add([preference.new_ones(()), preference.detach(), sft.detach(), margin, (margin > 0).to(margin.dtype),
                   reward_c.detach(), reward_r.detach()])  # METRIC_KEYS' order


def response_logprob(logprobs: torch.Tensor, mask: torch.Tensor, *, average: bool) -> torch.Tensor:
    """A response's log-prob from its per-token log-probs: the sum over the learned tokens, or their mean."""
    total = (logprobs * mask).sum()
    return total / mask.sum().clamp_min(1) if average else total


def dpo_pair_loss(members, reference_logps: Mapping[int, float], beta: float = 0.1) -> torch.Tensor:
    """The plain DPO loss of one pair (summed log-probs, no SFT term): `DPOLoss` with its defaults."""
    return DPOLoss(reference_logps, beta=beta)(members)
