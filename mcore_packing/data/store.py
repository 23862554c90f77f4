"""`PreparedStore`: a tokenized data set on disk, read through memory maps (``python -m mcore_packing
prepare`` writes it; ``data.prepared=STORE`` trains from it; ``plan --prepared STORE`` plans from it).

A store is a folder:

- ``tokens.bin`` / ``tokens.idx``: every sample's token ids, one sequence per sample, in Megatron-Core's
  own indexed-dataset format (``megatron.core.datasets.indexed_dataset``; the dtype is the smallest that
  holds the vocabulary: uint16 below 65,500 ids, else int32);
- ``spans.bin`` / ``spans.idx``: the same format, int32: each sample's learned token ranges as
  ``start, end`` pairs (a conversation's assistant turns; one ``0, n`` for plain text): two numbers per
  turn instead of a float per token;
- ``manifest.json``: the format, the store's ``kind``, the source's and the tokenizer's fingerprints, the
  data settings (``data.*`` keys: long-sample policy, limit, learned turns), the counts (records, samples,
  tokens, dropped / truncated / split) and every file's size.

Kinds (`KINDS`): ``sft`` (one sample per text or conversation, or per piece of a split text); ``pairs``
(DPO: sample ``2i`` is pair ``i``'s chosen response, ``2i + 1`` its rejected one, each prompt + response
with the response learned); ``rollouts`` (GRPO: one sample per sampled response, prompt + response, the
response learned, so the prompt's length is the first span's start), which adds

- ``logprobs.bin`` / ``logprobs.idx``: float64, each rollout's generation log-probs (none: length 0;
  a response is never empty);
- ``rollouts.json``: ``{"rewards": [...], "group_ids": [...]}``, one entry per rollout (JSON keeps both the
  floats and int or string group ids exactly).

Reading and writing need numpy only (no torch, no megatron-core import: ``prepare`` runs on a login node,
and the planner gets a million lengths in milliseconds): `read_index` parses the ``.idx`` layout (header,
version, dtype code, sequence and document counts, then the sequence lengths, byte offsets and document
indices) and checks it against the file's size; `IndexedWriter` writes it (one document per sample), and
the tests read what it writes with megatron-core's own ``IndexedDataset``. Opening a store checks every
file against the manifest (missing, truncated, or written by an unfinished `prepare`: each refused naming
the file); the store's `fingerprint` (a hash of the manifest, which holds the sizes and the index hashes)
is what checkpoints record.
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

import numpy as np

from .sample import SequenceSample

__all__ = [
    "FORMAT",
    "KINDS",
    "MANIFEST",
    "IndexedWriter",
    "PreparedStore",
    "mask_from_spans",
    "read_index",
    "spans_from_mask",
    "store_files",
    "token_dtype",
]

FORMAT = "mcore_packing.prepared/2"
MANIFEST = "manifest.json"
KINDS = ("sft", "pairs", "rollouts")
_FILES = ("tokens.bin", "tokens.idx", "spans.bin", "spans.idx")
_ROLLOUT_FILES = ("logprobs.bin", "logprobs.idx", "rollouts.json")


def store_files(kind: str) -> tuple[str, ...]:
    """The files a store of ``kind`` holds besides its manifest."""
    return _FILES + (_ROLLOUT_FILES if kind == "rollouts" else ())

_HEADER = b"MMIDIDX\x00\x00"
_DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32,
           8: np.uint16}  # fmt: skip
"""Megatron-Core's ``DType`` codes."""


