"""Bin packing of sequence lengths into fixed-capacity micro-batches: the algorithms, the bin-count
constraints, cost-capped packing and metrics. Pure numpy; never imports torch."""

from .bins import PackedBins
from .constraints import enforce_bin_count, required_bin_count
from .cost_capped import cost_capped_first_fit
from .metrics import PackingMetrics
from .packers import (
    ALGORITHM_ALIASES,
    DEFAULT_ALGORITHM,
    BestFitDecreasingPacker,
    ConcatenativePacker,
    FirstFitDecreasingPacker,
    FirstFitShufflePacker,
    ModifiedFirstFitDecreasingPacker,
    PackingAlgorithm,
    SequencePacker,
    get_packer,
    resolve_algorithm,
)

__all__ = [
    "ALGORITHM_ALIASES",
    "DEFAULT_ALGORITHM",
    "BestFitDecreasingPacker",
    "ConcatenativePacker",
    "FirstFitDecreasingPacker",
    "FirstFitShufflePacker",
    "ModifiedFirstFitDecreasingPacker",
    "PackedBins",
    "PackingAlgorithm",
    "PackingMetrics",
    "SequencePacker",
    "cost_capped_first_fit",
    "enforce_bin_count",
    "get_packer",
    "required_bin_count",
    "resolve_algorithm",
]
