"""RL on the packed path, as a library: the GRPO/PPO policy step on library types.

- `config`: `GRPOConfig`, `DPOConfig` (NeMo-RL's ``grpo`` / ``dpo`` keys; no torch: also the trainer's
  Hydra groups).
- `step`: `rl_step(policy, rollouts, plan_config, loss=ClippedPGConfig(...), grpo=GRPOConfig(...),
  reference=...)` -> `RLStepResult` (GRPO/PPO).
- `dpo`: `dpo_step(policy, reference, samples, plan_config, dpo=DPOConfig(...))` -> `DPOStepResult`.
- `metrics`: `sum_over_ranks`, the one reduction of step metrics.

A framework that brings its own trainer imports this, `megatron` and `planning`, never `app`. The torch
parts (`step`, `dpo`) load on first use, so ``from mcore_packing.rl import GRPOConfig`` stays torch-free.
"""

from .config import DPOConfig, GRPOConfig

__all__ = ["DPOConfig", "DPOStepResult", "GRPOConfig", "RLStepResult", "dpo_step", "rl_step"]

_TORCH_PARTS = {"RLStepResult": "step", "rl_step": "step", "DPOStepResult": "dpo", "dpo_step": "dpo"}


def __getattr__(name: str):
    if name in _TORCH_PARTS:
        from importlib import import_module

        return getattr(import_module(f".{_TORCH_PARTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
