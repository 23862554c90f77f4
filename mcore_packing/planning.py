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

from .batch import PaddingRule
from .packing import DEFAULT_ALGORITHM, get_packer, resolve_algorithm
from .packing.validation import as_lengths

__all__ = ["MODES", "ORDERS", "MicroBatchPlan", "StepPlan", "StepPlanConfig", "plan_step", "verify_plan_across_ranks"]

MODES = ("packing", "dynamic", "padded")
ORDERS = ("packer", "largest_first")


@dataclass(frozen=True, kw_only=True)
class StepPlanConfig:
    """How one global batch becomes micro-batches.

    Attributes:
        mode: ``packing`` (THD rows) or ``dynamic`` (padded BSHD micro-batches of similar lengths).
        train_mb_tokens: tokens one rank processes per training micro-batch (per GPU, after the CP split).
        logprob_mb_tokens: the same for forward-only passes (log-probs); defaults to ``train_mb_tokens``.
        algorithm: packing algorithm (packing mode).
        microbatch_order: ``packer`` or ``largest_first``.
        sequence_length_round: per-sequence length alignment (NeMo-RL's key).
        dp_size, tp_size, pp_size, cp_size, sequence_parallel: the parallel layout.
        fp8_alignment: per-sequence alignment for FP8 (16), 1 when off.
        fixed_length: packing mode: pad every row to the full ``train_mb_tokens * cp`` (PP without
            variable sequence lengths needs one shape). Default: on when ``pp_size > 1``.
    """

    mode: str = "packing"
    train_mb_tokens: int = 4096
    logprob_mb_tokens: int | None = None
    algorithm: str = DEFAULT_ALGORITHM.value
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

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(
                f"mode must be 'packing', 'dynamic' or 'padded', got {self.mode!r}. Packing fills THD rows with "
                "whole sequences; dynamic batching groups similar lengths into padded micro-batches; padded is "
                "the baseline (padded_rows consecutive samples padded to their longest). Pick one."
            )
        if self.microbatch_order not in ORDERS:
            raise ValueError(f"microbatch_order must be one of {ORDERS}, got {self.microbatch_order!r}.")
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
        resolve_algorithm(self.algorithm)
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
            "micro_batches": [[(mb.sample_indices, mb.shape) for mb in rank] for rank in self.micro_batches],
        }
        return hashlib.sha256(json.dumps(payload, sort_keys=True, default=list).encode()).hexdigest()

    def stats(self) -> dict:
        real = sum(mb.real_tokens for rank in self.micro_batches for mb in rank)
        padded = sum(mb.padded_tokens for rank in self.micro_batches for mb in rank)
        per_rank = [sum(mb.padded_tokens for mb in rank) for rank in self.micro_batches]
        return {
            "num_microbatches_per_rank": self.num_microbatches,
            "real_tokens": real,
            "padded_tokens": padded,
            "utilization": real / padded if padded else 1.0,
            "rank_tokens_max_over_mean": max(per_rank) / (sum(per_rank) / len(per_rank)) if padded else 1.0,
        }


def plan_step(lengths: Sequence[int] | np.ndarray, config: StepPlanConfig, *, forward_only: bool = False) -> StepPlan:
    """Plan one global batch (see the module docstring)."""
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
    if config.mode == "packing":
        groups, shapes = _plan_packing(lengths, padded, capacity, config, forward_only)
    elif config.mode == "dynamic":
        groups, shapes = _plan_dynamic(lengths, padded, capacity, config)
    else:
        groups, shapes = _plan_padded(lengths, padded, config)
    micro = [
        MicroBatchPlan(tuple(int(i) for i in g), shape, int(lengths[np.asarray(g)].sum()))
        for g, shape in zip(groups, shapes, strict=True)
    ]
    per_rank = _assign_to_ranks(micro, config.dp_size)
    if config.microbatch_order == "largest_first":
        per_rank = [sorted(rank, key=lambda mb: -mb.padded_tokens) for rank in per_rank]
    return StepPlan(
        config=config,
        forward_only=forward_only,
        lengths=tuple(int(x) for x in lengths),
        micro_batches=tuple(tuple(rank) for rank in per_rank),
        extra={"row_capacity": capacity},
    )


def _plan_packing(lengths, padded, capacity, config, forward_only):
    packer = get_packer(config.algorithm, capacity, bin_count_multiple=config.dp_size, seed=0)
    bins = packer.pack(padded)
    multiple = config.padding_rule.total_multiple
    shapes = []
    for b in bins:
        row = int(padded[b].sum())
        row = -(-row // multiple) * multiple
        shapes.append((1, capacity if config.use_fixed_length else row))
    return bins, shapes


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


def _assign_to_ranks(micro: list[MicroBatchPlan], dp_size: int) -> list[list[MicroBatchPlan]]:
    """Heaviest first, each to the least-loaded rank that still needs micro-batches (equal counts)."""
    if len(micro) % dp_size:
        raise AssertionError(f"{len(micro)} micro-batches do not split over {dp_size} ranks")
    per_rank_count = len(micro) // dp_size
    order = sorted(range(len(micro)), key=lambda k: (-micro[k].padded_tokens, k))
    heap = [(0, r) for r in range(dp_size)]
    ranks: list[list[int]] = [[] for _ in range(dp_size)]
    for k in order:
        load, r = heapq.heappop(heap)
        ranks[r].append(k)
        if len(ranks[r]) < per_rank_count:
            heapq.heappush(heap, (load + micro[k].padded_tokens, r))
    return [[micro[k] for k in sorted(rank)] for rank in ranks]


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
