"""The dynamic-CP step: each row of a `planning.dynamic_cp.DynamicCPPlan` on its own CP sub-group.

    groups = DynamicCPGroups.create(process_groups, max_cp=4)     # collective, once
    plan = plan_dynamic_cp(lengths, DynamicCPConfig(max_tokens_per_rank=..., layout=layout))
    result = forward_backward_dynamic_cp(model, samples, plan, process_groups, groups)  # then optimizer.step()

Megatron is initialized with the run's largest CP size, so its DP x CP group is the plan's domain and
DDP reduces the gradients over it once, at the end of the step, as under static CP. Each rank runs its
rows (`DynamicCPPlan.for_rank`) in the plan's order through Megatron's schedule (pp=1): a row of CP size
``k`` on ranks ``first_rank .. first_rank + k - 1`` of the domain is built and cut like a static CP
micro-batch of CP ``k`` (chunks ``p`` and ``2k - 1 - p`` of every sequence on the row's ``p``-th rank),
its ``PackedSeqParams.cp_group`` is the row's sub-group (the attention gathers keys and values over it),
and Megatron's RoPE gets the sub-group for the forward (`_patches.rope_cp_group`). The loss is normalized
over the whole global batch (the totals are counted from the samples, which every rank holds), so the
step's loss and gradients are those of the unpacked batch. Losses on the per-token weights only
(`TokenMeanNLL`, `SequenceMeanNLL`); the unpacked-view losses are refused.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist

from ..data.sample import SequenceSample
from ..planning.dynamic_cp import CPRow, DynamicCPPlan
from ..planning.layout import ParallelLayout
from ..planning.step_config import StepPlanConfig
from ..planning.step_plan import MicroBatchPlan, StepPlan
from ..thd.loss_weights import StepTotals, megatron_loss_output
from ._patches.rope_cp_group import rope_cp_group
from .prepare import prepare_micro_batch, target_count
from .process_groups import ProcessGroups, group_rank, group_size
from .schedule import StepResult, _check_samples, _device, _step_loss
from .step_loss import SequenceMeanNLL, StepLoss, TokenMeanNLL

__all__ = ["DynamicCPGroups", "forward_backward_dynamic_cp"]


@dataclass(frozen=True)
class DynamicCPGroups:
    """A process group for every aligned group of ``k`` ranks of the DP x CP domain, for every CP size
    ``k`` up to ``max_cp`` (singletons for ``k = 1``); ``rank`` is this rank's place in the domain."""

    groups: dict
    rank: int
    size: int

    @classmethod
    def create(cls, process_groups: ProcessGroups, *, max_cp: int) -> DynamicCPGroups:
        """Collective over the whole world (``torch.distributed.new_group`` is): every rank calls it."""
        domain = process_groups.dp_cp
        ranks = dist.get_process_group_ranks(domain) if domain is not None else [dist.get_rank()]
        groups, k = {}, 1
        while k <= max_cp:
            for first in range(0, len(ranks), k):
                groups[k, first] = dist.new_group(ranks[first : first + k])
            k *= 2
        return cls(groups=groups, rank=group_rank(domain), size=len(ranks))

    def group(self, row: CPRow):
        return self.groups[row.cp_size, row.first_rank]


def forward_backward_dynamic_cp(
    model,
    samples: Sequence[SequenceSample],
    plan: DynamicCPPlan,
    process_groups: ProcessGroups,
    groups: DynamicCPGroups,
    *,
    loss: StepLoss | None = None,
    forward_only: bool = False,
    device: torch.device | str | None = None,
) -> StepResult:
    """Forward and backward of this rank's rows (gradients reduced over DP x CP by Megatron's finalize);
    the optimizer step is the caller's. ``model``: one DDP-wrapped chunk at pp=1, built at CP =
    ``plan.config.layout.cp``."""
    loss = TokenMeanNLL() if loss is None else loss
    _check(model, samples, plan, process_groups, groups, loss)
    device = _device(device)
    totals = _totals(samples)
    mine = plan.for_rank(groups.rank)
    prepared = [_prepare_row(row, samples, plan, process_groups, groups, loss, totals, device) for row in mine]
    per_token = bool(getattr(model.config, "calculate_per_token_loss", False))

    def loss_func(prep, row_groups: ProcessGroups, output: torch.Tensor):
        return megatron_loss_output(
            loss.micro_batch_sum(prep, output, row_groups, totals),
            local_valid_tokens=prep.local_valid_tokens,
            totals=totals,
            dp_size=process_groups.dp_size,
            num_microbatches=len(prepared),
            calculate_per_token_loss=per_token,
        )

    store = _run(model, prepared, loss_func, process_groups, forward_only=forward_only)
    return StepResult(
        loss=_step_loss(store, process_groups),
        num_tokens=totals.num_tokens,
        num_sequences=totals.num_sequences,
        num_microbatches=len(mine),
        padded_tokens=sum(row.row_length for row in mine),
        real_tokens=sum(row.real_tokens for row in mine),
    )


