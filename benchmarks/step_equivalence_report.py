"""Print how far each parallel layout's step is from the single-process unpacked reference.

Runs the same configurations as tests/test_step_equivalence.py (real megatron-core schedules, real gloo
ranks, CPU) and prints the loss and worst per-tensor gradient relative errors, and log-prob errors:

    python benchmarks/step_equivalence_report.py            # 1- and 2-rank layouts and negative controls
    python benchmarks/step_equivalence_report.py --eight    # also TP2xPP2xCP2 and PP2xCP2xDP2 (8 ranks)
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def main() -> None:
    from tests.distributed_harness import run_distributed
    from tests.test_step_equivalence import EIGHT_RANKS, NEGATIVE, SAMPLES, SINGLE, TWO_RANKS, grad_errors, run_configs

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--eight", action="store_true", help="also run the 8-rank layouts")
    args = parser.parse_args()
    print(f"samples: {len(SAMPLES)}, lengths {[len(s['tokens']) for s in SAMPLES]}")
    ref = run_distributed("tests.step_workers:reference_worker", 1, samples=SAMPLES)[0]
    worlds = [(1, SINGLE), (2, TWO_RANKS + NEGATIVE)] + ([(8, EIGHT_RANKS)] if args.eight else [])
    for world, configs in worlds:
        for r in run_configs(world, configs, ref):
            norm = r["config"].get("normalization", "token_mean")
            errors = grad_errors(r["grads"], ref[norm]["grads"])
            loss_err = abs(r["loss"] - ref[norm]["loss"]) / abs(ref[norm]["loss"])
            extra = ""
            if r["logprobs"] is not None:
                lp = max(
                    float((r["logprobs"][i, : t.numel()] - t).abs().max())
                    for i, t in enumerate(ref["logprobs"])
                    if t.numel()
                )
                extra = f" logprob_abs_err={lp:.1e}"
            print(
                f"ranks={world} {json.dumps(r['config'])}: loss_rel_err={loss_err:.1e} "
                f"grad_rel_err_max={max(errors.values()):.1e}{extra} microbatches/rank={r['num_microbatches']}",
                flush=True,
            )


if __name__ == "__main__":
    main()
