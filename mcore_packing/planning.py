"""Step planner: the lengths of one global batch -> ordered micro-batches for every data-parallel rank.

Every rank calls `plan_step` on the same inputs and gets the same plan, with no communication;
`verify_plan_across_ranks` turns a disagreement into an error instead of a hang.

Budgets are per GPU. ``train_mb_tokens`` is what one rank processes in one micro-batch. With context
parallelism a micro-batch's packed row (or padded rows) holds ``train_mb_tokens * cp`` tokens and each CP
rank gets ``train_mb_tokens`` of them.

Modes:
- ``packing``: sequences (padded to ``PaddingRule.sequence_multiple``) are bin-packed into rows of
  ``train_mb_tokens * cp`` tokens, the bin count a multiple of DP; bins go to ranks heaviest first to
  the least-loaded rank that still needs one, so every rank gets the same number of micro-batches.
- ``dynamic``: samples sorted by length (longest first) are cut into micro-batches of similar lengths
  while ``rows * padded_length <= train_mb_tokens * cp`` (padded length rounded to
  ``sequence_length_round`` and 2*CP); micro-batches with the most rows are split until their count is a
  multiple of DP; then assigned to ranks like bins.

- ``padded``: the baseline most loaders use: ``padded_rows`` consecutive samples per micro-batch, each
  padded to its longest (for comparisons and for users who need it).

Micro-batch order on a rank: ``packer`` (as planned) or ``largest_first`` (most tokens first; lets the
caching allocator reuse the largest blocks).
"""

from __future__ import annotations

import hashlib
import heapq
import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import numpy as np

from .balance import ORDERS, assign_balanced, assign_round_robin, cost_capped_first_fit, max_over_mean
from .balance import order_microbatches as _order
from .batch import PaddingRule
from .cost import CostModel
from .packing import DEFAULT_ALGORITHM, get_packer
from .packing.validation import as_lengths

__all__ = [
    "BALANCES",
    "MODES",
    "ORDERS",
    "MicroBatchPlan",
    "StepPlan",
    "StepPlanConfig",
    "plan_step",
    "verify_plan_across_ranks",
]

MODES = ("packing", "dynamic", "padded")
BALANCES = ("cost", "tokens", "round_robin")


