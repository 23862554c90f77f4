"""GPU training-step benchmark: packing vs dynamic batching vs pad-to-longest on one GPU, one run.

A ~1B-parameter Llama-shaped GPT (16 layers, width 2048, 16 query / 8 key-value heads, SwiGLU MLP 5632,
vocabulary 32000) in bf16 runs forward+backward of the same global batches of real CHAMP conversation
lengths (64 per step) through Megatron's schedule (`forward_backward`), cut three ways:

- padded: ``--padded-rows`` consecutive samples per micro-batch, padded to their longest;
- dynamic: `plan_step(mode="dynamic")`, similar lengths together under ``--mb-tokens``;
- packing: `plan_step(mode="packing")`, THD rows of ``--mb-tokens``.

Per mode and attention backend: real tokens/s, MFU (model FLOPs of the real tokens, from `CostModel`,
over time and ``--peak-tflops``), peak GPU memory (the same batches in every mode, so equal useful
tokens), the largest micro-batch in tokens, and for packing the step-time prediction of a `CostModel`
calibrated on the first half of the timed steps against the measured second half. The ratios are taken
in the same run.

    python benchmarks/gpu_step.py                 # about 2-3 minutes on an H100/H200
    python benchmarks/gpu_step.py --plan-only     # no GPU: the plans of every mode and step (CI)
    python benchmarks/gpu_step.py --device cpu --dtype float32 --layers 1 --hidden 64 ...   # code path

Results go to ``--out`` (default ``$MCORE_PACKING_GPU_RESULTS/gpu_step.json``, else
``benchmarks/results/gpu/gpu_step.json``).
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

MODES = ("padded", "dynamic", "packing")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--ffn", type=int, default=5632)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--no-gated", dest="gated", action="store_false", help="GELU MLP instead of SwiGLU")
    p.add_argument("--distribution", default="real:champ", help="length distribution (mcore_packing.data)")
    p.add_argument("--batch-size", type=int, default=64, help="samples per global batch")
    p.add_argument("--max-len", type=int, default=16384, help="longest sample drawn")
    p.add_argument("--mb-tokens", type=int, default=16384, help="train_mb_tokens for dynamic and packing")
    p.add_argument("--padded-rows", type=int, default=4, help="rows per padded micro-batch")
    p.add_argument("--steps", type=int, default=6, help="timed steps per mode (after one warm-up)")
    p.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak (H100/H200 SXM: 989)")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    p.add_argument("--attention-backends", nargs="+", default=["local", "te"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plan-only", action="store_true", help="plan every step and mode; no model, no GPU")
    results = os.environ.get("MCORE_PACKING_GPU_RESULTS", "benchmarks/results/gpu")
    p.add_argument("--out", default=os.path.join(results, "gpu_step.json"))
    return p.parse_args(argv)


def model_shape(args):
    from mcore_packing.planning import ModelShape

    return ModelShape(
        num_layers=args.layers,
        hidden_size=args.hidden,
        num_attention_heads=args.heads,
        num_query_groups=args.kv_heads,
        ffn_hidden_size=args.ffn,
        vocab_size=args.vocab,
        max_sequence_length=2 * args.max_len,
        normalization="RMSNorm",
        gated_mlp=args.gated,
    )


def global_batches(args) -> list[list[int]]:
    """``steps + 1`` global batches of lengths (the first is the warm-up), the same for every mode."""
    from mcore_packing.data import sample_lengths

    return [
        sample_lengths(args.distribution, args.batch_size, args.max_len, seed=args.seed + b).tolist()
        for b in range(args.steps + 1)
    ]


def plans(args, lengths: list[int]) -> dict:
    from mcore_packing.planning import CostModel, StepPlanConfig, plan_step

    cost = CostModel.from_shape(model_shape(args))
    budget = max(args.mb_tokens, max(lengths))
    return {
        mode: plan_step(
            lengths,
            StepPlanConfig(mode=mode, train_mb_tokens=budget, padded_rows=args.padded_rows, cost_model=cost),
        )
        for mode in MODES
    }


def plan_only(args, config: dict) -> int:
    rows = []
    for step, lengths in enumerate(global_batches(args)):
        for mode, plan in plans(args, lengths).items():
            stats = plan.stats()
            largest = max(mb.padded_tokens for mb in plan.micro_batches[0])
            rows.append({"step": step, "mode": mode, "largest_microbatch_tokens": largest, **stats})
            print(
                f"step {step} {mode:<8} {stats['num_microbatches_per_rank']:>3} micro-batches, computed "
                f"{stats['padded_tokens']:>7} tokens for {stats['real_tokens']:>7} real, largest {largest}",
                flush=True,
            )
    write_results(args.out, {**config, "plan_only": True}, rows, key="plans")
    return 0


def measure_mode(args, model, pgs, device, batches, mode: str) -> dict:
    """Time every step of one mode; the first step warms up kernels and the allocator."""
    import torch

    from mcore_packing.megatron import forward_backward
    from mcore_packing.planning import CostModel
    from mcore_packing.thd import SequenceSample

    flops = CostModel.from_shape(model_shape(args))
    rng = np.random.default_rng(args.seed)
    times, real, largest, lengths_per_step = [], 0, 0, []
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    for step, lengths in enumerate(batches):
        samples = [SequenceSample(rng.integers(0, args.vocab, n).tolist()) for n in lengths]
        plan = plans(args, lengths)[mode]
        model.zero_grad_buffer()
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        out = forward_backward(model, samples, plan, pgs, device=device, verify=False)
        if device.type == "cuda":
            torch.cuda.synchronize()
        if step > 0:
            times.append(time.perf_counter() - start)
            real += out.real_tokens
            lengths_per_step.append(lengths)
        largest = max(largest, max(mb.padded_tokens for mb in plan.micro_batches[0]))
    seconds = sum(times)
    model_flops = sum(float(flops.sequence_cost(s).sum()) for s in lengths_per_step)
    result = {
        "tokens_per_s": real / seconds,
        "step_s_median": statistics.median(times),
        "mfu": model_flops / seconds / (args.peak_tflops * 1e12),
        "largest_microbatch_tokens": largest,
        "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None,
    }
    if mode == "packing" and len(times) >= 4:
        result["prediction"] = predict(lengths_per_step, times)
    return result


def predict(lengths_per_step: list[list[int]], times: list[float]) -> dict:
    """Calibrate a CostModel on the first half of the steps; predict the second half."""
    from mcore_packing.planning import CostModel

    half = len(times) // 2
    model = CostModel.calibrate(lengths_per_step[:half], times[:half])
    predicted = [float(model.sequence_cost(s).sum()) for s in lengths_per_step[half:]]
    errors = [abs(p - m) / m for p, m in zip(predicted, times[half:], strict=True)]
    return {"predicted_s": predicted, "measured_s": times[half:], "mean_abs_rel_error": float(np.mean(errors))}


def run_model(args, config: dict) -> int:
    import torch
    import torch.distributed as dist

    from mcore_packing.compat import te_available
    from mcore_packing.megatron import (
        ProcessGroups,
        build_gpt_model,
        cpu_device_adapter,
        initialize_parallel,
        start_world_of_one,
    )

    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda needs a CUDA GPU; none is visible (use --plan-only without one).")
    if args.device == "cuda":
        torch.cuda.set_device(0)
    start_world_of_one("nccl" if args.device == "cuda" else "gloo")
    initialize_parallel()
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    dtype = torch.bfloat16 if args.dtype == "bfloat16" else torch.float32
    config.update(
        te_available=te_available(),
        machine=torch.cuda.get_device_name(0) if args.device == "cuda" else f"{platform.machine()}, no GPU",
    )
    batches = global_batches(args)
    rows = []
    with cpu_device_adapter(device=args.device) if args.device == "cpu" else contextlib.nullcontext():
        for backend in args.attention_backends:
            if backend == "te" and not te_available():
                print("attention backend te: skipped, TransformerEngine is not installed", flush=True)
                continue
            model, _ = build_gpt_model(model_shape(args), dtype=dtype, attention_backend=backend, device=device)
            pgs = ProcessGroups.from_megatron()
            row = {"attention_backend": backend, "parameters": sum(p.numel() for p in model.parameters())}
            for mode in MODES:
                row[mode] = measure_mode(args, model, pgs, device, batches, mode)
                print(f"{backend:<5} {mode:<8} {_line(row[mode])}", flush=True)
            row["packed_over_padded"] = row["packing"]["tokens_per_s"] / row["padded"]["tokens_per_s"]
            row["dynamic_over_padded"] = row["dynamic"]["tokens_per_s"] / row["padded"]["tokens_per_s"]
            print(
                f"{backend:<5} ratios: packed/padded = {row['packed_over_padded']:.2f}x, "
                f"dynamic/padded = {row['dynamic_over_padded']:.2f}x",
                flush=True,
            )
            rows.append(row)
            del model
    write_results(args.out, config, rows, key="results")
    dist.destroy_process_group()
    return 0


def _line(r: dict) -> str:
    memory = f"{r['peak_memory_gib']:.1f} GiB" if r["peak_memory_gib"] is not None else "n/a"
    text = (
        f"{r['tokens_per_s']:>9.0f} tokens/s  MFU {r['mfu']:.3f}  median step {r['step_s_median']:.3f}s  "
        f"peak memory {memory}  largest micro-batch {r['largest_microbatch_tokens']} tokens"
    )
    if "prediction" in r:
        text += f"  prediction error {r['prediction']['mean_abs_rel_error']:.1%}"
    return text


def main(argv=None) -> int:
    args = parse_args(argv)
    config = run_config(args, model_shape=model_shape(args).to_dict())
    return plan_only(args, config) if args.plan_only else run_model(args, config)


if __name__ == "__main__":
    sys.exit(main())
