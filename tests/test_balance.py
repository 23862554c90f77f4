"""Cost model, cost-aware rank balancing, micro-batch order, groups: properties and bad input."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from mcore_packing.packing import cost_capped_first_fit
from mcore_packing.planning import (
    CostModel,
    ModelShape,
    ParallelLayout,
    StepPlanConfig,
    assign_balanced,
    assign_round_robin,
    max_over_mean,
    order_microbatches,
    plan_step,
)

# Llama-3-8B's shape, written out (independent of the recipe that also describes it).
LLAMA3_8B = ModelShape(
    num_layers=32,
    hidden_size=4096,
    num_attention_heads=32,
    num_query_groups=8,
    ffn_hidden_size=14336,
    vocab_size=128256,
    gated_mlp=True,
)


def test_cost_model_hand_computed():
    # L=2, h=8, 2 heads (d=4), 1 kv head, ffn 16 (gated: 3 matrices), vocab 10.
    m = CostModel.from_shape(
        ModelShape(
            num_layers=2,
            hidden_size=8,
            num_attention_heads=2,
            num_query_groups=1,
            ffn_hidden_size=16,
            vocab_size=10,
            gated_mlp=True,
        ),
        training=False,
    )
    per_layer = 8 * (2 + 2 * 1) * 4 + 8 * 8 + 3 * 8 * 16
    assert m.linear == 2 * 2 * per_layer + 2 * 8 * 10
    assert m.quadratic == 2 * 2 * 8
    assert m.sequence_cost([3]) == pytest.approx(m.linear * 3 + m.quadratic * 9)
    assert m.sequence_cost([3], cp_size=2) == pytest.approx((m.linear * 3 + m.quadratic * 9) / 2)
    trained = CostModel.from_shape(
        ModelShape(num_layers=2, hidden_size=8, num_attention_heads=2, vocab_size=10, gated_mlp=True)
    )
    assert trained.quadratic == 3 * 2 * 2 * 8  # forward + backward = 3x forward


def _attended_pairs(length: int, window: int | None) -> int:
    """Brute force: the (query, key) pairs causal attention computes, each query seeing at most ``window``."""
    return sum(min(i + 1, window or length) for i in range(length))


@pytest.mark.parametrize("layers", [[0, 1, 2, 3], [0, 2], []])  # Mistral's every layer, GPT-OSS's every other
def test_windowed_layers_price_the_pairs_they_attend(layers):
    """The windowed layers' share of the attention term counts what they compute (at most W keys a query):
    the model's area per layer matches twice the brute-force pair count (the s^2 convention of full causal
    attention, s(s + 1) / 2 pairs) within 1/W; without the window (the control) a 2,000-token sequence would
    be priced at 16x its windowed layers' work."""
    window = 64
    shape = ModelShape(num_layers=4, hidden_size=64, num_attention_heads=4, vocab_size=100, window_size=window,
                       window_layers=tuple(layers))  # fmt: skip
    model = CostModel.from_shape(shape)
    windowed = len(layers) or 4
    assert (model.window, model.windowed_share) == (window, windowed / 4)
    for length in (1, 40, 64, 65, 300, 2000):
        per_layer = [2 * _attended_pairs(length, window if w else None) for w in shape.window_per_layer()]
        want = sum(per_layer) / 4  # the mean layer, in units of `quadratic` (which counts every layer)
        assert model.attention_area([length])[0] == pytest.approx(want, rel=1.0 / window + 1.0 / length)
    full = CostModel.from_shape(dataclasses.replace(shape, window_size=None, window_layers=()))
    assert full.attention_area([2000])[0] / model.attention_area([2000])[0] > (1.8 if len(layers) == 2 else 15)
    assert model.sequence_cost([2000])[0] == pytest.approx(model.linear * 2000 + model.quadratic
                                                           * model.attention_area([2000])[0])  # fmt: skip


def test_a_calibration_with_the_window_recovers_a_windowed_models_coefficients():
    truth = CostModel(linear=2.0, quadratic=0.01, unit="s", per_sequence=0.5, window=64, windowed_share=0.5)
    steps = [[10, 300], [2000], [64, 64, 900], [1500, 20], [700]]
    seconds = [float(truth.sequence_cost(s).sum()) for s in steps]
    fit = CostModel.calibrate(steps, seconds, window=64, windowed_share=0.5)
    assert (fit.linear, fit.quadratic, fit.per_sequence) == pytest.approx((2.0, 0.01, 0.5), rel=1e-6)
    blind = CostModel.calibrate(steps, seconds)  # control: s^2 cannot fit these times
    assert blind.quadratic != pytest.approx(0.01, rel=0.05)


def test_attention_share_grows_with_length_like_published_figures():
    llama8b = CostModel.from_shape(LLAMA3_8B)
    short, long = llama8b.attention_share([4096]), llama8b.attention_share([32768])
    assert 0.05 < short < 0.10 and 0.30 < long < 0.45  # published: ~8% at 4k, ~40% at 32k


