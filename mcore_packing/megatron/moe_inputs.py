"""What a Mixture-of-Experts model chunk gets with each micro-batch, for both step drivers (`schedule`
and `dynamic_cp`): the padding mask its routers keep pads out of their statistics with, its `RouterLoss`'s
share of the micro-batch's segments, and its `RouterReplay`'s share of the routes, each in the order this
stage's routers see the tokens.

    extra = begin_moe_micro_batch(prep, model_chunk, process_groups)   # before the chunk's forward
    output = model_chunk(tokens, positions, None, ..., **extra)

Under dynamic CP the router loss's counts are summed over the row's groups (``reduce_groups``: TP, then
the row's CP sub-group) instead of the run's static TP x CP group.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from .process_groups import ProcessGroups, group_rank
from .router_loss import attached_router_loss
from .router_replay import attached_router_replay

__all__ = ["begin_moe_micro_batch", "is_moe", "replayed_routes_cleared", "router_losses"]


def is_moe(model_config) -> bool:
    """Whether the model has Mixture-of-Experts layers (their routers take the micro-batch's padding mask)."""
    return bool(getattr(model_config, "num_moe_experts", None))


def router_losses(model) -> list:
    """The `RouterLoss` of every chunk of ``model`` that has one."""
    chunks = model if isinstance(model, list) else [model]
    return [loss for loss in (attached_router_loss(chunk) for chunk in chunks) if loss is not None]


@contextmanager
def replayed_routes_cleared(model):
    """Around one run of the schedule: afterwards no router of ``model`` keeps the last micro-batch's routes
    (a forward outside a step routes afresh)."""
    try:
        yield
    finally:
        for chunk in model if isinstance(model, list) else [model]:
            replay = attached_router_replay(chunk)
            if replay is not None:
                replay.end_step()


def begin_moe_micro_batch(prep, model_chunk, process_groups: ProcessGroups, *, reduce_groups=None) -> dict:
    """Hand the chunk's router loss and router replay this micro-batch's shares; returns the forward's
    extra keyword arguments (``padding_mask`` for an MoE micro-batch, none for a dense one)."""
    mask = _router_padding_mask(prep, model_chunk, process_groups)
    router_loss = attached_router_loss(model_chunk)
    if router_loss is not None and prep.segments is not None:
        router_loss.begin_micro_batch(_router_order(prep.segments, model_chunk, process_groups),
                                      prep.sequence_lengths, reduce_groups=reduce_groups)  # fmt: skip
    _replay_routes(prep, model_chunk, process_groups)
    return {} if mask is None else {"padding_mask": mask}


def _router_padding_mask(prep, model_chunk, process_groups: ProcessGroups):
    """The padding mask an MoE model chunk's routers get (None when the micro-batch has none: a dense
    model): the first pipeline stage takes it whole (Megatron splits it over sequence-parallel ranks
    there); a later stage under sequence parallelism gets this TP rank's share, which Megatron does not
    cut for it."""
    mask = prep.padding_mask
    if mask is None:
        return None
    first_stage = getattr(getattr(model_chunk, "module", model_chunk), "pre_process", True)
    if _sequence_parallel(model_chunk) and not first_stage:
        mask = _tp_rank_share(mask, process_groups)
    return mask


def _router_order(tensor: torch.Tensor, model_chunk, process_groups: ProcessGroups) -> torch.Tensor:
    """A per-token ``[batch, seq, ...]`` tensor of the micro-batch (segments, routes) in the order this
    stage's routers see the tokens: ``[seq, batch]`` flattened, this TP rank's sequence slice under
    sequence parallelism (every stage)."""
    if _sequence_parallel(model_chunk):
        tensor = _tp_rank_share(tensor, process_groups)
    return tensor.transpose(0, 1).reshape(-1, *tensor.shape[2:])


def _replay_routes(prep, model_chunk, process_groups: ProcessGroups) -> None:
    """Hand the chunk's `router_replay.RouterReplay` this micro-batch's routes (None: route afresh); routes
    on a model without one are refused rather than ignored."""
    replay = attached_router_replay(model_chunk)
    if replay is None:
        if prep.routes is not None:
            raise ValueError("the samples carry routed_experts but the model replays no routes: call "
                             "install_router_replay(model) (megatron.router_replay), or drop the samples' routes.")
        return
    replay.begin_micro_batch(None if prep.routes is None else _router_order(prep.routes, model_chunk, process_groups))


def _sequence_parallel(model_chunk) -> bool:
    return bool(getattr(getattr(model_chunk, "config", None), "sequence_parallel", False))


def _tp_rank_share(tensor: torch.Tensor, process_groups: ProcessGroups) -> torch.Tensor:
    """This TP rank's slice of a ``[batch, seq]`` tensor along the sequence (sequence parallelism)."""
    width = tensor.shape[1] // process_groups.tp_size
    rank = group_rank(process_groups.tp)
    return tensor[:, rank * width : (rank + 1) * width]
