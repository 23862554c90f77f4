"""SFT samples from real text: token ids and a loss mask per sample, ready for packing.

Sources (`SFT_SOURCES`): ``champ``, the bundled demo: `CHAMP_DEMO` conversations of CHAMP spread evenly
over its 19,440 (so the quick start tokenizes in a second); ``champ_full``, all of them; or ``jsonl``, a
user file whose ``text_field`` holds either plain text (every token learned) or a conversation: a list of
``{"role": ..., "content": ...}`` messages. ``num_samples`` then picks that many evenly spaced records of
the source; its default, None, takes every one, whatever the source (a prepared store too).
In conversations only the assistant's turns are learned (CHAMP: the "Model..." turns) unless
``learn_prompt``.

Tokenizers:
- ``tokenizer_path`` (the model's Hugging Face folder, `hf_tokenizer.ChatTokenizer`): the checkpoint's
  own ``tokenizer.json``; conversations go through its chat template, so training text is tokenized as
  the model expects. The model's vocabulary is the checkpoint's.
- otherwise the bundled ``quicktok`` vocabulary, mapped to a *compact* vocabulary (the ``vocab_size - 1``
  most frequent ids keep a slot, the rest share ``<unk>``, id 0) so a tiny demo model stays small;
  conversations are rendered as ``role: text`` lines. It changes which ids the model sees, never how many
  tokens a sample has.

A message's ``content`` is a string, or a list of text parts ``[{"type": "text", "text": "..."}]`` (the
OpenAI and Hugging Face structured form), which is joined into one string, as text-only chat templates
render it; anything else (a number, null, an image part) is refused naming ``file:line``.

A sample with no learned token (a conversation without an assistant turn, a one-token text) costs compute
and teaches nothing: refused naming ``file:line`` (``samples_without_targets=error``, the default) or
dropped and counted (``drop``).

Samples longer than ``max_sample_tokens`` (``long_samples``):
- ``drop`` (the default for conversations): counted and reported;
- ``truncate`` (conversations): keep the turns up to the last assistant turn that fits;
- ``split`` (the default for plain text): consecutive pieces, no token lost. Refused for conversations,
  whose pieces would lose their prompt;
- ``error``: refuse the data set.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from .jsonl import BadLines
from .real_text import champ_conversations, get_tokenizer, read_jsonl_field
from .sample import SequenceSample

__all__ = [
    "LONG_SAMPLE_POLICIES",
    "ROLES",
    "WITHOUT_TARGETS",
    "SftData",
    "TokenizedChunk",
    "check_messages",
    "check_outcome",
    "check_record",
    "check_targets",
    "chunk_info",
    "evenly_spaced",
    "load_sft_data",
    "tokenize_chunk",
]  # fmt: skip

UNK_ID = 0
LONG_SAMPLE_POLICIES = ("drop", "truncate", "split", "error")
WITHOUT_TARGETS = ("error", "drop")
SFT_SOURCES = ("champ", "champ_full", "jsonl")
CHAMP_DEMO = 512
"""``samples_without_targets``: what happens to a sample with no learned token."""
ROLES = ("system", "user", "assistant", "tool")
"""The chat roles a conversation may use (the ones chat templates render); others are refused by name."""


@dataclass(frozen=True)
class SftData:
    samples: list[SequenceSample]
    vocab_size: int
    info: dict


@dataclass
class _Encoded:
    """One record after tokenization: ids, learned flags, token counts after each assistant turn."""

    ids: list[int]
    mask: list[float]
    assistant_ends: list[int] = field(default_factory=list)
    conversation: bool = True


def _role(name: str) -> str:
    """CHAMP's roles ("System", "User", "Model.GPT-4", "Imputation") as chat roles."""
    return "assistant" if name.startswith("Model") else "system" if name == "System" else "user"


def _records(source: str, path: str | None, text_field: str) -> tuple[list[str], list]:
    """Where each record is (``file:line``) and the records: conversations (lists of {"role", "content"}
    with string contents) or plain texts."""
    if source in ("champ", "champ_full"):
        conversations = champ_conversations()
        chosen = evenly_spaced(len(conversations), CHAMP_DEMO if source == "champ" else None)
        return ([f"CHAMP conversation {i}" for i in chosen],
                [[{"role": _role(r), "content": t} for r, t in conversations[i]] for i in chosen])  # fmt: skip
    if source != "jsonl":
        raise ValueError(f"data.source must be one of {SFT_SOURCES}, got {source!r}.")
    records, bad = read_jsonl_field(path, text_field, key="data.text_field"), BadLines()
    checked = [bad.check(check_record, record, f"{path}:{line}", text_field) for line, record in records]
    bad.raise_any()
    return [f"{path}:{line}" for line, _ in records], checked


