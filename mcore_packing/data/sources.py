"""`RecordSource`: the records of a data set on disk, streamed in chunks (``prepare`` reads through it).

``--input`` may be:

- a JSONL file (one JSON object per line), read line by line as bytes: a worker process decodes them,
  so the parent never holds more than a chunk;
- a Parquet file, read a row group batch at a time through pyarrow (``compat.require_pyarrow``);
- a Hugging Face ``datasets`` folder written by ``save_to_disk``: a ``Dataset`` (``state.json`` lists its
  Arrow stream files in order) or a ``DatasetDict`` (``dataset_dict.json`` lists its splits; ``--split``
  picks one, default ``train``). Its Arrow files are read batch by batch from memory maps;
- a folder of ``*.jsonl`` or ``*.parquet`` shards, read in name order.

Rows come out as dicts (a ``messages`` column of structs as a list of ``{"role", "content"}`` dicts), so
every form goes through the same record checks. Each `Chunk` locates its records for error messages:
``file:line`` (JSONL, 1-based lines) or ``file row N`` (Parquet and Arrow, 0-based rows, as
``datasets`` numbers them). `RecordSource.chunks` feeds every byte of every file to a hash as it
streams, which is the source's fingerprint in the store's manifest.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Chunk", "RecordSource"]

_BLOCK = 1 << 20


@dataclass(frozen=True)
class Chunk:
    """Consecutive records of one file: raw JSONL lines (``raw``: bytes, decoded by the reader) or rows."""

    file: str
    first: int  # the first record's line (JSONL, 1-based) or row (0-based)
    items: list
    raw: bool

    def where(self, i: int) -> str:
        """Where record ``i`` of the chunk is, for messages."""
        return f"{self.file}:{self.first + i}" if self.raw else f"{self.file} row {self.first + i}"


class RecordSource:
    """The files of ``path`` (see the module docstring), checked when built: a missing path, an empty
    folder, a folder mixing forms or an unknown split are each a clear error naming the fix."""

    def __init__(self, path: str | Path, *, split: str | None = None):
        self.path = Path(path)
        if not self.path.exists():
            raise FileNotFoundError(f"--input {self.path} does not exist (a JSONL or Parquet file, a folder of "
                                    "them, or a Hugging Face datasets folder from save_to_disk).")  # fmt: skip
        self.form, self.files = self._find(split)

    def _find(self, split: str | None) -> tuple[str, list[Path]]:
        path = self.path
        if path.is_file():
            form = _form_of(path)
            if form is None:
                raise ValueError(f"--input {path}: unknown file type {path.suffix!r}; give a .jsonl (or .json "
                                 "lines) or .parquet file, or a folder.")  # fmt: skip
            return form, [path]
        if (path / "dataset_dict.json").is_file():
            splits = json.loads((path / "dataset_dict.json").read_text())["splits"]
            chosen = split or ("train" if "train" in splits else splits[0] if len(splits) == 1 else None)
            if chosen not in splits:
                raise ValueError(f"--input {path} is a DatasetDict with splits {splits}; pass --split with one "
                                 f"of them{f' (got {split!r})' if split else ''}.")  # fmt: skip
            path = path / chosen
        if (path / "state.json").is_file():
            state = json.loads((path / "state.json").read_text())
            files = [path / entry["filename"] for entry in state["_data_files"]]
            missing = [str(f) for f in files if not f.is_file()]
            if missing:
                raise FileNotFoundError(f"{path}/state.json lists {missing[:3]}, which are missing; save the "
                                        "dataset again.")  # fmt: skip
            return "arrow", files
        if split is not None:
            raise ValueError(f"--split {split} is for a Hugging Face DatasetDict folder; {path} is not one.")
        shards = sorted(p for p in path.iterdir() if p.is_file() and _form_of(p) is not None)
        forms = {_form_of(p) for p in shards}
        if not shards:
            raise ValueError(f"--input {path} is a folder without .jsonl or .parquet files or a Hugging Face "
                             "datasets folder (state.json or dataset_dict.json).")  # fmt: skip
        if len(forms) > 1:
            raise ValueError(f"--input {path} mixes {sorted(forms)} files; keep one kind of shard per folder.")
        return forms.pop(), shards

    @property
    def bytes(self) -> int:
        return sum(f.stat().st_size for f in self.files)

    def chunks(self, size: int, digest):
        """`Chunk` s of at most ``size`` records, file by file, in order; ``digest`` (a hashlib object) sees
        every file's name and bytes."""
        for file in self.files:
            digest.update(file.name.encode() + b"\0")
            if self.form == "jsonl":
                yield from _jsonl_chunks(file, size, digest)
                continue
            with open(file, "rb") as f:
                for block in iter(lambda f=f: f.read(_BLOCK), b""):
                    digest.update(block)
            yield from _arrow_chunks(file, size, self.form)


def _form_of(path: Path) -> str | None:
    return {".jsonl": "jsonl", ".json": "jsonl", ".parquet": "parquet", ".arrow": "arrow"}.get(path.suffix)


def _jsonl_chunks(path: Path, size: int, digest):
    lines, first = [], 1
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            digest.update(raw)
            if not lines:
                first = number
            lines.append(raw)
            if len(lines) == size:
                yield Chunk(str(path), first, lines, raw=True)
                lines = []
    if lines:
        yield Chunk(str(path), first, lines, raw=True)


def _arrow_chunks(path: Path, size: int, form: str):
    from ..compat import require_pyarrow

    pa = require_pyarrow()
    if form == "parquet":
        import pyarrow.parquet as pq

        batches = pq.ParquetFile(path).iter_batches(batch_size=size)
    else:
        batches = pa.ipc.open_stream(pa.memory_map(str(path))).__iter__()
    row, pending = 0, []
    for batch in batches:
        pending.extend(batch.to_pylist())
        while len(pending) >= size:
            yield Chunk(str(path), row, pending[:size], raw=False)
            row, pending = row + size, pending[size:]
    if pending:
        yield Chunk(str(path), row, pending, raw=False)
