"""The one JSONL reader: every non-blank line of a file as a JSON object, with its line number, or an
error naming ``file:line`` (SFT data, GRPO rollouts and DPO pairs all read through it)."""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["read_jsonl_objects"]


def read_jsonl_objects(path: str) -> list[tuple[int, dict]]:
    """``[(line number, object), ...]`` of ``path``; a missing file is a `FileNotFoundError`, a line that is
    not a JSON object a `ValueError` naming ``file:line``. Blank lines are skipped; the list may be empty."""
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"JSONL file {path!r} does not exist.")
    records = []
    with file.open(encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{number} is not valid JSON ({exc.msg}).") from None
            if not isinstance(record, dict):
                raise ValueError(f"{path}:{number} is a {type(record).__name__}, not a JSON object; one per line.")
            records.append((number, record))
    return records