class IndexedWriter:
    """Appends sequences to ``<prefix>.bin`` and writes ``<prefix>.idx`` at `finalize` (Megatron-Core's
    indexed-dataset layout, one document per sequence)."""

    def __init__(self, prefix: str | Path, dtype):
        self.prefix, self.dtype = Path(prefix), np.dtype(dtype)
        self.data = open(self.prefix.with_suffix(".bin"), "wb")
        self.lengths: list[np.ndarray] = []

    def add(self, values: np.ndarray, lengths: np.ndarray) -> None:
        """Sequences given as their concatenated ``values`` and each one's length."""
        self.data.write(np.asarray(values, dtype=self.dtype).tobytes())
        self.lengths.append(np.asarray(lengths, dtype=np.int32))

    def finalize(self) -> None:
        self.data.close()
        lengths = np.concatenate(self.lengths) if self.lengths else np.zeros(0, np.int32)
        pointers = np.zeros(len(lengths), dtype=np.int64)
        np.cumsum(lengths[:-1].astype(np.int64) * self.dtype.itemsize, out=pointers[1:])
        code = {np.dtype(v): k for k, v in _DTYPES.items()}[self.dtype]
        with open(self.prefix.with_suffix(".idx"), "wb") as f:
            f.write(_HEADER + struct.pack("<QBQQ", 1, code, len(lengths), len(lengths) + 1))
            f.write(lengths.tobytes() + pointers.tobytes() + np.arange(len(lengths) + 1, dtype=np.int64).tobytes())


def token_dtype(vocab_size: int):
    """The smallest dtype for ids below ``vocab_size`` (Megatron-Core's rule)."""
    return np.uint16 if vocab_size < 65500 else np.int32


def spans_from_mask(mask: np.ndarray) -> np.ndarray:
    """``[start, end, start, end, ...]`` (int32) of the runs of nonzero ``mask`` entries."""
    on = np.concatenate([[0], (np.asarray(mask) != 0).astype(np.int8), [0]])
    edges = np.flatnonzero(np.diff(on))
    return edges.astype(np.int32)


def mask_from_spans(spans: np.ndarray, length: int) -> np.ndarray:
    """The float32 0/1 mask of ``length`` tokens that `spans_from_mask` describes."""
    mask = np.zeros(length, dtype=np.float32)
    for start, end in np.asarray(spans).reshape(-1, 2):
        mask[start:end] = 1.0
    return mask


