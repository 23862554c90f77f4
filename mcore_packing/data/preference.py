"""Preference pairs for DPO: (chosen, rejected) responses to one prompt, as two training samples each.

One JSON object per line, in one of two forms:

    {"prompt": "2+2=", "chosen": "4", "rejected": "5"}                                  text
    {"prompt": [{"role": "user", "content": "2+2?"}], "chosen": "4", "rejected": "5"}   chat messages
    {"prompt_tokens": [12, 7], "chosen_tokens": [9, 2], "rejected_tokens": [4, 2]}      token ids

A chat prompt is a list of ``{"role", "content"}`` messages; a response is a string (one assistant
message) or a list of messages ending with the assistant's. Chat pairs go through the checkpoint's chat
template (``tokenizer_path``: `hf_tokenizer.ChatTokenizer`) or, without one, the bundled vocabulary's
``role: text`` lines (`data.sft`'s compact encoding); text pairs are the prompt's tokens then the
response's. Only the response's tokens are learned (loss mask 1): a chat response's assistant turns, a
text response's every token. Sample ``2i`` is pair ``i``'s chosen response, ``2i + 1`` its rejected one.

Refused, naming ``file:line`` and the fix (up to ten bad lines at once, `jsonl.BadLines`): a line that
is not a JSON object, missing keys, an empty or non-assistant response, chosen equal to rejected, token
ids that are not integers >= 0. Pairs with a sample over ``max_sample_tokens`` are dropped and counted
(both responses go, so no pair is broken).
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

import numpy as np

from .jsonl import BadLines, read_jsonl_objects
from .sample import SequenceSample
from .sft import UNK_ID, _compact_vocab, _encode_compact, _Encoded, check_messages

__all__ = ["PreferenceData", "encode_pair", "load_preference_data", "pair_form", "pair_ids"]

_TEXT_KEYS = ("prompt", "chosen", "rejected")
_TOKEN_KEYS = ("prompt_tokens", "chosen_tokens", "rejected_tokens")


@dataclass(frozen=True)
class PreferenceData:
    """Samples in pair order (chosen, rejected, chosen, ...), the vocabulary, a description."""

    samples: list[SequenceSample]
    vocab_size: int
    info: dict


def pair_ids(num_samples: int) -> list[int]:
    """The pair of every sample in pair order (``[0, 0, 1, 1, ...]``: sample ``2i`` is pair ``i``'s chosen
    response, ``2i + 1`` its rejected one)."""
    if num_samples % 2:
        raise ValueError(f"DPO samples come in (chosen, rejected) pairs; got {num_samples} samples (an odd count).")
    return [i // 2 for i in range(num_samples)]


def _read(path: str) -> list[tuple[int, dict]]:
    records = read_jsonl_objects(path)
    if not records:
        raise ValueError(f"{path} holds no pairs; one JSON object per line with prompt, chosen and rejected.")
    return records


def _where(path: str, number: int) -> str:
    return f"{path}:{number}"


def pair_form(record: dict, where: str) -> bool:
    """True for a token-id record, False for text/chat; else a ValueError naming the missing keys (``where``:
    the record's place, ``file:line``)."""
    if all(k in record for k in _TOKEN_KEYS):
        return True
    if all(k in record for k in _TEXT_KEYS):
        return False
    have = [k for k in (*_TEXT_KEYS, *_TOKEN_KEYS) if k in record]
    raise ValueError(
        f"{where} has {have or 'none'} of the keys; a pair needs prompt, chosen and rejected (text or chat "
        "messages) or prompt_tokens, chosen_tokens and rejected_tokens (ids)."
    )


def _token_ids(value, key: str, where: str, *, allow_empty: bool) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(t, numbers.Integral) and not isinstance(t, bool)
                                              and t >= 0 for t in value):  # fmt: skip
        raise ValueError(f"{where}: {key} must be a list of integer token ids >= 0, got {str(value)[:80]}.")
    if not value and not allow_empty:
        raise ValueError(f"{where}: {key} is empty; a response needs at least one token to learn.")
    return [int(t) for t in value]


def _messages(value, key: str, where: str, *, response: bool) -> list[dict]:
    """A string as one message (user for the prompt, assistant for a response), or a message list."""
    if isinstance(value, str):
        if response and not value.strip():
            raise ValueError(f"{where}: {key} is empty; write the response's text.")
        return [{"role": "assistant" if response else "user", "content": value}]
    if not isinstance(value, list):
        raise ValueError(f"{where}: {key} must be a string or a list of {{'role', 'content'}} messages.")
    check_messages(value, f"{where}: {key}")
    if response and (not value or value[-1]["role"] != "assistant"):
        raise ValueError(f"{where}: {key} must end with an assistant message (the tokens DPO learns).")
    return value


