"""Does the cost model order plans as measured step times do? The embedded default model, on this CPU.

The README's main-job model (a real Megatron GPTModel, 2 layers, width 128) and CHAMP conversations:
each global batch is planned for 4 data-parallel ranks with each balance (round_robin, tokens, cost);
every rank's share then runs forward+backward through Megatron's schedule in this one process, timed on
its own (the ranks of a real job run at once, so the step takes as long as the slowest share; timing them
one after the other measures exactly that without four processes fighting over two cores).

Pass 1 plans with the FLOP cost model and records every share's lengths, seconds and micro-batches;
`CostModel.calibrate` fits seconds per token, per squared length, per sequence and per micro-batch to
them. Pass 2 plans the same batches with the calibrated model. For each pass the benchmark prints the
slowest share measured and predicted per balance, and whether they rank the balances the same way.

    python benchmarks/balance_measured.py          # about 2 minutes on 2 cores
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import statistics
import sys
import time

from _report import run_config, write_results

BALANCES = ("round_robin", "tokens", "cost")


def main(argv=None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=3, help="global batches per balance (after one warm-up)")
    parser.add_argument("--batch-size", type=int, default=48)
    parser.add_argument("--dp", type=int, default=4, help="simulated data-parallel ranks")
    parser.add_argument("--out", default="benchmarks/results/balance_measured.json")
    args = parser.parse_args(argv)
    import torch
    import torch.distributed as dist

    from mcore_packing.app.config import ModelConfig
    from mcore_packing.app.global_batches import GlobalBatchSampler
    from mcore_packing.data.sft import load_sft_data
    from mcore_packing.megatron import (
        ProcessGroups,
        build_gpt_model,
        cpu_device_adapter,
        forward_backward,
        initialize_parallel,
        start_world_of_one,
    )
    from mcore_packing.planning import CostModel, StepPlanConfig, plan_step

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    start_world_of_one("gloo")
    initialize_parallel()
    data = load_sft_data(num_samples=512)
    shape = ModelConfig(num_query_groups=2, ffn_hidden_size=512).shape(data.vocab_size)  # the main job's model
    model_cost = CostModel.from_shape(shape)
    config = run_config(args, model_shape=shape.to_dict())
    sampler = GlobalBatchSampler(len(data.samples), args.batch_size, seed=0)
    batches = [sampler.next_batch() for _ in range(args.steps + 1)]
    rows, shares = [], []
    with cpu_device_adapter() if not torch.cuda.is_available() else contextlib.nullcontext():
        model, _ = build_gpt_model(shape)
        pgs = ProcessGroups.from_megatron()
        run = lambda plan, samples: _measure(plan, samples, model, pgs, forward_backward, args.dp)  # noqa: E731
        # Pass 1: the FLOP cost model; every rank's share is a measurement for the calibration.
        flops = _pass(batches, data, model_cost, args.dp, run, plan_step, StepPlanConfig, shares)
        calibrated = CostModel.calibrate([s[0] for s in shares], [s[1] for s in shares], [s[2] for s in shares])
        print(f"calibrated on {len(shares)} measured shares: {calibrated}", flush=True)
        # Pass 2: the same batches, planned and predicted with the calibrated model.
        seconds = _pass(batches, data, calibrated, args.dp, run, plan_step, StepPlanConfig, [])
        for balance in BALANCES:
            for name, result in (("flops", flops), ("calibrated", seconds)):
                measured, predicted = result[balance]
                rows.append({"model": name, "balance": balance, "measured_s": measured, "predicted": predicted})
                print(f"{name:<10} balance={balance:<11} measured slowest share {measured:.3f} s, predicted "
                      f"{predicted:.4g}", flush=True)  # fmt: skip
    agree = {}
    for name in ("flops", "calibrated"):
        mine = [r for r in rows if r["model"] == name]
        by_measured = [r["balance"] for r in sorted(mine, key=lambda r: r["measured_s"])]
        by_predicted = [r["balance"] for r in sorted(mine, key=lambda r: r["predicted"])]
        agree[name] = by_measured == by_predicted
        print(f"{name}: fastest to slowest measured {by_measured}, predicted {by_predicted}: "
              f"{'same' if agree[name] else 'DIFFERENT'}")  # fmt: skip
    write_results(args.out, {**config, "same_order": agree}, rows)
    dist.destroy_process_group()
    return 0


def _pass(batches, data, cost_model, dp, run, plan_step, StepPlanConfig, shares) -> dict:
    """Plan and run every batch with each balance; (mean slowest measured share, mean predicted) per balance.
    Every measured share after the warm-up batch is appended to ``shares`` as (lengths, seconds, mbs)."""
    from mcore_packing.planning import ParallelLayout

    out = {}
    for balance in BALANCES:
        config = StepPlanConfig(
            train_mb_tokens=4096, layout=ParallelLayout(dp=dp), balance=balance, cost_model=cost_model
        )
        measured, predicted = [], []
        for step, ids in enumerate(batches):
            samples = [data.samples[i] for i in ids]
            plan = plan_step([len(s) for s in samples], config)
            times = run(plan, samples)
            if step == 0:  # the first batch warms up kernels and the allocator
                continue
            measured.append(max(times))
            predicted.append(max(plan.rank_costs()))
            for rank, t in zip(plan.micro_batches, times, strict=True):
                shares.append(([plan.lengths[i] for mb in rank for i in mb.sample_indices], t, len(rank)))
        out[balance] = (statistics.mean(measured), statistics.mean(predicted))
    return out


def _measure(plan, samples, model, pgs, forward_backward, dp) -> list[float]:
    return [_time_share(plan, r, samples, model, pgs, forward_backward) for r in range(dp)]


def _time_share(plan, rank, samples, model, pgs, forward_backward) -> float:
    """Seconds for one DP rank's micro-batches, run alone through Megatron's schedule."""
    share = dataclasses.replace(
        plan, config=dataclasses.replace(plan.config, dp_size=1), micro_batches=(plan.micro_batches[rank],)
    )
    model.zero_grad_buffer()
    start = time.perf_counter()
    forward_backward(model, samples, share, pgs, verify=False)
    return time.perf_counter() - start


if __name__ == "__main__":
    sys.exit(main())
