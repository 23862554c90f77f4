"""The GRPO/PPO policy step as a framework drives it: rollouts in, one optimizer step out.

    check_rollouts -> rollout_samples + grpo_advantages            (losses.rollouts)
    log-prob pass  -> plan_step(forward_only, logprob_mb_tokens) -> compute_logprobs(policy), (reference)
    training pass  -> plan_step(train_mb_tokens) -> run_step(sample_loss=ClippedPGLoss) -> optimizer, schedule

Groups (the responses to one prompt) share a micro-batch when ``keep_groups_together``. The reference
model is built once (`build_reference_model`: the policy's shape and layout, the same starting weights,
no optimizer). Generation is the user's inference engine's job; this step takes its rollouts.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..losses import ClippedPGConfig, ClippedPGLoss
from ..losses.rollouts import Rollout, check_rollouts, grpo_advantages, rollout_samples
from ..planning import StepPlanConfig, plan_step
from .config import TrainConfig
from .model_setup import TrainingSetup
from .step import train_step

__all__ = ["RLStepConfig", "RLStepResult", "build_reference_model", "rl_step"]


@dataclass(frozen=True, kw_only=True)
class RLStepConfig:
    loss: ClippedPGConfig = field(default_factory=ClippedPGConfig)
    leave_one_out: bool = False  # GRPO baseline: the group's other rewards instead of its mean
    normalize_std: bool = True  # divide by the group's reward standard deviation
    keep_groups_together: bool = True


@dataclass(frozen=True)
class RLStepResult:
    loss: float
    metrics: dict
    advantages: list[float]
    logprob_seconds: float
    train_seconds: float


def build_reference_model(cfg: TrainConfig, shape, device):
    """The reference policy: the policy's shape and layout and its starting weights (``model.hf_path``,
    else the same seeded initialization), without an optimizer. Call after `setup_training`."""
    import torch
    from megatron.core import parallel_state as ps

    from ..megatron import build_gpt_model
    from ..megatron.hf_weights import load_hf_weights

    par = cfg.parallel
    model, _ = build_gpt_model(shape, tp=par.tp, pp=par.pp, cp=par.cp, sequence_parallel=par.sequence_parallel,
                               variable_seq_lengths=par.variable_seq_lengths, dtype=getattr(torch, cfg.model.dtype),
                               attention_backend=cfg.model.attention_backend, seed=cfg.training.seed,
                               device=device)  # fmt: skip
    if cfg.model.hf_path is not None:
        load_hf_weights(model, shape, cfg.model.hf_path, tp_rank=ps.get_tensor_model_parallel_rank(), tp_size=par.tp)
    model.eval()
    return model


def _per_position(rollouts: Sequence[Rollout], fallback) -> list:
    """Generation log-probs laid out like `compute_logprobs` rows (position j predicts token j + 1); the
    trainer's own old log-probs where the engine gave none (importance weight 1)."""
    import torch

    rows = []
    for i, r in enumerate(rollouts):
        row = fallback[i].clone()
        if r.generation_logprobs is not None:
            start = len(r.prompt_tokens) - 1
            row[start : start + len(r.response_tokens)] = torch.as_tensor(r.generation_logprobs, dtype=row.dtype)
        rows.append(row)
    return rows


def rl_step(setup: TrainingSetup, reference_model, rollouts: Sequence[Rollout], plan_config: StepPlanConfig,
            config: RLStepConfig) -> RLStepResult:  # fmt: skip
    """One policy step on ``rollouts`` (every rank passes the same list)."""
    from ..megatron import compute_logprobs

    check_rollouts(rollouts, grpo=True)
    samples = rollout_samples(rollouts)
    lengths = [len(s.tokens) for s in samples]
    group_ids = [r.group_id for r in rollouts]
    advantages = grpo_advantages([r.reward for r in rollouts], group_ids, leave_one_out=config.leave_one_out,
                                 normalize_std=config.normalize_std)  # fmt: skip
    keep = group_ids if config.keep_groups_together else None
    start = time.perf_counter()
    logprob_plan = plan_step(lengths, plan_config, forward_only=True, groups=keep)
    old = compute_logprobs(setup.model, samples, logprob_plan, setup.groups, device=setup.device)
    reference = None
    if config.loss.reference_policy_kl_penalty > 0:
        reference = compute_logprobs(reference_model, samples, logprob_plan, setup.groups, device=setup.device)
    logprob_seconds = time.perf_counter() - start
    loss = ClippedPGLoss(config.loss, advantages=advantages.tolist(), old_logprobs=old,
                         reference_logprobs=reference, generation_logprobs=_per_position(rollouts, old))  # fmt: skip
    train_plan = plan_step(lengths, plan_config, groups=keep)
    outcome = train_step(setup, samples, train_plan, normalization=config.loss.normalization, sample_loss=loss)
    metrics = _reduce_metrics(loss.metrics, setup.device)
    metrics.update(grad_norm=outcome.grad_norm, update_applied=outcome.updated,
                   mean_reward=sum(r.reward for r in rollouts) / len(rollouts))  # fmt: skip
    return RLStepResult(outcome.result.loss, metrics, advantages.tolist(), logprob_seconds, outcome.seconds)


def _reduce_metrics(sums: dict, device) -> dict:
    """Token-weighted means over every rank (TP, CP and the stages without a loss scale all counts alike)."""
    import torch
    import torch.distributed as dist

    keys = ("tokens", "clipped", "approx_kl", "ratio")
    values = torch.tensor([sums[k] for k in keys], dtype=torch.float64, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(values)
    tokens, clipped, kl, ratio = values.cpu().tolist()
    tokens = max(tokens, 1.0)
    return {"clip_fraction": clipped / tokens, "approx_kl": kl / tokens, "mean_ratio": ratio / tokens}
