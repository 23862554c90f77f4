"""The training loop, wired from parts with one job each.

    algorithm = algorithms.get_algorithm(cfg.algorithm)  sft | grpo | dpo: data, units, the step
    layout    = run_settings.validate_layout(cfg, world) the run's ParallelLayout (world size checked)
    plan cfg  = run_settings.plan_config(cfg, layout)    the one config -> planner translation
    data      = algorithm.load_data(cfg)                 samples + the units a step draws (`RunData`)
    setup     = model_setup.setup_training(cfg, shape)   distributed, policy, Megatron optimizer + LR schedule
    resume    = checkpoint.resume_folder(cfg)            newest complete checkpoint (resume=true|auto)
    folder    = run_folder.RunFolder(cfg, ...)           the run folder is this run's (checked, then claimed)
    each step: sampler.next_batch -> algorithm step -> metrics.log_step -> checkpointer
    stop      = stop_request.StopRequest                 SIGTERM/SIGINT/SIGUSR1 or the stop file: save, exit 0

Every rank loads the same samples, draws the same global batch of units from a seeded sampler (samples
for SFT, groups of responses for GRPO, pairs for DPO), plans it identically (no communication) and runs
only its share. Every check that needs only the config and the data (`prepare_run`, the plan of the first
global batch included) runs before the run folder is written and before Megatron starts; `dry_run` does
exactly these, without torch.
"""

from __future__ import annotations

import json
import logging
import os
import warnings
from dataclasses import dataclass
from pathlib import Path

from ..planning import ModelShape, ParallelLayout, StepPlan, StepPlanConfig, plan_step
from ..planning.hf_config import check_output_folder, check_safetensors
from ..planning.memory_budget import MemoryBudgetError
from ..planning.model_shape import MOE_TRAINING_FIELDS
from .algorithms import RunData, get_algorithm
from .checkpoint import (
    Checkpointer,
    check_compatible,
    check_schedule,
    checkpoint_folder,
    data_fingerprint,
    read_manifest,
    resume_folder,
)
from .config import ConfigError, ModelConfig, TrainConfig
from .global_batches import GlobalBatchSampler
from .metrics import MetricsLogger
from .model_setup import default_device, device_context, setup_training
from .run_folder import RunFolder
from .run_settings import budget_key, check_data_fits, check_shape_on_layout, plan_config, validate_layout
from .stop_request import STOP_REPORT_ENV, StopRequest

__all__ = ["RunInputs", "describe_schedule", "dry_run", "prepare_run", "quiet_megatron_on_cpu", "train"]

log = logging.getLogger("mcore_packing.train")


@dataclass(frozen=True)
class RunInputs:
    """What a run needs before any torch or Megatron: the parallel layout, the planner config, the data
    (`RunData`: samples and the units a step draws) and their lengths, the model shape, the checkpoint to
    resume from, and how many units a step draws."""

    layout: ParallelLayout
    step_config: StepPlanConfig
    data: RunData
    lengths: list[int]
    shape: ModelShape
    resume: Path | None
    batch_units: int
    fingerprint: str | None  # the data's (None in a dry run, which does not hash it)
    first_plan: object  # the plan of the first global batch (every pass of it chained)
    first_batch: list[int]  # its sample ids


