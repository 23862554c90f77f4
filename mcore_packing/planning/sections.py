"""NeMo-RL's two config sections for cutting a batch, as dataclasses: ``sequence_packing`` and
``dynamic_batching`` (the keys of NeMo-RL's ``policy.sequence_packing`` / ``policy.dynamic_batching``,
plus ours where marked). `StepPlanConfig.from_sections` reads their keys from these classes, and the
trainer's Hydra groups of the same names are these classes, so the schema exists once. No torch.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from ..packing import DEFAULT_ALGORITHM
from ..validators import require_choice, require_positive_int
from .balance import ORDERS
from .memory import parse_bytes

__all__ = ["SECTIONS", "DynamicBatchingConfig", "SequencePackingConfig", "section_keys"]


@dataclass(kw_only=True)
class SequencePackingConfig:
    """Whole sequences concatenated into THD rows of a token budget."""

    enabled: bool = True
    train_mb_tokens: int = 4096  # tokens per GPU per training micro-batch (after the CP split)
    logprob_mb_tokens: int | None = None  # the same for forward-only passes; null: train_mb_tokens
    algorithm: str = DEFAULT_ALGORITHM.value
    refine: bool | None = None  # ours: bin-count refinement after packing; null: the algorithm's default
    microbatch_order: str = "auto"  # auto (pipeline under PP, else packer) | packer | largest_first | bubble | pipeline
    sequence_length_round: int = 1
    cost_budget: Any = None  # ours: None | "auto" | a number: also cap each row's attention-aware cost
    fixed_shape: bool = False  # ours: one shape per micro-batch (full rows, cu_seqlens of fixed length) for CUDA graphs
    memory_budget: Any = None  # ours: bytes per GPU ("72GiB"): micro-batches also under the predicted peak

    def __post_init__(self):
        for name in ("train_mb_tokens", "sequence_length_round"):
            require_positive_int(name, getattr(self, name))
        require_positive_int("logprob_mb_tokens", self.logprob_mb_tokens, allow_none=True)
        require_choice("microbatch_order", self.microbatch_order, ORDERS)
        _check_memory_budget(self.memory_budget)


@dataclass(kw_only=True)
class DynamicBatchingConfig:
    """Similar lengths in padded BSHD rows of a token budget."""

    enabled: bool = False
    train_mb_tokens: int = 4096
    logprob_mb_tokens: int | None = None
    sequence_length_round: int = 1
    memory_budget: Any = None  # ours, as in sequence_packing

    def __post_init__(self):
        for name in ("train_mb_tokens", "sequence_length_round"):
            require_positive_int(name, getattr(self, name))
        require_positive_int("logprob_mb_tokens", self.logprob_mb_tokens, allow_none=True)
        _check_memory_budget(self.memory_budget)


def _check_memory_budget(value) -> None:
    if value is not None:
        parse_bytes(value, key="memory_budget")


SECTIONS = {"sequence_packing": SequencePackingConfig, "dynamic_batching": DynamicBatchingConfig}


def section_keys(name: str) -> frozenset[str]:
    """The keys of section ``name`` (its dataclass's fields)."""
    return frozenset(f.name for f in fields(SECTIONS[name]))
