"""The dynamic-CP step: each row of a `planning.dynamic_cp.DynamicCPPlan` on its own CP sub-group.

    pgs = ProcessGroups.from_megatron().with_dynamic_cp()          # the sub-groups: collective, once
    plan = plan_step(lengths, StepPlanConfig(..., dynamic_cp=True))  # a DynamicCPPlan
    result = forward_backward(model, samples, plan, pgs, loss=...)   # then optimizer.step()
    logprobs = compute_logprobs(model, samples, plan_step(..., forward_only=True), pgs)

`schedule.forward_backward` and `schedule.compute_logprobs` hand a `DynamicCPPlan` to this module, so a
step, a trainer or an RL loop runs static and dynamic CP through the same calls.

Megatron is initialized with the run's largest CP size, so its DP x CP group is the plan's domain and
DDP reduces the gradients over it once, at the end of the step, as under static CP. Each rank runs its
rows (`DynamicCPPlan.for_rank`) in the plan's order through Megatron's schedule (pp=1): a row of CP size
``k`` on ranks ``first_rank .. first_rank + k - 1`` of the domain is built and cut like a static CP
micro-batch of CP ``k`` (chunks ``p`` and ``2k - 1 - p`` of every sequence on the row's ``p``-th rank),
with the row's sub-group as its ``cp`` group: ``PackedSeqParams.cp_group`` (the attention gathers keys
and values over it), Megatron's RoPE for the forward (`_patches.rope_cp_group`), and the unpacked view's
gather (`prepare.per_sample_logprobs`). Dynamic batching's BSHD rows are built like static BSHD
micro-batches of CP ``k`` and get params that carry only the group (`packed_seq.bshd_cp_params`: GPTModel
slices the rotary table by it) and RoPE's table length, the row's width (`_patches.rope_cp_group`).
The totals (target tokens, sequences, groups) are counted on each row's first rank and summed over DP x
CP, so every loss (`TokenMeanNLL`, `SequenceMeanNLL`, `PerSequence`, `PerSample`, `PerGroup`) is
normalized over the whole global batch, and the step's loss and gradients are those of the unpacked
batch. Log-probs are written by each row's first rank and summed over DP x CP.
Mixture-of-Experts models run too: each row's routers get its padding mask, its router loss the row's
segments with the counts summed over TP and the row's CP sub-group (`moe_inputs`), its replay the routes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from functools import partial

import torch

from ..collectives import all_reduce
from ..data.sample import SequenceSample
from ..planning.dynamic_cp import CPRow, DynamicCPPlan
from ..planning.layout import ParallelLayout
from ..planning.step_config import StepPlanConfig
from ..planning.step_plan import StepPlan
from ..thd.loss_weights import StepTotals, megatron_loss_output
from ._patches.rope_cp_group import rope_cp_group
from .moe_inputs import begin_moe_micro_batch, is_moe, replayed_routes_cleared, router_losses
from .packed_seq import bshd_cp_params
from .prepare import count_targets, per_sample_logprobs, prepare_micro_batch
from .process_groups import ProcessGroups, group_size, verify_plan_across_ranks
from .step_loss import StepLoss, entropy_for, micro_batch_share
from .step_result import StepResult, step_loss

__all__ = ["compute_logprobs_dynamic_cp", "forward_backward_dynamic_cp"]


def forward_backward_dynamic_cp(
    model,
    samples: Sequence[SequenceSample],
    plan: DynamicCPPlan,
    process_groups: ProcessGroups,
    *,
    loss: StepLoss,
    forward_only: bool = False,
    device: torch.device,
    verify: bool = True,
):
    """Forward and backward of this rank's rows (gradients reduced over DP x CP by Megatron's finalize);
    the optimizer step is the caller's. ``model``: one DDP-wrapped chunk at pp=1, built at CP =
    ``plan.config.layout.cp``; ``process_groups`` with its dynamic-CP sub-groups. Called through
    `schedule.forward_backward`, which checks the loss and the samples first."""

    groups = _check(model, plan, process_groups, verify=verify)
    mine = plan.for_rank(groups.rank)
    totals = StepTotals.all_reduce(*_local_counts(plan, mine, groups.rank, samples), process_groups.dp_cp)
    from megatron.core.utils import get_model_config

    model_config = get_model_config(_chunk(model))
    moe, weights = is_moe(model_config), loss.token_weights
    prepared = [_prepare_row(row, samples, plan, process_groups, weights, totals, device, moe) for row in mine]
    per_token = bool(getattr(model_config, "calculate_per_token_loss", False))
    moe_losses = [] if forward_only else router_losses(_chunk(model))
    scale = totals.num_tokens if per_token else process_groups.dp_size * len(prepared)  # as the static step's
    for router_loss in moe_losses:
        router_loss.begin_step(num_sequences=len(samples), num_tokens=sum(plan.lengths), output_scale=scale)

    def loss_func(prep, row_groups: ProcessGroups, output: torch.Tensor):
        return megatron_loss_output(
            micro_batch_share(loss, prep, output, row_groups, totals, capture),
            local_valid_tokens=prep.local_valid_tokens,
            totals=totals,
            dp_size=process_groups.dp_size,
            num_microbatches=len(prepared),
            calculate_per_token_loss=per_token,
        )

    try:
        with entropy_for(loss, model, process_groups) as capture:
            store = _run(model, prepared, loss_func, process_groups, forward_only=forward_only,
                         labels=loss.uses_labels)  # fmt: skip
    finally:
        for router_loss in moe_losses:
            router_loss.end_step()
    return StepResult(
        loss=step_loss(store, process_groups, device),
        num_tokens=totals.num_tokens,
        num_sequences=totals.num_sequences,
        num_microbatches=len(mine),
        padded_tokens=sum(row.row_length for row in mine),
        real_tokens=sum(row.real_tokens for row in mine),
    )


def compute_logprobs_dynamic_cp(
    model, samples: Sequence[SequenceSample], plan: DynamicCPPlan, process_groups: ProcessGroups, *,
    device: torch.device, verify: bool = True,
) -> torch.Tensor:  # fmt: skip
    """`schedule.compute_logprobs` of a dynamic-CP plan: ``[N, S_max - 1]`` on every rank, each row's
    samples written by the row's first rank (after the gather over its sub-group) and summed over DP x CP."""
    groups = _check(model, plan, process_groups, verify=verify)
    mine = plan.for_rank(groups.rank)
    from megatron.core.utils import get_model_config

    moe = is_moe(get_model_config(_chunk(model)))
    prepared = [_prepare_row(row, samples, plan, process_groups, None, None, device, moe) for row in mine]
    out = torch.zeros((len(samples), max(max(plan.lengths) - 1, 0)), dtype=torch.float32, device=device)

    def loss_func(prep, row_groups: ProcessGroups, output: torch.Tensor):
        rows = per_sample_logprobs(prep, output.detach(), row_groups)
        if row_groups.cp_rank == 0:  # every rank of the row holds the same gathered values: write them once
            for sample, logprobs, _ in rows:
                out[sample, : logprobs.numel()] = logprobs  # device to device
        return output.new_zeros(()), {}

    with torch.no_grad():
        _run(model, prepared, loss_func, process_groups, forward_only=True)
    if group_size(process_groups.dp_cp) > 1:
        all_reduce(out, process_groups.dp_cp)
    return out


