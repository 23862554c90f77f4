"""Planning: the lengths of a global batch -> micro-batches per data-parallel rank, and their cost.

numpy only; never imports torch, so a login node can plan (and `python -m mcore_packing plan` can run)
without a GPU stack. Modules, in the order the data flows through them:

- `layout`: `ParallelLayout`, the one description of the parallel layout (its padding rules, world size).
- `padding`: `PaddingRule`, the per-sequence multiples CP needs and the per-row ones of SP and FP8.
- `model_shape`: `ModelShape`, the one description of a model's dimensions.
- `cost_model`: `CostModel`, a*s + b*s^2 per sequence from a shape, or calibrated from step times.
- `step_config`: `StepPlanConfig` (NeMo-RL keys), its one translation from config sections and its one
  budget check.
- `balance`: micro-batches to DP ranks by cost with equal counts; orders within a rank.
- `rebalance`: single sequences moved between ranks' rows until the slowest rank is near the mean.
- `pipeline`: a 1F1B schedule simulator, its lower bound and the order that minimises it.
- `hf_config`: Hugging Face ``config.json`` <-> `ModelShape`.
- `shared_prefix`: `SharedPrefix` (which samples share a prompt) -> the tokens and cost of laying each
  group's prompt out once (`shared_prefix_layout`).
- `step_plan`: `plan_step` -> `StepPlan` of `MicroBatchPlan`s.
- `report`: a whole data set planned batch by batch (`summarize`, `recommend_budget`).
"""

from .balance import BALANCES, ORDERS, assign_balanced, assign_round_robin, max_over_mean, order_microbatches
from .cost_model import CostModel
from .layout import ParallelLayout
from .model_shape import ModelShape
from .padding import FP8_ROW_ALIGNMENT, PaddingRule, fp8_row_alignment
from .pipeline import best_pipeline_order, pipeline_lower_bound, simulate_1f1b
from .rebalance import rebalance_units
from .report import recommend_budget, summarize
from .shared_prefix import SharedPrefix, SharedPrefixLayout, shared_prefix_layout
from .step_config import MODES, StepPlanConfig
from .step_plan import MicroBatchPlan, StepPlan, micro_batch_cost, plan_step

__all__ = [
    "BALANCES",
    "FP8_ROW_ALIGNMENT",
    "MODES",
    "ORDERS",
    "CostModel",
    "MicroBatchPlan",
    "ModelShape",
    "PaddingRule",
    "ParallelLayout",
    "SharedPrefix",
    "SharedPrefixLayout",
    "StepPlan",
    "StepPlanConfig",
    "assign_balanced",
    "assign_round_robin",
    "best_pipeline_order",
    "fp8_row_alignment",
    "max_over_mean",
    "micro_batch_cost",
    "order_microbatches",
    "pipeline_lower_bound",
    "plan_step",
    "rebalance_units",
    "recommend_budget",
    "shared_prefix_layout",
    "simulate_1f1b",
    "summarize",
]
