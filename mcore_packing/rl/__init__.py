"""RL on the packed path, as a library: the GRPO/PPO policy step on library types.

- `config`: `GRPOConfig`, `DPOConfig` (NeMo-RL's ``grpo`` / ``dpo`` keys), `RMConfig` (``rm``; no torch:
  also the trainer's Hydra groups).
- `step`: `rl_step(policy, rollouts, plan_config, loss=ClippedPGConfig(...), grpo=GRPOConfig(...),
  reference=...)` -> `RLStepResult` (GRPO/PPO).
- `dpo`: `dpo_step(policy, reference, samples, plan_config, dpo=DPOConfig(...))` -> `DPOStepResult`.
- `rm`: `rm_step(policy, samples, plan_config, rm=RMConfig(...))` -> `RMStepResult` (a Bradley-Terry reward
  model, `build_policy(..., head="reward")`); `pair_rewards` scores pairs forward-only (evaluation).
- `metrics`: `sum_over_ranks`, the one reduction of step metrics.

A framework that brings its own trainer imports this, `megatron` and `planning`, never `app`. The torch
parts (`step`, `dpo`) load on first use, so ``from mcore_packing.rl import GRPOConfig`` stays torch-free.
"""

from .config import DPOConfig, GRPOConfig, RMConfig

__all__ = ["DPOConfig", "DPOStepResult", "GRPOConfig", "RLStepResult", "RMConfig", "RMStepResult", "dpo_step",
           "pair_rewards", "rl_step", "rm_step"]

_TORCH_PARTS = {"RLStepResult": "step", "rl_step": "step", "DPOStepResult": "dpo", "dpo_step": "dpo",
                "RMStepResult": "rm", "rm_step": "rm", "pair_rewards": "rm"}


def __getattr__(name: str):
    if name in _TORCH_PARTS:
        from importlib import import_module

        return getattr(import_module(f".{_TORCH_PARTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
