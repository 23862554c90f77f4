"""``python -m mcore_packing plan``: what packing will do to your data, before you train.

It plans the run you would train: the config is the training config (the Hydra defaults or ``--recipe``,
with the same Hydra overrides as ``train``), and by default the data is the run's data, loaded, checked and
tokenized exactly as the trainer does (`trainer.prepare_run`: the checkpoint's tokenizer and chat template
with ``model.hf_path``, the long-sample policy, every check of ``train --dry-run``), drawn in the run's
global batches (the seeded sampler, ``training.steps`` of them) and planned as the training pass plans
them (DPO keeps pairs together, GRPO plans each minibatch). ``--lengths`` or ``--corpus`` plan other
lengths with the run's settings instead, in consecutive global batches. Every flag below is a shorthand
for a config key (``--tp`` is ``parallel.tp``, ``--mb-tokens`` the active budget, ``--hf-path``
``model.hf_path``, ``--jsonl`` a JSONL data file) and defaults to the config's value: one source of
defaults for ``plan`` and ``train``. It reports (`mcore_packing.planning.report`):

- packing efficiency, bins and the lower bound ceil(tokens / capacity);
- micro-batches per data-parallel rank;
- per-rank imbalance of tokens and of attention-aware cost (slowest rank / mean);
- padding saved against pad-to-longest micro-batches and against pad-to-capacity;
- predicted compute saved, from linear and quadratic (attention) FLOPs of the model shape;
- a budget recommendation (the smallest budget whose utilization is within 1% of the best tried).

With ``--png FILE`` it draws one figure (length histogram, micro-batch fill, per-rank load, useful-token
share per mode); with ``--json`` it prints one JSON document. Bad input exits with code 2 and a message
that says what to fix. Never imports torch or megatron-core: it runs on a login node.

    python -m mcore_packing plan                                     # the default run (tiny GPT, CHAMP)
    python -m mcore_packing plan --recipe llama3_8b_sft_packed --hf-path /ckpt/Llama-3.1-8B \
        --jsonl chat.jsonl --field messages                          # your data, the checkpoint's tokenizer
    python -m mcore_packing plan --recipe qwen2_7b_grpo_cp grpo.rollouts=rollouts.jsonl parallel.cp=4
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
from ..packing import PackingMetrics, get_packer, resolve_algorithm
from ..planning import (
    BALANCES,
    FP8_ROW_ALIGNMENT,
    MODES,
    ORDERS,
    ModelShape,
    StepPlanConfig,
    recommend_budget,
    summarize,
)
from ..planning.memory import format_bytes
from ..planning.report import summarize_dynamic_cp
from ..planning.shared_prefix import SharedPrefix
from .config import ConfigError, TrainConfig
from .recipes import RECIPES
from .run_settings import budget_key, check_shape_on_layout, plan_config, validate_layout

__all__ = ["DEFAULT_SHAPE", "PlanInputError", "build_parser", "load_lengths", "main"]


def recipe_shape(name: str) -> ModelShape:
    """A recipe's model shape with its data vocabulary (each recipe's default cluster fits its layout)."""
    cfg = RECIPES[name]()
    return cfg.model.shape(cfg.data.vocab_size)


DEFAULT_SHAPE = recipe_shape("llama3_8b_sft_packed")
"""The Llama-3-8B recipe's model shape (the benchmarks price their plans with it)."""


class PlanInputError(ValueError):
    """Bad user input for the planner; reported with exit code 2."""


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


