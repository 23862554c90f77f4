"""`StopRequest`: a cluster asks the run to save and exit (a job near its time limit, or preempted).

The Slurm launcher (``slurm/launch.sh``) traps the signal that ``#SBATCH --signal=B:USR1@<seconds>``
sends the batch shell, and creates the file named by ``MCORE_PACKING_STOP_FILE``. After each step every
rank asks `requested`: rank 0 looks for the file and one all-reduce tells all ranks the same answer, so
they save the same step together and leave the loop; the launcher then requeues the job, whose
``resume=auto`` continues from that checkpoint. A file rather than a signal in the Python processes,
because torchrun treats signals it does not forward as fatal, and a batch-shell signal reaches no rank.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["STOP_FILE_ENV", "StopRequest"]

STOP_FILE_ENV = "MCORE_PACKING_STOP_FILE"


class StopRequest:
    """Whether the launcher asked for a stop (one tiny all-reduce per step when a stop file is set)."""

    def __init__(self, path: str | None = None):
        path = path if path is not None else os.environ.get(STOP_FILE_ENV)
        self.path = Path(path) if path else None
        self.reason = f"{self.path} exists" if self.path else None

    def requested(self) -> bool:
        """The same answer on every rank (collective when a stop file is configured)."""
        if self.path is None:
            return False
        import torch.distributed as dist

        from ..collectives import all_reduce_values

        (flag,) = all_reduce_values([1.0 if dist.get_rank() == 0 and self.path.exists() else 0.0], None, op="max")
        return flag > 0
