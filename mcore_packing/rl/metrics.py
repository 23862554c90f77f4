"""Step metrics summed over every rank: each rank that scored a sample adds its sums (the first rank of
each CP group, `losses.recording`; TP ranks, which hold the same gathered values, add them alike), so
ratios of two sums are exact means."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["sum_over_ranks"]


def sum_over_ranks(values: Sequence[float]) -> list[float]:
    """``values`` (numbers, or 0-d tensors on one device) summed element-wise over the whole world: one
    all-reduce on the device the backend takes (`collectives.all_reduce_values`); a world of one returns
    them."""
    from ..collectives import all_reduce_values

    return all_reduce_values(values, None)
