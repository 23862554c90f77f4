"""Schedule driver: run one training step (or a forward-only pass) of a plan through Megatron's schedule.

    groups = ParallelGroups.from_megatron()
    plan = plan_step([len(s.tokens) for s in samples], StepPlanConfig(...))
    result = run_step(model, samples, plan, groups)              # training step (then optimizer.step())
    logprobs = compute_logprobs(model, samples, logprob_plan, groups)   # [N, S_max], input order

The driver builds this rank's micro-batches from the plan, calls
``megatron.core.pipeline_parallel.get_forward_backward_func()`` with ``num_microbatches`` equal to the
rank's micro-batch count, and returns the exact global loss (`mcore_packing.loss`). The schedule code
is Megatron's own; on a CPU-only machine wrap calls in `megatron.cpu_device_adapter()`.

Shapes for pipeline parallelism: packing mode sends ``[T/cp/(tp if sp), 1, hidden]`` tensors, so with a
fixed row length (the default under PP) ``seq_length`` is the row capacity and ``micro_batch_size`` 1;
with ``config.variable_seq_lengths`` Megatron exchanges shapes per micro-batch. Dynamic mode always
needs variable sequence lengths under PP.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist

from .batch import SequenceSample, build_packed_batch
from .context_parallel import gather_from_cp, slice_bshd_for_cp, slice_for_cp, thd_partition_indices
from .loss import LossNormalization, StepTotals, megatron_loss_output, token_weights
from .planning import MicroBatchPlan, StepPlan, verify_plan_across_ranks

__all__ = ["ParallelGroups", "PreparedMicroBatch", "StepResult", "compute_logprobs", "prepare_micro_batch", "run_step"]


@dataclass(frozen=True, kw_only=True)
class ParallelGroups:
    """Process groups and ranks the driver needs; build with `from_megatron` or pass your own."""

    dp: object
    cp: object
    dp_cp: object
    dp_rank: int
    dp_size: int
    cp_rank: int
    cp_size: int
    tp_size: int
    pp_size: int
    is_first_stage: bool
    is_last_stage: bool
    pp: object = None

    @classmethod
    def from_megatron(cls) -> ParallelGroups:
        """The one place that reads Megatron's global ``parallel_state``."""
        from megatron.core import parallel_state as ps

        return cls(
            dp=ps.get_data_parallel_group(),
            cp=ps.get_context_parallel_group(),
            dp_cp=ps.get_data_parallel_group(with_context_parallel=True),
            pp=ps.get_pipeline_model_parallel_group(),
            dp_rank=ps.get_data_parallel_rank(),
            dp_size=ps.get_data_parallel_world_size(),
            cp_rank=ps.get_context_parallel_rank(),
            cp_size=ps.get_context_parallel_world_size(),
            tp_size=ps.get_tensor_model_parallel_world_size(),
            pp_size=ps.get_pipeline_model_parallel_world_size(),
            is_first_stage=ps.is_pipeline_first_stage(ignore_virtual=True),
            is_last_stage=ps.is_pipeline_last_stage(ignore_virtual=True),
        )


@dataclass
class PreparedMicroBatch:
    """Tensors for one micro-batch on this rank (already split for CP)."""

    plan: MicroBatchPlan
    tokens: torch.Tensor
    position_ids: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor  # local (CP shard)
    weights: torch.Tensor  # local per-token loss weights w_t
    packed_seq_params: object | None
    full_batch: object | None  # the whole PackedBatch (packing mode), for gathering outputs
    span_lengths: list[int]  # per sequence (packing) or per row (dynamic), before the CP split
    real_lengths: list[int]
    local_valid_tokens: int  # valid targets in this CP shard, counted on the host (no device sync)