@dataclass(frozen=True, kw_only=True)
class StepPlanConfig:
    """How one global batch becomes micro-batches.

    Attributes:
        mode: ``packing`` (THD rows) or ``dynamic`` (padded BSHD micro-batches of similar lengths).
        train_mb_tokens: tokens one rank processes per training micro-batch (per GPU, after the CP split).
        logprob_mb_tokens: the same for forward-only passes (log-probs); defaults to ``train_mb_tokens``.
        algorithm: packing algorithm (packing mode).
        refine: bin-count refinement after packing (`get_packer`'s ``refine``); None is the algorithm's
            default (on for modified_first_fit_decreasing).
        microbatch_order: ``packer`` or ``largest_first``.
        sequence_length_round: per-sequence length alignment (NeMo-RL's key).
        dp_size, tp_size, pp_size, cp_size, sequence_parallel: the parallel layout.
        fp8_alignment: per-sequence alignment for FP8 (16), 1 when off.
        fixed_length: packing mode: pad every row to the full ``train_mb_tokens * cp`` (PP without
            variable sequence lengths needs one shape). Default: on when ``pp_size > 1``.
        padded_rows: rows per micro-batch in ``padded`` mode.
        balance: how micro-batches go to DP ranks: ``cost`` (attention-aware `cost_model`, LPT + swaps),
            ``tokens`` (the same on padded tokens), ``round_robin`` (NeMo-RL's, for comparison).
        cost_model: per-sequence cost; None counts tokens (no attention term).
        cost_budget: packing only: also cap each row's cost (in `cost_model` units), or ``"auto"`` for
            5% above the mean row cost of token-only packing, so rows are even in work.
    """

    mode: str = "packing"
    train_mb_tokens: int = 4096
    logprob_mb_tokens: int | None = None
    algorithm: str = DEFAULT_ALGORITHM.value
    refine: bool | None = None
    microbatch_order: str = "packer"
    sequence_length_round: int = 1
    dp_size: int = 1
    tp_size: int = 1
    pp_size: int = 1
    cp_size: int = 1
    sequence_parallel: bool = False
    fp8_alignment: int = 1
    fixed_length: bool | None = None
    padded_rows: int = 4
    balance: str = "cost"
    cost_model: CostModel | None = None
    cost_budget: float | str | None = None

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(
                f"mode must be 'packing', 'dynamic' or 'padded', got {self.mode!r}. Packing fills THD rows with "
                "whole sequences; dynamic batching groups similar lengths into padded micro-batches; padded is "
                "the baseline (padded_rows consecutive samples padded to their longest). Pick one."
            )
        if self.microbatch_order not in ORDERS:
            raise ValueError(f"microbatch_order must be one of {ORDERS}, got {self.microbatch_order!r}.")
        if self.balance not in BALANCES:
            raise ValueError(f"balance must be one of {BALANCES}, got {self.balance!r}.")
        if self.cost_budget is not None and self.cost_budget != "auto":
            if (
                isinstance(self.cost_budget, bool)
                or not isinstance(self.cost_budget, (int, float))
                or self.cost_budget <= 0
            ):
                raise ValueError(f"cost_budget must be a positive number, 'auto' or None, got {self.cost_budget!r}.")
        if self.cost_budget is not None and self.mode != "packing":
            raise ValueError("cost_budget caps the cost of packed rows: it needs mode='packing'.")
        for name in (
            "train_mb_tokens",
            "sequence_length_round",
            "dp_size",
            "tp_size",
            "pp_size",
            "cp_size",
            "fp8_alignment",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}.")
        if self.logprob_mb_tokens is not None and (
            isinstance(self.logprob_mb_tokens, bool)
            or not isinstance(self.logprob_mb_tokens, int)
            or self.logprob_mb_tokens < 1
        ):
            raise ValueError(f"logprob_mb_tokens must be an integer >= 1 or None, got {self.logprob_mb_tokens!r}.")
        get_packer(self.algorithm, 1, refine=self.refine)  # raises on an unknown algorithm or a bad `refine`
        if self.mode != "packing" and self.fixed_length:
            raise ValueError("fixed_length applies to packing mode; dynamic micro-batches are padded per batch.")

    @classmethod
    def from_nemo_rl(
        cls, *, sequence_packing: dict | None = None, dynamic_batching: dict | None = None, **parallel
    ) -> StepPlanConfig:
        """Build from NeMo-RL's ``policy.sequence_packing`` / ``policy.dynamic_batching`` sections.

        Keys: ``enabled``, ``train_mb_tokens``, ``logprob_mb_tokens``, ``algorithm``, ``microbatch_order``
        (packing only) and ``sequence_length_round``. ``parallel`` takes the remaining fields
        (``dp_size``, ``tp_size``, ...).
        """
        packing = dict(sequence_packing or {})
        dynamic = dict(dynamic_batching or {})
        if packing.get("enabled") and dynamic.get("enabled"):
            raise ValueError(
                "sequence_packing.enabled and dynamic_batching.enabled are both true. They are two ways to cut "
                "the same batch: packing concatenates whole sequences into THD rows (least padding, needs THD "
                "attention), dynamic batching groups similar lengths into padded rows. Set one of them to false."
            )
        section, mode = (packing, "packing") if packing.get("enabled") else (dynamic, "dynamic")
        if not section.get("enabled"):
            raise ValueError("Neither sequence_packing.enabled nor dynamic_batching.enabled is true; enable one.")
        known = {"enabled", "train_mb_tokens", "logprob_mb_tokens", "sequence_length_round"}
        if mode == "packing":
            known |= {"algorithm", "microbatch_order"}
        unknown = set(section) - known
        if unknown:
            name = "sequence_packing" if mode == "packing" else "dynamic_batching"
            raise ValueError(f"Unknown key(s) {sorted(unknown)} in {name}; valid keys: {sorted(known)}.")
        fields = {k: v for k, v in section.items() if k != "enabled" and v is not None}
        return cls(mode=mode, **fields, **parallel)

    @property
    def padding_rule(self) -> PaddingRule:
        return PaddingRule(
            cp_size=self.cp_size,
            tp_size=self.tp_size,
            sequence_parallel=self.sequence_parallel,
            sequence_length_round=self.sequence_length_round,
            fp8_alignment=self.fp8_alignment,
        )

    @property
    def use_fixed_length(self) -> bool:
        return self.mode == "packing" and (self.fixed_length if self.fixed_length is not None else self.pp_size > 1)

    def budget(self, forward_only: bool = False) -> tuple[str, int]:
        """The name and value of the per-GPU token budget that applies."""
        if forward_only and self.logprob_mb_tokens is not None:
            return "logprob_mb_tokens", self.logprob_mb_tokens
        return "train_mb_tokens", self.train_mb_tokens

    @property
    def length_multiple(self) -> int:
        """Sequences are padded to this: the THD span multiple, or in dynamic mode the BSHD row multiple
        (sequence parallelism splits each row's CP shard over TP ranks)."""
        rule = self.padding_rule
        if self.mode != "packing" and self.sequence_parallel and self.tp_size > 1:
            return math.lcm(rule.sequence_multiple, self.cp_size * self.tp_size)
        return rule.sequence_multiple

    def row_capacity(self, forward_only: bool = False) -> int:
        """Tokens in one micro-batch before the CP split, rounded down to the row multiple."""
        _, budget = self.budget(forward_only)
        multiple = self.padding_rule.total_multiple if self.mode == "packing" else self.length_multiple
        return (budget * self.cp_size) // multiple * multiple


