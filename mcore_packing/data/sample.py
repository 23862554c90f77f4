"""The unit every layer above passes around: one training sequence and which of its tokens are learned.

Plain data with no torch import, so data loaders and planners can build samples without a GPU stack;
the THD layer (`mcore_packing.thd`) turns lists of them into packed micro-batches.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["SequenceSample"]


@dataclass(frozen=True)
class SequenceSample:
    """One training sequence: token ids, and optionally which tokens are targets (1) or not (0).

    ``tokens`` and ``loss_mask`` may be torch tensors, numpy arrays or lists. ``loss_mask[j]`` says
    whether token ``j`` is learned (e.g. 0 on the prompt, 1 on the response). Position ``j`` predicts
    token ``j + 1``, so the packed loss mask at ``j`` is ``loss_mask[j + 1]``.

    ``routed_experts`` (Mixture-of-Experts models, router replay): the experts an inference engine chose,
    an integer array ``[n or n - 1, moe_layers, top_k]`` (row ``j`` is token ``j``'s choice in each MoE
    layer; without the last token's row that token is routed afresh: it predicts nothing that is scored).
    It travels with the tokens through packing and every split (`megatron.router_replay`).
    """

    tokens: Sequence[int] | Any
    loss_mask: Sequence[float] | Any | None = None
    routed_experts: Any | None = None

    def __len__(self) -> int:
        return len(self.tokens)
