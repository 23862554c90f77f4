"""What a shared-prefix layout (`thd.shared_prefix`) costs the planner: tokens and attention per group.

A group of G responses of R_i tokens to a prompt of P tokens is laid out as one context segment (the
prompt) and G member segments (the responses); the prompt's last token predicts every response's first
token (one extra target per member after the first, scored by the output layer and computed by no layer
before it). Each segment is padded as a THD sequence is (`PaddingRule.padded_length`), so the group's span
in a row is ``pad(P) + sum(pad(R_i))`` instead of ``sum(pad(P + R_i))``, and its tokens ``P + sum(R_i)``.
Under dynamic batching a shared group is one THD row among the BSHD ones (a micro-batch holding one is
laid out as a THD row, `StepPlan.is_thd`).

Attention: the context attends causally to itself, ``sequence_cost(c)`` for ``c = P``; a member of ``q``
tokens attends to the context and causally to itself, which is the work of the last ``q`` queries of a
sequence of ``c + q`` tokens: ``sequence_cost(c + q) - sequence_cost(c)`` (the per-sequence constant
counted once per segment). The planner sees the group as one unit of that many tokens and that cost:
the first member carries the context's share, so sums over any unit are right.

A group shares when it has two or more members, a prompt of one or more tokens and its shared span fits
one micro-batch; otherwise its members are planned as separate sequences (``fallback_groups``: too big
for one micro-batch even shared). numpy only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .cost_model import CostModel
from .step_config import StepPlanConfig

__all__ = ["SharedPrefix", "SharedPrefixLayout", "shared_prefix_layout"]


@dataclass(frozen=True, kw_only=True)
class SharedPrefix:
    """Which samples share a prompt: a group id and the prompt's token count per sample (members of a
    group give the same count; the layout checks the tokens themselves)."""

    group_ids: tuple
    prompt_lengths: tuple[int, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "group_ids", tuple(self.group_ids))
        object.__setattr__(self, "prompt_lengths", tuple(int(n) for n in self.prompt_lengths))
        if len(self.group_ids) != len(self.prompt_lengths):
            raise ValueError(
                f"SharedPrefix has {len(self.group_ids)} group ids and {len(self.prompt_lengths)} prompt lengths; "
                "give one of each per sample."
            )
        first: dict = {}
        for g, n in zip(self.group_ids, self.prompt_lengths, strict=True):
            if n < 0:
                raise ValueError(f"group {g!r} has a prompt of {n} tokens; a prompt length is 0 or more.")
            if first.setdefault(g, n) != n:
                raise ValueError(
                    f"group {g!r} gives prompt lengths {first[g]} and {n}; its members share one prompt, so one length."
                )


@dataclass(frozen=True)
class SharedPrefixLayout:
    """The planner's view of a step's shared-prefix layout: per sample, the tokens (``real``), padded size
    (``padded``: the THD span of a shared group's member, else the mode's padded length) and attention
    cost (``costs``) it adds to its micro-batch (the first member of a shared group carries the context),
    its span in a THD row (``spans``), the shared prompt length it is laid out with (``prefix``: 0 when
    laid out as its own sequence), and the units the packer must keep whole (a shared group, or one
    sample)."""

    real: np.ndarray
    padded: np.ndarray
    spans: np.ndarray
    costs: np.ndarray
    prefix: tuple[int, ...]
    units: list[list[int]]
    shared_groups: tuple
    fallback_groups: tuple

    def report(self, lengths: np.ndarray, separate_costs: np.ndarray) -> dict:
        """Tokens and predicted attention-and-linear cost with and without sharing (JSON-able)."""
        return {
            "shared_groups": len(self.shared_groups),
            "fallback_groups": [str(g) for g in self.fallback_groups],
            "separate_tokens": int(lengths.sum()),
            "computed_tokens": int(self.real.sum()),
            "separate_cost": float(separate_costs.sum()),
            "shared_cost": float(self.costs.sum()),
        }


def shared_prefix_layout(
    lengths: np.ndarray, spec: SharedPrefix, config: StepPlanConfig, model: CostModel, *, forward_only: bool = False,
    keep_groups: bool = False,
) -> SharedPrefixLayout:
    """The layout of ``spec`` over samples of ``lengths`` (see the module docstring). ``keep_groups``: a
    group that does not fit one micro-batch shared stays one unit of separate sequences (the caller keeps
    groups whole, and `StepPlanConfig.check_groups_fit` says whether it fits that way), not single samples."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if len(spec.group_ids) != lengths.size:
        raise ValueError(f"SharedPrefix covers {len(spec.group_ids)} samples; the batch has {lengths.size}.")
    padded = config.padded_lengths(lengths)
    rule = config.padding_rule
    span_of = lambda n: -(-np.asarray(n, dtype=np.int64) // rule.sequence_multiple) * rule.sequence_multiple  # noqa: E731
    real, spans = lengths.astype(np.int64).copy(), span_of(lengths)
    costs = model.sequence_cost(padded).astype(np.float64)
    prefix = [0] * lengths.size
    capacity = config.row_capacity(forward_only)
    members: dict = {}
    for i, g in enumerate(spec.group_ids):
        members.setdefault(g, []).append(i)
    units, shared, fallback = [], [], []
    for g, group in members.items():
        prompt = spec.prompt_lengths[group[0]]
        short = [i for i in group if lengths[i] <= prompt]
        if short:
            raise ValueError(
                f"group {g!r}: sample {short[0]} has {int(lengths[short[0]])} tokens, no response after its prompt of "
                f"{prompt}; a sample's length counts its prompt and its response."
            )
        if len(group) < 2 or prompt < 1:
            units += [[i] for i in group]
            continue
        context = prompt
        own = lengths[group] - context
        own_spans = span_of(own)
        context_span = int(span_of(context))
        if context_span + int(own_spans.sum()) > capacity:
            fallback.append(g)
            units += [list(group)] if keep_groups else [[i] for i in group]
            continue
        shared.append(g)
        units.append(list(group))
        member_costs = model.sequence_cost(context + own_spans) - model.sequence_cost([context])[0]
        member_costs = member_costs + model.per_sequence  # sequence_cost's difference cancelled the constant
        real[group], spans[group], padded[group], costs[group] = own, own_spans, own_spans, member_costs
        first = group[0]
        real[first] += context
        spans[first] += context_span
        padded[first] += context_span
        costs[first] += model.sequence_cost([context_span])[0]
        for i in group:
            prefix[i] = prompt
    return SharedPrefixLayout(real=real, padded=padded, spans=spans, costs=costs, prefix=tuple(prefix), units=units,
                              shared_groups=tuple(shared), fallback_groups=tuple(fallback))  # fmt: skip


def check_same_groups(groups: Sequence, spec: SharedPrefix) -> None:
    """Groups kept together (``plan_step(groups=...)``) and groups that share a prompt must be the same
    partition of the samples, so a shared group is one unit of the packer."""
    if [str(g) for g in groups] != [str(g) for g in spec.group_ids]:
        raise ValueError(
            "plan_step's groups and SharedPrefix.group_ids differ; give the same group id per sample to both (the "
            "responses to one prompt), or leave groups out."
        )
