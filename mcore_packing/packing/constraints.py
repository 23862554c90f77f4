"""Forcing the number of bins: ``min_bin_count`` and ``bin_count_multiple``.

Data-parallel training needs every rank to run the same number of micro-batches, so the bin count is
raised to ``max(num_bins, min_bin_count)`` rounded up to a multiple of ``bin_count_multiple``. Extra bins
are made by moving one sequence at a time out of the fullest bin that holds at least two, choosing the
sequence that best halves that bin's tokens. No bin is ever empty and no capacity can be exceeded (we
only remove from bins and fill new ones with a single sequence).
"""

from __future__ import annotations

import heapq

import numpy as np

from .bins import PackedBins

__all__ = ["enforce_bin_count", "required_bin_count"]


def required_bin_count(num_bins: int, min_bin_count: int | None, bin_count_multiple: int | None) -> int:
    """The bin count after applying both constraints (0 stays 0: empty input has no bins)."""
    if num_bins == 0:
        return 0
    target = max(num_bins, min_bin_count or 0)
    if bin_count_multiple:
        target = -(-target // bin_count_multiple) * bin_count_multiple
    return target


def enforce_bin_count(
    bins: PackedBins,
    lengths: np.ndarray,
    *,
    min_bin_count: int | None,
    bin_count_multiple: int | None,
) -> PackedBins:
    """Split bins until there are exactly ``required_bin_count(...)`` of them."""
    target = required_bin_count(bins.num_bins, min_bin_count, bin_count_multiple)
    if target == bins.num_bins:
        return bins
    num_sequences = bins.num_sequences
    if num_sequences < target:
        raise ValueError(
            f"Cannot create {target} bins with only {num_sequences} sequences "
            f"(min_bin_count={min_bin_count}, bin_count_multiple={bin_count_multiple}). Every bin needs at "
            "least one sequence: use a larger batch, or fewer data-parallel ranks / a smaller multiple."
        )
    tokens = bins.tokens_per_bin(lengths).tolist()
    sizes = bins.sizes()
    # Max-heap of splittable bins by tokens; ties go to the lower bin index for determinism.
    heap = [(-tokens[b], b) for b in np.flatnonzero(sizes >= 2).tolist()]
    heapq.heapify(heap)
    edited: dict[int, list[int]] = {}
    new_bins: list[list[int]] = []
    for _ in range(target - bins.num_bins):
        neg_tokens, b = heapq.heappop(heap)
        members = edited.get(b)
        if members is None:
            members = bins.bin(b).tolist()
            edited[b] = members
        half = -neg_tokens / 2
        # The member whose length is closest to half the bin; the later one on ties.
        pick = min(range(len(members)), key=lambda k: (abs(int(lengths[members[k]]) - half), -k))
        moved = members.pop(pick)
        new_bins.append([moved])
        remaining = -neg_tokens - int(lengths[moved])
        if len(members) >= 2:
            heapq.heappush(heap, (-remaining, b))
    all_bins = bins.to_lists()
    for b, members in edited.items():
        all_bins[b] = members
    return PackedBins.from_lists(all_bins + new_bins)
