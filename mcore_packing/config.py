"""Structured configuration for training: one dataclass per Hydra group, validated at start-up.

Groups (YAML in ``hydra_configs/<group>/``): model, data, sequence_packing, dynamic_batching, parallel,
training, logging, cluster. Keys of ``sequence_packing`` and ``dynamic_batching`` are NeMo-RL's.
The same dataclasses are registered in Hydra's ConfigStore (schemas); the defaults list lives in YAML.

Every error names the key and the fix. Hydra accepts ``+new.key=...`` on structured configs without a
word, so `check_unknown_keys` rejects keys that no dataclass declares.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "ClusterConfig",
    "ConfigError",
    "DataConfig",
    "DynamicBatchingConfig",
    "LoggingConfig",
    "ModelConfig",
    "ParallelConfig",
    "SequencePackingConfig",
    "TrainConfig",
    "TrainingConfig",
    "check_unknown_keys",
    "model_shape",
    "register_configs",
    "to_train_config",
    "validate_config",
]


class ConfigError(ValueError):
    """A configuration mistake; the message names the key and the fix."""


@dataclass
class ModelConfig:
    num_layers: int = 2
    hidden_size: int = 128
    num_attention_heads: int = 4
    num_query_groups: int | None = None
    ffn_hidden_size: int | None = None
    normalization: str = "LayerNorm"
    max_sequence_length: int = 4096
    dtype: str = "float32"  # float32 | bfloat16
    attention_backend: str = "auto"  # auto | te | local


@dataclass
class DataConfig:
    source: str = "champ"  # champ (bundled CHAMP conversations) | jsonl
    path: str | None = None  # JSONL file for source=jsonl
    text_field: str = "text"  # JSONL field holding the text
    encoding: str = "qwen3"  # quicktok bundled vocabulary
    vocab_size: int = 4096  # compact vocabulary: most frequent tokens + <unk>
    num_samples: int | None = 512  # use the first N samples (None: all)
    long_samples: str = "split"  # split | drop | error, for samples above max_sample_tokens
    max_sample_tokens: int = 2048
    learn_prompt: bool = False  # CHAMP: also learn System/User turns


@dataclass
class SequencePackingConfig:
    enabled: bool = True
    train_mb_tokens: int = 4096
    logprob_mb_tokens: int | None = None
    algorithm: str = "modified_first_fit_decreasing"
    refine: bool | None = None  # bin-count refinement after packing; null: the algorithm's default (on for MFFD)
    microbatch_order: str = "packer"  # packer | largest_first | bubble
    sequence_length_round: int = 1
    cost_budget: Any = None  # None | "auto" | a number: also cap each row's attention-aware cost


@dataclass
class DynamicBatchingConfig:
    enabled: bool = False
    train_mb_tokens: int = 4096
    logprob_mb_tokens: int | None = None
    sequence_length_round: int = 1


@dataclass
class ParallelConfig:
    tp: int = 1
    pp: int = 1
    cp: int = 1
    sequence_parallel: bool = False
    variable_seq_lengths: bool = False
    make_sequence_length_divisible_by: int | None = None  # NeMo-RL's key; must suit CP/TP


@dataclass
class TrainingConfig:
    global_batch_size: int = 32
    steps: int = 20
    lr: float = 3e-3
    weight_decay: float = 0.0
    seed: int = 1234
    loss_normalization: str = "token_mean"  # token_mean | sequence_mean
    padded_micro_batch_rows: int = 4  # rows per micro-batch when neither packing nor dynamic batching is on
    balance: str = "cost"  # cost (attention-aware) | tokens | round_robin: micro-batches to DP ranks
    save_interval: int = 0  # steps between checkpoints (0: only at the end)
    checkpoint_dir: str | None = None  # default: <run_dir>/checkpoints


@dataclass
class LoggingConfig:
    log_interval: int = 1
    progress_bar: bool = True
    tensorboard: bool = False
    metrics_file: str = "metrics.jsonl"


@dataclass
class ClusterConfig:
    backend: str = "auto"  # auto | gloo | nccl
    num_nodes: int = 1
    gpus_per_node: int = 1


@dataclass
class TrainConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    sequence_packing: SequencePackingConfig = field(default_factory=SequencePackingConfig)
    dynamic_batching: DynamicBatchingConfig = field(default_factory=DynamicBatchingConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    run_name: str = "sft"
    run_dir: str = "outputs/local/sft"
    resume: bool = False


GROUPS = {
    "model": ModelConfig,
    "data": DataConfig,
    "sequence_packing": SequencePackingConfig,
    "dynamic_batching": DynamicBatchingConfig,
    "parallel": ParallelConfig,
    "training": TrainingConfig,
    "logging": LoggingConfig,
    "cluster": ClusterConfig,
}


def model_shape(cfg: TrainConfig, vocab_size: int | None = None) -> dict:
    """The model dimensions `cost.CostModel.from_shape` takes, from a config (vocabulary from ``data``)."""
    m = cfg.model
    return dict(
        num_layers=m.num_layers,
        hidden_size=m.hidden_size,
        num_attention_heads=m.num_attention_heads,
        num_query_groups=m.num_query_groups,
        ffn_hidden_size=m.ffn_hidden_size,
        vocab_size=vocab_size or cfg.data.vocab_size,
    )


def register_configs() -> None:
    """Register the schemas in Hydra's ConfigStore (``<group>/schema`` and ``train_schema``)."""
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    cs.store(name="train_schema", node=TrainConfig)
    for group, cls in GROUPS.items():
        cs.store(group=group, name="schema", node=cls)


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
    """A `TrainConfig` from a DictConfig/dict (after `check_unknown_keys`)."""
    from omegaconf import DictConfig, OmegaConf

    mapping = OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else dict(cfg)
    mapping.pop("hydra", None)
    parts = {key: GROUPS[key](**mapping.pop(key)) for key in list(mapping) if key in GROUPS}
    return TrainConfig(**parts, **mapping)


