"""Run folder names: the default ``run_dir`` of a run and who is running (the job), without a config.

See `app.run_folder` for what a run folder holds and who may write into it. `default_run_dir` raises
`ValueError` for a case without a good default (the config turns it into a `ConfigError` on ``run_dir``).
"""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

__all__ = ["OUTPUTS", "default_run_dir", "job_identity"]

OUTPUTS = "outputs"


def _launcher() -> tuple[int, float]:
    """The process that started this rank's group: torchrun's agent for its workers (their parent), else
    this process; its pid and start time (seconds since the epoch, from /proc; now where /proc is absent)."""
    pid = os.getppid() if "TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_RANK" in os.environ else os.getpid()
    try:
        ticks = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
        boot = next(float(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                    if line.startswith("btime"))  # fmt: skip
        return pid, boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return pid, time.time()


def job_identity() -> str:
    """Who is running: ``slurm-<job id>`` (every attempt of a requeued job), else the launcher's host, pid
    and start time (every rank of one torchrun on one node agrees)."""
    if os.environ.get("SLURM_JOB_ID"):
        return f"slurm-{os.environ['SLURM_JOB_ID']}"
    pid, started = _launcher()
    return f"{socket.gethostname()}-{pid}-{started:.2f}"


def _several_nodes() -> bool:
    return int(os.environ.get("WORLD_SIZE", "1")) > int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get(
        "WORLD_SIZE", "1")))  # fmt: skip


def default_run_dir(run_name: str, resume) -> str:
    """Where a run with ``run_dir`` unset writes: ``outputs/<run_name>/job<ID>`` under Slurm; with
    ``resume=true`` (or ``auto``, when that run saved a checkpoint) the run ``outputs/<run_name>/latest``
    points at; else a new ``outputs/<run_name>/<launcher start time>-p<launcher pid>``."""
    base = Path(OUTPUTS) / run_name
    if os.environ.get("SLURM_JOB_ID"):
        return str(base / f"job{os.environ['SLURM_JOB_ID']}")
    latest = base / "latest"
    if latest.is_symlink() and (resume is True or (resume == "auto" and (latest / "checkpoints" / "latest").exists())):
        return str(base / os.readlink(latest))  # resume=auto follows it only to a run that saved
    if _several_nodes():
        raise ValueError(
            "run_dir is unset and this torchrun spans several nodes outside Slurm, whose ranks cannot agree on a "
            "new folder: set run_dir=/shared/path (the same on every node)."
        )
    pid, started = _launcher()
    return str(base / f"{time.strftime('%Y%m%d-%H%M%S', time.localtime(started))}-p{pid}")
