"""`Checkpointer`: when to save, where, and how a run resumes at the exact next sample, on any layout.

A checkpoint is one folder ``<checkpoint_dir>/step_NNNNNN/`` holding

- Megatron's distributed checkpoint (``torch_dist``): the model, the optimizer (the distributed
  optimizer's state too) and each rank's RNG state, as shards of global tensors, so it loads at another
  TP/PP/DP layout (`megatron.dist_checkpoint`);
- ``mcore_packing.json``: the step, the sampler position, the LR schedule's state, the model shape, the
  data set's fingerprint, the layout it was written at, the run's config, and the size of every file.

Writes are atomic: every rank writes into ``.step_NNNNNN.partial``; once all have finished, rank 0 writes
the manifest, renames the folder to ``step_NNNNNN`` and replaces the ``latest`` pointer (a temporary
file renamed over it). A save killed half-way leaves only a ``.partial`` folder, which the next save
removes. Then all but the newest ``training.keep_last`` complete checkpoints are deleted.

Resuming (``resume=true``, or ``auto``) takes the newest complete checkpoint: a step folder whose
manifest parses and whose files all exist with their recorded sizes; any other step folder is skipped
with a warning that names it and what is wrong. A checkpoint of another model shape, data set, seed or
optimizer kind is refused with an error naming what differs. Nothing is unpickled: the manifest is JSON
and the tensors go through dist_checkpointing's loaders (``weights_only`` torch loads).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import warnings
from dataclasses import asdict
from pathlib import Path

import numpy as np

from ..planning import ModelShape
from .config import ConfigError, TrainConfig
from .global_batches import GlobalBatchSampler
from .model_setup import TrainingSetup

__all__ = [
    "MANIFEST",
    "Checkpointer",
    "check_compatible",
    "checkpoint_folder",
    "data_fingerprint",
    "find_checkpoint",
    "read_manifest",
    "resume_folder",
    "schedule_differences",
]

MANIFEST = "mcore_packing.json"
FORMAT_VERSION = 2
_STEP_PREFIX = "step_"


def data_fingerprint(samples, extra: list | None = None) -> str:
    """A hash of every sample's tokens and loss mask, in order (and of ``extra``, JSON-serializable: the
    rollouts' rewards and groups): the same data set gives the same value."""
    digest = hashlib.sha256(json.dumps(extra).encode() if extra else b"")
    for sample in samples:
        tokens = np.asarray(sample.tokens, dtype=np.int64)
        digest.update(len(tokens).to_bytes(8, "little"))
        digest.update(tokens.tobytes())
        if sample.loss_mask is not None:
            digest.update(np.asarray(sample.loss_mask, dtype=bool).tobytes())
    return digest.hexdigest()[:32]


def _layout(layout) -> dict:
    """The manifest's layout record (the keys format 2 wrote: tp, pp, cp, dp; and ep when it is not 1)."""
    record = {key: getattr(layout, key) for key in ("tp", "pp", "cp", "dp")}
    if getattr(layout, "ep", 1) != 1:
        record["ep"] = layout.ep
    return record


def read_manifest(folder: Path) -> dict:
    """The manifest of a step folder; `ValueError` naming the folder and the problem when it is not a
    complete checkpoint (missing or unreadable manifest, a missing or truncated file)."""
    path = folder / MANIFEST
    if not path.is_file():
        raise ValueError(f"{folder} has no {MANIFEST} (a save that did not finish, or not a checkpoint)")
    try:
        manifest = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path} is not readable JSON ({exc})") from None
    if manifest.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{path} has format_version {manifest.get('format_version')}, expected {FORMAT_VERSION}")
    for name, size in manifest["files"].items():
        file = folder / name
        if not file.is_file():
            raise ValueError(f"{file} is missing")
        if file.stat().st_size != size:
            raise ValueError(f"{file} has {file.stat().st_size} bytes, the manifest says {size} (truncated?)")
    return manifest


def find_checkpoint(folder: Path) -> Path | None:
    """The newest complete checkpoint under ``folder`` (None when there is none, or no such folder);
    incomplete or corrupt step folders are skipped with a warning naming each."""
    if not folder.is_dir():
        return None
    steps = sorted(
        (p for p in folder.glob(f"{_STEP_PREFIX}*") if p.is_dir() and p.name[len(_STEP_PREFIX) :].isdigit()),
        key=lambda p: int(p.name[len(_STEP_PREFIX) :]),
        reverse=True,
    )
    for step in steps:
        try:
            read_manifest(step)
        except ValueError as exc:
            warnings.warn(f"skipping checkpoint {step}: {exc}", stacklevel=2)
            continue
        return step
    return None


