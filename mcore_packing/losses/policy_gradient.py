"""The clipped policy-gradient loss (PPO, GRPO) per sample, for `megatron.PerSample`.

Per response token t of sample i, with ratio r = exp(logp - old_logp) and advantage A:

    pg   = max(-A r, -A clamp(r, 1 - ratio_clip_min, 1 + ratio_clip_max))
    pg   = min(pg, -A ratio_clip_c)                         where A < 0, when ratio_clip_c is set (dual clip)
    kl   = k3: exp(ref - logp) - (ref - logp) - 1,  k1: logp - ref        (reference_policy_kl_penalty > 0)
    loss = w (pg + reference_policy_kl_penalty kl),  w = exp(old_logp - gen_logp) with the importance
           sampling correction on (the rollout engine's log-probs differ from the trainer's), else 1

``token_level_loss=True`` averages over every response token of the global batch (the sample returns its
token sum; `PerSample` divides by the global token count), ``False`` averages per sequence first, then over
sequences (the sample returns its token mean; `PerSample` divides by the global sequence count).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .pg_config import ClippedPGConfig
from .recording import recording

__all__ = ["ClippedPGLoss"]

KL = torch.Tensor | None  # the per-token KL estimate to the reference, when the KL penalty is on


class ClippedPGLoss:
    """``loss(sample_id, logprobs, mask) -> scalar`` for `PerSample(loss,
    normalization=config.normalization)`.

    Per sample ``i`` of the global batch: ``advantages[i]`` (a scalar, GRPO, or one value per next-token
    position), ``old_logprobs[i]`` (the policy's log-probs before this step, one per next-token position
    as `compute_logprobs` returns them), ``reference_logprobs[i]`` (needed with a KL penalty) and
    ``generation_logprobs[i]`` (needed with the importance sampling correction). ``mask`` selects the
    response tokens. `metrics` sums the clipped tokens, approximate KL (k3 of old vs new), ratio and the
    KL estimate to the reference (with a KL penalty) over the tokens this rank computed the loss of
    (the step driver records on one rank of each CP group, `recording`; the caller sums over ranks and
    divides by ``tokens``).
    """

    def __init__(
        self,
        config: ClippedPGConfig,
        *,
        advantages: Sequence,
        old_logprobs: Sequence,
        reference_logprobs: Sequence | None = None,
        generation_logprobs: Sequence | None = None,
    ):
        if config.reference_policy_kl_penalty > 0 and reference_logprobs is None:
            raise ValueError("reference_policy_kl_penalty > 0 needs reference_logprobs (one row per sample).")
        if config.use_importance_sampling_correction and generation_logprobs is None:
            raise ValueError("use_importance_sampling_correction needs generation_logprobs (one row per sample).")
        self.config = config
        self.advantages = advantages
        self.old = old_logprobs
        self.reference = reference_logprobs
        self.generation = generation_logprobs
        self.metrics = {"tokens": 0.0, "clipped": 0.0, "approx_kl": 0.0, "ratio": 0.0, "reference_kl": 0.0}

    def _row(self, rows: Sequence, sample_id: int, like: torch.Tensor) -> torch.Tensor:
        row = torch.as_tensor(rows[sample_id], dtype=torch.float32, device=like.device).reshape(-1)
        return row[: like.numel()]

    def per_token(self, sample_id: int, logprobs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, KL]:
        """The loss of every next-token position of one sample (before masking), the log of the ratio to
        the old policy there, and the KL estimate to the reference (None without a KL penalty)."""
        cfg = self.config
        lp = logprobs.float()
        old = self._row(self.old, sample_id, lp)
        advantage = torch.as_tensor(self.advantages[sample_id], dtype=torch.float32, device=lp.device)
        advantage = advantage.reshape(-1)[: lp.numel()] if advantage.dim() else advantage
        log_ratio_old = lp - old
        ratio = torch.exp(log_ratio_old)
        clipped = torch.clamp(ratio, 1 - cfg.ratio_clip_min, 1 + cfg.ratio_clip_max)
        loss = torch.maximum(-advantage * ratio, -advantage * clipped)
        if cfg.ratio_clip_c is not None:
            loss = torch.where(advantage < 0, torch.minimum(loss, -advantage * cfg.ratio_clip_c), loss)
        kl = None
        if cfg.reference_policy_kl_penalty > 0:
            log_ratio = self._row(self.reference, sample_id, lp) - lp
            kl = torch.exp(log_ratio) - log_ratio - 1 if cfg.kl_estimator == "k3" else -log_ratio
            loss = loss + cfg.reference_policy_kl_penalty * kl
        if cfg.use_importance_sampling_correction:
            loss = loss * torch.exp(old - self._row(self.generation, sample_id, lp))
        return loss, log_ratio_old, kl

    def __call__(self, sample_id: int, logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        weights = mask.float()
        per_token, log_ratio, kl = self.per_token(sample_id, logprobs)
        loss = (per_token * weights).sum()
        self._record(log_ratio.detach(), None if kl is None else kl.detach(), weights)
        return loss if self.config.token_level_loss else loss / weights.sum().clamp_min(1)

    def _record(self, log_ratio: torch.Tensor, kl: torch.Tensor | None, weights: torch.Tensor) -> None:
        if not recording():  # another rank of this micro-batch's CP group records it
            return
        ratio = torch.exp(log_ratio)
        outside = (ratio < 1 - self.config.ratio_clip_min) | (ratio > 1 + self.config.ratio_clip_max)
        self.metrics["tokens"] += float(weights.sum())
        self.metrics["clipped"] += float((outside.float() * weights).sum())
        self.metrics["approx_kl"] += float(((torch.exp(-log_ratio) + log_ratio - 1) * weights).sum())
        self.metrics["ratio"] += float((ratio * weights).sum())
        if kl is not None:
            self.metrics["reference_kl"] += float((kl * weights).sum())
