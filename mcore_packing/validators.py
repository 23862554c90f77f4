"""Small argument checks shared by every layer (no dependencies), so each rule and its message exist once.

Each check raises ``error`` (``ValueError`` unless the caller passes a subclass, e.g. the app's
``ConfigError``) with a message that names the value and what would be accepted.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable

__all__ = ["require_choice", "require_positive_int", "require_positive_number"]


def require_positive_int(name: str, value, *, allow_none: bool = False, error: type[Exception] = ValueError) -> None:
    """``value`` must be an integer >= 1 (Python or numpy; bools are refused), or None when ``allow_none``."""
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        accepted = "an integer >= 1" + (" or None (no constraint)" if allow_none else "")
        raise error(f"{name} must be {accepted}, got {value!r}.")


def require_positive_number(name: str, value, *, error: type[Exception] = ValueError) -> None:
    """``value`` must be a finite int or float > 0 (bools are refused)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 < value < float("inf"):
        raise error(f"{name} must be a positive number, got {value!r}.")


def require_choice(name: str, value, choices: Iterable, *, error: type[Exception] = ValueError) -> None:
    """``value`` must be one of ``choices``."""
    choices = tuple(choices)
    if value not in choices:
        raise error(f"{name} must be one of {', '.join(map(str, choices))}; got {value!r}.")
