"""FP8 alignment per row vs per sequence: the padded tokens each costs on the CHAMP workload of
docs/guides/planning-and-balance.md.

The 19,440 CHAMP conversations in Llama-3 tokens, global batches of 128, ``train_mb_tokens=8192``, planned
exactly as training plans them (`planning.plan_step`, packing mode) on 8 data-parallel ranks, for each
FP8 recipe's alignment (`planning.FP8_ROW_ALIGNMENT`) and two layouts: the guide's TP4 with sequence
parallelism, and CP2 x TP2 with sequence parallelism. Three rules, in one run:

- ``none``: no FP8 alignment (the layout's padding only);
- ``per sequence``: what `PaddingRule` did before: every sequence padded to the alignment (times the CP
  span multiple), the row to the layout's multiple. Emulated here through ``sequence_length_round``;
  the ``aligned`` column says whether every rank's share of every row then divides by the alignment
  (under sequence parallelism it often does not: the sum of aligned spans split over TP ranks);
- ``per row``: `PaddingRule.fp8_alignment`: each row's tail padded once so every rank's share divides.

    python benchmarks/fp8_padding.py      # writes benchmarks/results/fp8_padding.json
"""

from __future__ import annotations

import argparse

import numpy as np
from _report import run_config, write_results

from mcore_packing.data import real_corpus_lengths
from mcore_packing.planning import FP8_ROW_ALIGNMENT, ParallelLayout, StepPlanConfig, plan_step

LAYOUTS = {"tp4 sp": dict(tp=4, sequence_parallel=True), "cp2 tp2 sp": dict(cp=2, tp=2, sequence_parallel=True)}


def _computed(lengths: np.ndarray, config: StepPlanConfig, gbs: int, alignment: int) -> tuple[int, bool]:
    """Tokens in all planned rows, and whether every rank's share of every row divides by ``alignment``."""
    shards = config.padding_rule.row_shards
    total, aligned = 0, True
    for lo in range(0, lengths.size, gbs):
        plan = plan_step(lengths[lo : lo + gbs], config)
        for mb in (m for rank in plan.micro_batches for m in rank):
            rows, width = mb.shape
            total += rows * width
            aligned &= (width // shards) % alignment == 0
    return total, aligned


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb-tokens", type=int, default=8192)
    parser.add_argument("--global-batch-size", type=int, default=128)
    parser.add_argument("--dp", type=int, default=8)
    parser.add_argument("--out", default="benchmarks/results/fp8_padding.json")
    args = parser.parse_args(argv)
    config = run_config(args, corpus="champ (llama3 tokens)")
    lengths = np.asarray(real_corpus_lengths("champ", "llama3"), dtype=np.int64)
    real = int(lengths.sum())
    header = (f"{'layout':<11} {'recipe':<10} {'align':>5} {'none':>11} {'per seq':>11} {'aligned':>7} "
              f"{'per row':>11} {'aligned':>7} {'saved':>11} {'saved/seq':>9}")  # fmt: skip
    print(f"{lengths.size:,} sequences, {real:,} real tokens; padded tokens (computed - real) per rule")
    print(header)
    print("-" * len(header))
    rows = []
    for name, parallel in LAYOUTS.items():
        layout = ParallelLayout(dp=args.dp, **parallel)

        def plan_config(layout=layout, **fields):
            return StepPlanConfig(mode="packing", train_mb_tokens=args.mb_tokens, layout=layout, **fields)

        base, _ = _computed(lengths, plan_config(), args.global_batch_size, 1)
        for recipe, alignment in FP8_ROW_ALIGNMENT.items():
            if recipe == "delayed":
                continue  # the same alignment as tensorwise
            per_seq, seq_ok = _computed(lengths, plan_config(sequence_length_round=alignment),
                                        args.global_batch_size, alignment)  # fmt: skip
            per_row, row_ok = _computed(lengths, plan_config(fp8_alignment=alignment), args.global_batch_size,
                                        alignment)  # fmt: skip
            row = {"layout": name, "recipe": recipe, "alignment": alignment, "padding_none": base - real,
                   "padding_per_sequence": per_seq - real, "per_sequence_aligned": seq_ok,
                   "padding_per_row": per_row - real, "per_row_aligned": row_ok,
                   "tokens_saved": per_seq - per_row, "saved_share_of_per_sequence_padding":
                   (per_seq - per_row) / max(1, per_seq - real)}  # fmt: skip
            rows.append(row)
            print(f"{name:<11} {recipe:<10} {alignment:>5} {base - real:>11,} {per_seq - real:>11,} {seq_ok!s:>7} "
                  f"{per_row - real:>11,} {row_ok!s:>7} {per_seq - per_row:>11,} "
                  f"{row['saved_share_of_per_sequence_padding']:>9.1%}")
    write_results(args.out, config, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