def evenly_spaced(total: int, count: int | None) -> np.ndarray:
    """``count`` indices spread evenly over ``range(total)``, first and last included (CHAMP is ordered by
    problem, so the first N would be a few problems); all of them when ``count`` is None or not smaller."""
    if count is None or count >= total:
        return np.arange(total)
    return np.linspace(0, total - 1, count).round().astype(np.int64)


def check_record(record, where: str, text_field: str):
    """A record's ``text_field`` is a text or a conversation (`check_messages`); returns it with every
    message's content a string."""
    if isinstance(record, list):
        return check_messages(record, where)
    if not isinstance(record, str):
        raise ValueError(f"{where}: {text_field} is {str(record)[:60]} ({type(record).__name__}); it must be the "
                         "text (a string) or a list of {'role', 'content'} messages.")  # fmt: skip
    return record


def _content(content, where: str, index: int) -> str:
    """A message's content as a string: itself, or its text parts joined (see the module docstring)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" and isinstance(
            p.get("text"), str) for p in content):  # fmt: skip
        return "".join(p["text"] for p in content)
    raise ValueError(
        f"{where}: message {index} has content {str(content)[:60]} ({type(content).__name__}); content must be a "
        "string or a list of text parts [{'type': 'text', 'text': '...'}]."
    )


def check_messages(messages, where: str) -> list[dict]:
    """A conversation is a list of ``{"role", "content"}`` messages with roles from `ROLES` and string (or
    text-part) contents; returns it with string contents."""
    if not all(isinstance(m, dict) and {"role", "content"} <= set(m) for m in messages):
        raise ValueError(f"{where} is a list but not of {{'role', 'content'}} messages.")
    unknown = sorted({m["role"] for m in messages} - set(ROLES))
    if unknown:
        raise ValueError(
            f"{where} uses role(s) {unknown}; chat templates know {list(ROLES)} and only assistant turns are "
            "learned. Rename them (ShareGPT's human -> user, gpt -> assistant)."
        )
    return [{**m, "content": _content(m["content"], where, i)} for i, m in enumerate(messages)]


def _encode_compact(record, encode, learn_prompt: bool) -> _Encoded:
    if isinstance(record, str):
        ids = encode(record)
        return _Encoded(ids, [1.0] * len(ids), conversation=False)
    out = _Encoded([], [])
    for message in record:
        piece = encode(f"{message['role']}: {message['content']}\n")
        learned = learn_prompt or message["role"] == "assistant"
        out.ids += piece
        out.mask += [1.0 if learned else 0.0] * len(piece)
        if message["role"] == "assistant":
            out.assistant_ends.append(len(out.ids))
    return out


def _encode_chat(records: list, tokenizer, learn_prompt: bool) -> list[_Encoded]:
    """Every record through the checkpoint's tokenizer in two batches (plain texts, conversations), in order."""
    texts = [i for i, r in enumerate(records) if isinstance(r, str)]
    chats = [i for i, r in enumerate(records) if not isinstance(r, str)]
    out: list[_Encoded | None] = [None] * len(records)
    for i, ids in zip(texts, tokenizer.encode_batch([records[i] for i in texts]), strict=True):
        out[i] = _Encoded(ids, [1.0] * len(ids), conversation=False)
    encoded = tokenizer.encode_conversations([records[i] for i in chats], assistant_ends_only=True)
    for i, (ids, mask, ends) in zip(chats, encoded, strict=True):
        out[i] = _Encoded(ids, [1.0] * len(ids) if learn_prompt else mask, ends)
    return out