def write_png(path: str, lengths: np.ndarray, summary: dict, config: StepPlanConfig, source: str,
              dynamic: dict | None = None, memory: dict | None = None) -> None:  # fmt: skip
    """One figure: length histogram, micro-batch fill, per-rank load, useful-token share per layout; with
    ``memory`` (a memory budget) each stage's predicted peak at the run's budget and at the largest that fits."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise PlanInputError("--png needs matplotlib: pip install 'mcore-packing[plot]', or pass --no-png.") from exc
    fig, axes = plt.subplots(2, 3 if memory else 2, figsize=(18 if memory else 12, 8))
    if memory:
        _draw_memory(axes[0, 2], memory["stages"], memory["budget"], f"train_mb_tokens={memory['train_mb_tokens']}")
        _draw_memory(axes[1, 2], memory["largest_stages"], memory["budget"],
                     f"largest under the budget: {memory['largest_train_mb_tokens']}")  # fmt: skip
    ax = axes[0, 0]
    ax.hist(lengths, bins=60, color="#4C72B0")
    ax.set_yscale("log")
    ax.axvline(config.row_capacity(), color="k", ls="--", lw=1, label="row capacity")
    ax.set(title=f"sequence lengths ({source}, n={lengths.size:,})", xlabel="tokens", ylabel="sequences (log)")
    if dynamic is not None:  # the CP sizes dynamic CP gives these sequences
        used = "\n".join(f"CP {k}: {n:,}" for k, n in dynamic["cp_sizes"].items())
        ax.text(0.98, 0.6, f"dynamic CP\n{used}\nstatic/dynamic {dynamic['static_over_dynamic']:.3f}",
                transform=ax.transAxes, ha="right", va="top", fontsize=9)  # fmt: skip
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


def _draw_memory(ax, stages: list[dict], budget: int, title: str) -> None:
    """Stacked bars of each pipeline stage's predicted static bytes and activations (GiB), the budget a line."""
    names = [f"stage {d['stage']}" for d in stages]
    static = [d["static"] / 2**30 for d in stages]
    ax.bar(names, static, color="#8172B2", label="static (parameters, gradients, optimizer)")
    ax.bar(names, [d["activations"] / 2**30 for d in stages], bottom=static, color="#DD8452",
           label="activations (peak over the schedule)")  # fmt: skip
    ax.axhline(budget / 2**30, color="k", ls="--", lw=1, label="memory budget")
    ax.set(title=f"predicted peak per GPU, {title}", ylabel="GiB")
    ax.legend(fontsize=8)


_KEYS = {
    "tp": "parallel.tp",
    "pp": "parallel.pp",
    "cp": "parallel.cp",
    "ep": "parallel.ep",
    "vpp": "parallel.vpp",
    "sp": "parallel.sequence_parallel",
    "fp8_recipe": "model.fp8_recipe",
    "dynamic_cp": "context_parallel.dynamic",
    "global_batch_size": "training.global_batch_size",
    "micro_batch_size": "training.padded_micro_batch_rows",
    "balance": "training.balance",
    "steps": "training.steps",
    "algorithm": "sequence_packing.algorithm",
    "refine": "sequence_packing.refine",
    "order": "sequence_packing.microbatch_order",
    "hf_path": "model.hf_path",
    "prepared": "data.prepared",
    "encoding": "data.encoding",
    "field": "data.text_field",
    "num_layers": "model.num_layers",
    "hidden_size": "model.hidden_size",
    "num_attention_heads": "model.num_attention_heads",
    "num_query_groups": "model.num_query_groups",
    "ffn_hidden_size": "model.ffn_hidden_size",
    "vocab_size": "model.vocab_size",
}
"""Each flag's config key: a flag is a shorthand, and the config is the one source of every default."""

_MODES = {
    "packing": ("true", "false"),
    "dynamic": ("false", "true"),
    "padded": ("false", "false"),
}
"""``--mode``: (sequence_packing.enabled, dynamic_batching.enabled)."""


