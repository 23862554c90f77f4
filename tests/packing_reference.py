"""Independent, deliberately naive packers used as references by the tests (item by item, linear scans)."""

from __future__ import annotations


def reference_decreasing_fit(lengths: list[int], capacity: int, *, best_fit: bool) -> list[list[int]]:
    """Textbook FFD / BFD: longest first (ties by input index), linear scan over the open bins."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    room: list[int] = []
    for i in order:
        size = lengths[i]
        fitting = [b for b in range(len(bins)) if room[b] >= size]
        if not fitting:
            bins.append([i])
            room.append(capacity - size)
            continue
        b = min(fitting, key=lambda k: (room[k], k)) if best_fit else fitting[0]
        bins[b].append(i)
        room[b] -= size
    return bins


def reference_first_fit(order: list[int], lengths: list[int], capacity: int) -> list[list[int]]:
    """First fit over the items in the given order."""
    bins: list[list[int]] = []
    room: list[int] = []
    for i in order:
        for b in range(len(bins)):
            if room[b] >= lengths[i]:
                bins[b].append(i)
                room[b] -= lengths[i]
                break
        else:
            bins.append([i])
            room.append(capacity - lengths[i])
    return bins


def reference_next_fit(lengths: list[int], capacity: int) -> list[list[int]]:
    """Concatenate in input order, starting a new bin when the next item does not fit."""
    bins: list[list[int]] = []
    used = capacity + 1
    for i, size in enumerate(lengths):
        if used + size > capacity:
            bins.append([])
            used = 0
        bins[-1].append(i)
        used += size
    return bins
