"""`RunFolder`: a run folder belongs to one run, and nothing a run wrote is overwritten by another.

Default folders. With ``run_dir`` unset a run writes to ``outputs/<run_name>/<stamp>``: ``job<ID>`` under
Slurm (a requeued job keeps its ID, so ``resume=auto`` finds its own checkpoints), else the launcher's start
time and process id (``20261206-061628-p4242``: the same on every rank of one torchrun, different for two
runs). ``outputs/<run_name>/latest`` is a symlink to the newest; ``resume=true|auto`` with ``run_dir``
unset continues the folder it points at (under Slurm: the job's own folder when it exists). A torchrun
spanning several nodes outside Slurm has no launcher common to all ranks: it must set ``run_dir``.

Identity. ``<run_dir>/run.json`` records the run: its job (the Slurm job, or the launcher), start time,
the hash of its config, its data's fingerprint, its command line, and each later resume. Before anything
is written (and before Megatron starts, `check`):

- a run that starts afresh (``resume=false``, or ``auto`` without a checkpoint) into a folder holding
  another job's run (``run.json``, checkpoints, metrics) is refused, naming the folder and the three ways
  out: ``resume=true``, another ``run_dir``, or ``overwrite=true``, which moves the old run aside to
  ``<run_dir>.replaced-<UTC time>`` (never deletes it);
- a ``run_dir`` that is a file, or a ``training.checkpoint_dir`` that is, is refused.

`claim` (rank 0, after every check) then moves the old run aside if asked, writes ``run.json`` and the
resolved ``config.yaml``, points ``latest`` at the folder, and opens ``train.log``. A refused run writes
nothing.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path

from .config import ConfigError
from .run_names import OUTPUTS, job_identity

__all__ = ["RUN_FILE", "RunFolder", "config_hash"]

RUN_FILE = "run.json"
LOG_FILE = "train.log"
CONFIG_FILE = "config.yaml"

log = logging.getLogger("mcore_packing.train")


def config_hash(cfg) -> str:
    """A hash of the run's settings (``resume`` and ``overwrite`` left out: they say how to start, not what)."""
    settings = {k: v for k, v in asdict(cfg).items() if k not in ("resume", "overwrite")}
    return hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()[:16]


class RunFolder:
    """The run folder of ``cfg`` (``run_dir``) and its checkpoint folder; see the module docstring."""

    def __init__(self, cfg, checkpoints: Path):
        self.cfg = cfg
        self.path = Path(cfg.run_dir)
        self.checkpoints = checkpoints
        self.job = job_identity()

    def record(self) -> dict | None:
        """The folder's ``run.json`` (None when absent or unreadable)."""
        try:
            return json.loads((self.path / RUN_FILE).read_text())
        except (OSError, ValueError):
            return None

    def _is_ours(self) -> bool:
        record = self.record()
        return record is not None and record.get("job") == self.job

    def _evidence(self) -> list[str]:
        """What in the folder shows an earlier run: its record, checkpoints (complete or partial), metrics."""
        found = []
        if (self.path / RUN_FILE).is_file():
            record = self.record() or {}
            found.append(f"{RUN_FILE} (job {record.get('job', '?')}, started {record.get('started', '?')})")
        if self.checkpoints.is_dir():
            steps = sorted(p.name for p in self.checkpoints.iterdir() if p.name.startswith(("step_", ".step_")))
            if steps:
                found.append(f"checkpoints {', '.join(steps[-3:])}{' ...' if len(steps) > 3 else ''} in "
                             f"{self.checkpoints}")  # fmt: skip
        metrics = self.path / self.cfg.logging.metrics_file
        if metrics.is_file() and metrics.stat().st_size:
            found.append(str(metrics.name))
        return found

    def check_keys(self) -> None:
        """Before anything is read: a file where a folder belongs, ``overwrite`` with ``resume=true``."""
        for key, path in (("run_dir", self.path), ("training.checkpoint_dir", self.checkpoints)):
            if path.exists() and not path.is_dir():
                raise ConfigError(f"{key}={path} is a file; a run writes a folder there. Point {key} at a folder "
                                  "(or move the file).", key=key)  # fmt: skip
        if self.cfg.overwrite and self.cfg.resume is True:
            raise ConfigError("overwrite=true starts afresh and moves the old run aside; resume=true continues it. "
                              "Set one of them.", key="overwrite")  # fmt: skip

    def check(self, resume_from: Path | None) -> None:
        """Before anything is written: refuse a fresh start into another run's folder (see the module
        docstring); ``resume_from``: the checkpoint this run continues, if any."""
        self.check_keys()
        if resume_from is not None or self._is_ours():
            return  # continuing this run (a resume, or a requeued job's own folder)
        evidence = self._evidence()
        if evidence and not self.cfg.overwrite:
            raise ConfigError(
                f"run_dir={self.path} holds another run ({'; '.join(evidence)}); a new run never writes over it. "
                "Continue that run with resume=true, give this one another run_dir=..., or set overwrite=true to "
                f"move the old run aside to {self.path}.replaced-<time> (nothing is deleted).", key="run_dir",
            )  # fmt: skip

    def claim(self, *, data_fingerprint: str, resume_from: Path | None, from_step: int) -> logging.Handler:
        """Rank 0, after every check: move another run aside (``overwrite``), write ``run.json`` and
        ``config.yaml``, point ``latest`` here (default folders), and log to ``train.log``; returns that
        log's handler (the caller removes it when the run ends)."""
        if self.cfg.overwrite and resume_from is None and not self._is_ours() and self._evidence():
            self._move_aside()
        self.path.mkdir(parents=True, exist_ok=True)
        now = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        entry = {"job": self.job, "started": now, "config_sha256": config_hash(self.cfg),
                 "data_fingerprint": data_fingerprint, "command": sys.argv}  # fmt: skip
        record = self.record()
        if record is None:
            record = {**entry, "attempts": []}
        else:
            record["attempts"] = [*record.get("attempts", []), {**entry, "from_step": from_step}]
        _write_atomically(self.path / RUN_FILE, json.dumps(record, indent=1))
        _write_atomically(self.path / CONFIG_FILE, _yaml(self.cfg))
        self._point_latest()
        handler = logging.FileHandler(self.path / LOG_FILE)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
        logging.getLogger("mcore_packing").addHandler(handler)
        log.info("run folder %s (job %s)%s", self.path, self.job, f", resuming {resume_from}" if resume_from else "")
        return handler

    def _move_aside(self) -> None:
        stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
        moved = []
        for folder in {self.path, self.checkpoints}:
            if folder.is_dir() and not (folder != self.path and self.path in folder.parents):
                target = folder.with_name(f"{folder.name}.replaced-{stamp}")
                os.rename(folder, target)
                moved.append(f"{folder} -> {target}")
        log.warning("overwrite=true: moved the earlier run aside (%s)", "; ".join(moved))

    def _point_latest(self) -> None:
        """``outputs/<run_name>/latest`` -> this folder, when it is a default one."""
        base = Path(OUTPUTS) / self.cfg.run_name
        if self.path.parent != base:
            return
        tmp = base / f".latest.{os.getpid()}"
        tmp.unlink(missing_ok=True)
        os.symlink(self.path.name, tmp)
        os.replace(tmp, base / "latest")


def _yaml(cfg) -> str:
    from omegaconf import OmegaConf

    return OmegaConf.to_yaml(OmegaConf.create(asdict(cfg)))


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
