"""Packed THD micro-batches: from the samples of one bin to the tensors Megatron's THD path consumes.

Layout. The sequences of a bin are laid end to end in one row (``[1, T]``). Each sequence occupies a
*padded span* whose length is a multiple of ``PaddingRule.sequence_multiple``; its real tokens come first
and its padding after, so causal attention of a real token never sees padding. The last sequence's span
also absorbs whatever padding the total needs (``total_multiple``, or a fixed ``pad_to`` length for
pipeline parallelism), so no token lies past the last padded boundary: TransformerEngine's CP split is
wrong when it does.

Worked example: CP=2, TP=2 with sequence parallelism, lengths [5, 3, 8].
``sequence_multiple`` = 2*CP = 4 (each sequence is cut into 2*CP equal chunks), and ``total_multiple`` =
lcm(4, CP*TP) = 4 (each CP rank's T/CP tokens must split evenly over TP ranks).

    padded lengths        [8, 4, 8]               (5->8, 3->4, 8->8); T = 20
    cu_seqlens            [0, 5, 8, 16]           real lengths (cumulative)
    cu_seqlens_padded     [0, 8, 12, 20]          offsets of the padded spans in the row
    max_seqlen            8                       longest padded span (RoPE needs freqs that long)
    position_ids          0..7 | 0..3 | 0..7      restart in every span
    labels at i           token i+1 of the same sequence; pad id at the last real token and on padding
    loss_mask             1 where the next token is a target; 0 on each last real token and on padding

The per-sequence multiple is only what CP needs (times any user alignment). Sequence parallelism only
needs the *total* to divide by CP*TP, so it is met by padding the last span, not every sequence
(`mcore_packing.planning.PaddingRule` holds both multiples).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch

from ..data.sample import SequenceSample
from ..planning.padding import PaddingRule

__all__ = ["PackedBatch", "build_packed_batch", "samples_from_padded", "unpack"]


@dataclass(frozen=True, kw_only=True)
class PackedBatch:
    """A packed THD micro-batch (or, after `context_parallel.slice_for_cp`, one CP rank's part of it).

    Token tensors are ``[1, T]`` (``[1, T / cp]`` on a CP rank). ``cu_seqlens`` and ``cu_seqlens_padded``
    are int32 on the CPU and always describe the *whole* packed row, as Megatron expects.
    """

    tokens: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    cu_seqlens_padded: torch.Tensor
    max_seqlen: int
    seq_lengths: tuple[int, ...]
    padded_lengths: tuple[int, ...]
    sample_ids: tuple[int, ...]
    cp_size: int = 1
    cp_rank: int = 0

    @property
    def num_sequences(self) -> int:
        return len(self.seq_lengths)

    @property
    def total_tokens(self) -> int:
        """Length of the whole packed row (before any CP split)."""
        return int(sum(self.padded_lengths))

    @property
    def num_real_tokens(self) -> int:
        return int(sum(self.seq_lengths))

    def to(self, device: torch.device | str, non_blocking: bool = True) -> PackedBatch:
        """Move the token tensors to ``device``; cu_seqlens stay on the host (see `megatron.packed_seq`)."""
        move = {
            name: getattr(self, name).to(device, non_blocking=non_blocking)
            for name in ("tokens", "labels", "loss_mask", "position_ids")
        }
        return replace(self, **move)


def _as_long_1d(values, what: str, index: int) -> torch.Tensor:
    t = torch.as_tensor(np.asarray(values) if not isinstance(values, torch.Tensor) else values)
    if t.dim() != 1:
        raise ValueError(f"sample {index}: {what} must be 1-D, got shape {tuple(t.shape)}.")
    if t.numel() == 0:
        raise ValueError(f"sample {index} has no tokens; drop empty samples before packing.")
    if t.dtype.is_floating_point or t.dtype == torch.bool:
        raise ValueError(f"sample {index}: {what} must be integer token ids, got dtype {t.dtype}.")
    return t.to(torch.long)


def _checked_samples(samples: Sequence[SequenceSample], ids: tuple[int, ...]):
    """Each sample's tokens (int64) and loss mask (float32, ones when absent), or a ValueError naming it."""
    token_list, mask_list = [], []
    for i, sample in enumerate(samples):
        tokens = _as_long_1d(sample.tokens, "tokens", ids[i])
        if sample.loss_mask is None:
            mask = torch.ones(tokens.numel(), dtype=torch.float32)
        else:
            mask = torch.as_tensor(np.asarray(sample.loss_mask), dtype=torch.float32).reshape(-1)
            if mask.numel() != tokens.numel():
                raise ValueError(f"sample {ids[i]}: loss_mask has {mask.numel()} entries for {tokens.numel()} tokens.")
        token_list.append(tokens)
        mask_list.append(mask)
    return token_list, mask_list


def build_packed_batch(
    samples: Sequence[SequenceSample],
    rule: PaddingRule | None = None,
    *,
    sample_ids: Sequence[int] | None = None,
    pad_to: int | None = None,
    pad_token_id: int = 0,
) -> PackedBatch:
    """Pack ``samples`` (one bin of the plan, in order) into one THD micro-batch.

    Args:
        samples: the sequences of this micro-batch.
        rule: padding rule derived from the parallel settings (default: no padding).
        sample_ids: original indices of the samples (for unpacking); default ``0..n-1``.
        pad_to: make the packed row exactly this long (pipeline parallelism with a fixed shape). Must be
            at least the packed length and a multiple of ``rule.total_multiple``.
        pad_token_id: token id written into padding and into masked label slots.
    """
    rule = rule or PaddingRule()
    if len(samples) == 0:
        raise ValueError("build_packed_batch needs at least one sample; an empty micro-batch has no tokens.")
    ids = tuple(range(len(samples))) if sample_ids is None else tuple(int(i) for i in sample_ids)
    if len(ids) != len(samples):
        raise ValueError(f"sample_ids has {len(ids)} entries for {len(samples)} samples.")

    token_list, mask_list = _checked_samples(samples, ids)
    lengths = [t.numel() for t in token_list]
    padded = [rule.padded_length(n) for n in lengths]
    total = sum(padded)
    needed = -(-total // rule.total_multiple) * rule.total_multiple
    if pad_to is not None:
        if pad_to < needed or pad_to % rule.total_multiple:
            raise ValueError(
                f"pad_to={pad_to} cannot hold this micro-batch: it needs at least {needed} tokens and a multiple "
                f"of {rule.total_multiple} (PaddingRule.total_multiple). Raise the fixed micro-batch length."
            )
        needed = pad_to
    padded[-1] += needed - total  # the last span absorbs the row padding; stays a multiple of 2*CP
    total = needed

    tokens_out = torch.full((total,), pad_token_id, dtype=torch.long)
    labels_out = torch.full((total,), pad_token_id, dtype=torch.long)
    mask_out = torch.zeros(total, dtype=torch.float32)
    position_out = torch.empty(total, dtype=torch.long)
    offset = 0
    for tokens, mask, span in zip(token_list, mask_list, padded, strict=True):
        n = tokens.numel()
        tokens_out[offset : offset + n] = tokens
        labels_out[offset : offset + n - 1] = tokens[1:]
        mask_out[offset : offset + n - 1] = mask[1:]
        position_out[offset : offset + span] = torch.arange(span)
        offset += span

    cu_real = np.zeros(len(lengths) + 1, dtype=np.int32)
    np.cumsum(lengths, out=cu_real[1:])
    cu_padded = np.zeros(len(padded) + 1, dtype=np.int32)
    np.cumsum(padded, out=cu_padded[1:])
    return PackedBatch(
        tokens=tokens_out.unsqueeze(0),
        labels=labels_out.unsqueeze(0),
        loss_mask=mask_out.unsqueeze(0),
        position_ids=position_out.unsqueeze(0),
        cu_seqlens=torch.from_numpy(cu_real),
        cu_seqlens_padded=torch.from_numpy(cu_padded),
        max_seqlen=int(max(padded)),
        seq_lengths=tuple(lengths),
        padded_lengths=tuple(padded),
        sample_ids=ids,
    )


def samples_from_padded(
    tokens: torch.Tensor, lengths: Sequence[int] | torch.Tensor, loss_mask: torch.Tensor | None = None
) -> list[SequenceSample]:
    """Split a right-padded ``[B, S]`` batch into samples using each row's real length."""
    if tokens.dim() != 2:
        raise ValueError(f"tokens must be [B, S], got shape {tuple(tokens.shape)}.")
    lengths = [int(n) for n in (lengths.tolist() if isinstance(lengths, torch.Tensor) else lengths)]
    if len(lengths) != tokens.shape[0]:
        raise ValueError(f"lengths has {len(lengths)} entries for a batch of {tokens.shape[0]} rows.")
    for b, n in enumerate(lengths):
        if not 1 <= n <= tokens.shape[1]:
            raise ValueError(f"lengths[{b}] = {n} is outside [1, {tokens.shape[1]}] (the padded width).")
    return [
        SequenceSample(tokens[b, :n], None if loss_mask is None else loss_mask[b, :n]) for b, n in enumerate(lengths)
    ]


def unpack(values: torch.Tensor, batch: PackedBatch, *, pad_value: float = 0.0) -> torch.Tensor:
    """Per-token outputs of a whole packed row (``[T, ...]`` or ``[1, T, ...]``) to ``[B, S_max, ...]``.

    Row ``b`` holds sample ``batch.sample_ids[b]``'s real positions; the rest is ``pad_value``. For
    log-probs, position ``j`` scores token ``j + 1`` (the label), so a sample of ``n`` tokens has ``n - 1``
    meaningful values. Gather CP shards first (`context_parallel.gather_from_cp`).
    """
    if values.dim() >= 2 and values.shape[0] == 1 and values.shape[1] == batch.total_tokens:
        values = values[0]
    if values.shape[0] != batch.total_tokens:
        raise ValueError(
            f"values has {values.shape[0]} tokens but the packed row has {batch.total_tokens}; "
            "gather context-parallel shards before unpacking."
        )
    longest = max(batch.seq_lengths)
    out = values.new_full((batch.num_sequences, longest, *values.shape[1:]), pad_value)
    starts = batch.cu_seqlens_padded.tolist()
    for b, n in enumerate(batch.seq_lengths):
        out[b, :n] = values[starts[b] : starts[b] + n]
    return out
