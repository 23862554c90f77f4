"""SFT samples from real text: token ids and a loss mask per sample, ready for packing.

Sources: the bundled CHAMP conversations (learn the model turns; system and user turns are masked out
unless ``learn_prompt``) or a user JSONL file with a text field (every token learned).

Tokens come from quicktok's bundled vocabulary, then map to a *compact* vocabulary: the
``vocab_size - 1`` most frequent ids of the loaded samples keep a slot, the rest share ``<unk>`` (id 0).
That keeps the demo model's embedding and output layer small; it changes which ids the model sees,
never how many tokens a sample has.

Samples longer than ``max_sample_tokens``: ``split`` into consecutive pieces (no token lost),
``drop`` (counted and reported), or ``error``.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np

from .real_text import champ_conversations, get_tokenizer, read_jsonl_texts
from .sample import SequenceSample

__all__ = ["SftData", "load_sft_data"]

UNK_ID = 0


@dataclass(frozen=True)
class SftData:
    samples: list[SequenceSample]
    vocab_size: int
    info: dict


def _champ_segments(learn_prompt: bool) -> list[list[tuple[str, bool]]]:
    return [
        [(f"{role}: {text}\n", learn_prompt or role.startswith("Model")) for role, text in turns]
        for turns in champ_conversations()
    ]


def _jsonl_segments(path: str, field: str) -> list[list[tuple[str, bool]]]:
    return [[(text, True)] for text in read_jsonl_texts(path, field)]


def _tokenize(records, encoding: str) -> tuple[list[list[int]], list[list[float]]]:
    """Token ids and a per-token learned flag of every record (records without tokens are left out)."""
    tokenizer = get_tokenizer(encoding)
    encode = tokenizer.encode_ordinary if hasattr(tokenizer, "encode_ordinary") else tokenizer.encode
    token_lists, mask_lists = [], []
    for segments in records:
        ids, mask = [], []
        for text, learned in segments:
            piece = encode(text)
            ids.extend(piece)
            mask.extend([1.0 if learned else 0.0] * len(piece))
        if ids:
            token_lists.append(ids)
            mask_lists.append(mask)
    return token_lists, mask_lists


def _limit_lengths(token_lists, mask_lists, remap, long_samples: str, max_sample_tokens: int):
    """Samples in the compact vocabulary, long ones split, dropped or refused; returns (samples, split, dropped)."""
    samples: list[SequenceSample] = []
    dropped = split = 0
    for ids, mask in zip(token_lists, mask_lists, strict=True):
        compact = np.fromiter((remap.get(t, UNK_ID) for t in ids), dtype=np.int64, count=len(ids))
        mask_arr = np.asarray(mask, dtype=np.float32)
        if len(ids) <= max_sample_tokens:
            samples.append(SequenceSample(compact, mask_arr))
            continue
        if long_samples == "error":
            raise ValueError(
                f"A sample has {len(ids)} tokens, over data.max_sample_tokens={max_sample_tokens}. Raise it, or set "
                "data.long_samples=split (keeps every token in pieces) or drop."
            )
        if long_samples == "drop":
            dropped += 1
            continue
        split += 1
        for lo in range(0, len(ids), max_sample_tokens):
            samples.append(SequenceSample(compact[lo : lo + max_sample_tokens], mask_arr[lo : lo + max_sample_tokens]))
    return samples, split, dropped


def load_sft_data(
    *,
    source: str = "champ",
    path: str | None = None,
    text_field: str = "text",
    encoding: str = "qwen3",
    vocab_size: int = 4096,
    num_samples: int | None = None,
    long_samples: str = "split",
    max_sample_tokens: int = 2048,
    learn_prompt: bool = False,
) -> SftData:
    """Load, tokenize, compact the vocabulary and handle long samples (see the module docstring)."""
    if source == "champ":
        records = _champ_segments(learn_prompt)
    elif source == "jsonl":
        records = _jsonl_segments(path, text_field)
    else:
        raise ValueError(f"data.source must be 'champ' or 'jsonl', got {source!r}.")
    if num_samples is not None and num_samples < len(records):
        # Evenly spaced over the corpus (CHAMP is ordered by problem), deterministic.
        picks = np.linspace(0, len(records) - 1, num_samples).round().astype(int)
        records = [records[i] for i in picks]
    token_lists, mask_lists = _tokenize(records, encoding)
    counts = Counter(t for ids in token_lists for t in ids)
    keep = [t for t, _ in counts.most_common(vocab_size - 1)]
    remap = {t: i + 1 for i, t in enumerate(keep)}
    total_tokens = sum(len(ids) for ids in token_lists)
    samples, split, dropped = _limit_lengths(token_lists, mask_lists, remap, long_samples, max_sample_tokens)
    if not samples:
        raise ValueError("No samples are left after loading; check data.source/path and data.long_samples.")
    unk = sum(c for t, c in counts.items() if t not in remap)
    info = {
        "source": source,
        "num_records": len(records),
        "num_samples": len(samples),
        "num_tokens": total_tokens,
        "long_samples_split": split,
        "long_samples_dropped": dropped,
        "vocab_size": vocab_size,
        "unk_token_share": unk / total_tokens if total_tokens else 0.0,
        "learned_token_share": float(np.mean(np.concatenate([np.asarray(m) for m in mask_lists]))),
    }
    return SftData(samples=samples, vocab_size=vocab_size, info=info)
