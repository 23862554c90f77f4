"""Bad input to the step driver and planner configs fails with a clear error (and never hangs)."""

from __future__ import annotations

import dataclasses
import types

import pytest
import torch

from mcore_packing.megatron.schedule import _check_samples, _check_schedule_config
from mcore_packing.megatron.step_loss import PerSequence
from mcore_packing.planning import ParallelLayout, StepPlanConfig, plan_step
from mcore_packing.thd import SequenceSample

from .distributed_harness import run_distributed


@pytest.mark.multirank
def test_ranks_with_different_plans_raise_instead_of_hanging():
    results = run_distributed("tests.step_workers:plan_mismatch_worker", 2, timeout=120)
    messages = [m for pair in results for m in pair]  # different lengths; then different group ids
    assert all(m is not None and "Step plans differ across ranks" in m for m in messages), messages


def test_dynamic_with_pp_needs_variable_seq_lengths():
    plan = plan_step([5, 9, 12, 3], StepPlanConfig(mode="dynamic", train_mb_tokens=32, layout=ParallelLayout(pp=2)))
    with pytest.raises(ValueError, match="Dynamic batching with pipeline parallelism needs variable"):
        _check_schedule_config(plan, types.SimpleNamespace(variable_seq_lengths=False))
    _check_schedule_config(plan, types.SimpleNamespace(variable_seq_lengths=True))
    plan = plan_step([5, 9], StepPlanConfig(train_mb_tokens=32, layout=ParallelLayout(pp=2), fixed_length=False))
    with pytest.raises(ValueError, match="fixed_length=True"):
        _check_schedule_config(plan, types.SimpleNamespace(variable_seq_lengths=False))


def test_the_model_chunks_must_match_the_planned_vpp():
    vsl = types.SimpleNamespace(variable_seq_lengths=True)
    interleaved = ParallelLayout(pp=2, vpp=2)
    plan = plan_step([5, 9, 12, 3], StepPlanConfig(mode="dynamic", train_mb_tokens=32, layout=interleaved))
    with pytest.raises(ValueError, match="made for vpp=2 model chunks per stage but the model has 1"):
        _check_schedule_config(plan, vsl, 1)
    _check_schedule_config(plan, vsl, 2)
    plain = plan_step([5, 9, 12, 3], StepPlanConfig(mode="dynamic", train_mb_tokens=32, layout=ParallelLayout(pp=2)))
    with pytest.raises(ValueError, match="made for vpp=1 model chunks per stage but the model has 2"):
        _check_schedule_config(plain, vsl, 2)


def test_samples_must_match_the_plan():
    plan = plan_step([3, 4], StepPlanConfig(train_mb_tokens=32))
    with pytest.raises(ValueError, match="the plan covers 2 samples but 1 were given"):
        _check_samples([SequenceSample([1, 2, 3])], plan)
    with pytest.raises(ValueError, match="sample 1 has 5 tokens but the plan says 4"):
        _check_samples([SequenceSample([1, 2, 3]), SequenceSample([1, 2, 3, 4, 5])], plan)


def test_sequence_loss_with_wrong_shape_names_what_was_expected():
    from mcore_packing.thd import PaddingRule, StepTotals, build_packed_batch

    batch = build_packed_batch([SequenceSample([1, 2, 3]), SequenceSample([4, 5])], PaddingRule())
    prep = types.SimpleNamespace(packed=batch, full_loss_mask=batch.loss_mask[0], sample_ids=batch.sample_ids,
                                 real_lengths=batch.seq_lengths, target_counts=(2.0, 1.0), shared=None)  # fmt: skip
    process_groups = types.SimpleNamespace(cp_size=1, cp_rank=0)
    output = torch.rand(1, batch.total_tokens)
    with pytest.raises(ValueError, match=r"scalar \(0-d\) tensor for each sequence, got \(2,\)"):
        PerSequence(lambda lp, m: lp * m).micro_batch_sum(prep, output, process_groups, StepTotals(3, 2))
    value = PerSequence(lambda lp, m: (lp * m).sum()).micro_batch_sum(prep, output, process_groups, StepTotals(3, 2))
    assert value.dim() == 0


