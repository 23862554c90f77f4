"""The rollouts of an ``algorithm=grpo`` run: read from ``grpo.rollouts`` (JSONL), checked, grouped.

Every rank reads the same file. The unit a step draws is a group (all responses to one prompt), so the
trainer's `GlobalBatchSampler` draws ``grpo.num_prompts_per_step`` group indices per step, and
`RolloutData.indices_of` turns them into the step's rollouts (groups in drawn order, responses in file
order). Generation is the user's inference engine's job; this file is what it wrote.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..data.sample import SequenceSample
from ..losses.rollouts import Rollout, check_rollouts, group_members, read_rollouts_jsonl, rollout_samples
from .config import ConfigError, GRPOConfig

__all__ = ["RolloutData", "load_rollout_data"]


@dataclass(frozen=True)
class RolloutData:
    """The rollouts, their training samples (prompt + response, the response learned), the rollout
    indices of every group (first-appearance order), the smallest vocabulary holding their tokens, and a
    description for the log."""

    rollouts: list[Rollout]
    samples: list[SequenceSample]
    groups: list[list[int]]
    vocab_size: int
    info: dict

    def indices_of(self, group_indices: Sequence[int]) -> list[int]:
        """The rollout indices of these groups, group by group."""
        return [i for g in group_indices for i in self.groups[g]]

    def fingerprint_extra(self) -> list:
        """What identifies the rollouts beyond their tokens (for the checkpoint's data fingerprint)."""
        return [[r.reward, str(r.group_id)] for r in self.rollouts]


def load_rollout_data(grpo: GRPOConfig) -> RolloutData:
    """Read and check ``grpo.rollouts``; errors name the line, rollout or group and the fix."""
    if not grpo.rollouts:
        raise ConfigError(
            "algorithm=grpo needs grpo.rollouts=/path/rollouts.jsonl: one JSON object per sampled response with "
            "prompt_tokens, response_tokens, reward, group_id (and optionally generation_logprobs), written by "
            "your inference engine."
        )
    try:
        rollouts = read_rollouts_jsonl(grpo.rollouts)
        check_rollouts(rollouts, grpo=True)
    except (ValueError, FileNotFoundError) as exc:
        raise ConfigError(f"grpo.rollouts: {exc}") from None
    members = group_members([r.group_id for r in rollouts])
    groups = list(members.values())
    want = grpo.num_generations_per_prompt
    if want is not None:
        wrong = [(g, len(idx)) for g, idx in members.items() if len(idx) != want]
        if wrong:
            raise ConfigError(
                f"grpo.num_generations_per_prompt={want}, but group(s) {wrong[:5]} (id, responses) differ in "
                f"{grpo.rollouts}. Fix the file, or set grpo.num_generations_per_prompt=null to accept any group size."
            )
    if grpo.num_prompts_per_step > len(groups):
        raise ConfigError(
            f"grpo.num_prompts_per_step={grpo.num_prompts_per_step} is more than the {len(groups)} groups in "
            f"{grpo.rollouts}. Lower it, or write more rollouts."
        )
    largest = max(max(*r.prompt_tokens, *r.response_tokens, 0) for r in rollouts)
    info = {"source": "rollouts", "path": grpo.rollouts, "rollouts": len(rollouts), "groups": len(groups),
            "tokenizer": "the rollouts' own token ids"}  # fmt: skip
    return RolloutData(rollouts, rollout_samples(rollouts), groups, int(largest) + 1, info)
