"""What one step returns, and the step's exact loss on every rank: shared by both step drivers
(`schedule` for static plans, `dynamic_cp` for dynamic-CP plans), so neither imports the other's helpers."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..collectives import all_reduce, broadcast
from .process_groups import ProcessGroups, group_size

__all__ = ["StepResult", "broadcast_from_last_stage", "step_loss"]


@dataclass(frozen=True)
class StepResult:
    """Outcome of one step on this rank. ``loss`` is the exact global loss (on every rank)."""

    loss: float
    num_tokens: int
    num_sequences: int
    num_microbatches: int
    padded_tokens: int
    real_tokens: int


def step_loss(store: list[dict], process_groups: ProcessGroups, device: torch.device) -> float:
    """The step's exact loss on every rank: summed on the last stage over micro-batches (on the device)
    and DP x CP, then broadcast over the pipeline; read to the host once, after the schedule."""
    loss = torch.zeros(1, dtype=torch.float32, device=device)
    if process_groups.is_last_stage:
        for item in store:
            loss += item["weighted_loss"].float()
        if group_size(process_groups.dp_cp) > 1:
            all_reduce(loss, process_groups.dp_cp)
    broadcast_from_last_stage(loss, process_groups)
    return float(loss.item())


def broadcast_from_last_stage(tensor: torch.Tensor, process_groups: ProcessGroups) -> None:
    """``tensor`` of the last pipeline stage, on every stage (a no-op without PP)."""
    if process_groups.pp is not None and process_groups.pp_size > 1:
        broadcast(tensor, process_groups.pp_size - 1, process_groups.pp)
