"""The trainer's structured configuration: one dataclass per Hydra group, each validated when it is built.

Groups (YAML in ``hydra_configs/<group>/``): model, optimizer, data, sequence_packing, dynamic_batching,
parallel, context_parallel, training, logging, cluster, grpo, loss_fn, dpo, rm. Keys of ``sequence_packing``,
``dynamic_batching``, ``grpo``, ``loss_fn`` and ``dpo`` are NeMo-RL's; those groups are the lower layers'
own torch-free dataclasses (`planning.sections`, `rl.config`, `losses.ClippedPGConfig`), and ``model`` is
generated from `planning.ModelShape`, so each key is declared once. The same dataclasses are registered in
Hydra's ConfigStore (schemas); the YAML files hold the defaults list and only what differs.

Each group checks its own keys in ``__post_init__`` (`ConfigError` naming ``group.key`` and the fix);
`validate_layout` checks what spans groups or needs the world size; `plan_config` is the one
translation from this config to the planner's `StepPlanConfig` (through `StepPlanConfig.from_sections`,
the same path NeMo-RL configs take). Hydra accepts ``+new.key=...`` on structured configs without a
word, so `check_unknown_keys` rejects keys that no dataclass declares.
"""

from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass, field
from typing import Any

from ..data.sft import LONG_SAMPLE_POLICIES, SFT_SOURCES, WITHOUT_TARGETS
from ..losses import ClippedPGConfig
from ..planning import BALANCES, CostModel, ModelShape, ParallelLayout, StepPlanConfig, fp8_row_alignment
from ..planning.hf_config import read_hf_config, shape_from_hf_config
from ..planning.model_shape import MOE_TRAINING_FIELDS
from ..planning.sections import DynamicBatchingConfig, SequencePackingConfig
from ..rl.config import DPOConfig, GRPOConfig, RMConfig
from ..validators import InvalidValue, require_choice, require_positive_int
from .algorithms.registry import ALGORITHMS
from .memory_settings import memory_model
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
    "check_data_fits",
    "check_unknown_keys",
    "plan_config",
    "register_configs",
    "to_train_config",
    "validate_layout",
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


def validate_layout(cfg: TrainConfig, world_size: int) -> ParallelLayout:
    """Checks that span groups or need the world size (and the algorithm's config checks); returns the
    run's layout."""
    from .algorithms.registry import get_algorithm

    par = cfg.parallel
    layout = par.layout(world_size)
    get_algorithm(cfg.algorithm).check_config(cfg)
    if par.pp > 1 and cfg.dynamic_batching.enabled and not par.variable_seq_lengths:
        raise ConfigError(
            "dynamic_batching with parallel.pp > 1 needs parallel.variable_seq_lengths=true: its micro-batches "
            "have different shapes."
        )
    _check_dynamic_cp(cfg, layout)
    cfg.optimizer.decay_iters(cfg.optimizer_steps)  # the LR decay must end after the warmup
    return layout


def _check_dynamic_cp(cfg: TrainConfig, layout: ParallelLayout) -> None:
    """``context_parallel.dynamic``: packed or dynamic-batching rows, a power-of-two cp of at least 2, pp=1,
    no fixed shapes."""
    if not cfg.context_parallel.dynamic:
        return
    from ..planning.layout import check_dynamic_cp_layout

    key = "context_parallel.dynamic"
    if layout.cp == 1:
        raise ConfigError(f"{key}=true picks a CP size per sequence up to parallel.cp, which is 1; set parallel.cp "
                          "to 2 or more (a power of two).", key=key)  # fmt: skip
    try:
        check_dynamic_cp_layout(layout, key=key, cp_key="parallel.cp", pp_key="parallel.pp")
    except ValueError as exc:
        raise ConfigError(str(exc), key=key) from None
    if not (cfg.sequence_packing.enabled or cfg.dynamic_batching.enabled):
        raise ConfigError(
            f"{key}=true runs packed THD rows (sequence_packing.enabled=true) or dynamic batching's BSHD rows "
            "(dynamic_batching.enabled=true) on CP sub-groups; with neither, every micro-batch is padded to one "
            "shape. Enable one of them, or use static CP.", key=key,
        )  # fmt: skip
    for name in ("fixed_shape", "cost_budget"):
        if getattr(cfg.sequence_packing, name):
            raise ConfigError(
                f"sequence_packing.{name} does not apply with {key}=true (rows are sized per CP size and scheduled "
                f"by cost); unset sequence_packing.{name}, or use static CP.", key=f"sequence_packing.{name}",
            )  # fmt: skip


