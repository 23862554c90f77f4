"""Packing quality metrics: how full the bins are and how much padding packing saves.

Definitions, for ``n`` sequences of total ``S`` tokens, longest ``L``, packed into ``B`` bins of capacity ``C``:

- ``lower_bound = ceil(S / C)``: no packing can use fewer bins.
- ``utilization = S / (B * C)``; ``waste = 1 - utilization``.
- ``packing_efficiency = lower_bound / B`` (1.0 is optimal).
- ``bin_balance = min bin tokens / max bin tokens`` (1.0 is perfectly even).
- Padding tokens of three layouts: packed ``B*C - S``; pad-to-longest (one batch ``n x L``) ``n*L - S``;
  pad-to-capacity (every sequence alone in a ``C`` slot) ``n*C - S``. ``padding_saved_vs_*`` is the fraction
  of that layout's padding that packing removes.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from .bins import PackedBins

__all__ = ["PackingMetrics"]


@dataclass(frozen=True, kw_only=True)
class PackingMetrics:
    num_sequences: int
    num_tokens: int
    bin_capacity: int
    num_bins: int
    lower_bound: int
    utilization: float
    waste: float
    packing_efficiency: float
    bin_balance: float
    min_bin_tokens: int
    max_bin_tokens: int
    max_sequences_per_bin: int
    padding_tokens_packed: int
    padding_tokens_pad_to_longest: int
    padding_tokens_pad_to_capacity: int
    padding_saved_vs_pad_to_longest: float
    padding_saved_vs_pad_to_capacity: float

    @classmethod
    def compute(cls, lengths, bins: PackedBins | list[list[int]], bin_capacity: int) -> PackingMetrics:
        lengths = np.asarray(lengths, dtype=np.int64)
        if not isinstance(bins, PackedBins):
            bins = PackedBins.from_lists(bins)
        n = int(lengths.size)
        total = int(lengths.sum())
        num_bins = bins.num_bins
        tokens = bins.tokens_per_bin(lengths)
        longest = int(lengths.max()) if n else 0
        packed_pad = num_bins * bin_capacity - total
        longest_pad = n * longest - total
        capacity_pad = n * bin_capacity - total
        lower = -(-total // bin_capacity)
        return cls(
            num_sequences=n,
            num_tokens=total,
            bin_capacity=int(bin_capacity),
            num_bins=num_bins,
            lower_bound=lower,
            utilization=_ratio(total, num_bins * bin_capacity),
            waste=1.0 - _ratio(total, num_bins * bin_capacity) if num_bins else 0.0,
            packing_efficiency=_ratio(lower, num_bins),
            bin_balance=_ratio(int(tokens.min()), int(tokens.max())) if num_bins else 1.0,
            min_bin_tokens=int(tokens.min()) if num_bins else 0,
            max_bin_tokens=int(tokens.max()) if num_bins else 0,
            max_sequences_per_bin=int(bins.sizes().max()) if num_bins else 0,
            padding_tokens_packed=packed_pad,
            padding_tokens_pad_to_longest=longest_pad,
            padding_tokens_pad_to_capacity=capacity_pad,
            padding_saved_vs_pad_to_longest=_saved(packed_pad, longest_pad),
            padding_saved_vs_pad_to_capacity=_saved(packed_pad, capacity_pad),
        )

    def to_dict(self) -> dict:
        return asdict(self)


def _ratio(num: int, den: int) -> float:
    return float(num) / float(den) if den else 1.0


def _saved(packed_padding: int, baseline_padding: int) -> float:
    """Fraction of the baseline's padding that packing removes (can be negative if packing pads more)."""
    if baseline_padding == 0:
        return 0.0
    return 1.0 - packed_padding / baseline_padding
