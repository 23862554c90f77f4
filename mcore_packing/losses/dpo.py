"""The DPO loss on one (chosen, rejected) pair, for `run_step(group_loss=...)` on packed pairs.

    loss = -log sigmoid(beta ((log pi(chosen) - ref(chosen)) - (log pi(rejected) - ref(rejected))))

with sequence log-probs summed over each response's target tokens. The pair shares a micro-batch (plan
with ``groups=pair_ids``); `run_step` averages over the pairs of the global batch.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F

__all__ = ["dpo_pair_loss"]


def dpo_pair_loss(members, reference_logps: Mapping[int, float], beta: float = 0.1) -> torch.Tensor:
    """``members`` = ``[(sample_id, logprobs, loss_mask)] * 2``, chosen first (sample order);
    ``reference_logps[sample_id]`` is the reference policy's summed log-prob of that response."""
    if len(members) != 2:
        raise ValueError(f"a DPO group holds a (chosen, rejected) pair; got {len(members)} samples in one group.")
    (chosen, lp_c, mask_c), (rejected, lp_r, mask_r) = members
    margin = ((lp_c * mask_c).sum() - reference_logps[chosen]) - ((lp_r * mask_r).sum() - reference_logps[rejected])
    return -F.logsigmoid(beta * margin)
