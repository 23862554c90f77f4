"""Plan quality over many length distributions: efficiency, padding and rank balance, in one run.

For every distribution x budget x data-parallel size, the global batches are planned exactly as training
plans them (`mcore_packing.planning.summarize`) in packing and dynamic mode, and compared with padding
micro-batches of 4 rows to their longest. Costs use the Llama-3-8B shape (`mcore_packing.cost`).

    python benchmarks/plan_quality.py             # writes benchmarks/results/plan_quality.json
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
from _report import run_config, write_results

from mcore_packing.app.plan_command import DEFAULT_SHAPE
from mcore_packing.data import sample_lengths
from mcore_packing.planning import CostModel, ParallelLayout, StepPlanConfig, summarize

DISTRIBUTIONS = ["lognormal", "power_law", "uniform", "real:champ", "real:stdlib"]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--distributions", nargs="+", default=DISTRIBUTIONS)
    parser.add_argument("--budgets", type=int, nargs="+", default=[4096, 16384], help="train_mb_tokens values")
    parser.add_argument("--dp", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--num", type=int, default=8192, help="sequences per distribution")
    parser.add_argument("--global-batch-size", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="benchmarks/results/plan_quality.json")
    args = parser.parse_args(argv)
    model = CostModel.from_shape(DEFAULT_SHAPE)
    config = run_config(args, model_shape=DEFAULT_SHAPE.to_dict())
    header = (
        f"{'distribution':<12} {'budget':>6} {'dp':>3} {'mode':<8} {'effic':>6} {'fill':>6} {'useful':>6} "
        f"{'padded':>6} {'tok_imb':>7} {'cost_imb':>8} {'saved':>6} {'mb/rank':>7} {'time_s':>6}"
    )
    print(header)
    print("-" * len(header))
    rows = []
    for dist in args.distributions:
        for budget in args.budgets:
            lengths = sample_lengths(dist, args.num, budget, seed=args.seed)
            for dp in args.dp:
                for mode in ("packing", "dynamic"):
                    cfg = StepPlanConfig(
                        mode=mode, train_mb_tokens=budget, layout=ParallelLayout(dp=dp), cost_model=model
                    )
                    start = time.perf_counter()
                    s = summarize(lengths, cfg, global_batch_size=args.global_batch_size, padded_rows=4, model=model)
                    seconds = time.perf_counter() - start
                    row = {
                        "distribution": dist,
                        "budget": budget,
                        "dp": dp,
                        "mode": mode,
                        "seconds": seconds,
                        **{k: v for k, v in s.items() if not k.startswith("_")},
                    }
                    rows.append(row)
                    print(
                        f"{dist:<12} {budget:>6} {dp:>3} {mode:<8} {s['packing_efficiency']:>6.3f} "
                        f"{s['capacity_fill']:>6.3f} {s['useful_share_planned']:>6.3f} "
                        f"{s['useful_share_pad_to_longest']:>6.3f} {s['rank_token_imbalance_mean']:>7.3f} "
                        f"{s['rank_cost_imbalance_mean']:>8.3f} {s['compute_saved_with_attention']:>6.1%} "
                        f"{s['micro_batches_per_rank_per_step']:>7.1f} {seconds:>6.2f}",
                        flush=True,
                    )
    print(
        "effic = lower bound / micro-batches; fill = real tokens / (micro-batches x row capacity); useful = real /"
        " computed tokens (planned); padded = the same for pad-to-longest (4 rows); tok_imb / cost_imb = slowest DP "
        "rank / mean, tokens and attention-aware cost; saved = predicted compute saved vs padded."
    )
    write_results(args.out, config, rows)
    summary = {
        mode: float(np.mean([r["rank_cost_imbalance_mean"] for r in rows if r["mode"] == mode and r["dp"] > 1]))
        for mode in ("packing", "dynamic")
        if any(r["dp"] > 1 for r in rows)
    }
    print("mean slowest-rank cost / mean over dp > 1 rows:", json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