def prepare_run(cfg: TrainConfig, world_size: int, *, dry_run: bool = False) -> RunInputs:
    """Every check that needs no Megatron, in the order a user fixes them (errors come in a second)."""
    algorithm = get_algorithm(cfg.algorithm)
    layout = validate_layout(cfg, world_size)
    if not dry_run:  # the memory model's device is this machine's (`run_device`); a dry run plans for GPUs
        import torch  # noqa: F401

    step_config = plan_config(cfg, layout)
    if cfg.model.family != "gpt" and cfg.model.hf_path is None and not dry_run:
        raise ConfigError(
            f"model.family={cfg.model.family} describes a pretrained model: set model.hf_path=/path/to/hf_folder "
            "(its config.json, *.safetensors and tokenizer.json) to start from its weights. --dry-run works without."
        )
    if cfg.model.fp8_recipe is not None and not dry_run:
        raise ConfigError(
            f"model.fp8_recipe={cfg.model.fp8_recipe}: the planner pads every row for FP8 GEMMs (see --dry-run or "
            "`plan`), but this trainer does not run FP8 yet (TransformerEngine's FP8 GEMMs on a GPU). Set "
            "model.fp8_recipe=null to train.",
            key="model.fp8_recipe",
        )
    if cfg.training.export_dir and cfg.model.hf_path is None and cfg.model.family == "gpt":
        raise ConfigError("training.export_dir writes a Hugging Face folder: it needs model.hf_path (or model.family).")
    if cfg.training.export_dir:
        try:
            check_output_folder(cfg.training.export_dir, overwrite=False)
        except FileExistsError as exc:
            raise ConfigError(f"training.export_dir: {exc}".replace("pass --overwrite", "remove it")) from None
    if cfg.optimizer.lr == 0:
        warnings.warn("optimizer.lr=0: no step changes the weights (a check of a conversion round trip, or of the "
                      "loss on the starting weights); set optimizer.lr > 0 to learn.", stacklevel=2)  # fmt: skip
    folder = RunFolder(cfg, checkpoint_folder(cfg))
    folder.check_keys()
    resume = resume_folder(cfg)
    folder.check(resume)
    rebuilt = check_schedule(resume, cfg) if resume else []
    if rebuilt:
        log.warning("the LR schedule is rebuilt for this run (optimizer.override_opt_param_scheduler): %s",
                    "; ".join(rebuilt))  # fmt: skip
    data = algorithm.load_data(cfg)
    shape = cfg.model.shape(data.vocab_size)
    check_shape_on_layout(shape, layout)
    if cfg.model.hf_path is not None:
        try:
            check_safetensors(cfg.model.hf_path)
        except (ValueError, OSError) as exc:
            raise ConfigError(f"model.hf_path: {exc}", key="model.hf_path") from None
    _warn_ignored_model_keys(cfg, shape)
    lengths = data.sample_lengths()
    _check_vocab(cfg, data, shape)
    check_data_fits(cfg, step_config, lengths)
    algorithm.check_data(cfg, data, step_config)
    fingerprint = None if dry_run else data.fingerprint or data_fingerprint(data.samples, data.fingerprint_extra)
    if resume is not None and fingerprint is not None:
        check_compatible(resume, cfg, shape, fingerprint, data.num_units)
    batch_units = algorithm.batch_units(cfg)
    sampler = GlobalBatchSampler(data.num_units, batch_units, cfg.training.seed)  # a batch no larger than the data
    first_batch = data.sample_ids(sampler.next_batch())
    first_plan = _plan_first_batch(cfg, algorithm, data, lengths, step_config, layout, first_batch)
    check_memory_budget(step_config, first_plan, lengths)
    return RunInputs(layout=layout, step_config=step_config, data=data, lengths=lengths, shape=shape, resume=resume,
                     batch_units=batch_units, fingerprint=fingerprint, first_plan=first_plan,
                     first_batch=first_batch)  # fmt: skip


def _plan_first_batch(cfg, algorithm, data: RunData, lengths, step_config, layout, batch_ids: list[int]):
    """The plan of the first global batch, as the step will plan it (DPO keeps pairs together, GRPO plans
    each minibatch): a batch this layout cannot split is a `ConfigError` naming the batch key."""
    samples = len(batch_ids)
    if cfg.algorithm == "sft" and samples < layout.dp:
        raise ConfigError(
            f"training.global_batch_size={cfg.training.global_batch_size} is below the {layout.dp} data-parallel "
            f"ranks (world size / (parallel.tp x parallel.pp x parallel.cp)): each needs at least one sample a step. "
            f"Raise training.global_batch_size to {layout.dp} or more, or run on fewer ranks.",
            key="training.global_batch_size",
        )  # fmt: skip
    passes = algorithm.training_passes(cfg, data, batch_ids)
    sharing = getattr(algorithm, "shared_prefix", lambda *_: None)
    try:
        plans = [plan_step([lengths[i] for i in ids], step_config, groups=groups, shared_prefix=sharing(cfg, data, ids))
                 for ids, groups in passes]  # fmt: skip
    except MemoryBudgetError as exc:  # its longest sequence alone is over the memory budget
        key = budget_key(step_config).replace("train_mb_tokens", "memory_budget")
        longest = max(batch_ids, key=lambda i: lengths[i])
        raise ConfigError(f"{key}: sample {longest} of the data: {exc}", key=key) from None
    except ValueError as exc:  # the first batch cannot be planned on this layout: a setting to change
        key = algorithm.BATCH_KEY
        raise ConfigError(f"the first global batch ({samples} samples, set by {key}) cannot be planned on "
                          f"{layout.dp} data-parallel ranks: {exc}", key=key) from None  # fmt: skip
    return plans[0] if len(plans) == 1 else type(plans[0]).chained(plans)


