"""Sequence packers with a NeMo-RL-compatible interface.

``get_packer(algorithm, bin_capacity, ...)`` returns a packer whose ``.pack(lengths)`` gives, for each
bin, the input indices of the sequences in it. ``.pack_bins(lengths)`` returns the same as flat arrays
(`PackedBins`), which is what the planner uses at scale.

- ``concatenative`` (concat): input order, next fit (a new bin when the next one does not fit).
  O(n + B log n).
- ``first_fit_decreasing`` (ffd): longest first, first bin that fits. O(n log n + D*B), vectorized.
- ``best_fit_decreasing`` (bfd): longest first, the fitting bin with the least room. O(n log n + D*B log B).
- ``modified_first_fit_decreasing`` (mffd, the default): Johnson & Garey 1985, see ``_kernels``.
- ``first_fit_shuffle`` (ffs): seeded random order, first fit with a segment tree. O(n log n) in Python.

n sequences, B bins, D distinct lengths (<= capacity). The decreasing algorithms place all sequences of
one length in one vectorized step, which is what makes them fast; they produce exactly the bins of the
item-by-item textbook algorithms (the tests check this against plain reference implementations).
"""

from __future__ import annotations

import abc
import enum
from collections.abc import Sequence
from typing import ClassVar

import numpy as np

from . import _kernels
from .bins import PackedBins
from .constraints import enforce_bin_count
from .validation import as_lengths, check_capacity, check_optional_positive_int

__all__ = [
    "ALGORITHM_ALIASES",
    "DEFAULT_ALGORITHM",
    "BestFitDecreasingPacker",
    "ConcatenativePacker",
    "FirstFitDecreasingPacker",
    "FirstFitShufflePacker",
    "ModifiedFirstFitDecreasingPacker",
    "PackingAlgorithm",
    "SequencePacker",
    "get_packer",
    "resolve_algorithm",
]


class PackingAlgorithm(str, enum.Enum):
    """Algorithm names, identical to NeMo-RL's so configs carry over unchanged."""

    CONCATENATIVE = "concatenative"
    FIRST_FIT_DECREASING = "first_fit_decreasing"
    FIRST_FIT_SHUFFLE = "first_fit_shuffle"
    MODIFIED_FIRST_FIT_DECREASING = "modified_first_fit_decreasing"
    BEST_FIT_DECREASING = "best_fit_decreasing"


DEFAULT_ALGORITHM = PackingAlgorithm.MODIFIED_FIRST_FIT_DECREASING
"""NeMo-RL's default; on heavy-tailed data all decreasing algorithms reach within one bin of the bound."""

ALGORITHM_ALIASES: dict[str, PackingAlgorithm] = {
    "concat": PackingAlgorithm.CONCATENATIVE,
    "ffd": PackingAlgorithm.FIRST_FIT_DECREASING,
    "ffs": PackingAlgorithm.FIRST_FIT_SHUFFLE,
    "mffd": PackingAlgorithm.MODIFIED_FIRST_FIT_DECREASING,
    "bfd": PackingAlgorithm.BEST_FIT_DECREASING,
}


