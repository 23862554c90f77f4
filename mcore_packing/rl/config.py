"""`GRPOConfig`: the GRPO step's settings, without torch (NeMo-RL's ``grpo`` keys; also the trainer's
``grpo`` Hydra group, so a login node's dry run reads it without a GPU stack)."""

from __future__ import annotations

from dataclasses import dataclass

from ..validators import require_positive_int

__all__ = ["GRPOConfig"]


@dataclass(kw_only=True)
class GRPOConfig:
    """The policy step on rollouts an inference engine wrote.

    Each trainer step takes ``num_prompts_per_step`` groups (all responses to one prompt) from
    ``rollouts``, drawn like SFT samples (seeded order, epochs, resumable). The loss is the ``loss_fn``
    group (`losses.ClippedPGConfig`). A plain (not frozen) dataclass: Hydra fills it."""

    rollouts: str | None = None  # JSONL: prompt_tokens, response_tokens, reward, group_id[, generation_logprobs]
    num_prompts_per_step: int = 32
    num_generations_per_prompt: int | None = None  # when set, every group must have exactly this many responses
    use_leave_one_out_baseline: bool = False  # baseline: the mean of the group's other rewards
    normalize_rewards: bool = True  # divide advantages by the group's reward standard deviation
    keep_groups_together: bool = False  # a group's responses share a micro-batch of the log-prob pass
    num_minibatches: int = 1  # optimizer steps per GRPO step, each on whole groups against the same old log-probs

    def __post_init__(self):
        for name in ("num_prompts_per_step", "num_minibatches"):
            require_positive_int(name, getattr(self, name))
        if self.num_minibatches > self.num_prompts_per_step:
            raise ValueError(
                f"num_minibatches={self.num_minibatches} is more than num_prompts_per_step="
                f"{self.num_prompts_per_step}: a minibatch holds whole groups. Lower it."
            )
        require_positive_int("num_generations_per_prompt", self.num_generations_per_prompt, allow_none=True)
        if self.num_generations_per_prompt == 1:
            raise ValueError("num_generations_per_prompt=1: GRPO compares several responses per prompt; use >= 2.")