def test_calibration_recovers_coefficients():
    rng = np.random.default_rng(0)
    steps = [rng.integers(1, 4000, size=rng.integers(4, 30)).tolist() for _ in range(12)]
    seconds = [2e-6 * sum(s) + 3e-10 * sum(x * x for x in s) for s in steps]
    m = CostModel.calibrate(steps, seconds)
    assert m.linear == pytest.approx(2e-6, rel=1e-6) and m.quadratic == pytest.approx(3e-10, rel=1e-6)
    with pytest.raises(ValueError, match="at least two measured steps"):
        CostModel.calibrate(steps[:1], seconds[:1])
    # A per-micro-batch constant is recovered too when the micro-batch counts are given.
    counts = [int(c) for c in rng.integers(1, 9, size=len(steps))]
    timed = [t + 0.05 * c for t, c in zip(seconds, counts, strict=True)]
    m3 = CostModel.calibrate(steps, timed, counts)
    assert m3.per_microbatch == pytest.approx(0.05, rel=1e-6) and m3.linear == pytest.approx(2e-6, rel=1e-6)
    assert CostModel.calibrate(steps, seconds, counts).per_microbatch == pytest.approx(0.0, abs=1e-9)
    # Times that fall with the squared term would need b < 0: the fit stays non-negative.
    noisy = CostModel.calibrate([[100], [10, 10, 10, 10, 10, 10, 10, 10, 10, 10, 10]], [1.0, 1.2])
    assert noisy.linear >= 0 and noisy.quadratic >= 0 and noisy.linear + noisy.quadratic > 0


@settings(max_examples=100, deadline=None)
@given(st.lists(st.floats(0.1, 1000), min_size=1, max_size=64), st.integers(1, 8))
def test_balanced_assignment_is_equal_count_and_never_worse_than_round_robin(costs, ranks):
    costs = costs[: len(costs) // ranks * ranks]
    assume(costs)  # fewer costs than ranks: no equal-count assignment exists
    ours = assign_balanced(costs, ranks)
    assert sorted(i for r in ours for i in r) == list(range(len(costs)))
    assert len({len(r) for r in ours}) == 1
    c = np.asarray(costs)
    mine = max(c[r].sum() for r in ours)
    rr = max(c[r].sum() for r in assign_round_robin(len(costs), ranks))
    assert mine <= rr * (1 + 1e-9)
    assert mine >= c.sum() / ranks * (1 - 1e-9)


def test_swaps_fix_what_lpt_leaves():
    # Equal-count LPT gives {17, 6, 6} = 29 and {13, 10, 1} = 24; the optimum is 28 ({13, 6, 6 + ...}).
    costs = [17, 13, 10, 6, 6, 1]
    loads = lambda ranks: sorted(sum(costs[i] for i in r) for r in ranks)  # noqa: E731
    assert loads(assign_balanced(costs, 2, max_rounds=0)) == [24, 29]  # LPT alone
    assert loads(assign_balanced(costs, 2)) == [25, 28]  # one swap: the optimum of all 20 splits


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 100), st.floats(0.1, 50)), min_size=1, max_size=60))
def test_cost_capped_bins_respect_both_limits(items):
    tokens = [t for t, _ in items]
    costs = [c for _, c in items]
    bins = cost_capped_first_fit(tokens, costs, 128, 60.0)
    assert sorted(i for b in bins for i in b) == list(range(len(items)))
    assert all(sum(tokens[i] for i in b) <= 128 for b in bins)
    assert all(sum(costs[i] for i in b) <= 60.0 + 1e-6 for b in bins)


def test_orders():
    costs = [3, 9, 1, 7, 5]
    assert order_microbatches(costs, "packer") == [0, 1, 2, 3, 4]
    assert [costs[i] for i in order_microbatches(costs, "largest_first")] == [9, 7, 5, 3, 1]
    bubble = [costs[i] for i in order_microbatches(costs, "bubble")]
    assert bubble == [1, 5, 9, 7, 3]  # small at both ends, largest in the middle
    with pytest.raises(ValueError, match="microbatch_order"):
        order_microbatches(costs, "random")


@st.composite
def grouped_batches(draw):
    num_groups = draw(st.integers(2, 20))
    sizes = draw(st.lists(st.integers(1, 3), min_size=num_groups, max_size=num_groups))
    groups = [g for g, k in enumerate(sizes) for _ in range(k)]
    order = draw(st.permutations(range(len(groups))))
    groups = [groups[i] for i in order]
    lengths = draw(st.lists(st.integers(1, 60), min_size=len(groups), max_size=len(groups)))
    return lengths, groups


