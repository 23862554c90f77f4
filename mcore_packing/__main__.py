"""``python -m mcore_packing <command>`` (or the ``mcore-packing`` script): the command-line entry point.

    python -m mcore_packing train [--recipe NAME] [--dry-run] [hydra overrides]   train (SFT; algorithm=dpo: DPO on
                                                                                   pairs; algorithm=grpo: GRPO on
                                                                                   rollouts) or check a config
    python -m mcore_packing plan  [--recipe NAME] [--lengths FILE | --corpus NAME] [hydra overrides]
                                                                                   plan the run's data, no torch
    python -m mcore_packing prepare --input DATA --out STORE --hf-path MODEL      tokenize once, in parallel
                                                                                   (JSONL, Parquet, datasets folder)
    python -m mcore_packing export --checkpoint DIR --out HF_FOLDER                a checkpoint for transformers
    python -m mcore_packing grpo [--steps N] [--plot PNG]                          GRPO on a bundled task (CPU)
    python -m mcore_packing launch [torchrun options] train ...                    torchrun whose stop exits 0

Each command's ``--help`` lists its options. Only the chosen command's module is imported, so ``plan``
starts without torch or megatron-core.
"""

from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "train": ("mcore_packing.app.train_command", "train (SFT, DPO on pairs, or GRPO on rollouts), or --dry-run a "
              "config or --recipe"),
    "plan": ("mcore_packing.app.plan_command", "plan the run train would run and report the savings"),
    "prepare": ("mcore_packing.app.prepare_command", "tokenize a data set (JSONL, Parquet, a datasets folder) once "
                "into a memory-mapped store"),
    "export": ("mcore_packing.app.export_command", "write a training checkpoint as a Hugging Face folder"),
    "grpo": ("mcore_packing.app.grpo_command", "GRPO on digit addition with a tiny model (CPU example)"),
    "launch": ("mcore_packing.app.launch_command", "torchrun [options] <command>: SIGUSR1 forwarded too, and exit 0 "
               "after a signal's checkpoint"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] not in COMMANDS:
        width = max(map(len, COMMANDS))
        usage = "\n".join(f"  {name:<{width}} {text}" for name, (_, text) in COMMANDS.items())
        stream = sys.stdout if argv[:1] in (["-h"], ["--help"]) else sys.stderr
        print(f"usage: python -m mcore_packing <command> [args]\n\ncommands:\n{usage}", file=stream)
        if argv[:1] in (["-h"], ["--help"]):
            return 0
        if argv:
            print(f"\nunknown command {argv[0]!r}; use one of: {', '.join(COMMANDS)}.", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[argv[0]][0])
    return module.main(argv[1:])


if __name__ == "__main__":
    raise SystemExit(main())
