"""The GRPO/PPO policy step as a framework drives it: rollouts in, one or more optimizer steps out.

    check_rollouts -> rollout_samples + grpo_advantages            (losses.rollouts)
    log-prob pass  -> plan_step(forward_only, logprob_mb_tokens) -> compute_logprobs(policy), (reference)
    training pass  -> per minibatch (grpo.num_minibatches runs of whole groups): plan_step(train_mb_tokens)
                      -> train_step(loss=policy_step_loss(ClippedPGLoss)) -> optimizer, schedule
    every pass     -> under logits_temperature(grpo.temperature); with grpo.shared_prefix each group's
                      prompt laid out once (plan_step(shared_prefix=...), thd.shared_prefix)

Its arguments are library types: a `megatron.Policy` (model, optimizer, schedule, process groups,
device; `megatron.build_policy` builds it and its frozen reference), the planner's `StepPlanConfig`, and
the torch-free settings `losses.ClippedPGConfig` and `rl.GRPOConfig`. Groups (the responses to one
prompt) share a micro-batch of the log-prob pass when ``keep_groups_together`` (packing or dynamic
batching); the training pass packs freely (the loss is per sample, its normalization global), except
under ``loss_agg_mode=prompt-mean``, whose groups share a micro-batch there too. The
trainer (``algorithm=grpo``) runs this step per global batch of groups. Generation is the user's
inference engine's job; this step takes its rollouts.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

from ..losses import ClippedPGConfig, ClippedPGLoss
from ..losses.policy_gradient import METRIC_KEYS as PG_METRIC_KEYS
from ..losses.rollouts import (
    Rollout,
    check_generation_logprobs,
    check_rollouts,
    grpo_advantages,
    minibatches,
    rollout_samples,
    rollouts_shared_prefix,
)
from ..megatron import Policy, StepOutcome, compute_logprobs, logits_temperature, policy_step_loss, train_step
from ..planning import StepPlan, StepPlanConfig, plan_step
from .config import GRPOConfig
from .metrics import sum_over_ranks

__all__ = ["RLStepResult", "rl_step"]


@dataclass(frozen=True)
class RLStepResult:
    """The step's loss (exact, every rank; with minibatches their mean), its metrics (clip fraction,
    approximate KL, mean ratio, KL to the reference, the training/inference ratio ``gen_ratio`` and the
    fractions of tokens whose importance weight was truncated or zeroed, entropy estimate, mean reward,
    grad norm), the
    advantages, the seconds of each pass, the training pass's plan and `StepOutcome` (minibatches chained,
    for `MetricsLogger.log_step`), and each minibatch's loss."""

    loss: float
    metrics: dict
    advantages: list[float]
    logprob_seconds: float
    train_seconds: float
    plan: StepPlan
    outcome: StepOutcome
    minibatch_losses: list[float]


def _per_position(rollouts: Sequence[Rollout], fallback):
    """Generation log-probs laid out like `compute_logprobs` rows (position j predicts token j + 1), on
    ``fallback``'s device: the trainer's own old log-probs where the engine gave none (importance weight
    1)."""
    import torch

    out = fallback.clone()
    rows, columns, values = [], [], []
    for i, r in enumerate(rollouts):
        if r.generation_logprobs is not None:
            start = len(r.prompt_tokens) - 1
            rows += [i] * len(r.response_tokens)
            columns += range(start, start + len(r.response_tokens))
            values += [float(v) for v in r.generation_logprobs]
    if rows:  # before the step, outside its hot path
        index = torch.tensor([rows, columns], dtype=torch.int64).to(out.device)
        out[index[0], index[1]] = torch.tensor(values, dtype=out.dtype).to(out.device)
    return out