def _check(model, plan: DynamicCPPlan, process_groups: ProcessGroups, *, verify: bool):
    """The run can execute the plan: one chunk at pp=1, the plan's domain, the sub-groups;
    with ``verify``, every rank of the domain planned the same step. Returns the sub-groups."""
    if isinstance(model, list) and len(model) != 1:
        raise ValueError("dynamic CP runs one model chunk per rank (pp=1, vpp=1).")
    if process_groups.pp_size > 1:
        raise ValueError(f"dynamic CP runs at pp=1; this run has pp={process_groups.pp_size}.")
    groups = process_groups.dynamic_cp
    if groups is None:
        raise ValueError(
            "this is a dynamic-CP plan but the process groups have no dynamic-CP sub-groups: pass "
            "ProcessGroups.from_megatron().with_dynamic_cp() (build_policy(..., dynamic_cp=True) does)."
        )
    domain = group_size(process_groups.dp_cp)
    if domain != plan.num_ranks or groups.size != plan.num_ranks:
        raise ValueError(
            f"the plan is for {plan.num_ranks} DP x CP ranks but this run has {domain}; plan with the run's "
            "layout (dp x cp)."
        )
    if verify and domain > 1:
        verify_plan_across_ranks(plan, process_groups.dp_cp)
    return groups