def check_memory_budget(step_config, plan, lengths) -> None:
    """With a ``memory_budget``: log the first global batch's predicted peak per stage (`planning.memory`,
    the settings of `app.memory_settings` on this run's device), and the smaller token budget `plan_step`
    planned it at when the configured one would exceed the memory budget; refuse (`ConfigError`) a data
    set whose longest sample alone would exceed it, before Megatron starts (`plan_step` re-plans every
    step's batch under the budget, which then always fits)."""
    budget = step_config.memory_budget
    if budget is None or step_config.memory_model is None or not isinstance(plan, StepPlan):
        return
    from ..planning.memory import format_bytes
    from ..planning.memory_budget import plan_memory

    key = budget_key(step_config).replace("train_mb_tokens", "memory_budget")
    memory = step_config.memory_model
    try:
        stages = plan_memory(plan, memory.shape, memory.settings)
        longest = max(range(len(lengths)), key=lambda i: lengths[i])
        plan_step([lengths[longest]] * step_config.layout.dp, step_config)  # every batch's longest sequence fits
    except MemoryBudgetError as exc:
        raise ConfigError(f"{key}: sample {longest} of the data: {exc}", key=key) from None
    except ValueError as exc:  # a shape the memory model does not cover (MoE at TP > 1): named
        raise ConfigError(f"{key}: {exc}", key=key) from None
    peaks = ", ".join(f"stage {d['stage']} {format_bytes(d['peak'])}" for d in stages)
    planned, tokens_key = plan.config.train_mb_tokens, budget_key(step_config)
    smaller = f" (planned at {tokens_key}={planned} to fit)" if planned < step_config.train_mb_tokens else ""
    log.info("predicted peak per GPU (first batch, %s attention): %s; %s=%s%s", memory.settings.attention, peaks, key,
             format_bytes(budget), smaller)  # fmt: skip


def _warn_ignored_model_keys(cfg: TrainConfig, shape: ModelShape) -> None:
    """With model.hf_path the checkpoint's config.json defines the model: say which set keys lose (keys
    left at the schema's defaults were not set, and are not named)."""
    if cfg.model.hf_path is None:
        return
    declared = cfg.model.declared_shape(shape.vocab_size)
    unset = ModelConfig()
    for key, value in declared.to_dict().items():
        if key in MOE_TRAINING_FIELDS or key == "family" or value == getattr(unset, key, None):
            continue  # training settings are the run's; unset keys were not asked for
        if value != getattr(shape, key):
            warnings.warn(
                f"model.{key}={value} is ignored: {cfg.model.hf_path}/config.json says {getattr(shape, key)}.",
                stacklevel=2,
            )


def _check_vocab(cfg: TrainConfig, data: RunData, shape: ModelShape) -> None:
    largest = data.max_token_id
    if largest is None:
        largest = max(int(s.tokens.max()) for s in data.samples)
    if largest >= shape.vocab_size:
        raise ConfigError(
            f"the data has token id {largest} but the model's vocabulary is {shape.vocab_size}: the tokenizer "
            f"({data.info['tokenizer']}) does not belong to this model. Tokenize with the model's own "
            "(model.hf_path) or raise model.vocab_size."
        )


