"""Losses of the packed path on the unpacked view: each takes one sample's next-token log-probs (as
`megatron.run_step` hands them out, exactly what an unpacked forward gives) and returns that sample's
contribution; `run_step` divides by the global token or sequence count, so the step loss is exact under
packing, dynamic batching and any TP/PP/CP/DP layout.

- `policy_gradient`: PPO/GRPO clipped policy gradient with NeMo-RL's keys (ratio_clip_min/max,
  ratio_clip_c, reference_policy_kl_penalty with the k1/k3 estimators, token_level_loss, importance
  sampling correction against generation log-probs) and its per-step metrics.
- `dpo`: the DPO loss on a (chosen, rejected) pair, for `run_step(group_loss=...)`.
- `rollouts`: rollouts checked, GRPO advantages, samples for the policy step.
"""

from .dpo import dpo_pair_loss
from .policy_gradient import ClippedPGConfig, ClippedPGLoss

__all__ = ["ClippedPGConfig", "ClippedPGLoss", "dpo_pair_loss"]
