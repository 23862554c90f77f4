"""`MetricsLogger`: one record per step to the console, ``metrics.jsonl`` and (optionally) TensorBoard.

Each record has the loss, the learning rate, the gradient norm (before clipping), tokens/s, useful vs
computed tokens, micro-batches per rank, the rank balance of tokens and of attention-aware cost, and the
step time next to the time a cost model calibrated on the earlier steps predicted for it; a GRPO step
adds the mean reward, clip fraction, approximate KL (old vs new policy), KL to the reference, mean ratio,
entropy estimate and the seconds of its log-prob and training passes (``step_time_s`` is the training
pass); a Mixture-of-Experts model adds the expert load (`megatron.expert_load`) and, when it trains with
them, the balance and z-losses (`megatron.router_loss`). Only rank 0 writes.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path

from ..planning import CostModel, StepPlan
from .config import ConfigError, TrainConfig

__all__ = ["MetricsLogger"]

log = logging.getLogger("mcore_packing.train")

_TENSORBOARD_KEYS = (
    "loss",
    "expert_load_max_over_mean",
    "expert_load_mean_max_over_mean",
    "moe_balance_loss",
    "moe_z_loss",
    "lr",
    "grad_norm",
    "tokens_per_s",
    "utilization",
    "microbatches_per_rank",
    "rank_cost_max_over_mean",
    "predicted_step_time_s",
    "step_time_s",
    # GRPO (algorithm=grpo)
    "mean_reward",
    "clip_fraction",
    "approx_kl",
    "reference_kl",
    "mean_ratio",
    "entropy_estimate",
    "logprob_pass_s",
)


class MetricsLogger:
    """Per-step metrics of one run (see the module docstring)."""

    def __init__(self, cfg: TrainConfig, rank: int, *, start_step: int = 0, memory=None):
        self.enabled = rank == 0
        self.memory = memory  # the plan's `MemoryModel` (a memory budget): each step's predicted peak per stage
        self.total_steps = cfg.training.steps
        self.log_interval = cfg.logging.log_interval
        self.path = Path(cfg.run_dir) / cfg.logging.metrics_file
        self.history: list[tuple[list[int], float, int]] = []  # (slowest rank's lengths, seconds, micro-batches)
        self.writer = _tensorboard(Path(cfg.run_dir)) if cfg.logging.tensorboard and self.enabled else None
        self.progress = _Progress(self.total_steps, cfg.logging.progress_bar and self.enabled)
        if self.enabled:
            _set_aside_rows_after(self.path, start_step)

    def log_step(self, step: int, plan: StepPlan, outcome, batch_ids: list[int], extra: dict | None = None) -> dict:
        """Build the step's record (on every rank; ``extra``: the algorithm's own metrics) and write it
        (rank 0)."""
        stats = plan.stats()
        shared = stats.get("shared_prefix")  # the samples' tokens, not the fewer a shared prompt computes
        useful = shared["separate_tokens"] if shared is not None else stats["real_tokens"]
        slowest = max(plan.micro_batches, key=lambda rank: sum(mb.cost for mb in rank))
        slowest_lengths = [plan.lengths[i] for mb in slowest for i in mb.sample_indices]
        predicted = _predict_seconds(self.history, slowest_lengths, len(slowest))
        self.history.append((slowest_lengths, outcome.seconds, len(slowest)))
        record = {
            "step": step,
            "loss": outcome.result.loss,
            "lr": outcome.lr,
            "grad_norm": outcome.grad_norm,
            "update_applied": outcome.updated,
            "tokens_per_s": useful / outcome.seconds,
            "useful_tokens": useful,
            "padded_tokens": stats["padded_tokens"],
            "utilization": stats["utilization"],
            "microbatches_per_rank": stats["num_microbatches_per_rank"],
            "rank_tokens_max_over_mean": stats["rank_tokens_max_over_mean"],
            "rank_cost_max_over_mean": stats["rank_cost_max_over_mean"],
            "predicted_step_time_s": predicted,
            "step_time_s": outcome.seconds,
            "sample_ids": batch_ids,
            **({"cp_sizes": stats["cp_sizes"]} if "cp_sizes" in stats else {}),  # dynamic CP: sequences per size
            **({"shared_prefix": shared} if shared is not None else {}),  # tokens and predicted cost saved
            **self._memory(plan),
            **(extra or {}),
        }
        if self.enabled:
            self._write(record)
        return record

    def _memory(self, plan) -> dict:
        """With a memory budget: the step's predicted peak per pipeline stage (`planning.memory_budget`) and,
        on a GPU, the allocator's measured peak since the last step."""
        if self.memory is None or not isinstance(plan, StepPlan):
            return {}
        from ..planning.memory_budget import plan_memory

        stages = plan_memory(plan, self.memory.shape, self.memory.settings)
        out = {"predicted_peak_bytes": [int(s["peak"]) for s in stages]}
        import torch

        if torch.cuda.is_available():
            out["measured_peak_bytes"] = int(torch.cuda.max_memory_allocated())
            torch.cuda.reset_peak_memory_stats()
        return out

    def _write(self, record: dict) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        step = record["step"]
        if step % self.log_interval == 0:
            log.info("step %d/%d loss %s", step, self.total_steps, _console_text(record))
        if self.writer is not None:
            for key in _TENSORBOARD_KEYS:
                if record.get(key) is not None:
                    self.writer.add_scalar(f"train/{key}", record[key], step)
        self.progress.update(step, f"loss {record['loss']:.3f}")

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def _set_aside_rows_after(path: Path, step: int) -> None:
    """A run that continues at ``step`` (a resume, or a requeued job that had not saved) runs the steps
    after it again: their earlier records move to ``<name>.superseded.jsonl`` (kept, never deleted), so
    the metrics file has each step once."""
    if not path.is_file():
        return
    keep, later = [], []
    for line in path.read_text().splitlines():
        if line.strip():
            (later if json.loads(line)["step"] > step else keep).append(line)
    if not later:
        return
    with path.with_name(f"{path.stem}.superseded.jsonl").open("a") as f:
        f.write("\n".join(later) + "\n")
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(line + "\n" for line in keep))
    tmp.replace(path)
    log.info("%s: %d records of steps after %d moved to %s (those steps run again)", path, len(later), step,
             path.with_name(f"{path.stem}.superseded.jsonl").name)


