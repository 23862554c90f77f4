"""RL on the packed path, as a library: the GRPO/PPO policy step on library types.

- `config`: `GRPOConfig` (NeMo-RL's ``grpo`` keys; no torch: also the trainer's ``grpo`` Hydra group).
- `step`: `rl_step(policy, rollouts, plan_config, loss=ClippedPGConfig(...), grpo=GRPOConfig(...),
  reference=...)` -> `RLStepResult`.

A framework that brings its own trainer imports this, `megatron` and `planning`, never `app`. The torch
part (`step`) loads on first use, so ``from mcore_packing.rl import GRPOConfig`` stays torch-free.
"""

from .config import GRPOConfig

__all__ = ["GRPOConfig", "RLStepResult", "rl_step"]


def __getattr__(name: str):
    if name in ("RLStepResult", "rl_step"):
        from . import step

        return getattr(step, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
