"""The THD micro-batch builder: layout, labels, masks, padding rule, unpacking, bad input."""

from __future__ import annotations

import pytest
import torch

from mcore_packing.planning import fp8_row_alignment
from mcore_packing.thd import PaddingRule, SequenceSample, build_packed_batch, samples_from_padded, slice_for_cp, unpack


def test_docstring_worked_example():
    rule = PaddingRule(cp_size=2, tp_size=2, sequence_parallel=True)
    assert rule.sequence_multiple == 4 and rule.total_multiple == 4
    seqs = [torch.arange(10, 15), torch.arange(20, 23), torch.arange(30, 38)]
    b = build_packed_batch([SequenceSample(s) for s in seqs], rule)
    assert b.padded_lengths == (8, 4, 8) and b.total_tokens == 20
    assert b.cu_seqlens.tolist() == [0, 5, 8, 16] and b.cu_seqlens.dtype == torch.int32
    assert b.cu_seqlens_padded.tolist() == [0, 8, 12, 20] and b.cu_seqlens_padded.dtype == torch.int32
    assert b.max_seqlen == 8
    assert b.position_ids[0].tolist() == [*range(8), *range(4), *range(8)]
    assert b.tokens[0, :8].tolist() == [10, 11, 12, 13, 14, 0, 0, 0]
    # Labels: next token of the same sequence; never the first token of the next sequence.
    assert b.labels[0, :8].tolist() == [11, 12, 13, 14, 0, 0, 0, 0]
    assert b.loss_mask[0, :8].tolist() == [1, 1, 1, 1, 0, 0, 0, 0]
    assert b.labels[0, 8:12].tolist() == [21, 22, 0, 0]
    assert b.loss_mask[0].sum().item() == (5 - 1) + (3 - 1) + (8 - 1)


@pytest.mark.parametrize(
    "kwargs, seq_multiple, total_multiple",
    [
        ({}, 1, 1),
        ({"cp_size": 2}, 4, 4),
        ({"cp_size": 4}, 8, 8),
        ({"tp_size": 4, "sequence_parallel": True}, 1, 4),
        ({"tp_size": 4}, 1, 1),  # TP without SP does not split the token dimension
        ({"cp_size": 2, "tp_size": 4, "sequence_parallel": True}, 4, 8),  # CP*lcm(2,TP), not 2*CP*TP
        ({"cp_size": 2, "tp_size": 3, "sequence_parallel": True}, 4, 12),
        ({"cp_size": 2, "fp8_alignment": 16}, 4, 32),  # FP8 aligns each CP rank's share, not each sequence
        ({"sequence_length_round": 64, "fp8_alignment": 16}, 64, 64),
        ({"tp_size": 2, "fp8_alignment": 32}, 1, 32),  # without SP every TP rank holds the whole row
        ({"cp_size": 2, "tp_size": 2, "sequence_parallel": True, "fp8_alignment": 128}, 4, 512),
    ],
)
def test_padding_rule(kwargs, seq_multiple, total_multiple):
    rule = PaddingRule(**kwargs)
    assert rule.sequence_multiple == seq_multiple
    assert rule.total_multiple == total_multiple


