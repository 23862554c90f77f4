"""Small argument checks shared by every layer (no dependencies), so each rule and its message exist once.

Each check raises ``error`` (`InvalidValue` unless the caller passes another ``ValueError`` subclass,
e.g. the app's ``ConfigError``) with a message that names the value and what would be accepted.
`InvalidValue` is the one typed error of the lower layers' settings: it carries the key it was given, so
the app can name it with its config group (``loss_fn.ratio_clip_c``) and a command can tell a bad
setting (exit 2) from a crash.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable

__all__ = ["InvalidValue", "require_choice", "require_positive_int", "require_positive_number"]


class InvalidValue(ValueError):
    """A bad value for a named setting; ``key`` is the name the check was given, and the message starts
    with it."""

    def __init__(self, message: str, *, key: str | None = None):
        super().__init__(message)
        self.key = key


def _error(error: type[Exception], name: str, message: str) -> Exception:
    return error(message, key=name) if issubclass(error, InvalidValue) else error(message)


def require_positive_int(name: str, value, *, allow_none: bool = False, error: type[Exception] = InvalidValue) -> None:
    """``value`` must be an integer >= 1 (Python or numpy; bools are refused), or None when ``allow_none``."""
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        accepted = "an integer >= 1" + (" or None (no constraint)" if allow_none else "")
        raise _error(error, name, f"{name} must be {accepted}, got {value!r}.")


def require_positive_number(name: str, value, *, error: type[Exception] = InvalidValue) -> None:
    """``value`` must be a finite int or float > 0 (bools are refused)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 < value < float("inf"):
        raise _error(error, name, f"{name} must be a positive number, got {value!r}.")


def require_choice(name: str, value, choices: Iterable, *, error: type[Exception] = InvalidValue) -> None:
    """``value`` must be one of ``choices``."""
    choices = tuple(choices)
    if value not in choices:
        raise _error(error, name, f"{name} must be one of {', '.join(map(str, choices))}; got {value!r}.")
