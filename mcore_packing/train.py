"""``python -m mcore_packing.train``: SFT of a GPT (real Megatron GPTModel) through the schedule driver.

A Hydra app over ``hydra_configs/`` (see `mcore_packing.config`). The default runs on a 2-core CPU in a
few minutes on real text with no download; ``torchrun --nproc_per_node N -m mcore_packing.train``
runs it multi-rank (gloo on CPU, NCCL on GPUs).

    python -m mcore_packing.train                                      # packed, tiny model, CHAMP
    python -m mcore_packing.train sequence_packing.enabled=false dynamic_batching.enabled=true
    torchrun --nproc_per_node 2 -m mcore_packing.train parallel.cp=2
    python -m mcore_packing.train resume=true training.steps=40         # continue at the next sample

Each step: the global batch's lengths are planned identically on every rank (`planning.plan_step`),
this rank's micro-batches run through Megatron's schedule (`schedule.run_step`), then AdamW steps.
Ranks other than 0 write no Hydra output; the run directory is deterministic (``run_dir``).
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np

from .config import (
    ConfigError,
    TrainConfig,
    check_unknown_keys,
    model_shape,
    register_configs,
    to_train_config,
    validate_config,
)
from .data.sft import load_sft_data

log = logging.getLogger("mcore_packing.train")

CONFIG_DIR = str(Path(__file__).resolve().parent.parent / "hydra_configs")


class GlobalBatchSampler:
    """Deterministic epochs of shuffled sample indices, cut into global batches; resumable exactly."""

    def __init__(self, num_samples: int, global_batch_size: int, seed: int):
        if global_batch_size > num_samples:
            raise ConfigError(
                f"training.global_batch_size={global_batch_size} is larger than the data set ({num_samples} "
                "samples). Lower it or load more samples (data.num_samples)."
            )
        self.num_samples = num_samples
        self.global_batch_size = global_batch_size
        self.seed = seed
        self.epoch = 0
        self.offset = 0

    def _order(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)

    def next_batch(self) -> list[int]:
        """The next global batch; an epoch's tail shorter than a batch is carried into the next epoch."""
        out: list[int] = []
        while len(out) < self.global_batch_size:
            order = self._order(self.epoch)
            take = order[self.offset : self.offset + self.global_batch_size - len(out)]
            out.extend(int(i) for i in take)
            self.offset += len(take)
            if self.offset >= self.num_samples:
                self.epoch += 1
                self.offset = 0
        return out

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "offset": self.offset, "seed": self.seed, "num_samples": self.num_samples}

    def load_state_dict(self, state: dict) -> None:
        if state["num_samples"] != self.num_samples or state["seed"] != self.seed:
            raise ConfigError(
                "The checkpoint was written for a different data set or seed (num_samples/seed differ); resume with "
                "the same data.* and training.seed, or start a new run_dir."
            )
        self.epoch, self.offset = state["epoch"], state["offset"]


def _init_distributed(cfg: TrainConfig):
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        return
    backend = cfg.cluster.backend
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if "RANK" not in os.environ:  # a plain `python -m`: a world of one
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cost_model(cfg: TrainConfig, vocab_size: int):
    from .cost import CostModel

    return CostModel.from_shape(**model_shape(cfg, vocab_size), gated_mlp=False)  # local spec: GELU MLP


def _plan_config(cfg: TrainConfig, dp: int, vocab_size: int | None = None):
    """The step planner's config for this run; its ValueErrors (an unknown algorithm, ...) become config
    errors (exit 2) that name the section."""
    try:
        return _build_plan_config(cfg, dp, vocab_size)
    except ValueError as exc:
        section = next(
            (name for name in ("sequence_packing", "dynamic_batching") if getattr(cfg, name).enabled), "training"
        )
        raise ConfigError(f"{section}: {exc}") from None


