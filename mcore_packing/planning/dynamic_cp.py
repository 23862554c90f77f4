"""Dynamic context parallelism: every sequence gets the CP size it needs (numpy only).

Static CP cuts every sequence, even a 200-token one, into ``2 * cp`` chunks over ``cp`` ranks and pays
the K/V exchange for it. Here, over the ``dp * cp`` ranks of a step (the DP x CP domain, indexed as
Megatron's ``dp_cp`` group orders its ranks), a sequence gets the smallest power-of-two size ``k``
(``1 <= k <= cp``) whose padded length (a multiple of ``2k`` for ``k > 1``) over ``k`` fits
``max_tokens_per_rank``. Sequences of one size go into rows of ``k * max_tokens_per_rank`` tokens, and
each row runs on an aligned group of ``k`` ranks (``first_rank`` a multiple of ``k``), cut into ``2k``
chunks per sequence as static CP does.

    config = DynamicCPConfig(max_tokens_per_rank=4096, layout=ParallelLayout(cp=4, dp=2))
    plan = plan_dynamic_cp(lengths, config)          # the same on every rank, no communication
    plan.for_rank(r)                                 # rank r's rows, in execution order
    plan.cp_size_counts()                            # {1: 412, 2: 31, 4: 5}: sequences per CP size

Scheduling (list scheduling with synchronisation, one sequence at a time): the largest CP size first,
then the most expensive sequence, each to the aligned group of ``k`` ranks that is free soonest (a row
starts when all its ranks are free: its collectives join them), into the first of that group's rows
with room or a new one; the CP-1 sequences come last and even out the ranks, so the slowest rank ends
within about one sequence of the others. Every rank runs its rows in one global order (size by size,
group by group), so two ranks that share rows meet them in the same order and nothing can deadlock.
Then rows are split (between samples) on the ranks with the fewest micro-batches until every rank runs
the same number. A row's cost on each of
its ranks is `CostModel`'s per-rank attention-aware cost at CP ``k`` plus the CP exchange
(`CostModel.cp_exchange`: the K/V tokens each rank receives and the exchange steps, zero at ``k = 1``).
The predicted step time is the slowest rank's finish in that simulation.

Pipeline parallelism is refused: every pipeline stage would need the same sub-groups in step, which
Megatron's schedules do not offer.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..packing.validation import as_lengths
from ..validators import require_positive_int
from .cost_model import CostModel
from .layout import ParallelLayout
from .padding import PaddingRule
from .step_plan import micro_batch_cost

__all__ = ["CPRow", "DynamicCPConfig", "DynamicCPPlan", "plan_dynamic_cp", "simulate_rows"]


@dataclass(frozen=True, kw_only=True)
class DynamicCPConfig:
    """How a step's sequences get their CP sizes.

    Attributes:
        max_tokens_per_rank: tokens one rank holds of a row (after the CP split): the budget.
        layout: the run's `ParallelLayout`; ``cp`` is the largest CP size (a power of two), ``dp * cp``
            ranks share the step. ``pp`` must be 1.
        sequence_length_round: per-sequence alignment on top of CP's ``2k``.
        cost_model: per-rank cost (None: tokens, no attention term, no exchange).
    """

    max_tokens_per_rank: int
    layout: ParallelLayout
    sequence_length_round: int = 1
    cost_model: CostModel | None = None

    def __post_init__(self):
        require_positive_int("max_tokens_per_rank", self.max_tokens_per_rank)
        require_positive_int("sequence_length_round", self.sequence_length_round)
        layout = self.layout
        if layout.cp & (layout.cp - 1):
            raise ValueError(
                f"context_parallel.dynamic needs a power-of-two cp (sizes 1, 2, 4, ...); got cp={layout.cp}."
            )
        if layout.pp > 1:
            raise ValueError(
                f"context_parallel.dynamic runs at pp=1 (got pp={layout.pp}): every pipeline stage would have to "
                "switch CP sub-groups in step with the others, which Megatron's pipeline schedules do not do. Use "
                "pp=1, or static CP (context_parallel.dynamic=false)."
            )

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
                           sequence_length_round=self.sequence_length_round)  # fmt: skip

    def model(self) -> CostModel:
        return self.cost_model or CostModel(linear=1.0, quadratic=0.0, unit="token")

    def cp_sizes(self, lengths) -> np.ndarray:
        """Each sample's CP size: the smallest whose padded length over the size fits the budget; a sample
        that does not fit at ``cp`` is refused, naming it and the fix."""
        lengths = np.asarray(lengths, dtype=np.int64)
        out = np.zeros(lengths.size, dtype=np.int64)
        for k in self.sizes[::-1]:  # the smallest size that fits wins: write the large ones first
            fits = self.padded(lengths, k) <= k * self.max_tokens_per_rank
            out[fits] = k
        if (out == 0).any():
            i = int(np.flatnonzero(out == 0)[0])
            cp = self.layout.cp
            need = -(-int(self.padded(lengths[i : i + 1], cp)[0]) // cp)
            raise ValueError(
                f"sample {i} has {int(lengths[i])} tokens: more than cp={cp} ranks hold at max_tokens_per_rank="
                f"{self.max_tokens_per_rank}. Raise max_tokens_per_rank to at least {need}, raise cp, or split the "
                "sample upstream."
            )
        return out

    def padded(self, lengths, cp_size: int) -> np.ndarray:
        m = self.padding_rule(cp_size).sequence_multiple
        return -(-np.asarray(lengths, dtype=np.int64) // m) * m


@dataclass(frozen=True)
class CPRow:
    """One micro-batch of dynamic CP: a packed row of ``sample_indices`` on the ``cp_size`` ranks
    ``first_rank .. first_rank + cp_size - 1`` of the DP x CP domain; ``row_length`` padded tokens
    before the split; ``cost`` on each of its ranks."""

    sample_indices: tuple[int, ...]
    cp_size: int
    first_rank: int
    row_length: int
    real_tokens: int
    cost: float

    @property
    def ranks(self) -> range:
        return range(self.first_rank, self.first_rank + self.cp_size)


@dataclass(frozen=True)
class DynamicCPPlan:
    """Rows in the one global execution order; every rank runs the rows that include it, in that order."""

    config: DynamicCPConfig
    lengths: tuple[int, ...]
    rows: tuple[CPRow, ...]

    def for_rank(self, rank: int) -> list[CPRow]:
        return [row for row in self.rows if rank in row.ranks]

    @property
    def num_microbatches(self) -> int:
        """Micro-batches per rank (the same on every rank)."""
        return len(self.for_rank(0))

    def cp_size_counts(self) -> dict[int, int]:
        """Sequences per CP size."""
        counts = {k: 0 for k in self.config.sizes}
        for row in self.rows:
            counts[row.cp_size] += len(row.sample_indices)
        return counts

    def rank_finish(self) -> np.ndarray:
        """Each rank's simulated finish time (`simulate_rows`)."""
        return simulate_rows(self.rows, self.config.num_ranks)

    @property
    def predicted_step_time(self) -> float:
        return float(self.rank_finish().max())