@dataclass(frozen=True)
class MicroBatchPlan:
    """One micro-batch: the global-batch indices of its samples and its padded shape.

    ``shape`` is ``(1, row_length)`` in packing mode (the whole THD row, before the CP split) and
    ``(rows, padded_length)`` in dynamic mode.
    """

    sample_indices: tuple[int, ...]
    shape: tuple[int, int]
    real_tokens: int
    cost: float = 0.0

    @property
    def padded_tokens(self) -> int:
        return self.shape[0] * self.shape[1]


@dataclass(frozen=True)
class StepPlan:
    """Micro-batches per DP rank (equal counts), and how to get back to input order."""

    config: StepPlanConfig
    forward_only: bool
    lengths: tuple[int, ...]
    micro_batches: tuple[tuple[MicroBatchPlan, ...], ...]
    extra: dict = field(default_factory=dict, compare=False)

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
        payload = {
            "config": asdict(self.config),
            "forward_only": self.forward_only,
            "lengths": list(self.lengths),
            "groups": [str(g) for g in self.extra.get("groups") or []],
            "micro_batches": [[(mb.sample_indices, mb.shape) for mb in rank] for rank in self.micro_batches],
        }
        return hashlib.sha256(json.dumps(payload, sort_keys=True, default=list).encode()).hexdigest()

    def stats(self) -> dict:
        real = sum(mb.real_tokens for rank in self.micro_batches for mb in rank)
        padded = sum(mb.padded_tokens for rank in self.micro_batches for mb in rank)
        per_rank = [sum(mb.padded_tokens for mb in rank) for rank in self.micro_batches]
        per_rank_cost = [sum(mb.cost for mb in rank) for rank in self.micro_batches]
        return {
            "rank_cost_max_over_mean": max_over_mean(per_rank_cost),
            "predicted_step_cost": max(per_rank_cost) if per_rank_cost else 0.0,
            "num_microbatches_per_rank": self.num_microbatches,
            "real_tokens": real,
            "padded_tokens": padded,
            "utilization": real / padded if padded else 1.0,
            "rank_tokens_max_over_mean": max(per_rank) / (sum(per_rank) / len(per_rank)) if padded else 1.0,
        }


