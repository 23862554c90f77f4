"""``algorithm=sft``: the next-token NLL on ``data.*`` (the learned tokens of each sample)."""

from __future__ import annotations

from dataclasses import asdict

from ...data.sft import load_sft_data
from ...planning import plan_step
from ..config import ConfigError
from . import RunData


def check_config(cfg) -> None:
    """Nothing beyond the groups' own checks."""


def missing_data(cfg) -> str | None:
    return None


def load_data(cfg) -> RunData:
    """The SFT samples (``data.*``, the checkpoint's tokenizer with ``model.hf_path``); a missing file or
    field is a config error."""
    try:
        data = load_sft_data(**asdict(cfg.data), tokenizer_path=cfg.model.hf_path)
    except (ValueError, FileNotFoundError) as exc:
        raise ConfigError(f"data: {exc}") from None
    return RunData(samples=data.samples, vocab_size=data.vocab_size, info=data.info)


def check_data(cfg, data: RunData, step_config) -> None:
    """Nothing beyond the budget check every algorithm gets."""


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
        samples = [inputs.data.samples[i] for i in batch_ids]
        return plan, train_step(setup.policy, samples, plan, loss=loss), None

    return take_step