_SHAPE_FLAGS = (
    ("layers", "num_layers"),
    ("hidden", "hidden_size"),
    ("heads", "num_attention_heads"),
    ("kv-heads", "num_query_groups"),
    ("ffn", "ffn_hidden_size"),
    ("vocab", "vocab_size"),
)
"""(flag, ``model.*`` key) of the model-shape flags."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m mcore_packing plan",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Other arguments are Hydra overrides of the training config, as for train (data=jsonl ...).",
    )
    src = p.add_mutually_exclusive_group()
    src.add_argument("--corpus", choices=REAL_CORPORA, help="plan a built-in real corpus's lengths (--encoding tokens)")
    src.add_argument("--lengths", help="plan a file of lengths: .npy, .json list, or whitespace-separated integers")
    src.add_argument("--jsonl", help="the run's data from this JSONL file (data.source=jsonl data.path=FILE)")
    src.add_argument("--prepared", help="the run's data from a store written by prepare (data.prepared=STORE)")
    p.add_argument("--field", help="data.text_field: the JSONL field with the text or the chat messages")
    p.add_argument("--hf-path", help="model.hf_path: the checkpoint's shape, tokenizer and chat template")
    p.add_argument("--encoding", help="data.encoding: the bundled vocabulary (no --hf-path)")
    p.add_argument("--mode", choices=MODES, help="packing | dynamic | padded (default: the config's)")
    p.add_argument("--mb-tokens", "--capacity", dest="mb_tokens", type=int,
                   help="train_mb_tokens of the active section: tokens per GPU per micro-batch")  # fmt: skip
    p.add_argument("--memory-budget", help="memory_budget of the active section: bytes per GPU (e.g. 72GiB); "
                   "prints each stage's predicted peak and the largest train_mb_tokens that fits")  # fmt: skip
    p.add_argument("--algorithm", help="sequence_packing.algorithm")
    p.add_argument(
        "--refine",
        choices=["default", "on", "off"],
        help="sequence_packing.refine: bin-count refinement after packing (default: the algorithm's)",
    )
    p.add_argument("--global-batch-size", type=int,
                   help="training.global_batch_size (0 with --lengths/--corpus: all of them in one batch)")  # fmt: skip
    p.add_argument("--micro-batch-size", type=int, help="training.padded_micro_batch_rows (the padded baseline)")
    p.add_argument("--steps", type=int, help="training.steps: how many of the run's global batches to plan")
    p.add_argument("--dp", type=int, help="data-parallel ranks (default: the config's cluster / (tp x pp x cp))")
    for name in ("tp", "pp", "cp", "ep", "vpp"):
        p.add_argument(f"--{name}", type=int, help=f"parallel.{name}")
    p.add_argument("--sp", action=argparse.BooleanOptionalAction, help="parallel.sequence_parallel")
    p.add_argument("--fp8-recipe", choices=sorted(FP8_ROW_ALIGNMENT),
                   help="model.fp8_recipe: pad each row so every rank's share suits FP8 GEMMs")  # fmt: skip
    p.add_argument("--order", choices=ORDERS, help="sequence_packing.microbatch_order")
    p.add_argument("--dynamic-cp", action="store_true", default=None,
                   help="context_parallel.dynamic=true: plan dynamic context parallelism (each sequence on the CP "
                   "size it needs, up to --cp, --mb-tokens or context_parallel.max_tokens_per_rank per rank) and "
                   "compare its predicted step time with static CP's plan, which the report shows")  # fmt: skip
    p.add_argument("--balance", choices=BALANCES, help="training.balance: how micro-batches go to DP ranks")
    recipes = ", ".join(sorted(RECIPES))
    p.add_argument("--recipe", help=f"start from a recipe of mcore_packing.app.recipes: {recipes}")
    p.add_argument("--num-nodes", type=int, help="with --recipe: nodes the recipe plans for")
    p.add_argument("--gpus-per-node", type=int, help="with --recipe: GPUs per node")
    for name, key in _SHAPE_FLAGS:
        p.add_argument(f"--{name}", dest=key, type=int, help=f"model.{key}")
    p.add_argument("--png", default=None, help="write the figure to this PNG file (none unless given)")
    p.add_argument("--no-png", action="store_true", help="write no figure even with --png (scripts)")
    p.add_argument("--no-recommend", action="store_true", help="skip the budget recommendation")
    p.add_argument("--json", action="store_true", help="print one JSON document instead of text")
    return p


def _flag(dest: str) -> str:
    """The flag the user typed for ``dest`` (the model-shape flags are short names)."""
    short = {key: name for name, key in _SHAPE_FLAGS}
    return "--" + short.get(dest, dest.replace("_", "-"))


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, overrides = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    unknown = [o for o in overrides if o.startswith("-")]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)} (see --help; other arguments are Hydra overrides)")
    given: dict[str, str] = {}
    try:
        return _run(args, overrides, given)
    except (PlanInputError, ConfigError) as exc:
        message = str(exc)
        for key, flag in given.items():  # name the flag the user typed, not the key it set
            message = message.replace(key, flag)
        print(f"error: {message}", file=sys.stderr)
        return 2


def _overrides(args, user: list[str], given: dict[str, str]) -> list[str]:
    """The flags as Hydra overrides around the user's: data defaults of ``--jsonl`` first (the user's keys
    win), the flags last. ``--mb-tokens`` sets the budget of both sections (whichever is active plans it);
    ``given`` collects key -> flag for the error messages."""
    head = ["data.source=jsonl", f"data.path={args.jsonl}", "data.num_samples=null"] if args.jsonl else []
    tail = []
    if args.mode is not None:
        packing, dynamic = _MODES[args.mode]
        tail += [f"sequence_packing.enabled={packing}", f"dynamic_batching.enabled={dynamic}"]
    for dest, key in _KEYS.items():
        value = getattr(args, dest)
        if value is None or (dest == "global_batch_size" and value == 0):
            continue
        if dest == "refine":
            value = {"default": "null", "on": "true", "off": "false"}[value]
        elif isinstance(value, bool):
            value = str(value).lower()
        elif dest in ("hf_path", "prepared"):
            value = json.dumps(str(value))  # a quoted string: paths may hold '=' or ':'
        tail.append(f"{key}={value}")
        given[key] = _flag(dest)
    if args.mb_tokens is not None:
        for key in ("sequence_packing.train_mb_tokens", "dynamic_batching.train_mb_tokens"):
            tail.append(f"{key}={args.mb_tokens}")
            given[key] = "--mb-tokens"
    if args.memory_budget is not None:
        for key in ("sequence_packing.memory_budget", "dynamic_batching.memory_budget"):
            tail.append(f"{key}={json.dumps(args.memory_budget)}")
            given[key] = "--memory-budget"
    return [*head, *user, *tail]


def _compose(args, user: list[str], given: dict[str, str]) -> TrainConfig:
    from .train_command import _check_flags, compose_config

    _check_flags(args)
    sizes = {"num_nodes": args.num_nodes, "gpus_per_node": args.gpus_per_node}
    return compose_config(args.recipe, _overrides(args, user, given), **sizes)


def _world(args, cfg: TrainConfig) -> int:
    """``--dp`` x TP x PP x CP, else the config's cluster (which TP x PP x CP must divide)."""
    par = cfg.parallel
    model_parallel = par.tp * par.pp * par.cp
    if args.dp is not None:
        if args.dp < 1:
            raise PlanInputError(f"--dp must be >= 1, got {args.dp}.")
        return args.dp * model_parallel
    world = cfg.cluster.num_nodes * cfg.cluster.gpus_per_node
    if world % model_parallel:
        raise PlanInputError(
            f"the config's cluster has {world} GPU(s) (cluster.num_nodes x cluster.gpus_per_node), which tp x pp x cp "
            f"= {par.tp} x {par.pp} x {par.cp} does not divide: pass --dp N to plan N data-parallel ranks of it."
        )
    return world


