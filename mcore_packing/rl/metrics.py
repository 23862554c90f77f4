"""Step metrics summed over every rank: each rank that scored a sample adds its sums (the first rank of
each CP group, `losses.recording`; TP ranks, which hold the same gathered values, add them alike), so
ratios of two sums are exact means."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["sum_over_ranks"]


def sum_over_ranks(values: Sequence[float], device) -> list[float]:
    """``values`` summed element-wise over the whole world (one all-reduce; a world of one returns them)."""
    import torch
    import torch.distributed as dist

    tensor = torch.tensor(list(values), dtype=torch.float64, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(tensor)
    return tensor.cpu().tolist()
