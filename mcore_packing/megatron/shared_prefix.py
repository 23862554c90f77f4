"""A shared-prefix row (`thd.shared_prefix`) on Megatron's side: what its ``PackedSeqParams`` carry for the
attention, and the RoPE rotation of a context's keys.

`attach_shared_prefix` puts a `SharedPrefixAttention` on the params: each segment's context (host ints
from the layout, so attention needs no device copy) and, for each distinct key shift, RoPE's embedding
at position ``-shift`` from the model's own ``RotaryEmbedding`` (its base, scaling and interleaving), on
the device. `PackedCoreAttention` reads it with `shared_prefix_of`: a member segment's queries attend to
``rotate_keys(context keys, shift)`` followed by its own keys, causal aligned bottom-right. The keys of
every segment are gathered once per layer into that layout (`KeyPlan`: one rotated copy of a context per
distinct shift, an index built on the host once per row), so the attention is one variable-length call
with separate query and key offsets on a GPU (`compat.varlen_attention`), SDPA per segment on the CPU.

Why the rotation is exact: Megatron's THD RoPE rotates each segment's tokens by their position within
the segment, so a member's tokens sit ``shift`` positions earlier than in their sequence. RoPE's score
between a query rotated by ``m`` and a key rotated by ``n`` depends on ``m - n`` only (rotations compose:
``R(a) R(b) = R(a + b)``), so the member's scores among its own tokens are unchanged, and the context's
keys rotated once more by ``-shift`` have the distance to every member query that the whole sequence
gives them. Values carry no rotation.

`score_extra_rows`: the prompt's last token predicts every member's first token, so its logits are
scored once per member: the output layer's logits of those row positions (``SharedPrefixRow.extra_rows``)
are appended after the row's, and the labels the model gets (``SharedPrefixRow.labels``) have an entry
for each. The output layer sees the whole row there (Megatron gathers a sequence-parallel row before it),
so this holds at TP + SP, and the hook runs before the others on that layer (the sampling temperature,
the entropy), which then see every target.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from itertools import accumulate

import torch

from ..compat import require_megatron
from ..thd.shared_prefix import SharedPrefixRow

__all__ = ["KeyPlan", "SharedPrefixAttention", "attach_shared_prefix", "score_extra_rows", "shared_prefix_of"]

_ATTR = "_mcore_packing_shared_prefix"


@dataclass(frozen=True)
class KeyPlan:
    """Where each segment's keys come from, for one row: the context copies to rotate (``pairs``: each
    context's row start, real length and key shift, in the order they are appended after the row's own
    keys), the gather ``index`` into ``[keys, copies...]`` that lays every segment's keys out as
    ``[its context's rotated keys, its own padded span]`` (on the device), each segment's first gathered
    key and context length (host), and the gathered spans as varlen's ``cu_keys`` (int32, device) and
    ``max_keys``."""

    pairs: tuple[tuple[int, int, int], ...]
    index: torch.Tensor
    key_starts: tuple[int, ...]
    context_lengths: tuple[int, ...]
    cu_keys: torch.Tensor
    max_keys: int


@dataclass(frozen=True)
class SharedPrefixAttention:
    """Each segment's context segment (-1: none) and key shift, and RoPE's embedding per distinct shift
    (``[1, 1, 1, rotary dim]`` on the device; None for a model without RoPE). `key_plan` is built once per
    row and device, on first use."""

    context_of: tuple[int, ...]
    key_shifts: tuple[int, ...]
    rotations: dict[int, torch.Tensor] | None
    _plans: dict = field(default_factory=dict, compare=False, repr=False)

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

    def key_plan(self, layout, device: torch.device) -> KeyPlan:
        """The row's `KeyPlan` on ``device`` (``layout``: its `packed_seq.ThdLayout`); host ints, moved once."""
        plan = self._plans.get(device)
        if plan is None:
            plan = self._plans[device] = _key_plan(self, layout, device)
        return plan

    def gathered_keys(self, k: torch.Tensor, v: torch.Tensor, plan: KeyPlan, config, cp_group=None):
        """``k``, ``v`` ``[T, heads, dim]`` of the row laid out per segment as ``plan`` says: a member's
        context keys rotated back by its shift, then its own keys; values likewise (never rotated)."""
        keys = [k] + [self.rotate_keys(k[s : s + n], shift, config, cp_group) for s, n, shift in plan.pairs]
        values = [v] + [v[s : s + n] for s, n, _ in plan.pairs]
        return torch.cat(keys)[plan.index], torch.cat(values)[plan.index]


def _key_plan(shared: SharedPrefixAttention, layout, device) -> KeyPlan:
    copies: dict[tuple[int, int], int] = {}  # (context, shift) -> its rows' start after the row's own keys
    end = layout.total
    rows: list[range] = []
    key_starts, context_lengths, spans = [], [], []
    gathered = 0
    for j, (start, span, n) in enumerate(zip(layout.padded_starts, layout.padded_lengths, layout.real_lengths,
                                             strict=True)):  # fmt: skip
        context = shared.context(j) if n else -1
        n_c = 0
        if context >= 0:
            key = (context, shared.key_shifts[j])
            n_c = layout.real_lengths[context]
            if key not in copies:
                copies[key] = end
                end += n_c
            rows.append(range(copies[key], copies[key] + n_c))
        rows.append(range(start, start + span))
        key_starts.append(gathered)
        context_lengths.append(n_c)
        spans.append(n_c + span)
        gathered += n_c + span
    pairs = tuple((layout.padded_starts[c], layout.real_lengths[c], shift)
                  for (c, shift), _ in sorted(copies.items(), key=lambda item: item[1]))  # fmt: skip
    index = torch.tensor([i for r in rows for i in r], dtype=torch.long)
    cu = torch.tensor([0, *accumulate(spans)], dtype=torch.int32)
    return KeyPlan(pairs=pairs, index=index.to(device, non_blocking=True), key_starts=tuple(key_starts),
                   context_lengths=tuple(context_lengths), cu_keys=cu.to(device, non_blocking=True),
                   max_keys=max(spans, default=0))  # fmt: skip


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


@contextlib.contextmanager
def score_extra_rows(model_chunk, rows: torch.Tensor | None):
    """Within the block, the logits of ``model_chunk``'s output layer (on the last stage) are followed by
    those of the row positions ``rows`` (``[E]`` int64 on the logits' device; None or empty: unchanged), so
    Megatron's loss with labels of ``T + E`` entries scores them a second time (see the module docstring)."""
    if rows is None or rows.numel() == 0:
        yield
        return
    from .output_layer import DeferredLogits, output_layers

    def append(_module, _inputs, output):
        logits = output[0] if isinstance(output, tuple) else output  # [s, b, vocab / tp], the whole row
        if isinstance(logits, DeferredLogits):  # chunked log-probs: the rows' hidden states, scored later
            logits = logits.with_rows(rows)
        else:
            logits = torch.cat([logits, logits.index_select(0, rows)])
        return (logits, *output[1:]) if isinstance(output, tuple) else logits

    handles = [layer.register_forward_hook(append, prepend=True) for layer in output_layers(model_chunk)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
