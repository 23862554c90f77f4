"""Balancing micro-batches across data-parallel ranks by cost, and ordering them on a rank.

The slowest data-parallel rank sets the step time, and tokens are not work: attention grows with the
square of each sequence's length. This module works on per-micro-batch costs (`cost_model.CostModel`), never
on their contents, so the hard token cap of every micro-batch is untouched: balancing only decides
which rank runs which micro-batch.

- `assign_balanced`: every rank gets exactly ``len(costs) / num_ranks`` micro-batches. Longest
  processing time first (heaviest micro-batch to the least-loaded rank that still needs one), then
  pairwise swaps between the most-loaded rank and each other rank while a swap lowers the maximum; the
  round-robin assignment refined the same way is the fallback, so the result is never worse than it.
- `assign_round_robin`: micro-batch ``i`` to rank ``i % num_ranks`` (what NeMo-RL does), for comparison.
- `order_microbatches`: ``packer`` (as planned), ``largest_first`` (the caching allocator reuses the
  biggest blocks; peak memory is reached at once), ``bubble`` (smallest micro-batches at both ends of the
  step, largest in the middle: pipeline warm-up and cool-down, where stages idle, run the cheapest work),
  ``pipeline`` (the order with the smallest simulated 1F1B step time, `pipeline.best_pipeline_order`),
  ``auto`` (``pipeline`` under PP, else ``packer``).
"""

from __future__ import annotations

import heapq

import numpy as np

from .pipeline import best_pipeline_order

__all__ = [
    "BALANCES",
    "ORDERS",
    "assign_balanced",
    "assign_round_robin",
    "max_over_mean",
    "order_microbatches",
]

ORDERS = ("auto", "packer", "largest_first", "bubble", "pipeline")
"""Micro-batch orders on a rank (``microbatch_order``); ``auto`` is ``pipeline`` with PP > 1, else ``packer``."""
BALANCES = ("cost", "tokens", "round_robin")
"""How micro-batches go to data-parallel ranks (``balance``)."""


def max_over_mean(loads) -> float:
    loads = np.asarray(loads, dtype=np.float64)
    return float(loads.max() / loads.mean()) if loads.size and loads.mean() > 0 else 1.0


def assign_round_robin(num_items: int, num_ranks: int) -> list[list[int]]:
    return [list(range(r, num_items, num_ranks)) for r in range(num_ranks)]


def assign_balanced(costs, num_ranks: int, *, max_rounds: int = 1000) -> list[list[int]]:
    """Indices of ``costs`` per rank, equal counts, minimizing the largest rank sum.

    Longest processing time first, then pairwise swaps while the maximum drops. The same swaps also
    refine the round-robin assignment, and the better of the two is kept, so the result is never worse
    than round-robin (LPT under an equal-count rule can be, rarely).
    """
    costs = np.asarray(costs, dtype=np.float64)
    if costs.size % num_ranks:
        raise ValueError(f"{costs.size} micro-batches cannot be split equally over {num_ranks} ranks.")
    candidates = [_lpt(costs, num_ranks), assign_round_robin(costs.size, num_ranks)]
    refined = [_refine_by_swaps(costs, ranks, max_rounds) for ranks in candidates]
    best = min(refined, key=lambda ranks: max(costs[r].sum() for r in ranks))
    return [sorted(rank) for rank in best]


def _lpt(costs: np.ndarray, num_ranks: int) -> list[list[int]]:
    """Heaviest item to the least-loaded rank that still needs one (equal counts)."""
    per_rank = costs.size // num_ranks
    ranks: list[list[int]] = [[] for _ in range(num_ranks)]
    heap = [(0.0, r) for r in range(num_ranks)]
    for i in np.argsort(-costs, kind="stable").tolist():
        load, r = heapq.heappop(heap)
        ranks[r].append(i)
        if len(ranks[r]) < per_rank:
            heapq.heappush(heap, (load + costs[i], r))
    return ranks


def _refine_by_swaps(
    costs: np.ndarray, ranks: list[list[int]], max_rounds: int, candidates: int = 128
) -> list[list[int]]:
    """Swap one item of the most-loaded rank with one of another rank while the larger of the pair drops.
    Ranks with many items offer ``candidates`` of them per round, spread over their cost order."""
    ranks = [list(r) for r in ranks]
    loads = np.array([costs[r].sum() for r in ranks])
    for _ in range(max_rounds):
        hi = int(np.argmax(loads))
        best = None  # (new_max_of_pair, rank, position_in_hi, position_in_other)
        mine_pos = _spread_positions(costs[ranks[hi]], candidates)
        mine = costs[ranks[hi]][mine_pos]
        for r in range(len(ranks)):
            if r == hi:
                continue
            theirs_pos = _spread_positions(costs[ranks[r]], candidates)
            # Swapping a (from hi) with b (from r) moves d = c_a - c_b; best when d is close to gap / 2.
            diff = mine[:, None] - costs[ranks[r]][theirs_pos][None, :]
            useful = (diff > 0) & (diff < loads[hi] - loads[r])
            if not useful.any():
                continue
            pair_max = np.where(useful, np.maximum(loads[hi] - diff, loads[r] + diff), np.inf)
            a, b = np.unravel_index(int(np.argmin(pair_max)), pair_max.shape)
            if best is None or pair_max[a, b] < best[0]:
                best = (float(pair_max[a, b]), r, int(mine_pos[a]), int(theirs_pos[b]))
        if best is None or best[0] >= loads[hi] - 1e-12 * max(loads[hi], 1.0):
            break
        _, r, a, b = best
        ia, ib = ranks[hi][a], ranks[r][b]
        ranks[hi][a], ranks[r][b] = ib, ia
        loads[hi] += costs[ib] - costs[ia]
        loads[r] += costs[ia] - costs[ib]
    return ranks


def _spread_positions(costs: np.ndarray, limit: int) -> np.ndarray:
    """All positions, or ``limit`` of them evenly spread over the cost order."""
    if costs.size <= limit:
        return np.arange(costs.size)
    ordered = np.argsort(costs, kind="stable")
    return ordered[np.linspace(0, costs.size - 1, limit).round().astype(np.int64)]


def order_microbatches(costs, order: str, pp_size: int = 1, *, vpp: int = 1, group: int | None = None) -> list[int]:
    """Positions of a rank's micro-batches in execution order (``costs``: forward + backward per micro-batch);
    ``pipeline`` simulates the interleaved schedule when ``vpp > 1`` (``group``: its micro-batch group)."""
    if order not in ORDERS:
        raise ValueError(f"microbatch_order must be one of {', '.join(ORDERS)}; got {order!r}.")
    costs = np.asarray(costs, dtype=np.float64)
    if order == "auto":
        order = "pipeline" if pp_size > 1 else "packer"
    if order == "packer":
        return list(range(costs.size))
    if order == "pipeline":
        # forward a third, backward twice the forward
        return best_pipeline_order(costs / 3.0, max(pp_size, 1), vpp=vpp, group=group)
    descending = np.argsort(-costs, kind="stable").tolist()
    if order == "largest_first":
        return descending
    ascending = descending[::-1]
    return ascending[0::2] + ascending[1::2][::-1]  # small ... large ... small
