"""Dynamic against static context parallelism, measured: the same batches on 4 gloo ranks of this CPU.

A real Megatron GPTModel (the library's builder, 2 layers, width 256) at CP=4 over 4 ranks; lognormal
lengths shaped like Megatron's example, scaled down (mean 256, sigma 1.5, clipped to 32-2048), 512
tokens per rank. Each step runs once with static CP (`plan_step`: every sequence cut over the 4 ranks)
and once with dynamic CP (`plan_step` with ``dynamic_cp=True``: each sequence on the CP size it needs),
both through `forward_backward`, alternating, after one warm-up step of each; the ratio is taken in this
one run. Four processes share the machine's cores, as they would share nothing on a GPU cluster: the
number says which way the exchange goes on this machine, not by how much it goes on NVLink. ``--mode
dynamic``: dynamic batching's padded BSHD rows, static against dynamic CP.

    python benchmarks/dynamic_cp_measured.py                 # about a minute on 2 cores
    python benchmarks/dynamic_cp_measured.py --mode dynamic
"""

from __future__ import annotations

import os
import sys
import time

from _report import run_config, write_results

WORLD, CP, BUDGET = 4, 4, 512


def lengths_for(step: int, n: int):
    import numpy as np

    rng = np.random.default_rng(100 + step)
    return np.clip(np.rint(rng.lognormal(np.log(256) - 1.5**2 / 2, 1.5, n)), 32, 2048).astype(np.int64)


def worker(rank: int, rendezvous: str, steps: int, per_rank: int, mode: str, out: dict) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD))
    import numpy as np
    import torch
    import torch.distributed as dist

    from mcore_packing.megatron import (
        ProcessGroups,
        build_gpt_model,
        cpu_device_adapter,
        forward_backward,
        initialize_parallel,
    )
    from mcore_packing.planning import ModelShape, ParallelLayout, StepPlanConfig, plan_step
    from mcore_packing.thd import SequenceSample

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=WORLD)
    layout = ParallelLayout(cp=CP, dp=WORLD // CP)
    shape = ModelShape(num_layers=2, hidden_size=256, num_attention_heads=4, num_query_groups=2, vocab_size=512,
                       max_sequence_length=4096)  # fmt: skip
    times = {"static": [], "dynamic": []}
    sizes = {}
    with cpu_device_adapter():
        initialize_parallel(layout, seed=0)
        model, _ = build_gpt_model(shape, layout, device="cpu")
        pgs = ProcessGroups.from_megatron().with_dynamic_cp()
        for step in range(steps + 1):
            lengths = lengths_for(step, per_rank * WORLD)
            rng = np.random.default_rng(step)
            samples = [SequenceSample(rng.integers(0, 512, int(n)).tolist()) for n in lengths]
            static = plan_step(lengths, StepPlanConfig(mode=mode, train_mb_tokens=BUDGET, layout=layout))
            dynamic = plan_step(lengths, StepPlanConfig(mode=mode, train_mb_tokens=BUDGET, layout=layout,
                                                        dynamic_cp=True))  # fmt: skip
            for name in ("static", "dynamic") if step % 2 else ("dynamic", "static"):
                model.zero_grad_buffer()
                dist.barrier()
                start = time.perf_counter()
                forward_backward(model, samples, static if name == "static" else dynamic, pgs, device="cpu")
                dist.barrier()
                if step:  # step 0 warms up
                    times[name].append(time.perf_counter() - start)
            sizes = {k: sizes.get(k, 0) + v for k, v in dynamic.cp_size_counts().items()}
    if rank == 0:
        out.update(times=times, cp_sizes=sizes)
    dist.destroy_process_group()


def _entry(rank, rendezvous, steps, per_rank, mode, path):
    import json

    out: dict = {}
    worker(rank, rendezvous, steps, per_rank, mode, out)
    if rank == 0:
        with open(path, "w") as f:
            json.dump(out, f)


def main(argv=None) -> int:
    import argparse
    import json
    import tempfile

    import torch.multiprocessing as mp

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=4, help="timed steps of each (after one warm-up)")
    parser.add_argument("--per-rank", type=int, default=16, help="samples per rank per step")
    parser.add_argument("--mode", choices=["packing", "dynamic"], default="packing",
                        help="rows: packed THD (packing) or dynamic batching's BSHD rows (dynamic)")  # fmt: skip
    parser.add_argument("--out", default=None, help="default: benchmarks/results/dynamic_cp_measured[_dynamic].json")
    args = parser.parse_args(argv)
    suffix = "_dynamic" if args.mode == "dynamic" else ""
    args.out = args.out or f"benchmarks/results/dynamic_cp_measured{suffix}.json"
    config = run_config(args, world=WORLD, cp=CP, max_tokens_per_rank=BUDGET)
    with tempfile.TemporaryDirectory() as tmp:
        path, rendezvous = os.path.join(tmp, "out.json"), "file://" + os.path.join(tmp, "rendezvous")
        mp.start_processes(_entry, args=(rendezvous, args.steps, args.per_rank, args.mode, path), nprocs=WORLD,
                           start_method="spawn")  # fmt: skip
        with open(path) as f:
            out = json.load(f)
    static, dynamic = sum(out["times"]["static"]), sum(out["times"]["dynamic"])
    sizes = out["cp_sizes"]
    print(f"4 gloo ranks, CP=4, {args.mode} rows, {args.steps} steps: static CP {static:.2f} s, dynamic CP "
          f"{dynamic:.2f} s; static / dynamic {static / dynamic:.2f}x (sequences per CP size {sizes})",
          flush=True)  # fmt: skip
    write_results(args.out, config, [{"static_s": static, "dynamic_s": dynamic, "static_over_dynamic": static / dynamic,
                                      "cp_sizes": out["cp_sizes"], "times": out["times"]}])  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
