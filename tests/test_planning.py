"""Step plans: equal micro-batch counts per DP rank, every sample exactly once, budgets respected."""

from __future__ import annotations

import re

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from mcore_packing.planning import ParallelLayout, StepPlanConfig, plan_step


@st.composite
def plan_cases(draw):
    mode = draw(st.sampled_from(["packing", "dynamic", "padded"]))
    cp = draw(st.sampled_from([1, 2, 4]))
    tp = draw(st.sampled_from([1, 2]))
    sp = draw(st.booleans()) and tp > 1
    dp = draw(st.integers(1, 4))
    budget = draw(st.integers(32, 300))
    config = StepPlanConfig(
        mode=mode,
        train_mb_tokens=budget,
        layout=ParallelLayout(dp=dp, cp=cp, tp=tp, sequence_parallel=sp, pp=draw(st.sampled_from([1, 2]))),
        sequence_length_round=draw(st.sampled_from([1, 8])),
        microbatch_order=draw(st.sampled_from(["packer", "largest_first"])),
        algorithm=draw(st.sampled_from(["mffd", "ffd", "concatenative"])),
    )
    capacity = config.row_capacity()
    multiple = config.length_multiple
    max_len = max(1, capacity - multiple + 1) if capacity >= multiple else 1
    lengths = draw(st.lists(st.integers(1, max(1, min(max_len, 200))), min_size=dp * 4, max_size=60))
    return config, lengths


@settings(max_examples=120, deadline=None)
@given(plan_cases())
def test_plan_invariants(case):
    config, lengths = case
    try:
        plan = plan_step(lengths, config)
    except ValueError as err:  # only a batch too small for equal micro-batch counts may be refused
        need = re.search(r"need at least (\d+)|Cannot create (\d+) bins", str(err))
        assert need is not None, err
        assert len(lengths) < int(need.group(1) or need.group(2)), err
        assume(False)
    counts = {len(rank) for rank in plan.micro_batches}
    assert len(plan.micro_batches) == config.layout.dp and len(counts) == 1  # equal counts per DP rank
    order = plan.sample_order()
    assert sorted(order.tolist()) == list(range(len(lengths)))  # every sample exactly once
    assert np.array_equal(order[plan.inverse_permutation()], np.arange(len(lengths)))  # restores input order
    capacity = config.row_capacity()
    for rank in plan.micro_batches:
        for mb in rank:
            if config.mode != "padded":  # the padded baseline has fixed rows, not a token budget
                assert mb.padded_tokens <= capacity  # budget respected (per GPU x cp)
                assert mb.padded_tokens // config.layout.cp <= config.train_mb_tokens
            assert mb.real_tokens == sum(lengths[i] for i in mb.sample_indices)
            if config.mode != "packing":
                assert mb.shape[0] == len(mb.sample_indices)
                assert all(lengths[i] <= mb.shape[1] for i in mb.sample_indices)
                assert mb.shape[1] % config.length_multiple == 0
            else:
                assert mb.shape[1] % config.padding_rule.total_multiple == 0
                if config.use_fixed_length:
                    assert mb.shape[1] == capacity
        if config.microbatch_order == "largest_first":
            sizes = [mb.padded_tokens for mb in rank]
            assert sizes == sorted(sizes, reverse=True)


def test_same_inputs_same_plan_and_fingerprint():
    config = StepPlanConfig(train_mb_tokens=128, layout=ParallelLayout(dp=2))
    lengths = list(np.random.default_rng(0).integers(1, 100, 40))
    a, b = plan_step(lengths, config), plan_step(list(lengths), config)
    assert a == b and a.fingerprint() == b.fingerprint()
    assert a.fingerprint() != plan_step([*lengths[:-1], 7], config).fingerprint()