def checkpoint_folder(cfg: TrainConfig) -> Path:
    """Where the run's checkpoints live: ``training.checkpoint_dir``, else ``<run_dir>/checkpoints``."""
    return Path(cfg.training.checkpoint_dir or os.path.join(cfg.run_dir, "checkpoints"))


def resume_folder(cfg: TrainConfig) -> Path | None:
    """Where ``resume`` starts: None for a fresh start (``resume=false``, or ``auto`` without a complete
    checkpoint); a `ConfigError` for ``resume=true`` without one."""
    if cfg.resume is False:
        return None
    folder = checkpoint_folder(cfg)
    found = find_checkpoint(folder)
    partial = sorted(p.name for p in folder.glob(f".{_STEP_PREFIX}*.partial")) if folder.is_dir() else []
    if partial:
        warnings.warn(
            f"{folder} holds {', '.join(partial)}: a save that did not finish (the job was killed while writing "
            f"it). {'Resuming from ' + found.name if found else 'No complete checkpoint precedes it'}; the next save "
            "removes the partial folder.", stacklevel=2,
        )  # fmt: skip
    if found is None and cfg.resume is True:
        raise ConfigError(
            f"resume=true but {folder} holds no complete checkpoint. Use resume=auto to start fresh when there "
            "is none, or point training.checkpoint_dir at the run's checkpoints."
        )
    return found


_SCHEDULE_KEYS = {
    "max_lr": "optimizer.lr",
    "min_lr": "optimizer.min_lr",
    "lr_warmup_steps": "optimizer.lr_warmup_iters",
    "lr_decay_steps": "optimizer.lr_decay_iters (null: the run's optimizer steps)",
    "lr_decay_style": "optimizer.lr_decay_style",
    "start_wd": "optimizer.weight_decay",
}


def schedule_differences(saved: dict, cfg: TrainConfig) -> list[str]:
    """Where the checkpoint's LR schedule (its scheduler's state) differs from this run's, one entry per
    key, naming the config key; the decay length and ``min_lr`` do not count for a constant schedule."""
    run = cfg.optimizer.schedule(cfg.optimizer_steps)
    ignored = {"lr_decay_steps", "min_lr"} if run["lr_decay_style"] == saved["lr_decay_style"] == "constant" else set()
    return [
        f"{_SCHEDULE_KEYS[key]}: checkpoint {saved[key]!r}, this run {value!r}"
        for key, value in run.items()
        if key not in ignored and saved[key] != value
    ]


def check_schedule(folder: Path, cfg: TrainConfig) -> list[str]:
    """Before Megatron: a checkpoint whose LR schedule differs from this run's (an extended run,
    another decay) is refused, unless ``optimizer.override_opt_param_scheduler`` rebuilds the schedule;
    returns the differences (for the log) when it does."""
    manifest = read_manifest(folder)
    differences = schedule_differences(manifest["scheduler"], cfg)
    if differences and not cfg.optimizer.override_opt_param_scheduler:
        step = manifest["step"]
        raise ConfigError(
            f"cannot resume from {folder}: its LR schedule differs from this run's ({'; '.join(differences)}). "
            "Continuing the checkpoint's schedule would train an extended run at its end value. Set "
            f"optimizer.override_opt_param_scheduler=true to rebuild the schedule for this run (continuing at step "
            f"{step}), or give this run the checkpoint's settings."
        )
    return differences