def test_nemo_rl_sections():
    config = StepPlanConfig.from_nemo_rl(
        sequence_packing={"enabled": True, "train_mb_tokens": 512, "algorithm": "modified_first_fit_decreasing"},
        dynamic_batching={"enabled": False},
        layout=ParallelLayout(dp=2),
    )
    assert config.mode == "packing" and config.train_mb_tokens == 512 and config.layout.dp == 2
    config = StepPlanConfig.from_nemo_rl(dynamic_batching={"enabled": True, "train_mb_tokens": 256})
    assert config.mode == "dynamic"
    with pytest.raises(ValueError, match=r"both true\. They are two ways"):
        StepPlanConfig.from_nemo_rl(sequence_packing={"enabled": True}, dynamic_batching={"enabled": True})
    with pytest.raises(ValueError, match=r"Unknown key\(s\) \['algorithm'\] in dynamic_batching"):
        StepPlanConfig.from_nemo_rl(dynamic_batching={"enabled": True, "algorithm": "ffd"})
    with pytest.raises(ValueError, match="enable one"):
        StepPlanConfig.from_nemo_rl()


def test_a_dynamic_cp_plan_needs_its_sub_groups_one_chunk_and_its_domain():
    """`forward_backward` of a dynamic-CP plan refuses, before any collective, process groups without the
    CP sub-groups, several chunks, and a run whose DP x CP domain is not the plan's (a world of one here:
    ``None`` groups are a single rank, as everywhere on the step path)."""
    from mcore_packing.megatron import ProcessGroups
    from mcore_packing.megatron.dynamic_cp import _check
    from mcore_packing.megatron.process_groups import DynamicCPGroups

    plan = plan_step([5, 9, 12, 3], StepPlanConfig(train_mb_tokens=16, layout=ParallelLayout(cp=2), dynamic_cp=True))
    dense = types.SimpleNamespace(config=types.SimpleNamespace(num_moe_experts=None))
    one_rank = ProcessGroups(types.SimpleNamespace(pp=None, dp_cp=None))
    with pytest.raises(ValueError, match=r"no dynamic-CP sub-groups: pass ProcessGroups\.from_megatron\(\)"):
        _check(dense, plan, one_rank, verify=False)
    with pytest.raises(ValueError, match="one model chunk per rank"):
        _check([dense, dense], plan, one_rank, verify=False)
    groups = DynamicCPGroups(groups={}, rank=0, size=1, max_cp=1)
    with pytest.raises(ValueError, match="the plan is for 2 DP x CP ranks but this run has 1"):
        _check(dense, plan, dataclasses.replace(one_rank, dynamic_cp=groups), verify=False)


def test_a_reward_model_runs_only_value_losses_and_a_language_model_only_log_prob_losses():
    from mcore_packing.megatron.schedule import _check_head

    reward = types.SimpleNamespace(config=types.SimpleNamespace(mcore_packing_head="reward"))
    language = types.SimpleNamespace(config=types.SimpleNamespace(mcore_packing_head="lm"))
    with pytest.raises(ValueError, match=r"this model is a reward model .* no log-probs"):
        _check_head(reward, uses_labels=True)
    with pytest.raises(ValueError, match=r"build it with build_policy\(..., head='reward'\)"):
        _check_head(language, uses_labels=False)
    _check_head(reward, uses_labels=False)  # the controls: each with its own kind of loss
    _check_head([language], uses_labels=True)


def test_routes_are_laid_out_like_the_tokens_and_never_dropped_silently():
    """`prepare` puts each sample's routes at its tokens (-1 at pads and a missing last row) and refuses rows
    that do not match the tokens; routes reaching a model without replay, and a rollout with routes sent to
    a prepared store, are refused rather than ignored."""
    import numpy as np

    from mcore_packing.app.prepare_records import _one_rollout
    from mcore_packing.megatron.moe_inputs import _replay_routes
    from mcore_packing.megatron.prepare import _routes

    a, b = np.array([[[0, 1]], [[2, 3]], [[1, 2]]]), np.array([[[3, 0]]])  # 3 tokens; 2 tokens, last row missing
    laid = _routes([SequenceSample([5, 6, 7], None, a), SequenceSample([8, 9], None, b)], [0, 4], 8)
    assert laid[:3].tolist() == a.tolist() and laid[4].tolist() == b[0].tolist()
    assert (laid[[3, 5, 6, 7]] == -1).all()  # the pad after the first sample, the second's last token, the row's pads
    with pytest.raises(ValueError, match="a sample of 3 tokens has 1 rows of routed_experts"):
        _routes([SequenceSample([5, 6, 7], None, b)], [0], 4)
    chunk = types.SimpleNamespace(config=types.SimpleNamespace(sequence_parallel=False))
    with pytest.raises(ValueError, match=r"the model replays no routes: call install_router_replay\(model\)"):
        _replay_routes(types.SimpleNamespace(routes=laid[None]), chunk, None)
    record = {"prompt_tokens": [1], "response_tokens": [2], "reward": 1.0, "group_id": 0, "routed_experts": a[:2]}
    with pytest.raises(ValueError, match=r"r\.jsonl:1 carries routed_experts, which a prepared store does not hold"):
        _one_rollout("r.jsonl:1", record)
