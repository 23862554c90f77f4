"""Print how far a Mixture-of-Experts training step is from the unpacked reference, per layout.

Runs the grid of tests/test_moe_equivalence.py (real megatron-core schedules and MoE layers, real gloo
ranks, CPU; 12 samples of 1-40 tokens, 4 experts, top-2, per-sequence balance loss 0.1, z-loss 0.01) and
prints, per layout and mode, the relative errors of the main loss, the router losses and the worst
gradient tensor, and the same for the negative controls (the balance loss over each packed row; expert
counts of each CP shard alone; under dynamic CP, of each shard of a row alone); the 4-rank grid includes
PP2 x VPP2 and dynamic CP (rows of CP 1, 2 and 4):

    python benchmarks/moe_equivalence_report.py          # about two minutes on 2 CPU cores
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def main() -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from tests.distributed_harness import run_distributed
    from tests.test_moe_equivalence import (
        FOUR_RANKS,
        NEGATIVE,
        ONE_RANK,
        TWO_RANKS,
        VPP_AND_DYNAMIC_CP,
        errors,
        run_configs,
    )
    from tests.test_step_equivalence import SAMPLES

    print(f"samples: {len(SAMPLES)}, lengths {[len(s['tokens']) for s in SAMPLES]}")
    ref = run_distributed("tests.moe_workers:reference_worker", 1, samples=SAMPLES)[0]
    print(f"reference: loss {ref['loss']:.6f}, router losses {ref['router_loss']:.6f}")
    grids = [(1, ONE_RANK + NEGATIVE), (2, TWO_RANKS), (4, FOUR_RANKS + VPP_AND_DYNAMIC_CP)]  # negatives last
    for world, configs in grids:
        for r in run_configs(world, configs, ref):
            loss_err, router_err, grad_err = errors(r, ref)
            print(
                f"ranks={world} {json.dumps(r['config'])}: loss_rel_err={loss_err:.1e} "
                f"router_loss_rel_err={router_err:.1e} grad_rel_err_max={grad_err:.1e} "
                f"microbatches/rank={r['num_microbatches']}",
                flush=True,
            )


if __name__ == "__main__":
    main()
