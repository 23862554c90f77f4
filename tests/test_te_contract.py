"""TransformerEngine's packed-THD contract (`megatron.te_contract`): for every megatron-core release we
support (its ``PackedSeqParams`` fields) and every TE rule for ``pad_between_seqs`` (written from TE's
source, tags v2.0 .. v2.18), what TE infers from the params we build equals the truth, for rows of one
sequence, tail-only padding, padding everywhere, no padding, fixed shapes and dynamic-CP rows (CP 1, 2, 4
in one step). TE itself cannot run here (no GPU): the rules are TE's code, re-stated. Negative control:
the params this project built before (0.16's fields, no zero-length entry) fail the check under TE
2.5-2.17 for a single padded sequence at CP2, the case the review found."""

from __future__ import annotations

import pytest
import torch

from mcore_packing.megatron.te_contract import (
    MEGATRON_PACKED_FIELDS,
    TE_PAD_RULES,
    check_te_contract,
    te_inferred_pad_between_seqs,
    te_pad_rule,
    te_thd_fields,
)

TE_VERSIONS = ("2.1", "2.5", "2.12", "2.17", "2.18", "2.20")  # one or more per rule
ROWS = {  # (real lengths, CP size): the padded spans follow the CP rule (a multiple of 2 x CP)
    "one sequence, padded": ([5], 2),
    "one sequence, unpadded": ([8], 2),
    "tail-only padding": ([8, 4, 5], 2),
    "padding everywhere": ([3, 9, 6], 2),
    "no padding at CP1": ([3, 9, 6], 1),
    "dynamic CP row of 4": ([13], 4),
    "dynamic CP row of 1": ([13, 7], 1),
}


class Params:
    """A ``PackedSeqParams`` of a release with ``fields``: the attributes our builder sets, read as TE reads
    them (Megatron forwards the fields it has)."""

    def __init__(self, fields, thd, cp_group=None):
        self.qkv_format = "thd"
        self.cu_seqlens_q = self.cu_seqlens_kv = thd.cu_seqlens
        self.cu_seqlens_q_padded = self.cu_seqlens_kv_padded = thd.cu_seqlens_padded
        self.max_seqlen_q = self.max_seqlen_kv = thd.max_seqlen
        self.cp_group, self.local_cp_size = cp_group, None if cp_group is None else cp_group.size()
        if thd.pass_flag:
            assert "pad_between_seqs" in fields
            self.pad_between_seqs = thd.pad_between_seqs


class Group:
    def __init__(self, size):
        self._size = size

    def size(self):
        return self._size


