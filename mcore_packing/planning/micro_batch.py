"""One micro-batch's plan and the helpers both planners share (`step_plan` for static plans,
`dynamic_cp` for dynamic-CP plans): its cost, the samples of each group, a plan's fingerprint. Plain
numpy, no torch; neither planner imports the other's helpers."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass

import numpy as np

from .cost_model import CostModel

__all__ = ["MicroBatchPlan", "group_members", "micro_batch_cost", "plan_fingerprint"]


@dataclass(frozen=True)
class MicroBatchPlan:
    """One micro-batch: the global-batch indices of its samples and its padded shape.

    ``shape`` is ``(1, row_length)`` in packing mode (the whole THD row, before the CP split) and
    ``(rows, padded_length)`` in dynamic mode.
    """

    sample_indices: tuple[int, ...]
    shape: tuple[int, int]
    real_tokens: int
    cost: float = 0.0

    @property
    def padded_tokens(self) -> int:
        return self.shape[0] * self.shape[1]


def plan_fingerprint(plan, **planned) -> str:
    """A hash of a plan's inputs (its config, pass, lengths and groups) and of ``planned`` (what it
    decided, as JSON-able lists): `StepPlan.fingerprint`, `DynamicCPPlan.fingerprint`."""
    payload = {
        "config": asdict(plan.config),
        "forward_only": plan.forward_only,
        "lengths": list(plan.lengths),
        "groups": [str(g) for g in plan.groups or []],
        **({"shared_prefix": list(plan.shared_prefix)} if getattr(plan, "shared_prefix", None) is not None else {}),
        **planned,
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=list).encode()).hexdigest()


def micro_batch_cost(padded_lengths, shape: tuple[int, int], mode: str, cp_size: int, model: CostModel) -> float:
    """Predicted cost of one micro-batch on one CP rank: attention per sequence in packing mode (the row's
    padding counts as part of its last span), ``rows`` sequences of the padded width otherwise; plus the
    model's per-micro-batch constant and the CP exchange (`CostModel.cp_exchange`)."""
    exchange = model.cp_exchange(shape[0] * shape[1], cp_size)
    if mode == "packing":
        spans = np.asarray(padded_lengths, dtype=np.float64).copy()
        spans[-1] += shape[1] - spans.sum()
        return float(model.sequence_cost(spans, cp_size).sum()) + model.per_microbatch + exchange
    rows, width = shape
    return rows * float(model.sequence_cost([width], cp_size)[0]) + model.per_microbatch + exchange


def group_members(groups, count: int) -> list[list[int]]:
    """The samples of each group id, in the order ids first appear (``groups``: one id per sample)."""
    groups = list(groups)
    if len(groups) != count:
        raise ValueError(f"groups has {len(groups)} entries for {count} samples; give one group id per sample.")
    members: dict = {}
    for i, g in enumerate(groups):
        members.setdefault(g, []).append(i)
    return list(members.values())
