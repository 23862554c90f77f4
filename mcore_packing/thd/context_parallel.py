"""Load-balanced context-parallel (CP) split of packed (THD) and padded (BSHD) batches, and its inverse.

Causal attention work grows along a sequence: a token at position p attends to p + 1 keys. Cutting each
sequence into 2*CP equal chunks and giving CP rank r chunks r and 2*CP-1-r pairs a cheap chunk with an
expensive one, so every rank does the same attention work. This is TransformerEngine's
``thd_get_partitioned_indices`` rule; we use TE's kernel when it is importable (and check they agree).

Example, CP=2, one packed row with padded spans [8, 4] (``cu_seqlens_padded = [0, 8, 12]``): chunks of the
first span are 2 tokens, of the second 1 token.

    rank 0 keeps [0, 1, 6, 7,  8, 11]      (chunks 0 and 3 of each span)
    rank 1 keeps [2, 3, 4, 5,  9, 10]      (chunks 1 and 2)

Every token belongs to exactly one rank. A rank's local tensor keeps the order above (span after span,
the early chunk before the late one), which is the layout Megatron's THD RoPE expects.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch
import torch.distributed as dist

from ..collectives import all_gather_into, all_reduce
from ..compat import te_thd_partitioned_indices
from ..validators import require_positive_int
from .packed_batch import PackedBatch

__all__ = [
    "all_gather_cat",
    "bshd_inverse_order",
    "bshd_partition_indices",
    "gather_bshd_from_cp",
    "gather_from_cp",
    "slice_bshd_for_cp",
    "slice_for_cp",
    "thd_inverse_order",
    "thd_partition_indices",
]


def _check_cp(cp_size: int, cp_rank: int) -> None:
    require_positive_int("cp_size", cp_size)
    if isinstance(cp_rank, bool) or not isinstance(cp_rank, int) or not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank = {cp_rank!r} is out of range for cp_size = {cp_size}; use 0..{cp_size - 1}.")


def _host_array(values, what: str) -> np.ndarray:
    if isinstance(values, torch.Tensor):
        values = values.detach().cpu().numpy()
    arr = np.asarray(values)
    if arr.ndim != 1 or arr.size < 2 or arr.dtype.kind not in "iu":
        raise ValueError(f"{what} must be a 1-D integer array with at least 2 entries, got {arr!r}.")
    return arr.astype(np.int64)


def _zigzag_indices(starts: np.ndarray, spans: np.ndarray, cp_size: int, cp_rank: int) -> np.ndarray:
    chunk = spans // (2 * cp_size)
    first = starts + cp_rank * chunk
    second = starts + (2 * cp_size - 1 - cp_rank) * chunk
    # For each span: chunk[i] indices from first[i], then chunk[i] from second[i].
    begins = np.stack([first, second], axis=1).reshape(-1)
    lengths = np.repeat(chunk, 2)
    total = int(lengths.sum())
    offsets = np.repeat(begins - np.concatenate(([0], np.cumsum(lengths)[:-1])), lengths)
    return offsets + np.arange(total, dtype=np.int64)


def thd_partition_indices(cu_seqlens_padded, total_tokens: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """Token indices of the packed row that CP rank ``cp_rank`` keeps, in its local order (int64).

    Raises ValueError when cu_seqlens_padded does not start at 0 or is not increasing, when a padded
    length is not divisible by 2*cp_size, when ``total_tokens`` differs from the last padded boundary
    (trailing padding must live inside the last sequence's span), or when the rank is out of range.
    """
    _check_cp(cp_size, cp_rank)
    cu = _host_array(cu_seqlens_padded, "cu_seqlens_padded")
    if cu[0] != 0:
        raise ValueError(f"cu_seqlens_padded must start at 0, got {cu[0]}.")
    spans = np.diff(cu)
    if (spans <= 0).any():
        i = int(np.flatnonzero(spans <= 0)[0])
        raise ValueError(
            f"cu_seqlens_padded must be strictly increasing; entries {i} and {i + 1} are {cu[i]} and {cu[i + 1]}."
        )
    bad = np.flatnonzero(spans % (2 * cp_size))
    if bad.size:
        i = int(bad[0])
        raise ValueError(
            f"padded length of sequence {i} is {int(spans[i])}, not divisible by 2*cp_size = {2 * cp_size}. "
            f"Pad every sequence to a multiple of {2 * cp_size} (PaddingRule(cp_size={cp_size}))."
        )
    if int(total_tokens) != int(cu[-1]):
        where = "past" if int(total_tokens) > int(cu[-1]) else "short of"
        raise ValueError(
            f"total_tokens = {int(total_tokens)} is {where} the last padded boundary {int(cu[-1])}. Trailing padding "
            "must belong to the last sequence's padded span (extend its cu_seqlens_padded entry)."
        )
    ours = torch.from_numpy(_zigzag_indices(cu[:-1], spans, cp_size, cp_rank))
    _check_against_transformer_engine(cu, int(total_tokens), cp_size, cp_rank, ours)
    return ours


_TE_AGREEMENT_CHECKED = False


def _check_against_transformer_engine(cu: np.ndarray, total: int, cp_size: int, cp_rank: int, ours) -> None:
    """Once per process, when TE and a GPU are present, compare with TE's thd_get_partitioned_indices."""
    global _TE_AGREEMENT_CHECKED
    if _TE_AGREEMENT_CHECKED or cp_size == 1 or not torch.cuda.is_available():
        return
    te_fn = te_thd_partitioned_indices()
    _TE_AGREEMENT_CHECKED = True
    if te_fn is None:
        return
    theirs = te_fn(torch.as_tensor(cu, dtype=torch.int32, device="cuda"), total, cp_size, cp_rank)
    if not torch.equal(theirs.cpu().long(), ours):
        raise AssertionError(
            "mcore_packing's CP partition disagrees with TransformerEngine's thd_get_partitioned_indices "
            f"(cu_seqlens_padded={cu.tolist()}, cp_size={cp_size}, cp_rank={cp_rank}); please report this."
        )


def slice_for_cp(batch: PackedBatch, cp_size: int, cp_rank: int, *, index: torch.Tensor | None = None) -> PackedBatch:
    """The part of a packed micro-batch that CP rank ``cp_rank`` processes (cu_seqlens stay global).

    ``index``: this rank's `thd_partition_indices` when the caller already computed them (to slice other
    per-token tensors, e.g. loss weights, with the same index); computed here otherwise.
    """
    if batch.cp_size != 1:
        raise ValueError(f"batch is already a CP shard (cp_size={batch.cp_size}); slice the whole packed batch.")
    if batch.tokens.shape[-1] != batch.total_tokens:
        raise ValueError(
            f"batch has {batch.tokens.shape[-1]} tokens but its cu_seqlens_padded ends at {batch.total_tokens}; "
            "rebuild it with build_packed_batch so the tensors and offsets agree."
        )
    if cp_size == 1:
        _check_cp(cp_size, cp_rank)
        return batch
    if index is None:
        index = thd_partition_indices(batch.cu_seqlens_padded, batch.total_tokens, cp_size, cp_rank)
    index = index.to(batch.tokens.device)
    return replace(
        batch,
        tokens=batch.tokens[:, index],
        labels=batch.labels[:, index],
        loss_mask=batch.loss_mask[:, index],
        position_ids=batch.position_ids[:, index],
        cp_size=cp_size,
        cp_rank=cp_rank,
    )


class _AllGatherCat(torch.autograd.Function):
    """All-gather equal-shaped tensors along dim 0; backward sums the gradient over ranks and keeps ours."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        world = dist.get_world_size(group)
        ctx.rank = dist.get_rank(group)
        ctx.rows = local.shape[0]
        out = local.new_empty((world * local.shape[0], *local.shape[1:]))
        all_gather_into(out, local.contiguous(), group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = all_reduce(grad.contiguous(), ctx.group)
        return grad[ctx.rank * ctx.rows : (ctx.rank + 1) * ctx.rows], None


def all_gather_cat(local: torch.Tensor, group) -> torch.Tensor:
    """Differentiable all-gather along dim 0 (rank order)."""
    return _AllGatherCat.apply(local, group)


def _inverse(order: torch.Tensor) -> torch.Tensor:
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel())
    return inverse


def thd_inverse_order(cu_seqlens_padded, total_tokens: int, cp_size: int) -> torch.Tensor:
    """Index that puts the rank-ordered concatenation of all CP shards back into packed order."""
    return _inverse(
        torch.cat([thd_partition_indices(cu_seqlens_padded, total_tokens, cp_size, r) for r in range(cp_size)])
    )


def bshd_inverse_order(seq_len: int, cp_size: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Index that puts the rank-ordered concatenation of a row's CP shards back into position order.

    Computed by arithmetic on ``device`` (no host data, so no transfer): position ``p`` lies in chunk
    ``j = p // c`` (``c = seq_len / 2cp``), kept by rank ``j`` (first half) or ``2cp - 1 - j`` (second),
    at that rank's offset 0 or ``c`` within its ``2c`` tokens."""
    _check_cp(cp_size, 0)
    if seq_len % (2 * cp_size):
        raise ValueError(f"sequence length {seq_len} is not divisible by 2*cp_size = {2 * cp_size}.")
    chunk = seq_len // (2 * cp_size)
    position = torch.arange(seq_len, device=device)
    j = position // chunk
    late = j >= cp_size
    rank = torch.where(late, 2 * cp_size - 1 - j, j)
    return rank * (2 * chunk) + late * chunk + position % chunk


def gather_from_cp(local: torch.Tensor, batch: PackedBatch, group, inverse: torch.Tensor | None = None) -> torch.Tensor:
    """Gather per-rank THD outputs ``[T/cp, ...]`` over the CP group into ``[T, ...]`` in packed order.

    Differentiable. ``batch`` is the rank's shard (or the whole batch) and supplies the layout;
    ``inverse``: its `thd_inverse_order` already on ``local``'s device (`prepare` moves it with the
    micro-batch), else built here and copied.
    """
    cp_size = dist.get_world_size(group)
    if local.shape[0] * cp_size != batch.total_tokens:
        raise ValueError(
            f"local output has {local.shape[0]} tokens; with cp_size={cp_size} the packed row of "
            f"{batch.total_tokens} tokens needs {batch.total_tokens // cp_size} per rank."
        )
    gathered = all_gather_cat(local, group)
    if inverse is None:
        inverse = thd_inverse_order(batch.cu_seqlens_padded, batch.total_tokens, cp_size).to(local.device)
    return gathered[inverse]


def bshd_partition_indices(seq_len: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """Positions of a padded row of length ``seq_len`` that CP rank ``cp_rank`` keeps (chunks r, 2cp-1-r)."""
    _check_cp(cp_size, cp_rank)
    if seq_len % (2 * cp_size):
        raise ValueError(
            f"sequence length {seq_len} is not divisible by 2*cp_size = {2 * cp_size}; round the padded "
            f"length up to a multiple of {2 * cp_size}."
        )
    return torch.from_numpy(_zigzag_indices(np.array([0]), np.array([seq_len]), cp_size, cp_rank))


def slice_bshd_for_cp(tensor: torch.Tensor, cp_size: int, cp_rank: int, seq_dim: int = 1) -> torch.Tensor:
    """Keep this CP rank's two chunks of every row along ``seq_dim``."""
    if cp_size == 1:
        _check_cp(cp_size, cp_rank)
        return tensor
    index = bshd_partition_indices(tensor.shape[seq_dim], cp_size, cp_rank).to(tensor.device)
    return tensor.index_select(seq_dim, index)


def gather_bshd_from_cp(local: torch.Tensor, group, seq_dim: int = 1) -> torch.Tensor:
    """Inverse of `slice_bshd_for_cp` over the CP group (differentiable)."""
    cp_size = dist.get_world_size(group)
    moved = local.movedim(seq_dim, 0)
    gathered = all_gather_cat(moved, group)
    return gathered[bshd_inverse_order(gathered.shape[0], cp_size, device=local.device)].movedim(0, seq_dim)
