"""mcore_packing: sequence packing and dynamic batching for Megatron-Core.

The packing core (``mcore_packing.packing``) is pure numpy and imports no torch; the Megatron-facing
layers import torch and megatron-core lazily, so planning tools stay fast to start.
"""

from .packing import PackedBins, PackingAlgorithm, PackingMetrics, SequencePacker, get_packer

__version__ = "0.1.0"

__all__ = ["PackedBins", "PackingAlgorithm", "PackingMetrics", "SequencePacker", "__version__", "get_packer"]
