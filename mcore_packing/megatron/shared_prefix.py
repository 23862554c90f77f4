"""A shared-prefix row (`thd.shared_prefix`) on Megatron's side: what its ``PackedSeqParams`` carry for the
attention, and the RoPE rotation of a context's keys.

`attach_shared_prefix` puts a `SharedPrefixAttention` on the params: each segment's context (host ints
from the layout, so attention needs no device copy) and, for each distinct key shift, RoPE's embedding
at position ``-shift`` from the model's own ``RotaryEmbedding`` (its base, scaling and interleaving), on
the device. `PackedCoreAttention` reads it with `shared_prefix_of`: a member segment's queries attend to
``rotate_keys(context keys, shift)`` followed by its own keys, causal aligned bottom-right.

Why the rotation is exact: Megatron's THD RoPE rotates each segment's tokens by their position within
the segment, so a member's tokens sit ``shift`` positions earlier than in their sequence. RoPE's score
between a query rotated by ``m`` and a key rotated by ``n`` depends on ``m - n`` only (rotations compose:
``R(a) R(b) = R(a + b)``), so the member's scores among its own tokens are unchanged, and the context's
keys rotated once more by ``-shift`` have the distance to every member query that the whole sequence
gives them. Values carry no rotation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..compat import require_megatron
from ..thd.shared_prefix import SharedPrefixRow

__all__ = ["SharedPrefixAttention", "attach_shared_prefix", "shared_prefix_of"]

_ATTR = "_mcore_packing_shared_prefix"


@dataclass(frozen=True)
class SharedPrefixAttention:
    """Each segment's context segment (-1: none) and key shift, and RoPE's embedding per distinct shift
    (``[1, 1, 1, rotary dim]`` on the device; None for a model without RoPE)."""

    context_of: tuple[int, ...]
    key_shifts: tuple[int, ...]
    rotations: dict[int, torch.Tensor] | None

    def context(self, segment: int) -> int:
        """The context segment of ``segment`` (-1: none; the zero-length entries of fixed shapes have none)."""
        return self.context_of[segment] if segment < len(self.context_of) else -1

    def rotate_keys(self, keys: torch.Tensor, shift: int, config, cp_group=None) -> torch.Tensor:
        """``keys`` ``[n, heads, dim]`` (RoPE already applied) rotated by ``-shift`` positions, with Megatron's
        own RoPE application (``apply_rotary_pos_emb``; the fused kernel where the config asks for it)."""
        if self.rotations is None or shift == 0:
            return keys
        from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb

        rotated = apply_rotary_pos_emb(keys[:, None], self.rotations[shift], config=config, cp_group=cp_group)
        return rotated[:, 0]


def attach_shared_prefix(params, row: SharedPrefixRow, rotary, device: torch.device | str) -> object:
    """Attach ``row``'s `SharedPrefixAttention` to ``params`` (its ``PackedSeqParams``) and return them.
    ``rotary``: the model chunk's ``rotary_pos_emb`` (None: a model without RoPE)."""
    require_megatron()
    shifts = sorted({s for s in row.key_shifts if s})
    rotations = None
    if rotary is not None:
        rotations = {s: _position_embedding(rotary, -s).to(device) for s in shifts}
    setattr(params, _ATTR, SharedPrefixAttention(row.context_of, row.key_shifts, rotations))
    return params


def shared_prefix_of(params) -> SharedPrefixAttention | None:
    """The `SharedPrefixAttention` attached to ``params``, if any."""
    return getattr(params, _ATTR, None) if params is not None else None


def _position_embedding(rotary, position: int) -> torch.Tensor:
    """RoPE's embedding of the single position ``position`` from Megatron's ``RotaryEmbedding``."""
    return rotary.get_emb(1, offset=position)
