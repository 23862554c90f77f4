"""Dynamic against static context parallelism: predicted step time, same ranks, same budget, same cost model.

Static CP (`plan_step` at cp=CP, dp=W/CP, cost-balanced) cuts every sequence over CP ranks; dynamic CP
(`planning.dynamic_cp`) gives each sequence the smallest CP size its length needs over the same W ranks.
Both are priced by one `CostModel`: the model's attention-aware FLOPs plus the CP exchange
(`CostModel.with_cp_exchange`: keys and values of the other ranks' tokens, once forward and twice
backward, at an interconnect's FLOPs per byte, and a latency per exchange step). A pure FLOP count
cannot tell CP sizes apart (the FLOPs are the same), so the exchange is what the comparison measures;
the table shows the assumption next to each number and a FLOPs-only row.

Rows: packed THD rows (sequence packing) and, with ``--modes dynamic``, dynamic batching's padded BSHD
rows (static CP against dynamic CP, both in that mode).

Workloads: Megatron's dynamic-CP example (lognormal lengths, mean 1024, sigma 1.5, clipped to 128-8192,
TP1 CP4, 2048 tokens per rank) and CHAMP conversations with a long-context budget (CP4, 2560 tokens per
rank: the longest conversation needs all four), 16 samples per rank per step, 8 steps, at 8, 16, 32 and
64 ranks; the model of Megatron's example (12 layers, width 2048, 16 heads without GQA: 8 KiB of keys and
values per token and layer), Llama-3-8B and Llama-3.2-1B (GQA with 8 key/value heads: 4 and 2 KiB).

    python benchmarks/dynamic_cp.py          # about a minute on 2 cores (both row kinds)
"""

from __future__ import annotations

import sys

import numpy as np
from _report import run_config, write_results

from mcore_packing.app.plan_command import DEFAULT_SHAPE
from mcore_packing.data import real_corpus_lengths
from mcore_packing.planning import CostModel, ModelShape, ParallelLayout, StepPlanConfig
from mcore_packing.planning.report import summarize_dynamic_cp

SHAPES = {
    # the model of Megatron's own dynamic-CP example (examples/dynamic_context_parallel/benchmark_dcp.sh):
    # 12 layers, width 2048, MLP 8192 (GeLU), 16 heads without GQA, vocabulary 131072
    "megatron-example": ModelShape(num_layers=12, hidden_size=2048, num_attention_heads=16, ffn_hidden_size=8192,
                                   vocab_size=131072),
    "llama3-8b": DEFAULT_SHAPE,
    "llama3.2-1b": ModelShape(num_layers=16, hidden_size=2048, num_attention_heads=32, num_query_groups=8,
                              ffn_hidden_size=8192, vocab_size=128256, gated_mlp=True, normalization="RMSNorm"),
}  # fmt: skip
# H100 SXM, bf16: 400 TFLOP/s achieved; a CP group inside a node (NVLink: 150 GB/s achieved per direction,
# 20 us per exchange step) or across nodes (InfiniBand: 25 GB/s per GPU, 30 us).
LINKS = {
    "flops only": {"flops_per_byte": 0.0, "step_latency_flops": 0.0},
    "NVLink 150 GB/s, 20 us": {"flops_per_byte": 400e12 / 150e9, "step_latency_flops": 20e-6 * 400e12},
    "InfiniBand 25 GB/s, 30 us": {"flops_per_byte": 400e12 / 25e9, "step_latency_flops": 30e-6 * 400e12},
}
CP, STEPS, PER_RANK = 4, 8, 16
# what both plans look like (`summarize_dynamic_cp`): real share of computed tokens, micro-batches per rank per
# step, and the dynamic plan's slowest rank over the mean in its worst step
PLAN_KEYS = ("utilization", "static_utilization", "micro_batches_per_rank_per_step",
             "static_micro_batches_per_rank_per_step", "worst_rank_finish_over_mean")  # fmt: skip


def lognormal(n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.clip(np.rint(rng.lognormal(np.log(1024) - 1.5**2 / 2, 1.5, n)), 128, 8192).astype(np.int64)


def workloads() -> dict:
    champ = real_corpus_lengths("champ")
    return {
        "lognormal (Megatron's example), 2048/rank": (lambda n, seed: lognormal(n, seed), 2048),
        "CHAMP, 2560/rank": (lambda n, seed: np.random.default_rng(seed).choice(champ, n), 2560),
    }


def batches(draw, ranks: int) -> np.ndarray:
    """The run's STEPS global batches of ``ranks * PER_RANK`` samples, one after the other."""
    return np.concatenate([draw(ranks * PER_RANK, 1000 * ranks + step) for step in range(STEPS)])


def main(argv=None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="benchmarks/results/dynamic_cp.json")
    parser.add_argument("--ranks", type=int, nargs="+", default=[8, 16, 32, 64])
    parser.add_argument("--modes", nargs="+", choices=["packing", "dynamic"], default=["packing", "dynamic"],
                        help="rows: packing (THD) and/or dynamic (dynamic batching's BSHD rows)")
    args = parser.parse_args(argv)
    run = run_config(args, cp=CP, steps=STEPS, samples_per_rank=PER_RANK, links=LINKS)
    rows = []
    for mode in args.modes:
        for workload, (draw, budget) in workloads().items():
            for shape_name, shape in SHAPES.items():
                for link, constants in LINKS.items():
                    model = CostModel.from_shape(shape).with_cp_exchange(shape, **constants)
                    for ranks in args.ranks:
                        layout = ParallelLayout(cp=CP, dp=ranks // CP)
                        config = StepPlanConfig(mode=mode, train_mb_tokens=budget, layout=layout, cost_model=model)
                        s = summarize_dynamic_cp(batches(draw, ranks), config, global_batch_size=ranks * PER_RANK)
                        ratio, sizes = s["static_over_dynamic"], s["cp_sizes"]
                        plans = {key: s[key] for key in PLAN_KEYS}
                        rows.append({"mode": mode, "workload": workload, "model": shape_name, "link": link,
                                     "ranks": ranks, "static_over_dynamic": ratio, "cp_sizes": sizes,
                                     **plans})  # fmt: skip
                        print(f"{mode:<8} {workload:<42} {shape_name:<16} {link:<26} {ranks:>3} ranks: static / "
                              f"dynamic predicted step time {ratio:.3f}  (sequences per CP size {sizes}; real "
                              f"tokens {plans['utilization']:.3f} vs static {plans['static_utilization']:.3f}; "
                              f"micro-batches per rank {plans['micro_batches_per_rank_per_step']:.1f} vs "
                              f"{plans['static_micro_batches_per_rank_per_step']:.1f}; slowest rank / mean "
                              f"{plans['worst_rank_finish_over_mean']:.3f})", flush=True)  # fmt: skip
    write_results(args.out, run, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