@pytest.mark.parametrize("cp, tp, sp", [(1, 1, False), (2, 1, False), (2, 2, True), (4, 2, True), (1, 4, True)])
def test_every_layout_is_splittable(cp, tp, sp):
    rule = PaddingRule(cp_size=cp, tp_size=tp, sequence_parallel=sp)
    g = torch.Generator().manual_seed(cp * 10 + tp)
    for _ in range(30):
        lengths = torch.randint(1, 40, (int(torch.randint(1, 6, (1,), generator=g)),), generator=g).tolist()
        b = build_packed_batch([SequenceSample(torch.ones(n, dtype=torch.long)) for n in lengths], rule)
        assert all(p % (2 * cp if cp > 1 else 1) == 0 for p in b.padded_lengths)
        assert (b.total_tokens // cp) % (tp if sp else 1) == 0
        assert b.total_tokens == b.cu_seqlens_padded[-1].item()  # no token past the last padded boundary


@pytest.mark.parametrize("recipe", ["tensorwise", "mxfp8", "blockwise"])
@pytest.mark.parametrize("cp, tp, sp", [(1, 1, False), (2, 1, False), (2, 2, True), (1, 4, True)])
def test_fp8_pads_the_row_once_and_every_rank_share_is_aligned(recipe, cp, tp, sp):
    """Each rank's share of the row (after the CP split, and over TP under SP) divides by the recipe's
    alignment; the sequences keep CP's padding only; every token is in its place once; the extra tail
    is in the last span and learns nothing."""
    alignment = fp8_row_alignment(recipe)
    rule = PaddingRule(cp_size=cp, tp_size=tp, sequence_parallel=sp, fp8_alignment=alignment)
    without = PaddingRule(cp_size=cp, tp_size=tp, sequence_parallel=sp)
    g = torch.Generator().manual_seed(cp * 10 + tp + alignment)
    for _ in range(20):
        lengths = torch.randint(1, 300, (int(torch.randint(1, 7, (1,), generator=g)),), generator=g).tolist()
        samples = [SequenceSample(torch.randint(1, 99, (n,), generator=g)) for n in lengths]
        b, plain = build_packed_batch(samples, rule), build_packed_batch(samples, without)
        for rank in range(cp):
            local = slice_for_cp(b, cp, rank)
            assert local.tokens.shape[1] % (alignment * (tp if sp else 1)) == 0, (lengths, rank)
        assert b.padded_lengths[:-1] == plain.padded_lengths[:-1]  # no sequence padded for FP8
        tail = b.total_tokens - plain.total_tokens
        assert 0 <= tail < rule.total_multiple
        assert b.tokens[0, : plain.total_tokens].tolist() == plain.tokens[0].tolist()
        assert b.loss_mask.sum() == plain.loss_mask.sum() and b.loss_mask[0, plain.total_tokens :].sum() == 0
        assert b.seq_lengths == tuple(lengths) and b.cu_seqlens.tolist() == plain.cu_seqlens.tolist()


def test_fp8_recipe_names():
    assert [fp8_row_alignment(r) for r in (None, "tensorwise", "delayed", "mxfp8", "blockwise")] == [1, 16, 16, 32, 128]
    with pytest.raises(ValueError, match=r"fp8_recipe='e4m3' is not one of \['blockwise', 'delayed'"):
        fp8_row_alignment("e4m3")


def test_loss_mask_of_sample_is_shifted_to_the_predicting_position():
    # Prompt (3 tokens, not learned) + response (2 tokens, learned).
    s = SequenceSample([5, 6, 7, 8, 9], loss_mask=[0, 0, 0, 1, 1])
    b = build_packed_batch([s])
    assert b.labels[0].tolist() == [6, 7, 8, 9, 0]
    assert b.loss_mask[0].tolist() == [0, 0, 1, 1, 0]  # position j learns token j+1


def test_pad_to_fixed_length_extends_the_last_span():
    b = build_packed_batch([SequenceSample([1, 2, 3]), SequenceSample([4])], PaddingRule(cp_size=2), pad_to=16)
    assert b.total_tokens == 16 and b.padded_lengths == (4, 12)
    assert b.cu_seqlens_padded.tolist() == [0, 4, 16]
    with pytest.raises(ValueError, match="pad_to=6 cannot hold"):
        build_packed_batch([SequenceSample([1, 2, 3]), SequenceSample([4])], PaddingRule(cp_size=2), pad_to=6)
    with pytest.raises(ValueError, match="multiple of 4"):
        build_packed_batch([SequenceSample([1, 2, 3])], PaddingRule(cp_size=2), pad_to=10)


def test_length_one_sequence_has_no_target():
    b = build_packed_batch([SequenceSample([7]), SequenceSample([8, 9])])
    assert b.loss_mask[0].tolist() == [0, 1, 0]
    assert b.labels[0].tolist() == [0, 9, 0]


def test_unpack_restores_every_token_in_place_and_zeros_padding():
    seqs = [torch.arange(1, 6), torch.arange(10, 12), torch.arange(20, 29)]
    b = build_packed_batch([SequenceSample(s) for s in seqs], PaddingRule(cp_size=2), sample_ids=[7, 3, 5])
    out = unpack(b.tokens[0], b)
    assert out.shape == (3, 9)
    for i, s in enumerate(seqs):
        assert out[i, : s.numel()].tolist() == s.tolist()
        assert out[i, s.numel() :].abs().sum() == 0
    assert b.sample_ids == (7, 3, 5)
    feats = torch.randn(b.total_tokens, 4)
    assert unpack(feats[None], b).shape == (3, 9, 4)
    with pytest.raises(ValueError, match="gather context-parallel shards"):
        unpack(feats[:10], b)


def test_samples_from_padded_batch():
    tokens = torch.tensor([[1, 2, 3, 0], [4, 0, 0, 0]])
    samples = samples_from_padded(tokens, [3, 1])
    b = build_packed_batch(samples)
    assert b.tokens[0].tolist() == [1, 2, 3, 4]
    with pytest.raises(ValueError, match=r"lengths\[1\] = 5 is outside \[1, 4\]"):
        samples_from_padded(tokens, [3, 5])
    with pytest.raises(ValueError, match="lengths has 1 entries"):
        samples_from_padded(tokens, [3])


@pytest.mark.parametrize(
    "samples, kwargs, fragment",
    [
        ([], {}, "at least one sample"),
        ([SequenceSample([])], {}, "has no tokens"),
        ([SequenceSample([1.5, 2.0])], {}, "must be integer token ids"),
        ([SequenceSample([1, 2], loss_mask=[1])], {}, "loss_mask has 1 entries for 2 tokens"),
        ([SequenceSample([1, 2])], {"sample_ids": [1, 2]}, "sample_ids has 2 entries for 1 samples"),
    ],
)
def test_bad_samples(samples, kwargs, fragment):
    with pytest.raises(ValueError, match=None) as err:
        build_packed_batch(samples, **kwargs)
    assert fragment in str(err.value)


@pytest.mark.parametrize("field", ["cp_size", "tp_size", "sequence_length_round", "fp8_alignment"])
def test_bad_padding_rule(field):
    with pytest.raises(ValueError, match=f"PaddingRule.{field}"):
        PaddingRule(**{field: 0})
