"""`Policy`: what a step needs of a model, as one handle, and `build_policy`, the one builder of a
trainable policy and of its frozen reference.

    initialize_parallel(layout, seed=seed)                        # Megatron's parallel state, once
    policy = build_policy(shape, layout, seed=seed, hf_path=path, optimizer=make_optimizer)
    reference = build_policy(shape, layout, seed=seed, hf_path=path,      # same weights, no optimizer,
                             process_groups=policy.process_groups)          # the policy's groups
    train_step(policy, samples, plan, loss=TokenMeanNLL())

``make_optimizer(model) -> (optimizer, scheduler)`` is the caller's (the trainer builds Megatron's
optimizer and LR schedule from its ``optimizer`` config, `optimizer.build_optimizer`); without it the
model is put in eval mode and the policy has no optimizer (a reference or an evaluation model).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..planning.layout import ParallelLayout
from ..planning.model_shape import ModelShape
from .process_groups import ProcessGroups

__all__ = ["Policy", "build_policy"]


@dataclass
class Policy:
    """A Megatron model and what steps it: the (DDP-wrapped) model chunk (under a virtual pipeline,
    ``layout.vpp > 1``, the list of this stage's chunks), Megatron's optimizer and
    ``OptimizerParamScheduler`` (None for a frozen model), its process groups and its device. ``info``
    holds what the build did (``tensors_read`` from a Hugging Face folder)."""

    model: object
    optimizer: object | None
    scheduler: object | None
    process_groups: ProcessGroups
    device: torch.device
    info: dict = field(default_factory=dict)

    @property
    def chunks(self) -> list:
        """This stage's model chunks as a list (one without a virtual pipeline)."""
        return self.model if isinstance(self.model, list) else [self.model]


def build_policy(
    shape: ModelShape,
    layout: ParallelLayout,
    *,
    device: torch.device,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    attention_backend: str = "auto",
    variable_seq_lengths: bool = False,
    hf_path: str | None = None,
    optimizer: Callable | None = None,
    use_distributed_optimizer: bool = False,
    grad_reduce_in_fp32: bool = False,
    dynamic_cp: bool = False,
    process_groups: ProcessGroups | None = None,
    head: str = "lm",
    logprob_chunk_size: int | None = None,
    recompute: str | None = None,
    router_replay: bool = False,
) -> Policy:
    """The GPTModel of ``shape`` on ``layout`` (Megatron's parallel state initialized for it) with the
    weights of ``hf_path`` (this rank's slices), else the seeded initialization (`seeded_init`: a
    function of ``seed`` and the shape only, so a reference built with the same seed starts from the
    policy's weights on any layout and device); with ``optimizer`` its
    optimizer and schedule, else frozen in eval mode. ``dynamic_cp``: the process groups also carry the
    CP sub-groups dynamic context parallelism runs its rows on (`ProcessGroups.with_dynamic_cp`; a
    collective, every rank builds the policy). ``process_groups``: the groups of a policy built before on
    the same layout (a reference passes its policy's): reused, dynamic-CP sub-groups included, so a run
    makes one set of communicators. ``head="reward"``: a reward model (`reward_head`; from ``hf_path``
    its ``score.weight`` when the folder has one, else the seeded head on the checkpoint's body).
    ``logprob_chunk_size``: the output layer and the loss that many tokens at a time in every pass
    (`chunked_logprobs.chunk_logprobs`; None: whole logits). ``recompute``: Megatron's recompute_granularity
    (None, "selective", "full": `model.transformer_config`). ``router_replay``: an MoE model routes each
    token to the experts its sample's ``routed_experts`` name (`router_replay.install_router_replay`)."""
    from .chunked_logprobs import chunk_logprobs
    from .hf_weights import load_hf_weights
    from .model import build_gpt_chunks
    from .process_groups import group_rank

    if process_groups is None:
        process_groups = ProcessGroups.from_megatron()
        if dynamic_cp:
            process_groups = process_groups.with_dynamic_cp(layout.cp)
    elif dynamic_cp and process_groups.dynamic_cp is None:
        raise ValueError("dynamic_cp=True but the given process_groups have no dynamic-CP sub-groups; pass the "
                         "policy's (build_policy(..., dynamic_cp=True)) or none.")  # fmt: skip
    chunks, _ = build_gpt_chunks(
        shape,
        layout,
        variable_seq_lengths=variable_seq_lengths,
        dtype=dtype,
        attention_backend=attention_backend,
        seed=seed,
        device=device,
        use_distributed_optimizer=use_distributed_optimizer and optimizer is not None,
        grad_reduce_in_fp32=grad_reduce_in_fp32 and optimizer is not None,
        process_groups=process_groups,
        init="none" if hf_path is not None else "seeded",  # a checkpoint sets every parameter
        head=head,
        recompute=recompute,
    )
    model = chunks[0] if len(chunks) == 1 else chunks
    info = {}
    if hf_path is not None:
        ranks = dict(tp_rank=group_rank(process_groups.tp), tp_size=layout.tp, ep_rank=group_rank(process_groups.ep),
                     ep_size=layout.ep, etp_rank=group_rank(process_groups.expert_tp),
                     etp_size=layout.expert_tp)  # fmt: skip
        info["tensors_read"] = sum(load_hf_weights(chunk, shape, hf_path, **ranks)["tensors_read"] for chunk in chunks)
    if logprob_chunk_size is not None:
        chunk_logprobs(model, logprob_chunk_size)
    if router_replay:
        if not shape.is_moe:
            raise ValueError("router_replay=True replays the experts of an MoE model; this shape is dense.")
        from .router_replay import install_router_replay

        install_router_replay(model)
    built, scheduler = (None, None) if optimizer is None else optimizer(model)
    if optimizer is None:
        for chunk in chunks:
            chunk.eval()
    return Policy(model=model, optimizer=built, scheduler=scheduler, process_groups=process_groups,
                  device=torch.device(device), info=info)  # fmt: skip
