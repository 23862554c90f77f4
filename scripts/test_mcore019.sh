#!/usr/bin/env bash
# The megatron-core 0.19.2 lane: the tests that touch Megatron's API (schedules and their CUDA call sites,
# context parallelism, the interleaved schedule, HF import, the optimizer and dist_checkpointing, the DPO and
# policy-gradient steps with the output-layer hooks of temperature and entropy, log-probs in chunks (the output
# layer's forward and the model's loss replaced), the memory model against what the model saves, a reward
# model's head and its
# checkpoint, the version-pinned patches), in the second environment
# (scripts/setup_env_mcore019.sh). The full suite runs on 0.16.1 (scripts/test.sh); the checkpoint folder's
# own logic (a killed save, a truncated checkpoint) runs there only. To keep CI's time, the checkpoint tests run
# with the distributed optimizer only, and these run on 0.16.1 only: test_pg_objectives (test_pg_packed's
# single-rank steps and test_chunked_logprobs cover the same Megatron calls), the interleaved trainer through
# checkpoints (the interleaved schedule's equivalence tests stay), and test_layouts (DP2/CP2: covered by
# test_step_equivalence and test_dynamic_cp).
# Other arguments go to pytest. Workers as in scripts/test.sh (MCORE_PACKING_TEST_WORKERS, 2 by default).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$root/scripts/setup_env.sh"  # the 0.16.1 venv writes the checkpoints that 0.19.2 resumes
"$root/scripts/setup_env_mcore019.sh"
venv="${MCORE019_VENV:-$root/.venv-mcore019}"
cd "$root"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
export MCORE_PACKING_016_PYTHON="${MCORE_PACKING_016_PYTHON:-${MCORE_PACKING_VENV:-$root/.venv}/bin/python}"
"$venv/bin/python" -m pytest -n "${MCORE_PACKING_TEST_WORKERS:-2}" --dist loadfile -p no:cacheprovider --durations=15 \
  -W "ignore::UserWarning" \
  tests/test_patches.py tests/test_megatron_units.py tests/test_checkpoint.py \
  --deselect tests/test_checkpoint.py::test_sigkill_during_a_save_leaves_the_previous_checkpoint_usable \
  --deselect tests/test_checkpoint.py::test_a_truncated_checkpoint_is_skipped_by_name_then_refused_alone \
  --deselect "tests/test_checkpoint.py::test_a_checkpoint_written_with_megatron_core_0_16_resumes_on_this_release[False]" \
  --deselect "tests/test_checkpoint.py::test_resume_on_another_layout_continues_the_same_run[False]" \
  "tests/test_step_equivalence.py::test_two_ranks_match_reference" \
  tests/test_megatron_packed.py tests/test_dpo_packed.py \
  "tests/test_pg_packed.py::test_single_rank_packed_and_dynamic_pg_equal_unpacked" \
  tests/test_chunked_logprobs.py \
  tests/test_memory_model.py tests/test_router_replay.py \
  "tests/test_rm.py::test_the_train_command_trains_a_reward_model_and_refuses_dpos_bad_pairs" \
  "tests/test_hf_conversion.py::test_each_family_imports_with_hf_logits" \
  "tests/test_hf_conversion.py::test_tp2_pp2_together" \
  "tests/test_rl_step.py::test_rl_step_first_update_is_on_policy_and_exact" \
  "tests/test_interleaved.py::test_the_simulated_order_is_megatrons_schedule_table" \
  "tests/test_interleaved.py::test_pp2_vpp2_packed_and_dynamic_match_the_unpacked_reference" \
  "tests/test_interleaved.py::test_batched_p2p_at_pp2_breaks_the_interleaved_step" \
  "tests/test_dynamic_cp.py::test_dynamic_cp_steps_match_the_unpacked_reference" \
  tests/test_te_contract.py tests/test_collectives.py tests/test_sync_budget.py tests/test_gpu_check.py \
  tests/test_seeded_init.py \
  "$@"
