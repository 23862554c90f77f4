"""Megatron-Core ``PackedSeqParams`` from a `PackedBatch`, and the host-side layout attention reads.

cu_seqlens are built on the host as int32 and copied to the model's device without blocking (from pinned
memory on CUDA); ``max_seqlen`` is a Python int known on the host. So building the params costs no
device-to-host synchronization. The host-side layout (`ThdLayout`) is attached to the params object so
the attention module (`attention.PackedCoreAttention`) needs none either: this module writes it,
`thd_layout` reads it.

Fields that megatron-core 0.17+ added are passed only when the installed ``PackedSeqParams`` has them:

- ``total_tokens``: the whole packed row, also on a CP rank. Megatron derives ``seq_idx`` (each token's
  sequence, for Mamba's scan and convolution) from it and the padded cu_seqlens; Mamba gathers the
  sequence dimension over CP (and TP under sequence parallelism) before the scan, so the index must cover
  the gathered row. This rank's share alone would leave the tail of the row without an index, and its
  tokens would carry state across sequences.
- ``pad_between_seqs``: whether any sequence is padded (the padded cu_seqlens differ from the real ones),
  so TransformerEngine's fused attention skips the gaps.
- ``tokens_per_sample``: one packed row is one sample, so this rank's THD length. 0.19 uses it only to
  un-flatten a micro-batch of several rows before an MoE layer's own sequence balance loss; with one row
  that is a no-op, and the balance loss per sequence is `router_loss`'s.

Fixed shapes (``cu_entries``, for CUDA graphs): cu_seqlens get a fixed number of entries by repeating
their last one, i.e. zero-length sequences after the row's real ones; the row itself already has a fixed
length (`StepPlanConfig.fixed_shape`). A zero-length sequence has no token, so it changes no output,
loss or gradient (tested). ``max_seqlen`` stays the row's longest span: Megatron's THD RoPE reads a
frequency table as long as the whole row as positions counted from the row's start, so a static bound
equal to the row length would move every sequence's positions.

BSHD micro-batches (dynamic batching) need params only under dynamic context parallelism, where each
one runs on its own CP sub-group: `bshd_cp_params` carries just the group (qkv_format "sbhd",
``cp_group``, ``local_cp_size``). Its ``max_seqlen`` fields stay None: TransformerEngine multiplies a
given BSHD ``max_seqlen`` by the CP size (it expects this rank's share), while Megatron's RoPE reads it as
the whole row; `_patches.rope_cp_group` hands RoPE the row's length instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import pairwise

import torch

from ..compat import packed_seq_params_fields, require_megatron
from ..thd.packed_batch import PackedBatch

__all__ = ["ThdLayout", "bshd_cp_params", "thd_layout", "to_packed_seq_params"]

_LAYOUT_ATTR = "_mcore_packing_layout"


@dataclass(frozen=True)
class ThdLayout:
    """Host-side description of a packed row, so attention needs no device-to-host copy per layer."""

    padded_starts: tuple[int, ...]
    padded_lengths: tuple[int, ...]
    real_lengths: tuple[int, ...]

    @property
    def total(self) -> int:
        return self.padded_starts[-1] + self.padded_lengths[-1] if self.padded_starts else 0


def thd_layout(packed_seq_params) -> ThdLayout:
    """The `ThdLayout` attached by `to_packed_seq_params`, or one read back from the tensors (params built
    elsewhere: one sync, then cached on the params object)."""
    layout = getattr(packed_seq_params, _LAYOUT_ATTR, None)
    if layout is None:
        padded = packed_seq_params.cu_seqlens_q_padded
        if padded is None:
            padded = packed_seq_params.cu_seqlens_q
        padded = padded.tolist()
        real = packed_seq_params.cu_seqlens_q.tolist()
        layout = ThdLayout(
            padded_starts=tuple(padded[:-1]),
            padded_lengths=tuple(b - a for a, b in pairwise(padded)),
            real_lengths=tuple(b - a for a, b in pairwise(real)),
        )
        setattr(packed_seq_params, _LAYOUT_ATTR, layout)
    return layout


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def to_packed_seq_params(
    batch: PackedBatch, *, device: torch.device | str = "cpu", cp_group=None, cu_entries: int | None = None
):
    """The ``PackedSeqParams`` (qkv_format "thd") for ``batch``.

    ``cu_seqlens_q/kv`` hold the real lengths, ``cu_seqlens_q/kv_padded`` the padded spans, and
    ``max_seqlen_q/kv`` the longest padded span (RoPE needs frequencies for every padded position, and
    Megatron's THD RoPE switches to offset positions if this equals the whole row: it never does here
    unless the row holds a single sequence, where both modes agree). They always describe the whole
    packed row, also on a CP rank. ``cu_entries``: pad both cu_seqlens to this many entries with
    zero-length sequences (fixed shapes, see the module docstring). ``cp_group``: the micro-batch's CP
    group (the run's, or under dynamic CP the row's sub-group), set with ``local_cp_size`` its size, as
    TransformerEngine's attention reads them per micro-batch; a group of one rank is given as
    ``local_cp_size=1`` and no group (TE's way to turn CP off for one micro-batch).
    """
    require_megatron()
    from megatron.core.packed_seq_params import PackedSeqParams

    device = torch.device(device)
    fields = packed_seq_params_fields()
    cu, cu_padded = batch.cu_seqlens.to(torch.int32), batch.cu_seqlens_padded.to(torch.int32)
    if cu_entries is not None:
        cu, cu_padded = _pad_entries(cu, cu_entries), _pad_entries(cu_padded, cu_entries)
    starts = cu_padded[:-1].tolist()  # host tensor: no device sync
    lengths = (cu_padded[1:] - cu_padded[:-1]).tolist()
    real = (cu[1:] - cu[:-1]).tolist()
    cu, cu_padded = _to_device(cu, device), _to_device(cu_padded, device)
    kwargs = dict(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        cu_seqlens_q_padded=cu_padded,
        cu_seqlens_kv_padded=cu_padded,
        max_seqlen_q=batch.max_seqlen,
        max_seqlen_kv=batch.max_seqlen,
    )
    if cp_group is not None and "cp_group" in fields:
        kwargs["cp_group"] = cp_group
        if "local_cp_size" in fields:  # TransformerEngine's per-micro-batch CP (dynamic CP): the group's size;
            kwargs["local_cp_size"] = cp_group.size()  # a micro-batch without CP is local_cp_size=1, no group
            if kwargs["local_cp_size"] == 1:
                kwargs["cp_group"] = None
    if "total_tokens" in fields:
        kwargs["total_tokens"] = batch.total_tokens  # the whole row: seq_idx covers it after the CP gather
    if "pad_between_seqs" in fields:
        kwargs["pad_between_seqs"] = batch.padded_lengths != batch.seq_lengths
    if "tokens_per_sample" in fields:
        kwargs["tokens_per_sample"] = batch.total_tokens // batch.cp_size  # this rank's THD tensor: one row
    params = PackedSeqParams(**kwargs)
    layout = ThdLayout(padded_starts=tuple(starts), padded_lengths=tuple(lengths), real_lengths=tuple(real))
    setattr(params, _LAYOUT_ATTR, layout)
    return params


def _pad_entries(cu: torch.Tensor, entries: int) -> torch.Tensor:
    """``cu`` with its last entry repeated up to ``entries`` entries (zero-length sequences at the end)."""
    if isinstance(entries, bool) or not isinstance(entries, int) or entries < cu.numel():
        raise ValueError(
            f"cu_entries={entries!r} cannot describe this row of {cu.numel() - 1} sequences: it needs at least "
            f"{cu.numel()} entries. Use StepPlanConfig.cu_seqlens_entries(row_tokens), which bounds every row."
        )
    return torch.cat([cu, cu[-1:].expand(entries - cu.numel())])


def bshd_cp_params(cp_group):
    """``PackedSeqParams`` for a BSHD micro-batch on ``cp_group`` (a dynamic-CP row's sub-group): only the
    group, as Megatron's GPTModel (RoPE's CP slice) and TransformerEngine's attention read it per
    micro-batch. A group of one rank is kept (``local_cp_size=1`` with it): without a group Megatron's BSHD
    RoPE would fall back to the run's static CP group and slice the table for it."""
    require_megatron()
    from megatron.core.packed_seq_params import PackedSeqParams

    fields = packed_seq_params_fields()
    if "cp_group" not in fields or "local_cp_size" not in fields:
        raise RuntimeError(
            "this megatron-core's PackedSeqParams has no cp_group/local_cp_size (added in 0.16): dynamic CP needs "
            "them to name each micro-batch's CP group. Install megatron-core >= 0.16."
        )
    return PackedSeqParams(qkv_format="sbhd", cp_group=cp_group, local_cp_size=cp_group.size())
