"""Dynamic context parallelism: every sequence gets the CP size it needs (numpy only).

Static CP cuts every sequence, even a 200-token one, into ``2 * cp`` chunks over ``cp`` ranks and pays
the K/V exchange for it. Here, over the ``dp * cp`` ranks of a step (the DP x CP domain, indexed as
Megatron's ``dp_cp`` group orders its ranks), a sequence gets the smallest power-of-two size ``k``
(``1 <= k <= cp``) whose padded length (a multiple of ``2k`` for ``k > 1``) fits a row of ``k``
ranks: ``k * max_tokens_per_rank`` tokens, rounded down to the row multiple. Sequences of one size go
into such rows, and each row runs on an aligned group of ``k`` ranks (``first_rank`` a multiple of
``k``), cut into ``2k`` chunks per sequence as static CP does.

Rows are packed THD rows (``mode="packing"``), or with dynamic batching (``mode="dynamic"``) padded BSHD
micro-batches: ``n`` sequences of one CP size padded to the row's longest (a multiple of the BSHD row
multiple at ``k``), ``n`` times that width within the row's ``k * max_tokens_per_rank``.

    config = DynamicCPConfig(max_tokens_per_rank=4096, layout=ParallelLayout(cp=4, dp=2))
    plan = plan_dynamic_cp(lengths, config)          # the same on every rank, no communication
    plan.for_rank(r)                                 # rank r's rows, in execution order
    plan.cp_size_counts()                            # {1: 412, 2: 31, 4: 5}: sequences per CP size

`planning.plan_step` returns this plan when its `StepPlanConfig` has ``dynamic_cp=True`` (the budget is
the config's ``train_mb_tokens``, or ``logprob_mb_tokens`` for a forward-only pass), so a trainer plans
static and dynamic CP through one call. ``groups`` (DPO pairs, GRPO responses to one prompt) keep their
samples in one row: a group is one unit, and all its samples get the CP size the group's total needs.

Scheduling (list scheduling with synchronisation, one unit at a time): the largest CP size first, then
the most expensive unit, each to the aligned group of ``k`` ranks that is free soonest (a row starts
when all its ranks are free: its collectives join them), into the first of that group's rows with room
or a new one; the CP-1 units come last and even out the ranks, so the slowest rank ends within about
one sequence of the others. Every rank runs its rows in the order of one list (size by size, group by
group), so two ranks that share rows meet them in the same order and nothing can deadlock. Then every
rank gets the same number of micro-batches (`equalize_counts`: rows split between units, moved, run on twice
their ranks, or merged); a batch too small for that is planned again with no unit below 2, 4, ... ranks,
down to static CP (every unit at ``cp``); on 400 random small batches (the tests) none was refused that
static CP could give its DP ranks equal counts.
A row's cost on each of its ranks is `CostModel`'s per-rank attention-aware cost at CP ``k`` plus the
CP exchange (`CostModel.cp_exchange`: the K/V tokens each rank receives and the exchange steps, zero at
``k = 1``). The predicted step time is the slowest rank's finish in that simulation.

Pipeline parallelism is refused: the ranks of a row meet it at different positions of their lists (a
rank with more CP-1 rows before it gets there later), which is fine at pp=1, where a rank waits only for
the row's other ranks; under a pipeline schedule that wait also holds up the neighbouring stages, whose
own rows wait on other ranks, and the cycle can deadlock. Rows aligned in waves (every rank's m-th
micro-batch part of one partition of the ranks) would lift it; they are not built.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..packing.validation import as_lengths
from .dynamic_cp_equalize import equalize_counts
from .dynamic_cp_rows import CPRow, DynamicCPConfig, DynamicCPPlan, make_row, row_units, simulate_rows, unit_cost
from .layout import check_dynamic_cp_layout
from .micro_batch import group_members
from .step_config import DYNAMIC_CP_MODES

__all__ = ["DYNAMIC_CP_MODES", "CPRow", "DynamicCPConfig", "DynamicCPPlan", "check_dynamic_cp_layout",
           "plan_dynamic_cp", "simulate_rows"]  # fmt: skip


def plan_dynamic_cp(
    lengths, config: DynamicCPConfig, *, groups: Sequence | None = None, forward_only: bool = False
) -> DynamicCPPlan:
    """Plan one global batch under dynamic CP (see the module docstring). ``groups``: a group id per
    sample; a group's samples share one row."""
    lengths = as_lengths(lengths, np.iinfo(np.int64).max)
    if lengths.size == 0:
        raise ValueError("the global batch is empty; a step needs at least one sample.")
    units = _units(groups, lengths.size)
    sizes = config.unit_sizes(units, lengths, what="group" if groups is not None else "sample")
    unit_of = np.empty(lengths.size, dtype=np.int64)
    for u, members in enumerate(units):
        unit_of[members] = u
    for floor in config.sizes:  # a batch too small for equal counts: no unit below `floor` ranks, up to static CP
        try:
            rows = _schedule(units, np.maximum(sizes, floor), lengths, config, unit_of)
            break
        except ValueError:
            if floor == config.layout.cp:
                raise
    return DynamicCPPlan(config=config, lengths=tuple(lengths.tolist()), rows=tuple(rows), forward_only=forward_only,
                         groups=tuple(groups) if groups is not None else None)  # fmt: skip


