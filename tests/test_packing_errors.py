"""Bad input fails with a ValueError that names the value and the way out; nothing is dropped silently."""

from __future__ import annotations

import math

import numpy as np
import pytest

from mcore_packing.packing import PackingAlgorithm, get_packer


@pytest.mark.parametrize("algorithm", [a.value for a in PackingAlgorithm])
def test_length_over_capacity_names_index_length_capacity_and_fix(algorithm):
    with pytest.raises(ValueError) as err:
        get_packer(algorithm, 100).pack([10, 20, 101, 5])
    msg = str(err.value)
    assert "sequence_lengths[2] = 101" in msg
    assert "bin_capacity = 100" in msg
    assert "truncate" in msg and "capacity" in msg


@pytest.mark.parametrize(
    "lengths, fragment",
    [
        ([3, 0, 2], "sequence_lengths[1] = 0"),
        ([3, -4], "sequence_lengths[1] = -4"),
        ([3.5, 2], "sequence_lengths[0] = 3.5"),
        ([3, math.nan], "sequence_lengths[1] = nan"),
        (np.array([1.0, 2.0]), "float dtype"),
        (["a", 2], "not an integer"),
        ([True, False], "booleans"),
        ([[1, 2], [3, 4]], "must be 1-D"),
    ],
)
def test_bad_lengths(lengths, fragment):
    with pytest.raises(ValueError, match=None) as err:
        get_packer("ffd", 10).pack(lengths)
    assert fragment in str(err.value)


@pytest.mark.parametrize("capacity", [0, -5, 2.5, "100", None, True])
def test_bad_capacity(capacity):
    with pytest.raises(ValueError, match="bin_capacity"):
        get_packer("ffd", capacity)


@pytest.mark.parametrize("name", ["min_bin_count", "bin_count_multiple"])
@pytest.mark.parametrize("value", [0, -1, 1.5])
def test_bad_constraints(name, value):
    with pytest.raises(ValueError, match=name):
        get_packer("ffd", 10, **{name: value})


def test_bad_seed():
    with pytest.raises(ValueError, match="seed"):
        get_packer("first_fit_shuffle", 10, seed=-1)


def test_unknown_algorithm_lists_valid_names():
    with pytest.raises(ValueError) as err:
        get_packer("next_fit_magic", 10)
    msg = str(err.value)
    for name in [
        "concatenative",
        "first_fit_decreasing",
        "first_fit_shuffle",
        "modified_first_fit_decreasing",
        "best_fit_decreasing",
        "ffd",
        "bfd",
        "mffd",
    ]:
        assert name in msg


@pytest.mark.parametrize("algorithm", [a.value for a in PackingAlgorithm])
def test_empty_input_gives_no_bins(algorithm):
    assert get_packer(algorithm, 10).pack([]) == []
    assert get_packer(algorithm, 10, min_bin_count=4, bin_count_multiple=8).pack(np.array([], dtype=int)) == []
