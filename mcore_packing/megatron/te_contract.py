"""TransformerEngine's packed-THD contract: what TE reads from a ``PackedSeqParams``, decided in one place
(`te_thd_fields`) and checked (`check_te_contract`) for every megatron-core and TE version we support.

What TE's ``DotProductAttention`` reads of a THD micro-batch: ``cu_seqlens_q/kv`` (int32, contiguous,
the real lengths), ``cu_seqlens_q/kv_padded`` (the padded spans; under CP each a multiple of 2 x CP, the
last ending at the row's end), ``max_seqlen_q/kv`` (the longest padded span; TE's CP path divides it by
the CP size), ``cp_group`` / ``local_cp_size`` (the micro-batch's CP group, per micro-batch) and
``pad_between_seqs``: whether any sequence has padding after its real tokens. That flag picks TE's path:
under CP, TE's P2P attention counts each rank's real tokens as ``cu_seqlens // cp`` when it is False, which
is right only when no sequence is padded (a 5-token sequence padded to 8 at CP2: rank 1 holds 3 real
tokens, ``5 // 2`` says 2), and from the padded offsets when it is True.

Who sets the flag, read from the sources (TransformerEngine's
``pytorch/attention/dot_product_attention/dot_product_attention.py``, megatron-core's
``extensions/transformer_engine.py`` and ``packed_seq_params.py``):

| TransformerEngine | flag argument | when the caller passes none, TE infers                               |
|---|---|---|
| 2.0 - 2.1         | none          | ``not equal(cu_padded[:-1], cu[:-1])`` (q or kv): the last entry ignored |
| 2.2 - 2.17        | yes           | the same rule                                                        |
| 2.18 and later    | yes           | True unless the padded tensors are the very objects ``cu_seqlens_*`` |

| megatron-core | ``PackedSeqParams`` fields TE sees | the flag reaches TE |
|---|---|---|
| 0.16          | cu_seqlens*, max_seqlen*, cp_group, local_cp_size            | never (no field)    |
| 0.17, 0.18    | + total_tokens, seq_idx (not forwarded to TE)                 | never (no field)    |
| 0.19          | + tokens_per_sample (not forwarded), pad_between_seqs         | with TE >= 2.2      |

So where the flag does not reach TE and only the last sequence of a row is padded (every row of one
sequence: the long sequences CP exists for, every row dynamic CP puts alone on its ranks), the "last
entry ignored" rule reads "no padding". `te_thd_fields` then appends one zero-length sequence to both
cu_seqlens (the form fixed-shape rows already have): the former last entries now differ, TE infers
True, and a sequence with no token changes nothing (tested). Where the flag reaches TE it is passed as
the truth. A row without padding passes the padded cu_seqlens as the same tensor as the real ones, so
TE 2.18+ infers False too and keeps FlashAttention eligible.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise

import torch

__all__ = [
    "MEGATRON_PACKED_FIELDS",
    "TE_PAD_RULES",
    "PadRule",
    "TeThdFields",
    "check_te_contract",
    "pad_flag_reaches_te",
    "te_inferred_pad_between_seqs",
    "te_pad_rule",
    "te_thd_fields",
]


@dataclass(frozen=True)
class PadRule:
    """How a range of TransformerEngine releases gets ``pad_between_seqs`` for THD: ``takes_flag`` (the
    forward has the argument) and ``infer`` ("all_but_last": compare cu_seqlens without their last
    entry; "identity": True unless the padded tensors are the real ones)."""

    versions: str
    first: tuple[int, int]
    takes_flag: bool
    infer: str


TE_PAD_RULES = (
    PadRule("2.0-2.1", (2, 0), takes_flag=False, infer="all_but_last"),
    PadRule("2.2-2.17", (2, 2), takes_flag=True, infer="all_but_last"),
    PadRule("2.18+", (2, 18), takes_flag=True, infer="identity"),
)
"""Read from TransformerEngine's tags v2.0 .. v2.18 (``DotProductAttention.forward``)."""

_BASE = frozenset({"qkv_format", "cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded",
                   "max_seqlen_q", "max_seqlen_kv", "local_cp_size", "cp_group"})  # fmt: skip
MEGATRON_PACKED_FIELDS = {
    "0.16": _BASE,
    "0.17": _BASE | {"total_tokens", "seq_idx"},
    "0.18": _BASE | {"total_tokens", "seq_idx"},
    "0.19": _BASE | {"total_tokens", "seq_idx", "tokens_per_sample", "pad_between_seqs"},
}
"""``PackedSeqParams``' fields per megatron-core release (read from the core_v0.16.1 .. core_v0.19.0 tags)."""