def plan_step(
    lengths: Sequence[int] | np.ndarray,
    config: StepPlanConfig,
    *,
    forward_only: bool = False,
    groups: Sequence | None = None,
) -> StepPlan:
    """Plan one global batch (see the module docstring).

    ``groups``: optional group id per sample (DPO chosen/rejected pairs, GRPO responses to one prompt).
    Samples of a group always share a micro-batch, so a group is never split across micro-batches or
    ranks. Packing mode only.
    """
    capacity = config.row_capacity(forward_only)
    budget_name, budget = config.budget(forward_only)
    lengths = as_lengths(lengths, np.iinfo(np.int64).max)
    if lengths.size == 0:
        raise ValueError("the global batch is empty; a step needs at least one sample.")
    multiple = config.length_multiple
    padded = -(-lengths // multiple) * multiple
    longest = int(padded.max())
    if longest > capacity:
        i = int(np.argmax(padded))
        raise ValueError(
            f"{budget_name}={budget} (x cp={config.cp_size}: {capacity} tokens per micro-batch) is smaller than "
            f"sample {i}, whose padded length is {longest} (length {int(lengths[i])}). Raise {budget_name} to at "
            f"least {-(-longest // config.cp_size)}, or truncate/split long samples upstream."
        )
    model = config.cost_model or CostModel(linear=1.0, quadratic=0.0, unit="token")
    units = _units(groups, lengths.size, padded, capacity, config)
    if config.mode == "packing":
        bins, shapes = _plan_packing(padded, capacity, config, units, model)
    elif config.mode == "dynamic":
        bins, shapes = _plan_dynamic(lengths, padded, capacity, config)
    else:
        bins, shapes = _plan_padded(lengths, padded, config)
    micro = [
        MicroBatchPlan(
            tuple(int(i) for i in b),
            shape,
            int(lengths[np.asarray(b)].sum()),
            _mb_cost(b, shape, padded, config, model),
        )
        for b, shape in zip(bins, shapes, strict=True)
    ]
    if len(micro) % config.dp_size:
        raise AssertionError(f"{len(micro)} micro-batches do not split over {config.dp_size} ranks")
    if config.balance == "round_robin":
        assignment = assign_round_robin(len(micro), config.dp_size)
    else:
        weights = [mb.cost if config.balance == "cost" else mb.padded_tokens for mb in micro]
        assignment = assign_balanced(weights, config.dp_size)
    per_rank = []
    for rank in assignment:
        chosen = [micro[k] for k in rank]
        order = _order([mb.cost for mb in chosen], config.microbatch_order)
        per_rank.append(tuple(chosen[k] for k in order))
    return StepPlan(
        config=config,
        forward_only=forward_only,
        lengths=tuple(int(x) for x in lengths),
        micro_batches=tuple(per_rank),
        extra={"row_capacity": capacity, "groups": list(groups) if groups is not None else None},
    )


def _units(groups, n, padded, capacity, config) -> list[list[int]] | None:
    """Samples grouped by id (first-appearance order), or None without groups."""
    if groups is None:
        return None
    groups = list(groups)
    if len(groups) != n:
        raise ValueError(f"groups has {len(groups)} entries for {n} samples; give one group id per sample.")
    if config.mode != "packing":
        raise ValueError("groups keep samples together in one packed row: they need mode='packing'.")
    members: dict = {}
    for i, g in enumerate(groups):
        members.setdefault(g, []).append(i)
    for g, idx in members.items():
        size = int(padded[idx].sum())
        if size > capacity:
            raise ValueError(
                f"group {g!r} has {len(idx)} samples and {size} padded tokens, more than one micro-batch holds "
                f"({capacity}). Raise train_mb_tokens (x cp) to at least {-(-size // config.cp_size)}, or split "
                "the group upstream."
            )
    return list(members.values())


def _mb_cost(members, shape, padded, config, model: CostModel) -> float:
    """Predicted cost of a micro-batch on one CP rank (attention per sequence in packing mode)."""
    if config.mode == "packing":
        spans = padded[np.asarray(members)].astype(np.float64)
        spans[-1] += shape[1] - spans.sum()  # row padding is part of the last span
        return float(model.sequence_cost(spans, config.cp_size).sum())
    rows, width = shape
    return rows * float(model.sequence_cost([width], config.cp_size)[0])


def _plan_packing(padded, capacity, config, units, model: CostModel):
    items = units if units is not None else [[i] for i in range(padded.size)]
    sizes = np.array([int(padded[u].sum()) for u in items], dtype=np.int64)
    if config.cost_budget is None:
        packer = get_packer(config.algorithm, capacity, bin_count_multiple=config.dp_size, seed=0, refine=config.refine)
        unit_bins = packer.pack(sizes)
    else:
        costs = np.array([float(model.sequence_cost(padded[u]).sum()) for u in items])
        cost_budget = config.cost_budget
        if cost_budget == "auto":
            reference = get_packer(
                config.algorithm, capacity, bin_count_multiple=config.dp_size, seed=0, refine=config.refine
            ).pack(sizes)
            cost_budget = max(float(costs.max()), 1.05 * float(costs.sum()) / len(reference))
        unit_bins = cost_capped_first_fit(sizes, costs, capacity, cost_budget)
        unit_bins = _split_to_multiple(unit_bins, sizes, config.dp_size)
    bins = [[i for u in b for i in items[u]] for b in unit_bins]
    multiple = config.padding_rule.total_multiple
    shapes = []
    for b in bins:
        row = int(padded[b].sum())
        row = -(-row // multiple) * multiple
        shapes.append((1, capacity if config.use_fixed_length else row))
    return bins, shapes


def _split_to_multiple(bins: list[list[int]], sizes: np.ndarray, multiple: int) -> list[list[int]]:
    """Move single items out of the fullest multi-item bins until the bin count is a multiple."""
    from .packing import PackedBins
    from .packing.constraints import enforce_bin_count

    if len(bins) % multiple == 0:
        return bins
    if sum(len(b) for b in bins) < -(-len(bins) // multiple) * multiple:
        raise ValueError(
            f"Cannot give {multiple} data-parallel ranks the same number of micro-batches with only "
            f"{sum(len(b) for b in bins)} sequences (or groups) in the global batch."
        )
    return enforce_bin_count(
        PackedBins.from_lists(bins), sizes, min_bin_count=None, bin_count_multiple=multiple
    ).to_lists()


def _plan_dynamic(lengths, padded, capacity, config):
    order = np.argsort(-lengths, kind="stable")
    groups: list[list[int]] = []
    current: list[int] = []
    width = 0
    for i in order.tolist():
        w = max(width, int(padded[i]))
        if current and (len(current) + 1) * w > capacity:
            groups.append(current)
            current, w = [], int(padded[i])
        current.append(i)
        width = w
    groups.append(current)
    return _split_until_divisible(groups, padded, config.dp_size, len(lengths))


def _plan_padded(lengths, padded, config):
    """The baseline: ``padded_rows`` consecutive samples per micro-batch, padded to their longest."""
    groups = [
        list(range(lo, min(lo + config.padded_rows, len(lengths)))) for lo in range(0, len(lengths), config.padded_rows)
    ]
    return _split_until_divisible(groups, padded, config.dp_size, len(lengths))


def _split_until_divisible(groups, padded, dp, num_samples):
    """Split the micro-batches with the most rows until their count is a multiple of DP."""
    if num_samples < -(-len(groups) // dp) * dp:
        raise ValueError(
            f"Cannot give {dp} data-parallel ranks the same number of micro-batches with only {num_samples} "
            f"samples in the global batch (need at least {-(-len(groups) // dp) * dp})."
        )
    heap = [(-len(g), k) for k, g in enumerate(groups)]
    heapq.heapify(heap)
    while len(groups) % dp:
        _, k = heapq.heappop(heap)
        g = groups[k]
        half = len(g) // 2
        groups[k], extra = g[:half], g[half:]
        groups.append(extra)
        heapq.heappush(heap, (-len(groups[k]), k))
        heapq.heappush(heap, (-len(extra), len(groups) - 1))
    shapes = [(len(g), int(padded[np.asarray(g)].max())) for g in groups]
    return groups, shapes


def verify_plan_across_ranks(plan: StepPlan, group) -> None:
    """Raise a clear error (not a hang) when the ranks of ``group`` planned different steps.

    One small all-gather of the plan's fingerprint; every rank of the group must call this.
    """
    import torch
    import torch.distributed as dist

    digest = np.frombuffer(bytes.fromhex(plan.fingerprint())[:16], dtype=np.int64).copy()
    mine = torch.from_numpy(digest)
    world = dist.get_world_size(group)
    gathered = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine, group=group)
    differing = [r for r, t in enumerate(gathered) if not torch.equal(t, gathered[0])]
    if differing:
        raise ValueError(
            f"Step plans differ across ranks (ranks {differing} disagree with rank 0 of the group). Every rank "
            "must plan the same global batch with the same config: check the data loader's seed and sharding, "
            f"the batch size and train_mb_tokens. This rank planned {len(plan.lengths)} samples, "
            f"{plan.num_microbatches} micro-batches per rank."
        )
