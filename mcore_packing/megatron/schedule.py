"""Schedule driver: run one training step (or a forward-only pass) of a plan through Megatron's schedule.

    groups = ParallelGroups.from_megatron()
    plan = plan_step([len(s.tokens) for s in samples], StepPlanConfig(...))
    result = run_step(model, samples, plan, groups)              # training step (then optimizer.step())
    logprobs = compute_logprobs(model, samples, logprob_plan, groups)   # [N, S_max - 1], input order

Both build this rank's micro-batches (`prepare.prepare_micro_batch`) and hand them to one invocation of
``megatron.core.pipeline_parallel.get_forward_backward_func()`` with ``num_microbatches`` equal to the
rank's micro-batch count. `run_step` returns the exact global loss (`thd.loss_weights`). The schedule
code is Megatron's own; on a CPU-only machine wrap calls in `cpu_device_adapter()`.

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

from ..data.sample import SequenceSample
from ..planning.step_plan import StepPlan
from ..thd.loss_weights import LossNormalization, StepTotals, megatron_loss_output
from .parallel_groups import ParallelGroups, group_size, verify_plan_across_ranks
from .prepare import PreparedMicroBatch, local_step_counts, per_sample_logprobs, prepare_micro_batch
from .unpacked_losses import group_loss_sum, sample_loss_sum, sequence_loss_sum

__all__ = ["StepResult", "compute_logprobs", "run_step"]


@dataclass(frozen=True)
class StepResult:
    """Outcome of one step on this rank. ``loss`` is the exact global loss (on every rank)."""

    loss: float
    num_tokens: int
    num_sequences: int
    num_microbatches: int
    padded_tokens: int
    real_tokens: int


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
    sample_loss: Callable | None = None,
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
            (`prepare.per_sample_logprobs`: any mode); the step loss is the sequence mean of ``fn``.
        group_loss: optional ``fn(members) -> scalar`` per group (DPO pairs, GRPO groups), where
            ``members`` is ``[(sample_id, logprobs, loss_mask), ...]`` in sample order; the step loss is
            the mean over groups. Needs ``group_ids`` and a plan made with the same ``groups``.
        sample_loss: optional ``fn(sample_id, logprobs, loss_mask) -> scalar`` per sample on the unpacked
            view, with per-sample side inputs looked up by ``sample_id`` (RL: advantages, old and
            reference log-probs; `mcore_packing.losses.ClippedPGLoss`). With ``token_mean`` it returns
            the sample's token sum and the step loss divides by the global token count; with
            ``sequence_mean`` its per-sequence value, divided by the global sequence count.
        forward_only: evaluation (no backward).
        verify: check with one all-gather that every rank planned the same step.
    """
    model_config = _check_step(model, samples, plan)
    _check_loss_options(plan, samples, sequence_loss, group_loss, group_ids, sample_loss)
    if verify and group_size(groups.dp_cp) > 1:
        verify_plan_across_ranks(plan, groups.dp_cp)
    per_unit = sequence_loss is not None or group_loss is not None
    normalization = LossNormalization(LossNormalization.SEQUENCE_MEAN if per_unit else normalization)
    device = _device(device)
    counted_groups = group_ids if group_loss is not None else None
    totals = StepTotals.all_reduce(*local_step_counts(plan, samples, groups, counted_groups), groups.dp_cp)
    micro = plan.for_rank(groups.dp_rank)
    build = partial(prepare_micro_batch, totals=totals, normalization=normalization, device=device)
    prepared = [build(mb, samples, plan, groups, pad_token_id=pad_token_id) for mb in micro]

    def loss_func(prep: PreparedMicroBatch, output: torch.Tensor):
        if sample_loss is not None:
            per_token = normalization == LossNormalization.TOKEN_MEAN
            weighted = sample_loss_sum(prep, output, sample_loss, groups, totals, per_token=per_token)
        elif group_loss is not None:
            weighted = group_loss_sum(prep, output, group_loss, group_ids, groups, totals)
        elif sequence_loss is not None:
            weighted = sequence_loss_sum(prep, output, sequence_loss, groups, totals)
        else:
            weighted = (output.float() * prep.weights).sum()
        return megatron_loss_output(
            weighted,
            local_valid_tokens=prep.local_valid_tokens,
            totals=totals,
            dp_size=groups.dp_size,
            num_microbatches=len(prepared),
            calculate_per_token_loss=bool(getattr(model_config, "calculate_per_token_loss", False)),
        )

    store = _run_schedule(model, prepared, plan, loss_func, forward_only=forward_only)
    return StepResult(
        loss=_step_loss(store, groups),
        num_tokens=totals.num_tokens,
        num_sequences=totals.num_sequences,
        num_microbatches=len(micro),
        padded_tokens=sum(mb.padded_tokens for mb in micro),
        real_tokens=sum(mb.real_tokens for mb in micro),
    )


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
    _check_step(model, samples, plan)
    device = _device(device)
    build = partial(prepare_micro_batch, totals=None, normalization="token_mean", device=device)
    prepared = [build(mb, samples, plan, groups, pad_token_id=pad_token_id) for mb in plan.for_rank(groups.dp_rank)]
    out = torch.zeros((len(samples), max(max(plan.lengths) - 1, 0)), dtype=torch.float32)

    def loss_func(prep: PreparedMicroBatch, output: torch.Tensor):
        for sample, logprobs, _ in per_sample_logprobs(prep, output.detach(), groups):
            out[sample, : logprobs.numel()] = logprobs.cpu()
        return output.new_zeros(()), {}

    with torch.no_grad():
        _run_schedule(model, prepared, plan, loss_func, forward_only=True)
    if group_size(groups.dp) > 1:
        dist.all_reduce(out, group=groups.dp)  # each row was filled by exactly one DP rank
    if groups.pp is not None and groups.pp_size > 1:
        dist.broadcast(out, src=dist.get_global_rank(groups.pp, groups.pp_size - 1), group=groups.pp)
    return out