def _fit(record: _Encoded, policy: str | None, limit: int) -> tuple[list[tuple[list, list]], str | None]:
    """The pieces a record becomes under the long-sample policy, and what happened (None if it fit)."""
    if len(record.ids) <= limit:
        return [(record.ids, record.mask)], None
    policy = policy or ("drop" if record.conversation else "split")
    if policy == "error":
        raise ValueError(
            f"A sample has {len(record.ids)} tokens, over data.max_sample_tokens={limit}. Raise it, or set "
            "data.long_samples=drop, truncate (conversations) or split (plain text)."
        )
    if policy == "split" and record.conversation:
        raise ValueError(
            "data.long_samples=split would cut conversations into pieces that lose their prompt. Use drop or "
            "truncate (keeps whole turns up to the last assistant reply that fits)."
        )
    if policy == "truncate" and not record.conversation:
        raise ValueError("data.long_samples=truncate keeps whole turns of conversations; for plain text use split.")
    if policy == "split":
        return [
            (record.ids[lo : lo + limit], record.mask[lo : lo + limit]) for lo in range(0, len(record.ids), limit)
        ], "split"
    if policy == "truncate":
        ends = [e for e in record.assistant_ends if e <= limit]
        if ends:
            return [(record.ids[: ends[-1]], record.mask[: ends[-1]])], "truncated"
    return [], "dropped"


@dataclass
class TokenizedChunk:
    """Records after tokenization and the long-sample policy: the samples' ids and 0/1 masks, what the
    policy did (``split``/``truncated``/``dropped`` counts), and the counts the data info reports."""

    samples: list[tuple[np.ndarray, np.ndarray]]
    outcomes: Counter
    num_records: int
    num_tokens: int  # of the non-empty records, before the policy
    learned_tokens: float
    without_targets: list[str] = field(default_factory=list)  # where the records with no learned token are

    @property
    def any_learned(self) -> bool:
        """Whether some sample has a learned target (token 1 on: token 0 is never a target)."""
        return any(np.any(mask[1:]) for _, mask in self.samples)


def _apply_policy(encoded: list[_Encoded], num_records: int, long_samples, max_sample_tokens: int,
                  remap=None, wheres: list[str] | None = None) -> TokenizedChunk:  # fmt: skip
    """The samples of the records; a record with no learned token (an empty one too) is left out and named
    in ``without_targets`` (the caller refuses or counts it: `check_targets`)."""
    wheres = wheres if wheres is not None else [f"record {i}" for i in range(len(encoded))]
    samples, outcomes, without = [], Counter(), []
    for where, record in zip(wheres, encoded, strict=True):
        if not any(record.mask[1:]):  # an empty record too
            without.append(where)
            continue
        pieces, outcome = _fit(record, long_samples, max_sample_tokens)
        outcomes[outcome] += 1
        for ids, mask in pieces:
            ids = ids if remap is None else [remap.get(t, UNK_ID) for t in ids]
            samples.append((np.asarray(ids, dtype=np.int64), np.asarray(mask, dtype=np.float32)))
    return TokenizedChunk(samples, outcomes, num_records, sum(len(r.ids) for r in encoded),
                          float(sum(np.sum(r.mask) for r in encoded)), without)  # fmt: skip


def check_targets(chunk: TokenizedChunk, policy: str, keys: dict) -> list[str]:
    """The messages refusing ``chunk``'s records without a learned token (``policy="error"``; none for
    ``drop``, which counts them)."""
    if policy == "drop":
        return []
    return [f"{where} has no learned token (a conversation without an assistant turn, or a one-token text): it "
            f"would cost compute and teach nothing. Add the assistant's reply, {keys['learn']} to learn every turn, "
            f"or {keys['targets']} to drop such samples (counted)." for where in chunk.without_targets]  # fmt: skip


def tokenize_chunk(records: list, tokenizer, *, learn_prompt: bool, long_samples: str | None,
                   max_sample_tokens: int, wheres: list[str] | None = None) -> TokenizedChunk:  # fmt: skip
    """Records (texts or conversations) through a `hf_tokenizer.ChatTokenizer` in batches, then the
    long-sample policy: what training does to every chunk of a data set (`load_sft_data`, ``prepare``)."""
    encoded = _encode_chat(records, tokenizer, learn_prompt)
    return _apply_policy(encoded, len(records), long_samples, max_sample_tokens, wheres=wheres)


def _compact_vocab(encoded: list[_Encoded], vocab_size: int) -> tuple[dict, float]:
    counts = Counter(t for r in encoded for t in r.ids)
    remap = {t: i + 1 for i, (t, _) in enumerate(counts.most_common(vocab_size - 1))}
    total = sum(counts.values())
    return remap, (sum(c for t, c in counts.items() if t not in remap) / total if total else 0.0)


