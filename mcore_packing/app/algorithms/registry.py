"""The names of the training algorithms and the lookup of each one's module: apart from the algorithms'
shared helpers (the package's ``__init__``), so that `app.config` validates ``algorithm`` without an import
circle (the helpers raise `app.config.ConfigError`)."""

from __future__ import annotations

from importlib import import_module

__all__ = ["ALGORITHMS", "get_algorithm"]

ALGORITHMS = ("sft", "grpo", "dpo", "rm")


def get_algorithm(name: str):
    """The module of algorithm ``name`` (one of `ALGORITHMS`)."""
    if name not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {', '.join(ALGORITHMS)}; got {name!r}.")
    return import_module(f"mcore_packing.app.algorithms.{name}")
