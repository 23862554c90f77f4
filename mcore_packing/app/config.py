"""The trainer's structured configuration: one dataclass per Hydra group, each validated when it is built.

Groups (YAML in ``hydra_configs/<group>/``): model, optimizer, data, sequence_packing, dynamic_batching,
parallel, context_parallel, training, logging, cluster, grpo, loss_fn, dpo, rm. Keys of ``sequence_packing``,
``dynamic_batching``, ``grpo``, ``loss_fn`` and ``dpo`` are NeMo-RL's; those groups are the lower layers'
own torch-free dataclasses (`planning.sections`, `rl.config`, `losses.ClippedPGConfig`), and ``model`` is
generated from `planning.ModelShape`, so each key is declared once. The same dataclasses are registered in
Hydra's ConfigStore (schemas); the YAML files hold the defaults list and only what differs.

Each group checks its own keys in ``__post_init__`` (`ConfigError` naming ``group.key`` and the fix).
What spans groups or needs the world size, and the one translation to the planner's `StepPlanConfig`, are
`app.run_settings` (`validate_layout`, `plan_config`); Hydra's side (the ConfigStore, the overrides' keys,
DictConfig -> `TrainConfig`) is `app.hydra_schema`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from ..data.sft import LONG_SAMPLE_POLICIES, SFT_SOURCES, WITHOUT_TARGETS
from ..losses import ClippedPGConfig
from ..planning import BALANCES, ModelShape, ParallelLayout, fp8_row_alignment
from ..planning.hf_config import read_hf_config, shape_from_hf_config
from ..planning.model_shape import MOE_TRAINING_FIELDS
from ..planning.sections import DynamicBatchingConfig, SequencePackingConfig
from ..rl.config import DPOConfig, GRPOConfig, RMConfig
from ..validators import InvalidValue, require_choice, require_positive_int
from .algorithms.registry import ALGORITHMS
from .run_names import default_run_dir
from .stop_request import DEFAULT_STOP_SIGNALS, check_stop_signals

LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root")  # Megatron's OptimizerParamScheduler
OPTIMIZERS = ("adam", "sgd")
RESUME_CHOICES = (False, True, "auto")

__all__ = [
    "ClusterConfig",
    "ConfigError",
    "ContextParallelConfig",
    "DPOConfig",
    "DataConfig",
    "DynamicBatchingConfig",
    "GRPOConfig",
    "LoggingConfig",
    "ModelConfig",
    "OptimizerConfig",
    "ParallelConfig",
    "RMConfig",
    "SequencePackingConfig",
    "TrainConfig",
    "TrainingConfig",
]


class ConfigError(InvalidValue):
    """A configuration mistake; the message names the key and the fix. The commands turn it (and only it)
    into exit code 2; any other exception is a crash and keeps its traceback."""


def _positive(group: str, obj, *names: str, allow_none: bool = False) -> None:
    for name in names:
        require_positive_int(f"{group}.{name}", getattr(obj, name), allow_none=allow_none, error=ConfigError)


def _choice(group: str, obj, name: str, choices) -> None:
    require_choice(f"{group}.{name}", getattr(obj, name), choices, error=ConfigError)


MODEL_DEFAULTS = {"vocab_size": None, "num_query_groups": 2}
"""Where the ``model`` group's defaults differ from `ModelShape`'s: the vocabulary comes from the data
(None: the data's compact vocabulary), and the tiny default model uses grouped-query attention."""


def _model_post_init(self):
    _choice("model", self, "dtype", ("float32", "bfloat16", "float16"))
    _choice("model", self, "attention_backend", ("auto", "te", "local"))
    try:
        fp8_row_alignment(self.fp8_recipe)
    except ValueError as exc:
        raise ConfigError(f"model.{exc}", key="model.fp8_recipe") from None
    _positive("model", self, "logprob_chunk_size", allow_none=True)  # tokens per chunk, or null: whole
    if self.recompute_granularity is not None:
        _choice("model", self, "recompute_granularity", ("selective", "full"))
    self.declared_shape(vocab_size=1)  # the shape's own checks, named model.<key>


def _declared_shape(self, vocab_size: int) -> ModelShape:
    """The shape these fields describe (``vocab_size`` unless the config sets one)."""
    fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(ModelShape) if f.name != "vocab_size"}
    try:
        return ModelShape(vocab_size=self.vocab_size or vocab_size, **fields)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def _shape(self, vocab_size: int) -> ModelShape:
    """The model's `ModelShape`: the checkpoint's config.json with ``hf_path``, else these fields."""
    if self.hf_path is None:
        return self.declared_shape(vocab_size)
    try:
        shape = shape_from_hf_config(read_hf_config(self.hf_path))
    except (ValueError, FileNotFoundError) as exc:
        raise ConfigError(f"model.hf_path: {exc}") from None
    # how to train it (the balance loss) is the run's, not the checkpoint's
    return dataclasses.replace(shape, **{k: getattr(self, k) for k in MOE_TRAINING_FIELDS}) if shape.is_moe else shape


