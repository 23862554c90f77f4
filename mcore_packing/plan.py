"""``python -m mcore_packing.plan``: what packing does to your data, before you train.

Reads sequence lengths (a built-in real corpus, or your own file of lengths), splits them into global
batches in data order (packing never moves a sample across a global-batch boundary), packs every batch
with each algorithm, and compares the tokens computed against padding every batch to its longest
sequence.

    python -m mcore_packing.plan                                  # CHAMP conversations, qwen3 tokens
    python -m mcore_packing.plan --corpus stdlib --capacity 32768 --global-batch-size 256
    python -m mcore_packing.plan --lengths my_lengths.npy --capacity 8192 --json

Exit code 2 on bad input, with a message that says what to fix.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from .data.real_text import REAL_CORPORA, real_corpus_lengths
from .packing import DEFAULT_ALGORITHM, PackingAlgorithm, PackingMetrics, get_packer, resolve_algorithm


class PlanInputError(ValueError):
    """Bad user input for the planner; reported with exit code 2."""


def load_lengths(path: str) -> np.ndarray:
    """Lengths from ``.npy``, ``.json`` (a list) or text (one integer per line or whitespace-separated)."""
    file = Path(path)
    if not file.is_file():
        raise PlanInputError(f"Length file {path!r} does not exist. Pass a .npy, .json or .txt file of lengths.")
    try:
        if file.suffix == ".npy":
            raw = np.load(file, allow_pickle=False)
        elif file.suffix == ".json":
            raw = np.asarray(json.loads(file.read_text()))
        else:
            raw = np.asarray(file.read_text().split(), dtype=object)
            raw = np.asarray([_parse_int(tok, i, path) for i, tok in enumerate(raw)], dtype=np.int64)
    except (ValueError, json.JSONDecodeError) as exc:
        if isinstance(exc, PlanInputError):
            raise
        raise PlanInputError(f"Could not read lengths from {path!r}: {exc}") from exc
    raw = np.asarray(raw).reshape(-1)
    if raw.size == 0:
        raise PlanInputError(f"{path!r} holds no lengths; the plan needs at least one sequence.")
    return raw


def _parse_int(token: str, index: int, path: str) -> int:
    try:
        return int(token)
    except ValueError:
        raise PlanInputError(f"{path!r}: entry {index} = {token!r} is not an integer length.") from None


def padded_tokens(lengths: np.ndarray, micro_batch_size: int) -> int:
    """Tokens computed when consecutive groups of ``micro_batch_size`` are each padded to their longest."""
    starts = np.arange(0, lengths.size, micro_batch_size)
    longest = np.maximum.reduceat(lengths, starts)
    rows = np.diff(np.append(starts, lengths.size))
    return int((longest * rows).sum())


def plan_global_batches(
    lengths: np.ndarray,
    capacity: int,
    algorithm: str,
    global_batch_size: int,
    bin_count_multiple: int | None,
    micro_batch_size: int,
) -> dict:
    """Pack each global batch separately; return totals for packed and pad-to-longest layouts."""
    packer = get_packer(algorithm, capacity, bin_count_multiple=bin_count_multiple, seed=0)
    step = global_batch_size if global_batch_size > 0 else lengths.size
    num_bins = 0
    padded = 0
    lower = 0
    start = time.perf_counter()
    for lo in range(0, lengths.size, step):
        batch = lengths[lo : lo + step]
        bins = packer.pack_bins(batch)
        num_bins += bins.num_bins
        padded += padded_tokens(batch, micro_batch_size)
        lower += -(-int(batch.sum()) // capacity)
    seconds = time.perf_counter() - start
    total = int(lengths.sum())
    return {
        "algorithm": resolve_algorithm(algorithm).value,
        "seconds": seconds,
        "num_bins": num_bins,
        "lower_bound_per_batch_sum": lower,
        "packed_tokens": num_bins * capacity,
        "useful_tokens": total,
        "useful_share_packed": total / (num_bins * capacity),
        "pad_to_longest_tokens": padded,
        "useful_share_pad_to_longest": total / padded,
        "compute_saved_vs_pad_to_longest": 1.0 - (num_bins * capacity) / padded,
    }


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m mcore_packing.plan", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--corpus", choices=REAL_CORPORA, default=None, help="built-in real corpus (default: champ)")
    source.add_argument("--lengths", help="file of lengths: .npy, .json list, or text with one integer per line")
    parser.add_argument("--capacity", type=int, default=16384, help="tokens per packed micro-batch")
    parser.add_argument("--global-batch-size", type=int, default=512, help="sequences per global batch (0: all)")
    parser.add_argument(
        "--micro-batch-size",
        type=int,
        default=4,
        help="sequences per padded micro-batch in the pad-to-longest baseline (data order)",
    )
    parser.add_argument("--dp", type=int, default=1, help="data-parallel size: bins per batch become a multiple")
    parser.add_argument(
        "--algorithm",
        action="append",
        help=f"packing algorithm (repeatable; default: all, {DEFAULT_ALGORITHM.value} first)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON document instead of tables")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return _run(args)
    except PlanInputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    if args.capacity <= 0:
        raise PlanInputError(f"--capacity must be a positive number of tokens, got {args.capacity}.")
    if args.dp <= 0 or args.global_batch_size < 0 or args.micro_batch_size <= 0:
        raise PlanInputError("--dp and --micro-batch-size must be >= 1, and --global-batch-size >= 0.")
    if args.lengths:
        source = args.lengths
        lengths = load_lengths(args.lengths)
    else:
        corpus = args.corpus or "champ"
        source = f"real:{corpus} (qwen3 tokens)"
        lengths = real_corpus_lengths(corpus)
    if lengths.dtype.kind not in "iu":
        raise PlanInputError(f"{source}: lengths must be integers, got dtype {lengths.dtype}.")
    lengths = lengths.astype(np.int64)
    if lengths.min() <= 0:
        bad = int(np.flatnonzero(lengths <= 0)[0])
        raise PlanInputError(f"{source}: length {bad} is {lengths[bad]}; every sequence needs at least one token.")
    too_long = int(np.count_nonzero(lengths > args.capacity))
    if too_long:
        raise PlanInputError(
            f"{too_long} of {lengths.size} sequences are longer than --capacity {args.capacity} (longest "
            f"{int(lengths.max())}). Raise --capacity to at least {int(lengths.max())}, or truncate/split them first."
        )
    algorithms = args.algorithm or [DEFAULT_ALGORITHM.value] + [
        a.value for a in PackingAlgorithm if a is not DEFAULT_ALGORITHM
    ]
    for name in algorithms:
        try:
            resolve_algorithm(name)
        except ValueError as exc:
            raise PlanInputError(str(exc)) from None

    whole = PackingMetrics.compute(lengths, get_packer(algorithms[0], args.capacity).pack_bins(lengths), args.capacity)
    rows = [
        plan_global_batches(
            lengths,
            args.capacity,
            a,
            args.global_batch_size,
            args.dp if args.dp > 1 else None,
            args.micro_batch_size,
        )
        for a in algorithms
    ]
    summary = {
        "source": source,
        "num_sequences": int(lengths.size),
        "num_tokens": int(lengths.sum()),
        "length_mean": float(lengths.mean()),
        "length_median": float(np.median(lengths)),
        "length_p99": float(np.percentile(lengths, 99)),
        "length_max": int(lengths.max()),
        "capacity": args.capacity,
        "global_batch_size": args.global_batch_size,
        "dp": args.dp,
        "micro_batch_size_padded": args.micro_batch_size,
        "whole_dataset_metrics": whole.to_dict(),
        "per_global_batch": rows,
    }
    if args.json:
        print(json.dumps(summary, indent=1))
        return 0
    print(f"source: {source}")
    print(
        f"  {lengths.size} sequences, {int(lengths.sum())} tokens; length mean {lengths.mean():.0f}, median "
        f"{np.median(lengths):.0f}, p99 {np.percentile(lengths, 99):.0f}, max {int(lengths.max())}"
    )
    print(
        f"whole dataset, {algorithms[0]}: {whole.num_bins} bins of {args.capacity} tokens (lower bound "
        f"{whole.lower_bound}), efficiency {whole.packing_efficiency:.4f}, utilization {whole.utilization:.4f}"
    )
    print(
        f"\nper global batch of {args.global_batch_size or lengths.size} sequences"
        f"{f', bins a multiple of dp={args.dp}' if args.dp > 1 else ''}:"
    )
    header = f"{'algorithm':<30} {'bins':>7} {'lower':>7} {'useful share':>12} {'compute saved':>13} {'time_s':>7}"
    print(header)
    print("-" * len(header))
    baseline = f"pad to longest, {args.micro_batch_size}/mb"
    print(f"{baseline:<30} {'':>7} {'':>7} {rows[0]['useful_share_pad_to_longest']:>12.3f}")
    for r in rows:
        print(
            f"{r['algorithm']:<30} {r['num_bins']:>7} {r['lower_bound_per_batch_sum']:>7} "
            f"{r['useful_share_packed']:>12.3f} {r['compute_saved_vs_pad_to_longest']:>13.3f} {r['seconds']:>7.3f}"
        )
    print(
        "\nuseful share = real tokens / tokens computed. compute saved = 1 - packed tokens / padded tokens, "
        "where the padded baseline pads each micro-batch of consecutive sequences to its longest "
        "(token-linear work; attention's quadratic part is not modelled here)."
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
