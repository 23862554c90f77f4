"""The THD layer: samples of one micro-batch -> packed tensors, their context-parallel split and gather,
and the per-token loss weights that keep the loss exact however a batch is split.

- `packed_batch`: `build_packed_batch` (tokens, labels shifted inside each sequence, loss mask,
  positions restarting per sequence, cu_seqlens real and padded), `unpack` back to ``[B, S]``.
- `context_parallel`: the load-balanced 2*CP-chunk split (`slice_for_cp`) and its differentiable inverse
  (`gather_from_cp`), for THD rows and BSHD rows.
- `loss_weights`: `LossNormalization`, `StepTotals`, `token_weights` and what Megatron's loss function
  must return (`megatron_loss_output`).

torch and torch.distributed only; no megatron-core import.
"""

from ..data.sample import SequenceSample
from ..planning.padding import PaddingRule
from .context_parallel import (
    all_gather_cat,
    bshd_inverse_order,
    bshd_partition_indices,
    gather_bshd_from_cp,
    gather_from_cp,
    slice_bshd_for_cp,
    slice_for_cp,
    thd_inverse_order,
    thd_partition_indices,
)
from .loss_weights import LossNormalization, StepTotals, megatron_loss_output, token_weights
from .packed_batch import PackedBatch, build_packed_batch, samples_from_padded, unpack

__all__ = [
    "LossNormalization",
    "PackedBatch",
    "PaddingRule",
    "SequenceSample",
    "StepTotals",
    "all_gather_cat",
    "bshd_inverse_order",
    "bshd_partition_indices",
    "build_packed_batch",
    "gather_bshd_from_cp",
    "gather_from_cp",
    "megatron_loss_output",
    "samples_from_padded",
    "slice_bshd_for_cp",
    "slice_for_cp",
    "thd_inverse_order",
    "thd_partition_indices",
    "token_weights",
    "unpack",
]
