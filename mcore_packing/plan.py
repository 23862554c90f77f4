"""``python -m mcore_packing.plan``: what packing will do to your data, before you train.

Reads sequence lengths (a built-in real corpus, a file of lengths, or a JSONL file tokenized with a
bundled vocabulary), cuts them into global batches in data order, plans every batch exactly as training
would (`planning.plan_step`: packing, dynamic or padded; DP/TP/PP/CP/SP), and reports:

- packing efficiency, bins and the lower bound ceil(tokens / capacity);
- micro-batches per data-parallel rank;
- per-rank imbalance of tokens and of attention-aware cost (slowest rank / mean);
- padding saved against pad-to-longest micro-batches and against pad-to-capacity;
- predicted compute saved, from linear and quadratic (attention) FLOPs of the model shape;
- a budget recommendation (the smallest budget whose utilization is within 1% of the best tried).

It writes one PNG (length histogram, micro-batch fill, per-rank load, useful-token share per mode) and,
with ``--json``, one JSON document. Bad input exits with code 2 and a message that says what to fix.

    python -m mcore_packing.plan                                        # CHAMP conversations, qwen3 tokens
    python -m mcore_packing.plan --jsonl my.jsonl --field text --dp 8 --cp 2 --recipe llama3_8b_sft_packed
    python -m mcore_packing.plan --lengths lengths.npy --mb-tokens 8192 --json > plan.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from .config import model_shape
from .cost import CostModel
from .data.real_text import REAL_CORPORA, real_corpus_lengths
from .packing import DEFAULT_ALGORITHM, PackingMetrics, get_packer, resolve_algorithm
from .planning import MODES, StepPlanConfig, plan_step
from .recipes import RECIPES, llama3_8b_sft_packed

__all__ = ["PlanInputError", "load_lengths", "main", "summarize"]

# Default model shape for cost numbers: the Llama-3-8B recipe's.
DEFAULT_SHAPE = model_shape(llama3_8b_sft_packed())


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

    from .data.real_text import get_tokenizer, read_jsonl_texts

    try:
        texts = read_jsonl_texts(path, field)
    except (FileNotFoundError, ValueError) as exc:
        raise PlanInputError(f"{exc} (pass --field NAME for another field)") from None
    return np.asarray(quicktok.count_batch(get_tokenizer(encoding), texts), dtype=np.int64)


def _progress(done: int, total: int, start: float) -> None:
    sys.stderr.write(f"\rplanning global batches: {done}/{total} ({time.time() - start:4.1f}s)")
    if done == total:
        sys.stderr.write("\n")
    sys.stderr.flush()


def _padded_cost(lengths: np.ndarray, rows: int, model: CostModel, cp: int) -> tuple[int, float]:
    """Tokens and cost of pad-to-longest micro-batches of ``rows`` consecutive sequences."""
    starts = np.arange(0, lengths.size, rows)
    width = np.maximum.reduceat(lengths, starts).astype(np.float64)
    count = np.diff(np.append(starts, lengths.size)).astype(np.float64)
    tokens = int((width * count).sum())
    cost = float((count * (model.linear * width + model.quadratic * width * width)).sum()) / cp
    return tokens, cost


def summarize(
    lengths: np.ndarray,
    config: StepPlanConfig,
    *,
    global_batch_size: int,
    padded_rows: int,
    model: CostModel,
    progress: bool = False,
) -> dict:
    """Plan every global batch and aggregate the statistics reported by the CLI."""
    step = global_batch_size if global_batch_size > 0 else lengths.size
    batches = range(0, lengths.size, step)
    total_batches = len(batches)
    show = progress and total_batches >= 200 and sys.stderr.isatty()
    start = time.time()
    cp = config.cp_size
    multiple = config.length_multiple
    planned_tokens = 0
    planned_cost = 0.0
    padded_tokens = 0
    padded_cost = 0.0
    lower = 0
    bins = 0
    token_imbalance, cost_imbalance, fills = [], [], []
    rank_tokens_total = np.zeros(config.dp_size)
    rank_cost_total = np.zeros(config.dp_size)
    for k, lo in enumerate(batches):
        batch = lengths[lo : lo + step]
        plan = plan_step(batch, config)
        capacity = config.row_capacity()
        lower += -(-int(batch.sum()) // capacity)
        rank_tokens = np.zeros(config.dp_size)
        rank_cost = np.zeros(config.dp_size)
        for r, micro in enumerate(plan.micro_batches):
            for mb in micro:
                bins += 1
                planned_tokens += mb.padded_tokens
                seq = batch[np.asarray(mb.sample_indices)]
                if config.mode == "packing":
                    spans = -(-seq // multiple) * multiple
                    extra = mb.shape[1] - int(spans.sum())  # row padding sits in the last span
                    spans[-1] += extra
                    c = float(model.sequence_cost(spans, cp).sum())
                else:
                    rows, width = mb.shape
                    c = rows * float(model.sequence_cost([width], cp)[0])
                # Packing: how full the row capacity is; padded layouts: real / computed tokens.
                fills.append(int(seq.sum()) / (capacity if config.mode == "packing" else mb.padded_tokens))
                rank_tokens[r] += mb.padded_tokens
                rank_cost[r] += c
                planned_cost += c
        token_imbalance.append(rank_tokens.max() / rank_tokens.mean())
        cost_imbalance.append(rank_cost.max() / rank_cost.mean())
        rank_tokens_total += rank_tokens
        rank_cost_total += rank_cost
        t, c = _padded_cost(batch, padded_rows, model, cp)
        padded_tokens += t
        padded_cost += c
        if show and (k % 50 == 0 or k == total_batches - 1):
            _progress(k + 1, total_batches, start)
    real = int(lengths.sum())
    real_cost = float(model.sequence_cost(lengths, cp).sum())
    return {
        "num_global_batches": total_batches,
        "micro_batches": bins,
        "micro_batches_per_rank_per_step": bins / total_batches / config.dp_size,
        "lower_bound": lower,
        "packing_efficiency": lower / bins if bins else 1.0,
        "useful_share_planned": real / planned_tokens,
        "capacity_fill": real / (bins * config.row_capacity()) if bins else 1.0,
        "useful_share_pad_to_longest": real / padded_tokens,
        "useful_share_pad_to_capacity": real / (lengths.size * config.row_capacity()),
        "padding_saved_vs_pad_to_longest": 1 - (planned_tokens - real) / max(padded_tokens - real, 1),
        "padding_saved_vs_pad_to_capacity": 1
        - (planned_tokens - real) / max(lengths.size * config.row_capacity() - real, 1),
        "compute_saved_linear_only": 1 - planned_tokens / padded_tokens,
        "compute_saved_with_attention": 1 - planned_cost / padded_cost,
        "attention_share_of_real_work": model.attention_share(lengths),
        "rank_token_imbalance_mean": float(np.mean(token_imbalance)),
        "rank_token_imbalance_worst": float(np.max(token_imbalance)),
        "rank_cost_imbalance_mean": float(np.mean(cost_imbalance)),
        "rank_cost_imbalance_worst": float(np.max(cost_imbalance)),
        "real_cost": real_cost,
        "_fills": fills,
        "_rank_tokens": rank_tokens_total.tolist(),
        "_rank_cost": rank_cost_total.tolist(),
    }


def recommend_budget(lengths: np.ndarray, base: StepPlanConfig, global_batch_size: int, model: CostModel) -> dict:
    """Try budgets from the longest padded sample up to 4x it and pick the smallest one that is within one
    point of the best tried: for packing the fill of the row capacity (real tokens / micro-batches x
    capacity), for dynamic batching the useful share of computed tokens. Larger budgets mean fewer,
    bigger micro-batches (less per-micro-batch overhead) and more activation memory."""
    multiple = base.length_multiple
    longest = -(-int(lengths.max()) // multiple) * multiple
    floor = -(-longest // base.cp_size)
    candidates = sorted({_round_up(int(floor * f), 256) for f in (1, 1.25, 1.5, 2, 3, 4)})
    sample = lengths[: max(global_batch_size, 1) * 20] if global_batch_size > 0 else lengths
    key = "capacity_fill" if base.mode == "packing" else "useful_share_planned"
    rows = []
    for budget in candidates:
        cfg = _replace(base, train_mb_tokens=budget)
        s = summarize(sample, cfg, global_batch_size=global_batch_size, padded_rows=4, model=model)
        rows.append(
            {
                "train_mb_tokens": budget,
                "score": s[key],
                "micro_batches_per_rank_per_step": s["micro_batches_per_rank_per_step"],
            }
        )
    best = max(r["score"] for r in rows)
    pick = next(r for r in rows if r["score"] >= best - 0.01)
    return {"recommended_train_mb_tokens": pick["train_mb_tokens"], "criterion": key, "candidates": rows}


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def _replace(config: StepPlanConfig, **changes) -> StepPlanConfig:
    from dataclasses import replace

    return replace(config, **changes)


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
    ax.axvline(config.row_capacity() / config.cp_size * config.cp_size, color="k", ls="--", lw=1, label="row capacity")
    ax.set(title=f"sequence lengths ({source}, n={lengths.size:,})", xlabel="tokens", ylabel="sequences (log)")
    ax.legend()
    ax = axes[0, 1]
    ax.hist(summary["_fills"], bins=40, range=(0, 1), color="#55A868")
    what = "real tokens / row capacity" if config.mode == "packing" else "real / computed tokens"
    ax.set(title=f"micro-batch fill ({config.mode}): {what}", xlabel="fill", ylabel="micro-batches")
    ax = axes[1, 0]
    ranks = np.arange(config.dp_size)
    tokens = np.asarray(summary["_rank_tokens"])
    cost = np.asarray(summary["_rank_cost"])
    ax.bar(ranks - 0.2, tokens / tokens.mean(), width=0.4, label="tokens")
    ax.bar(ranks + 0.2, cost / cost.mean(), width=0.4, label="attention-aware cost")
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set(title="load per data-parallel rank / mean (all steps)", xlabel="DP rank", ylabel="relative load")
    ax.legend()
    ax = axes[1, 1]
    labels = ["pad to longest\n(4 rows)", f"{config.mode}", "pad to\ncapacity"]
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
        prog="python -m mcore_packing.plan", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
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
    p.add_argument(
        "--balance",
        choices=["cost", "tokens", "round_robin"],
        default="cost",
        help="how micro-batches go to DP ranks (default: attention-aware cost)",
    )
    p.add_argument("--recipe", help="take the model shape from a recipe (see mcore_packing.recipes)")
    for name, key in (
        ("layers", "num_layers"),
        ("hidden", "hidden_size"),
        ("heads", "num_attention_heads"),
        ("kv-heads", "num_query_groups"),
        ("ffn", "ffn_hidden_size"),
        ("vocab", "vocab_size"),
    ):
        p.add_argument(f"--{name}", dest=key, type=int, default=None)
    p.add_argument("--png", default="plan.png", help="write the figure here (default: plan.png)")
    p.add_argument("--no-png", action="store_true")
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


def _model_from_args(args) -> tuple[CostModel, dict]:
    shape = dict(DEFAULT_SHAPE)
    if args.recipe:
        if args.recipe not in RECIPES:
            raise PlanInputError(f"Unknown recipe {args.recipe!r}. Available: {', '.join(sorted(RECIPES))}.")
        shape = model_shape(RECIPES[args.recipe]())  # each recipe's default cluster fits its layout
    for key in (
        "num_layers",
        "hidden_size",
        "num_attention_heads",
        "num_query_groups",
        "ffn_hidden_size",
        "vocab_size",
    ):
        if getattr(args, key) is not None:
            shape[key] = getattr(args, key)
    return CostModel.from_shape(**shape), shape


def _run(args: argparse.Namespace) -> int:
    for name in ("mb_tokens", "dp", "tp", "pp", "cp", "micro_batch_size"):
        if getattr(args, name) < 1:
            raise PlanInputError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}.")
    if args.global_batch_size < 0:
        raise PlanInputError("--global-batch-size must be >= 0 (0 plans the whole data set as one batch).")
    try:
        resolve_algorithm(args.algorithm)
    except ValueError as exc:
        raise PlanInputError(str(exc)) from None
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
    model, shape = _model_from_args(args)
    try:
        config = StepPlanConfig(
            mode=args.mode,
            train_mb_tokens=args.mb_tokens,
            algorithm=args.algorithm,
            refine=_REFINE[args.refine],
            dp_size=args.dp,
            tp_size=args.tp,
            pp_size=args.pp,
            cp_size=args.cp,
            sequence_parallel=args.sp,
            padded_rows=args.micro_batch_size,
            balance=args.balance,
            cost_model=model,
        )
    except ValueError as exc:
        raise PlanInputError(str(exc)) from None
    capacity = config.row_capacity()
    padded_lengths = -(-lengths // config.length_multiple) * config.length_multiple
    too_long = int(np.count_nonzero(padded_lengths > capacity))
    if too_long and args.mode != "padded":
        need = -(-int(padded_lengths.max()) // args.cp)
        raise PlanInputError(
            f"{too_long} of {lengths.size} sequences are longer than a micro-batch ({capacity} tokens = --mb-tokens "
            f"{args.mb_tokens} x cp {args.cp}; longest {int(lengths.max())}). Raise --mb-tokens to at least {need}, "
            "raise --cp, or truncate/split those sequences upstream."
        )
    gbs = args.global_batch_size
    if 0 < gbs < args.dp:
        raise PlanInputError(f"--global-batch-size {gbs} is smaller than --dp {args.dp}; every rank needs a sample.")
    try:
        summary = summarize(
            lengths,
            config,
            global_batch_size=gbs,
            padded_rows=args.micro_batch_size,
            model=model,
            progress=not args.json,
        )
    except ValueError as exc:
        raise PlanInputError(str(exc)) from None
    packer = get_packer(args.algorithm, capacity, refine=config.refine)
    whole = None
    if args.mode == "packing":
        packed = packer.pack_bins(padded_lengths)
        whole = PackingMetrics.compute(padded_lengths, packed, capacity).to_dict()
    recommendation = (
        None if args.no_recommend or args.mode == "padded" else recommend_budget(lengths, config, gbs, model)
    )
    if not args.no_png:
        write_png(args.png, lengths, summary, config, source)
    doc = {
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
            "global_batch_size": gbs,
            "dp": args.dp,
            "tp": args.tp,
            "pp": args.pp,
            "cp": args.cp,
            "sp": args.sp,
            "balance": args.balance,
            "model_shape": shape,
        },
        "summary": {k: v for k, v in summary.items() if not k.startswith("_")},
        "whole_dataset_packing": whole,
        "budget": recommendation,
        "png": None if args.no_png else args.png,
    }
    if args.json:
        print(json.dumps(doc, indent=1))
        return 0
    _print_text(doc)
    return 0


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
        f"{s['useful_share_pad_to_longest']:.3f} pad-to-longest (4 rows) vs {s['useful_share_pad_to_capacity']:.3f} "
        "pad-to-capacity"
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


if __name__ == "__main__":
    raise SystemExit(main())