class SequencePacker(abc.ABC):
    """Base class of all packers.

    Args:
        bin_capacity: tokens per bin (micro-batch); every sequence must fit.
        min_bin_count: produce at least this many bins (e.g. the data-parallel size).
        bin_count_multiple: make the bin count a multiple of this (e.g. the data-parallel size).
        seed: seed of the packer's own RNG (only ``first_fit_shuffle`` draws from it; never the global RNG).
    """

    algorithm: ClassVar[PackingAlgorithm]

    def __init__(
        self,
        bin_capacity: int,
        *,
        min_bin_count: int | None = None,
        bin_count_multiple: int | None = None,
        seed: int | None = None,
    ) -> None:
        self.bin_capacity = check_capacity(bin_capacity)
        self.min_bin_count = check_optional_positive_int("min_bin_count", min_bin_count)
        self.bin_count_multiple = check_optional_positive_int("bin_count_multiple", bin_count_multiple)
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0):
            raise ValueError(f"seed must be a non-negative integer or None, got {seed!r}.")
        self.seed = seed

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(bin_capacity={self.bin_capacity}, min_bin_count={self.min_bin_count}, "
            f"bin_count_multiple={self.bin_count_multiple}, seed={self.seed})"
        )

    def pack(self, sequence_lengths: Sequence[int] | np.ndarray) -> list[list[int]]:
        """Pack and return, for each bin, the indices of its sequences. Empty input gives ``[]``."""
        return self.pack_bins(sequence_lengths).to_lists()

    def pack_bins(self, sequence_lengths: Sequence[int] | np.ndarray) -> PackedBins:
        """Pack and return the bins as flat arrays (`PackedBins`)."""
        lengths = as_lengths(sequence_lengths, self.bin_capacity)
        if lengths.size == 0:
            return PackedBins.empty()
        items, bin_ids, num_bins = self._assign(lengths)
        indices, offsets = _kernels.bins_from_assignment(items, bin_ids, num_bins)
        return enforce_bin_count(
            PackedBins(indices, offsets),
            lengths,
            min_bin_count=self.min_bin_count,
            bin_count_multiple=self.bin_count_multiple,
        )

    @abc.abstractmethod
    def _assign(self, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
        """Return ``(items_in_placement_order, bin_id_of_each, num_bins)`` for valid, non-empty lengths."""


class ConcatenativePacker(SequencePacker):
    """Keeps the input order: sequences fill a bin until the next one does not fit (next fit)."""

    algorithm = PackingAlgorithm.CONCATENATIVE

    def _assign(self, lengths):
        bin_ids, num_bins = _kernels.next_fit_in_order(lengths, self.bin_capacity)
        return np.arange(lengths.size, dtype=np.int64), bin_ids, num_bins


class _DecreasingFitPacker(SequencePacker):
    best_fit: ClassVar[bool]

    def _assign(self, lengths):
        order = _kernels.stable_descending_order(lengths)
        bin_ids, residual = _kernels.decreasing_fit(lengths[order], self.bin_capacity, best_fit=self.best_fit)
        return order, bin_ids, int(residual.size)


class FirstFitDecreasingPacker(_DecreasingFitPacker):
    """Longest first; each sequence goes to the first bin with room (ties keep input order)."""

    algorithm = PackingAlgorithm.FIRST_FIT_DECREASING
    best_fit = False


class BestFitDecreasingPacker(_DecreasingFitPacker):
    """Longest first; each sequence goes to the fitting bin with the least room left (lowest index on ties)."""

    algorithm = PackingAlgorithm.BEST_FIT_DECREASING
    best_fit = True


class ModifiedFirstFitDecreasingPacker(SequencePacker):
    """Johnson & Garey's MFFD (worst case 71/60 OPT + 1): pairs large with medium/small items first."""

    algorithm = PackingAlgorithm.MODIFIED_FIRST_FIT_DECREASING

    def _assign(self, lengths):
        return _kernels.modified_first_fit_decreasing(lengths, self.bin_capacity)


class FirstFitShufflePacker(SequencePacker):
    """First fit over a seeded random permutation: cheap, less sorted bins (mixes lengths within a bin)."""

    algorithm = PackingAlgorithm.FIRST_FIT_SHUFFLE

    def _assign(self, lengths):
        order = np.random.default_rng(self.seed).permutation(lengths.size)
        bin_ids, num_bins = _kernels.first_fit_in_order(lengths[order], self.bin_capacity)
        return order, bin_ids, num_bins


_PACKERS: dict[PackingAlgorithm, type[SequencePacker]] = {
    cls.algorithm: cls
    for cls in (
        ConcatenativePacker,
        FirstFitDecreasingPacker,
        FirstFitShufflePacker,
        ModifiedFirstFitDecreasingPacker,
        BestFitDecreasingPacker,
    )
}


def resolve_algorithm(algorithm: str | PackingAlgorithm) -> PackingAlgorithm:
    """Map a name or alias (case-insensitive) to a `PackingAlgorithm`, or raise listing the valid names."""
    if isinstance(algorithm, PackingAlgorithm):
        return algorithm
    key = str(algorithm).strip().lower()
    if key in ALGORITHM_ALIASES:
        return ALGORITHM_ALIASES[key]
    try:
        return PackingAlgorithm(key)
    except ValueError:
        valid = ", ".join([a.value for a in PackingAlgorithm] + sorted(ALGORITHM_ALIASES))
        raise ValueError(f"Unknown packing algorithm {algorithm!r}. Valid names: {valid}.") from None


def get_packer(
    algorithm: str | PackingAlgorithm,
    bin_capacity: int,
    *,
    min_bin_count: int | None = None,
    bin_count_multiple: int | None = None,
    seed: int | None = None,
) -> SequencePacker:
    """Build a packer by algorithm name (see the module table); signature compatible with NeMo-RL's."""
    cls = _PACKERS[resolve_algorithm(algorithm)]
    return cls(bin_capacity, min_bin_count=min_bin_count, bin_count_multiple=bin_count_multiple, seed=seed)
