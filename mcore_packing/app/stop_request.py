"""`StopRequest`: the run is asked to save and exit (a job near its time limit, preempted, or stopped).

Two ways to ask, both answered at the next step boundary with a checkpoint and exit code 0:

- **A signal** to any rank: SIGTERM, SIGINT or SIGUSR1 (``training.stop_signals``), what Kubernetes,
  Slurm's ``--signal``, job managers and Ctrl-C send. The handler only records it (a line on stderr);
  a second signal more than `REPEAT_WINDOW_S` after the first exits at once without saving (one sent
  twice by a launcher and by the cluster, as Slurm's end-of-job SIGTERM reaching torchrun and its
  workers, counts once). torchrun forwards SIGTERM and SIGINT to its workers (add SIGUSR1 with
  ``--signals-to-handle``; ``--shutdown-timeout`` is how long it waits for their save) and then exits 1
  whatever they did; ``python -m mcore_packing launch`` (`app.launch_command`) is torchrun with SIGUSR1
  added, a longer wait, and exit 0 after a save.
- **A stop file**, named by ``MCORE_PACKING_STOP_FILE``: the Slurm launcher (``slurm/launch.sh``) creates
  it when ``#SBATCH --signal=B:USR1@<seconds>`` signals the batch shell, which reaches no rank.

After each step every rank calls `requested`: one all-reduce (max) of this rank's request tells every
rank the same answer, so they save the same step together and leave the loop.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path

__all__ = ["DEFAULT_STOP_SIGNALS", "REPEAT_WINDOW_S", "STOP_FILE_ENV", "STOP_REPORT_ENV", "StopRequest",
           "check_stop_signals"]  # fmt: skip

STOP_FILE_ENV = "MCORE_PACKING_STOP_FILE"
STOP_REPORT_ENV = "MCORE_PACKING_STOP_REPORT"
"""Set by ``python -m mcore_packing launch``: rank 0 writes its stop line there after the ranks saved."""
DEFAULT_STOP_SIGNALS = ("SIGTERM", "SIGINT", "SIGUSR1")
REPEAT_WINDOW_S = 2.0
_FILE_CODE = 1000  # the all-reduced request of a stop file (signals are their numbers, all below it)


def check_stop_signals(names) -> list[signal.Signals]:
    """``training.stop_signals`` as signals; `ValueError` naming a name that is none, or one no process
    can catch (SIGKILL, SIGSTOP)."""
    out = []
    for name in names:
        sig = getattr(signal.Signals, str(name), None)
        if sig is None or sig in (signal.SIGKILL, signal.SIGSTOP):
            raise ValueError(
                f"stop_signals: {name!r} is not a signal a process can catch; use names such as "
                f"{list(DEFAULT_STOP_SIGNALS)} (an empty list: no handler)."
            )
        out.append(sig)
    return out


class StopRequest:
    """A run's stop request (see the module docstring). `install` the handlers for the loop's lifetime;
    `uninstall` restores the previous ones."""

    def __init__(self, signals=DEFAULT_STOP_SIGNALS, path: str | None = None):
        self.signals = check_stop_signals(signals)
        path = path if path is not None else os.environ.get(STOP_FILE_ENV)
        self.path = Path(path) if path else None
        self.received: signal.Signals | None = None
        self._first = 0.0
        self._previous: dict = {}
        self.reason: str | None = None

    def install(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            for sig in self.signals:
                self._previous[sig] = signal.signal(sig, self._on_signal)
        return self

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _on_signal(self, signum: int, frame) -> None:
        sig, now = signal.Signals(signum), time.monotonic()
        rank = os.environ.get("RANK", "0")
        if self.received is None:
            self.received, self._first = sig, now
            print(f"[rank {rank}] {sig.name}: saving a checkpoint after this step, then exiting (send it again to "
                  "exit at once, without saving)", file=sys.stderr, flush=True)  # fmt: skip
        elif now - self._first > REPEAT_WINDOW_S:
            print(f"[rank {rank}] {sig.name} again: exiting now, without saving", file=sys.stderr, flush=True)
            os._exit(128 + signum)

    def requested(self, *, world_size: int, rank: int) -> bool:
        """Whether any rank was asked to stop: the same answer on every rank (one all-reduce when
        ``world_size > 1``). Sets `reason`."""
        local = float(self.received or 0)
        if not local and rank == 0 and self.path is not None and self.path.exists():
            local = float(_FILE_CODE)
        if world_size > 1:
            from ..collectives import all_reduce_values

            (local,) = all_reduce_values([local], None, op="max")
        if not local:
            return False
        code = int(local)
        self.reason = f"{self.path} exists" if code == _FILE_CODE else signal.Signals(code).name
        return True
