"""The one JSONL reader and its error style: every non-blank line of a file as a JSON object with its line
number, and `BadLines`, which gathers the problems of many lines into one error (SFT data, GRPO rollouts
and DPO pairs all read and check through them).

Every message names ``file:line`` (1-based), the field, the value and the fix; a file with several bad
lines reports up to `BadLines.SHOWN` of them at once, so a user fixes them in one pass.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

__all__ = ["BadLines", "field_of", "parse_jsonl_line", "read_jsonl_objects"]

T = TypeVar("T")


class BadLines:
    """Gathers `ValueError` messages of single lines (records) and raises them as one `ValueError`.

    ``check(fn, *args)`` returns ``fn(*args)``, or None after recording its `ValueError`; ``raise_any()``
    raises nothing, the one message, or ``"<N> <what> are bad"`` and the first `SHOWN` messages."""

    SHOWN = 10

    def __init__(self, what: str = "lines"):
        self.what = what
        self.messages: list[str] = []

    def add(self, message: str) -> None:
        self.messages.append(message)

    def check(self, fn: Callable[..., T], *args, **kwargs) -> T | None:
        try:
            return fn(*args, **kwargs)
        except ValueError as exc:
            self.add(str(exc))
            return None

    def raise_any(self) -> None:
        if not self.messages:
            return
        if len(self.messages) == 1:
            raise ValueError(self.messages[0])
        shown = self.messages[: self.SHOWN]
        more = len(self.messages) - len(shown)
        head = f"{len(self.messages)} {self.what} are bad" + (f" (the first {len(shown)} shown)" if more else "")
        raise ValueError(head + ":\n  " + "\n  ".join(shown) + (f"\n  ... and {more} more" if more else ""))


def read_jsonl_objects(path: str) -> list[tuple[int, dict]]:
    """``[(line number, object), ...]`` of ``path``; a missing file is a `FileNotFoundError`, lines that are
    not JSON objects one `ValueError` naming each ``file:line`` (`BadLines`). Blank lines are skipped; the
    list may be empty."""
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"JSONL file {path!r} does not exist.")
    records, bad = [], BadLines()
    with file.open("rb") as f:
        for number, raw in enumerate(f, 1):
            record = bad.check(parse_jsonl_line, raw, f"{path}:{number}")
            if record is not None:
                records.append((number, record))
    bad.raise_any()
    return records


def parse_jsonl_line(raw: bytes, where: str) -> dict | None:
    """One line (bytes) as a JSON object; None for a blank line; a `ValueError` naming ``where``
    (``file:line``) when it is not UTF-8, not JSON, or not an object."""
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{where} is not UTF-8 text (byte {exc.start} of the line); save the file as UTF-8.") from None
    if not line.strip():
        return None
    try:
        record = json.loads(line.rstrip("\r\n"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where} is not valid JSON ({exc.msg} at column {exc.colno}).") from None
    if not isinstance(record, dict):
        raise ValueError(f"{where} is a {type(record).__name__}, not a JSON object; one per line.")
    return record


def field_of(record: dict, field: str, where: str, key: str):
    """``record[field]``, or a `ValueError` naming ``where``, the fields present and ``key`` (the setting
    that names the field)."""
    if field not in record:
        raise ValueError(
            f"{where} has no field {field!r} (it has {sorted(record)}); set {key} to the field that holds the "
            "text (chat data: the list of messages, e.g. messages)."
        )
    return record[field]
