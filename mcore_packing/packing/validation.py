"""Input checks shared by every packer.

Packing never truncates or drops a sequence, so bad input must fail loudly and say how to fix it.
All checks are vectorized: validating a million lengths costs a few milliseconds.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence

import numpy as np

from ..validators import require_positive_int

__all__ = ["as_lengths", "check_capacity", "check_optional_positive_int"]


def check_capacity(bin_capacity: object) -> int:
    """Return ``bin_capacity`` as an int, or raise a ValueError that says what is wrong."""
    if isinstance(bin_capacity, bool) or not isinstance(bin_capacity, numbers.Integral):
        raise ValueError(
            f"bin_capacity must be a positive integer number of tokens, got {bin_capacity!r} "
            f"({type(bin_capacity).__name__})."
        )
    if bin_capacity <= 0:
        raise ValueError(f"bin_capacity must be a positive integer number of tokens, got {bin_capacity}.")
    return int(bin_capacity)


def check_optional_positive_int(name: str, value: object) -> int | None:
    """Validate an optional count such as ``min_bin_count``; None means 'no constraint'."""
    require_positive_int(name, value, allow_none=True)
    return None if value is None else int(value)


def as_lengths(sequence_lengths: Sequence[int] | np.ndarray, bin_capacity: int) -> np.ndarray:
    """Convert lengths to a 1-D int64 array and check every value is a whole number in [1, bin_capacity].

    Accepts lists, tuples, numpy arrays and anything with ``__array__`` (e.g. a CPU torch tensor).
    Raises ValueError naming the first offending index and value, and the way out.
    """
    if hasattr(sequence_lengths, "detach"):  # torch tensor: avoid importing torch here
        sequence_lengths = sequence_lengths.detach().cpu().numpy()
    arr = np.asarray(sequence_lengths)
    if arr.ndim != 1:
        raise ValueError(f"sequence_lengths must be 1-D, got an array of shape {arr.shape}.")
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)
    if arr.dtype == np.bool_:
        raise ValueError("sequence_lengths must be integers, got booleans.")
    if arr.dtype.kind not in "iu":
        _raise_non_integer(arr)
    lengths = arr.astype(np.int64, copy=False)
    bad = np.flatnonzero(lengths <= 0)
    if bad.size:
        i = int(bad[0])
        raise ValueError(
            f"sequence_lengths[{i}] = {int(lengths[i])}: every length must be >= 1 "
            f"({bad.size} non-positive length(s) in total). Drop empty samples before packing."
        )
    too_long = np.flatnonzero(lengths > bin_capacity)
    if too_long.size:
        i = int(too_long[0])
        raise ValueError(
            f"sequence_lengths[{i}] = {int(lengths[i])} exceeds bin_capacity = {bin_capacity} "
            f"({too_long.size} sequence(s) too long, longest {int(lengths.max())}). Raise the capacity to at "
            f"least {int(lengths.max())}, or truncate/split those sequences upstream; nothing is truncated here."
        )
    return lengths


def _raise_non_integer(arr: np.ndarray) -> None:
    if arr.dtype.kind == "f":
        finite = np.isfinite(arr)
        whole = finite & (np.floor(arr) == arr)
        bad = np.flatnonzero(~whole)
        if bad.size:
            i = int(bad[0])
            raise ValueError(
                f"sequence_lengths[{i}] = {float(arr[i])!r} is not a whole number (NaN, inf or fractional); "
                "lengths must be integer token counts."
            )
        raise ValueError(
            f"sequence_lengths has float dtype {arr.dtype}; pass integer token counts "
            "(e.g. lengths.astype(int) after checking they are whole)."
        )
    for i, value in enumerate(arr.tolist()):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise ValueError(
                f"sequence_lengths[{i}] = {value!r} ({type(value).__name__}) is not an integer token count."
            )
    raise ValueError(f"sequence_lengths has unsupported dtype {arr.dtype}; pass integer token counts.")
