"""mcore_packing: sequence packing, dynamic batching and context-parallel load balancing for Megatron-Core.

Packages follow the data flow, and a package imports only the ones before it:

    data, packing (numpy)  ->  planning (numpy)  ->  thd (torch)  ->  megatron (megatron-core)  ->  app

- `mcore_packing.data`: the `SequenceSample` type, real corpora, length distributions, SFT samples.
- `mcore_packing.packing`: bin packing of lengths (NeMo-RL-compatible `get_packer`), metrics.
- `mcore_packing.planning`: `plan_step` (a global batch -> micro-batches per DP rank), padding rule,
  model shape, cost model, balancing, the plan report.
- `mcore_packing.thd`: packed THD batches, the CP split and gather, exact loss weights.
- `mcore_packing.megatron`: PackedSeqParams, attention, layer specs, model building, the schedule driver.
- `mcore_packing.app`: Hydra config, recipes, the trainer and ``python -m mcore_packing train|plan``.

Importing this package (or packing, planning, data) never imports torch.
"""

from .packing import PackedBins, PackingAlgorithm, PackingMetrics, SequencePacker, get_packer

__version__ = "0.1.0"

__all__ = ["PackedBins", "PackingAlgorithm", "PackingMetrics", "SequencePacker", "__version__", "get_packer"]