_MEGATRON_FLAG_MIN_TE = (2, 2)  # 0.19's TEDotProductAttention drops pad_between_seqs for TE < 2.2


def _version_tuple(version: str) -> tuple[int, int]:
    parts = []
    for piece in str(version).split(".")[:2]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits or 0))
    major, minor = [*parts, 0, 0][:2]
    return major, minor


def te_pad_rule(te_version: str) -> PadRule:
    """The `PadRule` of a TransformerEngine version (2.0 or later)."""
    version = _version_tuple(te_version)
    if version < TE_PAD_RULES[0].first:
        raise ValueError(f"TransformerEngine {te_version} is older than 2.0, which mcore_packing supports.")
    return [rule for rule in TE_PAD_RULES if version >= rule.first][-1]


def pad_flag_reaches_te(fields: frozenset | set, te_version: str | None) -> bool:
    """Whether a ``pad_between_seqs`` set on ``PackedSeqParams`` (``fields``: the release's fields)
    reaches TE's attention. Without TE (``te_version`` None) only the field counts: nothing else reads it."""
    if "pad_between_seqs" not in fields:
        return False
    return te_version is None or _version_tuple(te_version) >= _MEGATRON_FLAG_MIN_TE


def te_inferred_pad_between_seqs(rule: PadRule, cu: torch.Tensor, cu_padded: torch.Tensor | None,
                                 passed: bool | None) -> bool:  # fmt: skip
    """The ``pad_between_seqs`` TE's attention uses under ``rule``, given what reached it (``passed``:
    the flag Megatron forwarded, None when it forwarded none)."""
    if passed is not None and rule.takes_flag:
        return bool(passed)
    if cu_padded is None:
        return False
    if rule.infer == "identity":
        return cu_padded is not cu
    return not torch.equal(cu_padded[:-1], cu[:-1])


@dataclass(frozen=True)
class TeThdFields:
    """The host-side THD fields of one packed row, as TE must read them. ``cu_seqlens_padded`` is the
    very tensor ``cu_seqlens`` when no sequence is padded. ``pad_between_seqs`` is the truth;
    ``pass_flag`` says whether to set it on ``PackedSeqParams`` (the release has the field)."""

    cu_seqlens: torch.Tensor
    cu_seqlens_padded: torch.Tensor
    max_seqlen: int
    pad_between_seqs: bool
    pass_flag: bool
    zero_length_entries: int

    def tensors(self) -> dict:
        """The host tensors to move to the device (the padded one only when it is its own tensor)."""
        out = {"cu_seqlens": self.cu_seqlens}
        if self.cu_seqlens_padded is not self.cu_seqlens:
            out["cu_seqlens_padded"] = self.cu_seqlens_padded
        return out


def _cumulative(lengths: Sequence[int]) -> torch.Tensor:
    out = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    out[1:] = torch.tensor(list(lengths), dtype=torch.int64).cumsum(0).to(torch.int32)
    return out


def te_thd_fields(
    real_lengths: Sequence[int],
    padded_lengths: Sequence[int],
    *,
    cp_size: int = 1,
    fields: frozenset | set,
    te_version: str | None = None,
    cu_entries: int | None = None,
) -> TeThdFields:
    """The THD fields of a row of sequences (``real_lengths``, each in a span of ``padded_lengths``) for
    a ``PackedSeqParams`` of a release with ``fields``, read by TE ``te_version`` (None: TE absent).
    ``cu_entries``: a fixed number of cu_seqlens entries (fixed shapes, CUDA graphs), the rest zero-length
    sequences. Raises ValueError on a span that TE's CP split cannot take."""
    real, padded = [int(n) for n in real_lengths], [int(n) for n in padded_lengths]
    if len(real) != len(padded) or not real:
        raise ValueError(f"{len(real)} real lengths for {len(padded)} padded spans; give one span per sequence.")
    for i, (n, span) in enumerate(zip(real, padded, strict=True)):
        if not 0 < n <= span:
            raise ValueError(f"sequence {i} has {n} tokens in a span of {span}; a span holds 1..span real tokens.")
        if cp_size > 1 and span % (2 * cp_size):
            raise ValueError(f"sequence {i}'s padded span {span} is not a multiple of 2 x CP = {2 * cp_size}; pad "
                             f"with PaddingRule(cp_size={cp_size}).")  # fmt: skip
    truth = real != padded
    cu, cu_padded = _cumulative(real), _cumulative(padded)
    needs_entry = truth and not pad_flag_reaches_te(fields, te_version) and torch.equal(cu[:-1], cu_padded[:-1])
    extra = int(needs_entry)  # only the last sequence is padded: a zero-length entry makes "all but last" see it
    if cu_entries is not None:
        if isinstance(cu_entries, bool) or not isinstance(cu_entries, int) or cu_entries < cu.numel():
            raise ValueError(
                f"cu_entries={cu_entries!r} cannot describe this row of {len(real)} sequences: it needs at least "
                f"{cu.numel()} entries. Use StepPlanConfig.cu_seqlens_entries(row_tokens), which bounds every row."
            )
        if cu_entries - cu.numel() < extra:
            raise ValueError(
                f"cu_entries={cu_entries} leaves no zero-length entry after this row of {len(real)} sequences, whose "
                "last alone is padded: TransformerEngine would read it as unpadded (see te_contract). Use "
                "StepPlanConfig.cu_seqlens_entries(row_tokens), which keeps one spare entry."
            )
        extra = cu_entries - cu.numel()
    if extra:
        cu = torch.cat([cu, cu[-1:].expand(extra)])
        cu_padded = torch.cat([cu_padded, cu_padded[-1:].expand(extra)])
    cu = cu.contiguous()
    cu_padded = cu_padded.contiguous() if truth else cu  # no padding: one tensor, so TE 2.18+ infers False too
    return TeThdFields(cu_seqlens=cu, cu_seqlens_padded=cu_padded, max_seqlen=max(padded), pad_between_seqs=truth,
                       pass_flag="pad_between_seqs" in fields, zero_length_entries=extra)  # fmt: skip