def _model_config_class() -> type:
    """``ModelConfig``: ``hf_path``, every `ModelShape` field (its defaults, except `MODEL_DEFAULTS`), and
    how to run the model (``dtype``, ``attention_backend``, ``logprob_chunk_size``, ...). Generated from
    `ModelShape`'s fields, so a new shape field (MoE experts, ...) is a Hydra key without a second declaration."""
    shape_fields = []
    for f in dataclasses.fields(ModelShape):
        kind = "int | None" if f.name == "vocab_size" else f.type
        shape_fields.append((f.name, kind, field(default=MODEL_DEFAULTS.get(f.name, f.default))))
    cls = dataclasses.make_dataclass(
        "ModelConfig",
        [
            # a Hugging Face model folder: its config.json, weights and tokenizer win over the shape keys
            ("hf_path", "str | None", field(default=None)),
            *shape_fields,
            ("dtype", "str", field(default="float32")),  # float32 | bfloat16 | float16 (16-bit: fp32 masters)
            ("attention_backend", "str", field(default="auto")),  # auto | te | local
            # Megatron's fp8_recipe (tensorwise | delayed | mxfp8 | blockwise) or null: the row alignment the
            # planner pads each row's tail to (planning.FP8_ROW_ALIGNMENT); training with it is refused for now
            ("fp8_recipe", "str | None", field(default=None)),
            # tokens per chunk of the output layer and the loss in every pass (no whole fp32 [T, V/TP] logits;
            # NeMo-RL's logprob_chunk_size); null: the logits whole
            ("logprob_chunk_size", "int | None", field(default=None)),
            # Megatron's recompute_granularity: null | selective (the core attention) | full (every layer)
            ("recompute_granularity", "str | None", field(default=None)),
        ],
        namespace={
            "__post_init__": _model_post_init,
            "declared_shape": _declared_shape,
            "shape": _shape,
            "__doc__": "The ``model`` group: ``hf_path``, the `ModelShape` fields (see its docstring), ``dtype``, "
            "``attention_backend``, ``fp8_recipe``, ``logprob_chunk_size`` and ``recompute_granularity``.",
        },
    )
    cls.__module__ = __name__  # its annotations are strings, resolved in this module (Hydra reads them)
    return cls


ModelConfig = _model_config_class()


@dataclass
class DataConfig:
    # champ: the bundled demo, 512 CHAMP conversations evenly spaced over its 19,440 | champ_full: all | jsonl
    source: str = "champ"
    path: str | None = None  # JSONL file for source=jsonl
    text_field: str = "text"  # JSONL field holding the text
    encoding: str = "qwen3"  # quicktok bundled vocabulary
    vocab_size: int = 4096  # compact vocabulary: most frequent tokens + <unk>
    num_samples: int | None = None  # N evenly spaced samples of the source; null (the default): every one
    long_samples: str | None = None  # drop | truncate | split | error; null: drop conversations, split text
    max_sample_tokens: int = 2048
    learn_prompt: bool = False  # also learn the system and user turns
    samples_without_targets: str = "error"  # a sample with no learned token: error (naming file:line) | drop
    prepared: str | None = None  # a store written by `python -m mcore_packing prepare`: no tokenizing at start

    def __post_init__(self):
        _choice("data", self, "source", SFT_SOURCES)
        _choice("data", self, "long_samples", (None, *LONG_SAMPLE_POLICIES))
        _choice("data", self, "samples_without_targets", WITHOUT_TARGETS)
        _positive("data", self, "vocab_size", "max_sample_tokens")
        _positive("data", self, "num_samples", allow_none=True)
        if self.source == "jsonl" and not self.path:
            raise ConfigError("data.source=jsonl needs data.path=/path/to/file.jsonl (one JSON object per line).")


