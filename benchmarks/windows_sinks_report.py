"""Print how far a packed step with sliding windows and attention sinks is from Megatron's own attention
run one sequence per forward, per layout and window.

Runs the cases of tests/test_windows_and_sinks.py (real megatron-core schedules, real gloo ranks, CPU; 12
samples of 1-40 tokens; layers 1 and 3 windowed, learnable sinks on every layer drawn at scale 1) and
prints the relative errors of the loss and of the worst gradient tensor; last the negative control (each
packed row attended as one sequence, so a window reaches across the boundary):

    python benchmarks/windows_sinks_report.py          # about half a minute on 2 CPU cores
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def main() -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from tests.distributed_harness import run_distributed
    from tests.test_step_equivalence import SAMPLES
    from tests.test_windows_and_sinks import CONFIGS, LONG, SHORT, errors

    refs = run_distributed("tests.window_workers:window_reference_worker", 1, samples=SAMPLES, windows=[SHORT, LONG])[0]
    results = run_distributed("tests.window_workers:window_step_worker", 2, configs=CONFIGS, samples=SAMPLES,
                              references=refs, timeout=900)[0]  # fmt: skip
    for r in results:
        loss_err, grad_err = errors(r, refs)
        print(f"ranks=2 {json.dumps(r['config'])}: loss_rel_err={loss_err:.1e} grad_rel_err_max={grad_err:.1e} "
              f"microbatches/rank={r['num_microbatches']}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
