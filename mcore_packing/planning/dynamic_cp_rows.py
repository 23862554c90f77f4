"""Dynamic context parallelism's data: the settings (`DynamicCPConfig`), a row of one CP size on an
aligned group of ranks (`CPRow`), the step's plan (`DynamicCPPlan`) and the pieces both the scheduler
(`planning.dynamic_cp`) and the equal-count pass (`planning.dynamic_cp_equalize`) build rows with.
numpy only; the algorithm is described in `planning.dynamic_cp`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from ..validators import require_positive_int
from .balance import max_over_mean
from .cost_model import CostModel
from .layout import ParallelLayout, check_dynamic_cp_layout
from .micro_batch import MicroBatchPlan, micro_batch_cost, plan_fingerprint
from .padding import PaddingRule, micro_batch_tokens
from .step_config import DYNAMIC_CP_MODES, StepPlanConfig

__all__ = ["CPRow", "DynamicCPConfig", "DynamicCPPlan", "make_row", "row_units", "simulate_rows", "unit_cost"]


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


def row_units(row: CPRow, unit_of: np.ndarray) -> list[list[int]]:
    """The row's samples by unit (a group's samples together), in the order units first appear."""
    members: dict = {}
    for i in row.sample_indices:
        members.setdefault(int(unit_of[i]), []).append(i)
    return list(members.values())


def make_row(samples: list[int], cp_size: int, first_rank: int, lengths: np.ndarray, config: DynamicCPConfig):
    padded = config.padded(lengths[samples], cp_size)
    if config.mode == "packing":
        multiple = config.padding_rule(cp_size).total_multiple
        width, shape = 0, (1, int(-(-int(padded.sum()) // multiple) * multiple))
    else:
        width = int(padded.max())
        shape = (len(samples), width)
    cost = micro_batch_cost(padded, shape, config.mode, cp_size, config.model())  # a static micro-batch's cost
    return CPRow(tuple(samples), cp_size, first_rank, shape[0] * shape[1], int(lengths[samples].sum()), cost, width)


def unit_cost(units: list[list[int]], k: int, lengths: np.ndarray, config: DynamicCPConfig):
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