def prepare_micro_batch(
    mb: MicroBatchPlan,
    samples: Sequence[SequenceSample],
    plan: StepPlan,
    groups: ParallelGroups,
    totals: StepTotals | None,
    normalization: LossNormalization | str,
    device: torch.device,
    pad_token_id: int = 0,
) -> PreparedMicroBatch:
    """Build the packed THD row (packing) or padded rows (dynamic) of ``mb`` and take this CP rank's part."""
    from .megatron.packed_seq import to_packed_seq_params

    config = plan.config
    chosen = [samples[i] for i in mb.sample_indices]
    if config.mode == "packing":
        batch = build_packed_batch(
            chosen,
            config.padding_rule,
            sample_ids=mb.sample_indices,
            pad_to=mb.shape[1] if config.use_fixed_length else None,
            pad_token_id=pad_token_id,
        )
        if batch.total_tokens != mb.shape[1]:
            raise AssertionError(f"planned row {mb.shape[1]} != built row {batch.total_tokens}")
        spans = list(batch.padded_lengths)
        weights = token_weights(batch.loss_mask[0], spans, normalization, totals)[None] if totals is not None else None
        local = slice_for_cp(batch, groups.cp_size, groups.cp_rank)
        if weights is not None and groups.cp_size > 1:
            index = thd_partition_indices(batch.cu_seqlens_padded, batch.total_tokens, groups.cp_size, groups.cp_rank)
            weights = weights[:, index]
        params = to_packed_seq_params(local, device=device, cp_group=groups.cp)
        return PreparedMicroBatch(
            plan=mb,
            tokens=local.tokens.to(device),
            position_ids=local.position_ids.to(device),
            labels=local.labels.to(device),
            loss_mask=local.loss_mask.to(device),
            weights=weights.to(device) if weights is not None else None,
            packed_seq_params=params,
            full_batch=batch,
            span_lengths=spans,
            real_lengths=list(batch.seq_lengths),
            local_valid_tokens=int(local.loss_mask.sum().item()),
        )
    rows, width = mb.shape
    # Each BSHD row is a one-sequence packed row padded to the micro-batch width (same label shift).
    built = [build_packed_batch([s], pad_to=width, pad_token_id=pad_token_id) for s in chosen]
    tokens = torch.cat([b.tokens for b in built])
    labels = torch.cat([b.labels for b in built])
    loss_mask = torch.cat([b.loss_mask for b in built])
    weights = (
        token_weights(loss_mask.reshape(-1), [width] * rows, normalization, totals).reshape(rows, width)
        if totals is not None
        else None
    )
    position_ids = torch.arange(width).expand(rows, width)
    split = partial(slice_bshd_for_cp, cp_size=groups.cp_size, cp_rank=groups.cp_rank, seq_dim=1)
    local_mask = split(loss_mask)
    return PreparedMicroBatch(
        plan=mb,
        tokens=split(tokens).to(device),
        position_ids=split(position_ids).contiguous().to(device),
        labels=split(labels).to(device),
        loss_mask=local_mask.to(device),
        weights=split(weights).to(device) if weights is not None else None,
        packed_seq_params=None,
        full_batch=None,
        span_lengths=[width] * rows,
        real_lengths=[int(torch.as_tensor(s.tokens).numel()) for s in chosen],
        local_valid_tokens=int(local_mask.sum().item()),
    )


def local_step_counts(
    plan: StepPlan, samples: Sequence[SequenceSample], groups: ParallelGroups, group_ids: Sequence | None = None
) -> tuple[int, int]:
    """Valid target tokens, and loss units (sequences with a target, or groups), in this DP rank's share.

    Counted whole-sample on CP rank 0 and 0 on other CP ranks, so a sum over DP x CP counts each once.
    """
    tokens = 0
    units = set()
    for mb in plan.for_rank(groups.dp_rank):
        for i in mb.sample_indices:
            s = samples[i]
            n = int(torch.as_tensor(s.tokens).numel())
            mask = torch.ones(n) if s.loss_mask is None else torch.as_tensor(s.loss_mask, dtype=torch.float32)
            valid = int(mask.reshape(-1)[1:].sum().item())  # targets are tokens 1..n-1
            tokens += valid
            if group_ids is not None:
                units.add(group_ids[i])
            elif valid > 0:
                units.add(i)
    if groups.cp_rank != 0:
        return 0, 0
    return tokens, len(units)


@dataclass(frozen=True)
class StepResult:
    """Outcome of one step on this rank. ``loss`` is the exact global loss (on every rank)."""

    loss: float
    num_tokens: int
    num_sequences: int
    num_microbatches: int
    padded_tokens: int
    real_tokens: int


def _check_samples(samples: Sequence[SequenceSample], plan: StepPlan) -> None:
    if len(samples) != len(plan.lengths):
        raise ValueError(
            f"the plan covers {len(plan.lengths)} samples but {len(samples)} were given; plan the same global batch."
        )
    for i, (s, n) in enumerate(zip(samples, plan.lengths, strict=True)):
        if int(torch.as_tensor(s.tokens).numel()) != n:
            raise ValueError(f"sample {i} has {torch.as_tensor(s.tokens).numel()} tokens but the plan says {n}.")


