"""``python -m mcore_packing train``: train (or check) a config: the Hydra defaults or a recipe.

    python -m mcore_packing train                                      # packed tiny GPT on CHAMP (CPU ok)
    python -m mcore_packing train sequence_packing.enabled=false dynamic_batching.enabled=true
    torchrun --nproc_per_node 2 -m mcore_packing train parallel.cp=2
    python -m mcore_packing launch --standalone --nproc-per-node 2 train parallel.cp=2   # torchrun, SIGTERM exits 0
    python -m mcore_packing train resume=true                          # continue at the next sample
    python -m mcore_packing train resume=true training.steps=40 optimizer.override_opt_param_scheduler=true
                                                                       # extend a run: the LR schedule over 40
    python -m mcore_packing train algorithm=grpo grpo.rollouts=rollouts.jsonl   # GRPO on your engine's rollouts
    python -m mcore_packing train algorithm=dpo dpo.pairs=pairs.jsonl           # DPO on preference pairs
    python -m mcore_packing train algorithm=rm rm.pairs=pairs.jsonl             # a Bradley-Terry reward model
    python -m mcore_packing train --recipe llama3_8b_sft_packed --num-nodes 2 --gpus-per-node 8 --dry-run

Arguments other than the flags below are Hydra overrides (``parallel.tp=2``, ``data=jsonl``; ``+key=..``
is rejected when nothing reads it). Without ``--recipe`` the config comes from ``hydra_configs/`` (package
data: ``mcore_packing.hydra_configs``, so an installed wheel has it), with ``--recipe`` from the recipe
function; both through Hydra's compose API with the same override grammar. ``--dry-run`` validates for the
config's cluster size and prints the plan of the first global batch without torch or a GPU.

The run folder (``run_dir``; unset: ``outputs/<run_name>/<stamp>``, ``latest`` pointing at the newest) is
written only after every check has passed: ``run.json`` (the run's identity), ``config.yaml`` (the
resolved config), ``train.log``, ``metrics.jsonl`` and ``checkpoints/``. A fresh run into another run's
folder is refused (``resume=true``, another ``run_dir``, or ``overwrite=true`` moves the old one aside).
SIGTERM, SIGINT and SIGUSR1 (``training.stop_signals``) save a checkpoint after the current step and exit 0;
a second one exits at once. Config and data errors exit with code 2 before the model is built.
"""

from __future__ import annotations

import argparse
import importlib.resources
import json
import logging
import os
import sys

from .config import ConfigError, TrainConfig
from .hydra_schema import check_override_keys, register_configs, to_train_config
from .recipes import RECIPES

__all__ = ["build_parser", "compose_config", "main"]

CONFIG_DIR = str(importlib.resources.files("mcore_packing.hydra_configs"))


def compose_config(
    recipe: str | None, overrides: list[str], *, num_nodes: int | None = None, gpus_per_node: int | None = None
) -> TrainConfig:
    """The recipe's config (or the ``hydra_configs`` defaults) with Hydra overrides applied."""
    from hydra import compose, initialize, initialize_config_dir
    from hydra.core.config_store import ConfigStore
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf

    check_override_keys(overrides)
    register_configs()
    GlobalHydra.instance().clear()
    if recipe is None:
        context, name = initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"), "config"
    else:
        if recipe not in RECIPES:
            raise ConfigError(f"Unknown recipe {recipe!r}. Available: {', '.join(sorted(RECIPES))}.")
        kwargs = {k: v for k, v in {"num_nodes": num_nodes, "gpus_per_node": gpus_per_node}.items() if v is not None}
        try:
            recipe_config = RECIPES[recipe](**kwargs)
        except ValueError as exc:  # the cluster cannot hold the recipe's layout
            raise ConfigError(str(exc)) from None
        ConfigStore.instance().store(name=f"recipe_{recipe}", node=OmegaConf.structured(recipe_config))
        context, name = initialize(version_base="1.3", config_path=None), f"recipe_{recipe}"
    with context:
        try:
            raw = compose(config_name=name, overrides=overrides)
        except Exception as exc:  # Hydra's own override errors (bad grammar, a value of the wrong type, ...)
            raise ConfigError(f"Cannot apply overrides {overrides}: {_hydra_reason(exc)}") from None
    return to_train_config(raw)


def _hydra_reason(exc: BaseException) -> str:
    """Hydra's error with its cause (the value and the type it needed), without its '+' hint."""
    lines = []
    while exc is not None and len(lines) < 2:
        text = str(exc).split("Config search path")[0] if "Available options" in str(exc) else str(exc)
        first = " ".join(text.split()) if "Available options" in text else (text.splitlines() or [""])[0]
        if first and "$VALUE" not in first:
            lines.append(first)
        exc = exc.__cause__
    return "; ".join(line for line in lines if not line.startswith("To append"))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m mcore_packing train", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--recipe", help=f"start from a recipe: {', '.join(sorted(RECIPES))}")
    parser.add_argument("--num-nodes", type=int, default=None, help="with --recipe: nodes the recipe plans for")
    parser.add_argument("--gpus-per-node", type=int, default=None, help="with --recipe: GPUs per node")
    parser.add_argument("--dry-run", action="store_true", help="validate and print the first step's plan; no training")
    return parser


def _parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    return build_parser().parse_known_args(argv)


def main(argv: list[str] | None = None) -> int:
    from .trainer import quiet_megatron_on_cpu

    args, overrides = _parse(sys.argv[1:] if argv is None else argv)
    quiet_megatron_on_cpu()
    return exit_2_on_config_error(lambda: (_check_flags(args), _run(args, overrides)))


def _check_flags(args: argparse.Namespace) -> None:
    if args.recipe is None and (args.num_nodes is not None or args.gpus_per_node is not None):
        raise ConfigError("--num-nodes and --gpus-per-node size a --recipe; without one set cluster.num_nodes=N "
                          "cluster.gpus_per_node=G.")  # fmt: skip


def exit_2_on_config_error(run) -> int:
    """The one place a command turns a `ConfigError` into its message on stderr and exit code 2 (printed
    by rank 0 only: under torchrun every rank finds the same mistake, and the others exit quietly); anything
    else raised by ``run`` is a crash and propagates with its traceback."""
    try:
        run()
    except ConfigError as exc:
        if os.environ.get("RANK", "0") == "0":
            print(f"config error: {exc}", file=sys.stderr)
        return 2
    return 0


def _run(args: argparse.Namespace, overrides: list[str]) -> None:
    from .trainer import dry_run, train

    cfg = compose_config(args.recipe, overrides, num_nodes=args.num_nodes, gpus_per_node=args.gpus_per_node)
    if args.dry_run:
        print(json.dumps(dry_run(cfg), indent=1))
        what = f"recipe {args.recipe}" if args.recipe else "the default config"
        what += f" with {' '.join(overrides)}" if overrides else ""
        nodes, gpus = cfg.cluster.num_nodes, cfg.cluster.gpus_per_node
        print(f"dry run OK: {what} is valid for {nodes} node(s) x {gpus} GPU(s)")
        return
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", stream=sys.stdout)
    _report(train(cfg))


def _report(summary: dict) -> None:
    if summary["losses"] and summary["rank"] == 0:
        print(f"final loss {summary['losses'][-1]:.4f} (first {summary['losses'][0]:.4f})", flush=True)
