"""Sequence packers with a NeMo-RL-compatible interface.

``get_packer(algorithm, bin_capacity, ...)`` returns a packer whose ``.pack(lengths)`` gives, for each
bin, the input indices of the sequences in it. ``.pack_bins(lengths)`` returns the same as flat arrays
(`PackedBins`), which is what the planner uses at scale.

- ``concatenative`` (concat): input order, next fit (a new bin when the next one does not fit).
  O(n + B log n).
- ``first_fit_decreasing`` (ffd): longest first, first bin that fits. O(n log n + D*B), vectorized.
- ``best_fit_decreasing`` (bfd): longest first, the fitting bin with the least room. O(n log n) with
  residual buckets (or O(n log n + D*B log B) grouped when lengths repeat a lot).
- ``modified_first_fit_decreasing`` (mffd, the default): Johnson & Garey 1985, see ``_kernels``, followed
  by the bin-count refinement of ``_refine`` (``refine=False`` gives plain MFFD).
- ``first_fit_shuffle`` (ffs): seeded random order, first fit with a segment tree. O(n log n) in Python.

n sequences, B bins, D distinct lengths (<= capacity). The decreasing algorithms place all sequences of
one length in one step, which is what makes them fast; they produce exactly the bins of the item-by-item
textbook algorithms (the tests check this against plain reference implementations). ``refine=True`` (the
default for MFFD only) then repacks the short sequences of a few bins to remove bins; it never adds one.
"""

from __future__ import annotations

import abc
import enum
from collections.abc import Sequence
from typing import ClassVar

import numpy as np

from . import _kernels, _refine
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
"""NeMo-RL's default. With its refinement it stays within one bin of ceil(sum/C) on heavy-tailed data up to
a million sequences (benchmarks/README.md), where plain FFD/BFD/MFFD end two bins over."""

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
        refine: after packing, try to remove bins by repacking the short sequences of the emptiest and
            least full bins (``_refine``). ``None`` takes the algorithm's default: on for
            ``modified_first_fit_decreasing``, off for ``first_fit_decreasing`` and ``best_fit_decreasing``
            (which then give exactly the textbook bins) and ``first_fit_shuffle``. ``concatenative``
            cannot refine, as it promises the input order.
    """

    algorithm: ClassVar[PackingAlgorithm]
    refine_by_default: ClassVar[bool] = False

    def __init__(
        self,
        bin_capacity: int,
        *,
        min_bin_count: int | None = None,
        bin_count_multiple: int | None = None,
        seed: int | None = None,
        refine: bool | None = None,
    ) -> None:
        self.bin_capacity = check_capacity(bin_capacity)
        self.min_bin_count = check_optional_positive_int("min_bin_count", min_bin_count)
        self.bin_count_multiple = check_optional_positive_int("bin_count_multiple", bin_count_multiple)
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0):
            raise ValueError(f"seed must be a non-negative integer or None, got {seed!r}.")
        self.seed = seed
        if refine is not None and not isinstance(refine, (bool, np.bool_)):
            raise ValueError(f"refine must be True, False or None (the algorithm's default), got {refine!r}.")
        self.refine = self.refine_by_default if refine is None else bool(refine)
        if self.refine and self.algorithm is PackingAlgorithm.CONCATENATIVE:
            raise ValueError(
                "refine=True is not available for 'concatenative', which keeps the input order; "
                "use a decreasing algorithm (e.g. 'modified_first_fit_decreasing') or refine=False."
            )

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(bin_capacity={self.bin_capacity}, min_bin_count={self.min_bin_count}, "
            f"bin_count_multiple={self.bin_count_multiple}, seed={self.seed}, refine={self.refine})"
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
        if self.refine:
            items, bin_ids, num_bins = _refine.refine_assignment(lengths, items, bin_ids, num_bins, self.bin_capacity)
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
    """Johnson & Garey's MFFD (worst case 71/60 OPT + 1): pairs large with medium/small items first.

    Followed by the bin-count refinement unless ``refine=False``; that pass only runs when the result is
    above ceil(sum/C) and only keeps a change that removes bins.
    """

    algorithm = PackingAlgorithm.MODIFIED_FIRST_FIT_DECREASING
    refine_by_default = True

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
    refine: bool | None = None,
) -> SequencePacker:
    """Build a packer by algorithm name (see the module table); signature compatible with NeMo-RL's.

    ``refine`` (not in NeMo-RL) turns the bin-count refinement on or off; ``None`` is the algorithm's default.
    """
    cls = _PACKERS[resolve_algorithm(algorithm)]
    return cls(
        bin_capacity, min_bin_count=min_bin_count, bin_count_multiple=bin_count_multiple, seed=seed, refine=refine
    )
