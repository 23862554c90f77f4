"""Dynamic context parallelism's equal counts: after scheduling, every rank of the DP x CP domain must run
the same number of micro-batches (Megatron's schedule runs one count per step). `equalize_counts` gets
there by splitting rows between their units, moving rows, running rows on twice their ranks, or merging
rows, while the counts differ (numpy only; `planning.dynamic_cp` calls it and retries with larger
minimum CP sizes when a batch is too small for it).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from .dynamic_cp_rows import CPRow, DynamicCPConfig, make_row, row_units, unit_cost

__all__ = ["equalize_counts"]


def equalize_counts(
    rows: list[CPRow], lengths: np.ndarray, config: DynamicCPConfig, unit_of: np.ndarray
) -> list[CPRow]:
    """Give every rank the same number of micro-batches. First up to the most any rank has: split a row
    (between units) on the ranks with the fewest (a CP-1 row of the rank first: only its count grows),
    else give such a rank half of another rank's CP-1 row, else (counts two or more apart) move a row
    there from ranks with the most, else run a row on twice its ranks (its CP size doubled: the new ranks
    lag), else split a row on ranks with the most and give its second half to a group with the fewest.
    When no rank can grow, down to the fewest: merge two rows on the same ranks with room for both.
    Every rank runs its rows in the list's order, so any change to the list keeps one global order."""
    grow = True
    while True:
        counts = _counts(rows, config.num_ranks)
        if counts.min() == counts.max():
            return rows
        if grow:
            position = _row_to_split(rows, counts, unit_of)
            if position is not None:
                rows[position : position + 1] = list(_halves(rows[position], lengths, config, unit_of))
                continue
            low = _lightest(rows, np.flatnonzero(counts == counts.min()), config.num_ranks)
            donor = _splittable_single(rows, unit_of)
            if donor is not None:
                first, second = _halves(rows[donor], lengths, config, unit_of)
                rows[donor : donor + 1] = [first, replace(second, first_rank=low)]
                continue
            if counts.max() - counts.min() >= 2 and _move_row(rows, counts, low):
                continue
            if _promote(rows, counts, lengths, config):
                continue
            if _split_across(rows, counts, lengths, config, unit_of):
                continue
            grow = False
        if not _merge_rows(rows, counts, lengths, config):
            raise ValueError(
                f"cannot give the {config.num_ranks} ranks of dynamic CP the same number of micro-batches "
                f"(they have {counts.min()} to {counts.max()}) without splitting a sample or a group: put more "
                "samples in the global batch, or lower max_tokens_per_rank."
            )


def _counts(rows: list[CPRow], num_ranks: int) -> np.ndarray:
    counts = np.zeros(num_ranks, dtype=np.int64)
    for row in rows:
        counts[row.first_rank : row.first_rank + row.cp_size] += 1
    return counts


def _lightest(rows: list[CPRow], ranks: np.ndarray, num_ranks: int) -> int:
    """Of ``ranks``, the one whose rows cost least (the first on a tie)."""
    busy = np.zeros(num_ranks)
    for row in rows:
        busy[row.first_rank : row.first_rank + row.cp_size] += row.cost
    return int(ranks[np.argmin(busy[ranks])])


def _splittable_single(rows: list[CPRow], unit_of: np.ndarray) -> int | None:
    """The most expensive CP-1 row of at least two units (its second half can run on another rank)."""
    singles = [p for p, row in enumerate(rows)
               if row.cp_size == 1 and len(row_units(row, unit_of)) > 1]  # fmt: skip
    return max(singles, key=lambda p: (rows[p].cost, -p)) if singles else None


def _split_across(rows: list[CPRow], counts: np.ndarray, lengths: np.ndarray, config: DynamicCPConfig,
                  unit_of: np.ndarray) -> bool:  # fmt: skip
    """Split a row of at least two units whose ranks have the most micro-batches, its second half to an
    aligned group of its size whose ranks all have the fewest (BSHD rows are filled full, so two units of
    a small batch can share the row another group needs): the most expensive such row. False if none."""
    low = counts.min()
    best = None
    for position, row in enumerate(rows):
        k = row.cp_size
        if counts[row.first_rank : row.first_rank + k].min() < counts.max():
            continue
        if len(row_units(row, unit_of)) < 2:
            continue
        empty = [g for g in range(0, config.num_ranks, k) if counts[g : g + k].max() == low]
        if empty and (best is None or row.cost > best[0]):
            best = (row.cost, position, empty[0])
    if best is None:
        return False
    _, position, target = best
    first, second = _halves(rows[position], lengths, config, unit_of)
    rows[position : position + 1] = [first, replace(second, first_rank=target)]
    return True