def train(cfg: TrainConfig) -> dict:
    """Run training; returns a summary with the step losses (the same on every rank)."""
    world_size, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    inputs = prepare_run(cfg, world_size)  # every config and data check, nothing written yet
    handler = None
    if rank == 0:
        from_step = int(read_manifest(inputs.resume)["step"]) if inputs.resume else 0
        folder = RunFolder(cfg, checkpoint_folder(cfg))
        handler = folder.claim(data_fingerprint=inputs.fingerprint, resume_from=inputs.resume, from_step=from_step)
    stop = StopRequest(cfg.training.stop_signals).install()  # a signal from here on saves instead of killing
    try:
        return _train(cfg, inputs, inputs.fingerprint, stop)
    finally:
        stop.uninstall()
        if handler is not None:
            handler.close()
            logging.getLogger("mcore_packing").removeHandler(handler)


def _train(cfg: TrainConfig, inputs: RunInputs, fingerprint: str, stop: StopRequest) -> dict:
    sampler = GlobalBatchSampler(inputs.data.num_units, inputs.batch_units, cfg.training.seed)
    summary = {"losses": [], "steps": [], "sample_ids": [], "mode": inputs.step_config.mode, "stopped_at": None}
    with device_context(default_device()):
        setup = setup_training(cfg, inputs.shape)
        quiet_megatron_on_cpu(cpu=setup.policy.device.type == "cpu")
        _announce(cfg, setup, inputs.data, inputs.step_config.mode)
        summary["rank"] = setup.rank
        checkpointer = Checkpointer(cfg, setup.rank, inputs.layout, fingerprint)
        start = checkpointer.load(inputs.resume, setup, sampler) if inputs.resume else 0
        if inputs.resume:
            log.info("resumed from %s at step %d", inputs.resume, start)
        _announce_draws(cfg, inputs, setup.rank)
        take_step = get_algorithm(cfg.algorithm).make_step(cfg, inputs, setup)
        metrics = MetricsLogger(cfg, setup.rank, start_step=start, memory=inputs.step_config.memory_model)
        meters = _moe_meters(setup.policy, inputs.shape)
        asked = {"world_size": setup.world_size, "rank": setup.rank}
        step = start
        if not stop.requested(**asked):
            for step in range(start + 1, cfg.training.steps + 1):
                batch_ids = inputs.data.sample_ids(sampler.next_batch())
                for meter in meters:
                    meter.reset()
                plan, outcome, extra_metrics = take_step(batch_ids)
                for meter in meters:  # a collective, on every rank
                    extra_metrics = {**(extra_metrics or {}), **meter.metrics()}
                metrics.log_step(step, plan, outcome, batch_ids, extra=extra_metrics)
                summary["losses"].append(outcome.result.loss)
                summary["steps"].append(step)
                summary["sample_ids"].append(batch_ids)
                stopping = stop.requested(**asked)
                if checkpointer.due(step, cfg.training.steps) or stopping:
                    checkpointer.save(step, setup, sampler)
                if stopping:
                    break
        metrics.close()
        if stop.reason is not None:
            summary["stopped_at"] = step
            if setup.rank == 0:
                saved = checkpointer.latest()
                where = f"saved {saved}" if step > start else f"no step ran; the last checkpoint is {saved}"
                line = (f"stopped by {stop.reason} after step {step} of {cfg.training.steps}: {where}; continue with "
                        f"resume=true run_dir={cfg.run_dir}")  # fmt: skip
                print(line, flush=True)
                if os.environ.get(STOP_REPORT_ENV):  # python -m mcore_packing launch exits 0 on it
                    Path(os.environ[STOP_REPORT_ENV]).write_text(line + "\n")
    if cfg.training.export_dir and summary["stopped_at"] is None:
        _export_at_end(cfg, checkpointer, setup.rank)
    return summary


