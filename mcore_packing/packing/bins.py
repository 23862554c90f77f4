"""`PackedBins`: the result of packing, stored as flat arrays (CSR) so a million sequences stay cheap."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import pairwise

import numpy as np

__all__ = ["PackedBins"]


@dataclass(frozen=True)
class PackedBins:
    """Bins as ``indices`` grouped by bin plus ``offsets``: bin ``b`` is ``indices[offsets[b]:offsets[b+1]]``.

    Example: bins ``[[3, 0], [1], [2]]`` are ``indices=[3, 0, 1, 2]``, ``offsets=[0, 2, 3, 4]``.
    Inside a bin, sequences keep the order the algorithm placed them in.
    """

    indices: np.ndarray
    offsets: np.ndarray

    @classmethod
    def empty(cls) -> PackedBins:
        return cls(np.zeros(0, dtype=np.int64), np.zeros(1, dtype=np.int64))

    @classmethod
    def from_lists(cls, bins: list[list[int]]) -> PackedBins:
        counts = np.fromiter((len(b) for b in bins), dtype=np.int64, count=len(bins))
        offsets = np.zeros(len(bins) + 1, dtype=np.int64)
        np.cumsum(counts, out=offsets[1:])
        flat = [i for b in bins for i in b]
        return cls(np.asarray(flat, dtype=np.int64), offsets)

    @property
    def num_bins(self) -> int:
        return int(self.offsets.size - 1)

    @property
    def num_sequences(self) -> int:
        return int(self.indices.size)

    def sizes(self) -> np.ndarray:
        """Number of sequences in each bin."""
        return np.diff(self.offsets)

    def bin(self, b: int) -> np.ndarray:
        return self.indices[self.offsets[b] : self.offsets[b + 1]]

    def tokens_per_bin(self, lengths: np.ndarray) -> np.ndarray:
        """Sum of ``lengths`` in each bin (bins are never empty)."""
        if self.num_bins == 0:
            return np.zeros(0, dtype=np.int64)
        return np.add.reduceat(np.asarray(lengths, dtype=np.int64)[self.indices], self.offsets[:-1])

    def to_lists(self) -> list[list[int]]:
        flat = self.indices.tolist()
        bounds = self.offsets.tolist()
        return [flat[a:b] for a, b in pairwise(bounds)]
