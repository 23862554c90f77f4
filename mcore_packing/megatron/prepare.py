"""This rank's micro-batches as tensors: the plan's samples -> THD rows or BSHD rows, split for CP.

`prepare_micro_batch` builds one `PreparedMicroBatch`: a packed THD row with its ``PackedSeqParams``
(packing mode, and a shared-prefix group's row under dynamic batching) or padded BSHD rows (dynamic and
padded modes), each cut to this CP rank's chunks, with
the per-token loss weights of `thd.token_weights`. `per_sample_logprobs` is the one way back: the
model's per-token losses of a micro-batch, CP shards gathered (differentiably), split into each
sample's log-probs and loss mask.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial

import torch

from ..data.sample import SequenceSample
from ..planning.step_plan import MicroBatchPlan, StepPlan
from ..thd.context_parallel import (
    gather_bshd_from_cp,
    gather_from_cp,
    slice_bshd_for_cp,
    slice_for_cp,
    thd_partition_indices,
)
from ..thd.loss_weights import LossNormalization, StepTotals, token_weights
from ..thd.packed_batch import PackedBatch, build_packed_batch
from ..thd.shared_prefix import SharedPrefixRow, build_shared_prefix_row
from ..thd.transfer import to_device_once
from .packed_seq import cp_inverse_index, host_packed_seq_params, on_device, thd_fields
from .process_groups import ProcessGroups

__all__ = ["PreparedMicroBatch", "local_step_counts", "per_sample_logprobs", "per_sample_values", "prepare_micro_batch"]


@dataclass(frozen=True, kw_only=True)
class PreparedMicroBatch:
    """One micro-batch on this rank. Token tensors are this CP rank's part; the ``full_*`` fields and
    ``packed`` describe the whole micro-batch before the CP split (for gathering outputs). Every tensor
    is on the step's device (moved in one transfer); the counts are host ints, so a loss reads them
    without a device sync."""

    plan: MicroBatchPlan
    tokens: torch.Tensor
    position_ids: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor
    weights: torch.Tensor | None  # per-token loss weights w_t (None when the loss reads none, or forward-only)
    packed_seq_params: object | None  # THD only
    packed: PackedBatch | None  # THD only: the whole packed row
    sample_ids: tuple[int, ...]
    real_lengths: tuple[int, ...]
    full_loss_mask: torch.Tensor  # [T] (THD) or [rows, width] (BSHD)
    local_valid_tokens: int  # valid targets in this CP shard, counted on the host (no device sync)
    target_counts: tuple[float, ...] = ()  # each sample's loss-mask sum over its targets (host), in row order
    group_ids: tuple | None = None  # the plan's group id of every sample of the step (indexed by sample id)
    segments: torch.Tensor | None = None  # like ``tokens`` (int64): each token's sequence in the micro-batch
    # (its index in ``sample_ids``), -1 at pad tokens; built for MoE models (router statistics, balance loss)
    sequence_lengths: torch.Tensor | None = None  # the real lengths on the device (MoE: the balance loss)
    shared: SharedPrefixRow | None = None  # a shared-prefix row: ``packed`` holds its segments, this the samples
    extra_rows: torch.Tensor | None = None  # a shared-prefix row's extra targets: the row positions they score
    routes: torch.Tensor | None = None  # like ``tokens`` with [moe_layers, top_k] per token (int64): the
    # samples' ``routed_experts`` for router replay, -1 where a token has none (pads)

    @property
    def padding_mask(self) -> torch.Tensor | None:
        """True at pad tokens (Megatron's MoE routers keep them out of their statistics)."""
        return None if self.segments is None else self.segments < 0


def prepare_micro_batch(
    mb: MicroBatchPlan,
    samples: Sequence[SequenceSample],
    plan: StepPlan,
    process_groups: ProcessGroups,
    *,
    totals: StepTotals | None,
    normalization: LossNormalization | str | None,
    device: torch.device,
    pad_token_id: int = 0,
    segments: bool = False,
) -> PreparedMicroBatch:
    """Build ``mb``'s tensors for this rank (see the module docstring). Per-token weights are built for
    ``normalization`` when ``totals`` are given (the NLL losses); None builds none. ``segments``: also
    each token's sequence index, -1 at pads (for MoE routers; dense models need none). Everything is
    built on the host and reaches ``device`` in one non-blocking transfer (`thd.transfer.to_device_once`)."""
    chosen = [samples[i] for i in mb.sample_indices]
    prepare = _prepare_thd if plan.is_thd(mb) else _prepare_bshd  # dynamic batching: a shared group's row is THD
    weigh = totals is not None and normalization is not None
    host, fields = prepare(mb, chosen, plan, process_groups, totals if weigh else None, normalization, pad_token_id,
                           segments)  # fmt: skip
    if segments:
        host["sequence_lengths"] = torch.tensor(fields["real_lengths"], dtype=torch.float32)
    thd, local = fields.pop("thd", None), fields.pop("local", None)
    params = None
    if thd is not None:  # built on the host; its tensors travel with the rest
        params, params_host = host_packed_seq_params(local, thd, cp_group=process_groups.cp)
        host.update({f"params.{name}": t for name, t in params_host.items()})
    moved = to_device_once(host, device)
    if params is not None:
        on_device(params, {name[len("params.") :]: t for name, t in moved.items() if name.startswith("params.")})
    tensors = {name: moved.get(name) for name in _TENSOR_FIELDS}
    return PreparedMicroBatch(plan=mb, packed_seq_params=params, target_counts=tuple(_target_sum(s) for s in chosen),
                              group_ids=plan.groups, **tensors, **fields)  # fmt: skip


_TENSOR_FIELDS = ("tokens", "position_ids", "labels", "loss_mask", "weights", "full_loss_mask", "segments",
                  "sequence_lengths", "extra_rows", "routes")  # fmt: skip


def _routes(chosen, starts, width: int) -> torch.Tensor | None:
    """The samples' ``routed_experts`` laid out like their tokens: ``[width, layers, k]`` with sample ``i``'s
    rows from ``starts[i]``, -1 elsewhere (pads, a missing last row, a sample without routes); None when
    no sample has routes."""
    given = [(start, s.routed_experts) for start, s in zip(starts, chosen, strict=True) if s.routed_experts is not None]
    if not given:
        return None
    for s in chosen:
        if s.routed_experts is not None and len(s.routed_experts) not in (len(s.tokens), len(s.tokens) - 1):
            raise ValueError(f"a sample of {len(s.tokens)} tokens has {len(s.routed_experts)} rows of routed_experts; "
                             "give one per token (the last may be left out).")  # fmt: skip
    shapes = {tuple(r.shape[1:]) for _, r in given}
    if len(shapes) > 1:
        raise ValueError(f"the micro-batch's routed_experts have different [moe_layers, top_k] {sorted(shapes)}; "
                         "record every sample's routes with the same model.")  # fmt: skip
    out = torch.full((width, *shapes.pop()), -1, dtype=torch.int64)
    for start, r in given:
        rows = torch.as_tensor(r, dtype=torch.int64)
        out[start : start + rows.shape[0]] = rows
    return out


def _prepare_thd(mb, chosen, plan, process_groups, totals, normalization, pad_token_id, segments):
    """Host tensors of a packed THD row cut for this CP rank, and the fields that are not tensors."""
    config = plan.config
    pad_to = mb.shape[1] if config.use_fixed_length else None
    shared = None
    if plan.shared_prefix is not None:
        groups, prompts = plan.shared_prefix_groups(mb)
        shared = build_shared_prefix_row(chosen, groups, prompts, config.padding_rule, sample_ids=mb.sample_indices,
                                         pad_to=pad_to, pad_token_id=pad_token_id)  # fmt: skip
        batch = shared.batch
    else:
        batch = build_packed_batch(chosen, config.padding_rule, sample_ids=mb.sample_indices, pad_to=pad_to,
                                   pad_token_id=pad_token_id)  # fmt: skip
    assert batch.total_tokens == mb.shape[1], f"planned row {mb.shape[1]} != built row {batch.total_tokens}"
    weights = None
    if totals is not None:
        weights = token_weights(batch.loss_mask[0], list(batch.padded_lengths), normalization, totals)[None]
    index = None
    cp_size, cp_rank = process_groups.cp_size, process_groups.cp_rank
    if cp_size > 1:
        index = thd_partition_indices(batch.cu_seqlens_padded, batch.total_tokens, cp_size, cp_rank)
        weights = weights[:, index] if weights is not None else None
    local = slice_for_cp(batch, cp_size, cp_rank, index=index)
    seg = None
    if segments:
        seg = torch.full((batch.total_tokens,), -1, dtype=torch.int64)
        for i, (start, length) in enumerate(zip(batch.cu_seqlens_padded.tolist(), batch.seq_lengths, strict=False)):
            seg[start : start + length] = i
        seg = (seg if index is None else seg[index])[None]
    starts = batch.cu_seqlens_padded.tolist()[: len(chosen)]
    routes = _routes(chosen, starts, batch.total_tokens) if shared is None else None
    if routes is not None:
        routes = (routes if index is None else routes[index])[None]
    thd = thd_fields(local, cu_entries=config.cu_seqlens_entries(batch.total_tokens))
    host = dict(tokens=local.tokens, position_ids=local.position_ids, labels=local.labels, loss_mask=local.loss_mask,
                weights=weights, full_loss_mask=batch.loss_mask[0], segments=seg, routes=routes)  # fmt: skip
    fields = dict(packed=batch, sample_ids=batch.sample_ids, real_lengths=batch.seq_lengths, thd=thd, local=local,
                  local_valid_tokens=int(local.loss_mask.sum().item()))  # fmt: skip
    if shared is not None:  # the samples are not the row's sequences: each is its context and its segment
        _shared_fields(shared, chosen, host, fields, weighted=totals is not None)
    return host, fields


def _shared_fields(shared: SharedPrefixRow, chosen, host: dict, fields: dict, *, weighted: bool) -> None:
    """A shared-prefix row's targets (the row's and the extra ones) and its samples (one CP rank)."""
    if weighted:
        raise ValueError("a shared-prefix row has no per-token loss weights: use a loss on the unpacked view.")
    mask = shared.loss_mask
    extra = torch.tensor(shared.extra_rows, dtype=torch.long) if shared.extra_rows else None
    host.update(labels=shared.labels, loss_mask=mask, full_loss_mask=mask[0], extra_rows=extra)
    fields.update(shared=shared, sample_ids=shared.sample_ids, real_lengths=tuple(len(s.tokens) for s in chosen),
                  local_valid_tokens=int(mask.sum().item()))  # fmt: skip


def _prepare_bshd(mb, chosen, plan, process_groups, totals, normalization, pad_token_id, segments):
    """Host tensors of padded BSHD rows cut for this CP rank, and the fields that are not tensors."""
    rows, width = mb.shape
    # Each BSHD row is a one-sequence packed row padded to the micro-batch width (same label shift).
    built = [build_packed_batch([s], pad_to=width, pad_token_id=pad_token_id) for s in chosen]
    loss_mask = torch.cat([b.loss_mask for b in built])
    weights = None
    if totals is not None:
        weights = token_weights(loss_mask.reshape(-1), [width] * rows, normalization, totals).reshape(rows, width)
    split = partial(slice_bshd_for_cp, cp_size=process_groups.cp_size, cp_rank=process_groups.cp_rank, seq_dim=1)
    local_mask = split(loss_mask)
    host = dict(tokens=split(torch.cat([b.tokens for b in built])),
                position_ids=split(torch.arange(width).expand(rows, width)).contiguous(),
                labels=split(torch.cat([b.labels for b in built])), loss_mask=local_mask,
                weights=split(weights) if weights is not None else None, full_loss_mask=loss_mask,
                segments=_bshd_segments(built, width, split) if segments else None)  # fmt: skip
    routes = _routes(chosen, range(0, rows * width, width), rows * width)  # row i's tokens start at i * width
    if routes is not None:
        host["routes"] = split(routes.reshape(rows, width, *routes.shape[1:]))
    fields = dict(packed=None, sample_ids=mb.sample_indices, real_lengths=tuple(b.seq_lengths[0] for b in built),
                  local_valid_tokens=int(local_mask.sum().item()))  # fmt: skip
    return host, fields


def _bshd_segments(built, width: int, split) -> torch.Tensor:
    """Row ``i``'s tokens are sequence ``i``; -1 past each row's sequence (this CP rank's columns)."""
    rows = torch.arange(len(built))[:, None].expand(len(built), width)
    real = torch.arange(width)[None] < torch.tensor([b.seq_lengths[0] for b in built])[:, None]
    return split(torch.where(real, rows, -1))


def per_sample_logprobs(
    prep: PreparedMicroBatch, output_tensor: torch.Tensor, process_groups: ProcessGroups
) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
    """``[(sample_id, logprobs, loss_mask), ...]`` for the micro-batch's samples in row order.

    ``output_tensor`` holds this rank's per-token losses (Megatron's output with labels), so log-probs are
    their negation. CP shards are all-gathered (differentiable: the gather's backward sums over the CP
    group, then keeps this rank's part). A sample of ``n`` tokens gets ``n - 1`` values: position ``j``
    scores token ``j + 1``.
    """
    rows, masks = _gathered_rows(prep, -output_tensor.float(), process_groups)
    return [
        (sample, row[: max(n - 1, 0)], mask[: max(n - 1, 0)])
        for sample, row, mask, n in zip(prep.sample_ids, rows, masks, prep.real_lengths, strict=True)
    ]


def per_sample_values(
    prep: PreparedMicroBatch, output_tensor: torch.Tensor, process_groups: ProcessGroups
) -> list[tuple[int, torch.Tensor]]:
    """``[(sample_id, values), ...]``: a model's per-token output without labels (a reward head's
    ``[b, s, 1]`` scores), CP gathered like `per_sample_logprobs`; a sample of ``n`` tokens gets all ``n``
    (position ``j`` is token ``j``'s)."""
    rows, _ = _gathered_rows(prep, output_tensor.float().reshape(output_tensor.shape[:2]), process_groups)
    return [(sample, row[:n]) for sample, row, n in zip(prep.sample_ids, rows, prep.real_lengths, strict=True)]


def _gathered_rows(prep: PreparedMicroBatch, values: torch.Tensor, process_groups: ProcessGroups):
    """This CP shard's per-token ``values`` ``[b, s]`` as the micro-batch's full rows (one per sample, CP
    all-gathered, differentiable: the gather's backward sums over the CP group, then keeps this rank's
    part), and the rows' loss masks."""
    if prep.shared is not None:  # one CP rank; each sample's values are its context's, then its segment's
        flat = values.reshape(-1)
        return prep.shared.sample_rows(flat), prep.shared.sample_rows(prep.full_loss_mask)
    if prep.packed is not None:
        flat = values.reshape(-1)
        if process_groups.cp_size > 1:
            inverse = cp_inverse_index(prep.packed_seq_params, process_groups.cp_size, flat.device)  # moved with it
            flat = gather_from_cp(flat, prep.packed, process_groups.cp, inverse=inverse)
        spans = list(prep.packed.padded_lengths)
        return torch.split(flat, spans), torch.split(prep.full_loss_mask, spans)
    cp_size = process_groups.cp_size
    rows = gather_bshd_from_cp(values, process_groups.cp, seq_dim=1) if cp_size > 1 else values
    return rows, prep.full_loss_mask


def _target_sum(sample: SequenceSample) -> float:
    """The sum of the sample's loss mask over its targets (tokens 1..n-1), on the host."""
    if sample.loss_mask is None:
        return float(len(sample.tokens) - 1)
    return float(torch.as_tensor(sample.loss_mask, dtype=torch.float32).reshape(-1)[1:].sum())


def target_count(sample: SequenceSample) -> int:
    """The sample's learned target tokens (targets are tokens 1..n-1; the loss mask picks them)."""
    return int(_target_sum(sample))


def local_step_counts(
    plan: StepPlan, samples: Sequence[SequenceSample], process_groups: ProcessGroups
) -> tuple[int, int, int]:
    """Valid target tokens, sequences with a target, and the plan's sample groups (0 without groups) in
    this DP rank's share.

    Counted whole-sample on CP rank 0 and 0 on other CP ranks, so a sum over DP x CP counts each once
    (a group never spans DP ranks: the planner keeps it in one micro-batch).
    """
    if process_groups.cp_rank != 0:
        return 0, 0, 0
    indices = (i for mb in plan.for_rank(process_groups.dp_rank) for i in mb.sample_indices)
    return count_targets(indices, samples, plan.groups)


def count_targets(indices, samples: Sequence[SequenceSample], group_ids=None) -> tuple[int, int, int]:
    """Valid target tokens, sequences with a target, and distinct group ids (0 without ``group_ids``) of
    the samples at ``indices``: the local share of `StepTotals` (the static and the dynamic-CP step)."""
    tokens = sequences = 0
    groups = set()
    for i in indices:
        valid = target_count(samples[i])
        tokens += valid
        sequences += valid > 0
        if group_ids is not None:
            groups.add(group_ids[i])
    return tokens, sequences, len(groups)