@settings(max_examples=80, deadline=None)
@given(
    grouped_batches(),
    st.sampled_from(["cost", "tokens", "round_robin"]),
    st.integers(1, 3),
    st.sampled_from([None, "auto"]),
    st.sampled_from(["packer", "largest_first", "bubble", "pipeline", "auto"]),
)
def test_plans_never_split_groups_never_exceed_the_cap_and_keep_equal_counts(batch, balance, dp, budget, order):
    lengths, groups = batch
    model = CostModel.from_shape(
        ModelShape(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=100, gated_mlp=True)
    )
    config = StepPlanConfig(
        train_mb_tokens=200,
        layout=ParallelLayout(dp=dp),
        balance=balance,
        cost_model=model,
        cost_budget=budget,
        microbatch_order=order,
    )
    assume(len(set(groups)) >= dp)  # every rank needs a group
    plan = plan_step(lengths, config, groups=groups)
    assert len({len(rank) for rank in plan.micro_batches}) == 1
    where = {}
    for r, rank in enumerate(plan.micro_batches):
        for k, mb in enumerate(rank):
            assert mb.padded_tokens <= config.row_capacity()
            for i in mb.sample_indices:
                where.setdefault(groups[i], set()).add((r, k))
    assert all(len(places) == 1 for places in where.values())  # every group in exactly one micro-batch
    assert sorted(plan.sample_order().tolist()) == list(range(len(lengths)))


@settings(max_examples=80, deadline=None)
@given(grouped_batches(), st.integers(1, 3), st.sampled_from(["cost", "round_robin"]))
def test_dynamic_batches_keep_groups_whole_under_the_budget(batch, dp, balance):
    lengths, groups = batch
    assume(len(set(groups)) % dp == 0)  # then equal counts per rank are always reachable between groups
    config = StepPlanConfig(mode="dynamic", train_mb_tokens=200, layout=ParallelLayout(dp=dp), balance=balance)
    plan = plan_step(lengths, config, groups=groups)
    assert len({len(rank) for rank in plan.micro_batches}) == 1
    where = {}
    for r, rank in enumerate(plan.micro_batches):
        for k, mb in enumerate(rank):
            rows, width = mb.shape
            assert rows == len(mb.sample_indices) and rows * width <= config.row_capacity()
            assert width == max(config.padded_lengths(np.asarray([lengths[i] for i in mb.sample_indices])))
            for i in mb.sample_indices:
                where.setdefault(groups[i], set()).add((r, k))
    assert all(len(places) == 1 for places in where.values())  # every group in exactly one micro-batch
    assert sorted(plan.sample_order().tolist()) == list(range(len(lengths)))


def test_dynamic_groups_match_ungrouped_plans_when_every_group_is_one_sample():
    lengths = [50, 7, 33, 33, 120, 64, 1, 90, 18]
    config = StepPlanConfig(mode="dynamic", train_mb_tokens=256, layout=ParallelLayout(dp=2))
    assert plan_step(lengths, config, groups=list(range(9))).micro_batches == plan_step(lengths, config).micro_batches


def test_cost_balance_beats_round_robin_on_long_tailed_32k():
    from mcore_packing.data import sample_lengths

    model = CostModel.from_shape(LLAMA3_8B)
    pool = sample_lengths("lognormal", 100_000, 32768, seed=1)
    lengths = pool[: int(np.searchsorted(np.cumsum(pool), 0.97 * 64 * 32768))]
    results = {}
    for balance in ("round_robin", "cost"):
        plan = plan_step(
            lengths,
            StepPlanConfig(train_mb_tokens=32768, layout=ParallelLayout(dp=8), balance=balance, cost_model=model),
        )
        results[balance] = max_over_mean([sum(mb.cost for mb in rank) for rank in plan.micro_batches])
    assert results["cost"] <= 1.02 < results["round_robin"], results


@pytest.mark.parametrize(
    "kwargs, plan_kwargs, fragment",
    [
        ({"train_mb_tokens": 50}, {"groups": [0, 0, 1]}, "group 0 has 2 samples and 60 padded tokens"),
        ({"mode": "padded"}, {"groups": [0, 0, 1]}, "need mode='packing' or 'dynamic'"),
        ({"mode": "dynamic", "train_mb_tokens": 50}, {"groups": [0, 0, 1]}, "60 tokens as 2 rows of 30"),
        (
            {"mode": "dynamic", "layout": ParallelLayout(dp=2)},
            {"groups": [0, 0, 0]},
            "only 1 groups in the global batch",
        ),
        ({}, {"groups": [0, 1]}, "groups has 2 entries for 3 samples"),
        ({"cost_budget": 1.0}, {}, "below the costliest single sequence"),
    ],
)
def test_bad_groups_and_budgets(kwargs, plan_kwargs, fragment):
    with pytest.raises(ValueError) as err:
        plan_step([30, 30, 20], StepPlanConfig(**kwargs), **plan_kwargs)
    assert fragment in str(err.value)


def test_bad_balance_config():
    with pytest.raises(ValueError, match="balance must be one of"):
        StepPlanConfig(balance="greedy")
    with pytest.raises(ValueError, match="cost_budget must be a positive number"):
        StepPlanConfig(cost_budget=-1)
    with pytest.raises(ValueError, match="needs mode='packing'"):
        StepPlanConfig(mode="dynamic", cost_budget="auto")