def _check_schedule_config(plan: StepPlan, model_config) -> None:
    config = plan.config
    if config.pp_size > 1 and not getattr(model_config, "variable_seq_lengths", False):
        if config.mode == "dynamic":
            raise ValueError(
                "Dynamic batching with pipeline parallelism needs variable sequence lengths: micro-batches have "
                "different shapes. Set TransformerConfig(variable_seq_lengths=True) (megatron-core 0.16 also needs "
                "moe_token_dispatcher_type='alltoall'), or use packing with fixed-length rows."
            )
        if not config.use_fixed_length:
            raise ValueError(
                "Packing with pipeline parallelism needs one row length per micro-batch (fixed_length=True) or "
                "TransformerConfig(variable_seq_lengths=True)."
            )


def _model_config(model):
    from megatron.core.utils import get_model_config

    return get_model_config(model[0] if isinstance(model, list) else model)


def _schedule_shapes(plan: StepPlan, model_config) -> tuple[int, int]:
    """``(seq_length, micro_batch_size)`` for Megatron's p2p shapes (ignored with variable lengths)."""
    shapes = [mb.shape for rank in plan.micro_batches for mb in rank]
    if plan.config.mode == "packing":
        return max(s[1] for s in shapes), 1
    return max(s[1] for s in shapes), max(s[0] for s in shapes)


