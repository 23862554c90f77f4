"""The CP partition rule: every token exactly once, TE's chunk rule, bad input."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest
import torch

from mcore_packing.thd import (
    PaddingRule,
    SequenceSample,
    bshd_partition_indices,
    build_packed_batch,
    slice_bshd_for_cp,
    slice_for_cp,
    thd_partition_indices,
)


def naive_partition(cu: list[int], cp: int, rank: int) -> list[int]:
    """Written from the rule's statement: cut each span into 2*cp chunks, keep chunks rank and 2cp-1-rank."""
    out = []
    for start, end in itertools.pairwise(cu):
        chunk = (end - start) // (2 * cp)
        chunks = [list(range(start + k * chunk, start + (k + 1) * chunk)) for k in range(2 * cp)]
        out += chunks[rank] + chunks[2 * cp - 1 - rank]
    return out


def test_hundreds_of_random_cases_cover_every_token_once():
    rng = np.random.default_rng(0)
    for _ in range(400):
        cp = int(rng.choice([1, 2, 3, 4, 8]))
        spans = (rng.integers(1, 12, size=int(rng.integers(1, 9))) * 2 * cp).tolist()
        cu = [0, *np.cumsum(spans).tolist()]
        parts = [thd_partition_indices(cu, cu[-1], cp, r) for r in range(cp)]
        union = torch.cat(parts).sort().values
        assert torch.equal(union, torch.arange(cu[-1]))
        assert len({p.numel() for p in parts}) == 1  # equal share per rank
        for r in range(cp):
            assert parts[r].tolist() == naive_partition(cu, cp, r)


def test_causal_work_is_balanced_across_ranks():
    # Work of a token at position p within its sequence is p + 1 keys: equal sum on every rank.
    cu = [0, 16, 48, 56]
    cp = 4
    positions = np.concatenate([np.arange(b - a) for a, b in itertools.pairwise(cu)])
    work = [int((positions[thd_partition_indices(cu, cu[-1], cp, r).numpy()] + 1).sum()) for r in range(cp)]
    assert len(set(work)) == 1, work


def test_docstring_example():
    assert thd_partition_indices([0, 8, 12], 12, 2, 0).tolist() == [0, 1, 6, 7, 8, 11]
    assert thd_partition_indices([0, 8, 12], 12, 2, 1).tolist() == [2, 3, 4, 5, 9, 10]


@pytest.mark.parametrize(
    "cu, total, cp, rank, fragment",
    [
        ([0, 6, 12], 12, 2, 0, "not divisible by 2*cp_size = 4"),
        ([1, 8], 8, 2, 0, "must start at 0"),
        ([0, 8, 8], 8, 2, 0, "strictly increasing"),
        ([0, 8, 4], 8, 2, 0, "strictly increasing"),
        ([0, 8, 16], 20, 2, 0, "past the last padded boundary 16"),
        ([0, 8, 16], 12, 2, 0, "short of the last padded boundary"),
        ([0, 8], 8, 2, 2, "cp_rank = 2 is out of range"),
        ([0, 8], 8, 2, -1, "out of range"),
        ([0, 8], 8, 0, 0, "cp_size must be an integer >= 1"),
        ([0.0, 8.0], 8, 2, 0, "1-D integer array"),
    ],
)
def test_bad_input(cu, total, cp, rank, fragment):
    with pytest.raises(ValueError) as err:
        thd_partition_indices(cu, total, cp, rank)
    assert fragment in str(err.value)


def test_slice_for_cp_keeps_global_cu_seqlens_and_refuses_double_slicing():
    b = build_packed_batch(
        [SequenceSample(torch.arange(1, 8)), SequenceSample(torch.arange(9, 12))], PaddingRule(cp_size=2)
    )
    local = slice_for_cp(b, 2, 1)
    assert local.tokens.shape == (1, b.total_tokens // 2)
    assert torch.equal(local.cu_seqlens_padded, b.cu_seqlens_padded)
    assert (
        local.tokens[0].tolist()
        == b.tokens[0, thd_partition_indices(b.cu_seqlens_padded, b.total_tokens, 2, 1)].tolist()
    )
    with pytest.raises(ValueError, match="already a CP shard"):
        slice_for_cp(local, 2, 0)
    with pytest.raises(ValueError, match="not divisible"):
        slice_for_cp(build_packed_batch([SequenceSample([1, 2, 3])]), 2, 0)
    truncated = dataclasses.replace(b, tokens=b.tokens[:, :-4])
    with pytest.raises(ValueError, match="tokens but its cu_seqlens_padded ends at"):
        slice_for_cp(truncated, 2, 0)


def test_bshd_partition():
    assert bshd_partition_indices(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert bshd_partition_indices(8, 2, 1).tolist() == [2, 3, 4, 5]
    x = torch.arange(24).reshape(2, 12)
    parts = [slice_bshd_for_cp(x, 3, r, seq_dim=1) for r in range(3)]
    assert torch.equal(torch.cat(parts, dim=1).sort(dim=1).values, x)
    with pytest.raises(ValueError, match="not divisible by 2\\*cp_size = 6"):
        bshd_partition_indices(10, 3, 0)


def test_bshd_inverse_order_by_arithmetic_inverts_the_rank_ordered_shards():
    """The index computed on the device (no host data) puts the concatenated shards back in order."""
    from mcore_packing.thd.context_parallel import bshd_inverse_order, bshd_partition_indices

    for cp, seq_len in itertools.product((1, 2, 3, 4), (12, 24, 48)):
        if seq_len % (2 * cp):
            continue
        concatenated = torch.cat([bshd_partition_indices(seq_len, cp, r) for r in range(cp)])
        assert torch.equal(concatenated[bshd_inverse_order(seq_len, cp)], torch.arange(seq_len)), (cp, seq_len)
    with pytest.raises(ValueError, match="not divisible by 2\\*cp_size = 4"):
        bshd_inverse_order(6, 2)
