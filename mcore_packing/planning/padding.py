"""How much each sequence and each packed row are padded, from the parallel layout (plain arithmetic).

Worked example: CP=2, TP=2 with sequence parallelism. Each sequence is cut into 2*CP equal chunks, so
``sequence_multiple`` = 4; each CP rank's T/CP tokens must split evenly over TP ranks, so the packed
row length T is a multiple of ``total_multiple`` = lcm(4, CP*TP) = 4. Lengths [5, 3, 8] pad to spans
[8, 4, 8]. Only the last span absorbs the row padding (`thd.build_packed_batch`), so sequence
parallelism never pads every sequence.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..validators import require_positive_int
from .layout import ParallelLayout

__all__ = ["PaddingRule"]


@dataclass(frozen=True, kw_only=True)
class PaddingRule:
    """How much each sequence and the whole packed row are padded (the layout's rules, `ParallelLayout`,
    plus the user's alignment). `for_layout` builds it from a layout.

    Attributes:
        cp_size: context-parallel size; > 1 cuts every sequence into 2*cp_size equal chunks.
        tp_size: tensor-parallel size.
        sequence_parallel: Megatron sequence parallelism (splits the packed row over TP ranks).
        sequence_length_round: extra per-sequence alignment (NeMo-RL's ``sequence_length_round``).
        fp8_alignment: per-sequence alignment for FP8 GEMMs (e.g. 16); 1 when FP8 is off.
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
        return self.layout.sequence_multiple * math.lcm(self.sequence_length_round, self.fp8_alignment)

    @property
    def total_multiple(self) -> int:
        """The packed row length T is a multiple of this (adds the layout's CP*TP when sequence parallel)."""
        return math.lcm(self.sequence_multiple, self.layout.row_multiple)

    def padded_length(self, length: int) -> int:
        m = self.sequence_multiple
        return -(-length // m) * m
