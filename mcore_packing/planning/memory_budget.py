"""A step plan's predicted memory, and the largest token budget whose plans fit a byte budget.

`plan_memory(plan, shape, settings)`: each pipeline stage's predicted peak for a `StepPlan` (the static
bytes, plus the largest live activations over Megatron's schedule of each DP rank's micro-batches in the
planner's order, the worst CP rank), from `planning.memory`. `largest_fitting_budget` searches the token
budgets (``train_mb_tokens``) whose plans of the given batches keep every stage under ``budget`` bytes,
and names what would make it fit when none does. numpy only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .balance import ORDERS
from .layout import ParallelLayout
from .memory import MemorySettings, MicroBatchTokens, format_bytes, micro_batch_memory, stage_peak, static_bytes
from .model_shape import ModelShape
from .step_config import StepPlanConfig
from .step_plan import plan_step

__all__ = ["MemoryBudgetError", "MemoryModel", "largest_fitting_budget", "memory_view", "plan_memory"]


class MemoryBudgetError(ValueError):
    """A batch whose longest sequence alone exceeds the memory budget (the message names the fixes)."""

def memory_view(plan, mb) -> MicroBatchTokens:
    """The memory model's view of one of ``plan``'s micro-batches."""
    lengths = tuple(int(plan.lengths[i]) for i in mb.sample_indices)
    rows, width = mb.shape
    thd = plan.is_thd(mb)
    spans = tuple(int(n) for n in plan.config.padded_lengths(list(lengths))) if thd else ()
    return MicroBatchTokens(thd=thd, lengths=lengths, rows=rows, width=width, spans=spans)


def plan_memory(plan, shape: ModelShape, settings: MemorySettings) -> list[dict]:
    """Per pipeline stage: ``{"stage", "static", "activations", "peak"}`` in bytes, the worst DP and CP
    rank's (see the module docstring)."""
    layout = plan.config.layout
    stages = []
    for stage in range(layout.pp):
        static = sum(static_bytes(shape, layout, settings, stage=stage).values())
        worst = 0.0
        for rank in plan.micro_batches:
            for cp_rank in range(layout.cp):
                per_mb = [[micro_batch_memory(shape, layout, settings, memory_view(plan, mb), stage=stage, chunk=v,
                                              cp_rank=cp_rank) for v in range(layout.vpp)] for mb in rank]  # fmt: skip
                worst = max(worst, stage_peak(per_mb, layout, stage))
        stages.append({"stage": stage, "static": static, "activations": worst, "peak": static + worst})
    return stages


@dataclass(frozen=True)
class MemoryModel:
    """The model shape and settings a `StepPlanConfig` predicts its plans' memory with
    (``StepPlanConfig.memory_model``); `plan_step` calls `enforce` on a training pass's plan."""

    shape: ModelShape
    settings: MemorySettings

    def enforce(self, plan, replan: Callable):
        """``plan``, or when a stage's predicted peak exceeds ``plan.config.memory_budget``, ``replan(config)``
        with another of the planner's micro-batch orders (under PP a stage holds consecutive micro-batches
        in flight) or else at the largest ``train_mb_tokens`` (a multiple of 64 below the plan's) that keeps
        every stage under it; a `MemoryBudgetError` naming the longest sequence when none does."""
        config, budget = plan.config, plan.config.memory_budget
        if self._fits(plan, budget):
            return plan
        unchecked = dataclasses.replace(config, memory_model=None)
        if config.layout.pp > 1:  # first the planner's other orders: a stage holds consecutive micro-batches
            for order in ORDERS:
                if order not in ("auto", config.microbatch_order):
                    candidate = replan(dataclasses.replace(unchecked, microbatch_order=order))
                    if self._fits(candidate, budget):
                        return candidate
        lengths = [int(n) for n in plan.lengths]
        low = _smallest_budget(config, max(lengths))
        candidate = lambda tokens: replan(dataclasses.replace(unchecked, train_mb_tokens=tokens))  # noqa: E731
        below = (config.train_mb_tokens - 1) // 64 * 64  # the largest multiple of 64 below the plan's budget
        tokens, result = _largest_fitting(low, below, candidate, lambda p: self._fits(p, budget))
        if tokens is None:
            stages = plan_memory(result or candidate(low), self.shape, self.settings)
            raise MemoryBudgetError(_too_big(max(lengths), stages, budget, config.layout, self.settings))
        return result

    def _fits(self, plan, budget: int) -> bool:
        return max(s["peak"] for s in plan_memory(plan, self.shape, self.settings)) <= budget


