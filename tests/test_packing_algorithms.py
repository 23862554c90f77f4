"""The packers against independent references and their invariants (hypothesis property tests)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mcore_packing.packing import PackingAlgorithm, get_packer, required_bin_count

from .packing_reference import reference_decreasing_fit, reference_first_fit, reference_next_fit

ALGORITHMS = [a.value for a in PackingAlgorithm]


@st.composite
def packing_cases(draw, max_n=120):
    capacity = draw(st.integers(1, 300))
    lengths = draw(st.lists(st.integers(1, capacity), min_size=0, max_size=max_n))
    return capacity, lengths


def check_valid(bins, lengths, capacity):
    flat = sorted(i for b in bins for i in b)
    assert flat == list(range(len(lengths))), "every index must appear exactly once"
    assert all(len(b) > 0 for b in bins), "no empty bin"
    assert all(sum(lengths[i] for i in b) <= capacity for b in bins), "no bin over capacity"


@settings(max_examples=150, deadline=None)
@given(packing_cases(), st.sampled_from(ALGORITHMS), st.integers(0, 2**31))
def test_every_index_once_and_no_bin_over_capacity(case, algorithm, seed):
    capacity, lengths = case
    bins = get_packer(algorithm, capacity, seed=seed).pack(lengths)
    check_valid(bins, lengths, capacity)


@settings(max_examples=200, deadline=None)
@given(packing_cases())
def test_ffd_equals_reference(case):
    capacity, lengths = case
    assert get_packer("first_fit_decreasing", capacity).pack(lengths) == reference_decreasing_fit(
        lengths, capacity, best_fit=False
    )


@settings(max_examples=200, deadline=None)
@given(packing_cases())
def test_bfd_equals_reference(case):
    capacity, lengths = case
    assert get_packer("best_fit_decreasing", capacity).pack(lengths) == reference_decreasing_fit(
        lengths, capacity, best_fit=True
    )


@settings(max_examples=100, deadline=None)
@given(packing_cases())
def test_concatenative_keeps_input_order(case):
    capacity, lengths = case
    bins = get_packer("concatenative", capacity).pack(lengths)
    assert bins == reference_next_fit(lengths, capacity)
    assert [i for b in bins for i in b] == list(range(len(lengths)))


@settings(max_examples=100, deadline=None)
@given(packing_cases(), st.integers(0, 2**31))
def test_first_fit_shuffle_is_first_fit_over_its_permutation(case, seed):
    capacity, lengths = case
    bins = get_packer("first_fit_shuffle", capacity, seed=seed).pack(lengths)
    order = np.random.default_rng(seed).permutation(len(lengths)).tolist()
    assert bins == reference_first_fit(order, lengths, capacity)


@settings(max_examples=60, deadline=None)
@given(packing_cases(), st.sampled_from(ALGORITHMS), st.integers(0, 1000))
def test_same_seed_same_bins(case, algorithm, seed):
    capacity, lengths = case
    first = get_packer(algorithm, capacity, seed=seed).pack(lengths)
    again = get_packer(algorithm, capacity, seed=seed).pack(list(lengths))
    assert first == again


def test_shuffle_seed_changes_bins_and_ignores_global_rng():
    lengths = list(range(1, 200))
    a = get_packer("first_fit_shuffle", 400, seed=1).pack(lengths)
    np.random.seed(123)
    b = get_packer("first_fit_shuffle", 400, seed=1).pack(lengths)
    c = get_packer("first_fit_shuffle", 400, seed=2).pack(lengths)
    assert a == b
    assert a != c


@settings(max_examples=150, deadline=None)
@given(
    packing_cases(max_n=60),
    st.sampled_from(ALGORITHMS),
    st.one_of(st.none(), st.integers(1, 40)),
    st.one_of(st.none(), st.integers(1, 9)),
)
def test_bin_count_constraints_exact(case, algorithm, min_bin_count, multiple):
    capacity, lengths = case
    packer = get_packer(algorithm, capacity, min_bin_count=min_bin_count, bin_count_multiple=multiple, seed=0)
    unconstrained = len(get_packer(algorithm, capacity, seed=0).pack(lengths))
    target = required_bin_count(unconstrained, min_bin_count, multiple)
    if len(lengths) < target:
        with pytest.raises(ValueError, match=f"Cannot create {target} bins with only {len(lengths)} sequences"):
            packer.pack(lengths)
        return
    bins = packer.pack(lengths)
    check_valid(bins, lengths, capacity)
    assert len(bins) == target
    if lengths:
        assert len(bins) >= (min_bin_count or 0)
        assert len(bins) % (multiple or 1) == 0


def test_constraint_splits_the_fullest_bins():
    # Two full bins and one light bin; forcing 4 bins must split a full bin, not the light one.
    lengths = [50, 50, 50, 50, 10]
    bins = get_packer("ffd", 100, min_bin_count=4).pack(lengths)
    assert len(bins) == 4
    assert sorted(sum(lengths[i] for i in b) for b in bins) == [10, 50, 50, 100]


def test_constraint_error_message_matches_nemo_rl():
    with pytest.raises(ValueError, match="Cannot create 4 bins with only 2 sequences"):
        get_packer("modified_first_fit_decreasing", 100, min_bin_count=4).pack([10, 20])


def test_aliases_and_enum_resolve_to_same_packer():
    lengths = [5, 9, 3, 7, 7, 2, 10]
    pairs = [("ffd", "first_fit_decreasing"), ("BFD", "best_fit_decreasing"), ("mffd", "modified_first_fit_decreasing")]
    for alias, name in pairs:
        assert get_packer(alias, 12).pack(lengths) == get_packer(name, 12).pack(lengths)
    assert get_packer(PackingAlgorithm.CONCATENATIVE, 12).pack(lengths) == get_packer("concat", 12).pack(lengths)


def test_inputs_as_numpy_and_torch():
    torch = pytest.importorskip("torch")
    lengths = [4, 8, 1, 3, 3]
    expected = get_packer("ffd", 8).pack(lengths)
    assert get_packer("ffd", 8).pack(np.asarray(lengths, dtype=np.int32)) == expected
    assert get_packer("ffd", 8).pack(torch.tensor(lengths)) == expected
    assert get_packer("ffd", 8).pack(tuple(lengths)) == expected


@pytest.mark.parametrize("distribution", ["lognormal", "power_law"])
@pytest.mark.parametrize("algorithm", ["ffd", "bfd", "mffd"])
def test_heavy_tailed_bins_within_one_of_lower_bound(distribution, algorithm):
    from mcore_packing.data import sample_lengths

    capacity = 4096
    lengths = sample_lengths(distribution, 20_000, capacity, seed=7)
    bins = get_packer(algorithm, capacity).pack_bins(lengths)
    lower = -(-int(lengths.sum()) // capacity)
    assert bins.num_bins - lower <= 1, (bins.num_bins, lower)


def test_mffd_phases_on_hand_worked_examples():
    # C=100. Phase 3: the large item 51 leaves 49; the two smallest small items (17, 18) fit together, so
    # the bin takes 17 and then the largest small item that fits beside it (31). The rest go to FFD.
    lengths = [17, 51, 30, 31, 18]
    assert get_packer("mffd", 100).pack(lengths) == [[1, 0, 3], [2, 4]]
    # Plain FFD packs the same items differently: it pairs 51 with 31 and then 18.
    assert get_packer("ffd", 100).pack(lengths) == [[1, 3, 4], [2, 0]]
    # Phase 2: walking forward, residual 30 takes no medium item (35, 40 > 30); residual 40 takes 40.
    lengths = [70, 60, 40, 35, 30, 20, 18]
    assert get_packer("mffd", 100).pack(lengths) == [[0, 4], [1, 2], [3, 5, 6]]
