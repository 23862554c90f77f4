"""Packing under two limits: a token capacity and a cost budget per bin, so bins are even in work.

Tokens are not work: attention grows with the square of each sequence. `cost_capped_first_fit` places
items by decreasing cost into the first bin where both the tokens and the cost still fit, so no bin
holds far more attention work than the others even when their token counts match. The costs come from
the caller (`mcore_packing.planning.CostModel`); this module only sees numbers.
"""

from __future__ import annotations

import numpy as np

__all__ = ["cost_capped_first_fit"]


def cost_capped_first_fit(tokens, costs, token_capacity: int, cost_budget: float) -> list[list[int]]:
    """Bins of item indices with ``sum(tokens) <= token_capacity`` and ``sum(costs) <= cost_budget``.

    Items go in order of decreasing cost to the first bin where both fit (an equal bin count per rank is
    the caller's: `constraints.enforce_bin_count`). Raises ValueError when one item alone exceeds either
    limit.
    """
    tokens = np.asarray(tokens, dtype=np.int64)
    costs = np.asarray(costs, dtype=np.float64)
    if tokens.size and tokens.max() > token_capacity:
        i = int(np.argmax(tokens))
        raise ValueError(f"item {i} has {int(tokens[i])} tokens, over the token capacity {token_capacity}.")
    if costs.size and costs.max() > cost_budget:
        i = int(np.argmax(costs))
        raise ValueError(
            f"cost budget {cost_budget:.4g} is below the costliest single sequence (item {i}, cost {costs[i]:.4g}); "
            f"raise it to at least {costs[i]:.4g} or drop the cost budget."
        )
    room_tokens = np.empty(tokens.size, dtype=np.int64)
    room_cost = np.empty(tokens.size, dtype=np.float64)
    bins: list[list[int]] = []
    for i in np.argsort(-costs, kind="stable").tolist():
        nb = len(bins)
        fits = np.flatnonzero((room_tokens[:nb] >= tokens[i]) & (room_cost[:nb] >= costs[i] - 1e-9 * cost_budget))
        if fits.size:
            b = int(fits[0])
        else:
            b = nb
            bins.append([])
            room_tokens[b] = token_capacity
            room_cost[b] = cost_budget
        bins[b].append(i)
        room_tokens[b] -= tokens[i]
        room_cost[b] -= costs[i]
    return bins