def run_step(
    model,
    samples: Sequence[SequenceSample],
    plan: StepPlan,
    groups: ParallelGroups,
    *,
    normalization: LossNormalization | str = LossNormalization.TOKEN_MEAN,
    sequence_loss: Callable | None = None,
    group_loss: Callable | None = None,
    group_ids: Sequence | None = None,
    forward_only: bool = False,
    device: torch.device | str | None = None,
    verify: bool = True,
    pad_token_id: int = 0,
) -> StepResult:
    """One training step (forward and backward of every micro-batch; the optimizer step is the caller's).

    Args:
        model: the Megatron model (chunk list or module), wrapped in Megatron DDP for DP/CP > 1.
        samples: the whole global batch (every rank passes the same list; the plan picks this rank's part).
        plan: `plan_step` output for these samples.
        groups: process groups (`ParallelGroups.from_megatron()`).
        normalization: ``token_mean`` (default) or ``sequence_mean``.
        sequence_loss: optional ``fn(logprobs, loss_mask) -> scalar`` per sequence on the unpacked view
            (packing mode); the step loss is the sequence mean of ``fn``.
        group_loss: optional ``fn(members) -> scalar`` per group (DPO pairs, GRPO groups), where
            ``members`` is ``[(sample_id, logprobs, loss_mask), ...]`` in sample order; the step loss is
            the mean over groups. Needs ``group_ids`` and a plan made with the same ``groups``.
        forward_only: evaluation (no backward).
        verify: check with one all-gather that every rank planned the same step.
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func

    _check_samples(samples, plan)
    model_config = _model_config(model)
    _check_schedule_config(plan, model_config)
    if verify and groups.dp_cp is not None and dist.get_world_size(groups.dp_cp) > 1:
        verify_plan_across_ranks(plan, groups.dp_cp)
    if (sequence_loss is not None or group_loss is not None) and plan.config.mode != "packing":
        raise ValueError("sequence_loss / group_loss run on the unpacked view of packed rows: use mode='packing'.")
    if group_loss is not None:
        if group_ids is None or len(group_ids) != len(samples):
            raise ValueError("group_loss needs group_ids: one group id per sample, the same passed to plan_step.")
        if list(plan.extra.get("groups") or []) != list(group_ids):
            raise ValueError("the plan was made without these group ids; call plan_step(..., groups=group_ids).")
    per_unit = sequence_loss is not None or group_loss is not None
    normalization = LossNormalization(LossNormalization.SEQUENCE_MEAN if per_unit else normalization)
    device = torch.device(device) if device is not None else _default_device()
    micro = plan.for_rank(groups.dp_rank)
    num_microbatches = len(micro)

    local_tokens, local_sequences = local_step_counts(
        plan, samples, groups, group_ids if group_loss is not None else None
    )
    totals = StepTotals.all_reduce(local_tokens, local_sequences, groups.dp_cp)
    prepared = [
        prepare_micro_batch(mb, samples, plan, groups, totals, normalization, device, pad_token_id) for mb in micro
    ]
    per_token = bool(getattr(model_config, "calculate_per_token_loss", False))

    def loss_func(prep: PreparedMicroBatch, output_tensor: torch.Tensor):
        if group_loss is not None:
            weighted = _group_loss_sum(prep, output_tensor, group_loss, group_ids, groups, totals)
        elif sequence_loss is not None:
            weighted = _sequence_loss_sum(prep, output_tensor, sequence_loss, groups, totals)
        else:
            weighted = (output_tensor.float() * prep.weights).sum()
        return megatron_loss_output(
            weighted,
            local_valid_tokens=prep.local_valid_tokens,
            totals=totals,
            dp_size=groups.dp_size,
            num_microbatches=num_microbatches,
            calculate_per_token_loss=per_token,
        )

    seq_length, micro_batch_size = _schedule_shapes(plan, model_config)
    forward_backward = get_forward_backward_func()
    store = forward_backward(
        forward_step_func=_forward_step(loss_func),
        data_iterator=iter(prepared),
        model=model if isinstance(model, list) else [model],
        num_microbatches=num_microbatches,
        seq_length=seq_length,
        micro_batch_size=micro_batch_size,
        forward_only=forward_only,
    )
    loss = torch.zeros(1)
    if groups.is_last_stage:
        for item in store:
            loss += item["weighted_loss"].float().cpu()
        if groups.dp_cp is not None and dist.get_world_size(groups.dp_cp) > 1:
            dist.all_reduce(loss, group=groups.dp_cp)
    if groups.pp is not None and groups.pp_size > 1:  # every stage reports the step's loss
        dist.broadcast(loss, src=dist.get_global_rank(groups.pp, groups.pp_size - 1), group=groups.pp)
    return StepResult(
        loss=float(loss.item()),
        num_tokens=totals.num_tokens,
        num_sequences=totals.num_sequences,
        num_microbatches=num_microbatches,
        padded_tokens=sum(mb.padded_tokens for mb in micro),
        real_tokens=sum(mb.real_tokens for mb in micro),
    )


def _sequence_loss_sum(prep, output_tensor, fn, groups, totals) -> torch.Tensor:
    """Run ``fn`` per sequence on full (CP-gathered) log-probs; return this rank's share of the sum / S."""
    logprobs = -output_tensor.float().reshape(-1)
    batch = prep.full_batch
    if groups.cp_size > 1:
        local = slice_for_cp(batch, groups.cp_size, groups.cp_rank)
        logprobs = gather_from_cp(logprobs, local, groups.cp)
    mask = batch.loss_mask[0].to(logprobs.device)
    total = logprobs.new_zeros(())
    start = 0
    for span, n in zip(batch.padded_lengths, batch.seq_lengths, strict=True):
        if n > 1 and mask[start : start + n - 1].sum() > 0:
            value = fn(logprobs[start : start + n - 1], mask[start : start + n - 1])
            if not isinstance(value, torch.Tensor) or value.dim() != 0:
                shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
                raise ValueError(
                    f"sequence_loss must return a scalar (0-d) tensor for each sequence, got {shape}; reduce "
                    "over the sequence's tokens inside the function (e.g. .sum() or .mean())."
                )
            total = total + value
        start += span
    # Every CP rank holds the same gathered sum; the gather's backward adds their gradients, so each rank
    # keeps 1/cp of it.
    return total / (totals.num_sequences * groups.cp_size)


def _unpacked_logprobs(prep, output_tensor, groups):
    """Full-row log-probs (CP shards gathered, differentiable) and the row's loss mask."""
    logprobs = -output_tensor.float().reshape(-1)
    batch = prep.full_batch
    if groups.cp_size > 1:
        logprobs = gather_from_cp(logprobs, slice_for_cp(batch, groups.cp_size, groups.cp_rank), groups.cp)
    return logprobs, batch.loss_mask[0].to(logprobs.device)


def _check_scalar(value, what: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor) or value.dim() != 0:
        shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise ValueError(
            f"{what} must return a scalar (0-d) tensor, got {shape}; reduce over the tokens inside the function."
        )
    return value