def simulate_rows(rows, num_ranks: int) -> np.ndarray:
    """Finish time of every rank when rows run in the given order, each starting when all its ranks are free."""
    clock = np.zeros(num_ranks)
    for row in rows:
        ranks = slice(row.first_rank, row.first_rank + row.cp_size)
        clock[ranks] = clock[ranks].max() + row.cost
    return clock


def plan_dynamic_cp(lengths, config: DynamicCPConfig) -> DynamicCPPlan:
    """Plan one global batch under dynamic CP (see the module docstring)."""
    lengths = as_lengths(lengths, np.iinfo(np.int64).max)
    if lengths.size == 0:
        raise ValueError("the global batch is empty; a step needs at least one sample.")
    sizes = config.cp_sizes(lengths)
    clock = np.zeros(config.num_ranks)
    rows: list[CPRow] = []
    for k in config.sizes[::-1]:  # the largest first: they join the most ranks, the small ones fill in after
        members = np.flatnonzero(sizes == k)
        if members.size:
            rows += _place(members, k, lengths, config, clock)
    return DynamicCPPlan(config=config, lengths=tuple(lengths.tolist()), rows=tuple(_equalize(rows, lengths, config)))


def _make_row(samples: list[int], cp_size: int, first_rank: int, lengths: np.ndarray, config: DynamicCPConfig):
    padded = config.padded(lengths[samples], cp_size)
    rule = config.padding_rule(cp_size)
    multiple = rule.total_multiple
    row_length = int(-(-int(padded.sum()) // multiple) * multiple)
    cost = micro_batch_cost(padded, (1, row_length), "packing", cp_size, config.model())  # a static row's cost
    return CPRow(tuple(samples), cp_size, first_rank, row_length, int(lengths[samples].sum()), cost)


def _place(members: np.ndarray, k: int, lengths: np.ndarray, config: DynamicCPConfig, clock: np.ndarray):
    """The size-``k`` samples, most expensive first, each to the aligned group of ``k`` ranks that is free
    soonest (the least idle on a tie), into the first of its rows with room or a new row; ``clock`` (each
    rank's finish) moves on. Returns the rows, group by group (groups of one size share no rank)."""
    model, capacity = config.model(), k * config.max_tokens_per_rank
    padded = config.padded(lengths[members], k)
    per_token = model.cp_exchange(1, k) - model.cp_exchange(0, k)  # the exchange is linear in the row's tokens
    cost = model.sequence_cost(padded, k) + per_token * padded
    opening = model.per_microbatch + model.cp_exchange(0, k)  # what a new row adds on each of its ranks
    groups = clock.reshape(-1, k)
    ready, idle = groups.max(axis=1), (groups.max(axis=1)[:, None] - groups).sum(axis=1)
    rows: list[list[list]] = [[] for _ in ready]  # per group: [samples, tokens]
    for j in np.lexsort((members, -cost)).tolist():
        g = int(np.lexsort((np.arange(ready.size), idle, ready))[0])
        row = next((r for r in rows[g] if r[1] + padded[j] <= capacity), None)
        if row is None:
            row = [[], 0]
            rows[g].append(row)
            ready[g] += opening
        row[0].append(int(members[j]))
        row[1] += int(padded[j])
        ready[g] += cost[j]
        idle[g] = 0.0
    out = []
    for g, group_rows in enumerate(rows):
        if group_rows:
            built = [_make_row(sorted(r[0]), k, g * k, lengths, config) for r in group_rows]
            ranks = slice(g * k, (g + 1) * k)
            clock[ranks] = clock[ranks].max() + sum(row.cost for row in built)
            out += built
    return out


def _equalize(rows: list[CPRow], lengths: np.ndarray, config: DynamicCPConfig) -> list[CPRow]:
    """Split rows (between samples) on the ranks with the fewest micro-batches until every rank runs the
    same number: a CP-1 row of the rank first (only its count grows), else a row whose ranks all lag."""
    while True:
        counts = np.zeros(config.num_ranks, dtype=np.int64)
        for row in rows:
            counts[row.first_rank : row.first_rank + row.cp_size] += 1
        if counts.min() == counts.max():
            return rows
        position = _row_to_split(rows, counts)
        if position is None:
            raise ValueError(
                f"cannot give the {config.num_ranks} ranks of dynamic CP the same number of micro-batches "
                f"(they have {counts.min()} to {counts.max()}) without splitting a sample: put more samples in the "
                "global batch, or lower max_tokens_per_rank."
            )
        row = rows[position]
        first, second = _halves(row, lengths, config)
        rows[position : position + 1] = [first, second]


def _row_to_split(rows: list[CPRow], counts: np.ndarray) -> int | None:
    """The row to split: on a rank with the fewest micro-batches, of at least two samples, whose ranks all
    have fewer than the most; the smallest CP size first, then the largest cost."""
    low, high = counts.min(), counts.max()
    lagging = set(np.flatnonzero(counts == low).tolist())
    best = None
    for position, row in enumerate(rows):
        if len(row.sample_indices) < 2 or not lagging.intersection(row.ranks):
            continue
        if counts[row.first_rank : row.first_rank + row.cp_size].max() >= high:
            continue
        key = (row.cp_size, -row.cost)
        if best is None or key < best[0]:
            best = (key, position)
    return None if best is None else best[1]


def _halves(row: CPRow, lengths: np.ndarray, config: DynamicCPConfig) -> tuple[CPRow, CPRow]:
    """The row's samples in two rows of about equal cost (largest first, each to the lighter half)."""
    model = config.model()
    samples = sorted(row.sample_indices, key=lambda i: (-int(lengths[i]), i))
    halves, loads = ([], []), [0.0, 0.0]
    for i in samples:
        side = 0 if loads[0] <= loads[1] else 1
        halves[side].append(i)
        loads[side] += float(model.sequence_cost(config.padded(lengths[[i]], row.cp_size), row.cp_size)[0])
    return tuple(_make_row(sorted(h), row.cp_size, row.first_rank, lengths, config) for h in halves)
