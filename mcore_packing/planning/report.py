"""The plan report: plan a whole data set global batch by global batch, exactly as training would, and
aggregate what packing does to it. numpy only (the planning CLI, `mcore_packing.app.plan_command`,
prints it and draws the figure).

- `summarize`: efficiency, bins against the lower bound ceil(tokens / capacity), micro-batches per rank,
  per-rank imbalance of tokens and of attention-aware cost, padding and compute saved against
  pad-to-longest and pad-to-capacity, the predicted step time (slowest rank; simulated 1F1B under PP)
  against its lower bound (total cost / DP, and the pipeline bound), the fill histogram, and the rows
  below half full with how many of them the equal-count rule forced.
- `recommend_budget`: the smallest ``train_mb_tokens`` whose fill is within one point of the best tried.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from ..packing import get_packer
from .cost_model import CostModel
from .pipeline import pipeline_lower_bound, simulate_1f1b
from .shared_prefix import SharedPrefix
from .step_config import StepPlanConfig
from .step_plan import plan_step

__all__ = ["global_batch_bounds", "recommend_budget", "summarize", "summarize_dynamic_cp"]


@dataclass
class _Tally:
    """Running sums over the planned global batches."""

    dp: int
    planned_tokens: int = 0
    planned_cost: float = 0.0
    padded_tokens: int = 0
    padded_cost: float = 0.0
    lower_bound: int = 0
    micro_batches: int = 0
    token_imbalance: list = field(default_factory=list)
    cost_imbalance: list = field(default_factory=list)
    fills: list = field(default_factory=list)
    rank_tokens: np.ndarray = None
    rank_cost: np.ndarray = None
    predicted: float = 0.0
    bound: float = 0.0
    below_half: int = 0
    below_half_forced: int = 0
    shared: dict | None = None  # the shared-prefix reports summed (`StepPlan.shared_report`)

    def __post_init__(self):
        self.rank_tokens = np.zeros(self.dp)
        self.rank_cost = np.zeros(self.dp)

    def add(self, batch: np.ndarray, config: StepPlanConfig, padded_rows: int, model: CostModel, groups=None,
            shared_prefix: SharedPrefix | None = None) -> None:  # fmt: skip
        plan = plan_step(batch, config, groups=groups, shared_prefix=shared_prefix)
        if plan.shared_report is not None:
            report = plan.shared_report
            self.shared = {key: (self.shared or {}).get(key, [] if key == "fallback_groups" else 0) + report[key]
                           for key in report}  # fmt: skip
        capacity = plan.row_capacity
        self.lower_bound += -(-int(batch.sum()) // capacity)
        tokens = np.array([sum(mb.padded_tokens for mb in rank) for rank in plan.micro_batches], dtype=np.float64)
        costs = np.asarray(plan.rank_costs())
        for rank in plan.micro_batches:
            for mb in rank:
                real = int(batch[np.asarray(mb.sample_indices)].sum())
                # Packing: how full the row capacity is; padded layouts: real / computed tokens.
                self.fills.append(real / (capacity if config.mode == "packing" else mb.padded_tokens))
        self.micro_batches += plan.num_microbatches * config.layout.dp
        self.planned_tokens += int(tokens.sum())
        self.planned_cost += float(costs.sum())
        self.token_imbalance.append(tokens.max() / tokens.mean())
        self.cost_imbalance.append(costs.max() / costs.mean())
        self.rank_tokens += tokens
        self.rank_cost += costs
        t, c = _padded_cost(batch, padded_rows, model, config.layout.cp)
        self.padded_tokens += t
        self.padded_cost += c
        self._step_time(plan, config)
        if config.mode == "packing":
            self._below_half(plan, config, batch)

    def _step_time(self, plan, config: StepPlanConfig) -> None:
        """Predicted step time (the slowest rank; its simulated 1F1B time under PP) and its lower bound."""
        per_rank = [[mb.cost for mb in rank] for rank in plan.micro_batches]
        layout = config.layout
        if layout.pp > 1:
            times = [simulate_1f1b(np.asarray(c) / 3, layout.pp, vpp=layout.vpp, group=layout.microbatch_group)
                     for c in per_rank]  # fmt: skip
            bounds = [pipeline_lower_bound(np.asarray(c) / 3, layout.pp, vpp=layout.vpp) for c in per_rank]
        else:
            times, bounds = [sum(c) for c in per_rank], [0.0]
        self.predicted += max(times)
        self.bound += max(sum(map(sum, per_rank)) / config.layout.dp, max(bounds))

    def _below_half(self, plan, config: StepPlanConfig, batch: np.ndarray) -> None:
        """Rows under half full, and how many of them the equal-count rule forced: the rows beyond what
        packing alone (without a multiple of DP) needs for this batch."""
        fills = [mb.real_tokens / plan.row_capacity for rank in plan.micro_batches for mb in rank]
        below = sum(f < 0.5 for f in fills)
        if below:
            alone = get_packer(config.algorithm, plan.row_capacity, refine=config.refine)
            extra = len(fills) - alone.pack_bins(config.padded_lengths(batch)).num_bins
            self.below_half += below
            self.below_half_forced += min(below, max(extra, 0))


def _padded_cost(lengths: np.ndarray, rows: int, model: CostModel, cp: int) -> tuple[int, float]:
    """Tokens and cost of pad-to-longest micro-batches of ``rows`` consecutive sequences."""
    starts = np.arange(0, lengths.size, rows)
    width = np.maximum.reduceat(lengths, starts).astype(np.float64)
    count = np.diff(np.append(starts, lengths.size)).astype(np.float64)
    tokens = int((width * count).sum())
    cost = float((count * (model.linear * width + model.quadratic * model.attention_area(width))).sum()) / cp
    return tokens, cost


def summarize(
    lengths: np.ndarray,
    config: StepPlanConfig,
    *,
    global_batch_size: int,
    padded_rows: int,
    model: CostModel,
    progress: bool = False,
    batch_sizes: Sequence[int] | None = None,
    groups: Sequence | None = None,
    shared_prefix: SharedPrefix | None = None,
) -> dict:
    """Plan every global batch of ``lengths`` (in order; 0 = one batch) and aggregate the statistics.

    ``batch_sizes`` (default: ``global_batch_size`` each) cuts ``lengths`` into the batches to plan, one
    `plan_step` each, and ``groups`` (a group id per sample, or None) keeps groups in one micro-batch: what
    a training run's passes do (`app.algorithms`' ``training_passes``). ``model`` prices the pad-to-longest
    baseline and the real work; the plan's micro-batches are priced by ``config.cost_model`` (pass the same
    model in both for comparable numbers). ``shared_prefix`` (one entry per sample of ``lengths``): each
    group's prompt laid out once (`planning.shared_prefix`); the summary's ``shared_prefix`` then says the
    tokens and the predicted cost with and without it.
    """
    bounds = global_batch_bounds(lengths.size, global_batch_size, batch_sizes)
    show = progress and len(bounds) >= 200 and sys.stderr.isatty()
    tally = _Tally(dp=config.layout.dp)
    began = time.time()
    for k, (lo, hi) in enumerate(bounds):
        part = None
        if shared_prefix is not None:
            part = SharedPrefix(group_ids=shared_prefix.group_ids[lo:hi],
                                prompt_lengths=shared_prefix.prompt_lengths[lo:hi])  # fmt: skip
        tally.add(lengths[lo:hi], config, padded_rows, model, None if groups is None else list(groups[lo:hi]), part)
        if show and (k % 50 == 0 or k == len(bounds) - 1):
            sys.stderr.write(f"\rplanning global batches: {k + 1}/{len(bounds)} ({time.time() - began:4.1f}s)")
            sys.stderr.write("\n" if k == len(bounds) - 1 else "")
    return _summary(lengths, config, model, tally, len(bounds))


def global_batch_bounds(total: int, global_batch_size: int, batch_sizes: Sequence[int] | None) -> list[tuple[int, int]]:
    """``[(start, end), ...]`` of the batches: ``batch_sizes`` (which must add up to ``total``), else
    consecutive runs of ``global_batch_size`` (0: one batch)."""
    if batch_sizes is None:
        step = global_batch_size if global_batch_size > 0 else total
        return [(lo, min(lo + step, total)) for lo in range(0, total, step)]
    ends = np.cumsum(batch_sizes).tolist()
    if not ends or ends[-1] != total or min(batch_sizes) < 1:
        raise ValueError(f"batch_sizes must be >= 1 and add up to the {total} lengths, got {list(batch_sizes)[:8]}")
    return list(zip([0, *ends[:-1]], ends, strict=True))


def _summary(lengths: np.ndarray, config: StepPlanConfig, model: CostModel, t: _Tally, num_batches: int) -> dict:
    real = int(lengths.sum())
    capacity = config.row_capacity()
    pad_to_capacity = lengths.size * capacity
    return {
        "num_global_batches": num_batches,
        "micro_batches": t.micro_batches,
        "micro_batches_per_rank_per_step": t.micro_batches / num_batches / config.layout.dp,
        "lower_bound": t.lower_bound,
        "packing_efficiency": t.lower_bound / t.micro_batches if t.micro_batches else 1.0,
        "useful_share_planned": real / t.planned_tokens,
        "capacity_fill": real / (t.micro_batches * capacity) if t.micro_batches else 1.0,
        "useful_share_pad_to_longest": real / t.padded_tokens,
        "useful_share_pad_to_capacity": real / pad_to_capacity,
        "padding_saved_vs_pad_to_longest": 1 - (t.planned_tokens - real) / max(t.padded_tokens - real, 1),
        "padding_saved_vs_pad_to_capacity": 1 - (t.planned_tokens - real) / max(pad_to_capacity - real, 1),
        "compute_saved_linear_only": 1 - t.planned_tokens / t.padded_tokens,
        "compute_saved_with_attention": 1 - t.planned_cost / t.padded_cost,
        "attention_share_of_real_work": model.attention_share(lengths),
        "rank_token_imbalance_mean": float(np.mean(t.token_imbalance)),
        "rank_token_imbalance_worst": float(np.max(t.token_imbalance)),
        "rank_cost_imbalance_mean": float(np.mean(t.cost_imbalance)),
        "rank_cost_imbalance_worst": float(np.max(t.cost_imbalance)),
        "real_cost": float(model.sequence_cost(lengths, config.layout.cp).sum()),
        "predicted_step_cost": t.predicted / num_batches,
        "step_cost_lower_bound": t.bound / num_batches,
        "predicted_over_lower_bound": t.predicted / t.bound if t.bound else 1.0,
        "fill_histogram": np.histogram(np.clip(t.fills, 0, 1), bins=10, range=(0, 1))[0].tolist(),
        "below_half_full": t.below_half,
        "below_half_full_forced_by_equal_counts": t.below_half_forced,
        **({"shared_prefix": _shared_summary(t.shared)} if t.shared is not None else {}),
        "_fills": t.fills,
        "_rank_tokens": t.rank_tokens.tolist(),
        "_rank_cost": t.rank_cost.tolist(),
    }


def _shared_summary(shared: dict) -> dict:
    """The shared-prefix sums with the shares they save."""
    return {**shared, "tokens_saved": 1 - shared["computed_tokens"] / shared["separate_tokens"],
            "predicted_compute_saved": 1 - shared["shared_cost"] / shared["separate_cost"]}  # fmt: skip


def recommend_budget(
    lengths: np.ndarray,
    base: StepPlanConfig,
    global_batch_size: int,
    model: CostModel,
    *,
    batch_sizes: Sequence[int] | None = None,
    groups: Sequence | None = None,
) -> dict:
    """Try budgets from the longest padded sample up to 4x it and pick the smallest one that is within one
    point of the best tried: for packing the fill of the row capacity (real tokens / micro-batches x
    capacity), for dynamic batching the useful share of computed tokens. Larger budgets mean fewer,
    bigger micro-batches (less per-micro-batch overhead) and more activation memory."""
    cuts = global_batch_bounds(lengths.size, global_batch_size, batch_sizes)[:20]  # the first 20 batches
    end = cuts[-1][1]
    padded = base.padded_lengths(lengths)
    longest = int(padded.max())
    if groups is not None:  # a group shares one micro-batch: the budget must hold the largest one
        for lo, hi in cuts:
            totals: dict = {}
            for g, n in zip(groups[lo:hi], padded[lo:hi].tolist(), strict=True):
                totals[g] = totals.get(g, 0) + n
            longest = max(longest, *totals.values())
    floor = -(-longest // base.layout.cp)
    candidates = sorted({-(-int(floor * f) // 256) * 256 for f in (1, 1.25, 1.5, 2, 3, 4)})
    sizes = None if batch_sizes is None else [hi - lo for lo, hi in cuts]
    part = None if groups is None else groups[:end]
    key = "capacity_fill" if base.mode == "packing" else "useful_share_planned"
    rows = []
    for budget in candidates:
        cfg = replace(base, train_mb_tokens=budget)
        s = summarize(lengths[:end], cfg, global_batch_size=global_batch_size, padded_rows=base.padded_rows,
                      model=model, batch_sizes=sizes, groups=part)  # fmt: skip
        rows.append(
            {
                "train_mb_tokens": budget,
                "score": s[key],
                "micro_batches_per_rank_per_step": s["micro_batches_per_rank_per_step"],
            }
        )
    best = max(r["score"] for r in rows)
    pick = next(r for r in rows if r["score"] >= best - 0.01)
    return {"recommended_train_mb_tokens": pick["train_mb_tokens"], "criterion": key, "candidates": rows}


def summarize_dynamic_cp(
    lengths, config: StepPlanConfig, *, global_batch_size: int, batch_sizes: Sequence[int] | None = None,
    groups: Sequence | None = None,
) -> dict:  # fmt: skip
    """Dynamic CP (`dynamic_cp.plan_dynamic_cp`, ``max_tokens_per_rank = config.train_mb_tokens``) on the
    same batches as `summarize` (``groups``: a group id per sample, each group in one row), against
    ``config``'s static CP plan with the same cost model: sequences per CP size, micro-batches per rank per
    step and the share of computed tokens that are real (both plans), the slowest rank's finish over the
    mean (dynamic, worst step), and the predicted step time of both (summed over steps)."""
    from .dynamic_cp import DynamicCPConfig, plan_dynamic_cp

    lengths = np.asarray(lengths, dtype=np.int64)
    dynamic_config = DynamicCPConfig.from_step_config(config)
    config = replace(config, dynamic_cp=False)  # the static plan to compare with
    sizes = {k: 0 for k in dynamic_config.sizes}
    static = dynamic = 0.0
    micro = static_micro = 0
    tokens = np.zeros((2, 2))  # [dynamic, static] x [real, padded]
    worst = 0.0  # the slowest rank's finish over the mean, the worst step
    bounds = global_batch_bounds(lengths.size, global_batch_size, batch_sizes)
    for lo, hi in bounds:
        part = None if groups is None else list(groups[lo:hi])
        plan = plan_dynamic_cp(lengths[lo:hi], dynamic_config, groups=part)
        for k, n in plan.cp_size_counts().items():
            sizes[k] += n
        dynamic += plan.predicted_step_time
        micro += plan.num_microbatches
        finish = plan.rank_finish()
        worst = max(worst, float(finish.max() / finish.mean()) if finish.mean() else 1.0)
        static_plan = plan_step(lengths[lo:hi], config, groups=part)
        static += max(static_plan.rank_costs())
        static_micro += static_plan.num_microbatches
        for row, stats in enumerate((plan.stats(), static_plan.stats())):
            tokens[row] += stats["real_tokens"], stats["padded_tokens"]
    return {
        "cp_sizes": sizes,
        "micro_batches_per_rank_per_step": micro / len(bounds),
        "static_micro_batches_per_rank_per_step": static_micro / len(bounds),
        "utilization": tokens[0, 0] / tokens[0, 1],  # real / computed tokens
        "static_utilization": tokens[1, 0] / tokens[1, 1],
        "worst_rank_finish_over_mean": worst,
        "predicted_step_cost": dynamic / len(bounds),
        "static_predicted_step_cost": static / len(bounds),
        "static_over_dynamic": static / dynamic if dynamic else 1.0,
        "exchange_priced": bool(float(dynamic_config.model().cp_exchange(1, 2)) > 0),  # else: FLOPs only
    }