@dataclass
class ParallelConfig:
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1  # expert parallelism (Mixture-of-Experts): experts split over ep of the DP x CP ranks
    etp: int | None = None  # expert tensor parallelism: null is tp; 1 keeps experts whole (GPT-OSS at tp > 1)
    vpp: int = 1  # virtual pipeline: model chunks per stage (Megatron's interleaved 1F1B); needs pp > 1
    # Megatron's key (null: pp): micro-batches per chunk in turn; each rank's count is planned a multiple of it
    microbatch_group_size_per_vp_stage: int | None = None
    sequence_parallel: bool = False
    variable_seq_lengths: bool = False
    make_sequence_length_divisible_by: int | None = None  # NeMo-RL's key; must suit CP/TP

    def __post_init__(self):
        _positive("parallel", self, "tp", "pp", "cp", "ep", "vpp")
        _positive("parallel", self, "make_sequence_length_divisible_by", "microbatch_group_size_per_vp_stage",
                  allow_none=True)  # fmt: skip
        unit = self.layout()  # the layout's own checks (sequence parallelism needs TP)
        cp_multiple = unit.sequence_multiple
        divisible_by = self.make_sequence_length_divisible_by
        if divisible_by is not None and divisible_by % cp_multiple:
            raise ConfigError(
                f"parallel.make_sequence_length_divisible_by={divisible_by} is incompatible with parallel.cp="
                f"{self.cp}: every sequence is cut into 2*cp={cp_multiple} chunks. Use a multiple of {cp_multiple} "
                f"(or leave it unset: the minimal multiple is derived automatically)."
            )

    def layout(self, world_size: int | None = None) -> ParallelLayout:
        """The `ParallelLayout` of these keys on ``world_size`` ranks (DP is what remains; None: one
        replica, whose check leaves out ep: it spans replicas). Errors name the keys."""
        try:
            return ParallelLayout.for_world(
                self.tp * self.pp * self.cp if world_size is None else world_size, tp=self.tp, pp=self.pp,
                cp=self.cp, sequence_parallel=self.sequence_parallel, ep=1 if world_size is None else self.ep,
                vpp=self.vpp, microbatch_group_size_per_vp_stage=self.microbatch_group_size_per_vp_stage,
                etp=self.etp, keys="parallel.tp x parallel.pp x parallel.cp",
            )  # fmt: skip
        except ValueError as exc:
            message = str(exc).replace("sequence_parallel=true needs tp", "parallel.sequence_parallel=true needs "
                                       "parallel.tp")  # fmt: skip
            message = message.replace(f"ep={self.ep} must", f"parallel.ep={self.ep} must")
            for key in ("vpp", "microbatch_group_size_per_vp_stage", "etp"):
                message = message.replace(f"{key}=", f"parallel.{key}=", 1)
            raise ConfigError(message) from None


@dataclass
class ContextParallelConfig:
    """Dynamic context parallelism (`planning.dynamic_cp`): with ``dynamic=true`` every sequence runs on
    the smallest power-of-two CP size (up to ``parallel.cp``) whose row of that many ranks holds it, so
    short sequences run data-parallel and only long ones pay CP's key/value exchange. Needs sequence
    packing (THD rows) or dynamic batching (BSHD rows), a power-of-two ``parallel.cp >= 2`` and
    ``parallel.pp=1``."""

    dynamic: bool = False
    # tokens one rank holds of a row (Megatron's max_seqlen_per_dp_cp_rank); null: the enabled section's
    # budgets (train_mb_tokens, and logprob_mb_tokens for log-prob passes); set: both passes
    max_tokens_per_rank: int | None = None

    def __post_init__(self):
        _positive("context_parallel", self, "max_tokens_per_rank", allow_none=True)
        if self.max_tokens_per_rank is not None and not self.dynamic:
            raise ConfigError(
                f"context_parallel.max_tokens_per_rank={self.max_tokens_per_rank} applies to dynamic CP; set "
                "context_parallel.dynamic=true, or (static CP) set sequence_packing.train_mb_tokens instead.",
                key="context_parallel.max_tokens_per_rank",
            )


def _number(group: str, obj, name: str, *, low: float, high: float | None = None, open_low: bool = False) -> None:
    value = getattr(obj, name)
    bad = not isinstance(value, (int, float)) or isinstance(value, bool) or value != value
    bad = bad or value < low or (open_low and value == low) or (high is not None and value >= high)
    if bad:
        bound = f"> {low}" if open_low else f">= {low}"
        bound += f" and < {high}" if high is not None else ""
        raise ConfigError(f"{group}.{name}={value!r} must be a number {bound}.")


