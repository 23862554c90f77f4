"""Training algorithms as modules behind one small protocol, so adding one is adding one module.

Each module (`sft`, `grpo`, `dpo`, `rm`) has (and optionally ``HEAD``, the model's last layer: "lm" or
"reward", `megatron.build_policy`):

    check_config(cfg)                     config-only checks (`run_settings.validate_layout` runs them, before data)
    missing_data(cfg) -> str | None       why a dry run cannot plan a first step (None: it can)
    load_data(cfg) -> RunData             the samples, the units a step draws, the vocabulary, a description
    check_data(cfg, data, step_config)    checks that need the data and the planner (before Megatron starts)
    batch_units(cfg) -> int               units drawn per step (BATCH_KEY: the config key that sets it)
    optimizer_steps(cfg) -> int           optimizer steps per training step (the LR schedule counts them)
    training_passes(cfg, data, ids)       -> [(sample ids, group ids | None), ...]: the training pass's
                                          `plan_step` calls for a drawn batch (the dry run and `plan` plan these)
    make_step(cfg, inputs, setup)         -> take_step(sample_ids) -> (plan, StepOutcome, extra metrics)

and optionally ``shared_prefix(cfg, data, ids) -> SharedPrefix | None``: the prompts a training pass lays out
once (`planning.shared_prefix`; GRPO with ``grpo.shared_prefix``), which the dry run plans with too.

The trainer (`app.trainer`) draws units with the seeded `GlobalBatchSampler` (samples for SFT, groups of
responses for GRPO, (chosen, rejected) pairs for DPO), turns them into sample ids (`RunData.sample_ids`)
and calls the algorithm's step; checkpoints, resume, stop requests, metrics and export are shared.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ...data.sample import SequenceSample
from .registry import ALGORITHMS, get_algorithm

__all__ = ["ALGORITHMS", "RunData", "StoreSamples", "batch_samples", "get_algorithm", "open_prepared", "step_metrics"]

def open_prepared(cfg, kind: str, *, instead_of: str | None = None):
    """The store ``data.prepared`` names, checked: written by ``prepare --kind <kind>``; tokenized with
    ``model.hf_path``'s tokenizer when both name one; not set together with ``instead_of`` (the algorithm's
    own file key). Every problem is a `ConfigError` naming the key."""
    from ...data.store import PreparedStore
    from ..config import ConfigError

    if instead_of is not None and _config_value(cfg, instead_of):
        raise ConfigError(f"data.prepared and {instead_of} are both set; the run reads one. Unset one of them.",
                          key="data.prepared")  # fmt: skip
    try:
        store = PreparedStore(cfg.data.prepared)
    except (ValueError, FileNotFoundError) as exc:
        raise ConfigError(f"data.prepared: {exc}", key="data.prepared") from None
    if store.kind != kind:
        reads = {"sft": "sft", "pairs": "dpo (or rm)", "rollouts": "grpo"}[store.kind]
        raise ConfigError(f"data.prepared={cfg.data.prepared} holds {store.kind} records; algorithm={cfg.algorithm} "
                          f"reads a store written by prepare --kind {kind}. Set algorithm={reads} for this store.",
                          key="data.prepared")  # fmt: skip
    tokenizer = store.manifest["tokenizer"]
    if cfg.model.hf_path is not None and tokenizer is not None:
        from ...data.hf_tokenizer import ChatTokenizer

        try:
            ours = ChatTokenizer(cfg.model.hf_path).fingerprint
        except FileNotFoundError as exc:
            raise ConfigError(f"model.hf_path: {exc}", key="model.hf_path") from None
        if ours != tokenizer["sha256"]:
            raise ConfigError(
                f"data.prepared={cfg.data.prepared} was tokenized with {tokenizer['name']}, whose tokenizer or chat "
                f"template differs from model.hf_path={cfg.model.hf_path}'s. Prepare the data with --hf-path set to "
                "this model.", key="data.prepared",
            )  # fmt: skip
    return store


def _config_value(cfg, dotted: str):
    """``cfg.<dotted>`` (``"dpo.pairs"``)."""
    value = cfg
    for part in dotted.split("."):
        value = getattr(value, part)
    return value


class StoreSamples(Sequence):
    """Chosen samples of a prepared store, each read from the memory maps on access; ``lengths`` comes
    from the index, so the step's checks read nothing (`megatron.schedule` takes the lengths from it) and
    a rank reads only the samples of its own micro-batches."""

    def __init__(self, store, ids):
        self.store, self.ids = store, np.asarray(ids, dtype=np.int64)

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def lengths(self) -> np.ndarray:
        return np.asarray(self.store.lengths[self.ids])

    def take(self, positions) -> StoreSamples:
        """The samples at ``positions`` of this sequence, still unread."""
        return StoreSamples(self.store, self.ids[np.asarray(positions, dtype=np.int64)])

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        return self.store[int(self.ids[i])]


def batch_samples(data: RunData, ids: Sequence[int]) -> Sequence[SequenceSample]:
    """The drawn samples of a step: still unread for a store (`StoreSamples.take`), else a list."""
    if isinstance(data.samples, StoreSamples):
        return data.samples.take(ids)
    return [data.samples[i] for i in ids]


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
