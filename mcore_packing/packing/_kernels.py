"""Numeric kernels behind the packers. Pure numpy + Python, no torch, no distributed.

The decreasing-order algorithms (FFD, BFD and the last phase of MFFD) place all items of one length at
once. Real and synthetic length distributions have few distinct lengths compared with their count (at
most ``bin_capacity`` of them), so the Python-level loop runs once per distinct length and the work
inside is vectorized over the open bins.

Why placing a whole group at once gives the textbook result: items arrive in non-increasing order, so
when an item of length ``s`` is placed, every bin before the first fitting bin already has residual
< ``s`` and stays that way. A first-fit scan therefore fills the first fitting bin with as many items of
length ``s`` as fit (``residual // s``), then the next fitting bin, and so on, and only then opens new
bins, each holding ``capacity // s`` items. Best fit is the same with the fitting bins visited in
order of increasing residual (ties broken by the lower bin index), because a bin that just received an
item has the smallest residual that still fits, if any. The tests compare both against plain
item-by-item reference implementations.

When lengths rarely repeat (uniform lengths: ~6 sequences per distinct length at 100k), per-length numpy
calls cost more than they save, and the kernels go item by item instead: first fit with a max segment
tree over bin residuals, best fit with bins bucketed by residual (a two-level bitset finds the smallest
residual that fits). The thresholds (``_PER_ITEM_RATIO``, ``_BEST_FIT_PER_ITEM_RATIO``) were set from
benchmarks/packing_speed.py; every path gives the same bins.
"""

from __future__ import annotations

import heapq

import numpy as np

from ._bitset import IntSet

__all__ = [
    "best_fit_in_order",
    "bins_from_assignment",
    "decreasing_fit",
    "first_fit_in_order",
    "next_fit_in_order",
    "stable_descending_order",
]


def stable_descending_order(lengths: np.ndarray) -> np.ndarray:
    """Indices that sort ``lengths`` non-increasingly; equal lengths keep their input order."""
    return np.argsort(-lengths, kind="stable")


def bins_from_assignment(items_in_placement_order: np.ndarray, bin_ids: np.ndarray, num_bins: int) -> tuple:
    """Group items by bin, keeping placement order inside each bin.

    Returns ``(indices, offsets)``: bin ``b`` holds ``indices[offsets[b]:offsets[b + 1]]``.
    """
    perm = np.argsort(bin_ids, kind="stable")
    counts = np.bincount(bin_ids, minlength=num_bins)
    offsets = np.zeros(num_bins + 1, dtype=np.int64)
    np.cumsum(counts, out=offsets[1:])
    return items_in_placement_order[perm], offsets


_BLOCK = 256
"""Bins per block of the residual index: scans visit only blocks whose largest residual fits the item."""
_SMALL = 32768
"""Up to this many open bins a flat scan beats the block index (numpy call overhead dominates)."""
_PER_ITEM_RATIO = 8
"""First fit goes item by item when there are fewer items than this per distinct length."""
_SMALL_GROUP = 16
"""First fit places groups of up to this many items in plain Python after the vectorized scan."""
_BEST_FIT_PER_ITEM_RATIO = 256
"""Same for best fit: its per-item structure is cheaper than the grouped scan up to long runs (measured
with benchmarks/packing_speed.py: per item wins at 60-200 items per length, loses at 400+)."""


