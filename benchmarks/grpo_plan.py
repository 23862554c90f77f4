"""The GRPO policy step at Qwen2.5-7B scale, planned: how much compute each batching mode wastes, in one run.

The `qwen2_7b_grpo_cp` recipe's step: 64 prompts x 8 responses, TP4 x CP2 on 2 nodes of 8 GPUs (DP=2),
a training pass at ``train_mb_tokens=8192`` and a forward-only log-prob pass at 16384 tokens per GPU.
Lengths are seeded and long-tailed: prompts lognormal (median 300 tokens), responses lognormal (median
700, sigma 1.1, capped at 12,000), the prompt + response under the 16k row. For each pass and mode the
planner prices every micro-batch with Qwen2.5-7B's attention-aware cost model (`CostModel.from_shape`);
the step waits for its slowest DP rank, so the predicted pass time is the largest per-rank cost sum.

- packing: the recipe (THD rows, MFFD, cost-balanced ranks); in the log-prob pass also with each group of 8
  kept in one row (``grpo.keep_groups_together``).
- dynamic: length-sorted BSHD micro-batches under the same token budget.
- padded: 4 rows per micro-batch padded to their longest (the pad-to-longest loaders).

Printed per pass: computed / real tokens, micro-batches per rank, and the predicted time relative to
packing, as the mean over 20 steps.

    python benchmarks/grpo_plan.py        # a few seconds on 2 cores; JSON: results/grpo_plan.json
"""

from __future__ import annotations

import argparse
import dataclasses

import numpy as np
from _report import run_config, write_results

from mcore_packing.app.recipes import qwen2_7b_grpo_cp
from mcore_packing.app.run_settings import plan_config
from mcore_packing.planning import CostModel, plan_step


def rollout_lengths(rng: np.random.Generator, prompts: int, per_prompt: int) -> tuple[list[int], list[int]]:
    """Prompt + response lengths of one GRPO step, and the group (prompt) of each."""
    lengths, groups = [], []
    for g in range(prompts):
        prompt = int(min(4000, max(16, rng.lognormal(np.log(300), 0.8))))
        for _ in range(per_prompt):
            response = int(min(12_000, max(1, rng.lognormal(np.log(700), 1.1))))
            lengths.append(prompt + response)
            groups.append(g)
    return lengths, groups


def configs(dp: int):
    """The recipe's planner config per mode (the same budgets, the recipe's layout)."""
    base = qwen2_7b_grpo_cp(num_nodes=2, gpus_per_node=8)
    dynamic = dataclasses.replace(base.dynamic_batching, enabled=True, train_mb_tokens=8192, logprob_mb_tokens=16384)
    padded = dataclasses.replace(base.training, padded_micro_batch_rows=4)
    no_packing = dataclasses.replace(base.sequence_packing, enabled=False)
    layout = base.parallel.layout(dp * base.parallel.layout().model_parallel_size)
    dynamic_cfg = dataclasses.replace(base, sequence_packing=no_packing, dynamic_batching=dynamic)
    return base, {
        "packing": plan_config(base, layout),
        "dynamic": plan_config(dynamic_cfg, layout),
        "padded": plan_config(dataclasses.replace(base, sequence_packing=no_packing, training=padded), layout),
    }


def measure(plan) -> dict:
    stats = plan.stats()
    return {
        "computed_over_real": stats["padded_tokens"] / stats["real_tokens"],
        "microbatches_per_rank": stats["num_microbatches_per_rank"],
        "predicted_cost": stats["predicted_step_cost"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="benchmarks/results/grpo_plan.json")
    args = parser.parse_args()
    dp = 2
    base, by_mode = configs(dp)
    config = run_config(args, recipe="qwen2_7b_grpo_cp", dp=dp, prompts=64, per_prompt=8)
    rng = np.random.default_rng(args.seed)
    runs: dict = {}
    for _ in range(args.steps):
        lengths, groups = rollout_lengths(rng, 64, 8)
        for mode, step_config in by_mode.items():
            for forward_only in (False, True):
                name = f"{'log-prob' if forward_only else 'training'} {mode}"
                plan = plan_step(lengths, step_config, forward_only=forward_only)
                runs.setdefault(name, []).append(measure(plan))
        try:  # one row of 32k tokens must hold all 8 responses of a prompt
            grouped = measure(plan_step(lengths, by_mode["packing"], forward_only=True, groups=groups))
        except ValueError:
            grouped = None
        runs.setdefault("log-prob packing, groups kept", []).append(grouped)
    rows = []
    for name, all_items in runs.items():
        kept = [k for k, m in enumerate(all_items) if m is not None]
        items = [all_items[k] for k in kept]
        packed = [runs[f"{name.split()[0]} packing"][k] for k in kept]
        if not items:
            print(f"{name:<30} impossible in all {len(all_items)} steps (a group is larger than one row)")
            rows.append({"pass": name, "impossible_steps": len(all_items)})
            continue
        ratios = [m["predicted_cost"] / p["predicted_cost"] for m, p in zip(items, packed, strict=True)]
        row = {
            "pass": name,
            "computed_over_real": float(np.mean([m["computed_over_real"] for m in items])),
            "microbatches_per_rank": float(np.mean([m["microbatches_per_rank"] for m in items])),
            "time_vs_packing": float(np.mean(ratios)),
            "impossible_steps": len(all_items) - len(items),
        }
        rows.append(row)
        print(f"{name:<30} computed/real tokens {row['computed_over_real']:.3f} | micro-batches/rank "
              f"{row['microbatches_per_rank']:5.1f} | predicted time vs packing {row['time_vs_packing']:.2f}x"
              + (f" (impossible in {row['impossible_steps']} of {len(all_items)} steps: a group exceeds one row)"
                 if row["impossible_steps"] else ""))  # fmt: skip
    print(f"model: {base.model.hidden_size} hidden, {base.model.num_layers} layers (Qwen2.5-7B); cost model "
          f"{CostModel.from_shape(base.model.shape(152064)).unit}")  # fmt: skip
    write_results(args.out, config, rows)


if __name__ == "__main__":
    main()
