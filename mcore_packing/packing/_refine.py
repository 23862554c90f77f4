"""Bin-count refinement: repack the small sequences of a few bins so that the emptiest bins disappear.

Decreasing-order packers leave almost every bin exactly full on heavy-tailed data, but at a million
sequences a few thousand bins end with gaps smaller than any sequence still to place, and those gaps add
up to one or two whole bins. This pass takes

- the emptiest bins made only of sequences of length ``<= theta = C / 16`` (up to ``_MAX_VICTIMS``, at
  most the excess over ``ceil(sum / C)``), which it tries to empty, and
- the bins with the largest gaps, until the gaps hold ``_HELPER_ROOM_FACTOR`` times what the emptiest bins
  carry (at most ``_MAX_BINS`` bins in all),

pulls out every sequence of length ``<= theta`` from them (the *pool*) and refills the same bins, the
least free first. Each bin is filled greedily with the longest pool length that fits; if room is left,
the last ``window`` tokens it took go back to the pool and a bounded subset sum over the pool's length
histogram (a Python integer as the bitset of reachable sums) picks the fill closest to exact. Bins at the
end of the order receive nothing when the pool runs out: those are the bins removed.

A pass is kept only if every pooled sequence found a place and the bin count went down; otherwise its
input is returned unchanged. Passes repeat (up to ``_MAX_PASSES``) while they remove bins. No bin ever
goes over capacity and every sequence stays in exactly one bin.

Cost per pass: O(n) numpy plus O(pool + bins * subset-sum window) Python, bounded by ``_MAX_BINS``; about
0.05-0.2 s at a million sequences (benchmarks/packing_speed.py prints the packers with and without it).
"""

from __future__ import annotations

import numpy as np

from ._bitset import IntSet

__all__ = ["refine_assignment"]

_MAX_PASSES = 4
"""Passes run while each removes at least one bin."""
_MAX_VICTIMS = 8
"""Bins one pass tries to empty."""
_HELPER_ROOM_FACTOR = 2
"""Helper bins are added until their gaps hold this many times the victims' tokens."""
_MAX_BINS = 4096
"""Upper bound on the bins one pass repacks (victims and helpers); bounds the cost."""
_THETA_DIVISOR = 16
"""Sequences up to ``theta = capacity // _THETA_DIVISOR`` tokens are movable."""
_WINDOW_MAX = 4096
"""Tokens handed back to the pool before the subset sum: ``min(theta, _WINDOW_MAX)``."""


class _LengthPool:
    """Multiset of lengths in ``[1, capacity]``: counts plus an `IntSet` of the lengths present, so
    "longest length <= r" costs a few integer operations."""

    def __init__(self, lengths: np.ndarray, capacity: int) -> None:
        count = np.bincount(lengths, minlength=capacity + 1)
        self.count = count.tolist()
        self.size = int(lengths.size)
        self.present = IntSet(capacity, np.flatnonzero(count).tolist())

    def longest_upto(self, r: int) -> int:
        """Longest length present that is ``<= r``, or 0."""
        return max(self.present.last_at_most(r), 0)

    def lengths_upto(self, r: int):
        """Distinct lengths present that are ``<= r``, ascending (a generator: callers may stop early)."""
        return self.present.ascending_upto(r)

    def take(self, u: int, k: int) -> None:
        left = self.count[u] - k
        self.count[u] = left
        self.size -= k
        if not left:
            self.present.discard(u)

    def give(self, u: int, k: int) -> None:
        if not self.count[u]:
            self.present.add(u)
        self.count[u] += k
        self.size += k