def rl_step(
    policy: Policy,
    rollouts: Sequence[Rollout],
    plan_config: StepPlanConfig,
    *,
    loss: ClippedPGConfig,
    grpo: GRPOConfig | None = None,
    reference: Policy | None = None,
) -> RLStepResult:
    """One GRPO step on ``rollouts`` (every rank passes the same list): the log-prob pass over all of them,
    then ``grpo.num_minibatches`` optimizer steps, each on a run of whole groups against the same old
    log-probs (from the second on the policy has moved, so the ratio and its clipping act). ``grpo`` (its
    defaults when None) also sets the advantage baseline and the grouping. ``reference`` (a frozen
    `Policy`) is needed when ``loss.reference_policy_kl_penalty > 0``."""
    grpo = grpo or GRPOConfig()
    if loss.reference_policy_kl_penalty > 0 and reference is None:
        raise ValueError(
            f"reference_policy_kl_penalty={loss.reference_policy_kl_penalty} needs the reference policy: pass "
            "reference=build_policy(shape, layout, ...) without an optimizer (the starting weights)."
        )
    check_rollouts(rollouts, grpo=True)
    _check_generation_logprobs(rollouts, loss)
    samples = rollout_samples(rollouts, routes=grpo.router_replay)
    lengths = [len(s.tokens) for s in samples]
    group_ids = [r.group_id for r in rollouts]
    advantages = grpo_advantages([r.reward for r in rollouts], group_ids, leave_one_out=grpo.use_leave_one_out_baseline,
                                 normalize_std=grpo.normalize_rewards)  # fmt: skip
    keep = group_ids if grpo.keep_groups_together else None  # plan_step refuses groups in padded mode
    shared = rollouts_shared_prefix(rollouts) if grpo.shared_prefix else None
    start = time.perf_counter()
    logprob_plan = plan_step(lengths, plan_config, forward_only=True, groups=keep, shared_prefix=shared)
    pgs, device, temperature = policy.process_groups, policy.device, grpo.temperature
    with logits_temperature(policy.model, temperature):
        old = compute_logprobs(policy.model, samples, logprob_plan, pgs, device=device)
    reference_logprobs = None
    if loss.reference_policy_kl_penalty > 0:
        with logits_temperature(reference.model, temperature):
            reference_logprobs = compute_logprobs(reference.model, samples, logprob_plan, pgs, device=device)
    logprob_seconds = time.perf_counter() - start
    pg_loss = ClippedPGLoss(
        loss,
        advantages=advantages.tolist(),
        old_logprobs=old,
        reference_logprobs=reference_logprobs,
        generation_logprobs=_per_position(rollouts, old),
        device=device,  # every side input on the device before the step: the loss copies nothing
    )
    plans, outcomes = [], []
    per_prompt = loss.normalization == "group_mean"  # prompt-mean: a prompt's responses share a micro-batch
    for part in minibatches(group_ids, grpo.num_minibatches):  # else the loss is per sample: groups may split
        groups = [group_ids[i] for i in part] if per_prompt else None
        part_shared = rollouts_shared_prefix([rollouts[i] for i in part]) if grpo.shared_prefix else None
        plans.append(plan_step([lengths[i] for i in part], plan_config, groups=groups, shared_prefix=part_shared))
        with logits_temperature(policy.model, temperature):
            outcomes.append(train_step(policy, [samples[i] for i in part], plans[-1],
                                       loss=policy_step_loss(pg_loss, part)))  # fmt: skip
    outcome = _combined(outcomes)
    metrics = _reduce_metrics(pg_loss.metrics)
    if not loss.needs_entropy:
        del metrics["entropy"]  # not computed: entropy_estimate is the free one
    metrics.update(grad_norm=outcome.grad_norm, update_applied=outcome.updated, entropy_estimate=_entropy(old, samples),
                   mean_reward=sum(r.reward for r in rollouts) / len(rollouts))  # fmt: skip
    plan = plans[0] if len(plans) == 1 else type(plans[0]).chained(plans)  # StepPlan or DynamicCPPlan
    return RLStepResult(outcome.result.loss, metrics, advantages.tolist(), logprob_seconds, outcome.seconds, plan,
                        outcome, [o.result.loss for o in outcomes])  # fmt: skip


def _check_generation_logprobs(rollouts: Sequence[Rollout], loss: ClippedPGConfig) -> None:
    """With the importance-sampling correction, every rollout carries its generation log-probs."""
    if not loss.use_importance_sampling_correction:
        return
    missing = [i for i, r in enumerate(rollouts) if r.generation_logprobs is None]
    example = f" (e.g. rollout {missing[0]}, group {rollouts[missing[0]].group_id!r})" if missing else ""
    check_generation_logprobs(missing, len(rollouts), example=example)


def _combined(outcomes: list[StepOutcome]) -> StepOutcome:
    """A GRPO step's optimizer steps as one outcome: the mean loss, summed counts and seconds, the first
    step's learning rate, the mean gradient norm, and whether every update was applied."""
    if len(outcomes) == 1:
        return outcomes[0]
    results = [o.result for o in outcomes]
    counts = {k: sum(getattr(r, k) for r in results)
              for k in ("num_tokens", "num_sequences", "num_microbatches", "padded_tokens", "real_tokens")}  # fmt: skip
    norms = [o.grad_norm for o in outcomes if o.grad_norm is not None]
    return StepOutcome(
        result=replace(results[0], loss=sum(r.loss for r in results) / len(results), **counts),
        seconds=sum(o.seconds for o in outcomes),
        lr=outcomes[0].lr,
        grad_norm=sum(norms) / len(norms) if norms else None,
        updated=all(o.updated for o in outcomes),
    )


def _entropy(old_logprobs, samples) -> float:
    """The policy's entropy per response token, estimated as the mean of -log p(sampled token) under the
    pre-step policy: free (the log-prob pass computed it) and unbiased for on-policy samples; the exact
    entropy needs the whole vocabulary's logits, which the packed path never materializes. (One copy of
    the log-probs to the host.)"""
    host = old_logprobs.cpu()
    total, count = 0.0, 0.0
    for i, sample in enumerate(samples):
        n = len(sample.tokens)
        mask = host.new_tensor(sample.loss_mask[1:n])
        total -= float((host[i, : n - 1] * mask).sum())
        count += float(mask.sum())
    return total / max(count, 1.0)


def _reduce_metrics(sums: dict) -> dict:
    """Token-weighted means over every rank (TP, CP and the stages without a loss scale all counts alike)."""
    totals = dict(zip(PG_METRIC_KEYS, sum_over_ranks([sums[k] for k in PG_METRIC_KEYS]), strict=True))
    tokens = max(totals.pop("tokens"), 1.0)
    names = {"clipped": "clip_fraction", "approx_kl": "approx_kl", "ratio": "mean_ratio",
             "reference_kl": "reference_kl", "gen_ratio": "gen_ratio", "is_truncated": "is_truncated_fraction",
             "is_zeroed": "is_zeroed_fraction", "entropy": "entropy"}  # fmt: skip
    return {names[k]: v / tokens for k, v in totals.items()}
