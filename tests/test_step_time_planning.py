"""Plans that minimise step time: sequence-level rebalancing, the 1F1B simulator and orders, costs."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from mcore_packing.planning import CostModel, ModelShape, ParallelLayout, StepPlanConfig, micro_batch_cost, plan_step
from mcore_packing.planning.pipeline import best_pipeline_order, pipeline_lower_bound, simulate_1f1b
from mcore_packing.planning.rebalance import rebalance_units

MODEL = CostModel.from_shape(ModelShape(num_layers=4, hidden_size=256, num_attention_heads=4, vocab_size=1000))


@settings(max_examples=80, deadline=None)
@given(
    st.lists(st.integers(1, 400), min_size=8, max_size=120),
    st.integers(2, 4),
    st.booleans(),
    st.integers(0, 2**16),
)
def test_rebalanced_plans_keep_every_hard_limit(lengths, dp, grouped, seed):
    groups = None
    if grouped:
        groups = np.random.default_rng(seed).integers(0, len(lengths) // 2 + 1, size=len(lengths)).tolist()
        assume(len(set(groups)) >= dp and max(np.bincount(groups, weights=lengths)) <= 512)
    config = StepPlanConfig(train_mb_tokens=512, layout=ParallelLayout(dp=dp), cost_model=MODEL)
    try:
        plan = plan_step(lengths, config, groups=groups)
    except ValueError as exc:  # too few groups to give every rank the same number of rows: refused by design
        assume("Cannot create" not in str(exc))
        raise
    assert sorted(plan.sample_order().tolist()) == list(range(len(lengths)))  # every sample exactly once
    assert len({len(rank) for rank in plan.micro_batches}) == 1  # equal counts
    where = {}
    for r, rank in enumerate(plan.micro_batches):
        for k, mb in enumerate(rank):
            assert sum(lengths[i] for i in mb.sample_indices) <= plan.row_capacity  # the token cap
            for i in mb.sample_indices:
                where.setdefault(groups[i] if groups else i, set()).add((r, k))
    assert all(len(places) == 1 for places in where.values())  # groups never split
    # Never worse than round-robin rows: the row assignment never is, and the rebalancer only lowers the max.
    rows = plan_step(
        lengths,
        StepPlanConfig(train_mb_tokens=512, layout=ParallelLayout(dp=dp), cost_model=MODEL, balance="round_robin"),
        groups=groups,
    )
    assert max(plan.rank_costs()) <= max(rows.rank_costs()) * (1 + 1e-9)


def test_rebalancer_evens_ranks_a_row_assignment_cannot():
    # Rank 1 holds a 20%-full row: whole rows cannot move, single sequences can.
    sizes = np.array([100] * 10 + [100, 100])
    costs = sizes.astype(float)
    bins = [list(range(0, 5)), list(range(5, 10)), [10], [11]]
    rank_of_bin = [0, 0, 1, 1]
    before = [costs[b].sum() for b in bins]
    after = rebalance_units(bins, rank_of_bin, sizes, costs, capacity=500)
    loads = [sum(costs[u] for b, r in zip(after, rank_of_bin, strict=True) if r == rank for u in b) for rank in (0, 1)]
    assert before[0] + before[1] == 1000 and loads == [600.0, 600.0]
    assert sorted(u for b in after for u in b) == list(range(12)) and all(after)


def test_1f1b_simulator_reproduces_the_textbook_bubble():
    for pp, m in ((2, 4), (4, 8), (8, 16)):
        assert simulate_1f1b([1.0] * m, pp) == pytest.approx((m + pp - 1) * 3.0)  # (m + p - 1)(f + b)
        assert pipeline_lower_bound([1.0] * m, pp) == pytest.approx((m + pp - 1) * 3.0)
    assert simulate_1f1b([2.0, 1.0], 1) == pytest.approx(9.0)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(0.05, 5.0), min_size=1, max_size=12), st.integers(2, 6))
def test_no_order_beats_the_lower_bound_and_the_chosen_order_is_best_of_its_candidates(forward, pp):
    f = np.asarray(forward)
    bound = pipeline_lower_bound(f, pp)
    assert simulate_1f1b(f, pp) >= bound * (1 - 1e-9)
    chosen = simulate_1f1b(f[best_pipeline_order(f, pp)], pp)
    assert bound * (1 - 1e-9) <= chosen <= simulate_1f1b(f, pp) * (1 + 1e-9)
    assert chosen <= simulate_1f1b(np.sort(f)[::-1], pp) * (1 + 1e-9)


def test_pipeline_order_puts_a_cheap_micro_batch_first():
    forward = [1.0, 1.0, 1.0, 0.1, 1.0, 1.0]
    order = best_pipeline_order(forward, 4)
    assert forward[order[0]] == 0.1
    assert simulate_1f1b(np.asarray(forward)[order], 4) < simulate_1f1b(forward, 4)


@pytest.mark.parametrize(
    "mode, layout",
    [("packing", {}), ("packing", {"cp": 2, "tp": 2, "sequence_parallel": True}),
     ("packing", {"pp": 2}), ("dynamic", {}), ("padded", {})],
)  # fmt: skip
def test_micro_batch_costs_equal_the_per_micro_batch_reference(mode, layout):
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 700, size=90)
    model = CostModel(linear=3.0, quadratic=0.01, per_microbatch=50.0)
    config = StepPlanConfig(mode=mode, train_mb_tokens=2048, layout=ParallelLayout(dp=3, **layout), cost_model=model)
    plan = plan_step(lengths, config)
    padded = config.padded_lengths(lengths)
    for mb in (mb for rank in plan.micro_batches for mb in rank):
        want = micro_batch_cost(padded[list(mb.sample_indices)], mb.shape, mode, config.layout.cp, model)
        assert mb.cost == pytest.approx(want, rel=1e-12)
        assert mb.real_tokens == int(lengths[list(mb.sample_indices)].sum())