def _build_plan_config(cfg: TrainConfig, dp: int, vocab_size: int | None = None):
    from .planning import StepPlanConfig

    par = cfg.parallel
    common = dict(
        balance=cfg.training.balance,
        cost_model=_cost_model(cfg, vocab_size or cfg.data.vocab_size),
        dp_size=dp,
        tp_size=par.tp,
        pp_size=par.pp,
        cp_size=par.cp,
        sequence_parallel=par.sequence_parallel,
        fixed_length=False if par.variable_seq_lengths else None,
    )
    divisible = par.make_sequence_length_divisible_by or 1
    if cfg.sequence_packing.enabled:
        sp = cfg.sequence_packing
        return StepPlanConfig(
            mode="packing",
            train_mb_tokens=sp.train_mb_tokens,
            logprob_mb_tokens=sp.logprob_mb_tokens,
            algorithm=sp.algorithm,
            refine=sp.refine,
            microbatch_order=sp.microbatch_order,
            sequence_length_round=math.lcm(sp.sequence_length_round, divisible),
            cost_budget=sp.cost_budget,
            **common,
        )
    if cfg.dynamic_batching.enabled:
        db = cfg.dynamic_batching
        return StepPlanConfig(
            mode="dynamic",
            train_mb_tokens=db.train_mb_tokens,
            logprob_mb_tokens=db.logprob_mb_tokens,
            sequence_length_round=math.lcm(db.sequence_length_round, divisible),
            **common,
        )
    longest = max(
        cfg.sequence_packing.train_mb_tokens, cfg.data.max_sample_tokens * cfg.training.padded_micro_batch_rows
    )
    return StepPlanConfig(
        mode="padded",
        train_mb_tokens=longest,
        padded_rows=cfg.training.padded_micro_batch_rows,
        sequence_length_round=divisible,
        **common,
    )


