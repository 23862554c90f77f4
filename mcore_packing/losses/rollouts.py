"""Rollouts for the policy step: checked, turned into training samples, and given GRPO advantages.

A `Rollout` is one sampled response: the prompt's tokens, the response's tokens, its reward, the group
(the prompt it answers) and optionally the inference engine's per-token log-probs of the response and,
for Mixture-of-Experts router replay, the experts it chose for every token (``routed_experts``).
`check_rollouts` refuses what would silently corrupt a step (an empty response, a NaN reward, log-probs
of the wrong length, a group of one under GRPO), naming the rollout and the fix.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..data.jsonl import BadLines
from ..data.sample import SequenceSample
from ..planning.shared_prefix import SharedPrefix

__all__ = [
    "Rollout",
    "check_generation_logprobs",
    "check_group_sizes",
    "check_rollout",
    "check_rollouts",
    "check_routed_experts",
    "group_members",
    "grpo_advantages",
    "minibatches",
    "read_rollouts_jsonl",
    "read_rollouts_jsonl_located",
    "rollout_from_record",
    "rollout_samples",
    "rollouts_shared_prefix",
]

_FIELDS = ("prompt_tokens", "response_tokens", "reward", "group_id")


@dataclass(frozen=True, kw_only=True)
class Rollout:
    prompt_tokens: Sequence[int]
    response_tokens: Sequence[int]
    reward: float
    group_id: int | str
    generation_logprobs: Sequence[float] | None = None  # one per response token
    routed_experts: np.ndarray | None = None  # [prompt + response tokens (or one fewer), moe_layers, top_k]


def read_rollouts_jsonl(path: str) -> list[Rollout]:
    """Rollouts from a JSONL file, one object per line with ``prompt_tokens``, ``response_tokens``,
    ``reward``, ``group_id`` and optionally ``generation_logprobs`` (what an inference engine wrote)."""
    return read_rollouts_jsonl_located(path)[0]


def read_rollouts_jsonl_located(path: str) -> tuple[list[Rollout], list[str]]:
    """`read_rollouts_jsonl` and each rollout's ``file:line`` (for `check_rollouts`' ``names``)."""
    from ..data.jsonl import read_jsonl_objects

    rollouts, names, bad = [], [], BadLines()
    for number, record in read_jsonl_objects(path):
        rollout = bad.check(rollout_from_record, record, f"{path}:{number}")
        if rollout is not None:
            rollouts.append(rollout)
            names.append(f"{path}:{number}")
    bad.raise_any()
    return rollouts, names


def rollout_from_record(record: dict, where: str) -> Rollout:
    """A `Rollout` from one record's fields, or a `ValueError` naming ``where`` and the missing fields
    (the values are checked by `check_rollouts`)."""
    missing = [k for k in _FIELDS if k not in record]
    if missing:
        raise ValueError(f"{where} lacks {missing}; each line needs {list(_FIELDS)}.")
    fields = {k: record[k] for k in (*_FIELDS, "generation_logprobs") if k in record}
    if record.get("routed_experts") is not None:
        fields["routed_experts"] = routes_array(record["routed_experts"], where)
    return Rollout(**fields)


ROUTES_SHAPE = "[tokens, moe_layers, top_k] (tokens: prompt + response, or one fewer)"


def routes_array(value, where: str) -> np.ndarray:
    """``routed_experts`` as an int16 array ``[tokens, moe_layers, top_k]`` (what SGLang's and vLLM's
    routed-experts export holds per request), or a `ValueError` naming ``where``: ragged lists, other
    dimensions, non-integers."""
    try:
        array = np.asarray(value)
    except ValueError:  # ragged nested lists
        array = None
    if array is None or array.ndim != 3 or not (np.issubdtype(array.dtype, np.integer) or array.size == 0):
        shape = "ragged" if array is None else f"of shape {list(array.shape)} ({array.dtype})"
        raise ValueError(f"{where}: routed_experts is {shape}; give integers of shape {ROUTES_SHAPE}, the expert ids "
                         "the engine chose for each token in each MoE layer.")  # fmt: skip
    if array.size and (array.min() < 0 or array.max() > np.iinfo(np.int16).max):
        bad = int(array.min() if array.min() < 0 else array.max())
        raise ValueError(f"{where}: routed_experts holds expert id {bad}; expert ids are 0 .. num_experts - 1.")
    return array.astype(np.int16)


def group_members(group_ids: Sequence) -> dict:
    """``{group id: [indices]}`` in first-appearance order, indices ascending."""
    members: dict = {}
    for i, g in enumerate(group_ids):
        members.setdefault(g, []).append(i)
    return members


def check_rollouts(rollouts: Sequence[Rollout], *, grpo: bool = True, names: Sequence[str] | None = None) -> None:
    """Clear errors for rollouts a step cannot use; ``names[i]`` locates rollout ``i`` in the messages
    (``file:line`` from `read_rollouts_jsonl_located`), else "rollout i"."""
    if not rollouts:
        raise ValueError("no rollouts: the policy step needs at least one sampled response.")
    bad = BadLines("rollouts")
    for i, r in enumerate(rollouts):
        bad.check(check_rollout, r, names[i] if names is not None else f"rollout {i}")
    bad.raise_any()
    if grpo:
        check_group_sizes([r.group_id for r in rollouts])


def check_generation_logprobs(missing: Sequence[int], total: int, *, where: str = "", example: str = "") -> None:
    """The importance-sampling correction weighs every token by the inference engine's log-prob: rollouts
    without them (``missing`` of ``total``, in ``where``; ``example`` names one) are refused, naming the key,
    never weighted 1 unsaid."""
    if missing:
        raise ValueError(
            f"loss_fn.use_importance_sampling_correction=true weighs each token by the inference engine's log-prob, "
            f"but {len(missing)} of {total} rollouts{where} have no generation_logprobs{example}. Have the engine "
            "write them, or set loss_fn.use_importance_sampling_correction=false."
        )


def check_group_sizes(group_ids: Sequence) -> None:
    """GRPO compares responses to one prompt: a group of one is refused, naming it."""
    single = [g for g, idx in group_members(group_ids).items() if len(idx) == 1]
    if single:
        raise ValueError(
            f"GRPO needs several responses per prompt; group(s) {single[:5]} have one. Sample more responses "
            "per prompt, or drop those groups."
        )


def check_rollout(r: Rollout, where: str) -> None:
    """One rollout's problems (the first found), located by ``where``."""
    for key, items in (("prompt_tokens", "token ids"), ("response_tokens", "token ids"),
                       ("generation_logprobs", "numbers")):  # fmt: skip
        value = getattr(r, key)
        if value is None and key == "generation_logprobs":  # optional
            continue
        if not isinstance(value, Sequence) or isinstance(value, str):
            raise ValueError(
                f"{where} (group {r.group_id!r}): {key} is {str(value)[:60]}; it must be a list of {items}."
            )
    if len(r.response_tokens) == 0:
        raise ValueError(f"{where} (group {r.group_id!r}) has an empty response: drop it before the step.")
    if len(r.prompt_tokens) == 0:
        raise ValueError(f"{where} (group {r.group_id!r}) has an empty prompt: the first response token "
                         "needs a context to be predicted from.")  # fmt: skip
    if isinstance(r.reward, bool) or not isinstance(r.reward, (int, float)):
        raise ValueError(f"{where} (group {r.group_id!r}) has reward {r.reward!r}: a reward is a number.")
    if math.isnan(r.reward) or math.isinf(r.reward):
        raise ValueError(f"{where} (group {r.group_id!r}) has reward {r.reward!r}: rewards must be finite.")
    for key in ("prompt_tokens", "response_tokens"):
        bad = [t for t in getattr(r, key) if isinstance(t, bool) or not isinstance(t, numbers.Integral) or t < 0]
        if bad:
            raise ValueError(f"{where} (group {r.group_id!r}): {key} holds {bad[:3]}; token ids are "
                             "integers >= 0.")  # fmt: skip
    if r.generation_logprobs is not None and len(r.generation_logprobs) != len(r.response_tokens):
        raise ValueError(
            f"{where} has {len(r.generation_logprobs)} generation log-probs for {len(r.response_tokens)} "
            "response tokens: give one per response token (or none)."
        )
    if r.routed_experts is not None:
        _check_routes(r, where)
    if r.generation_logprobs is not None and not all(
        isinstance(v, (int, float)) and not isinstance(v, bool) and v <= 0 for v in r.generation_logprobs
    ):
        worst = max((v for v in r.generation_logprobs if isinstance(v, (int, float))), default=None)
        raise ValueError(
            f"{where} (group {r.group_id!r}): generation_logprobs must be numbers <= 0 (log of a "
            f"probability); the largest is {worst!r}. Pass log-probs, not probabilities."
        )