def _run(args: argparse.Namespace, user: list[str], given: dict[str, str]) -> int:
    cfg = _compose(args, user, given)
    world = _world(args, cfg)
    if args.lengths or args.corpus:
        source, lengths, config, shape, cuts = _other_lengths(args, cfg, world)
    else:
        if args.global_batch_size == 0:
            raise PlanInputError("--global-batch-size 0 (one batch of everything) is for --lengths/--corpus; the "
                                 "run's data is planned in the run's global batches.")  # fmt: skip
        source, lengths, config, shape, cuts = _run_data(cfg, world)
    gbs, sizes, groups, shared = cuts
    # the pad-to-longest baseline has the run's padded rows (the plan itself only uses them in padded mode)
    config = dataclasses.replace(config, padded_rows=cfg.training.padded_micro_batch_rows)
    dynamic = _dynamic_cp(lengths, config, gbs, sizes, groups)
    config = dataclasses.replace(config, dynamic_cp=False)  # the report: static CP, dynamic CP's baseline
    try:
        summary = summarize(lengths, config, global_batch_size=gbs, padded_rows=config.padded_rows,
                            model=config.cost_model, progress=not args.json, batch_sizes=sizes,
                            groups=groups, shared_prefix=shared)  # fmt: skip
    except ValueError as exc:
        raise PlanInputError(str(exc)) from None
    memory = _memory(cfg, lengths, config, shape, gbs, sizes) if config.memory_budget is not None else None
    if args.png and not args.no_png:
        write_png(args.png, lengths, summary, config, source, dynamic, memory)
    doc = _document(args, cfg, source, lengths, config, shape, summary, cuts)
    doc["dynamic_cp"] = dynamic
    doc["memory"] = memory
    if args.json:
        print(json.dumps(doc, indent=1))
    else:
        _print_text(doc)
    return 0


