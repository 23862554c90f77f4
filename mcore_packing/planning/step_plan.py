"""Step planner: the lengths of one global batch -> ordered micro-batches for every data-parallel rank.

Every rank calls `plan_step` on the same inputs and gets the same plan, with no communication (numpy
only); `mcore_packing.megatron.verify_plan_across_ranks` turns a disagreement into an error instead of a
hang.

Modes (`StepPlanConfig.mode`):
- ``packing``: sequences (padded to ``PaddingRule.sequence_multiple``) are bin-packed into rows of
  ``train_mb_tokens * cp`` tokens, the bin count a multiple of DP (groups kept whole; optionally under
  a per-row cost cap). With ``balance="cost"`` single sequences (or groups) then move between the rows
  of different ranks until the slowest rank's cost is near the mean (`rebalance`).
- ``dynamic``: samples (or groups, kept whole) sorted by length (longest first) are cut into micro-batches
  of similar lengths while ``rows * padded_length <= train_mb_tokens * cp``; micro-batches with the most
  rows are split (between groups) until their count is a multiple of DP.
- ``padded``: the baseline most loaders use: ``padded_rows`` consecutive samples per micro-batch, each
  padded to its longest.

Then every micro-batch gets its predicted cost (`CostModel`, per CP rank), micro-batches go to DP ranks
with equal counts (`balance`: by cost, by tokens, or round-robin), and each rank's list is put in
``microbatch_order`` (``auto``: the smallest simulated 1F1B time under PP, else ``packer``; or
``largest_first``, ``bubble``, ``pipeline``).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np

from ..packing import PackedBins, cost_capped_first_fit, enforce_bin_count, get_packer, required_bin_count
from ..packing.validation import as_lengths
from .balance import assign_balanced, assign_round_robin, max_over_mean, order_microbatches
from .cost_model import CostModel
from .micro_batch import MicroBatchPlan, group_members, micro_batch_cost, plan_fingerprint
from .rebalance import rebalance_units
from .shared_prefix import SharedPrefix, check_same_groups, shared_prefix_layout
from .step_config import StepPlanConfig

if TYPE_CHECKING:
    from .dynamic_cp import DynamicCPPlan

__all__ = ["MicroBatchPlan", "StepPlan", "micro_batch_cost", "plan_step"]


@dataclass(frozen=True)
class StepPlan:
    """Micro-batches per DP rank (equal counts), and how to get back to input order.

    ``groups`` holds the group id of every sample when the plan was made with groups (DPO pairs, GRPO
    groups), else None; it is part of equality and of the fingerprint.
    """

    config: StepPlanConfig
    forward_only: bool
    lengths: tuple[int, ...]
    micro_batches: tuple[tuple[MicroBatchPlan, ...], ...]
    row_capacity: int
    groups: tuple | None = None
    shared_prefix: tuple[int, ...] | None = None  # per sample: the prompt it shares in its row (0: none)
    shared_groups: tuple | None = None  # the group id of every sample (shared_prefix's groups)
    shared_report: dict | None = None  # tokens and predicted cost with and without sharing

    @property
    def num_microbatches(self) -> int:
        return len(self.micro_batches[0]) if self.micro_batches else 0

    def for_rank(self, dp_rank: int) -> tuple[MicroBatchPlan, ...]:
        return self.micro_batches[dp_rank]

    def sample_order(self) -> np.ndarray:
        """Input indices in plan order: DP rank 0's micro-batches first, in order, then rank 1's, ..."""
        return np.asarray([i for rank in self.micro_batches for mb in rank for i in mb.sample_indices], dtype=np.int64)

    def inverse_permutation(self) -> np.ndarray:
        """``inverse[i]`` is the position of input sample ``i`` in `sample_order` (restores input order)."""
        order = self.sample_order()
        inverse = np.empty_like(order)
        inverse[order] = np.arange(order.size)
        return inverse

    def fingerprint(self) -> str:
        """A hash of the inputs and the plan; equal on every rank that planned the same step."""
        return plan_fingerprint(
            self, micro_batches=[[(mb.sample_indices, mb.shape) for mb in rank] for rank in self.micro_batches]
        )

    @classmethod
    def chained(cls, plans: Sequence[StepPlan]) -> StepPlan:
        """Plans of consecutive optimizer steps over consecutive slices of one sample list, as one plan for
        reporting (a GRPO step's minibatches): lengths concatenated, each rank's micro-batches in order,
        sample indices offset by the earlier plans' lengths."""
        offsets = np.cumsum([0, *(len(p.lengths) for p in plans)]).tolist()
        ranks = len(plans[0].micro_batches)
        micro = tuple(
            tuple(
                replace(mb, sample_indices=tuple(i + offset for i in mb.sample_indices))
                for p, offset in zip(plans, offsets, strict=False)
                for mb in p.micro_batches[r]
            )
            for r in range(ranks)
        )
        lengths = tuple(n for p in plans for n in p.lengths)
        reports = [p.shared_report for p in plans if p.shared_report is not None]
        shared = None
        if reports:  # the minibatches' sharing, summed
            shared = {key: sum((r[key] for r in reports), [] if key == "fallback_groups" else 0) for key in reports[0]}
        return cls(config=plans[0].config, forward_only=plans[0].forward_only, lengths=lengths, micro_batches=micro,
                   row_capacity=plans[0].row_capacity, shared_report=shared)  # fmt: skip

    def rank_costs(self) -> list[float]:
        """Predicted cost of each DP rank's micro-batches (the slowest sets the step time)."""
        return [sum(mb.cost for mb in rank) for rank in self.micro_batches]

    def is_thd(self, mb: MicroBatchPlan) -> bool:
        """Whether ``mb`` is a packed THD row: every micro-batch in packing mode, and under dynamic batching
        one that holds a shared-prefix group (the rest are BSHD rows)."""
        if self.config.mode == "packing":
            return True
        return self.shared_prefix is not None and any(self.shared_prefix[i] for i in mb.sample_indices)

    def shared_prefix_groups(self, mb: MicroBatchPlan) -> tuple[list[list[int]], list[int]]:
        """``mb``'s samples as positions in ``mb.sample_indices``, one list per shared group (consecutive:
        the planner keeps a shared group whole) or per sample laid out alone, and each list's shared prompt
        length (0: alone); the input of `thd.build_shared_prefix_row`."""
        lists: list[list[int]] = []
        prompts: list[int] = []
        previous = None
        for k, i in enumerate(mb.sample_indices):
            prompt = self.shared_prefix[i] if self.shared_prefix is not None else 0
            key = (self.shared_groups[i], prompt) if prompt else None
            if key is not None and key == previous:
                lists[-1].append(k)
            else:
                lists.append([k])
                prompts.append(prompt)
            previous = key
        return lists, prompts

    def stats(self) -> dict:
        real = sum(mb.real_tokens for rank in self.micro_batches for mb in rank)
        padded = sum(mb.padded_tokens for rank in self.micro_batches for mb in rank)
        per_rank = [sum(mb.padded_tokens for mb in rank) for rank in self.micro_batches]
        per_rank_cost = self.rank_costs()
        shared = {"shared_prefix": self.shared_report} if self.shared_report is not None else {}
        return {
            **shared,
            "rank_cost_max_over_mean": max_over_mean(per_rank_cost),
            "predicted_step_cost": max(per_rank_cost) if per_rank_cost else 0.0,
            "num_microbatches_per_rank": self.num_microbatches,
            "real_tokens": real,
            "padded_tokens": padded,
            "utilization": real / padded if padded else 1.0,
            "rank_tokens_max_over_mean": max_over_mean(per_rank),
            "max_tokens_per_rank": max((mb.padded_tokens for rank in self.micro_batches for mb in rank), default=0)
            // self.config.layout.cp,
        }


def plan_step(
    lengths: Sequence[int] | np.ndarray,
    config: StepPlanConfig,
    *,
    forward_only: bool = False,
    groups: Sequence | None = None,
    shared_prefix: SharedPrefix | None = None,
) -> StepPlan | DynamicCPPlan:
    """Plan one global batch (see the module docstring).

    ``groups``: optional group id per sample (DPO chosen/rejected pairs, GRPO responses to one prompt).
    Samples of a group always share a micro-batch, so a group is never split across micro-batches or
    ranks. Packing mode only.

    ``shared_prefix``: the responses of a group laid out after one copy of their prompt
    (`planning.shared_prefix`): a group's tokens and cost are the shared layout's, the group is kept whole
    (when it fits one micro-batch; else its members are planned alone, reported), and the plan records
    each sample's shared prompt. Packing or dynamic mode (a shared group's micro-batch is then a THD row
    among the BSHD ones), without context parallelism; ``groups``, when given, must be the same ids.

    With ``config.dynamic_cp`` the plan is a `dynamic_cp.DynamicCPPlan` (rows on CP sub-groups of the DP
    x CP ranks, at the pass's budget per rank) instead of a `StepPlan`.

    With ``config.memory_budget`` and ``config.memory_model`` (`memory_budget.MemoryModel`) a training
    pass's plan whose predicted peak exceeds the budget is planned again at the largest token budget that
    keeps it under (its ``config`` says which); a batch whose longest sequence alone exceeds it raises.
    """
    plan = _plan_tokens(lengths, config, forward_only=forward_only, groups=groups, shared_prefix=shared_prefix)
    memory = config.memory_model
    if memory is None or config.memory_budget is None or forward_only or not isinstance(plan, StepPlan):
        return plan
    return memory.enforce(plan, lambda cfg: _plan_tokens(lengths, cfg, groups=groups, shared_prefix=shared_prefix))


def _plan_tokens(lengths, config: StepPlanConfig, *, forward_only: bool = False, groups=None, shared_prefix=None):
    """`plan_step` under the token budget alone."""
    lengths = as_lengths(lengths, np.iinfo(np.int64).max)
    if lengths.size == 0:
        raise ValueError("the global batch is empty; a step needs at least one sample.")
    config.check_fits(lengths, forward_only=forward_only)
    if shared_prefix is not None:
        _check_sharing_applies(config)
    if config.dynamic_cp:
        from .dynamic_cp import DynamicCPConfig, plan_dynamic_cp  # it builds on this module

        if groups is not None:
            config.check_groups_fit(lengths, groups, forward_only=forward_only)
        return plan_dynamic_cp(lengths, DynamicCPConfig.from_step_config(config, forward_only=forward_only),
                               groups=groups, forward_only=forward_only)  # fmt: skip
    capacity = config.row_capacity(forward_only)
    padded = config.padded_lengths(lengths)
    model = config.cost_model or CostModel(linear=1.0, quadratic=0.0, unit="token")
    sharing = real_lengths = sample_costs = None
    if shared_prefix is not None:
        sharing = _sharing(lengths, shared_prefix, groups, config, model, forward_only)
        units, real_lengths, padded, sample_costs = sharing.units, sharing.real, sharing.padded, sharing.costs
    else:
        units = _units(groups, lengths, config, forward_only)
    assignment = None
    if config.mode == "packing":
        unit_bins, items = _plan_packing(padded, capacity, config, units, model, sample_costs)
        if config.balance == "cost" and config.layout.dp > 1:
            unit_bins, assignment = _rebalanced(unit_bins, items, padded, capacity, config, model, sample_costs)
        bins = [[i for u in b for i in items[u]] for b in unit_bins] if units is not None else unit_bins
        shapes = _row_shapes(bins, padded, capacity, config)
    elif config.mode == "dynamic":
        bins, shapes = _plan_dynamic(lengths, padded, capacity, config, units, sharing)
    else:
        bins, shapes = _plan_padded(lengths, padded, config)
    real_lengths = lengths if real_lengths is None else real_lengths
    real, costs = _bin_totals(bins, shapes, real_lengths, padded, config, model, sample_costs)
    if sharing is not None and config.mode == "dynamic":  # a THD row among the BSHD ones: its sequences' costs
        for j, b in enumerate(bins):
            if any(sharing.prefix[i] for i in b):
                costs[j] = float(sample_costs[b].sum()) + model.per_microbatch
    micro = [
        MicroBatchPlan(tuple(b), shape, int(r), float(c))
        for b, shape, r, c in zip(bins, shapes, real, costs, strict=True)
    ]
    return StepPlan(
        config=config,
        forward_only=forward_only,
        lengths=tuple(lengths.tolist()),
        micro_batches=_assign_and_order(micro, config, assignment),
        row_capacity=capacity,
        groups=tuple(groups) if groups is not None else None,
        shared_prefix=sharing.prefix if sharing is not None else None,
        shared_groups=shared_prefix.group_ids if sharing is not None else None,
        shared_report=sharing.report(lengths, model.sequence_cost(config.padded_lengths(lengths)))
        if sharing is not None
        else None,
    )


def _check_sharing_applies(config: StepPlanConfig) -> None:
    if config.mode == "padded" or config.dynamic_cp or config.layout.cp > 1:
        raise ValueError(
            f"a shared prefix is laid out in THD rows on one CP rank; this plan has mode={config.mode!r}, "
            f"cp={config.layout.cp}, dynamic_cp={config.dynamic_cp}. Use mode='packing' or 'dynamic' and cp=1, or "
            "leave shared_prefix out."
        )


def _sharing(lengths, spec: SharedPrefix, groups, config: StepPlanConfig, model: CostModel, forward_only: bool):
    """The shared-prefix layout of the batch (`planning.shared_prefix`). With ``groups`` (kept whole) a group
    too big to share must fit one micro-batch as separate sequences, else the budget check names it."""
    if groups is not None:
        check_same_groups(groups, spec)
    layout = shared_prefix_layout(lengths, spec, config, model, forward_only=forward_only,
                                  keep_groups=groups is not None)  # fmt: skip
    if groups is not None and layout.fallback_groups:
        fallback = set(layout.fallback_groups)
        kept = [i for i, g in enumerate(groups) if g in fallback]
        config.check_groups_fit(lengths[kept], [groups[i] for i in kept], forward_only=forward_only)
    return layout


def _assign_and_order(
    micro: list[MicroBatchPlan], config: StepPlanConfig, assignment: list[list[int]] | None = None
) -> tuple[tuple[MicroBatchPlan, ...], ...]:
    """Micro-batches to DP ranks (equal counts, by `config.balance`, unless ``assignment`` gives them),
    each rank's in `microbatch_order`."""
    multiple = config.count_multiple
    assert len(micro) % multiple == 0, f"{len(micro)} micro-batches: not a multiple of {multiple}"
    if assignment is None and config.balance == "round_robin":
        assignment = assign_round_robin(len(micro), config.layout.dp)
    elif assignment is None:
        weights = [mb.cost if config.balance == "cost" else mb.padded_tokens for mb in micro]
        assignment = assign_balanced(weights, config.layout.dp)
    per_rank = []
    for rank in assignment:
        chosen = [micro[k] for k in rank]
        order = order_microbatches([mb.cost for mb in chosen], config.microbatch_order, config.layout.pp,
                                   vpp=config.layout.vpp, group=config.layout.microbatch_group)  # fmt: skip
        per_rank.append(tuple(chosen[k] for k in order))
    return tuple(per_rank)


def _flat(bins: list[list[int]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``bins`` as one index array, the bin of each entry, and each bin's last entry's position."""
    sizes = np.fromiter((len(b) for b in bins), dtype=np.int64, count=len(bins))
    flat = np.fromiter((i for b in bins for i in b), dtype=np.int64, count=int(sizes.sum()))
    return flat, np.repeat(np.arange(len(bins)), sizes), np.cumsum(sizes) - 1


def _bin_totals(bins, shapes, lengths, padded, config: StepPlanConfig, model: CostModel, sample_costs=None):
    """Real tokens and predicted cost of every micro-batch at once; equal to `micro_batch_cost` per bin.
    ``sample_costs``: each sample's cost when it is not ``sequence_cost`` of its span (a shared prefix)."""
    flat, bin_id, last = _flat(bins)
    real = np.bincount(bin_id, weights=lengths[flat], minlength=len(bins))
    cp = config.layout.cp
    exchange = model.cp_exchange(np.array(shapes, dtype=np.float64).reshape(-1, 2).prod(axis=1), cp)
    if config.mode != "packing":
        rows, widths = np.array(shapes, dtype=np.float64).T
        return real, rows * model.sequence_cost(widths, cp) + model.per_microbatch + exchange
    per_sample = model.sequence_cost(padded, cp) if sample_costs is None else sample_costs
    cost = np.bincount(bin_id, weights=per_sample[flat], minlength=len(bins))
    spans = np.bincount(bin_id, weights=padded[flat], minlength=len(bins))
    tail = padded[flat[last]].astype(np.float64)
    extra = np.array([row for _, row in shapes], dtype=np.float64) - spans  # row padding sits in the last span
    cost += model.sequence_cost(tail + extra, cp) - model.sequence_cost(tail, cp)
    return real, cost + model.per_microbatch + exchange


def _units(groups, lengths: np.ndarray, config: StepPlanConfig, forward_only: bool) -> list[list[int]] | None:
    """Samples grouped by id (first-appearance order), or None without groups."""
    if groups is None:
        return None
    groups = list(groups)
    members = group_members(groups, lengths.size)  # one id per sample, checked before the budget check
    if config.mode == "padded":
        raise ValueError("groups keep samples together in one micro-batch: they need mode='packing' or 'dynamic'.")
    config.check_groups_fit(lengths, groups, forward_only=forward_only)
    return members


def _unit_sums(items: list[list[int]], values: np.ndarray) -> np.ndarray:
    """``values`` (one per sample) summed over each unit's samples."""
    flat, unit_id, _ = _flat(items)
    return np.bincount(unit_id, weights=values[flat], minlength=len(items))


def _plan_packing(padded, capacity, config, units, model: CostModel, sample_costs=None):
    """Bins of units (a unit: one sample, or one group) and the units, as sample-index lists."""
    items = units if units is not None else [[i] for i in range(padded.size)]
    sizes = padded.copy() if units is None else _unit_sums(items, padded).astype(np.int64)
    multiple = config.count_multiple  # DP, times the interleaved schedule's group
    packer = get_packer(config.algorithm, capacity, bin_count_multiple=multiple, seed=0, refine=config.refine)
    unit_bins = packer.pack(sizes)
    if config.cost_budget is not None:
        costs = _unit_sums(items, model.sequence_cost(padded) if sample_costs is None else sample_costs)
        cost_budget = config.cost_budget
        if cost_budget == "auto":
            cost_budget = max(float(costs.max()), 1.05 * float(costs.sum()) / len(unit_bins))
        capped = cost_capped_first_fit(sizes, costs, capacity, cost_budget)
        # The cost cap evens out work; it cannot ask for more rows than there are samples to give every DP
        # rank the same count. Then the token-capped bins stand (the token cap is the hard limit).
        if required_bin_count(len(capped), None, config.count_multiple) <= len(items):
            unit_bins = enforce_bin_count(
                PackedBins.from_lists(capped), sizes, min_bin_count=None, bin_count_multiple=config.count_multiple
            ).to_lists()
    return unit_bins, items


def _rebalanced(unit_bins, items, padded, capacity, config, model: CostModel, sample_costs=None):
    """Rows to ranks by cost (`assign_balanced`), then single units moved or swapped between the rows of
    different ranks (`rebalance.rebalance_units`); returns the rows and each rank's row indices."""
    sizes = _unit_sums(items, padded).astype(np.int64)
    costs = _unit_sums(items, model.sequence_cost(padded, config.layout.cp) if sample_costs is None else sample_costs)
    units_in_bins, bin_id, _ = _flat(unit_bins)
    row_costs = np.bincount(bin_id, weights=costs[units_in_bins], minlength=len(unit_bins))
    assignment = assign_balanced(row_costs, config.layout.dp)
    rank_of_bin = np.empty(len(unit_bins), dtype=np.int64)
    for rank, rows in enumerate(assignment):
        rank_of_bin[rows] = rank
    return rebalance_units(unit_bins, rank_of_bin.tolist(), sizes, costs, capacity), assignment


def _row_shapes(bins, padded, capacity, config) -> list[tuple[int, int]]:
    if config.use_fixed_length:
        return [(1, capacity)] * len(bins)
    flat, bin_id, _ = _flat(bins)
    multiple = config.padding_rule.total_multiple
    rows = -(-np.bincount(bin_id, weights=padded[flat], minlength=len(bins)).astype(np.int64) // multiple) * multiple
    return [(1, int(r)) for r in rows]


def _plan_dynamic(lengths, padded, capacity, config, units=None, sharing=None):
    """Units (single samples, or whole groups) longest first, cut while ``rows * width <= capacity``. A
    shared-prefix group (``sharing``) counts as one row as wide as its shared span, and a micro-batch that
    holds one becomes a THD row ``(1, its spans)`` (`StepPlan.is_thd`)."""
    units = units if units is not None else [[i] for i in range(lengths.size)]
    shared = [sharing is not None and sharing.prefix[u[0]] > 0 for u in units]
    longest = np.asarray([padded[u].sum() if s else lengths[u].max() for u, s in zip(units, shared, strict=True)])
    widths = [int(padded[u].sum()) if s else int(padded[u].max()) for u, s in zip(units, shared, strict=True)]
    rows_of = [1 if s else len(u) for u, s in zip(units, shared, strict=True)]
    batches: list[list[int]] = []
    current: list[int] = []
    rows = width = 0
    for k in np.argsort(-longest, kind="stable").tolist():
        w, r = max(width, widths[k]), rows + rows_of[k]
        if current and r * w > capacity:
            batches.append(current)
            current, w, r = [], widths[k], rows_of[k]
        current.append(k)
        rows, width = r, w
    batches.append(current)
    bins, shapes = _as_bins(_split_until_divisible(batches, rows_of, config), units, padded)
    if sharing is not None:
        multiple = config.padding_rule.total_multiple
        for j, b in enumerate(bins):
            if any(sharing.prefix[i] for i in b):  # THD: its sequences' spans end to end, the row padded at its tail
                shapes[j] = (1, -(-int(sharing.spans[b].sum()) // multiple) * multiple)
    return bins, shapes


def _plan_padded(lengths, padded, config):
    """The baseline: ``padded_rows`` consecutive samples per micro-batch, padded to their longest."""
    n = lengths.size
    batches = [list(range(lo, min(lo + config.padded_rows, n))) for lo in range(0, n, config.padded_rows)]
    units = [[i] for i in range(n)]
    return _as_bins(_split_until_divisible(batches, [1] * n, config), units, padded)


def _split_until_divisible(batches: list[list[int]], rows: list[int], config: StepPlanConfig) -> list[list[int]]:
    """Split the micro-batches with the most rows (between units: ``rows[k]`` samples of unit ``k``) until
    their count is a multiple of `StepPlanConfig.count_multiple` (DP, times the interleaved group)."""
    multiple, why = config.count_multiple, config.count_multiple_reason
    need = -(-len(batches) // multiple) * multiple
    if len(rows) < need:
        what = "samples" if max(rows) == 1 else "groups"
        raise ValueError(
            f"Cannot give {why} with only {len(rows)} {what} in the global batch (need at least {need})."
        )
    heap = [(-sum(rows[k] for k in b), i) for i, b in enumerate(batches) if len(b) > 1]
    heapq.heapify(heap)
    while len(batches) % multiple:
        if not heap:  # every micro-batch is one unit: splitting further would split a group
            raise ValueError(
                f"Cannot give {why} without splitting a group ({len(batches)} micro-batches of one group each); "
                "put more groups in the global batch, or lower the budget so that they spread."
            )
        _, i = heapq.heappop(heap)
        b = batches[i]
        batches[i], extra = b[: len(b) // 2], b[len(b) // 2 :]
        batches.append(extra)
        for k in (i, len(batches) - 1):
            if len(batches[k]) > 1:
                heapq.heappush(heap, (-sum(rows[u] for u in batches[k]), k))
    return batches


def _as_bins(batches: list[list[int]], units: list[list[int]], padded) -> tuple[list[list[int]], list[tuple]]:
    """Micro-batches of units -> sample-index bins and their BSHD shapes ``(rows, longest padded)``."""
    bins = [[i for k in b for i in units[k]] for b in batches]
    return bins, [(len(b), int(padded[np.asarray(b)].max())) for b in bins]