def check_compatible(folder: Path, cfg: TrainConfig, shape: ModelShape, fingerprint: str, num_units: int) -> None:
    """Before Megatron: refuse a checkpoint of another model, data set, seed or optimizer kind, naming
    what differs (``num_units``: what the run's sampler draws from)."""
    manifest = read_manifest(folder)
    saved = ModelShape(**manifest["model_shape"]).to_dict()  # JSON lists back to the shape's tuples
    differences = [
        f"model.{key}: checkpoint {value!r}, this run {getattr(shape, key)!r}"
        for key, value in saved.items()
        if getattr(shape, key) != value
    ]
    saved_ep = manifest.get("layout", {}).get("ep", 1)
    if shape.is_moe and saved_ep == 1 and manifest.get("expert_optimizer") != "own":
        differences.append(
            "the checkpoint's MoE optimizer state keeps the experts with the other parameters (written by an "
            "earlier version at parallel.ep=1); this version gives experts an optimizer of their own at "
            "every parallel.ep. Export the checkpoint (python -m mcore_packing export) and start from the "
            "Hugging Face folder"
        )
    if manifest["data_fingerprint"] != fingerprint:
        differences.append(
            f"data: the checkpoint was trained on another data set (fingerprint {manifest['data_fingerprint']}, "
            f"this run's {fingerprint}; {manifest['sampler']['num_samples']} vs {num_units} samples)"
        )
    if manifest["sampler"]["seed"] != cfg.training.seed:
        differences.append(f"training.seed: checkpoint {manifest['sampler']['seed']}, this run {cfg.training.seed}")
    if manifest["distributed_optimizer"] != cfg.optimizer.use_distributed_optimizer:
        differences.append(
            f"optimizer.use_distributed_optimizer: checkpoint {manifest['distributed_optimizer']}, this run "
            f"{cfg.optimizer.use_distributed_optimizer} (its optimizer state is stored differently)"
        )
    if differences:
        raise ConfigError(
            f"cannot resume from {folder}: " + "; ".join(differences) + ". Use the same settings, or a new "
            "run_dir to start afresh."
        )


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with tmp.open("w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


class Checkpointer:
    """Saves every ``training.save_interval`` steps and after the last; `resume` restores the newest
    complete checkpoint (see the module docstring)."""

    def __init__(self, cfg: TrainConfig, rank: int, layout, fingerprint: str):
        self.cfg = cfg
        self.folder = checkpoint_folder(cfg)
        self.interval = cfg.training.save_interval
        self.keep_last = cfg.training.keep_last
        self.rank = rank
        self.layout = _layout(layout)
        self.fingerprint = fingerprint

    def due(self, step: int, last_step: int) -> bool:
        """Save after ``step``: on the interval, and after the last step."""
        return (self.interval > 0 and step % self.interval == 0) or step == last_step

    def latest(self) -> Path | None:
        """The newest complete checkpoint, or None."""
        return find_checkpoint(self.folder)

    def _manifest(self, step: int, setup: TrainingSetup, sampler: GlobalBatchSampler) -> dict:
        return {
            "format_version": FORMAT_VERSION,
            "step": step,
            "sampler": sampler.state_dict(),
            "scheduler": setup.policy.scheduler.state_dict(),
            "model_shape": setup.shape.to_dict(),
            "hf_path": self.cfg.model.hf_path,
            "data_fingerprint": self.fingerprint,
            "distributed_optimizer": self.cfg.optimizer.use_distributed_optimizer,
            "layout": self.layout,
            "config": asdict(self.cfg),
            **({"expert_optimizer": "own"} if setup.shape.is_moe else {}),
        }

    def save(self, step: int, setup: TrainingSetup, sampler: GlobalBatchSampler) -> Path:
        """Collective: write the checkpoint of ``step`` (see the module docstring); returns its folder."""
        from ..collectives import barrier
        from ..megatron.dist_checkpoint import save_training_state

        final = self.folder / f"{_STEP_PREFIX}{step:06d}"
        partial = self.folder / f".{final.name}.partial"
        if self.rank == 0:
            self.folder.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(partial, ignore_errors=True)
            partial.mkdir()
        barrier()
        save_training_state(partial, setup.policy.model, setup.policy.optimizer)
        barrier()
        if self.rank == 0:
            manifest = self._manifest(step, setup, sampler)
            manifest["files"] = {p.name: p.stat().st_size for p in sorted(partial.iterdir()) if p.is_file()}
            _write_atomically(partial / MANIFEST, json.dumps(manifest, indent=1))
            if final.exists():  # the same step saved again (a resumed run that re-ran it)
                shutil.rmtree(final)
            os.rename(partial, final)
            _fsync_dir(self.folder)
            _write_atomically(self.folder / "latest", final.name)
            self._prune()
        barrier()
        return final

    def _prune(self) -> None:
        """Delete all but the newest ``keep_last`` complete checkpoints, and leftover partial folders."""
        for stale in self.folder.glob(f".{_STEP_PREFIX}*.partial"):
            shutil.rmtree(stale, ignore_errors=True)
        if self.keep_last is None:
            return
        complete = sorted(p for p in self.folder.glob(f"{_STEP_PREFIX}*") if (p / MANIFEST).is_file())
        for old in complete[: -self.keep_last]:
            shutil.rmtree(old, ignore_errors=True)

    def load(self, folder: Path, setup: TrainingSetup, sampler: GlobalBatchSampler) -> int:
        """Collective: restore model, optimizer, schedule, sampler (and RNG on the same layout); returns the
        checkpoint's step."""
        from ..megatron.dist_checkpoint import load_training_state

        manifest = read_manifest(folder)  # compatible: checked by check_compatible before Megatron started
        same_layout = manifest["layout"] == self.layout
        load_training_state(folder, setup.policy.model, setup.policy.optimizer, restore_rng=same_layout)
        scheduler = setup.policy.scheduler
        # differences were refused in prepare_run unless overriding: then Megatron keeps this run's values
        scheduler.override_opt_param_scheduler = bool(schedule_differences(manifest["scheduler"], self.cfg))
        scheduler.load_state_dict(manifest["scheduler"])
        sampler.load_state_dict(manifest["sampler"])
        return int(manifest["step"])
