"""``algorithm=dpo``: Direct Preference Optimization on (chosen, rejected) pairs from ``dpo.pairs`` (JSONL),
``training.global_batch_size`` pairs per step, through `rl.dpo_step`.

The unit a step draws is a pair; each pair is kept in one micro-batch of the training pass (packing or
dynamic batching). Text and chat pairs are tokenized like SFT data (``model.hf_path``'s tokenizer and chat
template, else ``data.encoding`` mapped to ``data.vocab_size``); pairs with a response over
``data.max_sample_tokens`` are dropped and counted. The reference is the policy's starting weights
(``model.hf_path``, else the same seeded initialization), built once.
"""

from __future__ import annotations

from ...data.preference import load_preference_data, pair_ids
from ...losses.rollouts import group_members
from ..config import ConfigError
from ..run_settings import budget_key
from . import RunData, StoreSamples, open_prepared, step_metrics


def check_config(cfg, algorithm: str = "dpo") -> None:
    if not (cfg.sequence_packing.enabled or cfg.dynamic_batching.enabled):
        raise ConfigError(
            f"algorithm={algorithm} keeps each (chosen, rejected) pair in one micro-batch: it needs "
            "sequence_packing.enabled=true or dynamic_batching.enabled=true."
        )


def missing_data(cfg, group: str = "dpo") -> str | None:
    if getattr(cfg, group).pairs or cfg.data.prepared:
        return None
    return f"{group}.pairs is not set: layout and config checked; set it to plan the first step"


def load_data(cfg, group: str = "dpo") -> RunData:
    """Read, check and tokenize ``<group>.pairs`` (errors name ``file:line`` and the fix), or open the store
    of pairs ``data.prepared`` names (``prepare --kind pairs``: tokenized and checked already). ``group``:
    the config group whose ``pairs`` key is read (``dpo``, or ``rm`` for the reward model)."""
    if cfg.data.prepared is not None:
        return _load_prepared(cfg, group)
    pairs = getattr(cfg, group).pairs
    if not pairs:
        raise ConfigError(
            f"algorithm={group} needs {group}.pairs=/path/pairs.jsonl: one JSON object per line with prompt, chosen "
            "and rejected (text or chat messages), or prompt_tokens, chosen_tokens and rejected_tokens; or "
            "data.prepared=STORE written by prepare --kind pairs."
        )
    try:
        data = load_preference_data(
            pairs,
            tokenizer_path=cfg.model.hf_path,
            encoding=cfg.data.encoding,
            vocab_size=cfg.data.vocab_size,
            max_sample_tokens=cfg.data.max_sample_tokens,
        )
    except (ValueError, FileNotFoundError) as exc:
        raise ConfigError(f"{group}.pairs: {exc}") from None
    units = list(group_members(pair_ids(len(data.samples))).values())  # [[0, 1], [2, 3], ...]
    return RunData(samples=data.samples, vocab_size=data.vocab_size, info=data.info, units=units)


def _load_prepared(cfg, group: str) -> RunData:
    store = open_prepared(cfg, "pairs", instead_of=f"{group}.pairs")
    units = list(group_members(pair_ids(len(store))).values())
    return RunData(samples=StoreSamples(store, range(len(store))), vocab_size=store.vocab_size, info=store.info,
                   units=units, lengths=store.lengths.tolist(), fingerprint=store.fingerprint,
                   max_token_id=store.manifest["counts"]["max_token_id"])  # fmt: skip


def check_data(cfg, data: RunData, step_config, group: str = "dpo") -> None:
    """Every pair fits one micro-batch of the training pass."""
    pairs = pair_ids(len(data.samples))
    try:
        step_config.check_groups_fit(list(data.sample_lengths()), pairs, key=budget_key(step_config, cfg=cfg))
    except ValueError as exc:
        raise ConfigError(f"{group}.pairs: {exc} (a pair shares one micro-batch)") from None


BATCH_KEY = "training.global_batch_size"  # the key of batch_units


def batch_units(cfg) -> int:
    return cfg.training.global_batch_size


def optimizer_steps(cfg) -> int:
    return 1


def training_passes(cfg, data: RunData, batch_ids: list[int]) -> list[tuple[list[int], list[int]]]:
    """One plan of the batch (whole pairs, in pair order) with each pair in one micro-batch, as `rl.dpo_step`
    plans its training pass."""
    return [(list(batch_ids), pair_ids(len(batch_ids)))]


def make_step(cfg, inputs, setup):
    """``take_step(sample_ids)`` (whole pairs, in pair order) runs `rl.dpo_step` against the reference."""
    from ...rl import dpo_step
    from ..model_setup import build_model

    reference = build_model(cfg, inputs.shape, inputs.layout, process_groups=setup.policy.process_groups)

    def take_step(batch_ids: list[int]):
        samples = [inputs.data.samples[i] for i in batch_ids]
        result = dpo_step(setup.policy, reference, samples, inputs.step_config, dpo=cfg.dpo)
        seconds = {"reference_pass_s": result.reference_seconds, "train_pass_s": result.train_seconds}
        extra = step_metrics(result.metrics, **seconds)
        return result.plan, result.outcome, extra

    return take_step
