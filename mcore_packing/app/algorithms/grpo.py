"""``algorithm=grpo``: the clipped policy gradient (``loss_fn``) on rollouts your inference engine wrote
(``grpo.rollouts``, JSONL), whole groups per step (``grpo.num_prompts_per_step``), through `rl.rl_step`.

Every rank reads the same file. The unit a step draws is a group (all responses to one prompt, responses
in file order). Generation is the user's inference engine's job; this file is what it wrote.
"""

from __future__ import annotations

from collections.abc import Sequence

from ...losses.rollouts import (
    Rollout,
    check_generation_logprobs,
    check_rollouts,
    check_routed_experts,
    group_members,
    minibatches,
    read_rollouts_jsonl_located,
    rollout_samples,
    rollouts_shared_prefix,
)
from ..config import ConfigError
from ..run_settings import budget_key
from . import RunData, StoreSamples, open_prepared, step_metrics


def check_config(cfg) -> None:
    batched = cfg.sequence_packing.enabled or cfg.dynamic_batching.enabled
    if cfg.loss_fn.aggregation == "prompt-mean" and not batched:
        raise ConfigError(
            "loss_fn.loss_agg_mode=prompt-mean averages each prompt's responses in one micro-batch: it needs "
            "sequence_packing.enabled=true or dynamic_batching.enabled=true (or another loss_fn.loss_agg_mode)."
        )
    if cfg.grpo.keep_groups_together and not batched:
        raise ConfigError(
            "grpo.keep_groups_together=true keeps a group in one micro-batch: it needs sequence_packing.enabled="
            "true or dynamic_batching.enabled=true. Set grpo.keep_groups_together=false for padded batches."
        )
    if cfg.grpo.shared_prefix:
        _check_shared_prefix(cfg)
    if cfg.grpo.router_replay:
        _check_router_replay(cfg)


def _check_router_replay(cfg) -> None:
    """``grpo.router_replay``: the rollouts' JSONL (a store holds no routes), no full recompute (the model
    is checked with the data: `_load_jsonl`)."""
    why = None
    if cfg.data.prepared is not None:
        why = ("prepared stores do not hold routed_experts yet: train from the JSONL (grpo.rollouts=FILE, "
               "data.prepared=null)")  # fmt: skip
    elif cfg.model.recompute_granularity == "full":
        why = ("a fully recomputed forward could meet another micro-batch's routes: set "
               "model.recompute_granularity=none or selective")  # fmt: skip
    if why is not None:
        raise ConfigError(f"grpo.router_replay=true: {why}, or set grpo.router_replay=false.", key="grpo.router_replay")


def _check_shared_prefix(cfg) -> None:
    """``grpo.shared_prefix``: packed rows or dynamic batching on one CP rank, the built-in attention, a dense
    model."""
    why = None
    if not (cfg.sequence_packing.enabled or cfg.dynamic_batching.enabled):
        why = ("it lays each group out in a THD row: set sequence_packing.enabled=true or "
               "dynamic_batching.enabled=true")  # fmt: skip
    elif cfg.parallel.cp > 1 or cfg.context_parallel.dynamic:
        why = f"it runs without context parallelism (parallel.cp={cfg.parallel.cp}): set parallel.cp=1"
    elif cfg.model.attention_backend == "te":
        why = "it needs the built-in attention (a response sees its prompt's keys): set model.attention_backend=local"
    elif cfg.model.num_experts:
        why = "it runs dense models only for now (model.num_experts is set)"
    if why is not None:
        raise ConfigError(f"grpo.shared_prefix=true: {why}, or set grpo.shared_prefix=false.", key="grpo.shared_prefix")


def missing_data(cfg) -> str | None:
    if cfg.grpo.rollouts or cfg.data.prepared:
        return None
    return "grpo.rollouts is not set: layout and config checked; set it to plan the first step"


def load_data(cfg) -> RunData:
    """Read and check ``grpo.rollouts`` (errors name the line, rollout or group and the fix), or open the
    store of rollouts ``data.prepared`` names (``prepare --kind rollouts``: checked already)."""
    data = _load_prepared(cfg) if cfg.data.prepared is not None else _load_jsonl(cfg)
    grpo, where = cfg.grpo, cfg.data.prepared or cfg.grpo.rollouts
    members = group_members(sample_groups(data))
    want = grpo.num_generations_per_prompt
    if want is not None:
        wrong = [(data.records[idx[0]].group_id, len(idx)) for idx in members.values() if len(idx) != want]
        if wrong:
            raise ConfigError(
                f"grpo.num_generations_per_prompt={want}, but group(s) {wrong[:5]} (id, responses) differ in "
                f"{where}. Fix the file, or set grpo.num_generations_per_prompt=null to accept any group size."
            )
    if grpo.num_prompts_per_step > len(members):
        raise ConfigError(
            f"grpo.num_prompts_per_step={grpo.num_prompts_per_step} is more than the {len(members)} groups in "
            f"{where}. Lower it, or write more rollouts."
        )
    if cfg.loss_fn.use_importance_sampling_correction:
        _check_generation_logprobs(data, where)
    return data


