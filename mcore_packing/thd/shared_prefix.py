"""Shared-prefix THD rows: a group of sequences that begin with the same prompt, the prompt laid out once.

In GRPO every prompt comes with G sampled responses. Packed as G sequences, the prompt is computed G
times in every forward and backward. Here a group becomes one *context* segment (the prompt) and G
*member* segments (the responses):

    sequences             [p0 p1 p2 p3 a0 a1]  [p0 p1 p2 p3 b0 b1 b2]        (prompt of P = 4 tokens)
    segments              [p0 p1 p2 p3] | [a0 a1] | [b0 b1 b2]               context, member 1, member 2
    position_ids          0 1 2 3       | 4 5     | 4 5 6                     each token's place in its sequence
    labels                p1 p2 p3 a0   | a1 -    | b1 b2 -      + b0         (one extra target, after the row)
    attention             causal        | context + causal over itself (never another member)

A group of G responses of R_i tokens to a prompt of P tokens computes ``P + sum(R_i)`` tokens instead of
``G * P + sum(R_i)``. The prompt's last token predicts each response's first token: one hidden state, G
targets. The row's own label slot holds the first member's; the others are *extra targets* after the
row's ``T`` positions (``extra_rows``: the row position each one scores, ``labels`` and ``loss_mask``:
the row's followed by the extras'). The output layer scores those positions again
(`megatron.shared_prefix.score_extra_rows` appends their logits), so the per-token losses have
``T + len(extra_rows)`` entries; the transformer computes none of them twice.

The segments are the row's THD "sequences" (``cu_seqlens`` over segments, padded by the `PaddingRule` as
any sequence); `SharedPrefixRow` says which context each member attends to, and each sequence's values
come back in their original places (`SharedPrefixRow.sample_rows`): a sample's per-token outputs are its
context's (the last one its own target's) followed by its member segment's, so a loss over them, and its
gradient, is the loss over G separate sequences (the context's outputs are shared: their gradients sum
over the members, as the G copies' would). The prompt's targets must be out of the loss (loss mask 0 on
prompt tokens 1..P-1, as RL rollouts have it), because a per-token weighted loss on the row would count a
shared target once.

Attention (`megatron.attention.PackedCoreAttention`) gives a member's queries the context's keys and
values followed by its own, causal aligned bottom-right. Megatron's THD RoPE restarts positions at every
segment, so a member's own tokens are at positions ``0..`` instead of ``P..``; RoPE's scores depend
only on the distance between query and key, so the member-to-member part is unchanged and the context's
keys, rotated back by ``P`` positions, give the member-to-context part its true distances
(`SharedPrefixRow.key_shifts`).

torch only; no megatron-core import.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch

from ..data.sample import SequenceSample
from ..planning.padding import PaddingRule
from .packed_batch import PackedBatch, _checked_samples, build_packed_batch

__all__ = ["SharedPrefixRow", "build_shared_prefix_row", "common_prefix_length"]


@dataclass(frozen=True, kw_only=True)
class SharedPrefixRow:
    """A packed row of segments (``batch``: its ``seq_lengths``, ``padded_lengths`` and ``cu_seqlens`` are
    per segment, its ``sample_ids`` the segment indices) and how they make up the samples.

    ``context_of[j]``: the segment whose keys segment ``j`` attends to before its own (-1: none; a context
    or a sample laid out alone). ``key_shifts[j]``: the positions by which the context's keys are rotated
    back for segment ``j`` (its first token's position in its sequence; 0 without a context).
    ``sample_ids[k]`` is the ``k``-th sample's id, ``sample_segments[k]`` its (context, own) segments and
    ``sample_slots[k]`` the scored slot of its prompt's last token (-1 without a context): a row position,
    or ``T + e`` for the ``e``-th extra target. ``extra_rows[e]``: the row position that extra target
    scores; ``extra_labels`` and ``extra_loss_mask`` its label and loss mask.
    """

    batch: PackedBatch
    context_of: tuple[int, ...]
    key_shifts: tuple[int, ...]
    sample_ids: tuple[int, ...]
    sample_segments: tuple[tuple[int, int], ...]
    sample_slots: tuple[int, ...]
    extra_rows: tuple[int, ...] = ()
    extra_labels: tuple[int, ...] = ()
    extra_loss_mask: tuple[float, ...] = ()

    @property
    def computed_tokens(self) -> int:
        """Real tokens the row computes (padding excluded)."""
        return self.batch.num_real_tokens

    @property
    def separate_tokens(self) -> int:
        """Real tokens the same samples would compute packed as separate sequences."""
        lengths = self.batch.seq_lengths
        return sum((lengths[c] if c >= 0 else 0) + lengths[own] for c, own in self.sample_segments)

    @property
    def labels(self) -> torch.Tensor:
        """``[1, T + extras]``: the row's labels followed by the extra targets'."""
        extra = torch.tensor(self.extra_labels, dtype=self.batch.labels.dtype)
        return torch.cat([self.batch.labels, extra[None]], dim=1)

    @property
    def loss_mask(self) -> torch.Tensor:
        """``[1, T + extras]``: the row's loss mask followed by the extra targets'."""
        extra = torch.tensor(self.extra_loss_mask, dtype=self.batch.loss_mask.dtype)
        return torch.cat([self.batch.loss_mask, extra[None]], dim=1)

    def sample_rows(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Per-token values of the row as each sample's values in its original token order (``[n_k, ...]``,
        sample order), differentiably: a context's values appear in each member's. ``flat``: per scored
        slot (``[T + extras, ...]``: per-token losses, the scored loss mask) or per row position (``[T, ...]``:
        tokens, positions, logits; a prompt's last token then gives every member the same value)."""
        total, extras = self.batch.total_tokens, len(self.extra_rows)
        if flat.shape[0] == total and extras:
            flat = torch.cat([flat, flat[list(self.extra_rows)]])
        elif flat.shape[0] != total + extras:
            raise ValueError(f"{flat.shape[0]} values for a row of {total} positions and {extras} extra targets.")
        starts = self.batch.cu_seqlens_padded.tolist()
        lengths = self.batch.seq_lengths
        rows = []
        for (context, own), slot in zip(self.sample_segments, self.sample_slots, strict=True):
            mine = flat[starts[own] : starts[own] + lengths[own]]
            if context >= 0:
                first = starts[context]
                mine = torch.cat([flat[first : first + lengths[context] - 1], flat[slot : slot + 1], mine])
            rows.append(mine)
        return rows


def common_prefix_length(sequences: Sequence) -> int:
    """How many leading tokens all ``sequences`` share."""
    arrays = [np.asarray(s).reshape(-1) for s in sequences]
    n = min(a.size for a in arrays)
    same = np.ones(n, dtype=bool)
    for a in arrays[1:]:
        same &= arrays[0][:n] == a[:n]
    return int(n if same.all() else np.argmin(same))


def build_shared_prefix_row(
    samples: Sequence[SequenceSample],
    groups: Sequence[Sequence[int]],
    prompt_lengths: Sequence[int],
    rule: PaddingRule | None = None,
    *,
    sample_ids: Sequence[int] | None = None,
    pad_to: int | None = None,
    pad_token_id: int = 0,
) -> SharedPrefixRow:
    """Lay out ``samples`` (one micro-batch) with each of ``groups`` (lists of indices into ``samples``,
    together covering each index once, in row order) sharing its first ``prompt_lengths[g]`` tokens.

    A group of one, or a prompt of no tokens, is laid out as plain sequences (nothing to share). Raises a
    ValueError naming the group when its members do not all begin with the same ``prompt_lengths[g]``
    tokens, when a member has no token after the prompt, or when a prompt target is in the loss.
    ``rule``, ``pad_to`` and ``pad_token_id`` as in `build_packed_batch` (the rule pads each segment).
    """
    ids = tuple(range(len(samples))) if sample_ids is None else tuple(int(i) for i in sample_ids)
    if len(ids) != len(samples):
        raise ValueError(f"sample_ids has {len(ids)} entries for {len(samples)} samples.")
    if len(groups) != len(prompt_lengths):
        raise ValueError(f"{len(groups)} groups but {len(prompt_lengths)} prompt lengths; give one per group.")
    covered = sorted(i for group in groups for i in group)
    if covered != list(range(len(samples))):
        raise ValueError(
            f"groups must cover each of the {len(samples)} samples once (indices 0..{len(samples) - 1}); they "
            f"cover {covered}."
        )
    segments: list[SequenceSample] = []
    context_of: list[int] = []
    shifts: list[int] = []
    targets: list[tuple[int, int, float]] = []  # per sample: (context segment or -1, first response token, mask)
    order: list[int] = []
    sample_segments: list[tuple[int, int]] = []
    for g, (group, prompt) in enumerate(zip(groups, prompt_lengths, strict=True)):
        members = [samples[i] for i in group]
        prompt = int(prompt)
        if len(members) < 2 or prompt < 1:
            for i, sample in zip(group, members, strict=True):
                order.append(i)
                sample_segments.append((-1, len(segments)))
                targets.append((-1, 0, 0.0))
                segments.append(sample)
                context_of.append(-1)
                shifts.append(0)
            continue
        tokens, masks = _checked_samples(members, tuple(ids[i] for i in group))
        _check_group(g, [ids[i] for i in group], tokens, masks, prompt)
        context = len(segments)
        segments.append(SequenceSample(tokens[0][:prompt], masks[0][:prompt]))
        context_of.append(-1)
        shifts.append(0)
        for i, t, m in zip(group, tokens, masks, strict=True):
            order.append(i)
            sample_segments.append((context, len(segments)))
            targets.append((context, int(t[prompt]), float(m[prompt])))
            segments.append(SequenceSample(t[prompt:], m[prompt:]))
            context_of.append(context)
            shifts.append(prompt)
    batch = build_packed_batch(segments, rule, pad_to=pad_to, pad_token_id=pad_token_id)
    return _with_targets(batch, targets, sample_ids=tuple(ids[i] for i in order), context_of=tuple(context_of),
                         key_shifts=tuple(shifts), sample_segments=tuple(sample_segments))  # fmt: skip


def _with_targets(batch: PackedBatch, targets, **fields) -> SharedPrefixRow:
    """The row with its positions counted in each sequence and each member's first response token as the
    target of its prompt's last token: the first member's in the row's label slot, the rest extra targets."""
    batch = _with_sequence_positions(batch, fields["key_shifts"])
    starts = batch.cu_seqlens_padded.tolist()
    slots, extra_rows, extra_labels, extra_mask = [], [], [], []
    labelled = set()
    for context, label, mask in targets:
        if context < 0:
            slots.append(-1)
            continue
        last = starts[context] + batch.seq_lengths[context] - 1
        if context not in labelled:
            labelled.add(context)
            batch.labels[0, last] = label
            batch.loss_mask[0, last] = mask
            slots.append(last)
            continue
        slots.append(batch.total_tokens + len(extra_rows))
        extra_rows.append(last)
        extra_labels.append(label)
        extra_mask.append(mask)
    return SharedPrefixRow(batch=batch, sample_slots=tuple(slots), extra_rows=tuple(extra_rows),
                           extra_labels=tuple(extra_labels), extra_loss_mask=tuple(extra_mask), **fields)  # fmt: skip


def _check_group(g: int, ids: list[int], tokens: list[torch.Tensor], masks: list[torch.Tensor], prompt: int) -> None:
    shortest = min(t.numel() for t in tokens)
    if shortest <= prompt:
        raise ValueError(
            f"group {g} (samples {ids}): a member of {shortest} tokens has no response after the prompt of "
            f"{prompt}; lay this group out as separate sequences."
        )
    shared = common_prefix_length([t[:prompt].numpy() for t in tokens])
    if shared < prompt:
        raise ValueError(
            f"group {g} (samples {ids}): its members share only their first {shared} tokens, not the prompt of "
            f"{prompt}; give the group's true prompt length or lay it out as separate sequences."
        )
    learned = [ids[k] for k, m in enumerate(masks) if bool(m[1:prompt].any())]
    if learned:
        raise ValueError(
            f"group {g}: samples {learned} have prompt tokens in the loss (loss_mask on tokens 1..{prompt - 1}); a "
            "shared prompt is computed once, so its targets must be out of the loss (set their loss_mask to 0)."
        )


def _with_sequence_positions(batch: PackedBatch, shifts: Sequence[int]) -> PackedBatch:
    """``batch`` with each segment's position ids counted from its place in its sequence."""
    if not any(shifts):
        return batch
    offsets = torch.repeat_interleave(torch.tensor(shifts, dtype=torch.long), torch.tensor(batch.padded_lengths))
    return replace(batch, position_ids=batch.position_ids + offsets[None])
