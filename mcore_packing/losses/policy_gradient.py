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

__all__ = ["METRIC_KEYS", "ClippedPGLoss"]

METRIC_KEYS = ("tokens", "clipped", "approx_kl", "ratio", "reference_kl")

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
    divides by ``tokens``). The sums stay on the device during the step.

    ``device``: the step's device. The side inputs are moved there once, here (a call then indexes
    device rows: no host copy inside the loss); without it each call copies its sample's rows.
    """

    def __init__(
        self,
        config: ClippedPGConfig,
        *,
        advantages: Sequence,
        old_logprobs: Sequence,
        reference_logprobs: Sequence | None = None,
        generation_logprobs: Sequence | None = None,
        device: torch.device | str | None = None,
    ):
        if config.reference_policy_kl_penalty > 0 and reference_logprobs is None:
            raise ValueError("reference_policy_kl_penalty > 0 needs reference_logprobs (one row per sample).")
        if config.use_importance_sampling_correction and generation_logprobs is None:
            raise ValueError("use_importance_sampling_correction needs generation_logprobs (one row per sample).")
        self.config = config
        self.advantages = _on_device(advantages, device)
        self.old = _on_device(old_logprobs, device)
        self.reference = _on_device(reference_logprobs, device)
        self.generation = _on_device(generation_logprobs, device)
        self._sums: torch.Tensor | None = None  # METRIC_KEYS' sums, on the loss's device

    @property
    def metrics(self) -> dict:
        """The per-step sums of `METRIC_KEYS` (read to the host once: call it after the step)."""
        values = self._sums.tolist() if self._sums is not None else [0.0] * len(METRIC_KEYS)
        return dict(zip(METRIC_KEYS, values, strict=True))

    def _row(self, rows, sample_id: int, like: torch.Tensor) -> torch.Tensor:
        return _on(rows[sample_id], like).reshape(-1)[: like.numel()]

    def per_token(self, sample_id: int, logprobs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, KL]:
        """The loss of every next-token position of one sample (before masking), the log of the ratio to
        the old policy there, and the KL estimate to the reference (None without a KL penalty)."""
        cfg = self.config
        lp = logprobs.float()
        old = self._row(self.old, sample_id, lp)
        advantage = _on(self.advantages[sample_id], lp)
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
        """Adds this sample's sums on the device (no host copy: the step reads `metrics` once at its end)."""
        if not recording():  # another rank of this micro-batch's CP group records it
            return
        ratio = torch.exp(log_ratio)
        outside = (ratio < 1 - self.config.ratio_clip_min) | (ratio > 1 + self.config.ratio_clip_max)
        sums = torch.stack([
            weights.sum(),
            (outside.float() * weights).sum(),
            ((torch.exp(-log_ratio) + log_ratio - 1) * weights).sum(),
            (ratio * weights).sum(),
            (kl * weights).sum() if kl is not None else weights.new_zeros(()),
        ]).double()  # fmt: skip
        self._sums = sums if self._sums is None else self._sums + sums


def _on(value, like: torch.Tensor) -> torch.Tensor:
    """A sample's side input as float32 on ``like``'s device: a view when it was staged there (``device=``),
    else a copy (side inputs given without a device)."""
    if not isinstance(value, torch.Tensor) or value.device != like.device:
        return torch.as_tensor(value, dtype=torch.float32, device=like.device)
    return value.float()


def _on_device(rows, device):
    """Per-sample side inputs on ``device`` in one transfer: a tensor (or array) whose rows are the samples
    moves whole; a list of rows (scalars or 1-D sequences of any lengths) is concatenated, moved once
    and split back into views. ``device`` None or ``rows`` None: unchanged."""
    if rows is None or device is None:
        return rows
    device = torch.device(device)
    if isinstance(rows, torch.Tensor):
        return rows.to(device=device, dtype=torch.float32, non_blocking=True)
    host = [torch.as_tensor(r, dtype=torch.float32) for r in rows]
    if all(r.dim() == 0 for r in host):
        return torch.stack(host).to(device, non_blocking=True) if host else torch.zeros(0, device=device)
    flat = torch.cat([r.reshape(-1) for r in host]).to(device, non_blocking=True)
    return list(torch.split(flat, [r.numel() for r in host]))
