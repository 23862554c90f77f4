"""Print how far a router-replay training step is from the unpacked replay reference, per layout.

Runs the cases of tests/test_router_replay.py (real megatron-core schedules and MoE layers, real gloo
ranks, CPU; 12 samples of 1-40 tokens, 4 experts, top-2, balance loss 0.1, z-loss 0.01; routes recorded
from an unpacked forward, then the routers perturbed) and prints the share of (token, layer) choices fresh
routing changes, then per layout the relative errors of the loss, the router losses and the worst gradient
tensor, whether every (layer, expert) count of real tokens equals the recorded routes', and the replay's
own mismatch metric; last the negative control (the same step without the routes):

    python benchmarks/router_replay_report.py          # about a minute on 2 CPU cores
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def main() -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    from tests.distributed_harness import run_distributed
    from tests.test_moe_equivalence import errors
    from tests.test_router_replay import LAYOUTS, run
    from tests.test_step_equivalence import SAMPLES

    ref = run_distributed("tests.replay_workers:replay_reference_worker", 1, samples=SAMPLES)[0]
    print(f"samples: {len(SAMPLES)}; reference: loss {ref['loss']:.6f}, router losses {ref['router_loss']:.6f}; "
          f"fresh routing differs from the recorded routes in {ref['fresh_mismatch']:.1%} of (token, layer) choices")
    cases = [(1, [{"mode": "packing"}, {"mode": "dynamic"}]), (4, LAYOUTS)]
    for world, configs in cases:
        for r in run(world, configs, ref):
            loss_err, router_err, grad_err = errors(r, ref)
            mismatch = "-" if r["mismatch"] is None else f"{r['mismatch']:.1%}"
            print(f"ranks={world} {json.dumps(r['config'])}: loss_rel_err={loss_err:.1e} "
                  f"router_loss_rel_err={router_err:.1e} grad_rel_err_max={grad_err:.1e} "
                  f"counts_equal={torch.equal(r['counts'], ref['counts'])} replay_mismatch={mismatch} "
                  f"microbatches/rank={r['num_microbatches']}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
