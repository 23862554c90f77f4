"""Dynamic context parallelism: the planner (numpy only).

Checked against the definitions, not against itself: every sample's CP size is the smallest power of
two that fits the budget (checked by brute force), every row fits its group's budget and lies on an
aligned group, every sample is planned exactly once, every rank runs the same number of micro-batches,
the order is one global order (no two ranks meet shared rows in different orders), and the predicted
step time is the replay of the rows. Negative control: a plan whose rows are shuffled per rank is caught
by the order check.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from mcore_packing.planning import CostModel, ParallelLayout, StepPlanConfig, plan_step
from mcore_packing.planning.dynamic_cp import DynamicCPConfig, plan_dynamic_cp, simulate_rows

MODEL = CostModel(linear=1.0, quadratic=2e-4, cp_exchange_per_token=0.05, cp_exchange_per_step=40.0)


def lognormal(n: int, seed: int = 0) -> np.ndarray:
    """Megatron's dynamic-CP example distribution: lognormal, mean 1024, sigma 1.5, clipped to 128-8192."""
    rng = np.random.default_rng(seed)
    return np.clip(np.rint(rng.lognormal(np.log(1024) - 1.5**2 / 2, 1.5, n)), 128, 8192).astype(np.int64)


def brute_force_size(length: int, budget: int, cp: int) -> int | None:
    for k in (1, 2, 4, 8, 16):
        if k > cp:
            return None
        multiple = 2 * k if k > 1 else 1
        if -(-length // multiple) * multiple <= k * budget:
            return k
    return None


def shared_row_orders_agree(plan, num_ranks: int) -> bool:
    """Every pair of ranks meets the rows they share in the same order."""
    orders = [[id(row) for row in plan.for_rank(r)] for r in range(num_ranks)]
    for a in range(num_ranks):
        for b in range(a + 1, num_ranks):
            shared = set(orders[a]) & set(orders[b])
            if [x for x in orders[a] if x in shared] != [x for x in orders[b] if x in shared]:
                return False
    return True


@pytest.mark.parametrize("mode", ["packing", "dynamic"])
@pytest.mark.parametrize("dp,cp", [(1, 4), (2, 2), (2, 4), (4, 4), (1, 8)])
def test_plans_meet_every_rule(dp, cp, mode):
    """THD rows, and dynamic batching's BSHD rows: every sample padded to the row's width, the tightest
    multiple of 2k above its longest sample, rows times width within the row's budget."""
    budget = 2048
    lengths = lognormal(24 * dp * cp, seed=dp * 10 + cp)
    lengths = lengths[lengths <= cp * budget]
    config = DynamicCPConfig(max_tokens_per_rank=budget, layout=ParallelLayout(dp=dp, cp=cp), cost_model=MODEL,
                             mode=mode)  # fmt: skip
    plan = plan_dynamic_cp(lengths, config)
    sizes = {}
    for row in plan.rows:
        k = row.cp_size
        multiple = 2 * k if k > 1 else 1
        assert row.first_rank % k == 0 and row.first_rank + k <= dp * cp  # an aligned group of the domain
        assert row.row_length <= k * budget and row.row_length % multiple == 0
        assert row.real_tokens == int(lengths[list(row.sample_indices)].sum())
        longest = int(lengths[list(row.sample_indices)].max())
        if mode == "dynamic":
            assert row.shape == (len(row.sample_indices), row.width) and row.row_length == row.shape[0] * row.width
            assert row.width % multiple == 0 and longest <= row.width < longest + multiple
        else:
            assert row.width == 0 and row.shape == (1, row.row_length)
        sizes.update({i: k for i in row.sample_indices})
    assert sorted(sizes) == list(range(lengths.size))  # every sample exactly once
    smallest = [brute_force_size(int(n), budget, cp) for n in lengths]
    assert all(sizes[i] >= smallest[i] for i in range(lengths.size))
    # a larger size than needed only to even out the counts: rare on a batch of 24 samples per rank
    assert sum(sizes[i] > smallest[i] for i in range(lengths.size)) <= 2, sizes
    counts = {len(plan.for_rank(r)) for r in range(dp * cp)}
    assert len(counts) == 1, counts
    assert shared_row_orders_agree(plan, dp * cp)
    finish = simulate_rows(plan.rows, dp * cp)
    assert plan.predicted_step_time == pytest.approx(finish.max())
    if cp > 1:
        assert len({k for k in sizes.values()}) > 1  # the data needs more than one size: the test is not vacuous


def test_the_order_check_catches_a_rank_that_runs_shared_rows_out_of_order():
    """Negative control for `shared_row_orders_agree`: two CP-2 rows on ranks 0-1, one rank reversed."""
    config = DynamicCPConfig(max_tokens_per_rank=64, layout=ParallelLayout(dp=1, cp=2), cost_model=MODEL)
    plan = plan_dynamic_cp([100, 90, 30, 20, 25, 22], config)
    assert shared_row_orders_agree(plan, 2)

    class Reversed:
        def __init__(self, plan):
            self.plan = plan

        def for_rank(self, r):
            rows = self.plan.for_rank(r)
            return rows[::-1] if r == 1 else rows

    assert sum(row.cp_size == 2 for row in plan.rows) >= 2
    assert not shared_row_orders_agree(Reversed(plan), 2)


def test_short_sequences_run_data_parallel_and_balance_the_ranks():
    """On the lognormal distribution most sequences run at CP 1; the slowest rank ends within 1% of the
    mean; without an exchange cost dynamic and static CP predict the same work (the FLOPs do not change),
    with one the dynamic plan is faster."""
    lengths = lognormal(16 * 16)
    layout = ParallelLayout(dp=4, cp=4)
    for model, faster in [(CostModel(linear=1.0, quadratic=2e-4), False), (MODEL, True)]:
        plan = plan_dynamic_cp(lengths, DynamicCPConfig(max_tokens_per_rank=2048, layout=layout, cost_model=model))
        counts = plan.cp_size_counts()
        assert counts[1] > 0.8 * lengths.size and counts[4] > 0
        finish = plan.rank_finish()
        assert finish.max() / finish.mean() < 1.01
        static = plan_step(lengths, StepPlanConfig(train_mb_tokens=2048, layout=layout, cost_model=model))
        static_time = max(sum(mb.cost for mb in rank) for rank in static.micro_batches)
        ratio = static_time / plan.predicted_step_time
        assert (ratio > 1.02) if faster else (0.98 < ratio < 1.02), ratio


def test_bad_configs_and_samples_are_refused_naming_the_fix():
    with pytest.raises(ValueError, match="power-of-two cp"):
        DynamicCPConfig(max_tokens_per_rank=64, layout=ParallelLayout(cp=3))
    with pytest.raises(ValueError, match="runs at pp=1"):
        DynamicCPConfig(max_tokens_per_rank=64, layout=ParallelLayout(cp=2, pp=2))
    with pytest.raises(ValueError, match=r"got mode='padded'. Use one of \('packing', 'dynamic'\)"):
        DynamicCPConfig(max_tokens_per_rank=64, layout=ParallelLayout(cp=2), mode="padded")
    config = DynamicCPConfig(max_tokens_per_rank=64, layout=ParallelLayout(cp=2))
    with pytest.raises(ValueError, match=r"sample 1 has 200 tokens.*at least 100"):
        plan_dynamic_cp([10, 200], config)
    # One CP-1 sample on two ranks runs at CP 2 (the other rank would have nothing to run) ...
    assert [(row.cp_size, row.sample_indices) for row in plan_dynamic_cp([30], config).rows] == [(2, (0,))]
    # ... but over DP2 x CP2 the other pair of ranks still has nothing: refused, naming the fix.
    with pytest.raises(ValueError, match=r"cannot give the 4 ranks of dynamic CP the same number.*more samples"):
        plan_dynamic_cp([30], DynamicCPConfig(max_tokens_per_rank=64, layout=ParallelLayout(cp=2, dp=2)))


def check_plan(plan, lengths, dp: int, cp: int, groups=None) -> dict:
    """The rules every dynamic-CP plan keeps; returns each sample's CP size."""
    sizes = {}
    for row in plan.rows:
        k = row.cp_size
        assert row.first_rank % k == 0 and row.first_rank + k <= dp * cp
        assert row.row_length <= plan.config.capacity(k) and row.row_length % (2 * k if k > 1 else 1) == 0
        if row.width:  # BSHD rows: every sample padded to the width
            assert row.row_length == len(row.sample_indices) * row.width
            assert row.width >= int(np.asarray(lengths)[list(row.sample_indices)].max())
        assert row.real_tokens == int(np.asarray(lengths)[list(row.sample_indices)].sum())
        assert not set(row.sample_indices) & set(sizes)
        sizes.update({i: k for i in row.sample_indices})
        if groups is not None:  # a group never spans rows
            assert all(groups[j] != groups[i] or j in row.sample_indices for i in row.sample_indices
                       for j in range(len(groups)))  # fmt: skip
    assert sorted(sizes) == list(range(len(lengths)))
    assert len({len(plan.for_rank(r)) for r in range(dp * cp)}) == 1
    assert shared_row_orders_agree(plan, dp * cp)
    return sizes


@pytest.mark.parametrize("mode", ["packing", "dynamic"])
def test_small_batches_are_refused_only_where_static_cp_refuses_them_too(mode):
    """Small random batches (down to one sample per DP group, where equal counts are hardest): every plan
    keeps the rules (splitting, moving, promoting and merging rows, at worst every sample at the full CP
    size); a batch is refused only when static CP cannot give its DP ranks equal counts either."""
    rng = np.random.default_rng(7)
    planned = refused = 0
    for case in range(400):
        dp, cp = [(1, 2), (1, 4), (2, 2), (2, 4)][case % 4]
        n = int(rng.integers(dp, 5 * dp * cp))
        lengths = rng.integers(1, cp * 64 - 2 * cp, n)
        layout = ParallelLayout(dp=dp, cp=cp)
        config = DynamicCPConfig(max_tokens_per_rank=64, layout=layout, cost_model=MODEL, mode=mode)
        try:
            plan = plan_dynamic_cp(lengths, config)
        except ValueError as exc:
            assert "same number of micro-batches" in str(exc) and "more samples" in str(exc)
            with pytest.raises(ValueError):
                plan_step(lengths, StepPlanConfig(train_mb_tokens=64, layout=layout, mode=mode))
            refused += 1
            continue
        check_plan(plan, lengths, dp, cp)
        planned += 1
    assert planned > 350, (planned, refused)


def test_groups_share_one_row_at_the_size_the_group_needs():
    """A group (a DPO pair, GRPO responses) runs in one row; its CP size is the smallest whose row holds
    all of it, larger than its samples alone would need; a group too large for cp ranks is refused
    naming it."""
    lengths = [50, 40, 30, 30, 20, 10, 60, 5, 45, 35, 25, 15]
    groups = [0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5]
    config = DynamicCPConfig(max_tokens_per_rank=64, layout=ParallelLayout(dp=1, cp=4), cost_model=MODEL)
    plan = plan_dynamic_cp(lengths, config, groups=groups)
    sizes = check_plan(plan, lengths, 1, 4, groups)
    assert sizes[0] == sizes[1] >= 2  # 50 + 40 > 64: the pair needs two ranks although each fits one
    assert plan.groups == tuple(groups)
    with pytest.raises(ValueError, match=r"the group of samples \[0, 1\] has 272 padded tokens.*at least 68"):
        plan_dynamic_cp([136, 136, 8, 8], config, groups=[0, 0, 1, 1])
    # BSHD rows pad a group's samples to its longest: 60 + 4 fills one THD row of 64, but two rows of 60 need 2
    pair = [60, 4, 10, 10, 10, 10, 10, 10]
    pairs = [0, 0, 1, 1, 2, 2, 3, 3]
    for mode, size in [("packing", 1), ("dynamic", 2)]:
        plan = plan_dynamic_cp(pair, replace(config, mode=mode), groups=pairs)
        assert check_plan(plan, pair, 1, 4, pairs)[0] == size, mode


def test_plan_step_with_dynamic_cp_plans_both_passes_and_reports_like_a_step_plan():
    """`plan_step` with ``dynamic_cp=True`` returns the dynamic plan at the pass's budget per rank; its
    report (stats, micro-batches per rank, fingerprint, chained minibatches) reads like a `StepPlan`'s;
    the settings that do not apply are refused naming them."""
    from mcore_packing.planning.dynamic_cp import DynamicCPPlan

    lengths = np.minimum(lognormal(64, seed=3) // 8, 250)
    layout = ParallelLayout(dp=2, cp=2)
    config = StepPlanConfig(train_mb_tokens=128, logprob_mb_tokens=512, layout=layout, cost_model=MODEL,
                            dynamic_cp=True)
    train = plan_step(lengths, config)
    logprob = plan_step(lengths, config, forward_only=True)
    assert isinstance(train, DynamicCPPlan) and train.config.max_tokens_per_rank == 128
    assert logprob.forward_only and logprob.config.max_tokens_per_rank == 512
    assert logprob.cp_size_counts()[2] < train.cp_size_counts()[2]  # the larger budget needs CP less often
    stats = train.stats()
    assert stats["real_tokens"] == int(lengths.sum()) and stats["num_microbatches_per_rank"] == train.num_microbatches
    assert stats["predicted_step_cost"] == pytest.approx(train.predicted_step_time)
    assert [len(r) for r in train.micro_batches] == [train.num_microbatches] * 4
    assert stats["max_tokens_per_rank"] <= 128 and sum(stats["cp_sizes"].values()) == lengths.size
    assert train.fingerprint() == plan_step(lengths, config).fingerprint() != logprob.fingerprint()
    chained = type(train).chained([train, logprob])
    assert chained.lengths == train.lengths + logprob.lengths
    assert sorted(i for row in chained.rows for i in row.sample_indices) == list(range(2 * lengths.size))
    for bad, fragment in [({"mode": "padded"}, "mode='padded' pads every micro-batch"),
                          ({"fixed_shape": True}, "fixed_shape does not"),
                          ({"cost_budget": "auto"}, "cost_budget does not"),
                          ({"layout": ParallelLayout(cp=2, pp=2)}, "dynamic_cp runs at pp=1")]:  # fmt: skip
        with pytest.raises(ValueError, match=fragment):
            StepPlanConfig(**{"train_mb_tokens": 128, "layout": layout, "dynamic_cp": True, **bad})


def test_the_exchange_cost_is_what_the_cost_model_says():
    model = CostModel(linear=1.0, quadratic=0.0, cp_exchange_per_token=2.0, cp_exchange_per_step=5.0)
    assert model.cp_exchange(100, 1) == 0.0
    assert model.cp_exchange(100, 4) == pytest.approx(0.75 * 100 * 2.0 + 3 * 5.0)
    from mcore_packing.planning import ModelShape

    shape = ModelShape(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, vocab_size=64)
    derived = CostModel(linear=1.0, quadratic=0.0).with_cp_exchange(shape, flops_per_byte=10.0, step_latency_flops=7.0)
    assert derived.cp_exchange_per_token == pytest.approx(3 * 2 * (2 * 2 * 16 * 2) * 10.0)  # 3 passes, 2 layers
    assert derived.cp_exchange_per_step == pytest.approx(3 * 2 * 7.0)


# ---------------------------------------------------------------- the step on real gloo ranks


@pytest.fixture(scope="module")
def reference():
    from .distributed_harness import run_distributed
    from .test_step_equivalence import SAMPLES

    return run_distributed("tests.step_workers:reference_worker", 1, samples=SAMPLES)[0]


STEPS = [
    # CP4 over 4 ranks: sequences of CP size 1, 2 and 4 in one step; log-probs too
    {"cp": 4, "dynamic_cp": True, "train_mb_tokens": 16, "logprobs": True},
    {"cp": 2, "dynamic_cp": True, "train_mb_tokens": 24, "normalization": "sequence_mean"},  # DP2 x CP2: 1 and 2
    # TP2 with sequence parallelism x CP2: two DP x CP domains (one per TP rank), each with its sub-groups
    {"tp": 2, "sp": True, "cp": 2, "dynamic_cp": True, "train_mb_tokens": 24},
    {"cp": 4, "dynamic_cp": True, "train_mb_tokens": 16, "negative": "rope_rank_reversed"},
    {"cp": 4, "dynamic_cp": True, "train_mb_tokens": 16, "negative": "gather_over_own_rank"},
    # dynamic batching: padded BSHD rows per CP size, each on its sub-group
    {"cp": 4, "dynamic_cp": True, "mode": "dynamic", "train_mb_tokens": 16, "logprobs": True},
    {"cp": 2, "dynamic_cp": True, "mode": "dynamic", "train_mb_tokens": 24, "normalization": "sequence_mean"},
    {"tp": 2, "sp": True, "cp": 2, "dynamic_cp": True, "mode": "dynamic", "train_mb_tokens": 24},
    {"cp": 4, "dynamic_cp": True, "mode": "dynamic", "train_mb_tokens": 16, "negative": "bshd_rope_rank_reversed"},
    {"cp": 4, "dynamic_cp": True, "mode": "dynamic", "train_mb_tokens": 16, "negative": "bshd_gather_over_own_rank"},
]


@pytest.mark.multirank
def test_dynamic_cp_steps_match_the_unpacked_reference(reference):
    """Each row on its own CP sub-group (K/V gathered over it, RoPE placed by it, the 2k-chunk split),
    gradients reduced over DP x CP once, the loss normalized over the global batch: loss <= 1e-6 and
    gradients <= 1e-5 against one sequence per forward in one process; log-probs too. Packed THD rows and
    dynamic batching's BSHD rows. Negative controls, for both: RoPE positions placed as the mirrored rank
    of the same sub-group would, and a row split over its sub-group whose keys and values are gathered
    over the wrong group (this rank alone): each moves the gradients far off."""
    from .distributed_harness import run_distributed
    from .test_step_equivalence import SAMPLES, check_logprobs, errors

    results = run_distributed("tests.step_workers:step_worker", 4, configs=STEPS, samples=SAMPLES,
                              state_dict=reference["state_dict"], timeout=600)[0]  # fmt: skip
    for result in results:
        loss_err, grad_err = errors(result, reference)
        assert result["all_losses_equal"]
        cfg = result["config"]
        print(f"dynamic CP {cfg}: loss {loss_err:.1e}, grads {grad_err:.1e}, CP sizes {result['cp_sizes']}")
        if cfg.get("negative"):
            assert grad_err > 1e-3, (loss_err, grad_err)
            continue
        assert loss_err <= 1e-6 and grad_err <= 1e-5, (cfg, loss_err, grad_err)
        used = {k for k, n in result["cp_sizes"].items() if n}
        assert used == ({1, 2, 4} if cfg["cp"] == 4 else {1, 2}), result["cp_sizes"]
        if cfg.get("logprobs"):
            check_logprobs(result, reference)
        if cfg["cp"] == 4:  # TransformerEngine's per-row fields: rank 0 ran rows of every size; a BSHD row
            one = (1, 1) if cfg.get("mode") == "dynamic" else (1, None)  # of one rank keeps its group (RoPE)
            assert result["cp_fields"] == [one, (2, 2), (4, 4)], result["cp_fields"]