def _check_generation_logprobs(data: RunData, where: str) -> None:
    """The importance-sampling correction needs every rollout's generation log-probs (never weight 1 unsaid)."""
    records = data.records
    if isinstance(records, StoreRollouts):
        missing = records.store.without_logprobs().tolist()
        example = f" (e.g. rollout {missing[0]})" if missing else ""
    else:
        missing = [i for i, r in enumerate(records) if r.generation_logprobs is None]
        example = f" (e.g. line {missing[0] + 1})" if missing else ""
    try:
        check_generation_logprobs(missing, len(records), where=f" in {where}", example=example)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def _load_jsonl(cfg) -> RunData:
    grpo = cfg.grpo
    if not grpo.rollouts:
        raise ConfigError(
            "algorithm=grpo needs grpo.rollouts=/path/rollouts.jsonl: one JSON object per sampled response with "
            "prompt_tokens, response_tokens, reward, group_id (and optionally generation_logprobs), written by "
            "your inference engine; or data.prepared=STORE written by prepare --kind rollouts."
        )
    try:
        rollouts, names = read_rollouts_jsonl_located(grpo.rollouts)
        check_rollouts(rollouts, grpo=True, names=names)
    except (ValueError, FileNotFoundError) as exc:
        raise ConfigError(f"grpo.rollouts: {exc}") from None
    groups = list(group_members([r.group_id for r in rollouts]).values())
    largest = max(max(*r.prompt_tokens, *r.response_tokens, 0) for r in rollouts)
    if grpo.router_replay:
        shape = cfg.model.shape(int(largest) + 1)
        if not shape.is_moe:
            raise ConfigError("grpo.router_replay=true replays the experts of a Mixture-of-Experts model; this model "
                              "is dense. Set grpo.router_replay=false.", key="grpo.router_replay")  # fmt: skip
        try:
            check_routed_experts(rollouts, moe_layers=sum(shape.moe_layers()), topk=shape.moe_router_topk,
                                 num_experts=shape.num_experts, names=names)  # fmt: skip
        except ValueError as exc:
            raise ConfigError(f"grpo.rollouts: {exc}", key="grpo.router_replay") from None
    info = {"source": "rollouts", "path": grpo.rollouts, "rollouts": len(rollouts), "groups": len(groups),
            "tokenizer": "the rollouts' own token ids"}  # fmt: skip
    samples = rollout_samples(rollouts, routes=grpo.router_replay)
    return RunData(samples=samples, vocab_size=int(largest) + 1, info=info, units=groups,
                   records=rollouts, fingerprint_extra=[[r.reward, str(r.group_id)] for r in rollouts])  # fmt: skip


def _load_prepared(cfg) -> RunData:
    store = open_prepared(cfg, "rollouts", instead_of="grpo.rollouts")
    groups = list(group_members(store.group_ids).values())
    largest = store.manifest["counts"]["max_token_id"]
    info = {**store.info, "rollouts": len(store), "groups": len(groups)}
    return RunData(samples=StoreSamples(store, range(len(store))), vocab_size=largest + 1, info=info, units=groups,
                   records=StoreRollouts(store), lengths=store.lengths.tolist(), fingerprint=store.fingerprint,
                   max_token_id=largest)  # fmt: skip


class StoreRollouts(Sequence):
    """A rollouts store's `Rollout` s, each read from the memory maps on access as lists, as the JSONL
    reader makes them (the prompt ends where the learned span starts)."""

    def __init__(self, store):
        self.store = store

    def __len__(self) -> int:
        return len(self.store)

    def __getitem__(self, i: int) -> Rollout:
        tokens, prompt, logprobs = self.store[i].tokens.tolist(), int(self.store.spans(i)[0]), self.store.logprobs(i)
        return Rollout(prompt_tokens=tokens[:prompt], response_tokens=tokens[prompt:], reward=self.store.rewards[i],
                       group_id=self.store.group_ids[i],
                       generation_logprobs=None if logprobs is None else logprobs.tolist())  # fmt: skip


def sample_groups(data: RunData) -> list:
    """Each sample's group id, from the units (one rollout read per group, not every sample)."""
    out: list = [None] * len(data.samples)
    for members in data.units:
        group = data.records[members[0]].group_id
        for i in members:
            out[i] = group
    return out