def _memory(cfg: TrainConfig, lengths, config: StepPlanConfig, shape: ModelShape, gbs: int, sizes) -> dict:
    """The predicted peak per pipeline stage and the largest token budget under ``memory_budget``
    (`app.memory_settings`; the first global batches, planned without groups)."""
    from ..planning.report import global_batch_bounds
    from .memory_settings import memory_report, memory_settings

    batches = [lengths[lo:hi] for lo, hi in global_batch_bounds(lengths.size, gbs, sizes)]
    try:
        return memory_report(batches, config, shape, memory_settings(cfg))
    except ValueError as exc:
        raise PlanInputError(f"memory_budget: {exc}") from None


def _dynamic_cp(lengths, config: StepPlanConfig, gbs: int, sizes, groups) -> dict | None:
    """`summarize_dynamic_cp` when the run has dynamic CP (``context_parallel.dynamic``, ``--dynamic-cp``;
    its checks were the config's), else None."""
    if not config.dynamic_cp:
        return None
    try:
        return summarize_dynamic_cp(lengths, config, global_batch_size=gbs, batch_sizes=sizes, groups=groups)
    except ValueError as exc:
        raise PlanInputError(str(exc)) from None


def _other_lengths(args, cfg: TrainConfig, world: int):
    """``--lengths`` / ``--corpus``: the run's settings, the model's shape, consecutive global batches."""
    layout = validate_layout(cfg, world)
    shape = cfg.model.shape(cfg.data.vocab_size)
    check_shape_on_layout(shape, layout)
    config = plan_config(cfg, layout)
    if args.lengths:
        source, lengths = args.lengths, load_lengths(args.lengths)
    else:
        encoding = cfg.data.encoding
        source, lengths = f"real:{args.corpus} ({encoding} tokens)", real_corpus_lengths(args.corpus, encoding)
    if (lengths <= 0).any():
        bad = int(np.flatnonzero(lengths <= 0)[0])
        raise PlanInputError(f"{source}: length {bad} is {int(lengths[bad])}; every sequence needs at least one token.")
    gbs = 0 if args.global_batch_size == 0 else cfg.training.global_batch_size
    if 0 < gbs < layout.dp:
        raise PlanInputError(f"--global-batch-size {gbs} is smaller than --dp {layout.dp}; every rank needs a sample.")
    if config.mode != "padded":
        try:
            config.check_fits(lengths, key=budget_key(config, cfg=cfg),
                              fix="truncate or split those sequences upstream")  # fmt: skip
        except ValueError as exc:
            raise PlanInputError(str(exc)) from None
    return source, lengths, config, shape, (gbs, None, None, None)


