"""What ``prepare`` does to one chunk of records in a worker process: decode, check and tokenize them as
training does, and return the arrays the store holds, per store kind (`data.store.KINDS`):

- ``sft``: each record's ``text_field`` checked by `data.sft.check_record`, the chunk tokenized and the
  long-sample policy applied by `data.sft.tokenize_chunk` (what ``load_sft_data`` does);
- ``pairs``: each record through `data.preference.encode_pair` (what ``load_preference_data`` does), a
  pair with a sample over ``max_sample_tokens`` dropped whole and counted;
- ``rollouts``: each record through `losses.rollouts.rollout_from_record` and `check_rollout` (what
  ``grpo.rollouts`` reading does), prompt + response as one sample with the response learned.

Every bad record of the chunk is returned as a message naming its place (`data.sources.Chunk.where`), so
the parent reports the whole file's problems at once. Workers are forked with the tokenizer loaded once
(`init_worker`), one tokenizer thread each: the processes are the parallelism.
"""

from __future__ import annotations

import os

import numpy as np

from ..data.jsonl import BadLines, field_of, parse_jsonl_line
from ..data.preference import encode_pair, pair_form
from ..data.sft import check_record, check_targets, chunk_info, tokenize_chunk
from ..data.sources import Chunk
from ..data.store import spans_from_mask
from ..losses.rollouts import check_rollout, rollout_from_record, rollout_samples

__all__ = ["encode_chunk", "init_worker"]

_WORKER: dict = {}
_PAIR_KEYS = ("prompt", "chosen", "rejected")
_ROLLOUT_KEYS = ("prompt_tokens", "response_tokens", "reward")


def init_worker(hf_path: str | None, kind: str, settings: dict) -> None:
    """Load the tokenizer once per worker process (none for token-id records)."""
    os.environ.setdefault("RAYON_RS_NUM_CPUS", "1")
    tokenizer = None
    if hf_path is not None:
        from ..data.hf_tokenizer import ChatTokenizer

        tokenizer = ChatTokenizer(hf_path)
    _WORKER.update(tokenizer=tokenizer, kind=kind, settings=settings)


def encode_chunk(chunk: Chunk) -> dict:
    """One chunk in a worker: ``{"errors": [...]}`` if any record is bad, else the samples as arrays
    (`_arrays`), the counts to add up (``info``) and the kind's own fields."""
    objects, bad = [], BadLines()
    for i, item in enumerate(chunk.items):
        obj = bad.check(parse_jsonl_line, item, chunk.where(i)) if chunk.raw else item
        if obj is not None:
            objects.append((chunk.where(i), obj))
    if bad.messages:
        return {"errors": bad.messages}
    return _ENCODERS[_WORKER["kind"]](objects, _WORKER["tokenizer"], _WORKER["settings"])


def _arrays(samples: list[tuple[np.ndarray, np.ndarray]]) -> dict:
    """Samples ``(ids, mask)`` as the store's concatenated ids and learned spans with their lengths."""
    spans = [spans_from_mask(mask) for _, mask in samples]
    largest = max((int(ids.max()) for ids, _ in samples if len(ids)), default=0)
    if largest >= 2**31:
        raise ValueError(f"a token id is {largest}; token ids must be below 2**31.")
    return {
        "errors": [],
        "ids": np.concatenate([ids for ids, _ in samples]) if samples else np.zeros(0, np.int64),
        "lengths": np.array([len(ids) for ids, _ in samples], dtype=np.int64),
        "spans": np.concatenate(spans) if spans else np.zeros(0, np.int32),
        "span_lengths": np.array([len(s) for s in spans], dtype=np.int64),
        "max_token_id": largest,
    }


def _sft_record(where: str, obj: dict, field: str):
    if field not in obj and set(_PAIR_KEYS) <= set(obj):
        raise ValueError(f"{where} is a preference pair (prompt, chosen, rejected); pass --kind pairs.")
    if field not in obj and set(_ROLLOUT_KEYS) <= set(obj):
        raise ValueError(f"{where} is a rollout (prompt_tokens, response_tokens, reward); pass --kind rollouts.")
    record = field_of(obj, field, where, "--text-field (data.text_field)")
    return check_record(record, where, field)