def _padded(real, cp):
    multiple = 2 * cp if cp > 1 else 1
    return [-(-n // multiple) * multiple for n in real]


@pytest.mark.parametrize("release", sorted(MEGATRON_PACKED_FIELDS))
@pytest.mark.parametrize("te_version", TE_VERSIONS)
@pytest.mark.parametrize("fixed_entries", [None, 6])
def test_te_infers_the_truth_for_every_release_and_rule(release, te_version, fixed_entries):
    fields = MEGATRON_PACKED_FIELDS[release]
    for name, (real, cp) in ROWS.items():
        padded = _padded(real, cp)
        thd = te_thd_fields(real, padded, cp_size=cp, fields=fields, te_version=te_version, cu_entries=fixed_entries)
        params = Params(fields, thd, Group(cp) if cp > 1 else None)
        problems = check_te_contract(params, real_lengths=real, padded_lengths=padded, cp_size=cp,
                                     te_version=te_version, fields=fields)  # fmt: skip
        assert problems == [], (release, te_version, name, problems)


def test_the_rules_read_from_te():
    assert [(r.versions, r.takes_flag, r.infer) for r in TE_PAD_RULES] == [
        ("2.0-2.1", False, "all_but_last"), ("2.2-2.17", True, "all_but_last"), ("2.18+", True, "identity")]
    assert te_pad_rule("2.17.1").versions == "2.2-2.17" and te_pad_rule("2.18.0rc1").versions == "2.18+"
    cu, padded = torch.tensor([0, 5], dtype=torch.int32), torch.tensor([0, 8], dtype=torch.int32)
    assert not te_inferred_pad_between_seqs(te_pad_rule("2.5"), cu, padded, None)  # the last entry is ignored
    assert te_inferred_pad_between_seqs(te_pad_rule("2.18"), cu, padded, None)  # another object: True
    assert not te_inferred_pad_between_seqs(te_pad_rule("2.18"), cu, cu, None)
    assert te_inferred_pad_between_seqs(te_pad_rule("2.5"), cu, cu, True)  # a flag that reaches TE wins
    assert not te_inferred_pad_between_seqs(te_pad_rule("2.1"), cu, cu, True)  # 2.0-2.1 take no flag


def test_the_zero_length_entry_appears_only_where_te_would_miss_the_padding():
    fields16, fields19 = MEGATRON_PACKED_FIELDS["0.16"], MEGATRON_PACKED_FIELDS["0.19"]
    single = te_thd_fields([5], [8], cp_size=2, fields=fields16, te_version="2.5")
    assert single.cu_seqlens.tolist() == [0, 5, 5] and single.cu_seqlens_padded.tolist() == [0, 8, 8]
    assert te_thd_fields([5], [8], cp_size=2, fields=fields19, te_version="2.5").cu_seqlens.tolist() == [0, 5]
    assert te_thd_fields([5], [8], cp_size=2, fields=fields19, te_version="2.1").zero_length_entries == 1
    everywhere = te_thd_fields([3, 5], [4, 8], cp_size=2, fields=fields16, te_version="2.5")
    assert everywhere.zero_length_entries == 0  # the first span's padding is in the compared entries
    unpadded = te_thd_fields([4, 8], [4, 8], cp_size=2, fields=fields16, te_version="2.18")
    assert unpadded.cu_seqlens_padded is unpadded.cu_seqlens and not unpadded.pad_between_seqs
    with pytest.raises(ValueError, match="leaves no zero-length entry"):
        te_thd_fields([4, 5], [4, 8], cp_size=2, fields=fields16, te_version="2.5", cu_entries=3)
    with pytest.raises(ValueError, match="not a multiple of 2 x CP = 4"):
        te_thd_fields([5], [6], cp_size=2, fields=fields16)


def test_the_installed_builder_keeps_the_contract(monkeypatch):
    """`to_packed_seq_params` with the installed megatron-core, as it builds with each TE version installed."""
    from mcore_packing.compat import packed_seq_params_fields
    from mcore_packing.megatron import packed_seq, to_packed_seq_params
    from mcore_packing.thd import PaddingRule, SequenceSample, build_packed_batch, slice_for_cp

    fields = packed_seq_params_fields()
    for te_version in TE_VERSIONS:
        monkeypatch.setattr(packed_seq, "te_version", lambda v=te_version: v)
        for real, cp in ROWS.values():
            batch = build_packed_batch([SequenceSample(list(range(n))) for n in real], PaddingRule(cp_size=cp))
            params = to_packed_seq_params(slice_for_cp(batch, cp, 0))
            problems = check_te_contract(params, real_lengths=batch.seq_lengths, padded_lengths=batch.padded_lengths,
                                         cp_size=cp, te_version=te_version, fields=fields)  # fmt: skip
            assert problems == [], (real, cp, te_version, problems)


def test_negative_control_the_old_016_params_fail_under_te_2_5():
    """The former builder: 0.16's fields, the padded cu_seqlens always their own tensor, no zero-length
    entry. A single 5-token sequence padded to 8 at CP2 reads as unpadded."""

    class Old:
        qkv_format, max_seqlen_q, max_seqlen_kv, cp_group, local_cp_size = "thd", 8, 8, None, None
        cu_seqlens_q = cu_seqlens_kv = torch.tensor([0, 5], dtype=torch.int32)
        cu_seqlens_q_padded = cu_seqlens_kv_padded = torch.tensor([0, 8], dtype=torch.int32)

    problems = check_te_contract(Old(), real_lengths=[5], padded_lengths=[8], cp_size=2, te_version="2.5",
                                 fields=MEGATRON_PACKED_FIELDS["0.16"])  # fmt: skip
    assert len(problems) == 1 and "infers pad_between_seqs=False but the row is padded" in problems[0]
    assert check_te_contract(Old(), real_lengths=[5], padded_lengths=[8], cp_size=2, te_version="2.18",
                             fields=MEGATRON_PACKED_FIELDS["0.16"]) == []  # fmt: skip
