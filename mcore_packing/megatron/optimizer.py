"""Megatron-Core's optimizer and learning-rate schedule for a model built by `build_gpt_model`.

`build_optimizer` calls ``get_megatron_optimizer`` with an ``OptimizerConfig``: Adam (decoupled weight
decay, as AdamW) or SGD, gradient clipping by the global norm, fp32 master weights for bf16/fp16
parameters, dynamic loss scaling for fp16, and the distributed optimizer (optimizer state sharded over
the data-parallel ranks) when the model's DDP buffers were laid out for it. `build_scheduler` makes
Megatron's ``OptimizerParamScheduler`` (linear warmup, then constant / linear / cosine /
inverse-square-root decay to ``min_lr``), stepped once per training step.

On a CPU Megatron's optimizer checks parameter types by their CUDA type strings and allocates a few
scalars on CUDA; `cpu_device_adapter` redirects exactly those call sites (see its docstring).
"""

from __future__ import annotations

import torch

__all__ = ["build_optimizer", "build_scheduler"]


def build_optimizer(
    model,
    *,
    optimizer: str = "adam",
    lr: float,
    min_lr: float = 0.0,
    weight_decay: float = 0.0,
    adam_beta1: float = 0.9,
    adam_beta2: float = 0.999,
    adam_eps: float = 1e-8,
    sgd_momentum: float = 0.9,
    clip_grad: float = 0.0,
    use_distributed_optimizer: bool = False,
    dtype: torch.dtype = torch.float32,
    initial_loss_scale: float = 2.0**32,
    min_loss_scale: float = 1.0,
    loss_scale_window: int = 1000,
    hysteresis: int = 2,
):
    """Megatron's optimizer over the model chunk(s) ``model`` (Megatron DDP-wrapped).

    ``dtype`` is the parameters' dtype: bf16 and fp16 train on fp32 master copies; fp16 also scales the
    loss dynamically (the schedule multiplies each micro-batch's loss by ``optimizer.scale_loss``).
    ``clip_grad`` 0 turns clipping off.
    """
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    config = OptimizerConfig(
        optimizer=optimizer,
        lr=lr,
        min_lr=min_lr,
        weight_decay=weight_decay,
        adam_beta1=adam_beta1,
        adam_beta2=adam_beta2,
        adam_eps=adam_eps,
        sgd_momentum=sgd_momentum,
        clip_grad=clip_grad,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        params_dtype=dtype,
        initial_loss_scale=initial_loss_scale,
        min_loss_scale=min_loss_scale,
        loss_scale_window=loss_scale_window,
        hysteresis=hysteresis,
        use_distributed_optimizer=use_distributed_optimizer,
    )
    chunks = model if isinstance(model, list) else [model]
    megatron_optimizer = get_megatron_optimizer(config, chunks)
    for chunk in chunks:
        chunk.config.grad_scale_func = megatron_optimizer.scale_loss if dtype == torch.float16 else None
    return megatron_optimizer


def build_scheduler(
    optimizer,
    *,
    lr: float,
    min_lr: float,
    lr_warmup_init: float = 0.0,
    lr_warmup_iters: int = 0,
    lr_decay_iters: int,
    lr_decay_style: str = "cosine",
    weight_decay: float = 0.0,
):
    """Megatron's ``OptimizerParamScheduler`` in units of training steps (call ``step(1)`` after each).

    The learning rate of step ``k`` (1-based) is the schedule at ``k - 1``: warmup rises linearly from
    ``lr_warmup_init`` over ``lr_warmup_iters`` steps, then decays to ``min_lr`` at ``lr_decay_iters``.
    """
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    return OptimizerParamScheduler(
        optimizer,
        init_lr=lr_warmup_init,
        max_lr=lr,
        min_lr=min_lr,
        lr_warmup_steps=lr_warmup_iters,
        lr_decay_steps=lr_decay_iters,
        lr_decay_style=lr_decay_style,
        start_wd=weight_decay,
        end_wd=weight_decay,
        wd_incr_steps=lr_decay_iters,
        wd_incr_style="constant",
    )
