"""The bin-count refinement (`mcore_packing.packing._refine`): invariants, its subset sum, and its gain."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mcore_packing.data import sample_lengths
from mcore_packing.packing import _refine, get_packer


@pytest.fixture
def everything_movable(monkeypatch):
    # Small hypothesis capacities would leave nothing movable at capacity // 16; make every length movable
    # and the pass tiny so that all of its branches run on small cases.
    monkeypatch.setattr(_refine, "_THETA_DIVISOR", 1)
    monkeypatch.setattr(_refine, "_MAX_VICTIMS", 2)
    monkeypatch.setattr(_refine, "_WINDOW_MAX", 8)


@st.composite
def packing_cases(draw):
    capacity = draw(st.integers(1, 120))
    lengths = draw(st.lists(st.integers(1, capacity), min_size=0, max_size=120))
    return capacity, lengths


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=packing_cases(), algorithm=st.sampled_from(["ffd", "bfd", "mffd", "ffs"]))
def test_refinement_keeps_every_sequence_once_within_capacity_and_never_adds_bins(everything_movable, case, algorithm):
    capacity, lengths = case
    plain = get_packer(algorithm, capacity, seed=1, refine=False).pack(lengths)
    refined = get_packer(algorithm, capacity, seed=1, refine=True).pack(lengths)
    assert sorted(i for b in refined for i in b) == list(range(len(lengths)))
    assert all(b and sum(lengths[i] for i in b) <= capacity for b in refined)
    assert len(refined) <= len(plain)
    if len(refined) == len(plain):
        assert refined == plain  # a pass that removes nothing leaves the packing untouched
    assert refined == get_packer(algorithm, capacity, seed=1, refine=True).pack(lengths)  # deterministic


def brute_force_closest(counts: dict[int, int], target: int) -> int:
    """Largest achievable sum <= target by trying every count vector (tiny pools only)."""
    sizes = sorted(counts)
    best = 0
    for combo in itertools.product(*(range(counts[u] + 1) for u in sizes)):
        total = sum(k * u for k, u in zip(combo, sizes, strict=True))
        if total <= target:
            best = max(best, total)
    return best


@settings(max_examples=200, deadline=None)
@given(
    counts=st.dictionaries(st.integers(1, 40), st.integers(1, 4), min_size=1, max_size=5),
    target=st.integers(0, 150),
)
def test_closest_subset_sum_matches_brute_force(counts, target):
    lengths = np.repeat(np.asarray(list(counts), dtype=np.int64), list(counts.values()))
    pool = _refine._LengthPool(lengths, 64)
    chosen = _refine.closest_subset_sum(pool, target)
    assert all(0 < k <= counts[u] for u, k in chosen.items())
    assert sum(u * k for u, k in chosen.items()) == brute_force_closest(counts, target)


def test_negative_control_greedy_fill_is_not_the_closest_sum():
    # Longest-first greedy on {6, 4, 4} with room 8 takes 6 and stops at 6; the subset sum finds 4 + 4.
    # If the refinement only filled greedily, the brute-force comparison above would fail on such pools.
    pool = _refine._LengthPool(np.asarray([6, 4, 4]), 16)
    assert pool.longest_upto(8) == 6
    assert _refine.closest_subset_sum(pool, 8) == {4: 2}
    assert brute_force_closest({6: 1, 4: 2}, 8) == 8


def test_length_pool_queries_match_a_sorted_list():
    rng = np.random.default_rng(3)
    lengths = rng.integers(1, 500, size=300)
    pool = _refine._LengthPool(lengths, 500)
    present = sorted(set(lengths.tolist()))
    for r in [0, 1, 63, 64, 65, 127, 128, 250, 499, 500, 10_000]:
        below = [u for u in present if u <= r]
        assert pool.longest_upto(r) == (below[-1] if below else 0)
        assert list(pool.lengths_upto(r)) == below
    u = present[0]
    pool.take(u, pool.count[u])
    assert u not in list(pool.lengths_upto(500))
    pool.give(u, 1)
    assert pool.longest_upto(u) == u


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_refinement_reaches_one_bin_of_the_bound_where_plain_packers_do_not(seed):
    # Heavy tail with a floor (power law from 32 tokens), 100k sequences: plain FFD/BFD/MFFD end 3 bins over
    # ceil(sum/C) (the negative control: the bound check fails without the refinement), refined ones <= 1.
    capacity = 4096
    lengths = sample_lengths("power_law:32", 100_000, capacity, seed=seed)
    lower_bound = -(-int(lengths.sum()) // capacity)
    for algorithm in ["ffd", "bfd", "mffd"]:
        plain = get_packer(algorithm, capacity, refine=False).pack_bins(lengths)
        refined = get_packer(algorithm, capacity, refine=True).pack_bins(lengths)
        assert plain.num_bins - lower_bound >= 2
        assert refined.num_bins - lower_bound <= 1
        assert np.array_equal(np.sort(refined.indices), np.arange(lengths.size))
        assert refined.tokens_per_bin(lengths).max() <= capacity


def test_refine_defaults_and_errors():
    assert get_packer("mffd", 100).refine is True
    assert get_packer("ffd", 100).refine is False
    assert get_packer("bfd", 100).refine is False
    assert get_packer("ffd", 100, refine=True).refine is True
    with pytest.raises(ValueError, match="concatenative"):
        get_packer("concatenative", 100, refine=True)
    with pytest.raises(ValueError, match="refine must be True, False or None"):
        get_packer("mffd", 100, refine="yes")
