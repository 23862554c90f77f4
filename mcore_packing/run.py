"""``python -m mcore_packing.run --recipe NAME [--dry-run] key=value ...``: run or check a recipe.

Overrides use Hydra's override grammar (``parallel.tp=2``, ``~key``, ``+key=...`` is rejected when
nothing reads it). ``--dry-run`` validates the config for the recipe's world size and prints the plan
of the first global batch on the CPU: micro-batches per data-parallel rank, tokens per GPU, padding,
rank balance. Without ``--dry-run`` it trains in this process (a single rank, or each rank under
torchrun / the Slurm scripts).
"""

from __future__ import annotations

import argparse
import json
import sys

from .config import ConfigError, TrainConfig, check_unknown_keys, to_train_config, validate_config
from .recipes import RECIPES


def compose_recipe(name: str, overrides: list[str], *, num_nodes: int | None, gpus_per_node: int | None) -> TrainConfig:
    """The recipe's config with Hydra overrides applied (Hydra's compose API and grammar)."""
    from hydra import compose, initialize
    from hydra.core.config_store import ConfigStore
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf

    if name not in RECIPES:
        raise ConfigError(f"Unknown recipe {name!r}. Available: {', '.join(sorted(RECIPES))}.")
    kwargs = {k: v for k, v in {"num_nodes": num_nodes, "gpus_per_node": gpus_per_node}.items() if v is not None}
    base = RECIPES[name](**kwargs)
    ConfigStore.instance().store(name=f"recipe_{name}", node=OmegaConf.structured(base))
    GlobalHydra.instance().clear()
    with initialize(version_base="1.3", config_path=None):
        try:
            raw = compose(config_name=f"recipe_{name}", overrides=overrides)
        except Exception as exc:  # Hydra's own override errors (bad grammar, unknown key without '+')
            raise ConfigError(f"Cannot apply overrides {overrides}: {exc}") from None
    check_unknown_keys(raw)
    return to_train_config(raw)


def dry_run(cfg: TrainConfig) -> dict:
    """Validate for the recipe's world size and plan the first global batch; no GPU, no Megatron."""
    from dataclasses import asdict

    from .data.sft import load_sft_data
    from .planning import plan_step
    from .train import GlobalBatchSampler, _check_budget, _plan_config

    world = cfg.cluster.num_nodes * cfg.cluster.gpus_per_node
    validate_config(cfg, world)
    par = cfg.parallel
    dp = world // (par.tp * par.pp * par.cp)
    data = load_sft_data(**asdict(cfg.data))
    lengths = [len(s.tokens) for s in data.samples]
    plan_config = _plan_config(cfg, dp)
    _check_budget(plan_config, lengths, cfg)
    sampler = GlobalBatchSampler(len(lengths), cfg.training.global_batch_size, cfg.training.seed)
    batch = [lengths[i] for i in sampler.next_batch()]
    plan = plan_step(batch, plan_config)
    stats = plan.stats()
    per_gpu = max(mb.padded_tokens for rank in plan.micro_batches for mb in rank) // par.cp
    return {
        "world_size": world,
        "layout": {"tp": par.tp, "pp": par.pp, "cp": par.cp, "dp": dp, "sequence_parallel": par.sequence_parallel},
        "mode": plan_config.mode,
        "row_capacity_tokens": plan_config.row_capacity(),
        "max_tokens_per_gpu_per_microbatch": per_gpu,
        "data": data.info,
        "first_global_batch": {"samples": len(batch), "tokens": sum(batch), **stats},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m mcore_packing.run", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--recipe", required=True, help=f"one of: {', '.join(sorted(RECIPES))}")
    parser.add_argument("--num-nodes", type=int, default=None)
    parser.add_argument("--gpus-per-node", type=int, default=None)
    parser.add_argument("--dry-run", action="store_true", help="validate and print the plan; do not train")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. parallel.tp=2 training.steps=10")
    args = parser.parse_args(argv)
    try:
        cfg = compose_recipe(args.recipe, args.overrides, num_nodes=args.num_nodes, gpus_per_node=args.gpus_per_node)
        if args.dry_run:
            print(json.dumps(dry_run(cfg), indent=1))
            print(
                f"dry run OK: recipe {args.recipe} is valid for {cfg.cluster.num_nodes} node(s) x "
                f"{cfg.cluster.gpus_per_node} GPU(s)"
            )
            return 0
        from .train import train

        summary = train(cfg)
        if summary["losses"] and summary["rank"] == 0:
            print(f"final loss {summary['losses'][-1]:.4f}")
        return 0
    except (ConfigError, ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
