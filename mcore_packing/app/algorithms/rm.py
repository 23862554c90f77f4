"""``algorithm=rm``: a Bradley-Terry reward model on (chosen, rejected) pairs from ``rm.pairs`` (JSONL, DPO's
forms and checks) or a store of pairs (``data.prepared``), ``training.global_batch_size`` pairs per step,
through `rl.rm_step`.

The model ends in a score head (`megatron.reward_head`, ``head="reward"``): from ``model.hf_path`` the
causal LM's body (its ``lm_head`` unread) and a seeded head, or a ``*ForSequenceClassification`` folder's
``score.weight``. No reference model. Each pair is kept in one micro-batch (packing or dynamic batching).
"""

from __future__ import annotations

from . import RunData, step_metrics
from . import dpo as _pairs

BATCH_KEY = _pairs.BATCH_KEY
batch_units = _pairs.batch_units
optimizer_steps = _pairs.optimizer_steps
training_passes = _pairs.training_passes
HEAD = "reward"  # the model this algorithm trains ends in a reward head (`megatron.build_policy`)


def check_config(cfg) -> None:
    _pairs.check_config(cfg, "rm")


def missing_data(cfg) -> str | None:
    return _pairs.missing_data(cfg, "rm")


def load_data(cfg) -> RunData:
    return _pairs.load_data(cfg, "rm")


def check_data(cfg, data: RunData, step_config) -> None:
    _pairs.check_data(cfg, data, step_config, "rm")


def make_step(cfg, inputs, setup):
    """``take_step(sample_ids)`` (whole pairs, in pair order) runs `rl.rm_step`."""
    from ...rl import rm_step

    def take_step(batch_ids: list[int]):
        samples = [inputs.data.samples[i] for i in batch_ids]
        result = rm_step(setup.policy, samples, inputs.step_config, rm=cfg.rm)
        return result.plan, result.outcome, step_metrics(result.metrics, train_pass_s=result.train_seconds)

    return take_step