def _check_budget(plan_config, lengths: list[int], cfg: TrainConfig) -> None:
    """The budget must hold the longest (padded) sample of the data set: say so before training starts."""
    capacity = plan_config.row_capacity()
    multiple = plan_config.length_multiple
    longest = max(lengths)
    padded = -(-longest // multiple) * multiple
    if padded > capacity and plan_config.mode != "padded":
        key = "sequence_packing" if plan_config.mode == "packing" else "dynamic_batching"
        raise ConfigError(
            f"{key}.train_mb_tokens={getattr(cfg, key).train_mb_tokens} (x cp={cfg.parallel.cp}: {capacity} tokens "
            f"per micro-batch) is smaller than the longest sample, {longest} tokens ({padded} padded). Raise "
            f"{key}.train_mb_tokens to at least {-(-padded // cfg.parallel.cp)}, or lower data.max_sample_tokens."
        )


def _predict_seconds(history, lengths) -> float | None:
    """Step time predicted by a cost model calibrated on the earlier steps (the first, a warm-up, is left
    out), once three of them exist; None before that."""
    if len(history) < 4:
        return None
    from .cost import CostModel

    model = CostModel.calibrate([h[0] for h in history[1:]], [h[1] for h in history[1:]])
    return float(model.sequence_cost(lengths).sum())


class _Progress:
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


def _checkpoint_dir(cfg: TrainConfig) -> Path:
    return Path(cfg.training.checkpoint_dir or os.path.join(cfg.run_dir, "checkpoints"))


def _save(cfg, step, model, optimizer, sampler, rank):
    import torch
    import torch.distributed as dist

    folder = _checkpoint_dir(cfg) / f"step_{step:06d}"
    folder.mkdir(parents=True, exist_ok=True)
    torch.save(
        {
            "step": step,
            "model": model.module.state_dict(),
            "optimizer": optimizer.state_dict(),
            "sampler": sampler.state_dict(),
            "torch_rng": torch.get_rng_state(),
        },
        folder / f"rank{rank:05d}.pt",
    )
    dist.barrier()
    if rank == 0:
        (_checkpoint_dir(cfg) / "latest").write_text(folder.name)
    dist.barrier()


def _load_latest(cfg, model, optimizer, sampler, rank) -> int:
    import torch

    latest = _checkpoint_dir(cfg) / "latest"
    if not latest.exists():
        raise ConfigError(f"resume=true but {latest} does not exist; there is no checkpoint in this run_dir yet.")
    state = torch.load(_checkpoint_dir(cfg) / latest.read_text().strip() / f"rank{rank:05d}.pt", weights_only=False)
    model.module.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    sampler.load_state_dict(state["sampler"])
    torch.set_rng_state(state["torch_rng"])
    return int(state["step"])


def train(cfg: TrainConfig) -> dict:
    """Run training; returns a summary with the step losses (the same on every rank)."""
    import contextlib

    # Everything that can be checked without Megatron is checked first: errors come in a second.
    world = int(os.environ.get("WORLD_SIZE", "1"))
    validate_config(cfg, world)
    par = cfg.parallel
    try:
        data = load_sft_data(**asdict(cfg.data))
    except (ValueError, FileNotFoundError) as exc:  # user data problems: say so, exit 2
        raise ConfigError(f"data: {exc}") from None
    lengths_all = [len(s.tokens) for s in data.samples]
    plan_config = _plan_config(cfg, world // (par.tp * par.pp * par.cp))
    _check_budget(plan_config, lengths_all, cfg)

    import torch
    import torch.distributed as dist

    from .megatron import cpu_device_adapter
    from .megatron.model import GPTShape, build_gpt_model, initialize_parallel
    from .planning import plan_step
    from .schedule import ParallelGroups, run_step

    _init_distributed(cfg)
    rank = dist.get_rank()
    initialize_parallel(tp=par.tp, pp=par.pp, cp=par.cp, seed=cfg.training.seed)
    groups = ParallelGroups.from_megatron()
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    adapter = cpu_device_adapter() if device.type == "cpu" else contextlib.nullcontext()
    run_dir = Path(cfg.run_dir)
    if rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        log.info("rank %d/%d on %s; data: %s", rank, world, device, json.dumps(data.info))
    print(
        f"[rank {rank}/{world}] host={os.uname().nodename} dp={groups.dp_rank}/{groups.dp_size} "
        f"cp={groups.cp_rank}/{groups.cp_size} tp={par.tp} pp={par.pp} mode={plan_config.mode}",
        flush=True,
    )
    sampler = GlobalBatchSampler(len(data.samples), cfg.training.global_batch_size, cfg.training.seed)
    summary = {"losses": [], "steps": [], "sample_ids": [], "mode": plan_config.mode, "rank": rank}
    writer = None
    with adapter:
        model, _ = build_gpt_model(
            GPTShape(
                num_layers=cfg.model.num_layers,
                hidden_size=cfg.model.hidden_size,
                num_attention_heads=cfg.model.num_attention_heads,
                num_query_groups=cfg.model.num_query_groups,
                ffn_hidden_size=cfg.model.ffn_hidden_size,
                vocab_size=data.vocab_size,
                max_sequence_length=cfg.model.max_sequence_length,
                normalization=cfg.model.normalization,
            ),
            tp=par.tp,
            pp=par.pp,
            cp=par.cp,
            sequence_parallel=par.sequence_parallel,
            variable_seq_lengths=par.variable_seq_lengths,
            dtype=torch.bfloat16 if cfg.model.dtype == "bfloat16" else torch.float32,
            attention_backend=cfg.model.attention_backend,
            seed=cfg.training.seed,
            device=device,
        )
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=cfg.training.lr, weight_decay=cfg.training.weight_decay)
        start_step = _load_latest(cfg, model, optimizer, sampler, rank) if cfg.resume else 0
        if cfg.logging.tensorboard and rank == 0:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as exc:
                raise ConfigError(
                    "logging.tensorboard=true needs the tensorboard package: pip install tensorboard."
                ) from exc
            writer = SummaryWriter(str(run_dir / "tensorboard"))
        metrics_path = run_dir / cfg.logging.metrics_file
        history: list[tuple[list[int], float]] = []  # (lengths of the slowest rank, measured seconds)
        progress = _Progress(cfg.training.steps, cfg.logging.progress_bar and rank == 0)
        for step in range(start_step + 1, cfg.training.steps + 1):
            batch_ids = sampler.next_batch()
            samples = [data.samples[i] for i in batch_ids]
            plan = plan_step([lengths_all[i] for i in batch_ids], plan_config)
            model.zero_grad_buffer()
            t0 = time.perf_counter()
            result = run_step(
                model, samples, plan, groups, normalization=cfg.training.loss_normalization, device=device
            )
            for p in params:
                p.grad = p.main_grad.to(p.dtype) if getattr(p, "main_grad", None) is not None else p.grad
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            elapsed = time.perf_counter() - t0
            stats = plan.stats()
            slowest = max(plan.micro_batches, key=lambda rank: sum(mb.cost for mb in rank))
            slowest_lengths = [plan.lengths[i] for mb in slowest for i in mb.sample_indices]
            predicted = _predict_seconds(history, slowest_lengths)
            history.append((slowest_lengths, elapsed))
            record = {
                "step": step,
                "loss": result.loss,
                "tokens_per_s": stats["real_tokens"] / elapsed,
                "useful_tokens": stats["real_tokens"],
                "padded_tokens": stats["padded_tokens"],
                "utilization": stats["utilization"],
                "microbatches_per_rank": stats["num_microbatches_per_rank"],
                "rank_tokens_max_over_mean": stats["rank_tokens_max_over_mean"],
                "rank_cost_max_over_mean": stats["rank_cost_max_over_mean"],
                "predicted_step_time_s": predicted,
                "step_time_s": elapsed,
                "sample_ids": batch_ids,
            }
            summary["losses"].append(result.loss)
            summary["steps"].append(step)
            summary["sample_ids"].append(batch_ids)
            if rank == 0:
                with metrics_path.open("a") as f:
                    f.write(json.dumps(record) + "\n")
                if step % cfg.logging.log_interval == 0:
                    loss_text = f"{result.loss:.4f}"
                    if predicted is not None:
                        loss_text += f" | step {elapsed:.2f}s (predicted {predicted:.2f}s)"
                    loss_text += f" | rank cost max/mean {record['rank_cost_max_over_mean']:.3f}"
                    log.info(
                        "step %d/%d loss %s | %.0f tok/s | useful %d / computed %d tokens (%.1f%%) | %d micro-batches"
                        "/rank",
                        step,
                        cfg.training.steps,
                        loss_text,
                        record["tokens_per_s"],
                        record["useful_tokens"],
                        record["padded_tokens"],
                        100 * record["utilization"],
                        record["microbatches_per_rank"],
                    )
                if writer is not None:
                    for key in (
                        "loss",
                        "tokens_per_s",
                        "utilization",
                        "microbatches_per_rank",
                        "rank_cost_max_over_mean",
                        "predicted_step_time_s",
                        "step_time_s",
                    ):
                        if record[key] is not None:
                            writer.add_scalar(f"train/{key}", record[key], step)
                progress.update(step, f"loss {result.loss:.3f}")
            if cfg.training.save_interval and step % cfg.training.save_interval == 0:
                _save(cfg, step, model, optimizer, sampler, rank)
        if cfg.training.steps > start_step and not (
            cfg.training.save_interval and cfg.training.steps % cfg.training.save_interval == 0
        ):
            _save(cfg, cfg.training.steps, model, optimizer, sampler, rank)
    if writer is not None:
        writer.close()
    return summary


def _hydra_main() -> None:
    import hydra
    from omegaconf import DictConfig

    register_configs()

    @hydra.main(config_path=CONFIG_DIR, config_name="config", version_base="1.3")
    def _main(raw: DictConfig) -> None:
        quiet_megatron_on_cpu()  # Hydra's job logging was just configured
        try:
            check_unknown_keys(raw)
            cfg = to_train_config(raw)
            summary = train(cfg)
        except ConfigError as exc:
            print(f"config error: {exc}", file=sys.stderr)
            sys.exit(2)
        if summary["losses"] and summary["rank"] == 0:
            print(f"final loss {summary['losses'][-1]:.4f} (first {summary['losses'][0]:.4f})", flush=True)

    _main()


def quiet_megatron_on_cpu() -> None:
    """Megatron logs every DDP bucket at INFO and warns that TE/Apex are absent; neither helps a user here."""
    import warnings

    logging.getLogger("megatron").setLevel(logging.WARNING)
    for pattern in (
        ".*Transformer Engine and Apex are not installed.*",
        ".*Apex is not installed.*",
        ".*full scope is deprecated.*",
        ".*torch.jit.script_method.*",
    ):
        warnings.filterwarnings("ignore", message=pattern)


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", stream=sys.stdout)
    quiet_megatron_on_cpu()
    if os.environ.get("RANK", "0") != "0":
        # Only rank 0 writes Hydra's run folder and logs.
        sys.argv += ["hydra.output_subdir=null", "hydra/job_logging=none", "hydra/hydra_logging=none"]
    _hydra_main()


if __name__ == "__main__":
    main()
