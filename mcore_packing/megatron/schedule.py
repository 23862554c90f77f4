"""Schedule driver: one forward and backward pass (or a forward-only pass) of a plan through Megatron's
pipeline schedule.

    process_groups = ProcessGroups.from_megatron()
    plan = plan_step([len(s.tokens) for s in samples], StepPlanConfig(...))
    result = forward_backward(model, samples, plan, process_groups, loss=TokenMeanNLL())  # then optimizer.step()
    logprobs = compute_logprobs(model, samples, logprob_plan, process_groups)   # [N, S_max - 1], input order

Both build this rank's micro-batches (`prepare.prepare_micro_batch`) and hand them to one invocation of
``megatron.core.pipeline_parallel.get_forward_backward_func()`` with ``num_microbatches`` equal to the
rank's micro-batch count and the same ``ProcessGroupCollection``. `forward_backward` returns the exact
global loss of its `step_loss.StepLoss` (`thd.loss_weights`); the optimizer step is the caller's
(`train_step.train_step` does the whole step). The schedule code is Megatron's own; on a CPU-only
machine wrap calls in `cpu_device_adapter()`.

Interleaved pipeline (``layout.vpp > 1``): ``model`` is the stage's list of chunks (`build_gpt_chunks`),
each chunk reads the prepared micro-batches from its own iterator, and the plan's micro-batch count per
rank meets Megatron's rules for the interleaved schedule (`planning.pipeline.check_interleaved_count`;
the planner makes it a multiple of ``microbatch_group_size_per_vp_stage``).

Shapes for pipeline parallelism: packing mode sends ``[T/cp/(tp if sp), 1, hidden]`` tensors, so with a
fixed row length (the default under PP) ``seq_length`` is the row capacity and ``micro_batch_size`` 1;
with ``config.variable_seq_lengths`` Megatron exchanges shapes per micro-batch. Dynamic mode always
needs variable sequence lengths under PP.

Dynamic context parallelism: a `planning.dynamic_cp.DynamicCPPlan` (``plan_step`` with
``StepPlanConfig(dynamic_cp=True)``) goes to `dynamic_cp` through the same two calls; ``process_groups``
must carry the CP sub-groups (`ProcessGroups.with_dynamic_cp`).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

import torch

from ..collectives import all_reduce
from ..data.sample import SequenceSample
from ..planning.dynamic_cp import DynamicCPPlan
from ..planning.pipeline import check_interleaved_count
from ..planning.step_plan import StepPlan
from ..thd.loss_weights import StepTotals, megatron_loss_output
from .moe_inputs import begin_moe_micro_batch, is_moe, replayed_routes_cleared, router_losses
from .prepare import PreparedMicroBatch, local_step_counts, per_sample_logprobs, prepare_micro_batch
from .process_groups import ProcessGroups, group_size, verify_plan_across_ranks
from .shared_prefix import attach_shared_prefix, score_extra_rows, shared_prefix_of
from .step_loss import StepLoss, TokenMeanNLL, entropy_for, micro_batch_share
from .step_result import StepResult, broadcast_from_last_stage, step_loss

__all__ = ["StepResult", "compute_logprobs", "forward_backward"]


def forward_backward(
    model,
    samples: Sequence[SequenceSample],
    plan: StepPlan | DynamicCPPlan,
    process_groups: ProcessGroups,
    *,
    loss: StepLoss | None = None,
    forward_only: bool = False,
    device: torch.device | str | None = None,
    verify: bool = True,
    pad_token_id: int = 0,
) -> StepResult:
    """Forward and backward of every micro-batch of this rank (gradients reduced over DP x CP by
    Megatron's finalize); the optimizer step is the caller's.

    Args:
        model: the Megatron model (chunk list or module), wrapped in Megatron DDP for DP/CP > 1.
        samples: the whole global batch (every rank passes the same list; the plan picks this rank's part).
        plan: `plan_step` output for these samples.
        process_groups: `ProcessGroups` (``ProcessGroups.from_megatron()``).
        loss: a `step_loss.StepLoss`: `TokenMeanNLL` (default), `SequenceMeanNLL`, `PerSequence(fn)`,
            `PerSample(fn, normalization)` or `PerGroup(fn)` (groups from ``plan.groups``).
        forward_only: evaluation (no backward).
        verify: check with one all-gather that every rank planned the same step.
    """
    loss = TokenMeanNLL() if loss is None else loss
    _check_loss(loss, plan)
    _check_head(model, uses_labels=loss.uses_labels)
    _check_shared_prefix(model, plan, loss)
    if _is_dynamic_cp(plan):
        from .dynamic_cp import forward_backward_dynamic_cp

        _check_samples(samples, plan)
        return forward_backward_dynamic_cp(model, samples, plan, process_groups, loss=loss, forward_only=forward_only,
                                           device=_device(device), verify=verify)  # fmt: skip
    model_config = _check_step(model, samples, plan)
    if verify and group_size(process_groups.dp_cp) > 1:
        verify_plan_across_ranks(plan, process_groups.dp_cp)
    device = _device(device)
    totals = StepTotals.all_reduce(*local_step_counts(plan, samples, process_groups), process_groups.dp_cp)
    micro = plan.for_rank(process_groups.dp_rank)
    build = partial(prepare_micro_batch, totals=totals, normalization=loss.token_weights, device=device,
                    segments=is_moe(model_config))  # fmt: skip
    prepared = [build(mb, samples, plan, process_groups, pad_token_id=pad_token_id) for mb in micro]
    per_token = bool(getattr(model_config, "calculate_per_token_loss", False))
    moe_losses = [] if forward_only else router_losses(model)
    scale = totals.num_tokens if per_token else process_groups.dp_size * len(prepared)  # what the schedule's
    for router_loss in moe_losses:  # normalization divides an attached loss by (as for the main loss)
        router_loss.begin_step(num_sequences=len(samples), num_tokens=sum(plan.lengths), output_scale=scale)

    def loss_func(prep: PreparedMicroBatch, output: torch.Tensor):
        return megatron_loss_output(
            micro_batch_share(loss, prep, output, process_groups, totals, capture),
            local_valid_tokens=prep.local_valid_tokens,
            totals=totals,
            dp_size=process_groups.dp_size,
            num_microbatches=len(prepared),
            calculate_per_token_loss=per_token,
        )

    try:
        with entropy_for(loss, model, process_groups) as capture:
            store = _run_schedule(model, prepared, plan, process_groups, loss_func, forward_only=forward_only,
                                  labels=loss.uses_labels)  # fmt: skip
    finally:
        for router_loss in moe_losses:
            router_loss.end_step()
    return StepResult(
        loss=step_loss(store, process_groups, device),
        num_tokens=totals.num_tokens,
        num_sequences=totals.num_sequences,
        num_microbatches=len(micro),
        padded_tokens=sum(mb.padded_tokens for mb in micro),
        real_tokens=sum(mb.real_tokens for mb in micro),
    )


def compute_logprobs(
    model,
    samples: Sequence[SequenceSample],
    plan: StepPlan | DynamicCPPlan,
    process_groups: ProcessGroups,
    *,
    device: torch.device | str | None = None,
    pad_token_id: int = 0,
) -> torch.Tensor:
    """Per-token log-probs of every sample's next tokens, ``[N, S_max - 1]`` in input order (0 on padding).

    Row ``i`` position ``j`` is ``log p(tokens_i[j + 1] | tokens_i[:j + 1])``. Forward-only through
    Megatron's schedule with the plan's (logprob) micro-batches. Every rank returns the full tensor, on
    ``device`` (written there by each micro-batch's loss function, with no copy to the host): the last
    pipeline stage computes it, CP shards are gathered, DP ranks' rows are summed together, and the
    result is broadcast over the pipeline. A dynamic-CP plan (`planning.dynamic_cp.DynamicCPPlan`) runs
    each row on its CP sub-group (`dynamic_cp.compute_logprobs_dynamic_cp`).
    """
    _check_head(model, uses_labels=True)
    _check_shared_prefix(model, plan, None)
    if _is_dynamic_cp(plan):
        from .dynamic_cp import compute_logprobs_dynamic_cp

        _check_samples(samples, plan)
        return compute_logprobs_dynamic_cp(model, samples, plan, process_groups, device=_device(device))
    model_config = _check_step(model, samples, plan)
    device = _device(device)
    build = partial(prepare_micro_batch, totals=None, normalization=None, device=device,
                    segments=is_moe(model_config))  # fmt: skip
    micro = plan.for_rank(process_groups.dp_rank)
    prepared = [build(mb, samples, plan, process_groups, pad_token_id=pad_token_id) for mb in micro]
    out = torch.zeros((len(samples), max(max(plan.lengths) - 1, 0)), dtype=torch.float32, device=device)

    def loss_func(prep: PreparedMicroBatch, output: torch.Tensor):
        for sample, logprobs, _ in per_sample_logprobs(prep, output.detach(), process_groups):
            out[sample, : logprobs.numel()] = logprobs  # device to device
        return output.new_zeros(()), {}

    with torch.no_grad():
        _run_schedule(model, prepared, plan, process_groups, loss_func, forward_only=True)
    if group_size(process_groups.dp) > 1:
        all_reduce(out, process_groups.dp)  # each row was filled by exactly one DP rank
    broadcast_from_last_stage(out, process_groups)
    return out


def _run_schedule(
    model, prepared: list[PreparedMicroBatch], plan: StepPlan, process_groups: ProcessGroups, loss_func, *,
    forward_only: bool, labels: bool = True,
):  # fmt: skip
    """The one call into Megatron's pipeline schedule, with ``process_groups``' collection (and, under
    PP, a P2P communicator over its pipeline group); returns the per-micro-batch loss statistics."""
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
    from megatron.core.utils import get_model_config

    chunks = model if isinstance(model, list) else [model]
    shapes = [mb.shape for rank in plan.micro_batches for mb in rank]
    rows = 1 if plan.config.mode == "packing" else max(s[0] for s in shapes)
    p2p = None
    if process_groups.pp_size > 1:
        p2p = P2PCommunicator(pp_group=process_groups.pp, config=get_model_config(chunks[0]))
    # Interleaved: every chunk reads the micro-batches in order, each from its own iterator.
    data = iter(prepared) if len(chunks) == 1 else [iter(prepared) for _ in chunks]
    with replayed_routes_cleared(chunks):
        return get_forward_backward_func()(
            forward_step_func=_forward_step(loss_func, process_groups, labels=labels),
            data_iterator=data,
            model=chunks,
            num_microbatches=len(prepared),
            seq_length=max(s[1] for s in shapes),  # p2p shapes; ignored with variable sequence lengths
            micro_batch_size=rows,
            forward_only=forward_only,
            p2p_communicator=p2p,
            pg_collection=process_groups.collection,
        )


def _forward_step(loss_func, process_groups: ProcessGroups, *, labels: bool = True):
    """Megatron's ``forward_step_func``: the next prepared micro-batch through the model chunk; the
    per-token losses go to ``loss_func(prepared, output)`` on the last stage. An MoE model also gets the
    micro-batch's padding mask, so its routers keep pad tokens out of their statistics, and its router
    loss and router replay, if any, this stage's share of the segments and routes (`moe_inputs`)."""

    def forward_step(data_iterator, model_chunk):
        prep = next(data_iterator)
        extra = begin_moe_micro_batch(prep, model_chunk, process_groups)
        if prep.shared is not None and shared_prefix_of(prep.packed_seq_params) is None:  # once per micro-batch
            attach_shared_prefix(prep.packed_seq_params, prep.shared, _rotary(model_chunk), prep.tokens.device)
        with score_extra_rows(model_chunk, prep.extra_rows if labels else None):  # a shared prompt's last token
            output = model_chunk(
                prep.tokens, prep.position_ids, None, labels=prep.labels if labels else None,
                packed_seq_params=prep.packed_seq_params, **extra
            )
        return output, partial(loss_func, prep)

    return forward_step


def _rotary(model_chunk):
    """The chunk's RoPE module (Megatron's ``GPTModel.rotary_pos_emb``; None without RoPE), under any wrapper."""
    module = model_chunk
    while hasattr(module, "module") and not hasattr(module, "rotary_pos_emb"):
        module = module.module
    return getattr(module, "rotary_pos_emb", None)


def _check_shared_prefix(model, plan, loss) -> None:
    """A shared-prefix plan needs what reads its rows: the built-in attention (`PackedCoreAttention`: TE's
    would let every segment attend only to itself), a dense model (an MoE router's per-sequence statistics
    would see segments), RoPE or no position embedding, and a loss on the unpacked view (a per-token
    weighted NLL would count a shared target once)."""
    if getattr(plan, "shared_prefix", None) is None:
        return
    from .attention import PackedCoreAttention

    chunks = model if isinstance(model, list) else [model]
    modules = [m for chunk in chunks for m in chunk.modules()]
    if not any(isinstance(m, PackedCoreAttention) for m in modules):
        raise ValueError(
            "a shared-prefix plan needs the built-in attention (PackedCoreAttention), which gives each response "
            "its prompt's keys; this model has none (TransformerEngine's?). Set model.attention_backend=local, or "
            "plan without shared_prefix."
        )
    from megatron.core.utils import get_model_config

    if is_moe(get_model_config(chunks[0])):
        raise ValueError("a shared-prefix plan runs dense models only for now; plan an MoE model without it.")
    embedding = {m.position_embedding_type for m in modules if hasattr(m, "position_embedding_type")}
    if embedding - {"rope", "none"}:
        raise ValueError(
            f"a shared-prefix plan needs RoPE (or no position embedding); this model has {sorted(embedding)}. Plan "
            "without shared_prefix."
        )
    if loss is not None and loss.token_weights is not None:
        raise ValueError(
            f"{type(loss).__name__} weights the packed row's tokens, where a shared prompt's targets appear once; a "
            "shared-prefix plan needs a loss on each sample's own log-probs (PerSample, PerGroup, PerSequence, the "
            "policy losses)."
        )


def _is_dynamic_cp(plan) -> bool:
    """Whether ``plan`` is a dynamic-CP plan (`planning.dynamic_cp.DynamicCPPlan`) rather than a `StepPlan`."""
    return isinstance(plan, DynamicCPPlan)


def _check_step(model, samples: Sequence[SequenceSample], plan: StepPlan):
    """The samples are the planned ones and the model's config can run the plan; returns that config."""
    from megatron.core.utils import get_model_config

    _check_samples(samples, plan)
    model_config = get_model_config(model[0] if isinstance(model, list) else model)
    _check_schedule_config(plan, model_config, len(model) if isinstance(model, list) else 1)
    return model_config


def _check_samples(samples: Sequence[SequenceSample], plan: StepPlan) -> None:
    """The samples' lengths are the plan's. A sequence that reads its samples on access and knows their
    lengths (a ``lengths`` attribute: a prepared store's) is checked against those, so nothing is read
    here and each rank reads only its own micro-batches' samples."""
    if len(samples) != len(plan.lengths):
        raise ValueError(
            f"the plan covers {len(plan.lengths)} samples but {len(samples)} were given; plan the same global batch."
        )
    known = getattr(samples, "lengths", None)
    lengths = (len(s.tokens) for s in samples) if known is None else (int(n) for n in known)
    for i, (have, n) in enumerate(zip(lengths, plan.lengths, strict=True)):
        if have != n:
            raise ValueError(f"sample {i} has {have} tokens but the plan says {n}.")


def _check_schedule_config(plan: StepPlan, model_config, num_chunks: int = 1) -> None:
    config = plan.config
    layout = config.layout
    if num_chunks != layout.vpp:
        raise ValueError(
            f"the plan was made for vpp={layout.vpp} model chunks per stage but the model has {num_chunks}; plan "
            "with the model's layout (ParallelLayout(vpp=...)), or build the model with build_gpt_chunks for it."
        )
    if layout.vpp > 1 and plan.num_microbatches:
        check_interleaved_count(plan.num_microbatches, layout.pp, layout.microbatch_group)
    if config.layout.pp > 1 and not getattr(model_config, "variable_seq_lengths", False):
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


def _check_head(model, *, uses_labels: bool) -> None:
    """A reward model (`reward_head`, no vocabulary) runs only losses over its values, and a language model
    only losses over its labels' log-probs (the head is recorded on the config, which every pipeline stage
    has, so every rank decides alike)."""
    from megatron.core.utils import get_model_config

    reward = getattr(get_model_config(model[0] if isinstance(model, list) else model), "mcore_packing_head",
                     "lm") == "reward"  # fmt: skip
    if reward and uses_labels:
        raise ValueError("this model is a reward model (head='reward': one score per token, no vocabulary); it has "
                         "no log-probs. Score it with a PerSequenceValues loss (rl.rm_step, rl.pair_rewards).")
    if not reward and not uses_labels:
        raise ValueError("this loss reads a reward model's scores (uses_labels=False), but the model ends in the "
                         "vocabulary: build it with build_policy(..., head='reward').")


def _check_loss(loss, plan: StepPlan) -> None:
    """A `StepLoss` object; a per-group loss needs the plan's groups (a group shares a micro-batch)."""
    if not isinstance(loss, StepLoss):
        raise TypeError(
            f"loss={loss!r} is not a StepLoss; pass TokenMeanNLL(), SequenceMeanNLL(), PerSequence(fn), "
            "PerSample(fn, normalization) or PerGroup(fn) from mcore_packing.megatron."
        )
    if loss.needs_plan_groups and plan.groups is None:
        raise ValueError(
            f"{type(loss).__name__} averages over the plan's groups, but the plan has none; call "
            "plan_step(lengths, config, groups=ids) with one group id per sample."
        )


def _device(device) -> torch.device:
    if device is not None:
        return torch.device(device)
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