def _encode_pair_part(prompt: list[dict], response: list[dict], encode, tokenizer, chat: bool) -> _Encoded:
    """Prompt then response, only the response's assistant tokens learned."""
    if tokenizer is not None and chat:
        ids, mask, ends = tokenizer.encode_conversation([*prompt, *response])
        start = ends[len(prompt) - 1] if prompt else 0
        return _Encoded(ids, [0.0] * start + mask[start:])
    if tokenizer is not None:  # text: the prompt's tokens, then the response's
        p, r = tokenizer.encode(prompt[0]["content"]), tokenizer.encode(response[0]["content"])
        return _Encoded(p + r, [0.0] * len(p) + [1.0] * len(r))
    if chat:
        head, tail = _encode_compact(prompt, encode, False), _encode_compact(response, encode, False)
        return _Encoded(head.ids + tail.ids, [0.0] * len(head.ids) + tail.mask)
    p, r = encode(prompt[0]["content"]), encode(response[0]["content"])
    return _Encoded(p + r, [0.0] * len(p) + [1.0] * len(r))


def encode_pair(record: dict, where: str, encode, tokenizer) -> tuple[_Encoded, _Encoded]:
    """A pair's (chosen, rejected) samples: token ids as given, text and chat through ``tokenizer`` (a
    `hf_tokenizer.ChatTokenizer`) or, without one, ``encode`` (the compact vocabulary's); the checks of the
    module docstring, naming ``where``."""
    if pair_form(record, where):
        prompt = _token_ids(record["prompt_tokens"], "prompt_tokens", where, allow_empty=True)
        chosen, rejected = (_token_ids(record[k], k, where, allow_empty=False) for k in _TOKEN_KEYS[1:])
        if chosen == rejected:
            raise ValueError(f"{where}: chosen_tokens equal rejected_tokens; a pair needs two different responses.")
        return tuple(_Encoded(prompt + r, [0.0] * len(prompt) + [1.0] * len(r)) for r in (chosen, rejected))
    if record["chosen"] == record["rejected"]:
        raise ValueError(f"{where}: chosen equals rejected; a pair needs two different responses.")
    chat = any(isinstance(record[k], list) for k in _TEXT_KEYS)
    prompt = _messages(record["prompt"], "prompt", where, response=False)
    parts = []
    for key in ("chosen", "rejected"):
        encoded = _encode_pair_part(prompt, _messages(record[key], key, where, response=True), encode, tokenizer, chat)
        if not any(encoded.mask[1:]):
            raise ValueError(f"{where}: {key} has no token to learn after tokenization (an empty response?).")
        parts.append(encoded)
    return tuple(parts)


def load_preference_data(
    path: str,
    *,
    tokenizer_path: str | None = None,
    encoding: str = "qwen3",
    vocab_size: int = 4096,
    max_sample_tokens: int = 2048,
) -> PreferenceData:
    """Read, check and tokenize ``path`` (see the module docstring)."""
    tokenizer, encode = None, None
    if tokenizer_path is not None:
        from .hf_tokenizer import ChatTokenizer

        tokenizer = ChatTokenizer(tokenizer_path)
    records, bad = _read(path), BadLines("pairs")
    forms = [bad.check(pair_form, r, _where(path, n)) for n, r in records]  # True: token ids
    bad.raise_any()
    token_records = all(forms)
    if any(forms) and not token_records:
        first = records[forms.index(not forms[0])][0]
        raise ValueError(
            f"{_where(path, first)} mixes token ids and text with line {records[0][0]}; write every pair in one form."
        )
    if tokenizer is None and not token_records:
        from .real_text import get_tokenizer

        quick = get_tokenizer(encoding)
        encode = quick.encode_ordinary if hasattr(quick, "encode_ordinary") else quick.encode
    pairs = [bad.check(encode_pair, r, _where(path, n), encode, tokenizer) for n, r in records]
    bad.raise_any()
    kept = [p for p in pairs if max(len(p[0].ids), len(p[1].ids)) <= max_sample_tokens]
    if not kept:
        raise ValueError(
            f"No pairs are left: all {len(pairs)} have a response longer than data.max_sample_tokens="
            f"{max_sample_tokens} (prompt included). Raise data.max_sample_tokens."
        )
    remap, unk_share = None, 0.0
    if tokenizer is not None:
        vocab_size = tokenizer.vocab_size
    elif token_records:
        vocab_size = 1 + max(max(e.ids, default=0) for p in kept for e in p)
    else:
        remap, unk_share = _compact_vocab([e for p in kept for e in p], vocab_size)
    samples = []
    for pair in kept:
        for e in pair:
            ids = e.ids if remap is None else [remap.get(t, UNK_ID) for t in e.ids]
            samples.append(SequenceSample(np.asarray(ids, dtype=np.int64), np.asarray(e.mask, dtype=np.float32)))
    info = {
        "source": "preference pairs",
        "path": path,
        "tokenizer": tokenizer_path or ("the pairs' own ids" if token_records else f"quicktok:{encoding} (compact)"),
        "pairs": len(kept),
        "pairs_dropped_too_long": len(pairs) - len(kept),
        "num_tokens": sum(len(x) for x in samples),
        "vocab_size": vocab_size,
        "unk_token_share": unk_share,
    }
    return PreferenceData(samples=samples, vocab_size=vocab_size, info=info)
