"""`GRPOConfig` and `DPOConfig`: the RL steps' settings, without torch (NeMo-RL's ``grpo`` and ``dpo``
keys; also the trainer's ``grpo`` and ``dpo`` Hydra groups, so a login node's dry run reads them without a
GPU stack)."""

from __future__ import annotations

from dataclasses import dataclass

from ..validators import InvalidValue, require_positive_int

__all__ = ["DPOConfig", "GRPOConfig", "RMConfig"]


@dataclass(kw_only=True)
class GRPOConfig:
    """The policy step on rollouts an inference engine wrote.

    Each trainer step takes ``num_prompts_per_step`` groups (all responses to one prompt) from
    ``rollouts``, drawn like SFT samples (seeded order, epochs, resumable). The loss is the ``loss_fn``
    group (`losses.ClippedPGConfig`). Every pass scores the responses at ``temperature`` (the logits
    divided by it, `megatron.logits_temperature`). With ``shared_prefix`` every pass lays a group out as
    its prompt once and its responses after it (`thd.shared_prefix`; packing or dynamic batching, cp=1, the
    built-in attention, dense models), exact, computing ``P + sum(R)`` tokens instead of ``G P + sum(R)``.
    With ``router_replay`` (Mixture-of-Experts models) every pass routes each token to the experts the
    engine chose (each rollout's ``routed_experts``; `megatron.router_replay`), the policy's and the
    reference's.
    A plain (not frozen) dataclass: Hydra fills it."""

    rollouts: str | None = None  # JSONL: prompt_tokens, response_tokens, reward, group_id[, generation_logprobs]
    num_prompts_per_step: int = 32
    num_generations_per_prompt: int | None = None  # when set, every group must have exactly this many responses
    use_leave_one_out_baseline: bool = False  # baseline: the mean of the group's other rewards
    normalize_rewards: bool = True  # divide advantages by the group's reward standard deviation
    keep_groups_together: bool = False  # a group's responses share a micro-batch of the log-prob pass
    num_minibatches: int = 1  # optimizer steps per GRPO step, each on whole groups against the same old log-probs
    temperature: float = 1.0  # the rollouts' sampling temperature (NeMo-RL: policy.generation.temperature)
    shared_prefix: bool = False  # a group's prompt laid out once for all its responses, in every pass
    router_replay: bool = False  # MoE: route every token to the experts the engine chose (routed_experts)

    def __post_init__(self):
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not (t > 0 and t < float("inf")):
            raise InvalidValue(
                f"temperature={t!r} must be a finite number > 0: the temperature the rollouts were sampled at "
                "(1: plain softmax). Greedy decoding has no log-probs to correct; use 1.", key="temperature")
        for name in ("num_prompts_per_step", "num_minibatches"):
            require_positive_int(name, getattr(self, name))
        if self.num_minibatches > self.num_prompts_per_step:
            raise InvalidValue(
                f"num_minibatches={self.num_minibatches} is more than num_prompts_per_step="
                f"{self.num_prompts_per_step}: a minibatch holds whole groups. Lower it.",
                key="num_minibatches",
            )
        require_positive_int("num_generations_per_prompt", self.num_generations_per_prompt, allow_none=True)
        if self.num_generations_per_prompt == 1:
            raise InvalidValue("num_generations_per_prompt=1: GRPO compares several responses per prompt; use >= 2.",
                               key="num_generations_per_prompt")


@dataclass(kw_only=True)
class DPOConfig:
    """``algorithm=dpo``: Direct Preference Optimization on (chosen, rejected) pairs (NeMo-RL's ``dpo`` keys,
    plus ``pairs``). The pair loss is ``preference_loss_weight * -log sigmoid(beta * margin)`` plus
    ``sft_loss_weight`` times the chosen response's NLL, averaged over the pairs of a step, where
    ``margin = (log pi(chosen) - log ref(chosen)) - (log pi(rejected) - log ref(rejected))`` and ``ref``
    is the policy's starting weights. Each trainer step takes ``training.global_batch_size`` pairs."""

    pairs: str | None = None  # JSONL: prompt/chosen/rejected (text or chat messages) or *_tokens (ids)
    reference_policy_kl_penalty: float = 0.05  # beta: how far the policy may move from the reference
    preference_loss_weight: float = 1.0
    sft_loss_weight: float = 0.0  # > 0 adds the chosen response's NLL (per token with sft_average_log_probs)
    preference_average_log_probs: bool = False  # a response's log-prob: its token mean instead of its sum
    sft_average_log_probs: bool = False

    def __post_init__(self):
        for name in ("reference_policy_kl_penalty", "preference_loss_weight", "sft_loss_weight"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
                raise InvalidValue(f"{name}={value!r} must be a number >= 0.", key=name)
        if self.reference_policy_kl_penalty == 0:
            raise InvalidValue("reference_policy_kl_penalty=0 makes the preference loss constant (log 2); use > 0.",
                               key="reference_policy_kl_penalty")
        if self.preference_loss_weight == 0 and self.sft_loss_weight == 0:
            raise InvalidValue("preference_loss_weight and sft_loss_weight are both 0: nothing to train; set one > 0.",
                               key="preference_loss_weight")


@dataclass(kw_only=True)
class RMConfig:
    """``algorithm=rm``: a Bradley-Terry reward model on (chosen, rejected) pairs (`losses.RewardPairLoss`):
    the model ends in a score head (`megatron.reward_head`) instead of the vocabulary, a response's reward
    is the score of its last token, and the loss is ``-log sigmoid(r_chosen - r_rejected - margin)`` plus
    ``center_rewards_coefficient (r_chosen + r_rejected)^2``, averaged over the pairs of a step. Pairs are
    DPO's (``pairs``: the same JSONL forms and refusals); each trainer step takes
    ``training.global_batch_size`` pairs, each pair in one micro-batch."""

    pairs: str | None = None  # JSONL: prompt/chosen/rejected (text or chat messages) or *_tokens (ids)
    margin: float = 0.0  # the chosen reward must win by at least this much
    center_rewards_coefficient: float = 0.0  # TRL's key: > 0 pulls the pair's reward sum toward 0

    def __post_init__(self):
        for name in ("margin", "center_rewards_coefficient"):
            value = getattr(self, name)
            number = isinstance(value, (int, float)) and not isinstance(value, bool)
            if not number or not 0 <= value < float("inf"):
                raise InvalidValue(f"{name}={value!r} must be a finite number >= 0.", key=name)
