"""Losses of the packed path on the unpacked view: each takes one sample's (or one group's) next-token
log-probs (as `megatron.forward_backward` hands them out through `PerSample` / `PerGroup`, exactly what an
unpacked forward gives) and returns its contribution; the step loss divides by the global token,
sequence or group count, so it is exact under packing, dynamic batching and any TP/PP/CP/DP layout.

- `policy_gradient`: PPO/GRPO clipped policy gradient with NeMo-RL's keys (ratio_clip_min/max,
  ratio_clip_c, reference_policy_kl_penalty with the k1/k3 estimators, token_level_loss, importance
  sampling correction against generation log-probs) and its per-step metrics.
- `dpo`: `DPOLoss` on a (chosen, rejected) pair (preference and SFT terms, metrics), for `PerGroup`.
- `pg_config`: `ClippedPGConfig`, its settings (no torch: the trainer's ``loss_fn`` config group).
- `rollouts`: rollouts checked, GRPO advantages, samples for the policy step (numpy).
- `recording`: whether a loss call records its metrics (`muted` on all but one rank of a CP group).

The torch parts load on first use, so ``from mcore_packing.losses import ClippedPGConfig`` (a config's
dry run on a login node) does not import torch.
"""

from .pg_config import KL_ESTIMATORS, ClippedPGConfig

__all__ = ["KL_ESTIMATORS", "ClippedPGConfig", "ClippedPGLoss", "DPOLoss", "dpo_pair_loss"]

_TORCH_PARTS = {"ClippedPGLoss": "policy_gradient", "DPOLoss": "dpo", "dpo_pair_loss": "dpo"}


def __getattr__(name: str):
    if name in _TORCH_PARTS:
        from importlib import import_module

        return getattr(import_module(f".{_TORCH_PARTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
