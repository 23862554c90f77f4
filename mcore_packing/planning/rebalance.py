"""Sequence-level rebalancing: move or swap single sequences (or whole groups) between the micro-batches of
different data-parallel ranks until the slowest rank's predicted cost is as close to the mean as the
token cap allows.

Assigning whole micro-batches to ranks (`balance.assign_balanced`) cannot fix imbalance when each rank
holds only a few micro-batches: on CHAMP with 8 ranks of 4-5 rows of 16384 tokens, one rank ends up with
the 20%-full row the equal-count rule forced, and the slowest rank carries ~1.07x the mean. Sequences are
small against a rank's share, so moving a few of them evens the ranks almost exactly.

Moves, each one lowering the larger of the two loads it touches (so the maximum never rises):
- move unit ``u`` from a row of the most-loaded rank ``H`` into the fullest row of rank ``R`` that still
  has room for it (best fit), when ``H``'s row keeps at least one unit (row counts never change);
- swap ``u`` (on ``H``) with a cheaper ``v`` (on ``R``) when both rows stay within the token cap.
The best move over all other ranks is the one whose transfer is closest to half the gap. Hard limits
never bend: the token cap per row, equal row counts per rank, groups never split. Deterministic (ties
by index). For large ranks, swaps consider at most ``candidates`` units per rank (spread over costs).
"""

from __future__ import annotations

import numpy as np

__all__ = ["rebalance_units"]


def rebalance_units(
    bins: list[list[int]],
    rank_of_bin: list[int],
    sizes: np.ndarray,
    costs: np.ndarray,
    capacity: int,
    *,
    max_moves: int = 2000,
    tolerance: float = 1e-3,
    candidates: int = 256,
    partners: int = 3,
) -> list[list[int]]:
    """New unit lists per bin (same bins, same ranks) with rank costs evened out; ``bins`` holds unit
    indices, ``sizes``/``costs`` are per unit (padded tokens, predicted cost). Stops when the slowest rank
    is within ``tolerance`` of the mean; each move looks at the ``partners`` least-loaded ranks."""
    state = _State(bins, rank_of_bin, sizes, costs, capacity)
    for _ in range(max_moves):
        hi = int(np.argmax(state.loads))
        if state.loads[hi] <= state.loads.mean() * (1 + tolerance):
            break
        move = state.best_move(hi, candidates, partners)
        if move is None:
            break
        state.apply(move)
    return state.bins


class _State:
    def __init__(self, bins, rank_of_bin, sizes, costs, capacity):
        self.bins = [list(b) for b in bins]
        self.rank_of_bin = np.asarray(rank_of_bin, dtype=np.int64)
        self.sizes = np.asarray(sizes, dtype=np.int64)
        self.costs = np.asarray(costs, dtype=np.float64)
        self.capacity = capacity
        self.num_ranks = int(self.rank_of_bin.max()) + 1
        self.bin_of_unit = np.empty(self.sizes.size, dtype=np.int64)
        for b, units in enumerate(self.bins):
            self.bin_of_unit[units] = b
        self.used = np.array([self.sizes[b].sum() for b in self.bins], dtype=np.int64)
        self.loads = np.zeros(self.num_ranks)
        np.add.at(self.loads, self.rank_of_bin, [self.costs[b].sum() for b in self.bins])

    def _units_of_rank(self, rank: int) -> np.ndarray:
        return np.flatnonzero(self.rank_of_bin[self.bin_of_unit] == rank)

    def best_move(self, hi: int, candidates: int, partners: int):
        """(new pair maximum, kind, u, v or target bin) of the best improving move off rank ``hi``."""
        mine = self._units_of_rank(hi)
        counts = np.bincount(self.bin_of_unit, minlength=len(self.bins))
        movable = mine[counts[self.bin_of_unit[mine]] > 1]
        best = None
        for r in np.argsort(self.loads, kind="stable")[:partners].tolist():
            if r == hi or self.loads[r] >= self.loads[hi]:
                continue
            for option in (self._best_shift(hi, r, movable), self._best_swap(hi, r, mine, candidates)):
                if option is not None and (best is None or option[0] < best[0]):
                    best = option
        if best is None or best[0] >= self.loads[hi] * (1 - 1e-12):
            return None
        return best

    def _pair_max(self, hi: int, r: int, transfer: np.ndarray) -> np.ndarray:
        return np.maximum(self.loads[hi] - transfer, self.loads[r] + transfer)

    def _best_shift(self, hi: int, r: int, movable: np.ndarray):
        if movable.size == 0:
            return None
        target_bins = np.flatnonzero(self.rank_of_bin == r)
        room = self.capacity - self.used[target_bins]
        fits = room[None, :] >= self.sizes[movable][:, None]
        if not fits.any():
            return None
        score = self._pair_max(hi, r, self.costs[movable])
        score = np.where(fits.any(axis=1), score, np.inf)
        k = int(np.argmin(score))
        # Best fit: the fullest row of r that takes it.
        choice = target_bins[np.flatnonzero(fits[k])[np.argmin(room[fits[k]])]]
        return float(score[k]), "shift", int(movable[k]), int(choice)

    def _best_swap(self, hi: int, r: int, mine: np.ndarray, candidates: int):
        theirs = self._units_of_rank(r)
        if mine.size == 0 or theirs.size == 0:
            return None
        mine, theirs = _spread(mine, self.costs, candidates), _spread(theirs, self.costs, candidates)
        transfer = self.costs[mine][:, None] - self.costs[theirs][None, :]
        room_mine = (self.capacity - self.used[self.bin_of_unit[mine]] + self.sizes[mine])[:, None]
        room_theirs = (self.capacity - self.used[self.bin_of_unit[theirs]] + self.sizes[theirs])[None, :]
        ok = (transfer > 0) & (room_mine >= self.sizes[theirs][None, :]) & (room_theirs >= self.sizes[mine][:, None])
        if not ok.any():
            return None
        score = np.where(ok, self._pair_max(hi, r, transfer), np.inf)
        a, b = np.unravel_index(int(np.argmin(score)), score.shape)
        return float(score[a, b]), "swap", int(mine[a]), int(theirs[b])

    def apply(self, move) -> None:
        _, kind, u, other = move
        if kind == "shift":
            self._relocate(u, other)
        else:
            bu, bv = int(self.bin_of_unit[u]), int(self.bin_of_unit[other])
            self._relocate(u, bv)
            self._relocate(other, bu)

    def _relocate(self, unit: int, target: int) -> None:
        source = int(self.bin_of_unit[unit])
        self.bins[source].remove(unit)
        self.bins[target].append(unit)
        self.bin_of_unit[unit] = target
        self.used[source] -= self.sizes[unit]
        self.used[target] += self.sizes[unit]
        self.loads[self.rank_of_bin[source]] -= self.costs[unit]
        self.loads[self.rank_of_bin[target]] += self.costs[unit]


def _spread(units: np.ndarray, costs: np.ndarray, limit: int) -> np.ndarray:
    """At most ``limit`` units, evenly spread over the cost order (all of them when few)."""
    if units.size <= limit:
        return units
    ordered = units[np.argsort(costs[units], kind="stable")]
    return ordered[np.linspace(0, ordered.size - 1, limit).round().astype(np.int64)]