def _group_loss_sum(prep, output_tensor, fn, group_ids, groups, totals) -> torch.Tensor:
    """Run ``fn`` once per group of this micro-batch; this rank's share of (sum / number of groups)."""
    logprobs, mask = _unpacked_logprobs(prep, output_tensor, groups)
    batch = prep.full_batch
    members: dict = {}
    start = 0
    for sample, span, n in zip(batch.sample_ids, batch.padded_lengths, batch.seq_lengths, strict=True):
        view = slice(start, start + max(n - 1, 0))
        members.setdefault(group_ids[sample], []).append((sample, logprobs[view], mask[view]))
        start += span
    total = logprobs.new_zeros(())
    for items in members.values():
        total = total + _check_scalar(fn(sorted(items, key=lambda item: item[0])), "group_loss")
    return total / (totals.num_sequences * groups.cp_size)


def _forward_step(loss_func):
    """Megatron's ``forward_step_func``: the next prepared micro-batch through the model chunk; the
    per-token losses go to ``loss_func(prepared, output)`` on the last stage."""

    def forward_step(data_iterator, model_chunk):
        prep = next(data_iterator)
        output = model_chunk(
            prep.tokens, prep.position_ids, None, labels=prep.labels, packed_seq_params=prep.packed_seq_params
        )
        return output, partial(loss_func, prep)

    return forward_step


def _default_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def compute_logprobs(
    model,
    samples: Sequence[SequenceSample],
    plan: StepPlan,
    groups: ParallelGroups,
    *,
    device: torch.device | str | None = None,
    pad_token_id: int = 0,
) -> torch.Tensor:
    """Per-token log-probs of every sample's next tokens, ``[N, S_max - 1]`` in input order (0 on padding).

    Row ``i`` position ``j`` is ``log p(tokens_i[j + 1] | tokens_i[:j + 1])``. Forward-only through
    Megatron's schedule with the plan's (logprob) micro-batches. Every rank returns the full tensor: the
    last pipeline stage computes it, CP shards are gathered, DP ranks' rows are summed together, and the
    result is broadcast over the pipeline.
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func

    _check_samples(samples, plan)
    model_config = _model_config(model)
    _check_schedule_config(plan, model_config)
    device = torch.device(device) if device is not None else _default_device()
    micro = plan.for_rank(groups.dp_rank)
    prepared = [
        prepare_micro_batch(mb, samples, plan, groups, None, LossNormalization.TOKEN_MEAN, device, pad_token_id)
        for mb in micro
    ]
    width = max(plan.lengths) - 1
    out = torch.zeros((len(samples), max(width, 0)), dtype=torch.float32)

    def loss_func(prep: PreparedMicroBatch, output_tensor: torch.Tensor):
        logprobs = -output_tensor.detach().float()
        _scatter_logprobs(prep, logprobs, groups, out)
        return output_tensor.new_zeros(()), {}

    seq_length, micro_batch_size = _schedule_shapes(plan, model_config)
    with torch.no_grad():
        get_forward_backward_func()(
            forward_step_func=_forward_step(loss_func),
            data_iterator=iter(prepared),
            model=model if isinstance(model, list) else [model],
            num_microbatches=len(prepared),
            seq_length=seq_length,
            micro_batch_size=micro_batch_size,
            forward_only=True,
        )
    if groups.dp is not None and dist.get_world_size(groups.dp) > 1:
        dist.all_reduce(out, group=groups.dp)  # each row was filled by exactly one DP rank
    if groups.pp is not None and groups.pp_size > 1:
        last = dist.get_global_rank(groups.pp, groups.pp_size - 1)
        dist.broadcast(out, src=last, group=groups.pp)
    return out


def _scatter_logprobs(prep: PreparedMicroBatch, logprobs: torch.Tensor, groups: ParallelGroups, out) -> None:
    if prep.full_batch is not None:
        batch = prep.full_batch
        flat = logprobs.reshape(-1)
        if groups.cp_size > 1:
            flat = gather_from_cp(flat, slice_for_cp(batch, groups.cp_size, groups.cp_rank), groups.cp)
        flat = flat.cpu()
        start = 0
        for sample, span, n in zip(batch.sample_ids, batch.padded_lengths, batch.seq_lengths, strict=True):
            out[sample, : n - 1] = flat[start : start + n - 1]
            start += span
        return
    rows = logprobs
    if groups.cp_size > 1:
        from .context_parallel import gather_bshd_from_cp

        rows = gather_bshd_from_cp(rows, groups.cp, seq_dim=1)
    rows = rows.cpu()
    for r, (sample, n) in enumerate(zip(prep.plan.sample_indices, prep.real_lengths, strict=True)):
        out[sample, : n - 1] = rows[r, : n - 1]
