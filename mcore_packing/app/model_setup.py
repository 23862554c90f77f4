"""Setting up a run: torch.distributed, Megatron's parallel state, the model, Megatron's optimizer and
its learning-rate schedule.

`setup_training` is the one place the trainer builds these, so changing the optimizer (or how the model
is made) touches only this module.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

from ..planning import ModelShape
from .config import TrainConfig

__all__ = ["TrainingSetup", "default_device", "device_context", "init_distributed", "setup_training"]


@dataclass
class TrainingSetup:
    """What a training loop needs: the (Megatron DDP-wrapped) model, Megatron's optimizer and
    ``OptimizerParamScheduler``, the process groups and the device."""

    model: object
    optimizer: object
    scheduler: object
    groups: object
    device: object
    rank: int
    world_size: int
    shape: ModelShape


def init_distributed(backend: str = "auto") -> None:
    """Start torch.distributed (a world of one for a plain ``python -m``; torchrun's env otherwise)."""
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        return
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if "RANK" not in os.environ:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def default_device():
    """This rank's CUDA device when there is one (after `init_distributed` set it), else the CPU."""
    import torch

    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def device_context(device):
    """The context Megatron code runs in: the CPU device adapter on a CPU, nothing on a GPU."""
    import contextlib

    from ..megatron import cpu_device_adapter

    return cpu_device_adapter() if device.type == "cpu" else contextlib.nullcontext()


def setup_training(cfg: TrainConfig, shape: ModelShape) -> TrainingSetup:
    """Distributed start, parallel groups, the GPTModel of ``shape`` (with the weights of
    ``model.hf_path`` when set), Megatron's optimizer and LR schedule (``cfg.optimizer``). Call inside
    `device_context`."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from ..megatron import ParallelGroups, build_gpt_model, initialize_parallel
    from ..megatron.hf_weights import load_hf_weights

    par, opt = cfg.parallel, cfg.optimizer
    dtype = getattr(torch, cfg.model.dtype)  # float32 | bfloat16 | float16
    init_distributed(cfg.cluster.backend)
    initialize_parallel(tp=par.tp, pp=par.pp, cp=par.cp, seed=cfg.training.seed)
    device = default_device()
    model, _ = build_gpt_model(
        shape,
        tp=par.tp,
        pp=par.pp,
        cp=par.cp,
        sequence_parallel=par.sequence_parallel,
        variable_seq_lengths=par.variable_seq_lengths,
        dtype=dtype,
        attention_backend=cfg.model.attention_backend,
        seed=cfg.training.seed,
        device=device,
        use_distributed_optimizer=opt.use_distributed_optimizer,
        grad_reduce_in_fp32=opt.grad_reduce_in_fp32 and dtype != torch.float32,
    )
    if cfg.model.hf_path is not None:
        stats = load_hf_weights(
            model, shape, cfg.model.hf_path, tp_rank=ps.get_tensor_model_parallel_rank(), tp_size=par.tp
        )
        if dist.get_rank() == 0:
            print(f"[rank 0] loaded {stats['tensors_read']} tensors from {cfg.model.hf_path}", flush=True)
    optimizer, scheduler = _optimizer_and_scheduler(cfg, model, dtype)
    return TrainingSetup(
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        groups=ParallelGroups.from_megatron(),
        device=device,
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        shape=shape,
    )


def _optimizer_and_scheduler(cfg: TrainConfig, model, dtype):
    """Megatron's optimizer from ``cfg.optimizer`` (the keys `build_optimizer` takes, by name) and its
    LR schedule."""
    import inspect
    from dataclasses import asdict

    from ..megatron.optimizer import build_optimizer, build_scheduler

    opt = cfg.optimizer
    takes = inspect.signature(build_optimizer).parameters
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
