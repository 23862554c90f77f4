"""The interleaved (virtual-pipeline) 1F1B schedule: the planner's micro-batch counts, the simulator, and
exact steps through Megatron's real interleaved schedule on gloo ranks.

References: the unpacked single-process step of `step_workers.reference_worker` (stock GPTModel, one
sequence per forward, plain torch loss); Megatron's own schedule table and warm-up counts for the
simulator's order; closed forms for equal micro-batches. Negative control: Megatron's batched P2P at pp=2
(both neighbours the same rank) under the interleaved schedule, which pairs an activation with a
gradient's receive.
"""

from __future__ import annotations

import numpy as np
import pytest

from mcore_packing.planning import CostModel, ParallelLayout, StepPlanConfig, plan_step
from mcore_packing.planning.pipeline import (
    best_pipeline_order,
    check_interleaved_count,
    interleaved_table,
    pipeline_lower_bound,
    simulate_1f1b,
)

from .distributed_harness import run_distributed
from .test_step_equivalence import SAMPLES, check, check_logprobs, errors, run_configs

# ---------------------------------------------------------------- planner and simulator (numpy only)


@pytest.mark.parametrize("pp,vpp,m", [(2, 2, 4), (2, 2, 2), (4, 2, 8), (4, 2, 12), (4, 4, 8), (2, 3, 6)])
def test_equal_micro_batches_run_in_the_interleaved_closed_form(pp, vpp, m):
    """m equal micro-batches (f = 1, b = 2): m (f + b) of work plus a bubble of (pp - 1)(f + b) / vpp."""
    expected = m * 3.0 + (pp - 1) * 3.0 / vpp
    assert simulate_1f1b([1.0] * m, pp, vpp=vpp) == pytest.approx(expected)
    assert pipeline_lower_bound([1.0] * m, pp, vpp=vpp) == pytest.approx(expected)
    assert simulate_1f1b([1.0] * m, pp) == pytest.approx((m + pp - 1) * 3.0)  # vpp shrinks the plain bubble


def test_interleaved_simulation_is_bounded_and_the_chosen_order_no_slower():
    rng = np.random.default_rng(0)
    for _ in range(100):
        pp, vpp = int(rng.choice([2, 4])), int(rng.choice([2, 3]))
        group = pp + int(rng.integers(0, 3))
        m = group * int(rng.integers(1, 4))
        f = rng.lognormal(0.0, 1.0, m)
        bound = pipeline_lower_bound(f, pp, vpp=vpp)
        given = simulate_1f1b(f, pp, vpp=vpp, group=group)
        chosen = simulate_1f1b(f[best_pipeline_order(f, pp, vpp=vpp, group=group)], pp, vpp=vpp, group=group)
        assert bound * (1 - 1e-9) <= chosen <= given * (1 + 1e-9)


def test_interleaved_counts_follow_megatrons_rules():
    check_interleaved_count(4, 2, 2)
    check_interleaved_count(5, 2, 3)  # a last group of 2 >= pp
    for m, pp, group in [(1, 2, 2), (3, 2, 2), (4, 2, 3), (7, 4, 4)]:
        with pytest.raises(ValueError, match="interleaved schedule"):
            check_interleaved_count(m, pp, group)
    with pytest.raises(ValueError, match="at least pp=4"):
        check_interleaved_count(8, 4, 2)


def test_layout_refuses_what_megatron_would():
    with pytest.raises(ValueError, match=r"vpp=2 .* pp=1"):
        ParallelLayout(vpp=2)
    with pytest.raises(ValueError, match="microbatch_group_size_per_vp_stage=1 must be at least pp=2"):
        ParallelLayout(pp=2, vpp=2, microbatch_group_size_per_vp_stage=1)
    with pytest.raises(ValueError, match="num_layers=6 cannot be split into pp x vpp = 2 x 2"):
        ParallelLayout(pp=2, vpp=2).check_layers(6)
    ParallelLayout(pp=2, vpp=3).check_layers(6)


LENGTHS = np.random.default_rng(1).lognormal(5.5, 1.0, 4000).astype(np.int64).clip(8, 4000)


@pytest.mark.parametrize("mode", ["packing", "dynamic"])
@pytest.mark.parametrize(
    "layout",
    [ParallelLayout(pp=4, vpp=2, dp=2), ParallelLayout(pp=2, vpp=2, dp=3, microbatch_group_size_per_vp_stage=3)],
)
def test_plans_give_every_rank_whole_groups_and_counts_vary_by_step(mode, layout):
    """Per step: equal counts on every DP rank, a multiple of the group, the schedule's rules met; across
    steps of different lengths the count varies (dynamic micro-batch counts), and every sample is planned
    exactly once."""
    config = StepPlanConfig(mode=mode, train_mb_tokens=4096, layout=layout, fixed_length=False if mode == "packing"
                            else None, cost_model=CostModel(linear=1.0, quadratic=1e-4))  # fmt: skip
    counts = set()
    for step in range(6):
        batch = LENGTHS[step * 256 : step * 256 + 64 + 32 * step]
        plan = plan_step(batch, config)
        per_rank = [len(rank) for rank in plan.micro_batches]
        assert len(set(per_rank)) == 1 and per_rank[0] % layout.microbatch_group == 0, per_rank
        check_interleaved_count(per_rank[0], layout.pp, layout.microbatch_group)
        planned = sorted(i for rank in plan.micro_batches for mb in rank for i in mb.sample_indices)
        assert planned == list(range(batch.size))
        counts.add(per_rank[0])
    assert len(counts) > 1, counts