_FLAGS = {"learn": "pass --learn-prompt", "targets": "pass --samples-without-targets drop"}


def _encode_sft(objects: list, tokenizer, settings: dict) -> dict:
    bad = BadLines()
    records = [bad.check(_sft_record, where, obj, settings["text_field"]) for where, obj in objects]
    if bad.messages:
        return {"errors": bad.messages}
    chunk = tokenize_chunk(records, tokenizer, learn_prompt=settings["learn_prompt"], long_samples=settings[
        "long_samples"], max_sample_tokens=settings["max_sample_tokens"], wheres=[w for w, _ in objects])  # fmt: skip
    refused = check_targets(chunk, settings.get("samples_without_targets", "error"), _FLAGS)
    if refused:
        return {"errors": refused}
    info = chunk_info(chunk)
    del info["learned_token_share"]  # a ratio: the parent takes it over the whole file
    return {**_arrays(chunk.samples), "info": {**info, "learned_tokens": chunk.learned_tokens},
            "any_learned": chunk.any_learned}  # fmt: skip


def _encode_one_pair(where: str, obj: dict, tokenizer):
    tokens = pair_form(obj, where)
    if not tokens and tokenizer is None:
        raise ValueError(f"{where} is a text or chat pair; tokenizing it needs --hf-path (the model folder).")
    return tokens, encode_pair(obj, where, None, tokenizer)


def _encode_pairs(objects: list, tokenizer, settings: dict) -> dict:
    bad, limit = BadLines(), settings["max_sample_tokens"]
    encoded = [(where, bad.check(_encode_one_pair, where, obj, tokenizer)) for where, obj in objects]
    if bad.messages:
        return {"errors": bad.messages}
    forms: dict[str, str] = {}  # "tokens"/"text": the first record of that form
    samples, dropped = [], 0
    for where, (tokens, pair) in encoded:
        forms.setdefault("tokens" if tokens else "text", where)
        if max(len(pair[0].ids), len(pair[1].ids)) > limit:
            dropped += 1
            continue
        samples += [(np.asarray(e.ids, dtype=np.int64), np.asarray(e.mask, dtype=np.float32)) for e in pair]
    info = {"num_records": len(objects), "num_samples": len(samples), "num_tokens": sum(len(i) for i, _ in samples),
            "pairs": len(samples) // 2, "pairs_dropped_too_long": dropped}  # fmt: skip
    return {**_arrays(samples), "info": info, "forms": forms}


def _one_rollout(where: str, obj: dict):
    if obj.get("routed_experts") is not None:
        raise ValueError(f"{where} carries routed_experts, which a prepared store does not hold yet: train router "
                         "replay from the JSONL (grpo.rollouts=FILE), or drop the key.")  # fmt: skip
    rollout = rollout_from_record(obj, where)
    check_rollout(rollout, where)
    return rollout


def _encode_rollouts(objects: list, tokenizer, settings: dict) -> dict:
    bad = BadLines()
    rollouts = [bad.check(_one_rollout, where, obj) for where, obj in objects]
    if bad.messages:
        return {"errors": bad.messages}
    samples = [(s.tokens, s.loss_mask) for s in rollout_samples(rollouts)]
    logprobs = [np.asarray(r.generation_logprobs or [], dtype=np.float64) for r in rollouts]
    info = {"num_records": len(objects), "num_samples": len(samples), "num_tokens": sum(len(i) for i, _ in samples)}
    return {
        **_arrays(samples),
        "info": info,
        "logprobs": np.concatenate(logprobs) if logprobs else np.zeros(0, np.float64),
        "logprob_lengths": np.array([len(x) for x in logprobs], dtype=np.int64),
        "rewards": [float(r.reward) for r in rollouts],
        "group_ids": [r.group_id for r in rollouts],
    }


_ENCODERS = {"sft": _encode_sft, "pairs": _encode_pairs, "rollouts": _encode_rollouts}
