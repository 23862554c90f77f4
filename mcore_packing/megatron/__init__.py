"""The thin Megatron-Core-facing layer: PackedSeqParams, THD attention, layer specs, CPU device adapter.

Importing this package imports megatron-core; the packing core does not.
"""

from .attention import PackedCoreAttention, ThdLayout, thd_layout
from .cpu_device import CpuDeviceAdapter, cpu_device_adapter
from .layer_spec import (
    LocalLayerNorm,
    LocalRMSNorm,
    get_packed_gpt_block_spec,
    get_packed_gpt_layer_spec,
    resolve_attention_backend,
)
from .packed_seq import to_packed_seq_params

__all__ = [
    "CpuDeviceAdapter",
    "LocalLayerNorm",
    "LocalRMSNorm",
    "PackedCoreAttention",
    "ThdLayout",
    "cpu_device_adapter",
    "get_packed_gpt_block_spec",
    "get_packed_gpt_layer_spec",
    "resolve_attention_backend",
    "thd_layout",
    "to_packed_seq_params",
]