def test_auto_order_simulates_the_interleaved_schedule():
    """`microbatch_order=auto` picks each rank's order by the interleaved simulation, never worse than the
    packer's order by that same simulation."""
    layout = ParallelLayout(pp=4, vpp=2, dp=2)
    kwargs = dict(mode="packing", train_mb_tokens=4096, layout=layout, cost_model=CostModel(linear=1.0, quadratic=1e-3))
    auto = plan_step(LENGTHS[:300], StepPlanConfig(microbatch_order="auto", **kwargs))
    packer = plan_step(LENGTHS[:300], StepPlanConfig(microbatch_order="packer", **kwargs))

    def step_time(plan):
        return max(simulate_1f1b(np.array([mb.cost for mb in rank]) / 3, 4, vpp=2) for rank in plan.micro_batches)

    assert step_time(auto) <= step_time(packer) * (1 + 1e-9)


def test_a_batch_too_small_for_one_group_per_rank_is_refused_naming_the_group():
    config = StepPlanConfig(mode="dynamic", train_mb_tokens=100, layout=ParallelLayout(pp=4, vpp=2))
    with pytest.raises(ValueError, match=r"microbatch_group_size_per_vp_stage=4 .*need at least 4"):
        plan_step([5, 6, 7], config)


# ---------------------------------------------------------------- against Megatron's own schedule


def test_the_simulated_order_is_megatrons_schedule_table():
    """`interleaved_table` (the order the simulator runs a stage's chunks in) is Megatron's own schedule
    table, for counts with and without a remainder group."""
    from megatron.core.pipeline_parallel.schedules import get_schedule_table

    for m, vpp, group in [(4, 2, 2), (5, 2, 3), (8, 2, 4), (10, 3, 4), (6, 2, 6)]:
        assert interleaved_table(m, vpp, group) == get_schedule_table(m, vpp, group)


# ---------------------------------------------------------------- exact steps on gloo ranks

TWO_RANKS = [
    {"mode": "packing", "pp": 2, "vpp": 2, "train_mb_tokens": 48, "logprobs": True},  # fixed rows, 6 per rank
    {"mode": "packing", "pp": 2, "vpp": 2, "variable_seq_lengths": True, "microbatch_order": "auto"},
    {"mode": "dynamic", "pp": 2, "vpp": 2, "variable_seq_lengths": True, "logprobs": True},
]


@pytest.fixture(scope="module")
def reference():
    return run_distributed("tests.step_workers:reference_worker", 1, samples=SAMPLES)[0]


@pytest.mark.multirank
def test_pp2_vpp2_packed_and_dynamic_match_the_unpacked_reference(reference):
    """Each stage holds two chunks (layers 0 and 2 on stage 0, 1 and 3 on stage 1), the embedding in the
    first stage's first chunk, the head in the last stage's last chunk; loss <= 1e-6, gradients <= 1e-5."""
    for result in run_configs(2, TWO_RANKS, reference):
        check(result, reference)
        if result["config"].get("logprobs"):
            check_logprobs(result, reference)
        assert result["stage_layers"] == {0: [(0, 1, True, False), (2, 1, False, False)],
                                          1: [(1, 1, False, False), (3, 1, False, True)]}  # fmt: skip
        assert result["num_microbatches"] % 2 == 0


@pytest.mark.multirank
def test_batched_p2p_at_pp2_breaks_the_interleaved_step(reference):
    """Negative control: with Megatron's batched P2P (what mcore_packing turns off under vpp > 1) the
    same step's gradients are far off: at pp=2 the previous and the next stage are one rank."""
    (result,) = run_configs(2, [{"mode": "packing", "pp": 2, "vpp": 2, "train_mb_tokens": 48,
                                 "negative": "batched_p2p"}], reference)  # fmt: skip
    assert errors(result, reference)[1] > 0.1, errors(result, reference)


FOUR_RANKS = [
    {"mode": "packing", "pp": 4, "logprobs": True},  # fixed-length rows through two middle stages
    {"mode": "dynamic", "pp": 4, "variable_seq_lengths": True, "microbatch_order": "auto"},
    {"mode": "dynamic", "pp": 2, "vpp": 2, "variable_seq_lengths": True, "logprobs": True},  # DP=2
]


@pytest.mark.multirank
@pytest.mark.slow
def test_pp4_middle_stages_and_pp2_vpp2_dp2_match_the_unpacked_reference(reference):
    """PP4: stages 1 and 2 hold neither the embedding nor the head, and still attend within each packed
    sequence (every stage's forward step gets the micro-batch's PackedSeqParams, not only the first)."""
    for result in run_configs(4, FOUR_RANKS, reference):
        check(result, reference)
        if result["config"].get("logprobs"):
            check_logprobs(result, reference)
        if result["config"]["pp"] == 4:
            assert result["stage_layers"] == {s: [(s, 1, s == 0, s == 3)] for s in range(4)}


@pytest.mark.multirank
@pytest.mark.slow
def test_the_trainer_at_pp2_vpp2_continues_pp1_runs_through_checkpoints(tmp_path):
    """The real trainer, `build_gpt_chunks` and Megatron's optimizer: a PP1 x DP2 checkpoint resumed at
    PP2 x VPP2 (packed, and dynamic) gives the PP1 run's losses, and an interleaved checkpoint resumed at
    PP1 the interleaved run's."""
    out = run_distributed("tests.checkpoint_workers:interleaved_resume_worker", 2, root=str(tmp_path), timeout=900)[0]
    for name, straight in [("vpp_packed", "straight"), ("vpp_dynamic", "straight"), ("pp1_from_vpp", "straight_vpp")]:
        assert out[name]["steps"] == [3, 4]
        assert out[name]["sample_ids"] == out[straight]["sample_ids"][2:]
        got, want = np.array(out[name]["losses"]), np.array(out[straight]["losses"][2:])
        assert np.abs(got - want).max() / np.abs(want).max() <= 1e-5, (name, got, want)
