"""Losses of the packed path on the unpacked view: each takes one sample's (or one group's) next-token
log-probs (as `megatron.forward_backward` hands them out through `PerSample` / `PerGroup`, exactly what an
unpacked forward gives) and returns its contribution; the step loss divides by the global token,
sequence or group count, so it is exact under packing, dynamic batching and any TP/PP/CP/DP layout.

- `policy_gradient`: the policy-gradient loss (PPO/GRPO clip with clip-higher and dual clip, GSPO, CISPO;
  k1/k3 KL; the training/inference correction TIS, ICEPOP, seq-TIS, seq-mask-TIS against generation
  log-probs; the five aggregation modes, each one global sum over one global count) and its metrics.
- `dpo`: `DPOLoss` on a (chosen, rejected) pair (preference and SFT terms, metrics), for `PerGroup`.
- `pg_config`: `ClippedPGConfig`, its settings (no torch: the trainer's ``loss_fn`` config group).
- `rollouts`: rollouts checked, GRPO advantages, samples for the policy step (numpy).
- `recording`: whether a loss call records its metrics (`muted` on all but one rank of a CP group).

The torch parts load on first use, so ``from mcore_packing.losses import ClippedPGConfig`` (a config's
dry run on a login node) does not import torch.
"""

from .pg_config import IS_TYPES, KL_ESTIMATORS, LOSS_AGG_MODES, POLICY_LOSS_MODES, ClippedPGConfig

__all__ = ["IS_TYPES", "KL_ESTIMATORS", "LOSS_AGG_MODES", "POLICY_LOSS_MODES", "ClippedPGConfig", "ClippedPGLoss",
           "DPOLoss", "dpo_pair_loss"]

_TORCH_PARTS = {"ClippedPGLoss": "policy_gradient", "DPOLoss": "dpo", "dpo_pair_loss": "dpo"}


def __getattr__(name: str):
    if name in _TORCH_PARTS:
        from importlib import import_module

        return getattr(import_module(f".{_TORCH_PARTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