@dataclass
class OptimizerConfig:
    """Megatron-Core's optimizer and LR schedule (``get_megatron_optimizer``, ``OptimizerParamScheduler``);
    the key names are NeMo-RL's ``megatron_cfg.optimizer`` and ``megatron_cfg.scheduler`` ones."""

    optimizer: str = "adam"  # adam (decoupled weight decay, as AdamW) | sgd
    lr: float = 3e-3  # peak learning rate
    min_lr: float = 0.0  # where the decay ends
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    sgd_momentum: float = 0.9
    clip_grad: float = 1.0  # clip the global gradient norm to this (0: off)
    use_distributed_optimizer: bool = False  # shard optimizer state and fp32 master weights over DP ranks
    grad_reduce_in_fp32: bool = True  # 16-bit models: accumulate and all-reduce gradients in fp32
    lr_decay_style: str = "cosine"  # constant | linear | cosine | inverse-square-root
    lr_warmup_iters: int = 2  # steps of linear warmup from lr_warmup_init to lr
    lr_warmup_init: float = 0.0
    lr_decay_iters: int | None = None  # the optimizer step where the decay reaches min_lr; null: the run's last
    # resume: the checkpoint's LR schedule must equal this run's; true rebuilds it for this run (Megatron's key),
    # continuing at the checkpoint's step (an extended run decays over its new length instead of sitting at min_lr)
    override_opt_param_scheduler: bool = False
    initial_loss_scale: float = 4294967296.0  # fp16 only: dynamic loss scaling
    min_loss_scale: float = 1.0
    loss_scale_window: int = 1000
    hysteresis: int = 2

    def __post_init__(self):
        _choice("optimizer", self, "optimizer", OPTIMIZERS)
        _choice("optimizer", self, "lr_decay_style", LR_DECAY_STYLES)
        for name in ("lr", "min_lr", "weight_decay", "clip_grad", "lr_warmup_init", "sgd_momentum"):
            _number("optimizer", self, name, low=0.0)
        for name in ("adam_beta1", "adam_beta2"):
            _number("optimizer", self, name, low=0.0, high=1.0)
        _number("optimizer", self, "adam_eps", low=0.0, open_low=True)
        _number("optimizer", self, "initial_loss_scale", low=1.0)
        _number("optimizer", self, "min_loss_scale", low=0.0, open_low=True)
        _positive("optimizer", self, "loss_scale_window", "hysteresis")
        _positive("optimizer", self, "lr_decay_iters", allow_none=True)
        if not isinstance(self.lr_warmup_iters, int) or self.lr_warmup_iters < 0:
            raise ConfigError(f"optimizer.lr_warmup_iters={self.lr_warmup_iters!r} must be an integer >= 0.")
        if self.min_lr > self.lr:
            raise ConfigError(f"optimizer.min_lr={self.min_lr} is above optimizer.lr={self.lr}; lower min_lr.")
        if self.lr_warmup_init > self.lr:
            raise ConfigError(
                f"optimizer.lr_warmup_init={self.lr_warmup_init} is above optimizer.lr={self.lr}; warmup rises to lr."
            )

    def decay_iters(self, steps: int) -> int:
        """The step where the decay ends: ``lr_decay_iters``, else the run's length (at least one step
        past the warmup, so a run shorter than the warmup still has a schedule)."""
        if self.lr_decay_iters is None:
            return max(steps, self.lr_warmup_iters + 1)
        if self.lr_decay_style != "constant" and self.lr_decay_iters <= self.lr_warmup_iters:
            raise ConfigError(
                f"optimizer.lr_decay_iters={self.lr_decay_iters} must exceed optimizer.lr_warmup_iters="
                f"{self.lr_warmup_iters}: the decay starts after the warmup."
            )
        return max(self.lr_decay_iters, self.lr_warmup_iters + 1)

    def schedule(self, steps: int) -> dict:
        """This run's LR schedule as Megatron's scheduler records it (``OptimizerParamScheduler.state_dict``
        keys), for ``steps`` optimizer steps."""
        return {"max_lr": self.lr, "min_lr": self.min_lr, "lr_warmup_steps": self.lr_warmup_iters,
                "lr_decay_steps": self.decay_iters(steps), "lr_decay_style": self.lr_decay_style,
                "start_wd": self.weight_decay}  # fmt: skip


