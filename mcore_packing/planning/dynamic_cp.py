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
rank gets the same number of micro-batches (`_equalize`: rows split between units, moved, run on twice
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
from dataclasses import dataclass, replace

import numpy as np

from ..packing.validation import as_lengths
from ..validators import require_positive_int
from .balance import max_over_mean
from .cost_model import CostModel
from .layout import ParallelLayout, check_dynamic_cp_layout
from .micro_batch import MicroBatchPlan, group_members, micro_batch_cost, plan_fingerprint
from .padding import PaddingRule, micro_batch_tokens
from .step_config import DYNAMIC_CP_MODES, StepPlanConfig

__all__ = ["DYNAMIC_CP_MODES", "CPRow", "DynamicCPConfig", "DynamicCPPlan", "check_dynamic_cp_layout",
           "plan_dynamic_cp", "simulate_rows"]  # fmt: skip

@dataclass(frozen=True, kw_only=True)
class DynamicCPConfig:
    """How a step's sequences get their CP sizes.

    Attributes:
        max_tokens_per_rank: tokens one rank holds of a row (after the CP split): the budget.
        layout: the run's `ParallelLayout`; ``cp`` is the largest CP size (a power of two), ``dp * cp``
            ranks share the step. ``pp`` must be 1.
        sequence_length_round: per-sequence alignment on top of CP's ``2k``.
        mode: ``"packing"`` (THD rows) or ``"dynamic"`` (dynamic batching: padded BSHD rows).
        fp8_alignment: FP8's alignment of each rank's share of a row (`PaddingRule`), 1 when off.
        cost_model: per-rank cost (None: tokens, no attention term, no exchange).
    """

    max_tokens_per_rank: int
    layout: ParallelLayout
    mode: str = "packing"
    sequence_length_round: int = 1
    fp8_alignment: int = 1
    cost_model: CostModel | None = None

    def __post_init__(self):
        require_positive_int("max_tokens_per_rank", self.max_tokens_per_rank)
        require_positive_int("sequence_length_round", self.sequence_length_round)
        require_positive_int("fp8_alignment", self.fp8_alignment)
        if self.mode not in DYNAMIC_CP_MODES:
            raise ValueError(
                f"dynamic CP plans packed THD rows (mode='packing') or dynamic batching's padded BSHD rows "
                f"(mode='dynamic'); got mode={self.mode!r}. Use one of {DYNAMIC_CP_MODES}, or static CP."
            )
        check_dynamic_cp_layout(self.layout)

    @classmethod
    def from_step_config(cls, config: StepPlanConfig, *, forward_only: bool = False) -> DynamicCPConfig:
        """The dynamic-CP settings of a `StepPlanConfig`: its budget per rank for the pass
        (``train_mb_tokens``, or ``logprob_mb_tokens`` when forward-only), layout, alignments, cost model."""
        return cls(max_tokens_per_rank=config.budget(forward_only)[1], layout=config.layout, mode=config.mode,
                   sequence_length_round=config.sequence_length_round, fp8_alignment=config.fp8_alignment,
                   cost_model=config.cost_model)  # fmt: skip

    @property
    def num_ranks(self) -> int:
        """The ranks of one step: DP x CP."""
        return self.layout.dp * self.layout.cp

    @property
    def sizes(self) -> tuple[int, ...]:
        """The CP sizes a sequence can get: 1, 2, 4, ..., cp."""
        return tuple(1 << i for i in range(self.layout.cp.bit_length()))

    def padding_rule(self, cp_size: int) -> PaddingRule:
        layout = self.layout
        return PaddingRule(cp_size=cp_size, tp_size=layout.tp, sequence_parallel=layout.sequence_parallel,
                           sequence_length_round=self.sequence_length_round,
                           fp8_alignment=self.fp8_alignment)  # fmt: skip

    def capacity(self, cp_size: int) -> int:
        """Tokens in one row of CP size ``cp_size``: ``cp_size * max_tokens_per_rank`` rounded down to the
        row multiple (so the row's rounded length never exceeds the budget)."""
        multiple = self.padding_rule(cp_size).total_multiple
        return cp_size * self.max_tokens_per_rank // multiple * multiple

    def model(self) -> CostModel:
        return self.cost_model or CostModel(linear=1.0, quadratic=0.0, unit="token")

    def unit_sizes(self, units: list[list[int]], lengths: np.ndarray, *, what: str = "group") -> np.ndarray:
        """Each unit's (a sample's, or a group's) CP size: the smallest whose row holds the unit's padded
        samples together; a unit that does not fit at ``cp`` is refused, naming it (``what``) and the fix."""
        out = np.zeros(len(units), dtype=np.int64)
        members = np.fromiter((i for u in units for i in u), dtype=np.int64)
        starts = np.cumsum([0, *(len(u) for u in units[:-1])])
        for k in self.sizes[::-1]:  # the smallest size that fits wins: write the large ones first
            padded = self.padded(lengths[members], k)
            if self.mode == "packing":  # a THD row holds the padded lengths end to end
                totals = np.add.reduceat(padded, starts)
            else:  # a BSHD micro-batch: every sample padded to the longest
                totals = np.maximum.reduceat(padded, starts) * np.diff([*starts, members.size])
            out[totals <= self.capacity(k)] = k
        if (out == 0).any():
            u = int(np.flatnonzero(out == 0)[0])
            cp = self.layout.cp
            tokens = self.row_tokens(self.padded(lengths[units[u]], cp))
            need = -(-tokens // cp)
            name = f"sample {units[u][0]} has {int(lengths[units[u][0]])} tokens" if what == "sample" else (
                f"the group of samples {units[u]} has {tokens} padded tokens")  # fmt: skip
            raise ValueError(
                f"{name}: more than cp={cp} ranks hold at max_tokens_per_rank={self.max_tokens_per_rank}. Raise "
                f"max_tokens_per_rank to at least {need}, raise cp, or split it upstream."
            )
        return out

    def padded(self, lengths, cp_size: int) -> np.ndarray:
        """``lengths`` padded at CP size ``cp_size`` (`PaddingRule.length_multiple` of the mode)."""
        m = self.padding_rule(cp_size).length_multiple(self.mode)
        return -(-np.asarray(lengths, dtype=np.int64) // m) * m

    def row_tokens(self, padded) -> int:
        """Tokens of one row holding ``padded`` (lengths from `padded`; `padding.micro_batch_tokens`). A THD
        row's capacity is a row multiple, so the sum fits exactly when the rounded row does."""
        return micro_batch_tokens(padded, self.mode)


@dataclass(frozen=True)
class CPRow:
    """One micro-batch of dynamic CP: a packed row of ``sample_indices`` (or with ``width``, dynamic
    batching's BSHD rows: one per sample, each padded to ``width``) on the ``cp_size`` ranks
    ``first_rank .. first_rank + cp_size - 1`` of the DP x CP domain; ``row_length`` padded tokens
    before the split; ``cost`` on each of its ranks."""

    sample_indices: tuple[int, ...]
    cp_size: int
    first_rank: int
    row_length: int
    real_tokens: int
    cost: float
    width: int = 0  # BSHD rows' padded width; 0: one packed THD row

    @property
    def ranks(self) -> range:
        return range(self.first_rank, self.first_rank + self.cp_size)

    @property
    def shape(self) -> tuple[int, int]:
        """``(1, row_length)`` for a THD row, ``(samples, width)`` for BSHD rows."""
        return (len(self.sample_indices), self.width) if self.width else (1, self.row_length)

    def as_micro_batch(self) -> MicroBatchPlan:
        """The row as a static plan's micro-batch (its shape, its cost on each of its ranks)."""
        return MicroBatchPlan(self.sample_indices, self.shape, self.real_tokens, self.cost)


@dataclass(frozen=True)
class DynamicCPPlan:
    """Rows in the one global execution order; every rank runs the rows that include it, in that order.
    ``groups`` (the plan's group id per sample, or None) and ``forward_only`` as in `StepPlan`."""

    config: DynamicCPConfig
    lengths: tuple[int, ...]
    rows: tuple[CPRow, ...]
    forward_only: bool = False
    groups: tuple | None = None

    def for_rank(self, rank: int) -> list[CPRow]:
        """Rank ``rank``'s rows (its place in the DP x CP domain), in execution order."""
        return [row for row in self.rows if rank in row.ranks]

    @property
    def num_ranks(self) -> int:
        return self.config.num_ranks

    @property
    def num_microbatches(self) -> int:
        """Micro-batches per rank (the same on every rank)."""
        return len(self.for_rank(0))

    @property
    def micro_batches(self) -> tuple[tuple[MicroBatchPlan, ...], ...]:
        """Each rank's rows as micro-batches (a row of CP size ``k`` appears on its ``k`` ranks), for what
        reads a `StepPlan`'s: the metrics' slowest rank, the step-time history."""
        return tuple(tuple(row.as_micro_batch() for row in self.for_rank(r)) for r in range(self.num_ranks))

    @property
    def row_capacity(self) -> int:
        """The largest row: ``cp`` ranks' worth."""
        return self.config.capacity(self.config.layout.cp)

    def cp_size_counts(self) -> dict[int, int]:
        """Sequences per CP size."""
        counts = {k: 0 for k in self.config.sizes}
        for row in self.rows:
            counts[row.cp_size] += len(row.sample_indices)
        return counts

    def rank_finish(self) -> np.ndarray:
        """Each rank's simulated finish time (`simulate_rows`)."""
        return simulate_rows(self.rows, self.num_ranks)

    @property
    def predicted_step_time(self) -> float:
        return float(self.rank_finish().max())

    def rank_costs(self) -> list[float]:
        """Each rank's busy cost: its rows' costs (waiting for a row's other ranks not counted)."""
        return [sum(row.cost for row in self.for_rank(r)) for r in range(self.num_ranks)]

    def stats(self) -> dict:
        """`StepPlan.stats`' keys (tokens per rank: a row's share on each of its ranks; the predicted step
        cost: the synchronised simulation's slowest finish) and the sequences per CP size."""
        real = sum(row.real_tokens for row in self.rows)
        padded = sum(row.row_length for row in self.rows)
        per_rank = np.zeros(self.num_ranks)
        for row in self.rows:
            per_rank[row.first_rank : row.first_rank + row.cp_size] += row.row_length / row.cp_size
        return {
            "rank_cost_max_over_mean": max_over_mean(self.rank_costs()),
            "predicted_step_cost": self.predicted_step_time,
            "num_microbatches_per_rank": self.num_microbatches,
            "real_tokens": real,
            "padded_tokens": padded,
            "utilization": real / padded if padded else 1.0,
            "rank_tokens_max_over_mean": max_over_mean(per_rank),
            "max_tokens_per_rank": max(row.row_length // row.cp_size for row in self.rows),
            "cp_sizes": self.cp_size_counts(),
        }

    def fingerprint(self) -> str:
        """A hash of the inputs and the plan; equal on every rank that planned the same step."""
        rows = [(row.sample_indices, row.cp_size, row.first_rank, row.row_length, row.width) for row in self.rows]
        return plan_fingerprint(self, rows=rows)

    @classmethod
    def chained(cls, plans: Sequence[DynamicCPPlan]) -> DynamicCPPlan:
        """Plans of consecutive optimizer steps over consecutive slices of one sample list, as one plan for
        reporting (a GRPO step's minibatches): rows one plan after the other, sample indices offset."""
        offsets = np.cumsum([0, *(len(p.lengths) for p in plans)]).tolist()
        rows = tuple(
            replace(row, sample_indices=tuple(i + offset for i in row.sample_indices))
            for p, offset in zip(plans, offsets, strict=False) for row in p.rows
        )  # fmt: skip
        lengths = tuple(n for p in plans for n in p.lengths)
        return cls(config=plans[0].config, lengths=lengths, rows=rows, forward_only=plans[0].forward_only)


def simulate_rows(rows, num_ranks: int) -> np.ndarray:
    """Finish time of every rank when rows run in the given order, each starting when all its ranks are free."""
    clock = np.zeros(num_ranks)
    for row in rows:
        ranks = slice(row.first_rank, row.first_rank + row.cp_size)
        clock[ranks] = clock[ranks].max() + row.cost
    return clock


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
    """The units in rows of their sizes on the ranks (`_place`), then equal counts (`_equalize`)."""
    clock = np.zeros(config.num_ranks)
    rows: list[CPRow] = []
    for k in config.sizes[::-1]:  # the largest first: they join the most ranks, the small ones fill in after
        chosen = [units[u] for u in np.flatnonzero(sizes == k).tolist()]
        if chosen:
            rows += _place(chosen, k, lengths, config, clock)
    if config.mode == "dynamic":
        _even_out_singles(rows, lengths, config, unit_of)
    return _equalize(rows, lengths, config, unit_of)


def _even_out_singles(rows: list[CPRow], lengths: np.ndarray, config: DynamicCPConfig, unit_of: np.ndarray) -> None:
    """BSHD rows are filled with neighbouring lengths (the least padding), so a rank's work comes in whole
    rows; even it out: move one unit from a CP-1 row of the slowest rank into a CP-1 row of the fastest
    where it fits, or into a new row there (`_equalize` evens the counts afterwards), the move that lowers
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
            units = _row_units(rows[a], unit_of)
            if len(units) < 2:
                continue
            for unit in units:
                rest = [i for i in rows[a].sample_indices if i not in unit]
                shrunk = _make_row(rest, 1, hi, lengths, config)
                for b in [*targets, None]:  # None: a new row on the fastest rank
                    grown = sorted((rows[b].sample_indices if b is not None else ()) + tuple(unit))
                    if config.row_tokens(config.padded(lengths[grown], 1)) > config.capacity(1):
                        continue
                    grown_row = _make_row(grown, 1, lo, lengths, config)
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


def _row_units(row: CPRow, unit_of: np.ndarray) -> list[list[int]]:
    """The row's samples by unit (a group's samples together), in the order units first appear."""
    members: dict = {}
    for i in row.sample_indices:
        members.setdefault(int(unit_of[i]), []).append(i)
    return list(members.values())


def _units(groups, count: int) -> list[list[int]]:
    """Samples grouped by id (`group_members`); each sample alone without groups."""
    return [[i] for i in range(count)] if groups is None else group_members(groups, count)


def _make_row(samples: list[int], cp_size: int, first_rank: int, lengths: np.ndarray, config: DynamicCPConfig):
    padded = config.padded(lengths[samples], cp_size)
    if config.mode == "packing":
        multiple = config.padding_rule(cp_size).total_multiple
        width, shape = 0, (1, int(-(-int(padded.sum()) // multiple) * multiple))
    else:
        width = int(padded.max())
        shape = (len(samples), width)
    cost = micro_batch_cost(padded, shape, config.mode, cp_size, config.model())  # a static micro-batch's cost
    return CPRow(tuple(samples), cp_size, first_rank, shape[0] * shape[1], int(lengths[samples].sum()), cost, width)


def _unit_cost(units: list[list[int]], k: int, lengths: np.ndarray, config: DynamicCPConfig):
    """Each unit's padded lengths at size ``k`` and its cost on each of ``k`` ranks (sequences and exchange;
    a BSHD unit as if its row were as wide as its own longest)."""
    model = config.model()
    per_token = model.cp_exchange(1, k) - model.cp_exchange(0, k)  # the exchange is linear in the row's tokens
    padded = [config.padded(lengths[u], k) for u in units]
    tokens = np.array([config.row_tokens(p) for p in padded], dtype=np.float64)
    if config.mode == "packing":
        cost = np.array([float(model.sequence_cost(p, k).sum()) for p in padded])
    else:
        cost = np.array([p.size * float(model.sequence_cost([p.max()], k)[0]) for p in padded])
    return padded, cost + per_token * tokens


def _place(units: list[list[int]], k: int, lengths: np.ndarray, config: DynamicCPConfig, clock: np.ndarray):
    """The size-``k`` units, most expensive first, each to the aligned group of ``k`` ranks that is free
    soonest (the least idle on a tie), into the first of its rows with room or a new row; ``clock`` (each
    rank's finish) moves on. BSHD rows (dynamic batching): the widest unit first, each row filled with
    the next units while they fit (neighbouring lengths: the least padding), a new row on the group free
    soonest; `_even_out_singles` then evens out the ranks. Returns the rows, group by group (groups of
    one size share no rank)."""
    model, capacity = config.model(), config.capacity(k)
    padded, cost = _unit_cost(units, k, lengths, config)
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
            built = [_make_row(sorted(i for j in r[0] for i in units[j]), k, g * k, lengths, config)
                     for r in group_rows]  # fmt: skip
            ranks = slice(g * k, (g + 1) * k)
            clock[ranks] = clock[ranks].max() + sum(row.cost for row in built)
            out += built
    return out


def _equalize(rows: list[CPRow], lengths: np.ndarray, config: DynamicCPConfig, unit_of: np.ndarray) -> list[CPRow]:
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
               if row.cp_size == 1 and len(_row_units(row, unit_of)) > 1]  # fmt: skip
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
        if len(_row_units(row, unit_of)) < 2:
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
    rows[position] = _make_row(list(rows[position].sample_indices), 2 * rows[position].cp_size, first, lengths, config)
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
    rows[a] = _make_row(samples, rows[a].cp_size, rows[a].first_rank, lengths, config)
    del rows[b]
    return True


def _row_to_split(rows: list[CPRow], counts: np.ndarray, unit_of: np.ndarray) -> int | None:
    """The row to split: on a rank with the fewest micro-batches, of at least two units, whose ranks all
    have fewer than the most; the smallest CP size first, then the largest cost."""
    low, high = counts.min(), counts.max()
    lagging = set(np.flatnonzero(counts == low).tolist())
    best = None
    for position, row in enumerate(rows):
        if len(_row_units(row, unit_of)) < 2 or not lagging.intersection(row.ranks):
            continue
        if counts[row.first_rank : row.first_rank + row.cp_size].max() >= high:
            continue
        key = (row.cp_size, -row.cost)
        if best is None or key < best[0]:
            best = (key, position)
    return None if best is None else best[1]


def _halves(row: CPRow, lengths: np.ndarray, config: DynamicCPConfig, unit_of: np.ndarray) -> tuple[CPRow, CPRow]:
    """The row's units in two rows of about equal cost (the most expensive first, each to the lighter half)."""
    units = _row_units(row, unit_of)
    _, cost = _unit_cost(units, row.cp_size, lengths, config)
    halves, loads = ([], []), [0.0, 0.0]
    for j in sorted(range(len(units)), key=lambda j: (-cost[j], units[j][0])):
        side = 0 if loads[0] <= loads[1] else 1
        halves[side].extend(units[j])
        loads[side] += float(cost[j])
    return tuple(_make_row(sorted(h), row.cp_size, row.first_rank, lengths, config) for h in halves)