def _run_data(cfg: TrainConfig, world: int):
    """The run's data as the trainer loads it, drawn in its global batches, cut as its training pass plans."""
    from .algorithms import get_algorithm
    from .global_batches import GlobalBatchSampler
    from .trainer import prepare_run

    algorithm = get_algorithm(cfg.algorithm)
    missing = algorithm.missing_data(cfg)
    if missing is not None:
        raise PlanInputError(f"{missing}, or plan other lengths with --lengths FILE or --corpus NAME.")
    inputs = prepare_run(cfg, world, dry_run=True)
    sampler = GlobalBatchSampler(inputs.data.num_units, inputs.batch_units, cfg.training.seed)
    order, sizes, groups, shared_ids, prompts = [], [], [], [], []
    sharing = getattr(algorithm, "shared_prefix", lambda *_: None)
    for _ in range(cfg.training.steps):
        batch_ids = inputs.data.sample_ids(sampler.next_batch())
        for ids, pass_groups in algorithm.training_passes(cfg, inputs.data, batch_ids):
            order += ids
            sizes.append(len(ids))
            groups += pass_groups if pass_groups is not None else [None] * len(ids)
            spec = sharing(cfg, inputs.data, ids)
            if spec is not None:
                shared_ids += spec.group_ids
                prompts += spec.prompt_lengths
    lengths = np.asarray([inputs.lengths[i] for i in order], dtype=np.int64)
    info = inputs.data.info
    source = f"the run's data: {info.get('path') or info['source']} ({info['tokenizer']})"
    shared = SharedPrefix(group_ids=shared_ids, prompt_lengths=prompts) if shared_ids else None
    cuts = (0, sizes, None if all(g is None for g in groups) else groups, shared)
    return source, lengths, inputs.step_config, inputs.shape, cuts


def _document(args, cfg: TrainConfig, source, lengths, config: StepPlanConfig, shape: ModelShape, summary: dict,
              cuts) -> dict:  # fmt: skip
    capacity = config.row_capacity()
    packer = get_packer(config.algorithm, capacity, refine=config.refine)
    gbs, sizes, groups, _ = cuts
    whole = None
    if config.mode == "packing" and groups is None:  # groups (DPO pairs) pack only within their batches
        padded = config.padded_lengths(lengths)
        whole = PackingMetrics.compute(padded, packer.pack_bins(padded), capacity).to_dict()
    recommend = not args.no_recommend and config.mode != "padded"
    layout = config.layout
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
            "recipe": args.recipe,
            "algorithm_of_training": cfg.algorithm,
            "mode": config.mode,
            "train_mb_tokens": config.train_mb_tokens,
            "row_capacity": capacity,
            "algorithm": resolve_algorithm(config.algorithm).value,
            "refine": packer.refine,
            "global_batch_size": gbs if sizes is None else cfg.training.global_batch_size,
            "planned_batches": summary["num_global_batches"],
            "dp": layout.dp,
            "tp": layout.tp,
            "pp": layout.pp,
            "cp": layout.cp,
            "ep": layout.ep,
            "vpp": layout.vpp,
            "microbatch_group": layout.microbatch_group,
            "sp": layout.sequence_parallel,
            "fp8_recipe": cfg.model.fp8_recipe,
            "padded_rows": config.padded_rows,
            "balance": config.balance,
            "model_shape": shape.to_dict(),
        },
        "summary": {k: v for k, v in summary.items() if not k.startswith("_")},
        "whole_dataset_packing": whole,
        "budget": recommend_budget(lengths, config, gbs, config.cost_model, batch_sizes=sizes, groups=groups)
        if recommend
        else None,
        "png": args.png if args.png and not args.no_png else None,
    }


