"""The Bradley-Terry loss of a reward model on one (chosen, rejected) pair, for `megatron.PerSequenceValues`.

    r      = the score of a response's last token (the whole sequence: prompt, then response)
    loss   = -log sigmoid(r_chosen - r_rejected - margin) + center_rewards_coefficient (r_chosen + r_rejected)^2

The pair shares a micro-batch (plan with ``groups=pair_ids``); the step divides by the global number of
pairs, so packing, dynamic batching and any layout give one value. ``margin`` asks the chosen response to
win by at least that much; the centering term (TRL's ``center_rewards_coefficient``) keeps the rewards'
mean near 0, since the Bradley-Terry loss sees only differences. `RewardPairLoss.metrics` sums the loss,
accuracy (r_chosen > r_rejected), margin and both rewards over the pairs this rank scored (one rank of
each CP group records: `recording`), on the device until read.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .recording import MetricSums, recording

__all__ = ["METRIC_KEYS", "RewardPairLoss"]

METRIC_KEYS = ("pairs", "preference_loss", "accuracy", "reward_margin", "chosen_reward", "rejected_reward")


class RewardPairLoss(MetricSums):
    """``loss(members) -> scalar`` for one pair; ``members`` = ``[(sample_id, scores)] * 2``, chosen first
    (sample order), ``scores`` the head's value at every position of the sample."""

    METRIC_KEYS = METRIC_KEYS

    def __init__(self, *, margin: float = 0.0, center_rewards_coefficient: float = 0.0):
        self.margin = margin
        self.center = center_rewards_coefficient

    def __call__(self, members) -> torch.Tensor:
        if len(members) != 2:
            raise ValueError(f"a reward-model group holds a (chosen, rejected) pair; got {len(members)} samples.")
        (_, scores_c), (_, scores_r) = members
        reward_c, reward_r = scores_c[-1], scores_r[-1]  # the last token's score
        preference = -F.logsigmoid(reward_c - reward_r - self.margin)
        loss = preference + self.center * (reward_c + reward_r) ** 2 if self.center else preference
        if recording():  # another rank of this micro-batch's CP group records it otherwise
            margin = (reward_c - reward_r).detach()
            self._add([preference.new_ones(()), preference.detach(), (margin > 0).to(margin.dtype), margin,
                       reward_c.detach(), reward_r.detach()])  # METRIC_KEYS' order
        return loss
