"""Length sources: synthetic distributions and real corpora shipped with installed packages."""

from __future__ import annotations

import numpy as np
import pytest

from mcore_packing.data import DISTRIBUTIONS, real_corpus_lengths, sample_lengths
from mcore_packing.data.lengths import split_to_capacity


@pytest.mark.parametrize("distribution", DISTRIBUTIONS)
def test_samples_are_in_range_and_seeded(distribution):
    a = sample_lengths(distribution, 5000, 2048, seed=3)
    b = sample_lengths(distribution, 5000, 2048, seed=3)
    assert a.dtype == np.int64 and a.shape == (5000,)
    assert a.min() >= 1 and a.max() <= 2048
    np.testing.assert_array_equal(a, b)


def test_heavy_tailed_shapes_are_heavy_tailed():
    for name in ["lognormal", "power_law", "real:champ"]:
        x = sample_lengths(name, 20000, 16384, seed=0)
        assert np.mean(x) > 1.1 * np.median(x), name  # right-skewed: mean above median


def test_split_to_capacity_keeps_every_token():
    lengths = np.array([5, 10, 23, 30, 1])
    pieces = split_to_capacity(lengths, 10)
    assert pieces.sum() == lengths.sum()
    assert pieces.max() <= 10 and pieces.min() >= 1
    assert sorted(pieces.tolist()) == sorted([5, 10, 10, 10, 3, 10, 10, 10, 1])


def test_real_corpora_are_real_and_long_tailed():
    champ = real_corpus_lengths("champ")
    assert champ.size == 19440  # CHAMP's documented conversation count
    assert 500 < np.median(champ) < 2000 and champ.max() > 4 * np.median(champ)
    stdlib = real_corpus_lengths("stdlib")
    assert stdlib.size > 500 and stdlib.max() > 20 * np.median(stdlib)


def test_power_law_minimum_is_configurable():
    x = sample_lengths("power_law:100", 10000, 16384, seed=1)
    assert x.min() == 100 and x.max() <= 16384
    with pytest.raises(ValueError, match="minimum must be >= 1"):
        sample_lengths("power_law:0", 10, 100)


def test_unknown_distribution():
    with pytest.raises(ValueError, match="Valid names"):
        sample_lengths("zipf9", 10, 100)
    with pytest.raises(ValueError, match="Valid names"):
        real_corpus_lengths("wikipedia")