def _print_shared_prefix(shared: dict | None) -> None:
    """The summary's shared-prefix line (GRPO with ``grpo.shared_prefix``); nothing without one."""
    if shared is None:
        return
    alone = len(shared["fallback_groups"])
    fallback = f", {alone} planned as separate sequences" if alone else ""
    print(
        f"  shared prompts (grpo.shared_prefix): {shared['shared_groups']:,} groups{fallback}; computed tokens "
        f"{shared['computed_tokens']:,} of {shared['separate_tokens']:,} ({shared['tokens_saved']:.1%} saved), "
        f"predicted compute saved {shared['predicted_compute_saved']:.1%}"
    )


def _print_shared_prefix_and_memory(shared: dict | None, memory: dict | None) -> None:
    _print_shared_prefix(shared)
    _print_memory(memory)


def _print_memory(memory: dict | None) -> None:
    """The memory lines (``--memory-budget`` / ``memory_budget``); nothing without a budget."""
    if memory is None:
        return

    def peaks(stages):
        return ", ".join(f"stage {d['stage']} {format_bytes(d['peak'])} (static {format_bytes(d['static'])} + "
                         f"activations {format_bytes(d['activations'])})" for d in stages)  # fmt: skip

    print(f"  predicted peak per GPU at train_mb_tokens={memory['train_mb_tokens']}: {peaks(memory['stages'])}")
    print(f"  largest train_mb_tokens under the memory budget of {format_bytes(memory['budget'])}: "
          f"{memory['largest_train_mb_tokens']} ({peaks(memory['largest_stages'])})"
          + ("; a whole global batch fits in one micro-batch" if memory["whole_batch_fits"] else ""))  # fmt: skip


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
        f"({c['planned_batches']} planned batches) "
        f"dp={c['dp']} tp={c['tp']} pp={c['pp']} cp={c['cp']} ep={c['ep']} sp={c['sp']}"
        + (f" vpp={c['vpp']}" if c.get("vpp", 1) > 1 else "")
        + (f" fp8_recipe={c['fp8_recipe']}" if c["fp8_recipe"] else "")
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
    _print_shared_prefix_and_memory(s.get("shared_prefix"), doc.get("memory"))
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
    if doc.get("dynamic_cp"):
        _print_dynamic_cp(doc["dynamic_cp"], c)
    if doc["png"]:
        print(f"wrote {doc['png']}")


def _print_dynamic_cp(d: dict, c: dict) -> None:
    used = ", ".join(f"CP {k}: {n:,}" for k, n in d["cp_sizes"].items())
    print(
        f"  dynamic CP (up to cp={c['cp']}, {c['train_mb_tokens']} tokens per rank): sequences per size {used}; "
        f"{d['micro_batches_per_rank_per_step']:.1f} micro-batches per rank per step; predicted static / dynamic "
        f"step time {d['static_over_dynamic']:.3f}"
    )
    if not d["exchange_priced"]:
        print("    (this cost model counts FLOPs, which do not change with the CP size, and prices no key/value "
              "exchange: dynamic CP's gain is the exchange it avoids; benchmarks/dynamic_cp.py prices NVLink and "
              "InfiniBand)")  # fmt: skip


def _count_rule(c: dict) -> str:
    """The multiple every step's micro-batch count is planned to, in words."""
    if c.get("vpp", 1) > 1:
        return f"dp={c['dp']} x the interleaved group {c['microbatch_group']}"
    return f"dp={c['dp']}"


def _print_step_time_and_fill(s: dict, c: dict) -> None:
    """The predicted step time against its bound, the fill histogram and the half-empty rows."""
    interleaved = " (interleaved, vpp=" + str(c["vpp"]) + ")" if c.get("vpp", 1) > 1 else ""
    bound = "total cost / DP" + (f" and the 1F1B pipeline bound{interleaved}" if c["pp"] > 1 else "")
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
            f"equal counts per rank (packing alone needs fewer rows than a multiple of {_count_rule(c)}), "
            f"{s['below_half_full'] - forced} otherwise"
        )


if __name__ == "__main__":
    raise SystemExit(main())
