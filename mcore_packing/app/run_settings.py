"""What a `TrainConfig` means for a run: its layout (checks that span groups or need the world size), the
planner's `StepPlanConfig` (the one config -> plan translation) and the budget key a message names.

    layout = validate_layout(cfg, world)       the run's ParallelLayout, the algorithm's config checks
    check_shape_on_layout(shape, layout)       heads over TP, experts over EP, layers over PP x VPP
    plan = plan_config(cfg, layout)            StepPlanConfig.from_sections, the path NeMo-RL configs take
    check_data_fits(cfg, plan, lengths)        the budget holds the longest sample
"""

from __future__ import annotations

from dataclasses import asdict

from ..planning import CostModel, ModelShape, ParallelLayout, StepPlanConfig, fp8_row_alignment
from .config import ConfigError, TrainConfig
from .memory_settings import memory_model

__all__ = ["budget_key", "check_data_fits", "check_shape_on_layout", "plan_config", "validate_layout"]


def validate_layout(cfg: TrainConfig, world_size: int) -> ParallelLayout:
    """Checks that span groups or need the world size (and the algorithm's config checks); returns the
    run's layout."""
    from .algorithms.registry import get_algorithm

    par = cfg.parallel
    layout = par.layout(world_size)
    get_algorithm(cfg.algorithm).check_config(cfg)
    if par.pp > 1 and cfg.dynamic_batching.enabled and not par.variable_seq_lengths:
        raise ConfigError(
            "dynamic_batching with parallel.pp > 1 needs parallel.variable_seq_lengths=true: its micro-batches "
            "have different shapes."
        )
    _check_dynamic_cp(cfg, layout)
    cfg.optimizer.decay_iters(cfg.optimizer_steps)  # the LR decay must end after the warmup
    return layout


def _check_dynamic_cp(cfg: TrainConfig, layout: ParallelLayout) -> None:
    """``context_parallel.dynamic``: packed or dynamic-batching rows, a power-of-two cp of at least 2, pp=1,
    no fixed shapes."""
    if not cfg.context_parallel.dynamic:
        return
    from ..planning.layout import check_dynamic_cp_layout

    key = "context_parallel.dynamic"
    if layout.cp == 1:
        raise ConfigError(f"{key}=true picks a CP size per sequence up to parallel.cp, which is 1; set parallel.cp "
                          "to 2 or more (a power of two).", key=key)  # fmt: skip
    try:
        check_dynamic_cp_layout(layout, key=key, cp_key="parallel.cp", pp_key="parallel.pp")
    except ValueError as exc:
        raise ConfigError(str(exc), key=key) from None
    if not (cfg.sequence_packing.enabled or cfg.dynamic_batching.enabled):
        raise ConfigError(
            f"{key}=true runs packed THD rows (sequence_packing.enabled=true) or dynamic batching's BSHD rows "
            "(dynamic_batching.enabled=true) on CP sub-groups; with neither, every micro-batch is padded to one "
            "shape. Enable one of them, or use static CP.", key=key,
        )  # fmt: skip
    for name in ("fixed_shape", "cost_budget"):
        if getattr(cfg.sequence_packing, name):
            raise ConfigError(
                f"sequence_packing.{name} does not apply with {key}=true (rows are sized per CP size and scheduled "
                f"by cost); unset sequence_packing.{name}, or use static CP.", key=f"sequence_packing.{name}",
            )  # fmt: skip


def check_shape_on_layout(shape: ModelShape, layout: ParallelLayout) -> None:
    """The model's heads split over TP, its experts over EP and its layers over PP x VPP (a `ConfigError`
    naming the parallel key)."""
    try:
        layout.check_heads(shape.num_attention_heads, shape.kv_heads)
    except ValueError as exc:
        raise ConfigError(str(exc), key="parallel.tp") from None
    try:
        layout.check_experts(shape.num_experts, biased=shape.is_moe and shape.linear_bias)
    except ValueError as exc:
        raise ConfigError(str(exc), key="parallel.ep") from None
    try:
        layout.check_layers(shape.num_layers)
    except ValueError as exc:
        raise ConfigError(str(exc).replace("pp x vpp", "parallel.pp x parallel.vpp"), key="parallel.vpp") from None


def plan_config(cfg: TrainConfig, layout: ParallelLayout, vocab_size: int | None = None) -> StepPlanConfig:
    """The step planner's config for this run on ``layout`` (the one config -> plan translation). Without
    packing or dynamic batching, ``padded`` mode sized to hold ``padded_micro_batch_rows`` of the longest
    samples."""
    par, training = cfg.parallel, cfg.training
    rows = training.padded_micro_batch_rows
    padded = {
        "train_mb_tokens": max(cfg.sequence_packing.train_mb_tokens, cfg.data.max_sample_tokens * rows),
        "padded_rows": rows,
    }
    shape = cfg.model.shape(vocab_size or cfg.data.vocab_size)
    packing, batching = asdict(cfg.sequence_packing), asdict(cfg.dynamic_batching)
    dynamic_cp = cfg.context_parallel.dynamic
    if dynamic_cp and cfg.context_parallel.max_tokens_per_rank is not None:  # both passes' budget per rank
        for section in (packing, batching):
            section.update(train_mb_tokens=cfg.context_parallel.max_tokens_per_rank,
                           logprob_mb_tokens=cfg.context_parallel.max_tokens_per_rank)  # fmt: skip
    try:
        return StepPlanConfig.from_sections(
            sequence_packing=packing,
            dynamic_batching=batching,
            padded=padded,
            sequence_length_divisible_by=par.make_sequence_length_divisible_by,
            balance=training.balance,
            cost_model=CostModel.from_shape(shape),
            layout=layout,
            fixed_length=False if par.variable_seq_lengths else None,
            fp8_alignment=fp8_row_alignment(cfg.model.fp8_recipe),
            dynamic_cp=dynamic_cp,
            memory_model=memory_model(cfg, shape, layout),
        )
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


_MODE_SECTIONS = {"packing": "sequence_packing", "dynamic": "dynamic_batching"}


def budget_key(plan: StepPlanConfig, *, forward_only: bool = False, cfg: TrainConfig | None = None) -> str | None:
    """The config key of the budget that applies (``sequence_packing.logprob_mb_tokens``, ...; with
    ``cfg``'s dynamic CP and its ``max_tokens_per_rank``, that key); None in padded mode, which has no
    section."""
    if cfg is not None and cfg.context_parallel.dynamic and cfg.context_parallel.max_tokens_per_rank is not None:
        return "context_parallel.max_tokens_per_rank"
    section = _MODE_SECTIONS.get(plan.mode)
    return f"{section}.{plan.budget(forward_only)[0]}" if section else None


def check_data_fits(cfg: TrainConfig, plan: StepPlanConfig, lengths) -> None:
    """The budget must hold the longest (padded) sample of the data set: say so before training starts."""
    key = budget_key(plan, cfg=cfg)
    # padded rows: SFT samples are cut to data.max_sample_tokens, rollouts not
    key, fix = (key, "lower data.max_sample_tokens") if key else ("data.max_sample_tokens", "drop them")
    try:
        plan.check_fits(lengths, key=key, fix=fix)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
