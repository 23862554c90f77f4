"""``python -m mcore_packing plan``: what packing will do to your data, before you train.

Reads sequence lengths (a built-in real corpus, a file of lengths, or a JSONL file tokenized with a
bundled vocabulary), cuts them into global batches in data order, plans every batch exactly as training
would (`mcore_packing.planning.report`: packing, dynamic or padded; DP/TP/PP/CP/SP), and reports:

- packing efficiency, bins and the lower bound ceil(tokens / capacity);
- micro-batches per data-parallel rank;
- per-rank imbalance of tokens and of attention-aware cost (slowest rank / mean);
- padding saved against pad-to-longest micro-batches and against pad-to-capacity;
- predicted compute saved, from linear and quadratic (attention) FLOPs of the model shape;
- a budget recommendation (the smallest budget whose utilization is within 1% of the best tried).

It writes one PNG (length histogram, micro-batch fill, per-rank load, useful-token share per mode) and,
with ``--json``, one JSON document. Bad input exits with code 2 and a message that says what to fix.
Never imports torch: it runs on a login node.

    python -m mcore_packing plan                                        # CHAMP conversations, qwen3 tokens
    python -m mcore_packing plan --jsonl my.jsonl --field text --dp 8 --cp 2 --recipe llama3_8b_sft_packed
    python -m mcore_packing plan --lengths lengths.npy --mb-tokens 8192 --json > plan.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import numpy as np

from ..data.real_text import REAL_CORPORA, real_corpus_lengths
from ..packing import DEFAULT_ALGORITHM, PackingMetrics, get_packer, resolve_algorithm
from ..planning import (
    BALANCES,
    MODES,
    ORDERS,
    CostModel,
    ModelShape,
    ParallelLayout,
    StepPlanConfig,
    recommend_budget,
    summarize,
)
from .recipes import RECIPES

__all__ = ["DEFAULT_SHAPE", "PlanInputError", "load_lengths", "main"]


def recipe_shape(name: str) -> ModelShape:
    """A recipe's model shape with its data vocabulary (each recipe's default cluster fits its layout)."""
    cfg = RECIPES[name]()
    return cfg.model.shape(cfg.data.vocab_size)


DEFAULT_SHAPE = recipe_shape("llama3_8b_sft_packed")
"""Model shape for cost numbers when none is given: the Llama-3-8B recipe's."""


class PlanInputError(ValueError):
    """Bad user input for the planner; reported with exit code 2."""


_REFINE = {"default": None, "on": True, "off": False}
"""``--refine`` choices to `get_packer`'s ``refine``."""


def load_lengths(path: str) -> np.ndarray:
    """Lengths from ``.npy``, ``.json`` (a list) or text (integers separated by whitespace)."""
    file = Path(path)
    if not file.is_file():
        raise PlanInputError(f"Length file {path!r} does not exist. Pass a .npy, .json or .txt file of lengths.")
    try:
        if file.suffix == ".npy":
            raw = np.load(file, allow_pickle=False)
        elif file.suffix == ".json":
            raw = np.asarray(json.loads(file.read_text()))
        else:
            tokens = file.read_text().split()
            raw = np.asarray([_parse_int(tok, i, path) for i, tok in enumerate(tokens)], dtype=np.int64)
    except (ValueError, json.JSONDecodeError) as exc:
        if isinstance(exc, PlanInputError):
            raise
        raise PlanInputError(f"Could not read lengths from {path!r}: {exc}") from exc
    raw = np.asarray(raw).reshape(-1)
    if raw.size == 0:
        raise PlanInputError(f"{path!r} holds no lengths; the plan needs at least one sequence.")
    if raw.dtype.kind not in "iu":
        raise PlanInputError(f"{path!r}: lengths must be integers, got dtype {raw.dtype}.")
    return raw.astype(np.int64)


def _parse_int(token: str, index: int, path: str) -> int:
    try:
        return int(token)
    except ValueError:
        raise PlanInputError(f"{path!r}: entry {index} = {token!r} is not an integer length.") from None