def _positive(name: str, value, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}.")


def validate_config(cfg: TrainConfig, world_size: int = 1) -> None:
    """Start-up checks that need no data; `mcore_packing.train` adds the data-dependent budget check."""
    sp, db, par = cfg.sequence_packing, cfg.dynamic_batching, cfg.parallel
    if sp.enabled and db.enabled:
        raise ConfigError(
            "sequence_packing.enabled and dynamic_batching.enabled are both true. Packing concatenates whole "
            "sequences into THD rows (least padding); dynamic batching groups similar lengths into padded rows. "
            "Set one of them to false, e.g. sequence_packing.enabled=false dynamic_batching.enabled=true."
        )
    for name, value in [
        ("sequence_packing.train_mb_tokens", sp.train_mb_tokens),
        ("dynamic_batching.train_mb_tokens", db.train_mb_tokens),
        ("sequence_packing.sequence_length_round", sp.sequence_length_round),
        ("dynamic_batching.sequence_length_round", db.sequence_length_round),
        ("parallel.tp", par.tp),
        ("parallel.pp", par.pp),
        ("parallel.cp", par.cp),
        ("training.global_batch_size", cfg.training.global_batch_size),
        ("training.steps", cfg.training.steps),
        ("training.padded_micro_batch_rows", cfg.training.padded_micro_batch_rows),
        ("data.vocab_size", cfg.data.vocab_size),
        ("data.max_sample_tokens", cfg.data.max_sample_tokens),
        ("cluster.num_nodes", cfg.cluster.num_nodes),
        ("cluster.gpus_per_node", cfg.cluster.gpus_per_node),
    ]:
        _positive(name, value)
    _positive("sequence_packing.logprob_mb_tokens", sp.logprob_mb_tokens, allow_none=True)
    _positive("dynamic_batching.logprob_mb_tokens", db.logprob_mb_tokens, allow_none=True)
    _positive("data.num_samples", cfg.data.num_samples, allow_none=True)
    model_parallel = par.tp * par.pp * par.cp
    if world_size % model_parallel:
        raise ConfigError(
            f"World size {world_size} does not factor into parallel.tp x parallel.pp x parallel.cp x DP = "
            f"{par.tp} x {par.pp} x {par.cp} x DP. Launch a multiple of {model_parallel} ranks, or change tp/pp/cp."
        )
    if par.sequence_parallel and par.tp == 1:
        raise ConfigError("parallel.sequence_parallel=true needs parallel.tp > 1 (it splits tokens over TP ranks).")
    required = (2 * par.cp if par.cp > 1 else 1) * (par.tp if par.sequence_parallel else 1)
    divisible_by = par.make_sequence_length_divisible_by
    if divisible_by is not None:
        _positive("parallel.make_sequence_length_divisible_by", divisible_by)
        if divisible_by % (2 * par.cp if par.cp > 1 else 1):
            raise ConfigError(
                f"parallel.make_sequence_length_divisible_by={divisible_by} is incompatible with parallel.cp="
                f"{par.cp}: every sequence is cut into 2*cp={2 * par.cp} chunks. Use a multiple of {2 * par.cp} "
                f"(or leave it unset: the minimal multiple, {required}, is derived automatically)."
            )
    if par.pp > 1 and db.enabled and not par.variable_seq_lengths:
        raise ConfigError(
            "dynamic_batching with parallel.pp > 1 needs parallel.variable_seq_lengths=true: its micro-batches "
            "have different shapes."
        )
    if cfg.model.dtype not in ("float32", "bfloat16"):
        raise ConfigError(f"model.dtype must be 'float32' or 'bfloat16', got {cfg.model.dtype!r}.")
    if cfg.data.source not in ("champ", "jsonl"):
        raise ConfigError(f"data.source must be 'champ' or 'jsonl', got {cfg.data.source!r}.")
    if cfg.data.source == "jsonl" and not cfg.data.path:
        raise ConfigError("data.source=jsonl needs data.path=/path/to/file.jsonl (one JSON object per line).")
    if cfg.data.long_samples not in ("split", "drop", "error"):
        raise ConfigError(f"data.long_samples must be split, drop or error, got {cfg.data.long_samples!r}.")
    if cfg.training.balance not in ("cost", "tokens", "round_robin"):
        raise ConfigError(f"training.balance must be cost, tokens or round_robin, got {cfg.training.balance!r}.")
    if sp.microbatch_order not in ("packer", "largest_first", "bubble"):
        raise ConfigError(
            f"sequence_packing.microbatch_order must be packer, largest_first or bubble, got {sp.microbatch_order!r}."
        )
    if cfg.training.loss_normalization not in ("token_mean", "sequence_mean"):
        raise ConfigError(
            f"training.loss_normalization must be token_mean or sequence_mean, got {cfg.training.loss_normalization!r}."
        )
    if cfg.cluster.backend not in ("auto", "gloo", "nccl"):
        raise ConfigError(f"cluster.backend must be auto, gloo or nccl, got {cfg.cluster.backend!r}.")
