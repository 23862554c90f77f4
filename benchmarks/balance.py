"""Data-parallel balance: slowest rank's cost / mean cost, ours vs round-robin vs token-only, same inputs.

Global batches of long-tailed lengths are packed at 32k tokens per micro-batch for 8 data-parallel ranks
with about 8 (and about 1) micro-batches per rank. Cost is the attention-aware FLOP model of a
Llama-3-8B-shaped GPT (`mcore_packing.cost`). Assignments compared on identical bins:

- round_robin: bin i to rank i % 8 (NeMo-RL);
- tokens: LPT + swaps on padded tokens (balances tokens, blind to attention);
- cost: LPT + swaps on attention-aware cost (ours);
- cost + budget: ours with packing under a cost budget as well as the token cap (bins even in work).

    python benchmarks/balance.py            # writes benchmarks/results/balance.json
"""

from __future__ import annotations

import argparse
from dataclasses import replace

import numpy as np
from _report import run_config, write_results

from mcore_packing.app.plan_command import DEFAULT_SHAPE
from mcore_packing.data import sample_lengths
from mcore_packing.planning import CostModel, ParallelLayout, StepPlanConfig, plan_step

STRATEGIES = {
    "round_robin": dict(balance="round_robin"),
    "tokens": dict(balance="tokens"),
    "cost": dict(balance="cost"),
    "cost+budget": dict(balance="cost", cost_budget="auto"),
}


def batch_for(distribution: str, target_bins: int, capacity: int, seed: int) -> np.ndarray:
    """Draw sequences until they fill about ``target_bins`` rows (97% of their capacity)."""
    pool = sample_lengths(distribution, 200_000, capacity, seed=seed)
    cut = int(np.searchsorted(np.cumsum(pool), 0.97 * target_bins * capacity))
    return pool[: max(cut, 8)]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--distributions", nargs="+", default=["lognormal", "power_law:64", "real:stdlib"])
    parser.add_argument("--capacity", type=int, default=32768)
    parser.add_argument("--dp", type=int, default=8)
    parser.add_argument("--mb-per-rank", type=int, nargs="+", default=[8, 1])
    parser.add_argument("--batches", type=int, default=10, help="global batches per setting (different seeds)")
    parser.add_argument("--out", default="benchmarks/results/balance.json")
    args = parser.parse_args(argv)
    model = CostModel.from_shape(DEFAULT_SHAPE)
    config = run_config(args, model_shape=DEFAULT_SHAPE.to_dict())
    header = f"{'distribution':<13} {'mb/rank':>7} " + " ".join(f"{name:>22}" for name in STRATEGIES)
    print(header + "\n" + "-" * len(header))
    rows = []
    for dist in args.distributions:
        for per_rank in args.mb_per_rank:
            results = {name: [] for name in STRATEGIES}
            counts = []
            for seed in range(args.batches):
                lengths = batch_for(dist, args.dp * per_rank, args.capacity, seed)
                base = StepPlanConfig(
                    mode="packing", train_mb_tokens=args.capacity, layout=ParallelLayout(dp=args.dp), cost_model=model
                )
                for name, change in STRATEGIES.items():
                    plan = plan_step(lengths, replace(base, **change))
                    loads = [sum(mb.cost for mb in rank) for rank in plan.micro_batches]
                    assert all(mb.padded_tokens <= args.capacity for rank in plan.micro_batches for mb in rank)
                    results[name].append(max(loads) / np.mean(loads))
                    if name == "cost":
                        counts.append(plan.num_microbatches)
            row = {
                "distribution": dist,
                "target_mb_per_rank": per_rank,
                "mean_mb_per_rank": float(np.mean(counts)),
                **{name: {"mean": float(np.mean(v)), "max": float(np.max(v))} for name, v in results.items()},
            }
            rows.append(row)
            cells = " ".join(f"{row[n]['mean']:>10.3f} (max {row[n]['max']:.3f})" for n in STRATEGIES)
            print(f"{dist:<13} {np.mean(counts):>7.1f} {cells}", flush=True)
    print("cells: slowest DP rank's predicted cost / mean over ranks, mean over global batches (and the worst).")
    write_results(args.out, config, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
