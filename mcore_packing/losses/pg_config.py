"""`ClippedPGConfig`: the policy-gradient loss's settings, without torch (a login node's dry run reads them
as the trainer's ``loss_fn`` config group).

Key names: NeMo-RL's where NeMo-RL has the option (ratio_clip_*, reference_policy_kl_penalty,
token_level_loss, use_importance_sampling_correction, truncated_importance_sampling_*,
sequence_level_importance_ratios); verl's where only verl has it (loss_agg_mode,
policy_loss_mode, entropy_coeff, calculate_entropy); ours otherwise (loss_agg_norm_constant, kl_estimator,
entropy_chunk_size). NeMo-RL's ``logprob_chunk_size`` is the model's (``model.logprob_chunk_size``: the
output layer, the loss and the entropy a chunk of tokens at a time).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..validators import InvalidValue, require_choice, require_positive_int

__all__ = ["IS_TYPES", "KL_ESTIMATORS", "LOSS_AGG_MODES", "POLICY_LOSS_MODES", "ClippedPGConfig"]

KL_ESTIMATORS = ("k1", "k3")
# How the per-token losses become one number (verl's agg_loss names; prompt-mean is SkyRL's):
#   token-mean               sum over every response token / G (response tokens of the global batch)
#   seq-mean-token-mean      each response's token mean, then the mean over the S responses
#   seq-mean-token-sum       each response's token sum, then the mean over the S responses
#   seq-mean-token-sum-norm  each response's token sum / loss_agg_norm_constant, mean over responses (Dr.GRPO)
#   prompt-mean              each prompt's token mean over all its responses, then the mean over prompts
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm", "prompt-mean")
POLICY_LOSS_MODES = ("vanilla", "gspo", "cispo")
# The training/inference mismatch correction w per token (with use_importance_sampling_correction),
# rho = exp(old_logprob - generation_logprob):
#   tis           min(rho, ratio)                                     (per token, truncated)
#   icepop        rho where ratio_min <= rho <= ratio, else 0           (per token, masked)
#   seq-tis       min(prod_t rho_t, ratio), one weight for the response (per sequence, truncated)
#   seq-mask-tis  min(rho, ratio) where the response's geometric-mean rho lies in [ratio_min, ratio],
#                 else 0 for the whole response                         (per sequence, masked)
IS_TYPES = ("tis", "icepop", "seq-tis", "seq-mask-tis")


def _number(name: str, value, *, above: float | None = None, at_least: float | None = None) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and (above is None or value > above) and (at_least is None or value >= at_least)
    if not ok:
        bound = f"> {above}" if above is not None else f">= {at_least}"
        raise InvalidValue(f"{name}={value!r} must be a finite number {bound}.", key=name)


@dataclass(kw_only=True)
class ClippedPGConfig:
    """The policy-gradient loss (PPO/GRPO, GSPO, CISPO) and how it is aggregated and corrected.

    Also the ``loss_fn`` group of the trainer's Hydra config (`app.config`), so it is a plain (not
    frozen) dataclass. ratio_clip_min/max are distances from 1 (clip-higher: ratio_clip_max larger)."""

    ratio_clip_min: float = 0.2
    ratio_clip_max: float = 0.2
    ratio_clip_c: float | None = None  # dual clip (> 1), for negative advantages
    reference_policy_kl_penalty: float = 0.0
    kl_estimator: str = "k3"
    token_level_loss: bool | None = None  # NeMo-RL: true = token-mean, false = seq-mean-token-mean
    loss_agg_mode: str | None = None  # verl: one of LOSS_AGG_MODES (null: from token_level_loss, else token-mean)
    loss_agg_norm_constant: float | None = None  # seq-mean-token-sum-norm's divisor (e.g. the max response length)
    policy_loss_mode: str = "vanilla"  # verl: vanilla (PPO clip), gspo (sequence ratio), cispo (clipped IS weight)
    sequence_level_importance_ratios: bool = False  # NeMo-RL's GSPO switch (= policy_loss_mode=gspo)
    use_importance_sampling_correction: bool = False
    truncated_importance_sampling_ratio: float | None = None  # upper bound (null: untruncated, type tis only)
    truncated_importance_sampling_ratio_min: float | None = None  # lower bound (icepop, seq-mask-tis)
    truncated_importance_sampling_type: str = "tis"
    entropy_coeff: float = 0.0  # verl: > 0 subtracts entropy_coeff x the policy's exact token entropy (a bonus)
    calculate_entropy: bool = False  # verl: report the exact entropy (on whenever entropy_coeff > 0)
    entropy_chunk_size: int = 1024  # tokens whose fp32 logits the entropy holds at once (of whole logits)

    def __post_init__(self):
        for name in ("ratio_clip_min", "ratio_clip_max", "reference_policy_kl_penalty"):
            _number(name, getattr(self, name), at_least=0)
        if self.ratio_clip_min + self.ratio_clip_max == 0:
            raise InvalidValue(
                "ratio_clip_min=0 and ratio_clip_max=0 clip the ratio to exactly 1 (low = high): every token's "
                "gradient is 0. Use a range, e.g. ratio_clip_min=0.2 ratio_clip_max=0.28.", key="ratio_clip_min")
        c = self.ratio_clip_c
        if c is not None and not (isinstance(c, (int, float)) and not isinstance(c, bool) and c > 1):
            message = f"ratio_clip_c={self.ratio_clip_c!r} must be > 1 (null/None: no dual clip)."
            raise InvalidValue(message, key="ratio_clip_c")
        require_choice("kl_estimator", self.kl_estimator, KL_ESTIMATORS)
        _number("entropy_coeff", self.entropy_coeff, at_least=0)
        require_positive_int("entropy_chunk_size", self.entropy_chunk_size)
        self._check_aggregation()
        self._check_policy_loss()
        self._check_importance_sampling()

    def _check_aggregation(self) -> None:
        if self.loss_agg_mode is not None:
            require_choice("loss_agg_mode", self.loss_agg_mode, LOSS_AGG_MODES)
            implied = {True: "token-mean", False: "seq-mean-token-mean"}.get(self.token_level_loss)
            if implied is not None and implied != self.loss_agg_mode:
                raise InvalidValue(
                    f"token_level_loss={self.token_level_loss} means loss_agg_mode={implied}, but loss_agg_mode="
                    f"{self.loss_agg_mode}: set one of the two (token_level_loss=null leaves it to loss_agg_mode).",
                    key="token_level_loss")  # fmt: skip
        needs_constant = self.aggregation == "seq-mean-token-sum-norm"
        if needs_constant and self.loss_agg_norm_constant is None:
            raise InvalidValue(
                "loss_agg_mode=seq-mean-token-sum-norm needs loss_agg_norm_constant: a constant divisor, e.g. the "
                "maximum response length (a divisor taken from the padded batch would change with packing).",
                key="loss_agg_norm_constant")  # fmt: skip
        if self.loss_agg_norm_constant is not None:
            if not needs_constant:
                raise InvalidValue(
                    f"loss_agg_norm_constant={self.loss_agg_norm_constant} is only read by loss_agg_mode="
                    f"seq-mean-token-sum-norm (now {self.aggregation}): set that mode or drop the constant.",
                    key="loss_agg_norm_constant")  # fmt: skip
            _number("loss_agg_norm_constant", self.loss_agg_norm_constant, above=0)

    def _check_policy_loss(self) -> None:
        require_choice("policy_loss_mode", self.policy_loss_mode, POLICY_LOSS_MODES)
        if self.sequence_level_importance_ratios and self.policy_loss_mode == "cispo":
            raise InvalidValue(
                "sequence_level_importance_ratios=true (GSPO) and policy_loss_mode=cispo are two objectives: "
                "choose one.", key="sequence_level_importance_ratios")  # fmt: skip
        if self.ratio_clip_c is not None and self.objective == "cispo":
            raise InvalidValue(
                f"ratio_clip_c={self.ratio_clip_c} (dual clip) belongs to the clipped PPO objective; "
                "policy_loss_mode=cispo clips the importance weight instead. Set ratio_clip_c=null.",
                key="ratio_clip_c")  # fmt: skip

    def _check_importance_sampling(self) -> None:
        require_choice("truncated_importance_sampling_type", self.truncated_importance_sampling_type, IS_TYPES)
        high, low = self.truncated_importance_sampling_ratio, self.truncated_importance_sampling_ratio_min
        kind = self.truncated_importance_sampling_type
        set_keys = [k for k, v in (("truncated_importance_sampling_ratio", high),
                                   ("truncated_importance_sampling_ratio_min", low)) if v is not None]  # fmt: skip
        if not self.use_importance_sampling_correction:
            if set_keys or kind != "tis":
                key = set_keys[0] if set_keys else "truncated_importance_sampling_type"
                raise InvalidValue(
                    f"{key} corrects the training/inference mismatch, which is off: set "
                    "use_importance_sampling_correction=true (rollouts then need generation_logprobs).", key=key)
            return
        if high is not None:
            _number("truncated_importance_sampling_ratio", high, above=0)
        if low is not None:
            _number("truncated_importance_sampling_ratio_min", low, at_least=0)
        if kind in ("icepop", "seq-mask-tis"):
            if high is None or low is None:
                raise InvalidValue(
                    f"truncated_importance_sampling_type={kind} keeps weights inside [ratio_min, ratio]: set both "
                    "truncated_importance_sampling_ratio_min and truncated_importance_sampling_ratio (e.g. 0.5 and "
                    "5.0).", key="truncated_importance_sampling_ratio" if high is None else
                    "truncated_importance_sampling_ratio_min")  # fmt: skip
            if not low < high:
                raise InvalidValue(
                    f"truncated_importance_sampling_ratio_min={low} must be below truncated_importance_sampling_ratio"
                    f"={high} (low < high).", key="truncated_importance_sampling_ratio_min")  # fmt: skip
        elif low is not None:
            raise InvalidValue(
                f"truncated_importance_sampling_ratio_min={low} is read by the icepop and seq-mask-tis types only "
                f"(now {kind}): drop it, or pick one of those.", key="truncated_importance_sampling_ratio_min")
        if kind == "seq-tis" and high is None:
            raise InvalidValue(
                "truncated_importance_sampling_type=seq-tis truncates the response's product of ratios: set "
                "truncated_importance_sampling_ratio (e.g. 2.0).", key="truncated_importance_sampling_ratio")

    @property
    def aggregation(self) -> str:
        """The loss aggregation mode in force (`LOSS_AGG_MODES`)."""
        if self.loss_agg_mode is not None:
            return self.loss_agg_mode
        return "seq-mean-token-mean" if self.token_level_loss is False else "token-mean"

    @property
    def objective(self) -> str:
        """The policy loss in force: vanilla, gspo or cispo."""
        return "gspo" if self.sequence_level_importance_ratios else self.policy_loss_mode

    @property
    def needs_entropy(self) -> bool:
        """Whether the step computes the exact token entropy (a bonus, or a metric)."""
        return self.entropy_coeff > 0 or bool(self.calculate_entropy)

    @property
    def normalization(self) -> str:
        """The global count the aggregated loss is divided by: ``token_mean`` (every response token),
        ``sequence_mean`` (responses) or ``group_mean`` (prompts)."""
        return {"token-mean": "token_mean", "prompt-mean": "group_mean"}.get(self.aggregation, "sequence_mean")
