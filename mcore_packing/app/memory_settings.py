"""The memory model's settings (`planning.memory.MemorySettings`) of a training config, and the plan's
memory report: each pipeline stage's predicted peak at the run's token budget, and the largest budget
whose plans stay under ``memory_budget``. No torch: `plan` runs on a login node.
"""

from __future__ import annotations

import dataclasses
import sys

from ..planning.memory import MemorySettings, check_covered
from ..planning.memory_budget import MemoryModel, largest_fitting_budget, plan_memory

__all__ = ["memory_model", "memory_report", "memory_settings", "run_device"]

SEARCH_BATCHES = 16  # the first global batches the budget search plans (each candidate plans them all)


def run_device(cfg) -> str:
    """The device ``cfg``'s run trains on: cluster.backend nccl -> cuda, gloo -> cpu; auto -> cuda when
    this process has torch loaded and a GPU (the trainer), and cuda when torch is not loaded (`plan` on a
    login node plans for the GPUs it does not have)."""
    if cfg.cluster.backend != "auto":
        return "cuda" if cfg.cluster.backend == "nccl" else "cpu"
    torch = sys.modules.get("torch")
    return "cuda" if torch is None or torch.cuda.is_available() else "cpu"


def memory_settings(cfg, *, device: str = "cuda") -> MemorySettings:
    """How ``cfg``'s run holds its tensors on ``device`` (cuda: the attention kernel of
    ``model.attention_backend``, flash for the built-in one, TE's fused otherwise; cpu: SDPA's math path)."""
    dtype_bytes = 4 if cfg.model.dtype == "float32" else 2
    grad_bytes = 4 if cfg.optimizer.grad_reduce_in_fp32 or dtype_bytes == 4 else dtype_bytes
    attention = "sdpa-math" if device == "cpu" else ("flash" if cfg.model.attention_backend == "local" else "te-fused")
    loss = cfg.loss_fn
    entropy = cfg.algorithm == "grpo" and (loss.entropy_coeff > 0 or loss.calculate_entropy)
    return MemorySettings(dtype_bytes=dtype_bytes, grad_bytes=grad_bytes, optimizer=cfg.optimizer.optimizer,
                          distributed_optimizer=cfg.optimizer.use_distributed_optimizer, attention=attention,
                          logprob_chunk_size=cfg.model.logprob_chunk_size, entropy=entropy,
                          recompute=cfg.model.recompute_granularity or "none")  # fmt: skip


def memory_model(cfg, shape, layout) -> MemoryModel | None:
    """The `MemoryModel` a run with a ``memory_budget`` plans with (None without one); a ValueError naming
    the key when the memory model does not cover the shape on this layout."""
    section = "sequence_packing" if cfg.sequence_packing.enabled else "dynamic_batching"
    if getattr(cfg, section).memory_budget is None:
        return None
    try:
        check_covered(shape, layout)
    except ValueError as exc:
        raise ValueError(f"{section}.memory_budget: {exc} Unset the budget to train this model.") from None
    return MemoryModel(shape, memory_settings(cfg, device=run_device(cfg)))


def memory_report(batches, config, shape, settings: MemorySettings, *, plan=None) -> dict:
    """For the first `SEARCH_BATCHES` of ``batches`` (lengths arrays): ``budget``, ``train_mb_tokens``,
    ``settings`` and ``stages`` (each stage's peak in bytes at ``config``'s token budget, the worst over the
    batches); with ``config.memory_budget`` also ``largest_train_mb_tokens``, ``largest_stages`` (its
    peaks) and ``whole_batch_fits`` (the search reached a whole batch's tokens)."""
    from ..planning import plan_step

    plan = plan or (lambda lengths, cfg: plan_step(lengths, cfg))
    batches = list(batches)[:SEARCH_BATCHES]
    config = dataclasses.replace(config, memory_model=None)  # the peaks at the run's token budget as it is
    stages = [plan_memory(plan(b, config), shape, settings) for b in batches]
    worst = [max((s[k] for s in stages), key=lambda d: d["peak"]) for k in range(config.layout.pp)]
    report = {"budget": config.memory_budget, "train_mb_tokens": config.train_mb_tokens, "stages": worst,
              "settings": dataclasses.asdict(settings)}  # fmt: skip
    if config.memory_budget is not None:
        fit = largest_fitting_budget(batches, config, shape, settings, config.memory_budget, plan=plan)
        report.update(largest_train_mb_tokens=fit["train_mb_tokens"], largest_stages=fit["stages"],
                      whole_batch_fits=fit["whole_batch"])  # fmt: skip
    return report
