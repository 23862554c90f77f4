"""Plans that minimise step time: rank balance, pipeline order and planning speed, in one run.

1. The planning guide's workload (19,440 CHAMP conversations, 8 DP ranks, global batches of 512,
   ``train_mb_tokens=16384``, Llama-3-8B costs) with each balance: slowest rank / mean attention-aware
   cost (mean over steps and worst), micro-batches, rows below half full.
2. PP=4, about 8 micro-batches per rank, CHAMP and lognormal lengths: simulated 1F1B step time over its
   lower bound for each micro-batch order, plain and interleaved (PP=4 x VPP=2: counts per rank a
   multiple of 4), and the interleaved step time over the plain one (same data, the best order of each).
3. Planning time of one step: 512 CHAMP samples (median of all 37 full steps) and 65,536 lognormal
   samples (one step, DP=8).

    python benchmarks/step_time_plan.py           # about half a minute on 2 cores
"""

from __future__ import annotations

import statistics
import sys
import time

import numpy as np
from _report import run_config, write_results

from mcore_packing.app.plan_command import DEFAULT_SHAPE
from mcore_packing.data import real_corpus_lengths, sample_lengths
from mcore_packing.planning import CostModel, ParallelLayout, StepPlanConfig, plan_step, summarize


def balance_rows(model) -> list[dict]:
    lengths = real_corpus_lengths("champ")
    rows = []
    for balance in ("round_robin", "tokens", "cost"):
        config = StepPlanConfig(train_mb_tokens=16384, layout=ParallelLayout(dp=8), balance=balance, cost_model=model)
        s = summarize(lengths, config, global_batch_size=512, padded_rows=4, model=model)
        rows.append(
            {
                "table": "balance",
                "balance": balance,
                "cost_imbalance_mean": s["rank_cost_imbalance_mean"],
                "cost_imbalance_worst": s["rank_cost_imbalance_worst"],
                "micro_batches": s["micro_batches"],
                "below_half_full": s["below_half_full"],
                "below_half_forced": s["below_half_full_forced_by_equal_counts"],
            }
        )
        print(
            f"CHAMP dp=8 balance={balance:<11} slowest/mean cost {s['rank_cost_imbalance_mean']:.4f} (worst "
            f"{s['rank_cost_imbalance_worst']:.4f}), {s['micro_batches']} micro-batches, below half full "
            f"{s['below_half_full']} ({s['below_half_full_forced_by_equal_counts']} forced by equal counts)",
            flush=True,
        )
    return rows


def pipeline_rows(model) -> list[dict]:
    sets = {
        "CHAMP": (real_corpus_lengths("champ"), 512, 9472),
        "lognormal": (sample_lengths("lognormal", 40_000, 8192, seed=0), 640, 8192),
    }
    rows = []
    for name, (lengths, batch, budget) in sets.items():
        step_cost = {}
        for vpp in (1, 2):
            for order in ("packer", "largest_first", "bubble", "pipeline"):
                layout = ParallelLayout(dp=8, pp=4, vpp=vpp)
                config = StepPlanConfig(train_mb_tokens=budget, layout=layout, microbatch_order=order, cost_model=model)
                s = summarize(lengths, config, global_batch_size=batch, padded_rows=4, model=model)
                step_cost[vpp, order] = s["predicted_step_cost"]
                rows.append(
                    {
                        "table": "pipeline",
                        "lengths": name,
                        "vpp": vpp,
                        "order": order,
                        "micro_batches_per_rank": s["micro_batches_per_rank_per_step"],
                        "over_lower_bound": s["predicted_over_lower_bound"],
                        "predicted_step_cost": s["predicted_step_cost"],
                    }
                )
                print(
                    f"PP=4 VPP={vpp} {name:<9} {s['micro_batches_per_rank_per_step']:.1f} mb/rank order={order:<13} "
                    f"simulated 1F1B / lower bound {s['predicted_over_lower_bound']:.4f}",
                    flush=True,
                )
        ratio = step_cost[2, "pipeline"] / step_cost[1, "pipeline"]
        rows.append({"table": "interleaved_vs_plain", "lengths": name, "ratio": ratio})
        print(f"PP=4 {name}: interleaved (VPP=2) / plain simulated step time, best orders: {ratio:.4f}", flush=True)
    return rows


def speed_rows(model) -> list[dict]:
    champ = real_corpus_lengths("champ")
    config = StepPlanConfig(train_mb_tokens=16384, layout=ParallelLayout(dp=8), cost_model=model)
    times = []
    for lo in range(0, champ.size - 511, 512):
        start = time.perf_counter()
        plan_step(champ[lo : lo + 512], config)
        times.append(time.perf_counter() - start)
    big = sample_lengths("lognormal", 65_536, 16384, seed=1)
    start = time.perf_counter()
    plan = plan_step(big, config)
    seconds = time.perf_counter() - start
    costs = plan.rank_costs()
    print(
        f"planning 512 CHAMP samples: median {statistics.median(times) * 1e3:.1f} ms, max {max(times) * 1e3:.1f} ms; "
        f"65,536 lognormal samples: {seconds:.2f} s (slowest/mean cost {max(costs) / np.mean(costs):.4f})",
        flush=True,
    )
    return [
        {"table": "speed", "samples": 512, "median_s": statistics.median(times), "max_s": max(times)},
        {"table": "speed", "samples": 65536, "seconds": seconds, "imbalance": max(costs) / np.mean(costs)},
    ]


def main(argv=None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="benchmarks/results/step_time_plan.json")
    args = parser.parse_args(argv)
    config = run_config(args, model_shape=DEFAULT_SHAPE.to_dict())
    model = CostModel.from_shape(DEFAULT_SHAPE)
    rows = balance_rows(model) + pipeline_rows(model) + speed_rows(model)
    write_results(args.out, config, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
