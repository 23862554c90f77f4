"""Megatron-Core ``PackedSeqParams`` from a `PackedBatch`, and the host-side layout attention reads.

cu_seqlens are built on the host as int32 and reach the model's device in one non-blocking transfer (from
pinned memory on CUDA; `prepare` moves them with the rest of the micro-batch); ``max_seqlen`` is a Python
int known on the host. So building the params costs no device-to-host synchronization. The host-side
layout (`ThdLayout`) and, under CP, the device index that reorders gathered shards are attached to the
params object so the attention module (`attention.PackedCoreAttention`) needs no copy either: this module
writes them, `thd_layout` and `cp_inverse_index` read them.

What TransformerEngine reads of these fields, per TE and megatron-core version, is decided by
`te_contract.te_thd_fields` (`thd_fields` here): among others ``pad_between_seqs`` where the release has
the field, else a zero-length entry after a row whose only padded sequence is the last, which TE before
2.18 would read as unpadded.

Fields that megatron-core 0.17+ added are passed only when the installed ``PackedSeqParams`` has them:

- ``total_tokens``: the whole packed row, also on a CP rank. Megatron derives ``seq_idx`` (each token's
  sequence, for Mamba's scan and convolution) from it and the padded cu_seqlens; Mamba gathers the
  sequence dimension over CP (and TP under sequence parallelism) before the scan, so the index must cover
  the gathered row. This rank's share alone would leave the tail of the row without an index, and its
  tokens would carry state across sequences.
- ``pad_between_seqs``: whether any sequence is padded (the padded cu_seqlens differ from the real ones),
  so TransformerEngine's fused attention skips the gaps (`te_contract`).
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
from itertools import accumulate, pairwise

import torch

from ..compat import packed_seq_params_fields, require_megatron, te_version
from ..thd.context_parallel import thd_inverse_order
from ..thd.packed_batch import PackedBatch
from ..thd.transfer import to_device_once
from .te_contract import TeThdFields, te_thd_fields

__all__ = [
    "ThdLayout",
    "bshd_cp_params",
    "cp_inverse_index",
    "host_packed_seq_params",
    "on_device",
    "thd_fields",
    "thd_layout",
    "to_packed_seq_params",
]

_LAYOUT_ATTR = "_mcore_packing_layout"
_INVERSE_ATTR = "_mcore_packing_cp_inverse"


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


def thd_fields(batch: PackedBatch, *, cu_entries: int | None = None) -> TeThdFields:
    """The THD fields TransformerEngine reads for ``batch``, decided for the installed megatron-core and TE
    (`te_contract.te_thd_fields`: the zero-length entry where TE would miss a padded last sequence)."""
    return te_thd_fields(batch.seq_lengths, batch.padded_lengths, cp_size=batch.cp_size,
                         fields=packed_seq_params_fields(), te_version=te_version(),
                         cu_entries=cu_entries)  # fmt: skip


def to_packed_seq_params(
    batch: PackedBatch, *, device: torch.device | str = "cpu", cp_group=None, cu_entries: int | None = None
):
    """The ``PackedSeqParams`` (qkv_format "thd") for ``batch``.

    ``cu_seqlens_q/kv`` hold the real lengths, ``cu_seqlens_q/kv_padded`` the padded spans (the same
    tensor when no sequence is padded), and ``max_seqlen_q/kv`` the longest padded span (RoPE needs
    frequencies for every padded position, and Megatron's THD RoPE switches to offset positions if this
    equals the whole row: it never does here unless the row holds a single sequence, where both modes
    agree). They always describe the whole packed row, also on a CP rank. ``cu_entries``: pad both
    cu_seqlens to this many entries with zero-length sequences (fixed shapes, see the module docstring).
    ``cp_group``: the micro-batch's CP group (the run's, or under dynamic CP the row's sub-group), set
    with ``local_cp_size`` its size, as TransformerEngine's attention reads them per micro-batch; a group
    of one rank is given as ``local_cp_size=1`` and no group (TE's way to turn CP off for one micro-batch).
    The host tensors reach ``device`` in one non-blocking transfer (`thd.transfer.to_device_once`).
    """
    params, host = host_packed_seq_params(batch, thd_fields(batch, cu_entries=cu_entries), cp_group=cp_group)
    return on_device(params, to_device_once(host, device))


def host_packed_seq_params(batch: PackedBatch, fields: TeThdFields, *, cp_group=None) -> tuple[object, dict]:
    """The ``PackedSeqParams`` of ``batch`` built on the host from its `thd_fields`, and the host tensors
    that must reach the device (``cu_seqlens``, ``cu_seqlens_padded`` when it is its own tensor, Megatron's
    ``seq_idx`` where 0.17+ computes one, ``cp_inverse`` under CP): move them (with the rest of the
    micro-batch, `thd.transfer.to_device_once`) and hand them to `on_device`. Built on the host because
    0.17+'s ``__post_init__`` derives ``seq_idx`` from the cu_seqlens it is given: from device tensors
    that costs a blocking copy and a data-dependent ``repeat_interleave`` (a sync) per micro-batch."""
    require_megatron()
    from megatron.core.packed_seq_params import PackedSeqParams

    available = packed_seq_params_fields()
    cu, cu_padded = fields.cu_seqlens, fields.cu_seqlens_padded
    kwargs = dict(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu_padded,
                  cu_seqlens_kv_padded=cu_padded, max_seqlen_q=fields.max_seqlen,
                  max_seqlen_kv=fields.max_seqlen)  # fmt: skip
    if cp_group is not None and "cp_group" in available:
        kwargs["cp_group"] = cp_group
        if "local_cp_size" in available:  # TransformerEngine's per-micro-batch CP (dynamic CP): the group's size;
            kwargs["local_cp_size"] = cp_group.size()  # a micro-batch without CP is local_cp_size=1, no group
            if kwargs["local_cp_size"] == 1:
                kwargs["cp_group"] = None
    if "total_tokens" in available:
        kwargs["total_tokens"] = batch.total_tokens  # the whole row: seq_idx covers it after the CP gather
    if fields.pass_flag:
        kwargs["pad_between_seqs"] = fields.pad_between_seqs
    if "tokens_per_sample" in available:
        kwargs["tokens_per_sample"] = batch.total_tokens // batch.cp_size  # this rank's THD tensor: one row
    params = PackedSeqParams(**kwargs)
    cu_host, padded_host = cu.tolist(), cu_padded.tolist()  # host tensors: no device sync
    layout = ThdLayout(
        padded_starts=tuple(padded_host[:-1]),
        padded_lengths=tuple(b - a for a, b in pairwise(padded_host)),
        real_lengths=tuple(b - a for a, b in pairwise(cu_host)),
    )
    setattr(params, _LAYOUT_ATTR, layout)
    host = fields.tensors()
    if getattr(params, "seq_idx", None) is not None:
        host["seq_idx"] = params.seq_idx
    if batch.cp_size > 1:
        host["cp_inverse"] = thd_inverse_order(batch.cu_seqlens_padded, batch.total_tokens, batch.cp_size)
    return params, host


def on_device(params, staged: dict):
    """``params`` (from `host_packed_seq_params`) with its tensors replaced by their device copies in
    ``staged`` (the padded cu_seqlens stay the very tensor of the real ones when they were), the CP gather
    index attached (`cp_inverse_index`). Returns ``params``."""
    cu = staged["cu_seqlens"]
    cu_padded = staged.get("cu_seqlens_padded", cu)
    params.cu_seqlens_q = params.cu_seqlens_kv = cu
    params.cu_seqlens_q_padded = params.cu_seqlens_kv_padded = cu_padded
    if staged.get("seq_idx") is not None:
        params.seq_idx = staged["seq_idx"]
    if staged.get("cp_inverse") is not None:
        setattr(params, _INVERSE_ATTR, staged["cp_inverse"])
    return params


def cp_inverse_index(packed_seq_params, cp_size: int, device: torch.device) -> torch.Tensor:
    """The index that puts a THD row's CP shards, gathered in rank order, back in packed order, on
    ``device``: the one `to_packed_seq_params` attached (moved with the micro-batch), else built once
    from the layout and cached on the params object (params built elsewhere)."""
    index = getattr(packed_seq_params, _INVERSE_ATTR, None)
    if index is None or index.device != device:
        layout = thd_layout(packed_seq_params)
        cu = [0, *accumulate(span for span in layout.padded_lengths if span)]  # zero-length entries: no token
        index = thd_inverse_order(cu, layout.total, cp_size).to(device)
        setattr(packed_seq_params, _INVERSE_ATTR, index)
    return index


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