def _console_text(r: dict) -> str:
    text = f"{r['loss']:.4f} | lr {r['lr']:.3g}"
    if "mean_reward" in r:
        text += (f" | reward {r['mean_reward']:.3f} | clip {r['clip_fraction']:.3f} | kl to ref "
                 f"{r['reference_kl']:.2e} | entropy {r['entropy_estimate']:.3f} | log-prob pass "
                 f"{r['logprob_pass_s']:.2f}s")  # fmt: skip
    if r["grad_norm"] is not None:
        text += f" | grad norm {r['grad_norm']:.3f}"
    if "expert_load_max_over_mean" in r:
        text += f" | expert load max/mean {r['expert_load_max_over_mean']:.2f}"
    if "moe_balance_loss" in r:
        text += f" | balance loss {r['moe_balance_loss']:.4f}"
    if "moe_z_loss" in r:
        text += f" | z-loss {r['moe_z_loss']:.3f}"
    if r["predicted_step_time_s"] is not None:
        text += f" | step {r['step_time_s']:.2f}s (predicted {r['predicted_step_time_s']:.2f}s)"
    return (
        f"{text} | rank cost max/mean {r['rank_cost_max_over_mean']:.3f} | {r['tokens_per_s']:.0f} tok/s | useful "
        f"{r['useful_tokens']} / computed {r['padded_tokens']} tokens ({100 * r['utilization']:.1f}%) | "
        f"{r['microbatches_per_rank']} micro-batches/rank"
        + (" | sequences per CP size " + " ".join(f"{k}:{n}" for k, n in r["cp_sizes"].items()) if "cp_sizes" in r
           else "")
    )


def _tensorboard(run_dir: Path):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as exc:
        raise ConfigError("logging.tensorboard=true needs the tensorboard package: pip install tensorboard.") from exc
    return SummaryWriter(str(run_dir / "tensorboard"))


def _predict_seconds(history, lengths, microbatches: int) -> float | None:
    """Step time predicted by a cost model (per token, per squared length, per micro-batch) calibrated on
    the earlier steps (the first, a warm-up, is left out), once three of them exist; None before that."""
    if len(history) < 4:
        return None
    steps = history[1:]
    model = CostModel.calibrate([h[0] for h in steps], [h[1] for h in steps], [h[2] for h in steps])
    return float(model.sequence_cost(lengths).sum()) + model.per_microbatch * microbatches


class _Progress:
    """A one-line progress bar on a terminal (logs stay clean when stderr is not one)."""

    def __init__(self, total: int, enabled: bool):
        self.total, self.enabled, self.start = total, enabled and sys.stderr.isatty(), time.time()

    def update(self, step: int, text: str) -> None:
        if not self.enabled:
            return
        width = 30
        done = int(width * step / self.total)
        elapsed = time.time() - self.start
        sys.stderr.write(f"\r[{'#' * done}{'.' * (width - done)}] {step}/{self.total} {elapsed:5.0f}s {text}")
        sys.stderr.flush()
        if step == self.total:
            sys.stderr.write("\n")
