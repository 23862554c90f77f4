"""One training step: a planned global batch through Megatron's schedule, then Megatron's optimizer step
and one step of its learning-rate schedule.

The loop (`trainer.train`) calls `train_step` once per step; what it does with the gradients (clipping,
mixed precision, the distributed optimizer) is Megatron's optimizer, built in `model_setup`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..data.sample import SequenceSample
from ..planning import StepPlan
from .model_setup import TrainingSetup

__all__ = ["StepOutcome", "train_step"]


@dataclass(frozen=True)
class StepOutcome:
    """The schedule driver's `StepResult`, the wall time of the whole step (forward, backward, update),
    the learning rate the update used, the gradient norm before clipping, and whether the update was
    applied (fp16 skips it when the scaled gradients overflowed)."""

    result: object
    seconds: float
    lr: float
    grad_norm: float | None
    updated: bool


def train_step(
    setup: TrainingSetup,
    samples: Sequence[SequenceSample],
    plan: StepPlan,
    *,
    normalization: str,
    sample_loss: Callable | None = None,
) -> StepOutcome:
    """Zero the gradient buffers, run the plan (exact global loss; Megatron's finalize reduces the
    gradients over DP/CP), step Megatron's optimizer, then the LR schedule. ``sample_loss`` replaces the
    NLL (`run_step`'s per-sample hook: the policy-gradient loss of `app.rl_step`)."""
    from ..megatron import run_step

    setup.model.zero_grad_buffer()
    setup.optimizer.zero_grad()
    start = time.perf_counter()
    result = run_step(setup.model, samples, plan, setup.groups, normalization=normalization,
                      sample_loss=sample_loss, device=setup.device)  # fmt: skip
    lr = setup.optimizer.param_groups[0]["lr"]
    updated, grad_norm, _ = setup.optimizer.step()
    setup.scheduler.step(increment=1)
    return StepOutcome(
        result=result,
        seconds=time.perf_counter() - start,
        lr=float(lr),
        grad_norm=None if grad_norm is None else float(grad_norm),
        updated=bool(updated),
    )
