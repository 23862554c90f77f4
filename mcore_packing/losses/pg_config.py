"""`ClippedPGConfig`: the clipped policy-gradient loss's settings, without torch (a login node's dry run
reads them as the trainer's ``loss_fn`` config group)."""

from __future__ import annotations

from dataclasses import dataclass

from ..validators import InvalidValue, require_choice

__all__ = ["KL_ESTIMATORS", "ClippedPGConfig"]

KL_ESTIMATORS = ("k1", "k3")


@dataclass(kw_only=True)
class ClippedPGConfig:
    """NeMo-RL's ``loss_fn`` keys (ratio_clip_min/max are distances from 1). Also the ``loss_fn`` group of
    the trainer's Hydra config (`app.config`), so it is a plain (not frozen) dataclass."""

    ratio_clip_min: float = 0.2
    ratio_clip_max: float = 0.2
    ratio_clip_c: float | None = None  # dual clip (> 1), for negative advantages
    reference_policy_kl_penalty: float = 0.0
    kl_estimator: str = "k3"
    token_level_loss: bool = True
    use_importance_sampling_correction: bool = False

    def __post_init__(self):
        for name in ("ratio_clip_min", "ratio_clip_max", "reference_policy_kl_penalty"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or value < 0 or value != value:
                raise InvalidValue(f"{name}={value!r} must be a number >= 0.", key=name)
        if self.ratio_clip_c is not None and not self.ratio_clip_c > 1:
            message = f"ratio_clip_c={self.ratio_clip_c!r} must be > 1 (null/None: no dual clip)."
            raise InvalidValue(message, key="ratio_clip_c")
        require_choice("kl_estimator", self.kl_estimator, KL_ESTIMATORS)

    @property
    def normalization(self) -> str:
        """The `PerSample` normalization that makes the sample values below a global mean."""
        return "token_mean" if self.token_level_loss else "sequence_mean"