def _check_routes(r: Rollout, where: str) -> None:
    """One row per token (the last may be missing) and ``top_k`` different experts per (token, layer)."""
    routes, n = routes_array(r.routed_experts, where), len(r.prompt_tokens) + len(r.response_tokens)
    if routes.shape[0] not in (n, n - 1):
        raise ValueError(f"{where} (group {r.group_id!r}): routed_experts has {routes.shape[0]} rows for {n} tokens "
                         f"(prompt + response); give {ROUTES_SHAPE}.")  # fmt: skip
    ordered = np.sort(routes, axis=-1)
    repeated = np.argwhere((ordered[..., 1:] == ordered[..., :-1]).any(-1))
    if len(repeated):
        token, layer = (int(v) for v in repeated[0])
        experts = routes[token, layer].tolist()
        raise ValueError(f"{where} (group {r.group_id!r}): routed_experts names experts {experts} for token {token} "
                         f"in MoE layer {layer}: a token's top-k are k different experts.")  # fmt: skip


def check_routed_experts(rollouts: Sequence[Rollout], *, moe_layers: int, topk: int, num_experts: int,
                         names: Sequence[str] | None = None) -> None:  # fmt: skip
    """Router replay: every rollout carries ``routed_experts`` for this model (``moe_layers`` MoE layers,
    ``topk`` experts per token, ids below ``num_experts``); the first problem is a `ValueError` naming the
    rollout (``names[i]``, e.g. ``file:line``) and the fix."""
    for i, r in enumerate(rollouts):
        where = names[i] if names is not None else f"rollout {i}"
        if r.routed_experts is None:
            raise ValueError(f"{where} (group {r.group_id!r}) has no routed_experts; router replay needs every "
                             "rollout's routes: have the engine return them (SGLang --enable-return-routed-experts), "
                             "or set grpo.router_replay=false.")  # fmt: skip
        routes = np.asarray(r.routed_experts)
        _, layers, k = routes.shape
        if (layers, k) != (moe_layers, topk):
            raise ValueError(f"{where}: routed_experts is [tokens, {layers}, {k}] but the model has {moe_layers} MoE "
                             f"layers and top-{topk} routing; record the routes with this model.")  # fmt: skip
        if routes.size and int(routes.max()) >= num_experts:
            raise ValueError(f"{where}: routed_experts names expert {int(routes.max())}, but the model has "
                             f"{num_experts} experts (ids 0 .. {num_experts - 1}).")  # fmt: skip