def test_refine_reaches_the_packer():
    # A heavy tail where MFFD's refinement removes a bin (plain MFFD is ceil(sum/C) + 1 here).
    from mcore_packing.data import sample_lengths

    lengths = sample_lengths("power_law:8", 1000, 512, seed=2)
    lower_bound = -(-int(lengths.sum()) // 512)
    refined = plan_step(lengths, StepPlanConfig(train_mb_tokens=512))
    plain = plan_step(lengths, StepPlanConfig(train_mb_tokens=512, refine=False))
    assert plain.num_microbatches == lower_bound + 1
    assert refined.num_microbatches == lower_bound
    assert sorted(refined.sample_order().tolist()) == list(range(lengths.size))
    with pytest.raises(ValueError, match="not available for 'concatenative'"):
        StepPlanConfig(algorithm="concatenative", refine=True)


def test_dynamic_micro_batches_hold_similar_lengths():
    lengths = [5, 100, 7, 98, 6, 99, 8, 97]
    plan = plan_step(lengths, StepPlanConfig(mode="dynamic", train_mb_tokens=256))
    groups = [sorted(lengths[i] for i in mb.sample_indices) for mb in plan.micro_batches[0]]
    assert all(max(g) - min(g) <= 3 for g in groups), groups


def test_padded_baseline_keeps_data_order():
    plan = plan_step([5, 9, 2, 7, 3], StepPlanConfig(mode="padded", padded_rows=2, train_mb_tokens=64))
    assert [mb.sample_indices for mb in plan.micro_batches[0]] == [(0, 1), (2, 3), (4,)]
    assert [mb.shape for mb in plan.micro_batches[0]] == [(2, 9), (2, 7), (1, 3)]


def test_logprob_budget_is_used_for_forward_only():
    lengths = [30] * 16
    config = StepPlanConfig(train_mb_tokens=64, logprob_mb_tokens=256)
    assert plan_step(lengths, config).num_microbatches == 8
    assert plan_step(lengths, config, forward_only=True).num_microbatches == 2


@pytest.mark.parametrize(
    "kwargs, lengths, fragment",
    [
        (
            {"train_mb_tokens": 100},
            [50, 120],
            "1 of 2 samples are longer than a micro-batch (100 tokens = train_mb_tokens 100 x cp 1)",
        ),
        ({"train_mb_tokens": 64, "layout": ParallelLayout(cp=2)}, [130], "Raise train_mb_tokens to at least 66"),
        ({"train_mb_tokens": 100, "logprob_mb_tokens": 50}, [60], "(50 tokens = logprob_mb_tokens 50 x cp 1)"),
        (
            {"mode": "dynamic", "layout": ParallelLayout(dp=4), "train_mb_tokens": 10},
            [9, 9],
            "same number of micro-batches",
        ),
        ({"layout": ParallelLayout(dp=4)}, [9, 9], "Cannot create 4 bins with only 2 sequences"),
        ({}, [], "global batch is empty"),
    ],
)
def test_bad_plans(kwargs, lengths, fragment):
    config = StepPlanConfig(**kwargs)
    with pytest.raises(ValueError) as err:
        plan_step(lengths, config, forward_only="logprob_mb_tokens" in kwargs)
    assert fragment in str(err.value)


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        ({"mode": "both"}, "mode must be one of packing, dynamic, padded"),
        ({"microbatch_order": "random"}, "microbatch_order"),
        ({"train_mb_tokens": 0}, "train_mb_tokens must be an integer >= 1"),
        ({"layout": (2, 1)}, "must be a ParallelLayout"),
        ({"algorithm": "magic"}, "Valid names"),
        ({"mode": "dynamic", "fixed_length": True}, "fixed_length applies to packing"),
        ({"mode": "dynamic", "fixed_shape": True}, "fixed_shape=True needs mode='packing'"),
        ({"fixed_shape": True, "fixed_length": False}, "fixed_length=False"),
        ({"logprob_mb_tokens": -3}, "logprob_mb_tokens"),
    ],
)
def test_bad_configs(kwargs, fragment):
    with pytest.raises((ValueError, TypeError)) as err:
        StepPlanConfig(**kwargs)
    assert fragment in str(err.value)


def test_fixed_shape_rows_are_full_and_their_cu_seqlens_length_bounds_every_row():
    """Every row of a fixed-shape plan has the capacity's length, and cu_seqlens_entries is two more than
    the most sequences such a row can hold (all of the shortest kind: one spare zero-length entry), whatever
    the data."""
    layout = ParallelLayout(cp=2, dp=2)
    config = StepPlanConfig(train_mb_tokens=64, layout=layout, fixed_shape=True)
    assert config.use_fixed_length and StepPlanConfig(train_mb_tokens=64, layout=layout).cu_seqlens_entries(128) is None
    rng = np.random.default_rng(3)
    plan = plan_step(rng.integers(1, 120, 40).tolist(), config)
    rows = {mb.shape for rank in plan.micro_batches for mb in rank}
    assert rows == {(1, config.row_capacity())} == {(1, 128)}
    entries = config.cu_seqlens_entries(128)
    assert entries == 128 // 4 + 2  # CP2: every sequence is padded to a multiple of 4
    tightest = plan_step([1] * 64, config)  # one-token sequences: the most a row can hold
    assert max(len(mb.sample_indices) for rank in tightest.micro_batches for mb in rank) + 2 == entries


@pytest.mark.parametrize("mode", ["packing", "dynamic"])
def test_a_memory_budget_replans_a_training_pass_under_it(mode):
    """#41: with StepPlanConfig.memory_budget and a MemoryModel, a training pass whose predicted peak at
    the token budget exceeds the byte budget is planned again at the largest multiple of 64 tokens that
    fits (every stage under it; 64 tokens more does not); a forward-only pass is untouched; a batch whose
    longest sequence alone exceeds the budget raises naming it."""
    import dataclasses

    from mcore_packing.planning import ModelShape
    from mcore_packing.planning.memory import MemorySettings
    from mcore_packing.planning.memory_budget import MemoryBudgetError, MemoryModel, plan_memory

    shape = ModelShape(num_layers=4, hidden_size=512, num_attention_heads=8, vocab_size=32000, max_sequence_length=8192)
    memory = MemoryModel(shape, MemorySettings(attention="flash"))
    lengths = np.random.default_rng(41).integers(50, 3000, 64)
    base = StepPlanConfig(mode=mode, train_mb_tokens=16384, layout=ParallelLayout(dp=2, pp=2))

    def peak(plan):
        return max(s["peak"] for s in plan_memory(plan, shape, memory.settings))

    whole = peak(plan_step(lengths, base))
    config = dataclasses.replace(base, memory_budget=int(whole * 0.7), memory_model=memory)
    plan = plan_step(lengths, config)
    fitted = plan.config.train_mb_tokens
    assert fitted < base.train_mb_tokens and fitted % 64 == 0 and peak(plan) <= config.memory_budget
    assert peak(plan_step(lengths, dataclasses.replace(base, train_mb_tokens=fitted + 64))) > config.memory_budget
    assert plan_step(lengths, config, forward_only=True).config.train_mb_tokens == base.train_mb_tokens
    longest = int(lengths.max())
    alone = dataclasses.replace(base, train_mb_tokens=-(-longest // 64) * 64)  # one sequence per micro-batch
    tight = dataclasses.replace(config, memory_budget=int(peak(plan_step([longest] * 2, alone)) * 0.9))
    with pytest.raises(MemoryBudgetError, match=r"the longest sequence \(\d+ tokens\) alone needs"):
        plan_step(lengths, tight)
