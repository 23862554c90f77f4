"""Real text that is on every machine after ``pip install``, and its token lengths.

- ``champ``: the CHAMP math dataset (PyPI ``champ-dataset``, MIT): 19,440 model conversations about 270
  competition problems. Chat-shaped SFT data: most conversations short, a long tail.
- ``stdlib``: the CPython standard library's ``.py`` sources of the running interpreter (site-packages
  excluded). Document-shaped data with a very heavy tail (a few files are 100k+ tokens).

Tokens come from ``quicktok`` (PyPI ``quicktok-v1``, MIT), which bundles the vocabularies of Qwen3,
Llama-3 and the OpenAI encodings, so nothing is downloaded.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import sysconfig
from pathlib import Path

import numpy as np

__all__ = [
    "REAL_CORPORA",
    "champ_conversation_texts",
    "champ_conversations",
    "get_tokenizer",
    "read_jsonl_field",
    "real_corpus_lengths",
    "stdlib_source_texts",
]

REAL_CORPORA = ("champ", "stdlib")
DEFAULT_ENCODING = "qwen3"


def _missing(package: str, extra: str = "data") -> ImportError:
    return ImportError(
        f"The real-text corpora need the PyPI package {package!r}. Install it with "
        f"`pip install 'mcore-packing[{extra}]'` (the README's setup script does this)."
    )


def get_tokenizer(encoding: str = DEFAULT_ENCODING):
    """A bundled-vocabulary BPE tokenizer (``quicktok``) with ``encode``/``decode``/``n_vocab``."""
    try:
        import quicktok
    except ImportError as exc:  # pragma: no cover - exercised only without the extra
        raise _missing("quicktok-v1") from exc
    return quicktok.get_encoding(encoding)


def champ_data_file() -> Path:
    """The CHAMP JSON file inside the installed ``champ-dataset`` package, found without importing it (its
    ``__init__`` imports natsort, which a bare GPU image lacks; the data is one file beside it)."""
    spec = importlib.util.find_spec("champ_dataset")
    if spec is None or not spec.submodule_search_locations:
        raise _missing("champ-dataset")
    path = Path(next(iter(spec.submodule_search_locations))) / "dataset_files" / "v0.json"
    if not path.is_file():
        raise FileNotFoundError(f"champ-dataset is installed but {path} is missing; reinstall champ-dataset.")
    return path


@functools.lru_cache(maxsize=1)
def champ_conversations() -> tuple[tuple[tuple[str, str], ...], ...]:
    """Every CHAMP conversation as ``((role, text), ...)`` (empty messages left out), in a stable order:
    problems by id, conversations by name. The one reader of the CHAMP JSON file."""
    with open(champ_data_file(), encoding="utf-8") as f:
        data = json.load(f)
    out = []
    for problem_id in sorted(data["problems"]):
        conversations = data["problems"][problem_id].get("conversations") or {}
        for name in sorted(conversations):
            messages = conversations[name].get("messages") or []
            turns = tuple((str(m["role"]), m["text"]) for m in messages if m.get("text"))
            if turns:
                out.append(turns)
    return tuple(out)


@functools.lru_cache(maxsize=1)
def champ_conversation_texts() -> tuple[str, ...]:
    """Every CHAMP conversation as one text: ``role: text`` lines joined by newlines."""
    return tuple("\n".join(f"{role}: {text}" for role, text in turns) for turns in champ_conversations())


@functools.lru_cache(maxsize=1)
def stdlib_source_texts() -> tuple[str, ...]:
    """The interpreter's non-empty standard-library ``.py`` files (no site-packages), sorted by path."""
    root = Path(sysconfig.get_paths()["stdlib"])
    texts = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "dist-packages", "__pycache__"))
        for name in sorted(filenames):
            if name.endswith(".py"):
                text = (Path(dirpath) / name).read_text(encoding="utf-8", errors="replace")
                if text.strip():  # empty __init__.py files are not documents
                    texts.append(text)
    if not texts:
        raise FileNotFoundError(f"No standard-library sources found under {root}.")
    return tuple(texts)


@functools.lru_cache(maxsize=8)
def real_corpus_lengths(corpus: str, encoding: str = DEFAULT_ENCODING) -> np.ndarray:
    """Token count of every document of a real corpus (``champ`` or ``stdlib``), as int64."""
    if corpus == "champ":
        texts = champ_conversation_texts()
    elif corpus == "stdlib":
        texts = stdlib_source_texts()
    else:
        raise ValueError(f"Unknown real corpus {corpus!r}. Valid names: {', '.join(REAL_CORPORA)}.")
    import quicktok

    counts = quicktok.count_batch(get_tokenizer(encoding), texts)
    lengths = np.asarray(counts, dtype=np.int64)
    lengths.setflags(write=False)
    return lengths


def read_jsonl_field(path: str, field: str, *, key: str = "the field name") -> list[tuple[int, object]]:
    """``(line, value)`` of ``field`` in every record of a JSONL file as stored (text, or a list of chat
    messages); ``key`` is the setting that names the field (for the error)."""
    from .jsonl import BadLines, field_of, read_jsonl_objects

    texts, bad = [], BadLines()
    for line_no, record in read_jsonl_objects(path):
        try:
            texts.append((line_no, field_of(record, field, f"{path}:{line_no}", key)))
        except ValueError as exc:
            bad.add(str(exc))
    bad.raise_any()
    if not texts:
        raise ValueError(f"{path} holds no records; the data set is empty.")
    return texts