def jsonl_lengths(path: str, field: str, encoding: str) -> np.ndarray:
    """Token counts of ``field`` in every record of a JSONL file (quicktok, bundled vocabulary)."""
    import quicktok

    from ..data.real_text import get_tokenizer, read_jsonl_texts

    try:
        texts = read_jsonl_texts(path, field)
    except (FileNotFoundError, ValueError) as exc:
        raise PlanInputError(f"{exc} (pass --field NAME for another field)") from None
    return np.asarray(quicktok.count_batch(get_tokenizer(encoding), texts), dtype=np.int64)


def write_png(path: str, lengths: np.ndarray, summary: dict, config: StepPlanConfig, source: str) -> None:
    """One figure: length histogram, micro-batch fill, per-rank load, useful-token share per layout."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise PlanInputError("--png needs matplotlib: pip install 'mcore-packing[plot]', or pass --no-png.") from exc
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    ax = axes[0, 0]
    ax.hist(lengths, bins=60, color="#4C72B0")
    ax.set_yscale("log")
    ax.axvline(config.row_capacity(), color="k", ls="--", lw=1, label="row capacity")
    ax.set(title=f"sequence lengths ({source}, n={lengths.size:,})", xlabel="tokens", ylabel="sequences (log)")
    ax.legend()
    ax = axes[0, 1]
    ax.hist(summary["_fills"], bins=40, range=(0, 1), color="#55A868")
    what = "real tokens / row capacity" if config.mode == "packing" else "real / computed tokens"
    ax.set(title=f"micro-batch fill ({config.mode}): {what}", xlabel="fill", ylabel="micro-batches")
    ax = axes[1, 0]
    ranks = np.arange(config.layout.dp)
    tokens = np.asarray(summary["_rank_tokens"])
    cost = np.asarray(summary["_rank_cost"])
    relative = np.concatenate([tokens / tokens.mean(), cost / cost.mean()])
    ax.bar(ranks - 0.2, tokens / tokens.mean(), width=0.4, label="tokens")
    ax.bar(ranks + 0.2, cost / cost.mean(), width=0.4, label="attention-aware cost")
    ax.axhline(1.0, color="k", lw=0.8)
    spread = max(float(np.abs(relative - 1).max()), 0.005)  # zoom on 1.0: a 1% imbalance stays visible
    ax.set_ylim(1 - 1.5 * spread, 1 + 1.5 * spread)
    ax.set(title="load per data-parallel rank / mean (all steps)", xlabel="DP rank", ylabel="relative load")
    ax.legend()
    ax = axes[1, 1]
    labels = [f"pad to longest\n({config.padded_rows} rows)", f"{config.mode}", "pad to\ncapacity"]
    shares = [
        summary["useful_share_pad_to_longest"],
        summary["useful_share_planned"],
        summary["useful_share_pad_to_capacity"],
    ]
    bars = ax.bar(labels, shares, color=["#C44E52", "#55A868", "#8172B2"])
    for bar, share in zip(bars, shares, strict=True):
        ax.text(bar.get_x() + bar.get_width() / 2, share + 0.01, f"{share:.0%}", ha="center")
    ax.set(title="useful share of computed tokens", ylim=(0, 1.1), ylabel="real tokens / computed tokens")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m mcore_packing plan", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    src = p.add_mutually_exclusive_group()
    src.add_argument("--corpus", choices=REAL_CORPORA, help="built-in real corpus (default: champ)")
    src.add_argument("--lengths", help="file of lengths: .npy, .json list, or whitespace-separated integers")
    src.add_argument("--jsonl", help="JSONL file; its --field is tokenized with --encoding")
    p.add_argument("--field", default="text", help="JSONL field holding the text (default: text)")
    p.add_argument("--encoding", default="qwen3", help="bundled tokenizer for --jsonl/--corpus (default: qwen3)")
    p.add_argument("--mode", choices=MODES, default="packing")
    p.add_argument(
        "--mb-tokens",
        "--capacity",
        dest="mb_tokens",
        type=int,
        default=16384,
        help="train_mb_tokens: tokens per GPU per micro-batch (x cp per packed row)",
    )
    p.add_argument("--algorithm", default=DEFAULT_ALGORITHM.value)
    p.add_argument(
        "--refine",
        choices=["default", "on", "off"],
        default="default",
        help="bin-count refinement after packing (default: the algorithm's, on for MFFD)",
    )
    p.add_argument("--global-batch-size", type=int, default=512, help="sequences per global batch (0: all)")
    p.add_argument("--micro-batch-size", type=int, default=4, help="rows per micro-batch of the padded baseline")
    for name in ("dp", "tp", "pp", "cp"):
        p.add_argument(f"--{name}", type=int, default=1)
    p.add_argument("--sp", action="store_true", help="sequence parallelism")
    p.add_argument("--order", choices=ORDERS, default="auto", help="microbatch_order (default: auto)")
    p.add_argument(
        "--balance",
        choices=BALANCES,
        default="cost",
        help="how micro-batches go to DP ranks (default: attention-aware cost)",
    )
    recipes = ", ".join(sorted(RECIPES))
    p.add_argument("--recipe", help=f"take the model shape from a recipe of mcore_packing.app.recipes: {recipes}")
    for name, key in (
        ("layers", "num_layers"),
        ("hidden", "hidden_size"),
        ("heads", "num_attention_heads"),
        ("kv-heads", "num_query_groups"),
        ("ffn", "ffn_hidden_size"),
        ("vocab", "vocab_size"),
    ):
        p.add_argument(f"--{name}", dest=key, type=int, default=None)
    p.add_argument("--png", default=None, help="write the figure to this PNG file (none unless given)")
    p.add_argument("--no-png", action="store_true", help="write no figure even with --png (scripts)")
    p.add_argument("--no-recommend", action="store_true", help="skip the budget recommendation")
    p.add_argument("--json", action="store_true", help="print one JSON document instead of text")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return _run(args)
    except PlanInputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


_SHAPE_FLAGS = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size", "vocab_size")


def _shape_from_args(args) -> ModelShape:
    """``--recipe``'s shape (default: the Llama-3-8B recipe's), with any of the shape flags applied."""
    if args.recipe and args.recipe not in RECIPES:
        raise PlanInputError(f"Unknown recipe {args.recipe!r}. Available: {', '.join(sorted(RECIPES))}.")
    shape = recipe_shape(args.recipe) if args.recipe else DEFAULT_SHAPE
    changes = {key: getattr(args, key) for key in _SHAPE_FLAGS if getattr(args, key) is not None}
    try:
        return dataclasses.replace(shape, **changes)
    except ValueError as exc:
        raise PlanInputError(str(exc)) from None


def _read_lengths(args) -> tuple[str, np.ndarray]:
    if args.lengths:
        source, lengths = args.lengths, load_lengths(args.lengths)
    elif args.jsonl:
        source, lengths = args.jsonl, jsonl_lengths(args.jsonl, args.field, args.encoding)
    else:
        corpus = args.corpus or "champ"
        source, lengths = f"real:{corpus} ({args.encoding} tokens)", real_corpus_lengths(corpus, args.encoding)
    if (lengths <= 0).any():
        bad = int(np.flatnonzero(lengths <= 0)[0])
        raise PlanInputError(f"{source}: length {bad} is {int(lengths[bad])}; every sequence needs at least one token.")
    return source, lengths


def _config_from_args(args, model: CostModel, model_shape: ModelShape) -> StepPlanConfig:
    for name in ("mb_tokens", "dp", "tp", "pp", "cp", "micro_batch_size"):
        if getattr(args, name) < 1:
            raise PlanInputError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}.")
    if args.global_batch_size < 0:
        raise PlanInputError("--global-batch-size must be >= 0 (0 plans the whole data set as one batch).")
    if 0 < args.global_batch_size < args.dp:
        raise PlanInputError(
            f"--global-batch-size {args.global_batch_size} is smaller than --dp {args.dp}; every rank needs a sample."
        )
    try:
        resolve_algorithm(args.algorithm)
        layout = ParallelLayout(dp=args.dp, tp=args.tp, pp=args.pp, cp=args.cp, sequence_parallel=args.sp)
        layout.check_heads(model_shape.num_attention_heads, model_shape.kv_heads)
        return StepPlanConfig(
            mode=args.mode,
            train_mb_tokens=args.mb_tokens,
            algorithm=args.algorithm,
            refine=_REFINE[args.refine],
            layout=layout,
            padded_rows=args.micro_batch_size,
            balance=args.balance,
            microbatch_order=args.order,
            cost_model=model,
        )
    except ValueError as exc:
        flags = {"model.num_attention_heads": "--heads", "model.num_query_groups": "--kv-heads", "parallel.tp": "--tp"}
        message = str(exc)
        for key, flag in flags.items():
            message = message.replace(key, flag)
        raise PlanInputError(message) from None


def _run(args: argparse.Namespace) -> int:
    shape = _shape_from_args(args)
    model = CostModel.from_shape(shape)
    config = _config_from_args(args, model, shape)
    source, lengths = _read_lengths(args)
    try:
        if args.mode != "padded":
            config.check_fits(lengths, key="--mb-tokens", fix="truncate or split those sequences upstream")
        summary = summarize(
            lengths,
            config,
            global_batch_size=args.global_batch_size,
            padded_rows=args.micro_batch_size,
            model=model,
            progress=not args.json,
        )
    except ValueError as exc:
        raise PlanInputError(str(exc)) from None
    if args.png and not args.no_png:
        write_png(args.png, lengths, summary, config, source)
    doc = _document(args, source, lengths, config, shape, summary)
    if args.json:
        print(json.dumps(doc, indent=1))
    else:
        _print_text(doc)
    return 0


def _document(args, source, lengths, config: StepPlanConfig, shape: ModelShape, summary: dict) -> dict:
    capacity = config.row_capacity()
    packer = get_packer(args.algorithm, capacity, refine=config.refine)
    whole = None
    if args.mode == "packing":
        padded = config.padded_lengths(lengths)
        whole = PackingMetrics.compute(padded, packer.pack_bins(padded), capacity).to_dict()
    recommend = not args.no_recommend and args.mode != "padded"
    return {
        "source": source,
        "num_sequences": int(lengths.size),
        "num_tokens": int(lengths.sum()),
        "length": {
            "mean": float(lengths.mean()),
            "median": float(np.median(lengths)),
            "p99": float(np.percentile(lengths, 99)),
            "max": int(lengths.max()),
        },
        "config": {
            "mode": args.mode,
            "train_mb_tokens": args.mb_tokens,
            "row_capacity": capacity,
            "algorithm": resolve_algorithm(args.algorithm).value,
            "refine": packer.refine,
            "global_batch_size": args.global_batch_size,
            "dp": args.dp,
            "tp": args.tp,
            "pp": args.pp,
            "cp": args.cp,
            "sp": args.sp,
            "padded_rows": config.padded_rows,
            "balance": args.balance,
            "model_shape": shape.to_dict(),
        },
        "summary": {k: v for k, v in summary.items() if not k.startswith("_")},
        "whole_dataset_packing": whole,
        "budget": recommend_budget(lengths, config, args.global_batch_size, config.cost_model) if recommend else None,
        "png": args.png if args.png and not args.no_png else None,
    }


def _print_text(doc: dict) -> None:
    s, c, L = doc["summary"], doc["config"], doc["length"]
    print(f"source: {doc['source']}")
    print(
        f"  {doc['num_sequences']:,} sequences, {doc['num_tokens']:,} tokens; length mean {L['mean']:.0f}, "
        f"median {L['median']:.0f}, p99 {L['p99']:.0f}, max {L['max']:,}"
    )
    print(
        f"plan: mode={c['mode']} train_mb_tokens={c['train_mb_tokens']} (row {c['row_capacity']} tokens) "
        f"algorithm={c['algorithm']} refine={c['refine']} global_batch_size={c['global_batch_size']} "
        f"dp={c['dp']} tp={c['tp']} pp={c['pp']} cp={c['cp']} sp={c['sp']}"
    )
    print(
        f"  micro-batches: {s['micro_batches']:,} over {s['num_global_batches']} global batches "
        f"({s['micro_batches_per_rank_per_step']:.1f} per rank per step); lower bound {s['lower_bound']:,}; "
        f"packing efficiency {s['packing_efficiency']:.4f}; row capacity fill {s['capacity_fill']:.3f}"
    )
    print(
        f"  useful share of computed tokens: {s['useful_share_planned']:.3f} planned vs "
        f"{s['useful_share_pad_to_longest']:.3f} pad-to-longest ({c['padded_rows']} rows) vs "
        f"{s['useful_share_pad_to_capacity']:.3f} pad-to-capacity"
    )
    print(
        f"  padding saved: {s['padding_saved_vs_pad_to_longest']:.1%} of pad-to-longest's, "
        f"{s['padding_saved_vs_pad_to_capacity']:.1%} of pad-to-capacity's"
    )
    print(
        f"  predicted compute saved vs pad-to-longest: {s['compute_saved_linear_only']:.1%} (token-linear), "
        f"{s['compute_saved_with_attention']:.1%} (with attention; attention is "
        f"{s['attention_share_of_real_work']:.1%} of the real work for this model)"
    )
    print(
        f"  slowest DP rank / mean: tokens {s['rank_token_imbalance_mean']:.3f} (worst step "
        f"{s['rank_token_imbalance_worst']:.3f}), attention-aware cost {s['rank_cost_imbalance_mean']:.3f} "
        f"(worst {s['rank_cost_imbalance_worst']:.3f})"
    )
    _print_step_time_and_fill(s, c)
    if doc["whole_dataset_packing"]:
        w = doc["whole_dataset_packing"]
        print(
            f"  whole data set as one pack: {w['num_bins']:,} bins, lower bound {w['lower_bound']:,}, "
            f"efficiency {w['packing_efficiency']:.4f}"
        )
    if doc["budget"]:
        b = doc["budget"]
        tried = ", ".join(
            f"{r['train_mb_tokens']}: {r['score']:.3f} ({r['micro_batches_per_rank_per_step']:.1f} mb/rank)"
            for r in b["candidates"]
        )
        print(
            f"  budget: recommend train_mb_tokens={b['recommended_train_mb_tokens']}, the smallest within 1 point "
            f"of the best {b['criterion']} tried: {tried}"
        )
    if doc["png"]:
        print(f"wrote {doc['png']}")


def _print_step_time_and_fill(s: dict, c: dict) -> None:
    """The predicted step time against its bound, the fill histogram and the half-empty rows."""
    bound = "total cost / DP" + (" and the 1F1B pipeline bound" if c["pp"] > 1 else "")
    print(
        f"  predicted step time: {s['predicted_over_lower_bound']:.3f}x its lower bound ({bound}): "
        f"{s['predicted_step_cost']:.4g} vs {s['step_cost_lower_bound']:.4g} per step"
    )
    if c["mode"] == "packing":
        histogram = ", ".join(f"{10 * k}-{10 * k + 10}%: {n}" for k, n in enumerate(s["fill_histogram"]) if n)
        print(f"  micro-batch fill (real tokens / row capacity): {histogram}")
        forced = s["below_half_full_forced_by_equal_counts"]
        print(
            f"  below half full: {s['below_half_full']} of {s['micro_batches']:,} micro-batches; {forced} forced by "
            f"equal counts per rank (packing alone needs fewer rows than a multiple of dp={c['dp']}), "
            f"{s['below_half_full'] - forced} otherwise"
        )


if __name__ == "__main__":
    raise SystemExit(main())
