"""Compute cost of sequences: a linear part per token and a quadratic part per sequence (attention).

For a GPT with ``L`` layers, width ``h``, ``n_q`` query heads of size ``d`` (``h / n_q`` unless the
shape sets ``head_dim``), ``n_kv`` key/value heads, MLP width ``f`` (``gated``: three matrices, else two)
and vocabulary ``V``, one sequence of ``s`` tokens costs, in forward FLOPs (a multiply-add is 2 FLOPs):

    linear(s)    = s * [ 2 * L * (h*(n_q + 2*n_kv)*d + n_q*d*h) + 2 * sum_layers(mlp) + 2*h*V ]
    mlp          = m*h*f (dense, m = 3 if gated else 2), or in a Mixture-of-Experts layer the work of the
                   experts a token is routed to: k*3*h*f_e + h*E (router) [+ 3*h*f_s + h (shared expert, gate)]
    attention(s) = 2 * L * n_q*d * s^2      (QK^T and AV: 2 * 2 * s^2 * n_q*d per layer, halved by the causal mask)

A layer with a sliding window of ``W`` tokens (Mistral's every layer, GPT-OSS's every other one) lets a
query see at most ``W`` keys, so its attention grows linearly past ``W``: ``s^2`` becomes
``2*W*s - W^2`` for ``s > W`` (the same area, counted the same way: sum_i min(i + 1, W), doubled). The
model keeps that as the share of ``b`` that belongs to windowed layers (``windowed_share``) and ``window``.

Training (forward + backward) is 3x forward. So ``cost(s) = a*s + b*s^2`` with ``a = 3*linear/s`` and
``b = 3*2*L*n_q*d``. With top-k routing the linear part counts k experts, not E: dropless routing sends
every token to exactly k of them, so the work per token is the same for any batch (how evenly the
experts are loaded is a separate matter, reported by the trainer). Under context parallelism each CP
rank does ``1/cp`` of both parts (the load-balanced split makes attention work equal), so the per-rank
cost is ``cost(s) / cp``.

Context parallelism also moves data: each CP rank receives the keys and values of the other ranks'
tokens (``(k - 1) / k`` of the row at CP ``k``, forward and twice in the backward) in ``k - 1``
exchange steps per layer. `CostModel.cp_exchange` prices both, per micro-batch on one rank, from
``cp_exchange_per_token`` and ``cp_exchange_per_step`` (0 in the FLOP model: a pure FLOP count sees no
difference between CP sizes; `with_cp_exchange` derives them from the shape and an interconnect's FLOPs
per byte and latency in FLOPs, for planning dynamic CP against static CP).

`CostModel.calibrate` fits ``a``, ``b`` and a per-micro-batch constant to measured step times instead
(non-negative least squares on the tokens, the sum of squared lengths and the micro-batch count of each
measured step), for hardware where FLOPs are not time.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from .model_shape import ModelShape

__all__ = ["CostModel"]


@dataclass(frozen=True)
class CostModel:
    """``cost(s) = linear * s + quadratic * s^2`` per sequence (FLOPs, or seconds when calibrated), plus
    ``per_microbatch`` for every micro-batch (kernel launches, the schedule's per-micro-batch work) and
    ``per_sequence`` for every sequence on every CP rank (per-sequence kernels, e.g. attention run one
    sequence at a time); both 0 in the FLOP model and fitted by `calibrate`, so fewer, fuller
    micro-batches and fewer, longer sequences are priced honestly."""

    linear: float
    quadratic: float
    unit: str = "FLOP"
    per_microbatch: float = 0.0
    per_sequence: float = 0.0
    cp_exchange_per_token: float = 0.0
    cp_exchange_per_step: float = 0.0
    window: int | None = None
    windowed_share: float = 0.0

    @classmethod
    def from_shape(cls, shape: ModelShape, *, training: bool = True) -> CostModel:
        """The FLOP model of the module docstring for a model shape."""
        h, q = shape.hidden_size, shape.num_attention_heads * shape.head_size
        attention = h * (shape.num_attention_heads + 2 * shape.kv_heads) * shape.head_size + q * h
        mlp = sum(_mlp_flop_params(shape, moe) for moe in shape.moe_layers())
        linear = 2.0 * (shape.num_layers * attention + mlp) + 2.0 * h * shape.vocab_size
        quadratic = 2.0 * shape.num_layers * q
        factor = 3.0 if training else 1.0
        windowed = sum(shape.window_per_layer()) / shape.num_layers
        return cls(linear=factor * linear, quadratic=quadratic * factor, window=shape.window_size if windowed else None,
                   windowed_share=windowed)  # fmt: skip

    def attention_area(self, lengths) -> np.ndarray:
        """Each sequence's attention in units of ``quadratic``: ``s^2``, and on the windowed layers' share
        ``2*W*s - W^2`` past the window."""
        s = np.asarray(lengths, dtype=np.float64)
        if self.window is None or not self.windowed_share:
            return s * s
        w = float(self.window)
        windowed = np.where(s <= w, s * s, 2.0 * w * s - w * w)
        return (1.0 - self.windowed_share) * s * s + self.windowed_share * windowed

    def sequence_cost(self, lengths, cp_size: int = 1) -> np.ndarray:
        """Cost of each sequence on one CP rank."""
        s = np.asarray(lengths, dtype=np.float64)
        return (self.linear * s + self.quadratic * self.attention_area(s)) / cp_size + self.per_sequence

    def cp_exchange(self, row_tokens, cp_size: int):
        """Per-rank cost of a micro-batch's CP exchange: the ``(k - 1) / k`` of its row's tokens whose keys
        and values each rank receives, and ``k - 1`` exchange steps; 0 at ``cp_size = 1``. ``row_tokens``
        may be an array (one row each)."""
        tokens = np.asarray(row_tokens, dtype=np.float64)
        if cp_size <= 1:
            return tokens * 0.0
        share = (cp_size - 1) / cp_size * tokens
        return share * self.cp_exchange_per_token + (cp_size - 1) * self.cp_exchange_per_step

    def with_cp_exchange(self, shape: ModelShape, *, flops_per_byte: float, step_latency_flops: float,
                         bytes_per_element: int = 2) -> CostModel:  # fmt: skip
        """This model plus the CP exchange of ``shape``: per layer a token's keys and values
        (``2 * kv_heads * head_size`` elements) move once forward and twice backward (the gradients of
        keys and values come back), each byte worth ``flops_per_byte`` (peak FLOP/s over link bytes/s);
        each of the three passes per layer pays ``step_latency_flops`` per exchange step (the link's
        latency in FLOPs)."""
        kv_bytes = 2 * shape.kv_heads * shape.head_size * bytes_per_element
        per_token = 3.0 * shape.num_layers * kv_bytes * flops_per_byte
        return replace(self, cp_exchange_per_token=per_token,
                       cp_exchange_per_step=3.0 * shape.num_layers * step_latency_flops)  # fmt: skip

    def attention_share(self, lengths) -> float:
        """Fraction of the total cost that is attention's quadratic part."""
        s = np.asarray(lengths, dtype=np.float64)
        quad = self.quadratic * float(self.attention_area(s).sum())
        return quad / (self.linear * float(s.sum()) + quad) if s.size else 0.0

    @classmethod
    def calibrate(
        cls, steps: list[list[int]], seconds: list[float], microbatches: list[int] | None = None, *,
        window: int | None = None, windowed_share: float = 0.0,
    ) -> CostModel:  # fmt: skip
        """Fit ``seconds ~ a * sum(s) + b * sum(s^2) + d * sequences [+ c * micro-batches]`` over measured
        steps (each a list of lengths, and with ``microbatches`` how many micro-batches ran them); with a
        ``window`` on ``windowed_share`` of the layers (`from_shape`'s), ``s^2`` is `attention_area`'s.

        Non-negative least squares, exact for these few coefficients: every subset of the columns is
        fitted and the best fit with no negative coefficient wins (noisy or narrow measurements can ask
        for a negative term; a zero is the honest answer then).
        """
        if len(steps) != len(seconds) or len(steps) < 2:
            raise ValueError("calibrate needs at least two measured steps, each with its lengths and its time.")
        area = cls(linear=0.0, quadratic=1.0, window=window, windowed_share=windowed_share).attention_area
        columns = [[sum(s) for s in steps], [float(area(s).sum()) for s in steps], [len(s) for s in steps]]
        if microbatches is not None:
            if len(microbatches) != len(steps):
                raise ValueError("calibrate needs one micro-batch count per measured step.")
            columns.append(list(microbatches))
        coef = _nnls(np.array(columns, dtype=np.float64).T, np.asarray(seconds, dtype=np.float64))
        overhead = float(coef[3]) if microbatches is not None else 0.0
        return cls(
            linear=float(coef[0]),
            quadratic=float(coef[1]),
            unit="s",
            per_microbatch=overhead,
            per_sequence=float(coef[2]),
            window=window,
            windowed_share=windowed_share,
        )


def _mlp_flop_params(shape: ModelShape, moe: bool) -> int:
    """Multiply-adds per token of one layer's MLP: dense, or the routed top-k experts, router and shared expert."""
    h = shape.hidden_size
    if not moe:
        return (3 if shape.gated_mlp else 2) * h * shape.ffn_size
    work = shape.moe_router_topk * 3 * h * shape.expert_size + h * shape.num_experts
    if shape.moe_shared_expert_size:
        work += 3 * h * shape.moe_shared_expert_size + (h if shape.moe_shared_expert_gate else 0)
    return work


def _nnls(design: np.ndarray, target: np.ndarray) -> np.ndarray:
    """Non-negative least squares by trying every subset of columns (fine for 2-3 columns)."""
    n = design.shape[1]
    best, best_error = np.zeros(n), float((target**2).sum())
    for mask in range(1, 2**n):
        cols = [j for j in range(n) if mask >> j & 1]
        sub, *_ = np.linalg.lstsq(design[:, cols], target, rcond=None)
        if (sub < 0).any():
            continue
        coef = np.zeros(n)
        coef[cols] = sub
        error = float(((design @ coef - target) ** 2).sum())
        if error < best_error - 1e-15 * max(best_error, 1.0):
            best, best_error = coef, error
    return best
