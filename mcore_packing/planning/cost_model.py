"""Compute cost of sequences: a linear part per token and a quadratic part per sequence (attention).

For a GPT with ``L`` layers, width ``h``, ``n_q`` query heads of size ``d`` (``h / n_q`` unless the
shape sets ``head_dim``), ``n_kv`` key/value heads, MLP width ``f`` (``gated``: three matrices, else two)
and vocabulary ``V``, one sequence of ``s`` tokens costs, in forward FLOPs (a multiply-add is 2 FLOPs):

    linear(s)    = s * [ 2 * L * (h*(n_q + 2*n_kv)*d + n_q*d*h + m*h*f) + 2*h*V ]   m = 3 if gated else 2
    attention(s) = 2 * L * n_q*d * s^2      (QK^T and AV: 2 * 2 * s^2 * n_q*d per layer, halved by the causal mask)

Training (forward + backward) is 3x forward. So ``cost(s) = a*s + b*s^2`` with ``a = 3*linear/s`` and
``b = 3*2*L*h``. Under context parallelism each CP rank does ``1/cp`` of both parts (the load-balanced
split makes attention work equal), so the per-rank cost is ``cost(s) / cp``.

`CostModel.calibrate` fits ``a`` and ``b`` to measured step times instead (non-negative least squares on
the tokens and the sum of squared lengths of each measured step), for hardware where FLOPs are not time.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .model_shape import ModelShape

__all__ = ["CostModel"]


@dataclass(frozen=True)
class CostModel:
    """``cost(s) = linear * s + quadratic * s^2`` per sequence (FLOPs, or seconds when calibrated)."""

    linear: float
    quadratic: float
    unit: str = "FLOP"

    @classmethod
    def from_shape(cls, shape: ModelShape, *, training: bool = True) -> CostModel:
        """The FLOP model of the module docstring for a model shape."""
        per_layer = (
            shape.hidden_size
            * (shape.num_attention_heads + 2 * shape.kv_heads)
            * (shape.hidden_size // shape.num_attention_heads)
            + shape.hidden_size * shape.hidden_size
        )
        per_layer += (3 if shape.gated_mlp else 2) * shape.hidden_size * shape.ffn_size
        linear = 2.0 * shape.num_layers * per_layer + 2.0 * shape.hidden_size * shape.vocab_size
        quadratic = 2.0 * shape.num_layers * shape.hidden_size
        factor = 3.0 if training else 1.0
        return cls(linear=factor * linear, quadratic=quadratic * factor)

    def sequence_cost(self, lengths, cp_size: int = 1) -> np.ndarray:
        """Cost of each sequence on one CP rank."""
        s = np.asarray(lengths, dtype=np.float64)
        return (self.linear * s + self.quadratic * s * s) / cp_size

    def attention_share(self, lengths) -> float:
        """Fraction of the total cost that is attention's quadratic part."""
        s = np.asarray(lengths, dtype=np.float64)
        quad = self.quadratic * float((s * s).sum())
        return quad / (self.linear * float(s.sum()) + quad) if s.size else 0.0

    @classmethod
    def calibrate(cls, steps: list[list[int]], seconds: list[float]) -> CostModel:
        """Fit ``seconds ~ a * sum(s) + b * sum(s^2)`` over measured steps (each a list of lengths).

        Non-negative least squares: the unconstrained fit when both coefficients are >= 0, else the
        better of the two one-coefficient fits (noisy or narrow measurements can ask for a negative term).
        """
        if len(steps) != len(seconds) or len(steps) < 2:
            raise ValueError("calibrate needs at least two measured steps, each with its lengths and its time.")
        design = np.array([[sum(s), sum(x * x for x in s)] for s in steps], dtype=np.float64)
        target = np.asarray(seconds, dtype=np.float64)
        (a, b), *_ = np.linalg.lstsq(design, target, rcond=None)
        if a < 0 or b < 0:
            candidates = []
            for column in (0, 1):
                x = design[:, column]
                coef = max(float(x @ target) / float(x @ x), 0.0) if float(x @ x) > 0 else 0.0
                candidates.append((float(((x * coef - target) ** 2).sum()), column, coef))
            _, column, coef = min(candidates)
            a, b = (coef, 0.0) if column == 0 else (0.0, coef)
        return cls(linear=float(a), quadratic=float(b), unit="s")
