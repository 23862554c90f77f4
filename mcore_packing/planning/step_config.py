"""`StepPlanConfig`: how one global batch becomes micro-batches, and the checks every caller shares.

One translation from NeMo-RL-style sections (``sequence_packing`` / ``dynamic_batching`` dicts, whose
keys are the fields of `sections.SequencePackingConfig` / `DynamicBatchingConfig`) to a config,
`StepPlanConfig.from_sections`, serves both `from_nemo_rl` and the trainer. One budget check,
`StepPlanConfig.check_fits`, serves the planner, the trainer's start-up check and the planning CLI.

Budgets are per GPU. ``train_mb_tokens`` is what one rank processes in one micro-batch; with context
parallelism a micro-batch's packed row (or padded rows) holds ``train_mb_tokens * cp`` tokens and each
CP rank gets ``train_mb_tokens`` of them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..packing import DEFAULT_ALGORITHM, get_packer
from ..validators import require_choice, require_positive_int, require_positive_number
from .balance import BALANCES, ORDERS
from .cost_model import CostModel
from .layout import SINGLE_RANK, ParallelLayout, check_dynamic_cp_layout
from .memory import parse_bytes
from .padding import PaddingRule, micro_batch_tokens
from .sections import section_keys

__all__ = ["DYNAMIC_CP_MODES", "MODES", "StepPlanConfig"]

MODES = ("packing", "dynamic", "padded")
"""``packing``: whole sequences in THD rows; ``dynamic``: similar lengths in padded BSHD rows;
``padded``: the baseline, ``padded_rows`` consecutive samples padded to their longest."""

DYNAMIC_CP_MODES = ("packing", "dynamic")
"""The `StepPlanConfig` modes dynamic CP plans: THD rows, and dynamic batching's BSHD rows (not ``padded``)."""