def grpo_advantages(rewards: Sequence[float], group_ids: Sequence, *, leave_one_out: bool = False,
                    normalize_std: bool = True, eps: float = 1e-6) -> np.ndarray:  # fmt: skip
    """Each reward minus its group's mean (or, ``leave_one_out``, the mean of the group's other rewards),
    divided by the group's standard deviation when ``normalize_std`` (a group of equal rewards gives 0)."""
    rewards = np.asarray(rewards, dtype=np.float64)
    out = np.zeros_like(rewards)
    keys = np.asarray([str(g) for g in group_ids])
    for key in np.unique(keys):
        idx = np.flatnonzero(keys == key)
        r = rewards[idx]
        baseline = (r.sum() - r) / (len(r) - 1) if leave_one_out and len(r) > 1 else r.mean()
        centred = r - baseline
        out[idx] = centred / (r.std() + eps) if normalize_std else centred
    return out


def rollout_samples(rollouts: Sequence[Rollout], *, routes: bool = False) -> list[SequenceSample]:
    """prompt + response as one sequence, learning only the response's tokens; ``routes``: with each
    rollout's ``routed_experts`` (router replay)."""
    samples = []
    for r in rollouts:
        tokens = np.asarray([*r.prompt_tokens, *r.response_tokens], dtype=np.int64)
        mask = np.zeros(len(tokens), dtype=np.float32)
        mask[len(r.prompt_tokens) :] = 1.0
        samples.append(SequenceSample(tokens, mask, r.routed_experts if routes else None))
    return samples


def minibatches(group_ids: Sequence, count: int) -> list[list[int]]:
    """The rollout indices of ``count`` minibatches of whole groups: the groups in first-appearance order
    cut into ``count`` consecutive runs of (nearly) equal numbers of groups; rollouts in input order."""
    members = group_members(group_ids)
    if not 1 <= count <= len(members):
        raise ValueError(
            f"num_minibatches={count} needs 1 to {len(members)} (the number of groups in the step): a minibatch "
            "holds whole groups."
        )
    runs = np.array_split(np.arange(len(members)), count)
    groups = list(members.values())
    return [sorted(i for k in run.tolist() for i in groups[k]) for run in runs]


def rollouts_shared_prefix(rollouts: Sequence[Rollout]) -> SharedPrefix:
    """The planner's `SharedPrefix` of ``rollouts``: each one's group and prompt length. A group whose
    responses answer different prompts (compared token by token) is refused, naming the group and the
    first rollout that differs."""
    first: dict = {}
    for i, r in enumerate(rollouts):
        k = first.setdefault(r.group_id, i)
        if list(rollouts[k].prompt_tokens) != list(r.prompt_tokens):
            raise ValueError(
                f"grpo.shared_prefix: group {r.group_id!r} holds different prompts (rollout {i} differs from rollout "
                f"{k}); a group is the responses to one prompt. Fix the group ids, or set grpo.shared_prefix=false."
            )
    return SharedPrefix(group_ids=[r.group_id for r in rollouts],
                        prompt_lengths=[len(r.prompt_tokens) for r in rollouts])  # fmt: skip