def _schedule(units, sizes: np.ndarray, lengths: np.ndarray, config: DynamicCPConfig, unit_of: np.ndarray):
    """The units in rows of their sizes on the ranks (`_place`), then equal counts (`equalize_counts`)."""
    clock = np.zeros(config.num_ranks)
    rows: list[CPRow] = []
    for k in config.sizes[::-1]:  # the largest first: they join the most ranks, the small ones fill in after
        chosen = [units[u] for u in np.flatnonzero(sizes == k).tolist()]
        if chosen:
            rows += _place(chosen, k, lengths, config, clock)
    if config.mode == "dynamic":
        _even_out_singles(rows, lengths, config, unit_of)
    return equalize_counts(rows, lengths, config, unit_of)


def _even_out_singles(rows: list[CPRow], lengths: np.ndarray, config: DynamicCPConfig, unit_of: np.ndarray) -> None:
    """BSHD rows are filled with neighbouring lengths (the least padding), so a rank's work comes in whole
    rows; even it out: move one unit from a CP-1 row of the slowest rank into a CP-1 row of the fastest
    where it fits, or into a new row there (`equalize_counts` evens the counts afterwards), the move that lowers
    the slower of the two the most, while one does. CP-1 rows come last in the order (a new row is
    appended), so a move changes only those two ranks' finish."""
    num_ranks = config.num_ranks
    for _ in range(4 * num_ranks):
        finish = simulate_rows(rows, num_ranks)
        hi, lo = int(np.argmax(finish)), int(np.argmin(finish))
        best, best_value = None, finish[hi]
        sources = [p for p, row in enumerate(rows) if row.cp_size == 1 and row.first_rank == hi]
        targets = [p for p, row in enumerate(rows) if row.cp_size == 1 and row.first_rank == lo]
        for a in sources:
            units = row_units(rows[a], unit_of)
            if len(units) < 2:
                continue
            for unit in units:
                rest = [i for i in rows[a].sample_indices if i not in unit]
                shrunk = make_row(rest, 1, hi, lengths, config)
                for b in [*targets, None]:  # None: a new row on the fastest rank
                    grown = sorted((rows[b].sample_indices if b is not None else ()) + tuple(unit))
                    if config.row_tokens(config.padded(lengths[grown], 1)) > config.capacity(1):
                        continue
                    grown_row = make_row(grown, 1, lo, lengths, config)
                    before = rows[b].cost if b is not None else 0.0
                    value = max(finish[hi] - rows[a].cost + shrunk.cost, finish[lo] - before + grown_row.cost)
                    if value < best_value - 1e-9 * finish[hi]:
                        best, best_value = (a, shrunk, b, grown_row), value
        if best is None:
            return
        a, shrunk, b, grown_row = best
        rows[a] = shrunk
        if b is None:
            rows.append(grown_row)
        else:
            rows[b] = grown_row


def _units(groups, count: int) -> list[list[int]]:
    """Samples grouped by id (`group_members`); each sample alone without groups."""
    return [[i] for i in range(count)] if groups is None else group_members(groups, count)


def _place(units: list[list[int]], k: int, lengths: np.ndarray, config: DynamicCPConfig, clock: np.ndarray):
    """The size-``k`` units, most expensive first, each to the aligned group of ``k`` ranks that is free
    soonest (the least idle on a tie), into the first of its rows with room or a new row; ``clock`` (each
    rank's finish) moves on. BSHD rows (dynamic batching): the widest unit first, each row filled with
    the next units while they fit (neighbouring lengths: the least padding), a new row on the group free
    soonest; `_even_out_singles` then evens out the ranks. Returns the rows, group by group (groups of
    one size share no rank)."""
    model, capacity = config.model(), config.capacity(k)
    padded, cost = unit_cost(units, k, lengths, config)
    opening = model.per_microbatch + model.cp_exchange(0, k)  # what a new row adds on each of its ranks
    groups = clock.reshape(-1, k)
    ready, idle = groups.max(axis=1), (groups.max(axis=1)[:, None] - groups).sum(axis=1)
    rows: list[list[list]] = [[] for _ in ready]  # per group: [units, their padded lengths]
    first = np.array([u[0] for u in units])
    bshd = config.mode == "dynamic"
    order = np.lexsort((first, -cost, -np.array([p.max() for p in padded]) if bshd else -cost))
    g, row = 0, None
    for j in order.tolist():
        fits = row is not None and config.row_tokens(row[1] + padded[j].tolist()) <= capacity
        if bshd and fits:
            # BSHD: the widest first, each row filled with the next ones (the least padding), then a new
            # row on the group free soonest
            ready[g] += cost[j]
            row[0].append(j)
            row[1] += padded[j].tolist()
            continue
        g = int(np.lexsort((np.arange(ready.size), idle, ready))[0])
        room = (r for r in rows[g] if config.row_tokens(r[1] + padded[j].tolist()) <= capacity)
        row = None if bshd else next(room, None)
        if row is None:
            row = [[], []]
            rows[g].append(row)
            ready[g] += opening
        row[0].append(j)
        row[1] += padded[j].tolist()
        ready[g] += cost[j]
        idle[g] = 0.0
    out = []
    for g, group_rows in enumerate(rows):
        if group_rows:
            built = [make_row(sorted(i for j in r[0] for i in units[j]), k, g * k, lengths, config)
                     for r in group_rows]  # fmt: skip
            ranks = slice(g * k, (g + 1) * k)
            clock[ranks] = clock[ranks].max() + sum(row.cost for row in built)
            out += built
    return out