def _announce_draws(cfg: TrainConfig, inputs: RunInputs, rank: int) -> None:
    """How many units the run draws from and whether it sees any twice (the sampler walks a fresh
    permutation of the data set each epoch)."""
    if rank != 0:
        return
    units, per_step = inputs.data.num_units, inputs.batch_units
    draws = cfg.training.steps * per_step
    what = {"sft": "samples", "dpo": "pairs", "grpo": "groups", "rm": "pairs"}[cfg.algorithm]
    epochs = draws / units
    repeats = (f"each seen {epochs:.2f} times on average (repeats from step {units // per_step + 1})"
               if draws > units else f"no {what[:-1]} seen twice ({100 * draws / units:.1f}% of the data)")  # fmt: skip
    log.info("data: %d %s; %s x %d = %d draws: %s", units, what, _count(cfg.training.steps, "step"), per_step, draws,
             repeats)  # fmt: skip


def _moe_meters(policy, shape: ModelShape) -> list:
    """The step's meters of an MoE model (none for a dense one): the expert load, the router losses when
    the model trains with them, and router replay's mismatch when it replays."""
    if not shape.is_moe:
        return []
    from ..megatron.expert_load import ExpertLoadMeter
    from ..megatron.router_loss import attached_router_loss
    from ..megatron.router_replay import attached_router_replay

    losses = [loss for loss in map(attached_router_loss, policy.chunks) if loss is not None]
    replay = attached_router_replay(policy.chunks[0])  # its counts cover every chunk
    meters = [ExpertLoadMeter(policy.model, shape.num_layers, shape.num_experts)]
    return meters + ([_ChunksSum(losses)] if losses else []) + ([replay] if replay is not None else [])


class _ChunksSum:
    """The router losses of a stage's chunks (a virtual pipeline) as one meter: each chunk's metrics are
    its layers' share of the per-layer mean, so the model's are their sum."""

    def __init__(self, meters: list):
        self.meters = meters

    def reset(self) -> None:
        for meter in self.meters:
            meter.reset()

    def metrics(self) -> dict:
        out: dict = {}
        for meter in self.meters:  # a collective each, the same count on every rank
            for key, value in meter.metrics().items():
                out[key] = out.get(key, 0.0) + value
        return out


def _export_at_end(cfg: TrainConfig, checkpointer: Checkpointer, rank: int) -> None:
    """Rank 0 writes the Hugging Face folder from the last checkpoint, in a process of its own (export
    loads the checkpoint at TP1/PP1, a layout this job's parallel state is not); the others wait."""
    import subprocess
    import sys

    from ..collectives import barrier

    if rank == 0:
        env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARS and not k.startswith("TORCHELASTIC")}
        command = [sys.executable, "-m", "mcore_packing", "export", "--checkpoint", str(checkpointer.latest()),
                   "--out", cfg.training.export_dir, "--dtype", cfg.model.dtype]  # fmt: skip
        subprocess.run(command, env=env, check=True)
        log.info("exported a Hugging Face folder to %s", cfg.training.export_dir)
    barrier()


_LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")


def _announce(cfg: TrainConfig, setup, data: RunData, mode: str) -> None:
    pgs = setup.policy.process_groups
    if setup.rank == 0:
        log.info("rank %d/%d on %s; data: %s", setup.rank, setup.world_size, setup.policy.device, json.dumps(data.info))
        log.info("lr schedule: %s", describe_schedule(cfg))
    print(
        f"[rank {setup.rank}/{setup.world_size}] host={os.uname().nodename} dp={pgs.dp_rank}/{pgs.dp_size} "
        f"cp={pgs.cp_rank}/{pgs.cp_size}{' (dynamic)' if cfg.context_parallel.dynamic else ''} tp={cfg.parallel.tp} "
        f"pp={cfg.parallel.pp} mode={mode} "
        f"algorithm={cfg.algorithm}",
        flush=True,
    )


