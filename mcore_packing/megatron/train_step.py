"""One training step: a planned global batch through Megatron's schedule (`schedule.forward_backward`),
then Megatron's optimizer step and one step of its learning-rate schedule.

A loop calls `train_step` once per step (the trainer's SFT steps, each optimizer step of `rl.rl_step`);
what happens with the gradients (clipping, mixed precision, the distributed optimizer) is Megatron's
optimizer, which the `Policy` carries.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from ..data.sample import SequenceSample
from ..planning.step_plan import StepPlan
from .policy import Policy
from .schedule import StepResult, forward_backward
from .step_loss import StepLoss

__all__ = ["StepOutcome", "train_step"]


@dataclass(frozen=True)
class StepOutcome:
    """The schedule driver's `StepResult`, the wall time of the whole step (forward, backward, update),
    the learning rate the update used, the gradient norm before clipping, and whether the update was
    applied (fp16 skips it when the scaled gradients overflowed)."""

    result: StepResult
    seconds: float
    lr: float
    grad_norm: float | None
    updated: bool


def train_step(
    policy: Policy, samples: Sequence[SequenceSample], plan: StepPlan, *, loss: StepLoss | None = None
) -> StepOutcome:
    """Zero the gradient buffers, run the plan with ``loss`` (exact global loss; Megatron's finalize
    reduces the gradients over DP x CP), step Megatron's optimizer, then the LR schedule."""
    if policy.optimizer is None:
        raise ValueError("train_step needs a policy with an optimizer; this one was built frozen (optimizer=None).")
    for chunk in policy.chunks:
        chunk.zero_grad_buffer()
    policy.optimizer.zero_grad()
    start = time.perf_counter()
    result = forward_backward(policy.model, samples, plan, policy.process_groups, loss=loss, device=policy.device)
    lr = policy.optimizer.param_groups[0]["lr"]
    updated, grad_norm, _ = policy.optimizer.step()
    policy.scheduler.step(increment=1)
    return StepOutcome(
        result=result,
        seconds=time.perf_counter() - start,
        lr=float(lr),
        grad_norm=None if grad_norm is None else float(grad_norm),
        updated=bool(updated),
    )
