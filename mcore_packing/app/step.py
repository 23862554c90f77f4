"""One training step: a planned global batch through Megatron's schedule, then the optimizer step.

The loop (`trainer.train`) calls `train_step` once per step; what it does with the gradients (the
optimizer, clipping, the LR schedule) lives here and in `model_setup`, nowhere else.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from ..data.sample import SequenceSample
from ..planning import StepPlan
from .model_setup import TrainingSetup

__all__ = ["StepOutcome", "train_step"]


@dataclass(frozen=True)
class StepOutcome:
    """The schedule driver's `StepResult` and the wall time of the whole step (forward, backward, update)."""

    result: object
    seconds: float


def train_step(
    setup: TrainingSetup, samples: Sequence[SequenceSample], plan: StepPlan, *, normalization: str
) -> StepOutcome:
    """Zero the gradient buffers, run the plan (exact global loss), copy Megatron DDP's ``main_grad`` into
    ``.grad`` for the torch optimizer, and step it."""
    from ..megatron import run_step

    setup.model.zero_grad_buffer()
    start = time.perf_counter()
    result = run_step(setup.model, samples, plan, setup.groups, normalization=normalization, device=setup.device)
    for p in setup.params:
        if getattr(p, "main_grad", None) is not None:
            p.grad = p.main_grad.to(p.dtype)
    setup.optimizer.step()
    setup.optimizer.zero_grad(set_to_none=True)
    return StepOutcome(result=result, seconds=time.perf_counter() - start)
