"""Hydra's side of the configuration: the schemas registered in its ConfigStore, the overrides' keys checked
before Hydra sees them, and the composed DictConfig turned into a validated `TrainConfig`.

Hydra accepts ``+new.key=...`` on structured configs without a word, so `check_unknown_keys` rejects keys
that no dataclass declares; `check_override_keys` names the closest valid key for a misspelled one.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ..validators import InvalidValue
from .config import GROUPS, ConfigError, TrainConfig

__all__ = ["check_override_keys", "check_unknown_keys", "register_configs", "to_train_config"]


def register_configs() -> None:
    """Register the schemas in Hydra's ConfigStore (``<group>/schema`` and ``train_schema``)."""
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    cs.store(name="train_schema", node=TrainConfig)
    for group, cls in GROUPS.items():
        cs.store(group=group, name="schema", node=cls)


def check_override_keys(overrides: list[str]) -> None:
    """Before Hydra sees them: every ``group.key=value`` override names a key of its group's dataclass (and
    every ``key=value`` a group or a top-level key), else a `ConfigError` with the closest valid name
    (Hydra's own message suggests the '+' prefix, which adds a key nothing reads)."""
    import difflib

    top = {f.name for f in dataclasses.fields(TrainConfig)} | {"hydra"}
    for override in overrides:
        key = override.split("=", 1)[0]
        if "=" not in override or key.startswith(("+", "~", "hydra.", "hydra/")):
            continue  # '+' keys: check_unknown_keys refuses them after composition
        group, _, name = key.partition(".")
        if group not in top:
            options, wrong = sorted(top - {"hydra"}), group
        elif name and group in GROUPS and name.split(".")[0] not in {f.name for f in dataclasses.fields(GROUPS[group])}:
            options, wrong = sorted(f"{group}.{f.name}" for f in dataclasses.fields(GROUPS[group])), key
        else:
            continue
        close = difflib.get_close_matches(wrong, options, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ConfigError(f"Unknown config key {key!r} in override {override!r}.{hint} Valid keys: {options}.", key=key)


def check_unknown_keys(cfg: Any, schema: type = TrainConfig, prefix: str = "") -> None:
    """Raise `ConfigError` for any key of ``cfg`` (a DictConfig or dict) that ``schema`` does not declare."""
    from omegaconf import DictConfig, OmegaConf

    mapping = OmegaConf.to_container(cfg, resolve=False) if isinstance(cfg, DictConfig) else cfg
    known = {f.name: f for f in dataclasses.fields(schema)}
    for key, value in mapping.items():
        if key == "hydra":
            continue
        name = f"{prefix}{key}"
        if key not in known:
            raise ConfigError(
                f"Unknown config key {name!r}. Valid keys here: {sorted(known)}. Check the spelling; Hydra's '+' "
                "prefix adds keys that nothing reads."
            )
        sub = GROUPS.get(key) if not prefix else None
        if sub is not None and isinstance(value, dict):
            check_unknown_keys(value, sub, f"{name}.")


def to_train_config(cfg: Any) -> TrainConfig:
    """A validated `TrainConfig` from a DictConfig/dict: unknown keys and bad values raise `ConfigError`."""
    from omegaconf import DictConfig, OmegaConf

    check_unknown_keys(cfg)
    mapping = OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else dict(cfg)
    mapping.pop("hydra", None)
    parts = {}
    for key in [k for k in mapping if k in GROUPS]:
        try:
            parts[key] = GROUPS[key](**mapping.pop(key))
        except ConfigError:
            raise
        except InvalidValue as exc:  # a group defined below app (loss_fn, grpo, ...) names its keys without it
            raise ConfigError(f"{key}.{exc}", key=f"{key}.{exc.key}") from None
    return TrainConfig(**parts, **mapping)
