"""``algorithm=sft``: the next-token NLL on ``data.*`` (the learned tokens of each sample)."""

from __future__ import annotations

from dataclasses import asdict

from ...data.sft import evenly_spaced, load_sft_data
from ...planning import plan_step
from ..config import ConfigError
from . import RunData, StoreSamples, batch_samples, open_prepared


def check_config(cfg) -> None:
    """Nothing beyond the groups' own checks."""


def missing_data(cfg) -> str | None:
    return None


def load_data(cfg) -> RunData:
    """The SFT samples (``data.*``, the checkpoint's tokenizer with ``model.hf_path``; or a store written by
    ``prepare``, ``data.prepared``); a missing file or field is a config error."""
    if cfg.data.prepared is not None:
        return load_prepared(cfg)
    try:
        fields = {k: v for k, v in asdict(cfg.data).items() if k != "prepared"}
        data = load_sft_data(**fields, tokenizer_path=cfg.model.hf_path)
    except (ValueError, FileNotFoundError) as exc:
        raise ConfigError(f"data: {exc}") from None
    return RunData(samples=data.samples, vocab_size=data.vocab_size, info=data.info)


def load_prepared(cfg) -> RunData:
    """A prepared store's samples, read from its memory maps when a step needs them; ``data.num_samples``
    picks that many evenly spaced ones (as from a JSONL file). With ``model.hf_path`` the store must have
    been tokenized by that checkpoint's tokenizer."""
    store = open_prepared(cfg, "sft")
    _warn_ignored_data_keys(cfg, store)
    ids = evenly_spaced(len(store), cfg.data.num_samples)
    return RunData(
        samples=StoreSamples(store, ids),
        vocab_size=store.vocab_size,
        info={**store.info, "num_samples": len(ids)},
        lengths=store.lengths[ids].tolist(),  # Python ints, as measured lengths are
        fingerprint=f"{store.fingerprint}:{len(ids)}",
        max_token_id=store.manifest["counts"]["max_token_id"],
    )


def _warn_ignored_data_keys(cfg, store) -> None:
    """The store's tokenization settings are the ones its samples have: say which set keys lose."""
    import warnings

    from ..config import DataConfig

    unset = DataConfig()
    for key, value in store.manifest["settings"].items():
        ours = getattr(cfg.data, key)
        if ours != getattr(unset, key) and ours != value:
            warnings.warn(f"data.{key}={ours} is ignored: {cfg.data.prepared} was prepared with {key}={value} "
                          "(prepare it again to change it).", stacklevel=2)  # fmt: skip


def check_data(cfg, data: RunData, step_config) -> None:
    """Nothing beyond the budget check every algorithm gets."""


BATCH_KEY = "training.global_batch_size"  # the key of batch_units


def batch_units(cfg) -> int:
    return cfg.training.global_batch_size


def optimizer_steps(cfg) -> int:
    return 1


def training_passes(cfg, data: RunData, batch_ids: list[int]) -> list[tuple[list[int], None]]:
    """One plan of the whole batch, no groups."""
    return [(list(batch_ids), None)]


def make_step(cfg, inputs, setup):
    """``take_step(sample_ids) -> (plan, StepOutcome, None)``: plan the batch, then one `train_step`."""
    from ...megatron import nll_loss, train_step

    loss = nll_loss(cfg.training.loss_normalization)

    def take_step(batch_ids: list[int]):
        ((ids, _),) = training_passes(cfg, inputs.data, batch_ids)
        plan = plan_step([inputs.lengths[i] for i in ids], inputs.step_config)
        samples = batch_samples(inputs.data, batch_ids)  # a store's: each rank reads its own micro-batches only
        return plan, train_step(setup.policy, samples, plan, loss=loss), None

    return take_step
