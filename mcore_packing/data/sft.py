"""SFT samples from real text: token ids and a loss mask per sample, ready for packing.

Sources: the bundled CHAMP conversations, or a user JSONL file whose ``text_field`` holds either plain
text (every token learned) or a conversation: a list of ``{"role": ..., "content": ...}`` messages.
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

__all__ = ["LONG_SAMPLE_POLICIES", "ROLES", "SftData", "TokenizedChunk", "check_messages", "check_outcome",
           "check_record", "chunk_info", "evenly_spaced", "load_sft_data", "tokenize_chunk"]  # fmt: skip

UNK_ID = 0
LONG_SAMPLE_POLICIES = ("drop", "truncate", "split", "error")
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


def _records(source: str, path: str | None, text_field: str) -> list:
    """Conversations (lists of {"role", "content"}) or plain texts."""
    if source == "champ":
        return [[{"role": _role(r), "content": t} for r, t in turns] for turns in champ_conversations()]
    if source != "jsonl":
        raise ValueError(f"data.source must be 'champ' or 'jsonl', got {source!r}.")
    records, bad = read_jsonl_field(path, text_field, key="data.text_field"), BadLines()
    for line, record in records:
        bad.check(check_record, record, f"{path}:{line}", text_field)
    bad.raise_any()
    return [r for _, r in records]


def evenly_spaced(total: int, count: int | None) -> np.ndarray:
    """``count`` indices spread evenly over ``range(total)``, first and last included (CHAMP is ordered by
    problem, so the first N would be a few problems); all of them when ``count`` is None or not smaller."""
    if count is None or count >= total:
        return np.arange(total)
    return np.linspace(0, total - 1, count).round().astype(np.int64)


def check_record(record, where: str, text_field: str) -> None:
    """A record's ``text_field`` is a text or a conversation (`check_messages`)."""
    if isinstance(record, list):
        check_messages(record, where)
    elif not isinstance(record, str):
        raise ValueError(f"{where}: {text_field} is {str(record)[:60]} ({type(record).__name__}); it must be the "
                         "text (a string) or a list of {'role', 'content'} messages.")  # fmt: skip


def check_messages(messages, where: str) -> None:
    """A conversation is a list of ``{"role", "content"}`` messages with roles from `ROLES`."""
    if not all(isinstance(m, dict) and {"role", "content"} <= set(m) for m in messages):
        raise ValueError(f"{where} is a list but not of {{'role', 'content'}} messages.")
    unknown = sorted({m["role"] for m in messages} - set(ROLES))
    if unknown:
        raise ValueError(
            f"{where} uses role(s) {unknown}; chat templates know {list(ROLES)} and only assistant turns are "
            "learned. Rename them (ShareGPT's human -> user, gpt -> assistant)."
        )


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

    @property
    def any_learned(self) -> bool:
        """Whether some sample has a learned target (token 1 on: token 0 is never a target)."""
        return any(np.any(mask[1:]) for _, mask in self.samples)


def _apply_policy(encoded: list[_Encoded], num_records: int, long_samples, max_sample_tokens: int,
                  remap=None) -> TokenizedChunk:  # fmt: skip
    encoded = [r for r in encoded if r.ids]
    samples, outcomes = [], Counter()
    for record in encoded:
        pieces, outcome = _fit(record, long_samples, max_sample_tokens)
        outcomes[outcome] += 1
        for ids, mask in pieces:
            ids = ids if remap is None else [remap.get(t, UNK_ID) for t in ids]
            samples.append((np.asarray(ids, dtype=np.int64), np.asarray(mask, dtype=np.float32)))
    return TokenizedChunk(samples, outcomes, num_records, sum(len(r.ids) for r in encoded),
                          float(sum(np.sum(r.mask) for r in encoded)))  # fmt: skip


def tokenize_chunk(records: list, tokenizer, *, learn_prompt: bool, long_samples: str | None,
                   max_sample_tokens: int) -> TokenizedChunk:  # fmt: skip
    """Records (texts or conversations) through a `hf_tokenizer.ChatTokenizer` in batches, then the
    long-sample policy: what training does to every chunk of a data set (`load_sft_data`, ``prepare``)."""
    encoded = _encode_chat(records, tokenizer, learn_prompt)
    return _apply_policy(encoded, len(records), long_samples, max_sample_tokens)


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
    tokenizer_path: str | None = None,
) -> SftData:
    """Load, tokenize and apply the long-sample policy (see the module docstring)."""
    records = _records(source, path, text_field)
    records = [records[i] for i in evenly_spaced(len(records), num_samples)]
    if tokenizer_path is not None:
        from .hf_tokenizer import ChatTokenizer

        tokenizer = ChatTokenizer(tokenizer_path)
        chunk = tokenize_chunk(records, tokenizer, learn_prompt=learn_prompt, long_samples=long_samples,
                               max_sample_tokens=max_sample_tokens)  # fmt: skip
        unk_share, vocab_size = 0.0, tokenizer.vocab_size
    else:
        quick = get_tokenizer(encoding)
        encode = quick.encode_ordinary if hasattr(quick, "encode_ordinary") else quick.encode
        encoded = [_encode_compact(r, encode, learn_prompt) for r in records]
        remap, unk_share = _compact_vocab(encoded, vocab_size)
        chunk = _apply_policy(encoded, len(records), long_samples, max_sample_tokens, remap)
    samples = [SequenceSample(ids, mask) for ids, mask in chunk.samples]
    check_outcome(num_records=chunk.num_records, num_samples=len(samples), dropped=chunk.outcomes["dropped"],
                  any_learned=chunk.any_learned, max_sample_tokens=max_sample_tokens)  # fmt: skip
    info = {
        "source": source,
        "tokenizer": tokenizer_path or f"quicktok:{encoding} (compact)",
        **chunk_info(chunk),
        "vocab_size": vocab_size,
        "unk_token_share": unk_share,
    }
    return SftData(samples=samples, vocab_size=vocab_size, info=info)


DATA_KEYS = {"limit": "data.max_sample_tokens", "truncate": "set data.long_samples=truncate",
             "learn": "set data.learn_prompt=true"}  # fmt: skip
"""How `check_outcome`'s fixes name the settings (``prepare`` names its flags)."""


def check_outcome(*, num_records: int, num_samples: int, dropped: int, any_learned: bool, max_sample_tokens: int,
                  keys: dict = DATA_KEYS) -> None:  # fmt: skip
    """A data set with no sample left, or none with a learned token, is refused (the fix named)."""
    if num_samples and not any_learned:
        raise ValueError(
            "No token of the data set is learned: conversations need an assistant turn (only those are learned), "
            f"or {keys['learn']} to learn every turn."
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
        "learned_token_share": chunk.learned_tokens / chunk.num_tokens if chunk.num_tokens else 0.0,
    }
