"""Losses of the packed path on the unpacked view: each takes one sample's next-token log-probs (as
`megatron.run_step` hands them out, exactly what an unpacked forward gives) and returns that sample's
contribution; `run_step` divides by the global token or sequence count, so the step loss is exact under
packing, dynamic batching and any TP/PP/CP/DP layout.

- `policy_gradient`: PPO/GRPO clipped policy gradient with NeMo-RL's keys (ratio_clip_min/max,
  ratio_clip_c, reference_policy_kl_penalty with the k1/k3 estimators, token_level_loss, importance
  sampling correction against generation log-probs) and its per-step metrics.
- `dpo`: the DPO loss on a (chosen, rejected) pair, for `run_step(group_loss=...)`.
- `pg_config`: `ClippedPGConfig`, its settings (no torch: the trainer's ``loss_fn`` config group).
- `rollouts`: rollouts checked, GRPO advantages, samples for the policy step (numpy).

The torch parts load on first use, so ``from mcore_packing.losses import ClippedPGConfig`` (a config's
dry run on a login node) does not import torch.
"""

from .pg_config import KL_ESTIMATORS, ClippedPGConfig

__all__ = ["KL_ESTIMATORS", "ClippedPGConfig", "ClippedPGLoss", "dpo_pair_loss"]

_TORCH_PARTS = {"ClippedPGLoss": "policy_gradient", "dpo_pair_loss": "dpo"}


def __getattr__(name: str):
    if name in _TORCH_PARTS:
        from importlib import import_module

        return getattr(import_module(f".{_TORCH_PARTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
