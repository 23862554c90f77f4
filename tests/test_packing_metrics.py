"""PackingMetrics on hand-computed cases."""

from __future__ import annotations

import pytest

from mcore_packing.packing import PackingMetrics, get_packer


def test_metrics_hand_computed():
    lengths = [60, 40, 30, 30, 10]  # 170 tokens, longest 60
    bins = [[0, 1], [2, 3, 4]]  # 100 and 70 tokens
    m = PackingMetrics.compute(lengths, bins, 100)
    assert m.num_bins == 2 and m.lower_bound == 2
    assert m.utilization == pytest.approx(170 / 200)
    assert m.waste == pytest.approx(30 / 200)
    assert m.packing_efficiency == 1.0
    assert m.bin_balance == pytest.approx(0.7)
    assert m.max_sequences_per_bin == 3
    assert m.padding_tokens_packed == 30
    assert m.padding_tokens_pad_to_longest == 5 * 60 - 170
    assert m.padding_tokens_pad_to_capacity == 5 * 100 - 170
    assert m.padding_saved_vs_pad_to_longest == pytest.approx(1 - 30 / 130)
    assert m.padding_saved_vs_pad_to_capacity == pytest.approx(1 - 30 / 330)
    d = m.to_dict()
    assert d["num_bins"] == 2 and set(d) >= {"utilization", "packing_efficiency", "bin_balance"}


def test_metrics_from_packer_and_from_lists_agree():
    lengths = [7, 3, 9, 1, 1, 5, 8]
    packer = get_packer("bfd", 10)
    a = PackingMetrics.compute(lengths, packer.pack(lengths), 10)
    b = PackingMetrics.compute(lengths, packer.pack_bins(lengths), 10)
    assert a == b
    assert a.num_tokens == sum(lengths)


def test_metrics_empty():
    m = PackingMetrics.compute([], [], 100)
    assert m.num_bins == 0 and m.utilization == 1.0 and m.waste == 0.0