def load_sft_data(
    *,
    source: str = "champ",
    path: str | None = None,
    text_field: str = "text",
    encoding: str = "qwen3",
    vocab_size: int = 4096,
    num_samples: int | None = None,
    long_samples: str | None = None,
    max_sample_tokens: int = 2048,
    learn_prompt: bool = False,
    samples_without_targets: str = "error",
    tokenizer_path: str | None = None,
) -> SftData:
    """Load, tokenize and apply the long-sample policy (see the module docstring)."""
    wheres, records = _records(source, path, text_field)
    chosen = evenly_spaced(len(records), num_samples)
    wheres, records = [wheres[i] for i in chosen], [records[i] for i in chosen]
    if tokenizer_path is not None:
        from .hf_tokenizer import ChatTokenizer

        tokenizer = ChatTokenizer(tokenizer_path)
        chunk = tokenize_chunk(records, tokenizer, learn_prompt=learn_prompt, long_samples=long_samples,
                               max_sample_tokens=max_sample_tokens, wheres=wheres)  # fmt: skip
        unk_share, vocab_size = 0.0, tokenizer.vocab_size
    else:
        quick = get_tokenizer(encoding)
        encode = quick.encode_ordinary if hasattr(quick, "encode_ordinary") else quick.encode
        encoded = [_encode_compact(r, encode, learn_prompt) for r in records]
        remap, unk_share = _compact_vocab(encoded, vocab_size)
        chunk = _apply_policy(encoded, len(records), long_samples, max_sample_tokens, remap, wheres)
    bad = BadLines("records")
    for message in check_targets(chunk, samples_without_targets, DATA_KEYS):
        bad.add(message)
    bad.raise_any()
    samples = [SequenceSample(ids, mask) for ids, mask in chunk.samples]
    check_outcome(num_records=chunk.num_records, num_samples=len(samples), dropped=chunk.outcomes["dropped"],
                  any_learned=chunk.any_learned, max_sample_tokens=max_sample_tokens,
                  without_targets=len(chunk.without_targets))  # fmt: skip
    info = {
        "source": source,
        "tokenizer": tokenizer_path or f"quicktok:{encoding} (compact)",
        **chunk_info(chunk),
        "vocab_size": vocab_size,
        "unk_token_share": unk_share,
    }
    return SftData(samples=samples, vocab_size=vocab_size, info=info)


DATA_KEYS = {"limit": "data.max_sample_tokens", "truncate": "set data.long_samples=truncate",
             "learn": "set data.learn_prompt=true", "targets": "set data.samples_without_targets=drop"}  # fmt: skip
"""How `check_outcome`'s fixes name the settings (``prepare`` names its flags)."""


def check_outcome(*, num_records: int, num_samples: int, dropped: int, any_learned: bool, max_sample_tokens: int,
                  keys: dict = DATA_KEYS, without_targets: int = 0) -> None:  # fmt: skip
    """A data set with no sample left, or none with a learned token, is refused (the fix named)."""
    if num_samples and not any_learned:
        raise ValueError(
            "No token of the data set is learned: conversations need an assistant turn (only those are learned), "
            f"or {keys['learn']} to learn every turn."
        )
    if not num_samples and without_targets:
        raise ValueError(
            f"No samples are left: {without_targets} of {num_records} records have no learned token (conversations "
            f"need an assistant turn, or {keys['learn']}) and {dropped} are longer than {keys['limit']}="
            f"{max_sample_tokens}."
        )
    if not num_samples:
        raise ValueError(
            f"No samples are left: {dropped} of {num_records} records are longer than {keys['limit']}="
            f"{max_sample_tokens} and were dropped. Raise {keys['limit']}, or {keys['truncate']} (conversations: "
            "keep the turns that fit)."
        )


def chunk_info(chunk: TokenizedChunk) -> dict:
    """The counts the data info reports (records, samples, tokens, the policy's outcomes, learned share)."""
    return {
        "num_records": chunk.num_records,
        "num_samples": len(chunk.samples),
        "num_tokens": chunk.num_tokens,
        "long_samples_split": chunk.outcomes["split"],
        "long_samples_truncated": chunk.outcomes["truncated"],
        "long_samples_dropped": chunk.outcomes["dropped"],
        "samples_without_targets_dropped": len(chunk.without_targets),
        "learned_token_share": chunk.learned_tokens / chunk.num_tokens if chunk.num_tokens else 0.0,
    }