def check_data(cfg, data: RunData, step_config) -> None:
    """With ``grpo.shared_prefix`` every group of a JSONL file answers one prompt. With
    ``grpo.keep_groups_together`` every group must fit one micro-batch of the log-prob pass, and
    every DP rank needs a group of its own; with ``loss_fn.loss_agg_mode=prompt-mean`` every group must
    fit one micro-batch of the training pass."""
    if cfg.grpo.shared_prefix and isinstance(data.records, list):  # a file read whole: every group now (a
        try:  # prepared store's rollouts are read per step, and checked there)
            rollouts_shared_prefix(data.records)
        except ValueError as exc:
            raise ConfigError(f"{exc} ({cfg.grpo.rollouts})", key="grpo.shared_prefix") from None
    if cfg.loss_fn.aggregation == "prompt-mean":
        _check_groups_fit(cfg, data, step_config, forward_only=False,
                          why="loss_fn.loss_agg_mode=prompt-mean averages each prompt's responses in one micro-batch "
                              "of the training pass.")  # fmt: skip
    if not cfg.grpo.keep_groups_together:
        return
    prompts = cfg.grpo.num_prompts_per_step
    if prompts < step_config.layout.dp:
        raise ConfigError(
            f"grpo.num_prompts_per_step={prompts} is fewer than the {step_config.layout.dp} data-parallel ranks: with "
            "grpo.keep_groups_together=true every rank needs a whole group. Raise it, or set it to false."
        )
    _check_groups_fit(cfg, data, step_config, forward_only=True,
                      why="grpo.keep_groups_together=true keeps each group in one micro-batch of the log-prob pass; "
                          "set it to false to let groups split.")  # fmt: skip


def _check_groups_fit(cfg, data: RunData, step_config, *, forward_only: bool, why: str) -> None:
    """Every group fits one micro-batch of the pass (``forward_only``: the log-prob pass), else a
    `ConfigError` naming the budget's key and ``why`` the groups stay whole."""
    key = budget_key(step_config, forward_only=forward_only, cfg=cfg)
    try:
        step_config.check_groups_fit(list(data.sample_lengths()), sample_groups(data), forward_only=forward_only,
                                     key=key)  # fmt: skip
    except ValueError as exc:
        raise ConfigError(f"{exc} ({why})") from None


BATCH_KEY = "grpo.num_prompts_per_step"  # the key of batch_units


def batch_units(cfg) -> int:
    return cfg.grpo.num_prompts_per_step  # at most the groups in the file: checked by load_data


def optimizer_steps(cfg) -> int:
    return cfg.grpo.num_minibatches


def training_passes(cfg, data: RunData, batch_ids: list[int]) -> list[tuple[list[int], list | None]]:
    """One plan per minibatch (``grpo.num_minibatches`` runs of whole groups), as `rl.rl_step` plans its
    training pass: the loss is per sample, so groups may split, except under
    ``loss_fn.loss_agg_mode=prompt-mean``, whose groups each share a micro-batch."""
    group_ids = [data.records[i].group_id for i in batch_ids]
    per_prompt = cfg.loss_fn.aggregation == "prompt-mean"
    return [([batch_ids[i] for i in part], [group_ids[i] for i in part] if per_prompt else None)
            for part in minibatches(group_ids, cfg.grpo.num_minibatches)]  # fmt: skip


def shared_prefix(cfg, data: RunData, batch_ids: list[int]):
    """The training pass's `SharedPrefix` of ``batch_ids`` with ``grpo.shared_prefix`` (else None)."""
    if not cfg.grpo.shared_prefix:
        return None
    return rollouts_shared_prefix([data.records[i] for i in batch_ids])


def make_step(cfg, inputs, setup):
    """``take_step(rollout_ids)`` runs `rl.rl_step` on those rollouts (whole groups). The reference policy
    is built once, from the policy's starting weights, only when the KL penalty needs it."""
    from ...rl import rl_step
    from ..model_setup import build_model

    reference = None
    if cfg.loss_fn.reference_policy_kl_penalty > 0:
        reference = build_model(cfg, inputs.shape, inputs.layout, process_groups=setup.policy.process_groups)

    def take_step(batch_ids: list[int]):
        rollouts = [inputs.data.records[i] for i in batch_ids]
        result = rl_step(setup.policy, rollouts, inputs.step_config, loss=cfg.loss_fn, grpo=cfg.grpo,
                         reference=reference)  # fmt: skip
        extra = step_metrics(result.metrics, logprob_pass_s=result.logprob_seconds, train_pass_s=result.train_seconds)
        return result.plan, result.outcome, extra

    return take_step
