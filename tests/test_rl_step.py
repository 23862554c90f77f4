"""The GRPO policy step (`app.rl_step`): advantages, the packed log-prob pass, the training pass.

On the first step the old log-probs come from a pass packed differently (logprob_mb_tokens) from the
training pass, with the same weights: if both passes give every token the same log-prob, the ratios are
exactly 1, nothing is clipped, the approximate KL is 0, and the loss is -sum_i A_i n_i / sum_i n_i
(token-level), computed here from the advantages and response lengths alone.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from .distributed_harness import run_distributed
from .rl_workers import make_rollouts

pytestmark = pytest.mark.multirank


def test_grpo_advantages_by_hand():
    from mcore_packing.losses.rollouts import grpo_advantages

    a = grpo_advantages([1.0, 0.0, 0.0, 1.0, 5.0, 5.0], [0, 0, 0, 0, 1, 1])
    assert np.allclose(a[:4], [1, -1, -1, 1], atol=1e-5) and np.allclose(a[4:], 0)  # equal rewards: no signal
    loo = grpo_advantages([3.0, 1.0, 2.0], ["p", "p", "p"], leave_one_out=True, normalize_std=False)
    assert np.allclose(loo, [3 - 1.5, 1 - 2.5, 2 - 2.0])


def test_bad_rollouts_are_refused_naming_the_rollout():
    from mcore_packing.losses.rollouts import Rollout, check_rollouts

    ok = [Rollout(prompt_tokens=[1, 2], response_tokens=[3], reward=1.0, group_id=0)] * 2
    check_rollouts(ok)  # control
    cases = [
        ([ok[0], Rollout(prompt_tokens=[1], response_tokens=[], reward=0.0, group_id=0)], "rollout 1 .* empty"),
        ([ok[0], Rollout(prompt_tokens=[1], response_tokens=[2], reward=math.nan, group_id=0)], "reward nan"),
        ([*ok, Rollout(prompt_tokens=[1], response_tokens=[2], reward=0.0, group_id=7)], r"group\(s\) \[7\]"),
        ([ok[0], Rollout(prompt_tokens=[1], response_tokens=[2, 3], reward=0.0, group_id=0,
                         generation_logprobs=[-1.0])], "1 generation log-probs for 2 response tokens"),
    ]  # fmt: skip
    for rollouts, message in cases:
        with pytest.raises(ValueError, match=message):
            check_rollouts(rollouts)


def test_rollouts_from_jsonl(tmp_path):
    import json

    from mcore_packing.losses.rollouts import Rollout, read_rollouts_jsonl

    path = tmp_path / "rollouts.jsonl"
    rows = [{"prompt_tokens": [1, 2], "response_tokens": [3, 4], "reward": 1.0, "group_id": "q1",
             "generation_logprobs": [-0.5, -1.0]}, {"prompt_tokens": [1, 2], "response_tokens": [5], "reward": 0.0,
             "group_id": "q1"}]  # fmt: skip
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert read_rollouts_jsonl(str(path)) == [Rollout(**rows[0]), Rollout(**rows[1])]
    path.write_text(json.dumps({"prompt_tokens": [1], "reward": 1.0, "group_id": 0}) + "\n")
    with pytest.raises(ValueError, match=r"rollouts.jsonl:1 lacks \['response_tokens'\]"):
        read_rollouts_jsonl(str(path))


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2])
def test_rl_step_first_update_is_on_policy_and_exact(tmp_path, world):
    steps = run_distributed("tests.rl_workers:rl_step_worker", world, root=str(tmp_path), kl=0.05)[0]
    first = steps[0]
    rollouts = make_rollouts()
    n = np.array([len(r.response_tokens) for r in rollouts], dtype=np.float64)
    expected = -float((np.array(first["advantages"]) * n).sum() / n.sum())  # ratio 1, KL 0
    assert abs(first["loss"] - expected) <= 1e-5 * max(abs(expected), 1e-3), (first["loss"], expected)
    m = first["metrics"]
    assert abs(m["mean_ratio"] - 1) <= 1e-6 and m["clip_fraction"] == 0 and abs(m["approx_kl"]) <= 1e-9, m
    assert first["logprob_seconds"] > 0 and first["train_seconds"] > 0
    assert m["update_applied"] and m["grad_norm"] > 0
    # The second step's old log-probs come from the updated policy: again on-policy, ratio 1.
    assert abs(steps[1]["metrics"]["mean_ratio"] - 1) <= 1e-6
    assert steps[1]["loss"] != first["loss"]  # the KL to the (unchanged) reference now counts


@pytest.mark.slow
def test_rl_step_prompt_mean_cispo_at_temperature_is_on_policy(tmp_path):
    """prompt-mean, CISPO, T=0.7 through `rl_step` on 2 ranks: the log-prob pass and the training pass both
    score at T (else the first step's ratios would not be 1), and the loss is the mean over prompts of
    -sum_{i in g} A_i n_i / sum_{i in g} n_i, computed from the advantages and lengths alone."""
    steps = run_distributed("tests.rl_workers:rl_step_worker", 2, root=str(tmp_path), kl=0.0, steps=1,
                            loss_settings={"loss_agg_mode": "prompt-mean", "policy_loss_mode": "cispo"},
                            temperature=0.7)[0]  # fmt: skip
    first, rollouts = steps[0], make_rollouts()
    n = np.array([len(r.response_tokens) for r in rollouts], dtype=np.float64)
    a, groups = np.array(first["advantages"]), np.array([r.group_id for r in rollouts])
    expected = float(np.mean([-(a[groups == g] * n[groups == g]).sum() / n[groups == g].sum()
                              for g in np.unique(groups)]))  # fmt: skip
    token_mean = -float((a * n).sum() / n.sum())
    assert abs(first["loss"] - expected) <= 1e-5 * max(abs(expected), 1e-3), (first["loss"], expected)
    assert abs(token_mean - expected) > 1e-3  # the modes differ on this batch: the check can tell them apart
    m = first["metrics"]
    assert abs(m["mean_ratio"] - 1) <= 1e-6 and m["clip_fraction"] == 0 and abs(m["gen_ratio"] - 1) <= 1e-9, m
    # The control: at T=1 the log-prob pass scores other values (the entropy estimate, -mean log p, moves).
    plain = run_distributed("tests.rl_workers:rl_step_worker", 1, root=str(tmp_path / "t1"), kl=0.0, steps=1,
                            loss_settings={"loss_agg_mode": "prompt-mean", "policy_loss_mode": "cispo"})[0]  # fmt: skip
    assert abs(plain[0]["metrics"]["entropy_estimate"] - m["entropy_estimate"]) > 1e-3, (plain[0]["metrics"], m)


@pytest.mark.slow
def test_minibatches_take_one_optimizer_step_per_run_of_groups(tmp_path):
    """Two minibatches: the first (groups 0 and 1) is exactly a one-minibatch step on those groups alone;
    the second is scored against the old log-probs after the first update, so its ratio has moved."""
    both = run_distributed("tests.rl_workers:rl_step_worker", 1, root=str(tmp_path / "a"), kl=0.05, minibatches=2,
                           steps=1)[0][0]  # fmt: skip
    alone = run_distributed("tests.rl_workers:rl_step_worker", 1, root=str(tmp_path / "b"), kl=0.05, groups=2,
                            steps=1)[0][0]  # fmt: skip
    assert len(both["minibatch_losses"]) == 2 and alone["minibatch_losses"] == [alone["loss"]]
    first = both["minibatch_losses"][0]
    assert abs(first - alone["loss"]) <= 1e-6 * max(1.0, abs(alone["loss"])), (first, alone["loss"])
    assert abs(both["loss"] - sum(both["minibatch_losses"]) / 2) <= 1e-9
    assert abs(alone["metrics"]["mean_ratio"] - 1) <= 1e-6  # one update: on-policy
    assert abs(both["metrics"]["mean_ratio"] - 1) > 1e-5, both["metrics"]  # the second run saw a moved policy


def test_minibatches_keep_groups_whole():
    from mcore_packing.losses.rollouts import minibatches

    assert minibatches(["a", "b", "a", "c", "b", "c", "d"], 2) == [[0, 1, 2, 4], [3, 5, 6]]
    assert minibatches([0, 0, 1, 1], 1) == [[0, 1, 2, 3]]
    with pytest.raises(ValueError, match="num_minibatches=3 needs 1 to 2"):
        minibatches([0, 0, 1, 1], 3)


@pytest.mark.slow
def test_grpo_example_reward_rises(tmp_path):
    """The CPU example (`python -m mcore_packing grpo`), 25 steps: the mean reward of the last five steps is
    well above that of the first five (the full 60-step curve is in docs/guides/rl.md)."""
    records = run_distributed(
        "tests.rl_workers:grpo_example_worker", 1, root=str(tmp_path), steps=25, warmup_steps=10, timeout=600
    )[0]
    rewards = [r["mean_reward"] for r in records]
    first, last = np.mean(rewards[:5]), np.mean(rewards[-5:])
    assert last > first + 0.08, rewards
    assert all(r["logprob_seconds"] > 0 and r["train_seconds"] > 0 for r in records)
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 25