def check_te_contract(
    params, *, real_lengths: Sequence[int], padded_lengths: Sequence[int], cp_size: int, te_version: str,
    fields: frozenset | set,
) -> list[str]:  # fmt: skip
    """What TE ``te_version`` would read wrongly from ``params`` (a THD ``PackedSeqParams`` of a release
    with ``fields``) for a row of these sequences at ``cp_size``: an empty list when nothing. Checks the
    cu_seqlens dtypes, shapes and contiguity, the padded spans against 2 x CP, the zero-length entries
    (trailing only), ``max_seqlen``, ``local_cp_size`` against the group, and the ``pad_between_seqs`` TE
    infers under its rule against the truth."""
    problems = []
    real, padded = [int(n) for n in real_lengths], [int(n) for n in padded_lengths]
    cu, cu_padded = params.cu_seqlens_q, params.cu_seqlens_q_padded
    for name, t in (("cu_seqlens_q", cu), ("cu_seqlens_q_padded", cu_padded)):
        if t is None:
            problems.append(f"{name} is None")
            continue
        if t.dtype != torch.int32 or t.dim() != 1 or not t.is_contiguous():
            problems.append(f"{name} must be a contiguous 1-D int32 tensor, got {t.dtype} {tuple(t.shape)}")
    if params.cu_seqlens_kv is not cu or params.cu_seqlens_kv_padded is not cu_padded:
        problems.append("self-attention: the kv cu_seqlens must be the q ones")
    if problems:
        return problems
    host, host_padded = cu.cpu().tolist(), cu_padded.cpu().tolist()
    n = len(real)
    if len(host) != len(host_padded) or len(host) < n + 1:
        return [f"cu_seqlens have {len(host)} / {len(host_padded)} entries for {n} sequences"]
    lengths = [b - a for a, b in pairwise(host)]
    if lengths[:n] != real:
        problems.append(f"cu_seqlens_q {host} do not hold the real lengths {real}")
    spans = [b - a for a, b in pairwise(host_padded)]
    if spans[:n] != padded:
        problems.append(f"cu_seqlens_q_padded {host_padded} do not hold the padded spans {padded}")
    if any(spans[n:]) or any(lengths[n:]):
        problems.append("entries after the row's sequences must be zero-length")
    if cp_size > 1 and any(span % (2 * cp_size) for span in spans):
        problems.append(f"a padded span is not a multiple of 2 x CP = {2 * cp_size}: {spans}")
    if params.max_seqlen_q != max(padded) or params.max_seqlen_kv != params.max_seqlen_q:
        problems.append(f"max_seqlen {params.max_seqlen_q} is not the longest padded span {max(padded)}")
    group, local = getattr(params, "cp_group", None), getattr(params, "local_cp_size", None)
    if local is not None and local != (group.size() if group is not None else 1):
        problems.append(f"local_cp_size={local} but the cp_group has {group.size() if group else 1} ranks")
    truth = real != padded
    passed = getattr(params, "pad_between_seqs", None) if pad_flag_reaches_te(fields, te_version) else None
    inferred = te_inferred_pad_between_seqs(te_pad_rule(te_version), cu, cu_padded, passed)
    if inferred != truth:
        problems.append(f"TE {te_version} infers pad_between_seqs={inferred} but the row is "
                        f"{'padded' if truth else 'unpadded'} (real {real}, padded {padded})")  # fmt: skip
    return problems