def _check(model, samples, plan: DynamicCPPlan, process_groups: ProcessGroups, groups, loss) -> None:
    if isinstance(model, list) and len(model) != 1:
        raise ValueError("dynamic CP runs one model chunk per rank (pp=1, vpp=1).")
    if process_groups.pp_size > 1:
        raise ValueError(f"dynamic CP runs at pp=1; this run has pp={process_groups.pp_size}.")
    if group_size(process_groups.dp_cp) != plan.config.num_ranks or groups.size != plan.config.num_ranks:
        raise ValueError(
            f"the plan is for {plan.config.num_ranks} DP x CP ranks but this run has "
            f"{group_size(process_groups.dp_cp)}; plan with the run's layout (dp x cp)."
        )
    _check_samples(samples, plan)
    if not isinstance(loss, (TokenMeanNLL, SequenceMeanNLL)):
        raise ValueError(
            f"dynamic CP takes TokenMeanNLL or SequenceMeanNLL, got {type(loss).__name__}: the per-sample and "
            "per-group losses read the unpacked view, not built for dynamic CP yet. Use static CP for them."
        )


def _totals(samples: Sequence[SequenceSample]) -> StepTotals:
    """The global batch's learned target tokens and sequences with a target, counted from the samples
    (every rank holds the batch: nothing to all-reduce; a batch with no target is refused as in a static step)."""
    counts = [target_count(s) for s in samples]
    return StepTotals.all_reduce(sum(counts), sum(n > 0 for n in counts), 0, None)


def _prepare_row(row: CPRow, samples, plan: DynamicCPPlan, process_groups, groups: DynamicCPGroups, loss, totals,
                 device):  # fmt: skip
    """The row as a static micro-batch of CP ``row.cp_size`` whose CP group is the row's sub-group: the
    prepared micro-batch and the row's process groups."""
    cfg = plan.config
    layout = ParallelLayout(cp=row.cp_size, tp=cfg.layout.tp, sequence_parallel=cfg.layout.sequence_parallel)
    row_config = StepPlanConfig(mode="packing", train_mb_tokens=cfg.max_tokens_per_rank, layout=layout,
                                sequence_length_round=cfg.sequence_length_round, fixed_length=False)  # fmt: skip
    mb = MicroBatchPlan(row.sample_indices, (1, row.row_length), row.real_tokens, row.cost)
    row_plan = StepPlan(config=row_config, forward_only=False, lengths=plan.lengths, micro_batches=((mb,),),
                        row_capacity=row.cp_size * cfg.max_tokens_per_rank)  # fmt: skip
    collection = copy.copy(process_groups.collection)
    collection.cp = groups.group(row)
    row_groups = ProcessGroups(collection)
    prep = prepare_micro_batch(mb, samples, row_plan, row_groups, totals=totals, normalization=loss.token_weights,
                               device=device)  # fmt: skip
    return prep, row_groups


def _run(model, prepared: list, loss_func, process_groups: ProcessGroups, *, forward_only: bool):
    """Megatron's schedule (pp=1: one forward and backward per row, gradients reduced at the end)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    def forward_step(data_iterator, model_chunk):
        prep, row_groups = next(data_iterator)
        with rope_cp_group(model_chunk, row_groups.cp):
            output = model_chunk(prep.tokens, prep.position_ids, None, labels=prep.labels,
                                 packed_seq_params=prep.packed_seq_params)  # fmt: skip
        return output, partial(loss_func, prep, row_groups)

    chunk = model[0] if isinstance(model, list) else model
    return get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter(prepared),
        model=[chunk],
        num_microbatches=len(prepared),
        seq_length=max((prep.tokens.shape[1] for prep, _ in prepared), default=1),
        micro_batch_size=1,
        forward_only=forward_only,
        pg_collection=process_groups.collection,
    )