def decreasing_fit(
    sorted_lengths: np.ndarray,
    capacity: int,
    *,
    best_fit: bool,
    initial_residuals: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """First fit (or best fit) of non-increasing ``sorted_lengths``, one group of equal lengths at a time.

    Args:
        sorted_lengths: non-increasing item lengths, each in [1, capacity].
        capacity: bin capacity.
        best_fit: visit fitting bins by increasing residual (best fit) instead of by index (first fit).
        initial_residuals: residual capacity of bins that are already open (MFFD's last phase).

    Returns:
        ``(bin_ids, residuals)``: the bin of every item (same order as ``sorted_lengths``) and the
        residual capacity of every bin, open bins first.

    Bins are indexed in blocks of ``_BLOCK`` with the largest residual of each block, so a group scans
    only the blocks that can take it (first fit stops at the first blocks that hold the whole group).
    """
    n = int(sorted_lengths.size)
    n_open = 0 if initial_residuals is None else int(initial_residuals.size)
    num_blocks = -(-(n_open + n) // _BLOCK)
    # Unopened slots hold -1 so they never look like room; bins are opened left to right.
    residual = np.full(num_blocks * _BLOCK, -1, dtype=np.int64)
    by_block = residual.reshape(num_blocks, _BLOCK)
    block_max = np.full(num_blocks, -1, dtype=np.int64)
    bin_ids = np.empty(n, dtype=np.int64)
    num_bins = n_open
    if n_open:
        residual[:n_open] = initial_residuals
        used = -(-n_open // _BLOCK)
        block_max[:used] = by_block[:used].max(axis=1)
    if n == 0:
        return bin_ids, residual[:num_bins].copy()

    # Items larger than half a bin, when no bin is open yet, each open their own bin: no earlier item
    # left room for them. One vectorized step instead of a group each.
    start_item = 0
    if n_open == 0:
        start_item = int(np.count_nonzero(2 * sorted_lengths > capacity))
        if start_item:
            bin_ids[:start_item] = np.arange(start_item, dtype=np.int64)
            residual[:start_item] = capacity - sorted_lengths[:start_item]
            num_bins = start_item
            used = -(-start_item // _BLOCK)
            block_max[:used] = by_block[:used].max(axis=1)
    if start_item == n:
        return bin_ids, residual[:num_bins].copy()

    tail = sorted_lengths[start_item:]
    boundaries = np.flatnonzero(tail[1:] != tail[:-1]) + 1 + start_item
    ratio = _BEST_FIT_PER_ITEM_RATIO if best_fit else _PER_ITEM_RATIO
    if tail.size < ratio * (boundaries.size + 1):
        # Few items per distinct length: a per-item structure is cheaper than numpy per group.
        in_order = best_fit_in_order if best_fit else first_fit_in_order
        tail_ids, num_bins_after = in_order(tail, capacity, residual[:num_bins])
        bin_ids[start_item:] = tail_ids
        after = np.full(num_bins_after, capacity, dtype=np.int64)
        after[:num_bins] = residual[:num_bins]
        after -= np.bincount(tail_ids, weights=tail, minlength=num_bins_after).astype(np.int64)
        return bin_ids, after
    starts = np.concatenate(([start_item], boundaries)).tolist()
    ends = np.concatenate((boundaries, [n])).tolist()
    values = sorted_lengths[starts].tolist()
    # Upper bound on the largest residual; lets groups skip the scan when nothing can fit.
    max_residual = int(block_max.max())

    for s, start, end in zip(values, starts, ends, strict=True):
        count = end - start
        placed = 0
        if max_residual >= s:
            if num_bins <= _SMALL:
                placed, max_residual = _place_group_scan(
                    s, count, start, num_bins, residual, block_max, bin_ids, best_fit, max_residual
                )
            else:
                blocks = np.flatnonzero(block_max[: -(-num_bins // _BLOCK)] >= s)
                placed, max_residual = _place_group(
                    s, count, start, blocks, by_block, residual, block_max, bin_ids, best_fit, max_residual
                )
        remaining = count - placed
        if remaining:
            per_bin = capacity // s
            num_new = -(-remaining // per_bin)
            bin_ids[start + placed : end] = num_bins + np.arange(remaining, dtype=np.int64) // per_bin
            residual[num_bins : num_bins + num_new] = capacity - per_bin * s
            last_residual = capacity - (remaining - (num_new - 1) * per_bin) * s
            residual[num_bins + num_new - 1] = last_residual
            first_block = num_bins // _BLOCK
            num_bins += num_new
            last_block = -(-num_bins // _BLOCK)
            block_max[first_block:last_block] = by_block[first_block:last_block].max(axis=1)
            max_residual = max(max_residual, last_residual)
    return bin_ids, residual[:num_bins].copy()


def _place_group_scan(s, count, start, num_bins, residual, block_max, bin_ids, best_fit, max_residual):
    """`_place_group` for few open bins: one flat scan is cheaper than the block index.

    ``block_max`` is left stale here; residuals only shrink, so it stays a valid upper bound.
    """
    open_residual = residual[:num_bins]
    if count == 1 and not best_fit:
        b = int(np.argmax(open_residual >= s))  # stops at the first fitting bin
        if open_residual[b] < s:
            return 0, s - 1
        open_residual[b] -= s
        bin_ids[start] = b
        return 1, max_residual
    candidates = np.flatnonzero(open_residual >= s)
    if candidates.size == 0:
        return 0, s - 1
    if not best_fit and count <= _SMALL_GROUP:
        # Every candidate takes at least one item, so only the first `count` can be used: plain Python
        # over them is cheaper than the vectorized fill's dozen numpy calls.
        head = candidates[:count]
        placed = 0
        for b, r in zip(head.tolist(), open_residual[head].tolist(), strict=True):
            take = min(count - placed, r // s)
            open_residual[b] = r - take * s
            bin_ids[start + placed : start + placed + take] = b
            placed += take
            if placed == count:
                break
        return placed, (s - 1 if placed < count else max_residual)
    placed, candidates, all_used = _fill(
        s, count, start, candidates, open_residual[candidates], residual, bin_ids, best_fit
    )
    return placed, (s - 1 if all_used else max_residual)


def _fill(s, count, start, candidates, cand_residual, residual, bin_ids, best_fit):
    """Put up to ``count`` items of length ``s`` into ``candidates`` (bins that fit one, in index order),
    each taking ``residual // s``: by index (first fit) or by increasing residual (best fit).

    Returns ``(placed, bins used, whether every candidate was filled below s)``.
    """
    if best_fit:
        by_residual = np.argsort(cand_residual, kind="stable")
        candidates = candidates[by_residual]
        cand_residual = cand_residual[by_residual]
    fits = cand_residual // s
    cumulative = np.cumsum(fits)
    all_used = cumulative[-1] <= count
    if not all_used:
        last = int(np.searchsorted(cumulative, count))
        candidates = candidates[: last + 1]
        fits = fits[: last + 1]
        fits[-1] -= int(cumulative[last]) - count
    placed = int(fits.sum())
    bin_ids[start : start + placed] = np.repeat(candidates, fits)
    residual[candidates] -= fits * s
    return placed, candidates, all_used


def _place_group(s, count, start, blocks, by_block, residual, block_max, bin_ids, best_fit, max_residual):
    """Place up to ``count`` items of length ``s`` into the open bins of ``blocks``; return (placed, bound)."""
    if blocks.size == 0:
        return 0, s - 1
    # First fit looks at a few blocks first and widens only if the group does not fit there.
    take = blocks.size if best_fit else min(blocks.size, 4)
    while True:
        chosen = blocks[:take]
        block_res = by_block[chosen]
        block_max[chosen] = block_res.max(axis=1)  # refresh bounds left stale by the flat scan
        rows, cols = np.nonzero(block_res >= s)
        candidates = chosen[rows] * _BLOCK + cols
        cand_residual = block_res[rows, cols]
        if take == blocks.size or (cand_residual.size and int((cand_residual // s).sum()) >= count):
            break
        take = min(blocks.size, take * 4)
    if cand_residual.size == 0:
        return 0, s - 1
    placed, candidates, all_used = _fill(s, count, start, candidates, cand_residual, residual, bin_ids, best_fit)
    if all_used and take == blocks.size:
        max_residual = s - 1  # every fitting bin is now below s
    touched = np.unique(candidates // _BLOCK)
    block_max[touched] = by_block[touched].max(axis=1)
    return placed, max_residual


def first_fit_in_order(
    lengths: np.ndarray, capacity: int, initial_residuals: np.ndarray | None = None
) -> tuple[np.ndarray, int]:
    """Textbook first fit in the given order, with a max-segment-tree over bin residuals.

    O(n log n), about a microsecond per item. Used by ``first_fit_shuffle`` (whose order has no
    equal-length runs to batch) and by FFD when its equal-length groups are too small to pay for numpy.
    ``initial_residuals`` are bins already open, in index order. Returns ``(bin_ids, num_bins)``.
    """
    n = int(lengths.size)
    n_open = 0 if initial_residuals is None else int(initial_residuals.size)
    bin_ids = np.empty(n, dtype=np.int64)
    if n == 0:
        return bin_ids, n_open
    size = 1
    while size < n + n_open:
        size *= 2
    # Leaves hold residuals; unopened bins hold `capacity`, so "first leaf with residual >= s" is exactly
    # "first open bin that fits, else the next new bin".
    tree = [capacity] * (2 * size)
    if n_open:
        tree[size : size + n_open] = initial_residuals.tolist()
        for node in range(size - 1, 0, -1):
            left, right = tree[2 * node], tree[2 * node + 1]
            tree[node] = left if left > right else right
    num_bins = n_open
    out = bin_ids  # local alias
    for i, s in enumerate(lengths.tolist()):
        node = 1
        while node < size:
            node *= 2
            if tree[node] < s:
                node += 1
        leaf = node - size
        out[i] = leaf
        if leaf >= num_bins:
            num_bins = leaf + 1
        value = tree[node] - s
        tree[node] = value
        node //= 2
        while node:
            left = tree[2 * node]
            right = tree[2 * node + 1]
            best = left if left > right else right
            if tree[node] == best:
                break
            tree[node] = best
            node //= 2
    return bin_ids, num_bins


def best_fit_in_order(
    lengths: np.ndarray, capacity: int, initial_residuals: np.ndarray | None = None
) -> tuple[np.ndarray, int]:
    """Textbook best fit in the given order: the fitting bin with the least room, lowest index on ties.

    Bins are bucketed by residual: a min-heap of bin indices per residual value, and an `IntSet`
    (two-level bitset) of the non-empty residual values, so "smallest residual >= s" is a few word
    operations (about a microsecond per item in Python, independent of the number of bins). A run of
    equal lengths is placed bin by bin: the chosen bin takes ``residual // s`` items at once, which is
    what item-by-item best fit does, since its new residual, if it still fits, is the smallest one that
    fits.
    ``initial_residuals`` are bins already open, in index order. Returns ``(bin_ids, num_bins)``.
    """
    n = int(lengths.size)
    bin_ids = np.empty(n, dtype=np.int64)
    opened = [] if initial_residuals is None else initial_residuals.tolist()
    num_bins = len(opened)
    if n == 0:
        return bin_ids, num_bins
    buckets: dict[int, list[int]] = {}
    for b, r in enumerate(opened):
        if r > 0:
            buckets.setdefault(r, []).append(b)  # increasing indices: already a heap
    present = IntSet(capacity, list(buckets))  # residuals (>= 1) that some bin has
    next_at_least, add, discard = present.next_at_least, present.add, present.discard
    heappop, heappush = heapq.heappop, heapq.heappush
    out: list[int] = [0] * n
    values = lengths.tolist()
    starts = np.concatenate(([0], np.flatnonzero(lengths[1:] != lengths[:-1]) + 1)).tolist()
    ends = [*starts[1:], n]
    for start, end in zip(starts, ends, strict=True):
        s = values[start]
        pos = start
        while pos < end:
            r = next_at_least(s)  # the smallest residual that fits
            if r > 0:
                heap = buckets[r]
                b = heappop(heap)
                if not heap:
                    del buckets[r]
                    discard(r)
                take = min(r // s, end - pos)
            else:
                b = num_bins  # nothing fits: open a bin (the highest index, so appending keeps heaps valid)
                num_bins += 1
                r = capacity
                take = min(capacity // s, end - pos)
            out[pos : pos + take] = [b] * take
            pos += take
            r -= take * s
            if r:
                heap = buckets.get(r)
                if heap is None:
                    buckets[r] = [b]
                    add(r)
                else:
                    heappush(heap, b)
    bin_ids[:] = out
    return bin_ids, num_bins


def next_fit_in_order(lengths: np.ndarray, capacity: int) -> tuple[np.ndarray, int]:
    """Next fit in input order: a new bin starts whenever the next item does not fit the current one.

    Returns ``(bin_ids, num_bins)``. One ``searchsorted`` per bin over the prefix sums.
    """
    n = int(lengths.size)
    bin_ids = np.empty(n, dtype=np.int64)
    if n == 0:
        return bin_ids, 0
    prefix = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(lengths, out=prefix[1:])
    start = 0
    num_bins = 0
    while start < n:
        # Last end with prefix[end] - prefix[start] <= capacity; always >= start + 1 as lengths <= capacity.
        end = int(np.searchsorted(prefix, prefix[start] + capacity, side="right")) - 1
        bin_ids[start:end] = num_bins
        num_bins += 1
        start = end
    return bin_ids, num_bins


def _find(parent: list, i: int) -> int:
    """Union-find root with path halving; ``parent[i] == i`` marks a live slot, -1 the sentinel."""
    while i >= 0 and parent[i] != i:
        parent[i] = parent[parent[i]] if parent[i] >= 0 else -1
        i = parent[i]
    return i


def modified_first_fit_decreasing(lengths: np.ndarray, capacity: int) -> tuple[np.ndarray, np.ndarray, int]:
    """Johnson & Garey's modified first fit decreasing (MFFD), with grouped FFD for the final phase.

    Item classes by size relative to the capacity C: large (> C/2), medium (C/3, C/2], small
    (C/6, C/3], and the rest (<= C/6).

    1. Every large item opens its own bin, largest first.
    2. Forward over the large-item bins (their residuals grow), each takes the largest medium item that fits.
    3. Backward over the large-item bins, where the two smallest small items fit together: take the
       smallest, then the largest remaining small item that fits beside it.
    4. Everything left is placed by first fit decreasing over all bins, large-item bins first.

    Returns ``(items_in_placement_order, bin_ids, num_bins)``.
    """
    order = stable_descending_order(lengths)
    s = lengths[order]
    num_large = int(np.count_nonzero(2 * s > capacity))
    num_medium = int(np.count_nonzero(3 * s > capacity)) - num_large
    num_small = int(np.count_nonzero(6 * s > capacity)) - num_large - num_medium
    residual = capacity - s[:num_large]
    placed_items = [order[:num_large]]
    placed_bins = [np.arange(num_large, dtype=np.int64)]
    taken = np.zeros(s.size, dtype=bool)
    taken[:num_large] = True

    # Phase 2. Medium items ascending (the reversed descending range); a stack of those that fit the
    # current bin: as residuals only grow, the top of the stack is always the largest one that fits.
    if num_large and num_medium:
        medium_pos = np.arange(num_large + num_medium - 1, num_large - 1, -1)
        medium_val = s[medium_pos].tolist()
        res_list = residual.tolist()
        stack: list[int] = []
        next_medium = 0
        bins_2, pos_2 = [], []
        for b, r in enumerate(res_list):
            while next_medium < num_medium and medium_val[next_medium] <= r:
                stack.append(next_medium)
                next_medium += 1
            if stack:
                q = stack.pop()
                bins_2.append(b)
                pos_2.append(int(medium_pos[q]))
                res_list[b] = r - medium_val[q]
            elif next_medium == num_medium:
                break
        if pos_2:
            residual = np.asarray(res_list, dtype=np.int64)
            pos_arr = np.asarray(pos_2, dtype=np.int64)
            taken[pos_arr] = True
            placed_items.append(order[pos_arr])
            placed_bins.append(np.asarray(bins_2, dtype=np.int64))

    # Phase 3. Small items ascending with two union-finds: predecessor and successor among live items.
    if num_large and num_small >= 2:
        first = num_large + num_medium
        small_pos = np.arange(first + num_small - 1, first - 1, -1)
        small_val_arr = s[small_pos]
        small_val = small_val_arr.tolist()
        pred = list(range(num_small))
        succ = list(range(num_small + 1))  # slot num_small is the "none" sentinel on the right
        alive = num_small
        lo = 0
        bins_3, pos_3 = [], []
        res_list = residual.tolist()
        threshold = small_val[0] + small_val[1]
        for b in np.flatnonzero(residual >= threshold)[::-1].tolist():
            r = res_list[b]
            if alive < 2:
                break
            second = _find_right(succ, lo + 1)
            if small_val[lo] + small_val[second] > r:
                continue
            first_val = small_val[lo]
            pred[lo] = lo - 1
            succ[lo] = lo + 1
            j = int(np.searchsorted(small_val_arr, r - first_val, side="right")) - 1
            j = _find(pred, j)  # exists: `second` fits
            pred[j] = j - 1
            succ[j] = j + 1
            bins_3 += [b, b]
            pos_3 += [int(small_pos[lo]), int(small_pos[j])]
            res_list[b] = r - first_val - small_val[j]
            alive -= 2
            lo = _find_right(succ, lo + 1)
        if pos_3:
            residual = np.asarray(res_list, dtype=np.int64)
            pos_arr = np.asarray(pos_3, dtype=np.int64)
            taken[pos_arr] = True
            placed_items.append(order[pos_arr])
            placed_bins.append(np.asarray(bins_3, dtype=np.int64))

    # Phase 4. Grouped FFD of the rest over the existing bins.
    rest = np.flatnonzero(~taken)
    bin_ids, all_residual = decreasing_fit(s[rest], capacity, best_fit=False, initial_residuals=residual)
    placed_items.append(order[rest])
    placed_bins.append(bin_ids)
    return np.concatenate(placed_items), np.concatenate(placed_bins), int(all_residual.size)


def _find_right(parent: list, i: int) -> int:
    """Successor union-find: the smallest live slot >= i (``len(parent) - 1`` is the sentinel)."""
    root = i
    while parent[root] != root:
        root = parent[root]
    while parent[i] != root:
        parent[i], i = root, parent[i]
    return root
