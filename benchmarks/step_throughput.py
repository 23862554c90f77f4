"""Training-step throughput on CPU: pad-to-longest vs dynamic batching vs packing, one run, same batches.

A small real Megatron GPTModel runs forward+backward of whole global batches through
`mcore_packing.megatron.forward_backward` (Megatron's own schedule). Three ways to cut each global batch:

- padded: consecutive samples in micro-batches of ``--padded-rows`` rows, each padded to its longest
  (the usual pad-to-longest data loader);
- dynamic: `plan_step(mode="dynamic")`, similar lengths together under ``--mb-tokens``;
- packing: `plan_step(mode="packing")`, THD rows of ``--mb-tokens``.

Throughput = real (unpadded) tokens / wall time of the step. The ratios packed/padded and
dynamic/padded are taken in the same run on the same global batches.

    python benchmarks/step_throughput.py                 # about 3-4 minutes on 2 cores
    python benchmarks/step_throughput.py --quick         # a smoke run (seconds)
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import statistics
import sys
import time

import numpy as np
from _report import run_config, write_results


def global_batches(distribution: str, num_batches: int, batch_size: int, max_len: int, seed: int, vocab: int) -> list:
    from mcore_packing.data import sample_lengths

    rng = np.random.default_rng(seed)
    batches = []
    for b in range(num_batches):
        if distribution == "real:champ/10":
            # CHAMP conversation lengths scaled by 1/10 (max 925) so a CPU step takes seconds.
            lengths = np.maximum(1, sample_lengths("real:champ", batch_size, 16384, seed=seed + b) // 10)
        else:
            lengths = sample_lengths(distribution, batch_size, max_len, seed=seed + b)
        batches.append([rng.integers(0, vocab, int(n)).tolist() for n in lengths])
    return batches


def main(argv=None, description: str = __doc__, defaults: dict | None = None) -> int:
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--distributions", nargs="+", default=["lognormal", "real:champ/10"])
    parser.add_argument("--batch-size", type=int, default=64, help="samples per global batch")
    parser.add_argument("--max-len", type=int, default=1024, help="longest synthetic sample")
    parser.add_argument("--mb-tokens", type=int, default=4096, help="train_mb_tokens for dynamic and packing")
    parser.add_argument("--padded-rows", type=int, default=8, help="rows per padded micro-batch")
    parser.add_argument("--steps", type=int, default=2, help="timed steps per mode (after one warm-up)")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--ffn", type=int, default=None)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument(
        "--attention-backends",
        nargs="+",
        default=["auto"],
        help="auto | local | te (te is skipped with a note when TransformerEngine is missing)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="tiny smoke run")
    parser.add_argument("--out", default="benchmarks/results/step_throughput.json")
    if defaults:
        parser.set_defaults(**defaults)
    args = parser.parse_args(argv)
    if args.quick and not defaults:
        args.batch_size, args.max_len, args.mb_tokens, args.steps = 8, 128, 512, 1
        args.distributions = args.distributions[:1]

    import torch
    import torch.distributed as dist

    from mcore_packing.compat import te_available
    from mcore_packing.megatron import ProcessGroups, cpu_device_adapter, forward_backward
    from mcore_packing.megatron.model import build_gpt_model, initialize_parallel, start_world_of_one
    from mcore_packing.planning import ModelShape, StepPlanConfig, plan_step
    from mcore_packing.thd import SequenceSample

    if args.device == "cpu":
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", os.cpu_count() or 1)))
    elif not torch.cuda.is_available():
        raise SystemExit("--device cuda needs a CUDA GPU; none is visible.")
    else:
        torch.cuda.set_device(0)
    start_world_of_one("gloo" if args.device == "cpu" else "nccl")
    initialize_parallel()
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    dtype = torch.bfloat16 if args.dtype == "bfloat16" else torch.float32
    shape = ModelShape(
        num_layers=args.layers,
        hidden_size=args.hidden,
        num_attention_heads=args.heads,
        ffn_hidden_size=args.ffn,
        vocab_size=args.vocab,
        max_sequence_length=max(args.max_len, 1024) * 2,
    )
    config = run_config(
        args,
        torch=torch.__version__,
        te_available=te_available(),
        machine=torch.cuda.get_device_name(0)
        if args.device == "cuda"
        else f"{platform.machine()}, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads, no GPU",
    )
    rows = []
    adapter = cpu_device_adapter(device=args.device) if args.device == "cpu" else contextlib.nullcontext()
    with adapter:
        for backend in args.attention_backends:
            if backend == "te" and not te_available():
                print("attention backend te: skipped, TransformerEngine is not installed", flush=True)
                continue
            model, _ = build_gpt_model(shape, dtype=dtype, attention_backend=backend, device=device)
            n_params = sum(p.numel() for p in model.parameters())
            pgs = ProcessGroups.from_megatron()
            for distribution in args.distributions:
                batches = global_batches(
                    distribution, args.steps + 1, args.batch_size, args.max_len, args.seed, args.vocab
                )
                result = {"distribution": distribution, "attention_backend": backend, "parameters": n_params}
                for mode in ("padded", "dynamic", "packing"):
                    times, real, computed = [], 0, 0
                    for step, batch in enumerate(batches):
                        samples = [SequenceSample(t) for t in batch]
                        lengths = [len(t) for t in batch]
                        plan_config = StepPlanConfig(
                            mode=mode, train_mb_tokens=max(args.mb_tokens, args.max_len), padded_rows=args.padded_rows
                        )
                        plan = plan_step(lengths, plan_config)
                        model.zero_grad_buffer()
                        if device.type == "cuda":
                            torch.cuda.synchronize()
                        start = time.perf_counter()
                        out = forward_backward(model, samples, plan, pgs, device=device, verify=False)
                        if device.type == "cuda":
                            torch.cuda.synchronize()
                        elapsed = time.perf_counter() - start
                        if step > 0:  # the first step warms up allocator and kernels
                            times.append(elapsed)
                            real += out.real_tokens
                            computed += out.padded_tokens
                    seconds = sum(times)
                    result[mode] = {
                        "tokens_per_s": real / seconds,
                        "step_s_median": statistics.median(times),
                        "useful_share": real / computed,
                    }
                    print(
                        f"{distribution:<14} {backend:<5} {mode:<8} {real / seconds:>9.0f} tokens/s  "
                        f"useful share {real / computed:.3f}  median step {statistics.median(times):.2f}s",
                        flush=True,
                    )
                padded_tps = result["padded"]["tokens_per_s"]
                result["packed_over_padded"] = result["packing"]["tokens_per_s"] / padded_tps
                result["dynamic_over_padded"] = result["dynamic"]["tokens_per_s"] / padded_tps
                print(
                    f"{distribution:<14} {backend:<5} ratios: packed/padded = {result['packed_over_padded']:.2f}x, "
                    f"dynamic/padded = {result['dynamic_over_padded']:.2f}x",
                    flush=True,
                )
                rows.append(result)
            del model
    if not (args.quick and not defaults):  # step_throughput's own --quick is a smoke run: keep results clean
        write_results(args.out, config, rows, key="results")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