def _local_counts(plan: DynamicCPPlan, mine: list[CPRow], rank: int, samples) -> tuple[int, int, int]:
    """Target tokens, sequences with a target and the plan's groups of the rows this rank is the first
    rank of (so a sum over the domain counts each row once; a group never spans rows)."""
    indices = (i for row in mine if row.first_rank == rank for i in row.sample_indices)
    return count_targets(indices, samples, plan.groups)


def _prepare_row(row: CPRow, samples, plan: DynamicCPPlan, process_groups: ProcessGroups, normalization, totals,
                 device, moe: bool):  # fmt: skip
    """The row as a static micro-batch of CP ``row.cp_size`` whose CP group is the row's sub-group (``moe``:
    with each token's sequence index for the routers): the prepared micro-batch and the row's process groups."""
    cfg = plan.config
    layout = ParallelLayout(cp=row.cp_size, tp=cfg.layout.tp, sequence_parallel=cfg.layout.sequence_parallel)
    row_config = StepPlanConfig(mode=cfg.mode, train_mb_tokens=cfg.max_tokens_per_rank, layout=layout,
                                sequence_length_round=cfg.sequence_length_round, fp8_alignment=cfg.fp8_alignment,
                                fixed_length=False if cfg.mode == "packing" else None)  # fmt: skip
    mb = row.as_micro_batch()
    row_plan = StepPlan(config=row_config, forward_only=plan.forward_only, lengths=plan.lengths,
                        micro_batches=((mb,),), row_capacity=cfg.capacity(row.cp_size),
                        groups=plan.groups)  # fmt: skip
    row_groups = process_groups.for_cp_group(process_groups.dynamic_cp.group(row.cp_size, row.first_rank))
    prep = prepare_micro_batch(mb, samples, row_plan, row_groups, totals=totals, normalization=normalization,
                               device=device, segments=moe)  # fmt: skip
    if row.width:  # BSHD rows: params that carry the row's group (a THD row's already do)
        prep = replace(prep, packed_seq_params=bshd_cp_params(row_groups.cp))
    return prep, row_groups


def _run(model, prepared: list, loss_func, process_groups: ProcessGroups, *, forward_only: bool, labels: bool = True):
    """Megatron's schedule (pp=1: one forward and backward per row, gradients reduced at the end)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    def forward_step(data_iterator, model_chunk):
        prep, row_groups = next(data_iterator)
        width = prep.plan.shape[1] if prep.packed is None else None  # BSHD: RoPE's table spans the whole row
        reduce = [g for g in (row_groups.tp, row_groups.cp) if g is not None and group_size(g) > 1]
        extra = begin_moe_micro_batch(prep, model_chunk, row_groups, reduce_groups=reduce)  # an MoE chunk's share
        with rope_cp_group(model_chunk, row_groups.cp, rotary_seq_len=width):
            output = model_chunk(prep.tokens, prep.position_ids, None, labels=prep.labels if labels else None,
                                 packed_seq_params=prep.packed_seq_params, **extra)  # fmt: skip
        return output, partial(loss_func, prep, row_groups)

    with replayed_routes_cleared(model):
        return get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter(prepared),
            model=[_chunk(model)],
            num_microbatches=len(prepared),
            seq_length=max((prep.tokens.shape[1] for prep, _ in prepared), default=1),
            micro_batch_size=1,
            forward_only=forward_only,
            pg_collection=process_groups.collection,
        )


def _chunk(model):
    return model[0] if isinstance(model, list) else model