def _run_schedule(model, prepared: list[PreparedMicroBatch], plan: StepPlan, loss_func, *, forward_only: bool):
    """The one call into Megatron's pipeline schedule; returns its per-micro-batch loss statistics."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    shapes = [mb.shape for rank in plan.micro_batches for mb in rank]
    rows = 1 if plan.config.mode == "packing" else max(s[0] for s in shapes)
    return get_forward_backward_func()(
        forward_step_func=_forward_step(loss_func),
        data_iterator=iter(prepared),
        model=model if isinstance(model, list) else [model],
        num_microbatches=len(prepared),
        seq_length=max(s[1] for s in shapes),  # p2p shapes; ignored with variable sequence lengths
        micro_batch_size=rows,
        forward_only=forward_only,
    )


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


def _step_loss(store: list[dict], groups: ParallelGroups) -> float:
    """The step's exact loss on every rank: summed on the last stage over micro-batches and DP x CP,
    then broadcast over the pipeline."""
    loss = torch.zeros(1)
    if groups.is_last_stage:
        for item in store:
            loss += item["weighted_loss"].float().cpu()
        if group_size(groups.dp_cp) > 1:
            dist.all_reduce(loss, group=groups.dp_cp)
    if groups.pp is not None and groups.pp_size > 1:
        dist.broadcast(loss, src=dist.get_global_rank(groups.pp, groups.pp_size - 1), group=groups.pp)
    return float(loss.item())


def _check_step(model, samples: Sequence[SequenceSample], plan: StepPlan):
    """The samples are the planned ones and the model's config can run the plan; returns that config."""
    from megatron.core.utils import get_model_config

    _check_samples(samples, plan)
    model_config = get_model_config(model[0] if isinstance(model, list) else model)
    _check_schedule_config(plan, model_config)
    return model_config


def _check_samples(samples: Sequence[SequenceSample], plan: StepPlan) -> None:
    if len(samples) != len(plan.lengths):
        raise ValueError(
            f"the plan covers {len(plan.lengths)} samples but {len(samples)} were given; plan the same global batch."
        )
    for i, (s, n) in enumerate(zip(samples, plan.lengths, strict=True)):
        if len(s.tokens) != n:
            raise ValueError(f"sample {i} has {len(s.tokens)} tokens but the plan says {n}.")


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


def _check_loss_options(plan: StepPlan, samples, sequence_loss, group_loss, group_ids, sample_loss) -> None:
    """One per-unit loss at most; a group loss needs the plan's groups (a group shares a micro-batch)."""
    given = [fn for fn in (sequence_loss, group_loss, sample_loss) if fn is not None]
    if len(given) > 1:
        raise ValueError("pass one of sequence_loss, group_loss and sample_loss.")
    if group_loss is None:
        return
    if group_ids is None or len(group_ids) != len(samples):
        raise ValueError("group_loss needs group_ids: one group id per sample, the same passed to plan_step.")
    if list(plan.groups or []) != list(group_ids):
        raise ValueError("the plan was made without these group ids; call plan_step(..., groups=group_ids).")


def _device(device) -> torch.device:
    if device is not None:
        return torch.device(device)
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
