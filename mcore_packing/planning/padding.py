"""How much each sequence and each packed row are padded, from the parallel layout (plain arithmetic).

Worked example: CP=2, TP=2 with sequence parallelism. Each sequence is cut into 2*CP equal chunks, so
``sequence_multiple`` = 4; each CP rank's T/CP tokens must split evenly over TP ranks, so the packed
row length T is a multiple of ``total_multiple`` = lcm(4, CP*TP) = 4. Lengths [5, 3, 8] pad to spans
[8, 4, 8]. Only the last span absorbs the row padding (`thd.build_packed_batch`), so sequence
parallelism never pads every sequence.

FP8 is a row rule too. An FP8 GEMM multiplies all of a rank's tokens at once, so what its recipe needs
aligned (`FP8_ROW_ALIGNMENT`: 16 tokens tensor-wise or delayed, 32 MXFP8, 128 block-wise) is each rank's
share of the row: T / CP, and T / (CP * TP) under sequence parallelism (TransformerEngine quantizes the
shard before its all-gather). The row is padded once at its tail to make that so; no sequence is padded
for FP8. With CP=2, TP=2, SP and block-wise FP8 the row is a multiple of lcm(4, 4, 128 * 4) = 512, and
every span stays a multiple of 4.

Dynamic batching's padded BSHD rows pad each sequence to ``total_multiple`` instead (a row is one
sequence: its CP shard splits over TP ranks), and a micro-batch of them costs its rows times the widest
(`micro_batch_tokens`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..validators import require_positive_int
from .layout import ParallelLayout

__all__ = ["FP8_ROW_ALIGNMENT", "PaddingRule", "fp8_row_alignment", "micro_batch_tokens"]

FP8_ROW_ALIGNMENT = {"tensorwise": 16, "delayed": 16, "mxfp8": 32, "blockwise": 128}
"""Tokens per rank that each FP8 recipe (Megatron's ``fp8_recipe`` names) needs the row's share to divide by."""


def fp8_row_alignment(recipe: str | None) -> int:
    """`FP8_ROW_ALIGNMENT` of ``recipe``; 1 for None (no FP8). An unknown name raises, naming the choices."""
    if recipe is None:
        return 1
    if recipe not in FP8_ROW_ALIGNMENT:
        raise ValueError(f"fp8_recipe={recipe!r} is not one of {sorted(FP8_ROW_ALIGNMENT)} (or null for no FP8).")
    return FP8_ROW_ALIGNMENT[recipe]


@dataclass(frozen=True, kw_only=True)
class PaddingRule:
    """How much each sequence and the whole packed row are padded (the layout's rules, `ParallelLayout`,
    plus the user's alignment). `for_layout` builds it from a layout.

    Attributes:
        cp_size: context-parallel size; > 1 cuts every sequence into 2*cp_size equal chunks.
        tp_size: tensor-parallel size.
        sequence_parallel: Megatron sequence parallelism (splits the packed row over TP ranks).
        sequence_length_round: extra per-sequence alignment (NeMo-RL's ``sequence_length_round``).
        fp8_alignment: tokens each rank's share of a row must divide by for FP8 GEMMs
            (`FP8_ROW_ALIGNMENT`); 1 when FP8 is off. A row rule: it pads the row's tail, not each sequence.
    """

    cp_size: int = 1
    tp_size: int = 1
    sequence_parallel: bool = False
    sequence_length_round: int = 1
    fp8_alignment: int = 1

    def __post_init__(self):
        for name in ("cp_size", "tp_size", "sequence_length_round", "fp8_alignment"):
            require_positive_int(f"PaddingRule.{name}", getattr(self, name))

    @classmethod
    def for_layout(cls, layout: ParallelLayout, *, sequence_length_round: int = 1, fp8_alignment: int = 1):
        return cls(cp_size=layout.cp, tp_size=layout.tp, sequence_parallel=layout.sequence_parallel,
                   sequence_length_round=sequence_length_round, fp8_alignment=fp8_alignment)  # fmt: skip

    @property
    def layout(self) -> ParallelLayout:
        """The layout whose rules apply (sequence parallelism only counts with TP > 1)."""
        sp = self.sequence_parallel and self.tp_size > 1
        return ParallelLayout(cp=self.cp_size, tp=self.tp_size, sequence_parallel=sp)

    @property
    def sequence_multiple(self) -> int:
        """Every padded span is a multiple of this: the layout's (2*CP under CP) times the user alignment."""
        return self.layout.sequence_multiple * self.sequence_length_round

    @property
    def row_shards(self) -> int:
        """How many ranks split one row: CP, times TP under sequence parallelism."""
        layout = self.layout
        return layout.cp * (layout.tp if layout.sequence_parallel else 1)

    @property
    def total_multiple(self) -> int:
        """The packed row length T is a multiple of this: the span multiple, the layout's CP*TP when sequence
        parallel, and FP8's alignment for every rank's share (``fp8_alignment * row_shards``)."""
        return math.lcm(self.sequence_multiple, self.layout.row_multiple, self.fp8_alignment * self.row_shards)

    def padded_length(self, length: int) -> int:
        m = self.sequence_multiple
        return -(-length // m) * m

    def length_multiple(self, mode: str) -> int:
        """What each sequence is padded to: the THD span multiple in ``packing`` mode, else the BSHD row
        multiple (sequence parallelism splits each row's CP shard over TP ranks)."""
        return self.sequence_multiple if mode == "packing" else self.total_multiple


def micro_batch_tokens(padded_lengths, mode: str) -> int:
    """Tokens of one micro-batch of these padded lengths: their sum in ``packing`` mode (a THD row holds
    them end to end), else their count times the longest (BSHD rows padded to the widest)."""
    lengths = [int(n) for n in padded_lengths]
    if not lengths:
        return 0
    return sum(lengths) if mode == "packing" else max(lengths) * len(lengths)