@dataclass(frozen=True, kw_only=True)
class StepPlanConfig:
    """How one global batch becomes micro-batches.

    Attributes:
        mode: one of `MODES`.
        train_mb_tokens: tokens one rank processes per training micro-batch (per GPU, after the CP split).
        logprob_mb_tokens: the same for forward-only passes (log-probs); defaults to ``train_mb_tokens``.
        algorithm: packing algorithm (packing mode).
        refine: bin-count refinement after packing (`get_packer`'s ``refine``); None is the algorithm's
            default (on for modified_first_fit_decreasing).
        microbatch_order: one of `ORDERS`: ``auto`` (the simulated-best 1F1B order under PP, else the
            packer's), ``packer``, ``largest_first``, ``bubble`` or ``pipeline``.
        sequence_length_round: per-sequence length alignment (NeMo-RL's key).
        layout: the `ParallelLayout` (tp, pp, cp, dp, sequence_parallel).
        fp8_alignment: FP8 GEMM alignment of each rank's share of a row (`FP8_ROW_ALIGNMENT`: 16, 32 or
            128), 1 when off; pads each row's tail, never a sequence (`PaddingRule`).
        fixed_length: packing mode: pad every row to the full ``train_mb_tokens * cp`` (PP without
            variable sequence lengths needs one shape). Default: on when ``layout.pp > 1``.
        fixed_shape: packing mode: every micro-batch has one shape for CUDA graphs: rows of the full
            capacity (``fixed_length``) and cu_seqlens of `cu_seqlens_entries` entries, the sequences a
            row holds followed by zero-length ones (`megatron.packed_seq.to_packed_seq_params`).
        padded_rows: rows per micro-batch in ``padded`` mode.
        balance: one of `BALANCES`: ``cost`` (attention-aware `cost_model`, LPT + swaps), ``tokens``
            (the same on padded tokens), ``round_robin`` (NeMo-RL's, for comparison).
        cost_model: per-sequence cost; None counts tokens (no attention term).
        cost_budget: packing only: also cap each row's cost (in `cost_model` units), or ``"auto"`` for
            5% above the mean row cost of token-only packing, so rows are even in work.
        dynamic_cp: packing or dynamic mode: dynamic context parallelism (`planning.dynamic_cp`): each
            sequence on the smallest power-of-two CP size (up to ``layout.cp``) whose row (THD, or BSHD rows
            in dynamic mode) of that many ranks holds it at the pass's budget per rank; `plan_step` then
            returns a `DynamicCPPlan`. Needs a power-of-two cp and
            pp=1; ``algorithm``, ``balance`` and ``microbatch_order`` do not apply (the rows are scheduled
            over the DP x CP ranks by cost).
    """

    mode: str = "packing"
    train_mb_tokens: int = 4096
    logprob_mb_tokens: int | None = None
    algorithm: str = DEFAULT_ALGORITHM.value
    refine: bool | None = None
    microbatch_order: str = "auto"
    sequence_length_round: int = 1
    layout: ParallelLayout = SINGLE_RANK
    fp8_alignment: int = 1
    fixed_length: bool | None = None
    fixed_shape: bool = False
    padded_rows: int = 4
    balance: str = "cost"
    cost_model: CostModel | None = None
    cost_budget: float | str | None = None
    dynamic_cp: bool = False
    memory_budget: int | str | None = None  # bytes per GPU a training pass's predicted peak must stay under
    memory_model: object | None = None  # what predicts it (`memory_budget.MemoryModel`); None: the budget unchecked

    def __post_init__(self):
        require_choice("mode", self.mode, MODES)
        require_choice("microbatch_order", self.microbatch_order, ORDERS)
        require_choice("balance", self.balance, BALANCES)
        for name in ("train_mb_tokens", "sequence_length_round"):
            require_positive_int(name, getattr(self, name))
        if not isinstance(self.layout, ParallelLayout):
            raise TypeError(f"layout={self.layout!r} must be a ParallelLayout(tp=, pp=, cp=, dp=, sequence_parallel=).")
        for name in ("fp8_alignment", "padded_rows"):
            require_positive_int(name, getattr(self, name))
        require_positive_int("logprob_mb_tokens", self.logprob_mb_tokens, allow_none=True)
        if self.memory_budget is not None:
            object.__setattr__(self, "memory_budget", parse_bytes(self.memory_budget))
        if self.cost_budget is not None:
            if self.cost_budget != "auto":
                require_positive_number("cost_budget", self.cost_budget)  # or 'auto', or None
            if self.mode != "packing":
                raise ValueError("cost_budget caps the cost of packed rows: it needs mode='packing'.")
        get_packer(self.algorithm, 1, refine=self.refine)  # raises on an unknown algorithm or a bad `refine`
        if self.mode != "packing" and self.fixed_length:
            raise ValueError("fixed_length applies to packing mode; dynamic micro-batches are padded per batch.")
        if self.fixed_shape and (self.mode != "packing" or self.fixed_length is False):
            raise ValueError(
                f"fixed_shape=True needs mode='packing' with fixed-length rows (got mode={self.mode!r}, "
                f"fixed_length={self.fixed_length}): one shape per micro-batch is a packed row of the full "
                "capacity. Use sequence packing without variable_seq_lengths, or set fixed_shape=false."
            )
        if self.dynamic_cp:
            self._check_dynamic_cp()

    def _check_dynamic_cp(self) -> None:
        check_dynamic_cp_layout(self.layout, key="dynamic_cp")
        if self.mode not in DYNAMIC_CP_MODES:
            raise ValueError(
                f"dynamic_cp plans packed THD rows (mode='packing') or dynamic batching's BSHD rows (mode='dynamic') "
                f"on CP sub-groups; mode={self.mode!r} pads every micro-batch to one shape. Use one of those modes, "
                "or static CP."
            )
        for name in ("fixed_shape", "cost_budget"):
            if getattr(self, name):
                raise ValueError(
                    f"{name} does not apply with dynamic_cp (its rows are sized per CP size and scheduled by cost); "
                    f"unset {name} or use static CP."
                )

    @classmethod
    def from_sections(
        cls,
        *,
        sequence_packing: dict | None = None,
        dynamic_batching: dict | None = None,
        padded: dict | None = None,
        sequence_length_divisible_by: int | None = None,
        **fields,
    ) -> StepPlanConfig:
        """The config for NeMo-RL-style sections: the enabled one of ``sequence_packing`` and
        ``dynamic_batching`` (keys: enabled, train_mb_tokens, logprob_mb_tokens, sequence_length_round;
        packing adds algorithm, refine, microbatch_order, cost_budget). With neither enabled, ``padded``
        (fields for ``mode="padded"``) is used, or it is an error when ``padded`` is None.
        ``sequence_length_divisible_by`` (NeMo-RL's ``make_sequence_length_divisible_by``) joins the
        section's ``sequence_length_round``; ``fields`` are the remaining ones (``layout``, ``balance``, ...).
        Errors name the section."""
        sections = {"sequence_packing": dict(sequence_packing or {}), "dynamic_batching": dict(dynamic_batching or {})}
        enabled = [name for name, section in sections.items() if section.get("enabled")]
        if len(enabled) == 2:
            raise ValueError(
                "sequence_packing.enabled and dynamic_batching.enabled are both true. They are two ways to cut "
                "the same batch: packing concatenates whole sequences into THD rows (least padding, needs THD "
                "attention), dynamic batching groups similar lengths into padded rows. Set one of them to false."
            )
        if not enabled and padded is None:
            raise ValueError("Neither sequence_packing.enabled nor dynamic_batching.enabled is true; enable one.")
        name = enabled[0] if enabled else "padded"
        chosen = dict(padded or {}) if not enabled else _section_fields(name, sections[name])
        divisible = sequence_length_divisible_by or 1
        chosen["sequence_length_round"] = math.lcm(chosen.get("sequence_length_round", 1), divisible)
        mode = {"sequence_packing": "packing", "dynamic_batching": "dynamic"}.get(name, "padded")
        try:
            return cls(mode=mode, **chosen, **fields)
        except ValueError as exc:
            raise ValueError(f"{name}: {exc}") from None

    @classmethod
    def from_nemo_rl(
        cls, *, sequence_packing: dict | None = None, dynamic_batching: dict | None = None, **fields
    ) -> StepPlanConfig:
        """Build from NeMo-RL's ``policy.sequence_packing`` / ``policy.dynamic_batching`` sections
        (`from_sections` without a padded fallback)."""
        return cls.from_sections(sequence_packing=sequence_packing, dynamic_batching=dynamic_batching, **fields)

    @property
    def padding_rule(self) -> PaddingRule:
        return PaddingRule.for_layout(
            self.layout, sequence_length_round=self.sequence_length_round, fp8_alignment=self.fp8_alignment
        )

    @property
    def use_fixed_length(self) -> bool:
        if self.fixed_shape:
            return True
        return self.mode == "packing" and (self.fixed_length if self.fixed_length is not None else self.layout.pp > 1)

    def cu_seqlens_entries(self, row_tokens: int) -> int | None:
        """With `fixed_shape`, the cu_seqlens length of every row of ``row_tokens`` tokens: two more than
        the most sequences such a row can hold (each takes at least one `PaddingRule.sequence_multiple`), so
        it never depends on the data and a full row still ends in one zero-length entry (TransformerEngine
        before 2.18 reads a row's padding from all but the last entry: `megatron.te_contract`); None
        without `fixed_shape`."""
        if not self.fixed_shape:
            return None
        return row_tokens // self.padding_rule.sequence_multiple + 2

    def check_groups_fit(self, lengths, groups, *, forward_only: bool = False, key: str | None = None) -> None:
        """Raise ValueError when a group (samples that share a micro-batch: DPO pairs, GRPO responses to one
        prompt) needs more tokens than one micro-batch holds (packing: its padded lengths summed; dynamic:
        its rows times its longest padded length); the message names the group, its size, the budget's key
        (``key``, else the planner's name for it) and the smallest budget that holds it."""
        padded = self.padded_lengths(np.asarray(lengths, dtype=np.int64))
        capacity = self.row_capacity(forward_only)
        members: dict = {}
        for g, n in zip(groups, padded.tolist(), strict=True):
            members.setdefault(g, []).append(n)
        tokens = {g: micro_batch_tokens(spans, self.mode) for g, spans in members.items()}
        group = max(tokens, key=tokens.get)
        if tokens[group] > capacity:
            count, widest = len(members[group]), max(members[group])
            how = "padded tokens" if self.mode == "packing" else f"tokens as {count} rows of {widest}"
            raise ValueError(
                f"group {group!r} has {count} samples and {tokens[group]} {how}, more than one micro-batch holds "
                f"({capacity}). Raise {key or self.budget(forward_only)[0]} (x cp) to at least "
                f"{-(-tokens[group] // self.layout.cp)}, or split the group upstream."
            )

    def budget(self, forward_only: bool = False) -> tuple[str, int]:
        """The name and value of the per-GPU token budget that applies."""
        if forward_only and self.logprob_mb_tokens is not None:
            return "logprob_mb_tokens", self.logprob_mb_tokens
        return "train_mb_tokens", self.train_mb_tokens

    @property
    def length_multiple(self) -> int:
        """Sequences are padded to this (`PaddingRule.length_multiple` of the mode)."""
        return self.padding_rule.length_multiple(self.mode)

    def padded_lengths(self, lengths: np.ndarray) -> np.ndarray:
        """``lengths`` rounded up to `length_multiple`."""
        multiple = self.length_multiple
        return -(-np.asarray(lengths, dtype=np.int64) // multiple) * multiple

    def row_capacity(self, forward_only: bool = False) -> int:
        """Tokens in one micro-batch before the CP split, rounded down to the row multiple."""
        _, budget = self.budget(forward_only)
        multiple = self.padding_rule.total_multiple if self.mode == "packing" else self.length_multiple
        return (budget * self.layout.cp) // multiple * multiple

    @property
    def count_multiple(self) -> int:
        """The step's micro-batch count is a multiple of this: DP (every rank the same count), times the
        interleaved schedule's group under vpp > 1 (`ParallelLayout.microbatch_multiple`)."""
        return self.layout.dp * self.layout.microbatch_multiple

    @property
    def count_multiple_reason(self) -> str:
        """What `count_multiple` gives, for error messages."""
        layout = self.layout
        if layout.vpp == 1:
            return f"{layout.dp} data-parallel ranks the same number of micro-batches"
        return (
            f"{layout.dp} data-parallel ranks the same number of micro-batches, a multiple of "
            f"microbatch_group_size_per_vp_stage={layout.microbatch_group} (the interleaved schedule at "
            f"vpp={layout.vpp}),"
        )

    def check_fits(
        self, lengths, *, forward_only: bool = False, key: str | None = None, fix: str = "split or drop them upstream"
    ) -> None:
        """Raise ValueError when a (padded) sample is longer than one micro-batch holds.

        The one budget check: the planner calls it per batch, the trainer once on the whole data set
        (``key`` names its config key), the planning CLI on the file it reads. The message counts the
        samples that do not fit, names the longest and the smallest budget that holds it.
        """
        lengths = np.asarray(lengths, dtype=np.int64)
        capacity = self.row_capacity(forward_only)
        padded = self.padded_lengths(lengths)
        too_long = padded > capacity
        if not too_long.any():
            return
        name, budget = self.budget(forward_only)
        key = key or name
        i = int(np.argmax(padded))
        raise ValueError(
            f"{int(too_long.sum())} of {lengths.size} samples are longer than a micro-batch ({capacity} tokens = "
            f"{key} {budget} x cp {self.layout.cp}); the longest is sample {i} with {int(lengths[i])} tokens "
            f"({int(padded[i])} padded). Raise {key} to at least {-(-int(padded[i]) // self.layout.cp)}, raise cp, "
            f"or {fix}."
        )


def _section_fields(name: str, section: dict) -> dict:
    keys = section_keys(name)
    unknown = set(section) - keys
    if unknown:
        raise ValueError(f"Unknown key(s) {sorted(unknown)} in {name}; valid keys: {sorted(keys)}.")
    return {k: v for k, v in section.items() if k != "enabled" and v is not None}
