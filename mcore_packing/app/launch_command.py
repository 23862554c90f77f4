"""``python -m mcore_packing launch [torchrun options] <command> [args]``: torchrun, with a stop that exits 0.

    python -m mcore_packing launch --standalone --nproc-per-node 2 train parallel.cp=2
    python -m mcore_packing launch --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d \\
        --rdzv-endpoint host:29500 train --recipe llama3_8b_sft_packed

torchrun's own options come first (its parser reads them), then one of this package's commands. It is
torchrun (``torch.distributed.run``) run in this process, with two defaults changed and one outcome:

- ``--signals-to-handle`` adds SIGUSR1 (Slurm's and job managers' early warning) to torchrun's SIGTERM,
  SIGINT, SIGHUP and SIGQUIT, which it forwards to the ranks;
- ``--shutdown-timeout`` is 300 s instead of 30: how long torchrun waits for the ranks' checkpoint after
  forwarding a signal, before it kills them;
- when a forwarded signal made the ranks save and exit (rank 0 reports it, ``MCORE_PACKING_STOP_REPORT``),
  it exits 0 like a plain ``python -m mcore_packing train`` does; plain torchrun re-raises the signal as a
  ``SignalException`` and exits 1 although its ranks saved.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

from .stop_request import STOP_REPORT_ENV

__all__ = ["main"]

SIGNALS = "SIGTERM,SIGINT,SIGUSR1,SIGHUP,SIGQUIT"
SHUTDOWN_TIMEOUT_S = 300


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    argv = sys.argv[1:] if argv is None else list(argv)
    parser = get_args_parser()
    parser.prog, parser.description = "python -m mcore_packing launch", __doc__
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    args = parser.parse_args(argv)
    if args.training_script == "launch":
        print("launch: after torchrun's options give the command the ranks run (train, ...), not launch.",
              file=sys.stderr)  # fmt: skip
        return 2
    args.training_script_args = [args.training_script, *args.training_script_args]
    args.training_script, args.module = "mcore_packing", True
    if args.signals_to_handle == parser.get_default("signals_to_handle"):
        args.signals_to_handle = SIGNALS
    if args.shutdown_timeout is None:
        args.shutdown_timeout = SHUTDOWN_TIMEOUT_S
    with tempfile.TemporaryDirectory(prefix="mcore_packing_launch_") as folder:
        report = Path(folder) / "stopped"
        os.environ[STOP_REPORT_ENV] = str(report)
        try:
            run(args)
        except ChildFailedError as exc:  # the ranks said why on their stderr; exit with rank 0's code
            rank, failure = min(exc.failures.items())
            print(f"launch: rank {rank} exited with code {failure.exitcode}", file=sys.stderr)
            return failure.exitcode if failure.exitcode > 0 else 1
        except SignalException as exc:
            if report.is_file():  # the ranks saved and exited 0; rank 0 printed where
                return 0
            print(f"launch: {exc.sigval.name} before the ranks could save; they were stopped.", file=sys.stderr)
            return 128 + int(exc.sigval)
    return 0