def check_shape_on_layout(shape: ModelShape, layout: ParallelLayout) -> None:
    """The model's heads split over TP, its experts over EP and its layers over PP x VPP (a `ConfigError`
    naming the parallel key)."""
    try:
        layout.check_heads(shape.num_attention_heads, shape.kv_heads)
    except ValueError as exc:
        raise ConfigError(str(exc), key="parallel.tp") from None
    try:
        layout.check_experts(shape.num_experts, biased=shape.is_moe and shape.linear_bias)
    except ValueError as exc:
        raise ConfigError(str(exc), key="parallel.ep") from None
    try:
        layout.check_layers(shape.num_layers)
    except ValueError as exc:
        raise ConfigError(str(exc).replace("pp x vpp", "parallel.pp x parallel.vpp"), key="parallel.vpp") from None


def plan_config(cfg: TrainConfig, layout: ParallelLayout, vocab_size: int | None = None) -> StepPlanConfig:
    """The step planner's config for this run on ``layout`` (the one config -> plan translation). Without
    packing or dynamic batching, ``padded`` mode sized to hold ``padded_micro_batch_rows`` of the longest
    samples."""
    par, training = cfg.parallel, cfg.training
    rows = training.padded_micro_batch_rows
    padded = {
        "train_mb_tokens": max(cfg.sequence_packing.train_mb_tokens, cfg.data.max_sample_tokens * rows),
        "padded_rows": rows,
    }
    shape = cfg.model.shape(vocab_size or cfg.data.vocab_size)
    packing, batching = asdict(cfg.sequence_packing), asdict(cfg.dynamic_batching)
    dynamic_cp = cfg.context_parallel.dynamic
    if dynamic_cp and cfg.context_parallel.max_tokens_per_rank is not None:  # both passes' budget per rank
        for section in (packing, batching):
            section.update(train_mb_tokens=cfg.context_parallel.max_tokens_per_rank,
                           logprob_mb_tokens=cfg.context_parallel.max_tokens_per_rank)  # fmt: skip
    try:
        return StepPlanConfig.from_sections(
            sequence_packing=packing,
            dynamic_batching=batching,
            padded=padded,
            sequence_length_divisible_by=par.make_sequence_length_divisible_by,
            balance=training.balance,
            cost_model=CostModel.from_shape(shape),
            layout=layout,
            fixed_length=False if par.variable_seq_lengths else None,
            fp8_alignment=fp8_row_alignment(cfg.model.fp8_recipe),
            dynamic_cp=dynamic_cp,
            memory_model=memory_model(cfg, shape, layout),
        )
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


_MODE_SECTIONS = {"packing": "sequence_packing", "dynamic": "dynamic_batching"}


def budget_key(plan: StepPlanConfig, *, forward_only: bool = False, cfg: TrainConfig | None = None) -> str | None:
    """The config key of the budget that applies (``sequence_packing.logprob_mb_tokens``, ...; with
    ``cfg``'s dynamic CP and its ``max_tokens_per_rank``, that key); None in padded mode, which has no
    section."""
    if cfg is not None and cfg.context_parallel.dynamic and cfg.context_parallel.max_tokens_per_rank is not None:
        return "context_parallel.max_tokens_per_rank"
    section = _MODE_SECTIONS.get(plan.mode)
    return f"{section}.{plan.budget(forward_only)[0]}" if section else None


def check_data_fits(cfg: TrainConfig, plan: StepPlanConfig, lengths) -> None:
    """The budget must hold the longest (padded) sample of the data set: say so before training starts."""
    key = budget_key(plan, cfg=cfg)
    # padded rows: SFT samples are cut to data.max_sample_tokens, rollouts not
    key, fix = (key, "lower data.max_sample_tokens") if key else ("data.max_sample_tokens", "drop them")
    try:
        plan.check_fits(lengths, key=key, fix=fix)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


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