def closest_subset_sum(pool: _LengthPool, target: int) -> dict[int, int]:
    """Lengths (with multiplicity, within the pool's counts) whose sum is the largest value <= target.

    Bounded subset sum with binary splitting of the counts; the reachable sums are the bits of a Python
    integer, so each step is one shift and one or. Returns ``{length: count}``.
    """
    mask = (2 << target) - 1
    reach = 1
    steps: list[tuple[int, int, int]] = []  # (length, count, reachable sums before this step)
    for u in pool.lengths_upto(target):
        left = min(pool.count[u], target // u)
        chunk = 1
        while left:
            k = min(chunk, left)
            steps.append((u, k, reach))
            reach = (reach | (reach << (k * u))) & mask
            left -= k
            chunk *= 2
        if reach >> target & 1:
            break
    total = reach.bit_length() - 1
    chosen: dict[int, int] = {}
    for u, k, before in reversed(steps):
        if not before >> total & 1:
            chosen[u] = chosen.get(u, 0) + k
            total -= k * u
    return chosen


def _fill(rooms: list[int], pool: _LengthPool, window: int) -> list[dict[int, int]]:
    """Fill bins of the given rooms in order from the pool; returns each bin's ``{length: count}``."""
    fills = []
    for room in rooms:
        placed: dict[int, int] = {}
        taken: list[tuple[int, int]] = []
        while pool.size:
            u = pool.longest_upto(room)
            if not u:
                break
            k = min(pool.count[u], room // u)
            pool.take(u, k)
            placed[u] = placed.get(u, 0) + k
            taken.append((u, k))
            room -= k * u
        if room and pool.size:
            # Hand the last `window` tokens back and choose the fill closest to exact.
            released = 0
            while taken and released < window:
                u, k = taken.pop()
                back = min(k, -(-(window - released) // u))
                pool.give(u, back)
                placed[u] -= back
                if not placed[u]:
                    del placed[u]
                released += back * u
            for u, k in closest_subset_sum(pool, room + released).items():
                pool.take(u, k)
                placed[u] = placed.get(u, 0) + k
        fills.append(placed)
    return fills


def refine_assignment(
    lengths: np.ndarray, items: np.ndarray, bin_ids: np.ndarray, num_bins: int, capacity: int
) -> tuple[np.ndarray, np.ndarray, int]:
    """Run refinement passes until one removes no bin (at most ``_MAX_PASSES``); same form as `_refine_once`."""
    for _ in range(_MAX_PASSES):
        items, bin_ids, after = _refine_once(lengths, items, bin_ids, num_bins, capacity)
        if after == num_bins:
            break
        num_bins = after
    return items, bin_ids, num_bins


def _refine_once(
    lengths: np.ndarray, items: np.ndarray, bin_ids: np.ndarray, num_bins: int, capacity: int
) -> tuple[np.ndarray, np.ndarray, int]:
    """One pass: try to remove bins from a packing; see the module docstring.

    Args:
        lengths: all sequence lengths (indexed by item).
        items: items in placement order; ``bin_ids[j]`` is the bin of ``items[j]``.
        num_bins: number of bins (every bin non-empty).
        capacity: bin capacity.

    Returns ``(items, bin_ids, num_bins)`` in the same form: unchanged if no bin could be removed;
    otherwise the moved items follow the others and the remaining bins keep their relative order.
    """
    sizes = lengths[items]
    loads = np.bincount(bin_ids, weights=sizes, minlength=num_bins).astype(np.int64)
    lower_bound = -(-int(sizes.sum()) // capacity)
    if num_bins <= lower_bound:
        return items, bin_ids, num_bins
    gaps = capacity - loads
    theta = capacity // _THETA_DIVISOR
    longest = np.zeros(num_bins, dtype=np.int64)
    np.maximum.at(longest, bin_ids, sizes)
    # Victims: the emptiest bins made only of movable (short) sequences.
    candidates = np.flatnonzero(longest <= theta)
    victims = candidates[np.argsort(loads[candidates], kind="stable")[: min(num_bins - lower_bound, _MAX_VICTIMS)]]
    if victims.size == 0:
        return items, bin_ids, num_bins
    is_victim = np.zeros(num_bins, dtype=bool)
    is_victim[victims] = True
    helpers = np.flatnonzero((gaps > 0) & ~is_victim)
    helpers = helpers[np.argsort(-gaps[helpers], kind="stable")]
    wanted = _HELPER_ROOM_FACTOR * int(loads[victims].sum())
    num_helpers = int(np.searchsorted(np.cumsum(gaps[helpers]), wanted)) + 1
    chosen = np.concatenate((helpers[: min(num_helpers, _MAX_BINS - victims.size)], victims))

    in_chosen = np.zeros(num_bins, dtype=bool)
    in_chosen[chosen] = True
    movable = in_chosen[bin_ids] & (sizes <= theta)
    fixed = loads - np.bincount(bin_ids[movable], weights=sizes[movable], minlength=num_bins).astype(np.int64)
    order = chosen[np.argsort(-fixed[chosen], kind="stable")]  # least free first; victims last among ties

    pool = _LengthPool(sizes[movable], capacity)
    window = min(theta, _WINDOW_MAX)
    fills = _fill((capacity - fixed[order]).tolist(), pool, window)
    emptied = [b for b, fill in zip(order.tolist(), fills, strict=True) if not fill and fixed[b] == 0]
    if pool.size or not emptied:
        return items, bin_ids, num_bins

    # Hand out the pooled items, length by length in item order, to the bins that took that length.
    moved_pos = np.flatnonzero(movable)
    by_length = moved_pos[np.lexsort((items[moved_pos], sizes[moved_pos]))]
    starts = np.searchsorted(sizes[by_length], np.arange(capacity + 2))
    cursor = starts.tolist()
    new_pos, new_bin = [], []
    for b, fill in zip(order.tolist(), fills, strict=True):
        for u in sorted(fill, reverse=True):
            k = fill[u]
            new_pos.append(by_length[cursor[u] : cursor[u] + k])
            new_bin.append(np.full(k, b, dtype=np.int64))
            cursor[u] += k
    new_pos_arr = np.concatenate(new_pos)
    keep = ~movable
    out_items = np.concatenate((items[keep], items[new_pos_arr]))
    out_bins = np.concatenate((bin_ids[keep], np.concatenate(new_bin)))
    # Renumber without the emptied bins, keeping the others' order.
    alive = np.ones(num_bins, dtype=bool)
    alive[emptied] = False
    renumber = np.cumsum(alive) - 1
    return out_items, renumber[out_bins], int(alive.sum())