def read_index(path: str | Path) -> tuple[np.dtype, np.ndarray, np.ndarray]:
    """``(dtype, lengths, pointers)`` of a Megatron-Core ``.idx`` file (lengths int32 and byte offsets int64
    as memory maps); a `ValueError` naming the file when it is not one or is cut short."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(34)
    if len(head) < 34 or head[:9] != _HEADER:
        raise ValueError(f"{path} is not a Megatron-Core indexed-dataset index (bad header).")
    version, code, count, documents = struct.unpack("<QBQQ", head[9:34])
    if version != 1 or code not in _DTYPES:
        raise ValueError(f"{path}: index version {version}, dtype code {code}; expected version 1.")
    expected = 34 + count * 4 + count * 8 + documents * 8
    if size < expected:
        raise ValueError(f"{path} is truncated: {size} bytes, its header promises {expected}.")
    lengths = np.memmap(path, dtype=np.int32, mode="r", offset=34, shape=(count,)) if count else np.zeros(0, np.int32)
    pointers = (np.memmap(path, dtype=np.int64, mode="r", offset=34 + 4 * count, shape=(count,)) if count
                else np.zeros(0, np.int64))  # fmt: skip
    return np.dtype(_DTYPES[code]), lengths, pointers


def _memmap(path: Path, dtype) -> np.ndarray:
    """A read-only memory map of ``path`` (an empty array for an empty file, which numpy cannot map)."""
    return np.memmap(path, dtype=dtype, mode="r") if path.stat().st_size else np.zeros(0, dtype)


def file_digest(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


class PreparedStore:
    """A store written by ``prepare`` (see the module docstring): ``len(store)`` samples, ``store.lengths``
    (int32, memory-mapped), ``store[i]`` one `SequenceSample` read from the memory maps."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        path = self.folder / MANIFEST
        if not path.is_file():
            hint = " (a prepare that did not finish leaves no manifest)" if self.folder.is_dir() else ""
            raise FileNotFoundError(f"{path} does not exist{hint}: data.prepared names a folder written by "
                                    "python -m mcore_packing prepare.")  # fmt: skip
        try:
            self.manifest = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ValueError(f"{path} is not valid JSON ({exc}); prepare the store again.") from None
        if self.manifest.get("format") != FORMAT:
            raise ValueError(f"{path}: format {self.manifest.get('format')!r}, this version reads {FORMAT!r}; "
                             "prepare the store again with this version.")  # fmt: skip
        self.kind = self.manifest["kind"]
        self._check_files()
        self.dtype, self.lengths, self._pointers = read_index(self.folder / "tokens.idx")
        _, span_lengths, self._span_pointers = read_index(self.folder / "spans.idx")
        if len(span_lengths) != len(self.lengths) or len(self.lengths) != self.manifest["counts"]["num_samples"]:
            raise ValueError(f"{self.folder}: tokens.idx has {len(self.lengths)} samples, spans.idx "
                             f"{len(span_lengths)}, the manifest {self.manifest['counts']['num_samples']}; prepare "
                             "the store again.")  # fmt: skip
        self._span_lengths = span_lengths
        self._tokens = _memmap(self.folder / "tokens.bin", self.dtype)
        self._spans = _memmap(self.folder / "spans.bin", np.int32)
        if self.kind == "rollouts":
            _, self._logprob_lengths, self._logprob_pointers = read_index(self.folder / "logprobs.idx")
            self._logprobs = _memmap(self.folder / "logprobs.bin", np.float64)
            extras = json.loads((self.folder / "rollouts.json").read_text())
            self.rewards, self.group_ids = extras["rewards"], extras["group_ids"]

    def _check_files(self) -> None:
        for name in store_files(self.kind):
            file = self.folder / name
            if not file.is_file():
                raise FileNotFoundError(f"{file} is missing; the store is incomplete. Prepare it again.")
            size, expected = file.stat().st_size, self.manifest["files"][name]["bytes"]
            if size != expected:
                raise ValueError(f"{file} has {size} bytes but the manifest records {expected}: the store was "
                                 "changed or cut short after prepare. Prepare it again.")  # fmt: skip
        for name in (n for n in store_files(self.kind) if n.endswith((".idx", ".json"))):  # small: hashed in full
            if file_digest(self.folder / name) != self.manifest["files"][name]["sha256"]:
                raise ValueError(f"{self.folder / name} differs from the one prepare wrote (sha256); prepare the "
                                 "store again.")  # fmt: skip

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> SequenceSample:
        n = int(self.lengths[i])
        start = int(self._pointers[i]) // self.dtype.itemsize
        tokens = np.asarray(self._tokens[start : start + n], dtype=np.int64)
        return SequenceSample(tokens, mask_from_spans(self.spans(i), n))

    def spans(self, i: int) -> np.ndarray:
        """Sample ``i``'s learned ranges, ``[start, end, start, end, ...]``."""
        s = int(self._span_pointers[i]) // 4
        return self._spans[s : s + int(self._span_lengths[i])]

    def without_logprobs(self) -> np.ndarray:
        """A rollouts store's rollouts that carry no generation log-probs (indices, ascending)."""
        return np.flatnonzero(np.asarray(self._logprob_lengths) == 0)

    def logprobs(self, i: int) -> np.ndarray | None:
        """A rollouts store's generation log-probs of rollout ``i`` (float64), None when it had none."""
        n = int(self._logprob_lengths[i])
        start = int(self._logprob_pointers[i]) // 8
        return np.asarray(self._logprobs[start : start + n]) if n else None

    @property
    def vocab_size(self) -> int:
        return int(self.manifest["vocab_size"])

    @property
    def info(self) -> dict:
        return {"source": f"prepared:{self.folder}", "kind": self.kind, **self.manifest["counts"],
                **self.manifest["settings"],
                "tokenizer": self._tokenizer_name, "vocab_size": self.vocab_size}  # fmt: skip

    @property
    def _tokenizer_name(self) -> str:
        tokenizer = self.manifest["tokenizer"]
        return tokenizer["name"] if tokenizer is not None else "the records' own token ids"

    @property
    def fingerprint(self) -> str:
        """What identifies the store's content: a hash of its manifest (sizes and index hashes included)."""
        return hashlib.sha256((self.folder / MANIFEST).read_bytes()).hexdigest()[:16]
