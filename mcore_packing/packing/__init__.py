"""Bin packing of sequence lengths into fixed-capacity micro-batches (pure numpy, no torch.distributed)."""

from .bins import PackedBins
from .constraints import required_bin_count
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
    "get_packer",
    "required_bin_count",
    "resolve_algorithm",
]
