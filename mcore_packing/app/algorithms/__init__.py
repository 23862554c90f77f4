"""Training algorithms as modules behind one small protocol, so adding one is adding one module.

Each module (`sft`, `grpo`, `dpo`) has:

    check_config(cfg)                     config-only checks (`config.validate_layout` runs them, before data)
    missing_data(cfg) -> str | None       why a dry run cannot plan a first step (None: it can)
    load_data(cfg) -> RunData             the samples, the units a step draws, the vocabulary, a description
    check_data(cfg, data, step_config)    checks that need the data and the planner (before Megatron starts)
    batch_units(cfg) -> int               units drawn per step
    optimizer_steps(cfg) -> int           optimizer steps per training step (the LR schedule counts them)
    training_passes(cfg, data, ids)       -> [(sample ids, group ids | None), ...]: the training pass's
                                          `plan_step` calls for a drawn batch (the dry run and `plan` plan these)
    make_step(cfg, inputs, setup)         -> take_step(sample_ids) -> (plan, StepOutcome, extra metrics)

The trainer (`app.trainer`) draws units with the seeded `GlobalBatchSampler` (samples for SFT, groups of
responses for GRPO, (chosen, rejected) pairs for DPO), turns them into sample ids (`RunData.sample_ids`)
and calls the algorithm's step; checkpoints, resume, stop requests, metrics and export are shared.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from importlib import import_module

from ...data.sample import SequenceSample

__all__ = ["ALGORITHMS", "RunData", "get_algorithm", "refuse_prepared_data", "step_metrics"]

ALGORITHMS = ("sft", "grpo", "dpo")


def get_algorithm(name: str):
    """The module of algorithm ``name`` (one of `ALGORITHMS`)."""
    if name not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {', '.join(ALGORITHMS)}; got {name!r}.")
    return import_module(f".{name}", __name__)


def refuse_prepared_data(cfg, reads: str) -> None:
    """``data.prepared`` holds SFT samples; an algorithm reading ``reads`` refuses it, naming the key."""
    if cfg.data.prepared is not None:
        from ..config import ConfigError

        raise ConfigError(
            f"data.prepared is read by algorithm=sft in this version; algorithm={cfg.algorithm} reads {reads}. "
            "Unset data.prepared.", key="data.prepared",
        )  # fmt: skip


def step_metrics(metrics: dict, **pass_seconds: float) -> dict:
    """An RL step's metrics for `MetricsLogger.log_step`'s ``extra``: without the gradient norm and the
    update flag (the `StepOutcome` logs those), with the seconds of each pass."""
    extra = {k: v for k, v in metrics.items() if k not in ("grad_norm", "update_applied")}
    extra.update(pass_seconds)
    return extra


@dataclass(frozen=True)
class RunData:
    """What an algorithm trains on: the samples (token ids and learned mask), ``units`` (the sample
    indices of each unit a step draws; None: each sample is a unit), the smallest vocabulary that holds
    the ids, a description for the log, ``records`` (the algorithm's own records, index-aligned with the
    samples: rollouts, pairs), and ``fingerprint_extra`` (what identifies the data beyond its tokens). A
    prepared store also gives the lengths, its fingerprint and its largest id, so nothing reads every
    sample."""

    samples: Sequence[SequenceSample]  # a list, or a prepared store's samples read on access
    vocab_size: int
    info: dict
    units: list[list[int]] | None = None
    records: list | None = None
    fingerprint_extra: list | None = None
    lengths: Sequence[int] | None = None  # known without reading the samples (a prepared store); else measured
    fingerprint: str | None = None  # what identifies the data when it is not hashed sample by sample (a store)
    max_token_id: int | None = None  # the largest id, when known without reading the samples

    def sample_lengths(self) -> Sequence[int]:
        return self.lengths if self.lengths is not None else [len(s) for s in self.samples]

    @property
    def num_units(self) -> int:
        return len(self.samples) if self.units is None else len(self.units)

    def sample_ids(self, unit_ids: Sequence[int]) -> list[int]:
        """The samples of the drawn units, unit by unit."""
        return list(unit_ids) if self.units is None else [i for u in unit_ids for i in self.units[u]]