def _move_row(rows: list[CPRow], counts: np.ndarray, low: int) -> bool:
    """Move the cheapest row whose ranks all have the most micro-batches to the aligned group of its size
    holding rank ``low`` when all of that group's ranks have the fewest (a CP-1 row: to ``low``)."""
    high = counts.max()
    best = None
    for position, row in enumerate(rows):
        k = row.cp_size
        target = low // k * k
        if counts[row.first_rank : row.first_rank + k].min() < high or counts[target : target + k].max() > counts.min():
            continue
        if best is None or (row.cost, position) < best[0]:
            best = ((row.cost, position), position, target)
    if best is None:
        return False
    _, position, target = best
    rows[position] = replace(rows[position], first_rank=target)
    return True


def _promote(rows: list[CPRow], counts: np.ndarray, lengths: np.ndarray, config: DynamicCPConfig) -> bool:
    """Run a row of CP size ``k < cp`` on the aligned group of ``2k`` ranks that holds it, when the ranks it
    gains all have fewer micro-batches than the most: the cheapest such row whose new ranks include one
    with the fewest. False when there is none."""
    high, low = counts.max(), counts.min()
    best = None
    for position, row in enumerate(rows):
        k = row.cp_size
        if 2 * k > config.layout.cp:
            continue
        first = row.first_rank // (2 * k) * (2 * k)
        gained = [r for r in range(first, first + 2 * k) if r not in row.ranks]
        if counts[gained].max() >= high:
            continue
        samples = list(row.sample_indices)  # padded for 2k, the row must still fit 2k ranks
        if config.row_tokens(config.padded(lengths[samples], 2 * k)) > config.capacity(2 * k):
            continue
        key = (counts[gained].min() > low, row.cost, position)
        if best is None or key < best[0]:
            best = (key, position, first)
    if best is None:
        return False
    _, position, first = best
    rows[position] = make_row(list(rows[position].sample_indices), 2 * rows[position].cp_size, first, lengths, config)
    return True


def _merge_rows(rows: list[CPRow], counts: np.ndarray, lengths: np.ndarray, config: DynamicCPConfig) -> bool:
    """Merge the two cheapest rows on the same ranks, all of them above the fewest micro-batches, whose
    samples fit one row; False when no two do."""
    low = counts.min()
    by_ranks: dict = {}
    for position, row in enumerate(rows):
        if counts[row.first_rank : row.first_rank + row.cp_size].min() > low:
            by_ranks.setdefault((row.cp_size, row.first_rank), []).append(position)
    best = None
    for (k, _), positions in by_ranks.items():
        ordered = sorted(positions, key=lambda p: (rows[p].cost, p))
        for a_index, a in enumerate(ordered):
            for b in ordered[a_index + 1 :]:
                samples = sorted(rows[a].sample_indices + rows[b].sample_indices)
                if config.row_tokens(config.padded(lengths[samples], k)) <= config.capacity(k):
                    key = rows[a].cost + rows[b].cost
                    if best is None or key < best[0]:
                        best = (key, a, b, samples)
                    break
    if best is None:
        return False
    _, a, b, samples = best
    rows[a] = make_row(samples, rows[a].cp_size, rows[a].first_rank, lengths, config)
    del rows[b]
    return True


def _row_to_split(rows: list[CPRow], counts: np.ndarray, unit_of: np.ndarray) -> int | None:
    """The row to split: on a rank with the fewest micro-batches, of at least two units, whose ranks all
    have fewer than the most; the smallest CP size first, then the largest cost."""
    low, high = counts.min(), counts.max()
    lagging = set(np.flatnonzero(counts == low).tolist())
    best = None
    for position, row in enumerate(rows):
        if len(row_units(row, unit_of)) < 2 or not lagging.intersection(row.ranks):
            continue
        if counts[row.first_rank : row.first_rank + row.cp_size].max() >= high:
            continue
        key = (row.cp_size, -row.cost)
        if best is None or key < best[0]:
            best = (key, position)
    return None if best is None else best[1]


def _halves(row: CPRow, lengths: np.ndarray, config: DynamicCPConfig, unit_of: np.ndarray) -> tuple[CPRow, CPRow]:
    """The row's units in two rows of about equal cost (the most expensive first, each to the lighter half)."""
    units = row_units(row, unit_of)
    _, cost = unit_cost(units, row.cp_size, lengths, config)
    halves, loads = ([], []), [0.0, 0.0]
    for j in sorted(range(len(units)), key=lambda j: (-cost[j], units[j][0])):
        side = 0 if loads[0] <= loads[1] else 1
        halves[side].extend(units[j])
        loads[side] += float(cost[j])
    return tuple(make_row(sorted(h), row.cp_size, row.first_rank, lengths, config) for h in halves)
