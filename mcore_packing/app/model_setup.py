"""Setting up a run: torch.distributed, Megatron's parallel state, the model, Megatron's optimizer and
its learning-rate schedule.

`setup_training` is the one place the trainer builds these, so changing the optimizer (or how the model
is made) touches only this module; `build_model` maps the config onto `megatron.build_policy`, the one
builder of the policy and of the GRPO reference.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import partial

from ..planning import ModelShape
from .config import TrainConfig

__all__ = ["TrainingSetup", "build_model", "default_device", "device_context", "init_distributed", "setup_training"]


@dataclass
class TrainingSetup:
    """What a training loop needs: the `megatron.Policy` (model, Megatron's optimizer and LR schedule,
    process groups, device), this rank, the world size and the model's shape."""

    policy: object
    rank: int
    world_size: int
    shape: ModelShape


def init_distributed(backend: str = "auto") -> None:
    """Start torch.distributed (a world of one for a plain ``python -m``; torchrun's env otherwise)."""
    import torch
    import torch.distributed as dist

    from ..megatron import start_world_of_one

    if dist.is_initialized():
        return
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    launched = "RANK" in os.environ
    if not launched:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    if launched:
        dist.init_process_group(backend)
    else:
        start_world_of_one(backend)


def default_device():
    """This rank's CUDA device when there is one (after `init_distributed` set it), else the CPU."""
    import torch

    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def device_context(device):
    """The context Megatron code runs in: the CPU device adapter on a CPU, nothing on a GPU."""
    import contextlib

    from ..megatron import cpu_device_adapter

    return cpu_device_adapter(device=device) if device.type == "cpu" else contextlib.nullcontext()


def setup_training(cfg: TrainConfig, shape: ModelShape) -> TrainingSetup:
    """Distributed start, parallel groups, the policy of ``shape`` (with the weights of ``model.hf_path``
    when set), Megatron's optimizer and LR schedule (``cfg.optimizer``). Call inside `device_context`."""
    import torch.distributed as dist

    from ..megatron import initialize_parallel

    init_distributed(cfg.cluster.backend)
    layout = cfg.parallel.layout(dist.get_world_size())
    initialize_parallel(layout, seed=cfg.training.seed)
    policy = build_model(cfg, shape, layout, optimizer=partial(_optimizer_and_scheduler, cfg))
    if cfg.model.hf_path is not None and dist.get_rank() == 0:
        print(f"[rank 0] loaded {policy.info['tensors_read']} tensors from {cfg.model.hf_path}", flush=True)
    return TrainingSetup(policy=policy, rank=dist.get_rank(), world_size=dist.get_world_size(), shape=shape)


def build_model(cfg: TrainConfig, shape: ModelShape, layout, *, optimizer=None, process_groups=None):
    """`megatron.build_policy` with this config's model, parallel and optimizer keys: the policy (with
    ``optimizer``) or its frozen reference (the same starting weights: ``model.hf_path``, else the same
    seeded initialization; ``process_groups``: the policy's, so the reference makes no communicators)."""
    import torch

    from ..megatron import build_policy
    from .algorithms import get_algorithm

    dtype = getattr(torch, cfg.model.dtype)  # float32 | bfloat16 | float16
    return build_policy(
        shape,
        layout,
        device=default_device(),
        seed=cfg.training.seed,
        dtype=dtype,
        attention_backend=cfg.model.attention_backend,
        variable_seq_lengths=cfg.parallel.variable_seq_lengths,
        hf_path=cfg.model.hf_path,
        optimizer=optimizer,
        use_distributed_optimizer=cfg.optimizer.use_distributed_optimizer,
        grad_reduce_in_fp32=cfg.optimizer.grad_reduce_in_fp32 and dtype != torch.float32,
        dynamic_cp=cfg.context_parallel.dynamic,
        process_groups=process_groups,
        head=getattr(get_algorithm(cfg.algorithm), "HEAD", "lm"),
        logprob_chunk_size=cfg.model.logprob_chunk_size,
        recompute=cfg.model.recompute_granularity,
        router_replay=cfg.algorithm == "grpo" and cfg.grpo.router_replay,
    )


def _optimizer_and_scheduler(cfg: TrainConfig, model):
    """Megatron's optimizer from ``cfg.optimizer`` (the keys `build_optimizer` takes, by name) and its
    LR schedule."""
    import inspect
    from dataclasses import asdict

    import torch

    from ..megatron.optimizer import build_optimizer, build_scheduler

    opt = cfg.optimizer
    takes = inspect.signature(build_optimizer).parameters
    dtype = getattr(torch, cfg.model.dtype)
    optimizer = build_optimizer(model, dtype=dtype, **{k: v for k, v in asdict(opt).items() if k in takes})
    scheduler = build_scheduler(
        optimizer,
        lr=opt.lr,
        min_lr=opt.min_lr,
        lr_warmup_init=opt.lr_warmup_init,
        lr_warmup_iters=opt.lr_warmup_iters,
        lr_decay_iters=opt.decay_iters(cfg.optimizer_steps),
        lr_decay_style=opt.lr_decay_style,
        weight_decay=opt.weight_decay,
    )
    return optimizer, scheduler
