"""Every internal path of the decreasing-fit kernel gives the textbook bins.

The kernel picks between a per-item structure (segment tree for first fit, residual buckets for best
fit), a grouped flat scan (small first-fit groups finished in plain Python) and a grouped block-indexed scan
by size; small hypothesis cases would only reach some of them, so each path is forced here.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mcore_packing.packing import _kernels, get_packer
from mcore_packing.packing._bitset import IntSet

from .packing_reference import reference_decreasing_fit

# The fixture patches module constants once per test; hypothesis examples then all run on that path.
PATHS = {
    "per_item": {"_PER_ITEM_RATIO": 10**9, "_BEST_FIT_PER_ITEM_RATIO": 10**9},
    "grouped_flat": {"_PER_ITEM_RATIO": 0, "_BEST_FIT_PER_ITEM_RATIO": 0, "_SMALL": 10**9},
    "grouped_flat_vectorized": {
        "_PER_ITEM_RATIO": 0,
        "_BEST_FIT_PER_ITEM_RATIO": 0,
        "_SMALL": 10**9,
        "_SMALL_GROUP": 0,
    },
    "grouped_blocks": {"_PER_ITEM_RATIO": 0, "_BEST_FIT_PER_ITEM_RATIO": 0, "_SMALL": 0, "_BLOCK": 4},
}


@pytest.fixture(params=sorted(PATHS))
def kernel_path(request, monkeypatch):
    for name, value in PATHS[request.param].items():
        monkeypatch.setattr(_kernels, name, value)
    return request.param


@st.composite
def cases(draw):
    capacity = draw(st.integers(1, 200))
    # Few distinct lengths so equal-length groups are common.
    palette = draw(st.lists(st.integers(1, capacity), min_size=1, max_size=6))
    lengths = draw(st.lists(st.sampled_from(palette), min_size=0, max_size=150))
    return capacity, lengths


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=cases())
def test_ffd_and_bfd_match_reference_on_every_path(kernel_path, case):
    capacity, lengths = case
    for name, best in [("ffd", False), ("bfd", True)]:
        assert get_packer(name, capacity).pack(lengths) == reference_decreasing_fit(lengths, capacity, best_fit=best)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=cases(), data=st.data(), best_fit=st.booleans())
def test_initial_residuals_are_respected_on_every_path(kernel_path, case, data, best_fit):
    capacity, lengths = case
    opened = data.draw(st.lists(st.integers(0, capacity), max_size=10))
    sorted_lengths = np.sort(np.asarray(lengths, dtype=np.int64))[::-1].copy()
    bin_ids, residual = _kernels.decreasing_fit(
        sorted_lengths, capacity, best_fit=best_fit, initial_residuals=np.asarray(opened, dtype=np.int64)
    )
    # Reference: first (or best) fit over pre-opened bins, then new bins.
    room = list(opened)
    expected = []
    for s in sorted_lengths.tolist():
        fitting = [k for k, r in enumerate(room) if r >= s]
        if not fitting:
            room.append(capacity)
            b = len(room) - 1
        else:
            b = min(fitting, key=lambda k: (room[k], k)) if best_fit else fitting[0]
        room[b] -= s
        expected.append(b)
    assert bin_ids.tolist() == expected
    assert residual.tolist() == room


def test_paths_agree_on_a_large_realistic_case(monkeypatch):
    from mcore_packing.data import sample_lengths

    lengths = sample_lengths("lognormal", 30_000, 2048, seed=5)
    results = {}
    for path, overrides in PATHS.items():
        with monkeypatch.context() as m:
            for name, value in overrides.items():
                m.setattr(_kernels, name, value if name != "_BLOCK" else 64)
            results[path] = [get_packer(name, 2048).pack_bins(lengths).indices.tolist() for name in ("ffd", "bfd")]
    assert len({str(r) for r in results.values()}) == 1, "kernel paths disagree"


def test_negative_control_reference_detects_a_wrong_tie_break(monkeypatch):
    # Patch the kernels' sort so equal lengths go by the higher index first: the same comparison with the
    # naive reference that the property tests rely on must now fail, for FFD and BFD alike.
    lengths = [5, 5, 5, 5, 3, 7, 3]
    reference = {name: reference_decreasing_fit(lengths, 10, best_fit=name == "bfd") for name in ("ffd", "bfd")}
    for name in ("ffd", "bfd"):
        assert get_packer(name, 10).pack(lengths) == reference[name]
    reversed_ties = lambda x: np.lexsort((-np.arange(len(x)), -np.asarray(x)))  # noqa: E731
    monkeypatch.setattr(_kernels, "stable_descending_order", reversed_ties)
    for name in ("ffd", "bfd"):
        patched = get_packer(name, 10).pack(lengths)
        assert patched != reference[name], f"{name}: a wrong tie-break went unnoticed"
        assert sorted(i for b in patched for i in b) == list(range(len(lengths)))  # still a valid packing


def test_intset_queries_match_a_sorted_list():
    rng = np.random.default_rng(7)
    members = sorted(set(rng.integers(0, 300, size=60).tolist()))
    s = IntSet(300, members)
    for v in range(0, 301):
        above = [m for m in members if m >= v]
        below = [m for m in members if m <= v]
        assert s.next_at_least(v) == (above[0] if above else -1)
        assert s.last_at_most(v) == (below[-1] if below else -1)
        assert list(s.ascending_upto(v)) == below
    s.discard(members[0])
    s.add(299)
    assert s.next_at_least(0) == members[1] and s.last_at_most(10_000) == 299