@dataclass
class TrainingConfig:
    global_batch_size: int = 32
    steps: int = 20
    seed: int = 1234
    loss_normalization: str = "token_mean"  # token_mean | sequence_mean
    padded_micro_batch_rows: int = 4  # rows per micro-batch when neither packing nor dynamic batching is on
    balance: str = "cost"  # cost (attention-aware) | tokens | round_robin: micro-batches to DP ranks
    save_interval: int = 0  # steps between checkpoints (0: only at the end)
    keep_last: int | None = 3  # complete checkpoints to keep (older ones are deleted); null: keep all
    checkpoint_dir: str | None = None  # default: <run_dir>/checkpoints
    export_dir: str | None = None  # after the last step, write a Hugging Face folder here (needs model.family)
    # signals that save a checkpoint after the current step and exit 0 (a second one exits at once); []: none
    stop_signals: list[str] = field(default_factory=lambda: list(DEFAULT_STOP_SIGNALS))

    def __post_init__(self):
        _positive("training", self, "global_batch_size", "steps", "padded_micro_batch_rows")
        try:
            check_stop_signals(self.stop_signals)
        except ValueError as exc:
            raise ConfigError(f"training.{exc}", key="training.stop_signals") from None
        _positive("training", self, "keep_last", allow_none=True)
        _choice("training", self, "loss_normalization", ("token_mean", "sequence_mean"))
        _choice("training", self, "balance", BALANCES)


@dataclass
class LoggingConfig:
    log_interval: int = 1
    progress_bar: bool = True
    tensorboard: bool = False
    metrics_file: str = "metrics.jsonl"

    def __post_init__(self):
        _positive("logging", self, "log_interval")


@dataclass
class ClusterConfig:
    backend: str = "auto"  # auto | gloo | nccl
    num_nodes: int = 1
    gpus_per_node: int = 1

    def __post_init__(self):
        _choice("cluster", self, "backend", ("auto", "gloo", "nccl"))
        _positive("cluster", self, "num_nodes", "gpus_per_node")


@dataclass
class TrainConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    sequence_packing: SequencePackingConfig = field(default_factory=SequencePackingConfig)
    dynamic_batching: DynamicBatchingConfig = field(default_factory=DynamicBatchingConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    context_parallel: ContextParallelConfig = field(default_factory=ContextParallelConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    loss_fn: ClippedPGConfig = field(default_factory=ClippedPGConfig)
    dpo: DPOConfig = field(default_factory=DPOConfig)
    rm: RMConfig = field(default_factory=RMConfig)
    # sft (NLL on data.*) | grpo (clipped PG on grpo.rollouts) | dpo (on dpo.pairs) | rm (reward model on rm.pairs)
    algorithm: str = "sft"
    run_name: str = "sft-tiny"
    # null: outputs/<run_name>/<job<SLURM_JOB_ID> or launcher start time> (app.run_names; the same on every rank)
    run_dir: str | None = None
    resume: Any = False  # false | true (the newest complete checkpoint; error if none) | auto (that, or start)
    overwrite: bool = False  # a fresh run into another run's run_dir moves that run aside (never deletes it)

    @property
    def optimizer_steps(self) -> int:
        """Optimizer (and LR schedule) steps of the run: ``training.steps`` times the algorithm's optimizer
        steps per step (GRPO: ``grpo.num_minibatches``)."""
        from .algorithms.registry import get_algorithm

        return self.training.steps * get_algorithm(self.algorithm).optimizer_steps(self)

    def __post_init__(self):
        require_choice("resume", self.resume, RESUME_CHOICES, error=ConfigError)
        require_choice("overwrite", self.overwrite, (False, True), error=ConfigError)
        if self.run_dir is None:
            try:
                self.run_dir = default_run_dir(self.run_name, self.resume)
            except ValueError as exc:
                raise ConfigError(str(exc), key="run_dir") from None
        require_choice("algorithm", self.algorithm, ALGORITHMS, error=ConfigError)


GROUPS = {
    "model": ModelConfig,
    "optimizer": OptimizerConfig,
    "data": DataConfig,
    "sequence_packing": SequencePackingConfig,
    "dynamic_batching": DynamicBatchingConfig,
    "parallel": ParallelConfig,
    "context_parallel": ContextParallelConfig,
    "training": TrainingConfig,
    "logging": LoggingConfig,
    "cluster": ClusterConfig,
    "grpo": GRPOConfig,
    "loss_fn": ClippedPGConfig,
    "dpo": DPOConfig,
    "rm": RMConfig,
}