def describe_schedule(cfg: TrainConfig) -> str:
    """The LR schedule in words, saying when step 1 runs at lr 0 (a warmup from lr_warmup_init=0: a run of
    N steps then applies N-1 updates)."""
    opt, steps = cfg.optimizer, cfg.optimizer_steps
    text = f"{opt.lr_decay_style} from lr {opt.lr:g}"
    if opt.lr_decay_style != "constant":
        text += f" to {opt.min_lr:g} at optimizer step {opt.decay_iters(steps)}"
    if opt.lr_warmup_iters:
        text = f"warmup over {_count(opt.lr_warmup_iters, 'step')} from {opt.lr_warmup_init:g}, then " + text
        if opt.lr_warmup_iters >= steps:
            text += (f" (the run ends inside the warmup, at optimizer step {steps} of {opt.lr_warmup_iters}: lr never "
                     f"reaches {opt.lr:g}; lower optimizer.lr_warmup_iters)")  # fmt: skip
        if opt.lr_warmup_init == 0:
            text += (f" (step 1 runs at lr 0, so {_count(steps, 'optimizer step')} "
                     f"{'apply' if steps > 1 else 'applies'} {_count(steps - 1, 'update')}; "
                     "set optimizer.lr_warmup_init > 0 to learn from step 1)")  # fmt: skip
    return text


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def dry_run(cfg: TrainConfig) -> dict:
    """Validate for the config's cluster size and plan the first global batch; no GPU, no torch. A config
    whose algorithm has no data to plan yet (GRPO without ``grpo.rollouts``, DPO without ``dpo.pairs``) is
    validated up to the data."""
    world = cfg.cluster.num_nodes * cfg.cluster.gpus_per_node
    missing = get_algorithm(cfg.algorithm).missing_data(cfg)
    if missing is not None:
        layout = validate_layout(cfg, world)
        plan_config(cfg, layout)
        return {"world_size": world, "layout": layout.to_dict(), "algorithm": cfg.algorithm,
                "first_global_batch": None, "note": missing}  # fmt: skip
    inputs = prepare_run(cfg, world, dry_run=True)
    batch = [inputs.lengths[i] for i in inputs.first_batch]
    plan = inputs.first_plan
    return {
        "world_size": world,
        "layout": inputs.layout.to_dict(),
        "algorithm": cfg.algorithm,
        "mode": inputs.step_config.mode,
        "dynamic_cp": inputs.step_config.dynamic_cp,
        "row_capacity_tokens": plan.row_capacity,
        "max_tokens_per_gpu_per_microbatch": plan.stats()["max_tokens_per_rank"],
        "data": inputs.data.info,
        "parameters": {
            "total": inputs.shape.num_parameters(),
            "active_per_token": inputs.shape.num_parameters(active=True),
        },
        "lr_schedule": describe_schedule(cfg),
        "first_global_batch": {"samples": len(batch), "tokens": sum(batch), **plan.stats()},
    }


def quiet_megatron_on_cpu(*, cpu: bool = False) -> None:
    """Silence what helps no user of these commands: Megatron's INFO line per DDP bucket, its warnings that
    TE/Apex are absent (we say which backend runs), and torch's deprecations of what Megatron calls (the
    collectives of its TP/SP layers, dist_checkpointing's ShardedTensor and ``load_state_dict``: Megatron's
    to change). On a
    CPU (``cpu``) also the advice to set CUDA_DEVICE_MAX_CONNECTIONS, which only a GPU reads (the sbatch
    launcher sets it). Our own warnings, and any other, stay."""
    from ..compat import quiet_megatron_imports

    logging.getLogger("megatron").setLevel(logging.WARNING)
    quiet_megatron_imports()
    patterns = [
        ".*full scope is deprecated.*",
        ".*torch.jit.script_method.*",
        ".*torch.distributed.all_gather_into_tensor` is deprecated.*",
        ".*torch.distributed.reduce_scatter_tensor` is deprecated.*",
        ".*Please use DTensor instead and we are deprecating ShardedTensor.*",  # dist_checkpointing's reshard
        ".*`load_state_dict` is deprecated and will be removed in future versions.*",  # and its torch loader
    ]
    if cpu:
        patterns.append(".*CUDA_DEVICE_MAX_CONNECTIONS.*")
    for pattern in patterns:
        warnings.filterwarnings("ignore", message=pattern)