def largest_fitting_budget(
    batches: Sequence, config: StepPlanConfig, shape: ModelShape, settings: MemorySettings, budget: int, *,
    plan: Callable | None = None,
) -> dict:  # fmt: skip
    """The largest ``train_mb_tokens`` (a multiple of 64, up to a whole batch's tokens: then ``whole_batch``)
    whose plans of every batch in ``batches`` (lengths arrays) keep every stage's predicted peak under
    ``budget`` bytes, with those peaks; ``plan(lengths, config)`` plans a batch (`plan_step` by default).
    A ValueError when even a budget holding the longest sequence alone does not fit, naming it and what
    would make it fit."""
    plan = plan or (lambda lengths, cfg: plan_step(lengths, cfg))
    config = dataclasses.replace(config, memory_model=None)  # every candidate budget planned as it is
    longest = max(int(max(b)) for b in batches)
    low = _smallest_budget(config, longest)

    def peaks(tokens: int) -> list[dict]:
        cfg = dataclasses.replace(config, train_mb_tokens=tokens)
        stages = [plan_memory(plan(b, cfg), shape, settings) for b in batches]
        return [max((s[k] for s in stages), key=lambda d: d["peak"]) for k in range(config.layout.pp)]

    most = max(int(sum(config.padded_lengths(list(b)))) for b in batches)  # a budget past a batch's tokens
    fits, best = _largest_fitting(low, max(most, low), peaks, lambda stages: max(s["peak"] for s in stages) <= budget)
    if fits is None:
        raise MemoryBudgetError(_too_big(longest, best, budget, config.layout, settings))
    return {"train_mb_tokens": fits, "stages": best, "budget": budget, "whole_batch": fits >= most}


def _smallest_budget(config: StepPlanConfig, longest: int) -> int:
    """The smallest multiple of 64 tokens whose row holds the ``longest`` sequence (padded)."""
    return -(-int(config.padded_lengths([longest])[0]) // 64) * 64


def _largest_fitting(low: int, high: int, attempt: Callable, fits: Callable) -> tuple:
    """``(tokens, attempt(tokens))`` for the largest multiple of 64 in ``[low, high]`` (``low`` one) whose
    attempt ``fits``, bisecting (the peak grows with the budget); ``(None, attempt(low))`` when ``low``'s
    does not fit (None when ``low`` is past ``high``)."""
    if low > high:
        return None, None
    first = attempt(low)
    if not fits(first):
        return None, first
    best = (low, first)
    lo, hi = low // 64 + 1, -(-high // 64)
    while lo <= hi:
        mid = (lo + hi) // 2
        result = attempt(mid * 64)
        if fits(result):
            best, lo = (mid * 64, result), mid + 1
        else:
            hi = mid - 1
    return best


def _too_big(longest: int, stages: list[dict], budget: int, layout: ParallelLayout, settings: MemorySettings) -> str:
    worst = max(stages, key=lambda s: s["peak"])
    hints = [f"parallel.cp={layout.cp * 2} (each rank holds half of every sequence)",
             f"parallel.tp={layout.tp * 2} with sequence_parallel"]  # fmt: skip
    if settings.logprob_chunk_size is None:
        hints.append("model.logprob_chunk_size=4096 (no whole fp32 logits)")
    if settings.recompute != "full":
        hints.append("model.recompute_granularity=full (each layer recomputed in the backward)")
    if worst["static"] > budget:
        hints = ["more pipeline stages, tensor parallelism or the distributed optimizer: the static bytes alone "
                 f"({format_bytes(worst['static'])}) exceed it"]  # fmt: skip
    return (f"the longest sequence ({longest} tokens) alone needs {format_bytes(worst['peak'])} on pipeline stage "
            f"{worst['stage']} (static {format_bytes(worst['static'])}), over the memory budget of "
            f"{format_bytes(budget)}; try {', or '.join(hints)}.")  # fmt: skip
