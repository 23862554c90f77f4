"""The policy-gradient loss (PPO/GRPO, GSPO, CISPO) per sample, for the step-loss protocol.

Per response token t of sample i, with the old policy's log-prob ``old``, the log-prob now ``lp`` (at the
sampling temperature, `megatron.logits_temperature`), the advantage A, and ``m`` the response mask:

    vanilla  r = exp(lp - old);  pg = max(-A r, -A clamp(r, 1 - ratio_clip_min, 1 + ratio_clip_max))
             pg = min(pg, -A ratio_clip_c)  where A < 0, with ratio_clip_c set (dual clip)
    gspo     r = exp(sum_t m (lp - old) / sum_t m) for every token of the response (the geometric mean of
             the token ratios, differentiable through each lp); pg as vanilla
    cispo    pg = -A sg(clamp(r, 1 - ratio_clip_min, 1 + ratio_clip_max)) exp(lp - sg(lp))
             (value -A clamp(r); gradient -A clamp(r) grad lp: no token is cut off by the clip)
    kl       k3: exp(ref - lp) - (ref - lp) - 1,  k1: lp - ref               (reference_policy_kl_penalty > 0)
    loss_t   = w_t (pg + reference_policy_kl_penalty kl) - entropy_coeff H_t
             w_t: the importance weight of the training/inference mismatch (`pg_config.IS_TYPES`, from
             rho = exp(old - generation log-prob); no gradient), 1 without the correction
             H_t: the policy's exact entropy at the token's position (`megatron.entropy`, chunked), when
             entropy_coeff > 0 or calculate_entropy

Aggregation (`pg_config.LOSS_AGG_MODES`) is one sum over the global batch divided by one global count
(`step_loss`): the sample's token sum (token-mean, seq-mean-token-sum), its token mean
(seq-mean-token-mean) or its token sum over the constant (seq-mean-token-sum-norm), divided by the
global response tokens or responses (`megatron.PerSample`); prompt-mean sums a prompt's responses over
their tokens (`megatron.PerGroup`, the group in one micro-batch) and divides by the global prompt count.
No divisor comes from a micro-batch, a padded width or a rank, so packing, dynamic batching and every
layout give the same loss.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from .pg_config import ClippedPGConfig
from .recording import MetricSums, recording

__all__ = ["METRIC_KEYS", "ClippedPGLoss"]

# Per-step sums over the response tokens: clipped (ratio outside the clip range), approx_kl (k3 of old vs
# new), ratio (new / old), reference_kl (with the KL penalty), gen_ratio (rho = old / generation
# probability: the training/inference mismatch, 1 where no generation log-probs were given), is_truncated
# and is_zeroed (tokens whose importance weight the correction truncated or set to 0), entropy (the exact
# token entropy, when computed).
METRIC_KEYS = ("tokens", "clipped", "approx_kl", "ratio", "reference_kl", "gen_ratio", "is_truncated", "is_zeroed",
               "entropy")


class ClippedPGLoss(MetricSums):
    """The per-sample policy-gradient loss of `ClippedPGConfig`, for the step-loss protocol:
    ``loss(sample_id, logprobs, mask) -> scalar`` (`megatron.PerSample` with ``config.normalization``,
    the per-sample aggregation of the module docstring) and ``loss.group_loss(members) -> scalar``
    (`megatron.PerGroup`, prompt-mean); `megatron.policy_step_loss` picks the one the config asks for.

    Per sample ``i`` of the global batch: ``advantages[i]`` (a scalar, GRPO, or one value per next-token
    position), ``old_logprobs[i]`` (the policy's log-probs before this step, one per next-token position
    as `compute_logprobs` returns them), ``reference_logprobs[i]`` (needed with a KL penalty) and
    ``generation_logprobs[i]`` (the inference engine's, needed with the importance sampling correction;
    reported as ``gen_ratio`` whenever given). ``mask`` selects the response tokens. `metrics` sums
    `METRIC_KEYS` over the tokens this rank computed the loss of (the step driver records on one rank of
    each CP group, `recording`; the caller sums over ranks and divides by ``tokens``). The sums stay on
    the device during the step.

    ``device``: the step's device. The side inputs are moved there once, here (a call then indexes
    device rows: no host copy inside the loss); without it each call copies its sample's rows.
    """

    METRIC_KEYS = METRIC_KEYS

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

    @property
    def normalization(self) -> str:
        """The global count the step divides by: ``token_mean``, ``sequence_mean`` or ``group_mean``."""
        return self.config.normalization

    @property
    def needs_entropy(self) -> bool:
        """Whether the step must hand each call the sample's per-token entropy (``entropy=``)."""
        return self.config.needs_entropy

    @property
    def entropy_chunk_tokens(self) -> int:
        return self.config.entropy_chunk_size

    def __call__(self, sample_id: int, logprobs: torch.Tensor, mask: torch.Tensor,
                 entropy: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        """One sample's share before the global count: its token sum, token mean (seq-mean-token-mean) or
        token sum over ``loss_agg_norm_constant`` (seq-mean-token-sum-norm). ``entropy``: the policy's
        per-token entropy (needed when `needs_entropy`)."""
        weights = mask.float()
        total = self.token_sum(sample_id, logprobs, weights, entropy)
        aggregation = self.config.aggregation
        if aggregation == "seq-mean-token-mean":
            return total / weights.sum().clamp_min(1)
        if aggregation == "seq-mean-token-sum-norm":
            return total / self.config.loss_agg_norm_constant
        return total

    def group_loss(self, members) -> torch.Tensor:
        """prompt-mean: the token mean over every response of one prompt (``members``: `PerGroup`'s
        ``[(sample_id, logprobs, mask), ...]``)."""
        total = count = None
        for sample_id, logprobs, mask, *entropy in members:
            weights = mask.float()
            part = self.token_sum(sample_id, logprobs, weights, entropy[0] if entropy else None)
            total = part if total is None else total + part
            count = weights.sum() if count is None else count + weights.sum()
        return total / count.clamp_min(1)

    def token_sum(self, sample_id: int, logprobs: torch.Tensor, weights: torch.Tensor,
                  entropy: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        """The sample's loss summed over its response tokens (``weights``: the float mask); records the
        sample's metrics."""
        if self.needs_entropy and entropy is None:
            raise ValueError("entropy_coeff > 0 or calculate_entropy needs each sample's entropy: build the step "
                             "loss with megatron.policy_step_loss (it asks the step for the entropies).")
        per_token, log_ratio, kl, is_stats = self.per_token(sample_id, logprobs, weights)
        if entropy is not None and self.config.entropy_coeff > 0:
            per_token = per_token - self.config.entropy_coeff * entropy.float()
        self._record(log_ratio.detach(), None if kl is None else kl.detach(), weights, is_stats,
                     None if entropy is None else entropy.detach())  # fmt: skip
        return (per_token * weights).sum()

    def _row(self, rows, sample_id: int, like: torch.Tensor) -> torch.Tensor:
        return _on(rows[sample_id], like).reshape(-1)[: like.numel()]

    def per_token(self, sample_id: int, logprobs: torch.Tensor, weights: torch.Tensor):
        """The loss of every next-token position of one sample (before masking), the log of the ratio to
        the old policy there (GSPO: the response's), the KL estimate to the reference (None without a KL
        penalty), and the importance-weight statistics (None without generation log-probs)."""
        cfg = self.config
        lp = logprobs.float()
        old = self._row(self.old, sample_id, lp)
        advantage = _on(self.advantages[sample_id], lp)
        advantage = advantage.reshape(-1)[: lp.numel()] if advantage.dim() else advantage
        log_ratio = lp - old
        if cfg.objective == "gspo":  # the geometric mean of the response's token ratios, on every token
            log_ratio = ((log_ratio * weights).sum() / weights.sum().clamp_min(1)).expand_as(lp)
        ratio = torch.exp(log_ratio)
        clipped = torch.clamp(ratio, 1 - cfg.ratio_clip_min, 1 + cfg.ratio_clip_max)
        if cfg.objective == "cispo":
            loss = -advantage * clipped.detach() * torch.exp(lp - lp.detach())
        else:
            loss = torch.maximum(-advantage * ratio, -advantage * clipped)
            if cfg.ratio_clip_c is not None:
                loss = torch.where(advantage < 0, torch.minimum(loss, -advantage * cfg.ratio_clip_c), loss)
        kl = None
        if cfg.reference_policy_kl_penalty > 0:
            log_ref = self._row(self.reference, sample_id, lp) - lp
            kl = torch.exp(log_ref) - log_ref - 1 if cfg.kl_estimator == "k3" else -log_ref
            loss = loss + cfg.reference_policy_kl_penalty * kl
        is_stats = None
        if self.generation is not None:
            log_rho = old - self._row(self.generation, sample_id, lp)
            weight, truncated, zeroed = self._importance_weights(log_rho, weights)
            is_stats = (torch.exp(log_rho), truncated, zeroed)
            if cfg.use_importance_sampling_correction:
                loss = loss * weight
        return loss, log_ratio, kl, is_stats

    def _importance_weights(self, log_rho: torch.Tensor, weights: torch.Tensor):
        """The importance weight of every token (no gradient: old and generation log-probs are data), and
        which tokens the truncation capped or the mask set to 0 (bool tensors)."""
        cfg = self.config
        kind, high, low = (cfg.truncated_importance_sampling_type, cfg.truncated_importance_sampling_ratio,
                           cfg.truncated_importance_sampling_ratio_min)  # fmt: skip
        rho = torch.exp(log_rho)
        none = torch.zeros_like(rho, dtype=torch.bool)
        if kind == "tis":
            if high is None:
                return rho, none, none
            return torch.clamp(rho, max=high), rho > high, none
        if kind == "icepop":
            keep = (rho >= low) & (rho <= high)
            return torch.where(keep, rho, torch.zeros_like(rho)), none, ~keep
        log_sequence = (log_rho * weights).sum()
        if kind == "seq-tis":  # the product of the response's ratios, capped in log space (no overflow)
            capped = torch.clamp(log_sequence, max=math.log(high))
            return torch.exp(capped).expand_as(rho), (log_sequence > math.log(high)).expand_as(rho), none
        mean = torch.exp(log_sequence / weights.sum().clamp_min(1))  # seq-mask-tis: the geometric mean
        keep = ((mean >= low) & (mean <= high)).expand_as(rho)
        return torch.where(keep, torch.clamp(rho, max=high), torch.zeros_like(rho)), keep & (rho > high), ~keep

    def _record(self, log_ratio: torch.Tensor, kl: torch.Tensor | None, weights: torch.Tensor, is_stats,
                entropy: torch.Tensor | None) -> None:  # fmt: skip
        """Adds this sample's sums on the device (no host copy: the step reads `metrics` once at its end)."""
        if not recording():  # another rank of this micro-batch's CP group records it
            return
        ratio = torch.exp(log_ratio)
        outside = (ratio < 1 - self.config.ratio_clip_min) | (ratio > 1 + self.config.ratio_clip_max)
        zero = weights.new_zeros(())
        rho, truncated, zeroed = is_stats if is_stats is not None else (None, None, None)
        self._add([
            weights.sum(),
            (outside.float() * weights).sum(),
            ((torch.exp(-log_ratio) + log_ratio - 1) * weights).sum(),
            (ratio * weights).sum(),
            (kl * weights).sum() if kl is not None else zero,
            (rho * weights).sum() if rho is not None else weights.sum(),
            (truncated.float() * weights).sum() if truncated is not None else zero,
            (zeroed.float() * weights).sum() if zeroed is not None else zero,
            (entropy.float() * weights).sum() if entropy is not None else zero,
        ])  # fmt: skip


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
