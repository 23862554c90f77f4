"""``algorithm=grpo`` through the train command: rollouts from JSONL, whole groups per step, the RL metrics,
the same losses on other layouts and modes, exact resume, and clear errors for bad rollouts.

The clipped loss itself is checked against a plain-torch reference in `test_pg_packed.py`; here the
checks are of the run around it, against facts computed from the rollouts file independently.
"""

from __future__ import annotations

import json
from dataclasses import asdict

import numpy as np
import pytest

from .rl_workers import make_rollouts
from .test_train import metrics, train

GRPO = [
    "algorithm=grpo",
    "grpo.num_prompts_per_step=3",
    "grpo.num_generations_per_prompt=4",
    "grpo.keep_groups_together=true",
    "loss_fn.reference_policy_kl_penalty=0.05",
    "loss_fn.ratio_clip_max=0.28",
    # #39's keys through the command: an aggregation mode, the sampling temperature, the exact entropy bonus
    "loss_fn.loss_agg_mode=seq-mean-token-sum",
    "grpo.temperature=0.8",
    "loss_fn.entropy_coeff=0.001",
    "optimizer.lr_warmup_iters=0",
    "optimizer.lr_decay_style=constant",  # a schedule that does not depend on training.steps (resume extends it)
    "optimizer.lr=0.003",
    "sequence_packing.train_mb_tokens=96",
    "sequence_packing.logprob_mb_tokens=160",
    "dynamic_batching.train_mb_tokens=96",
]


@pytest.fixture(scope="module")
def rollouts_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("rollouts") / "rollouts.jsonl"
    rows = [asdict(r) for r in make_rollouts(groups=8, per_group=4)]
    for row in rows:
        row["group_id"] = f"prompt-{row['group_id']}"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path, rows


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory, rollouts_file):
    run_dir = tmp_path_factory.mktemp("grpo") / "straight"
    proc = train(run_dir, *GRPO, f"grpo.rollouts={rollouts_file[0]}", "training.steps=4")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return metrics(run_dir)


def test_each_step_takes_whole_groups_and_logs_the_rl_metrics(straight_run, rollouts_file):
    _, rows = rollouts_file
    assert [r["step"] for r in straight_run] == [1, 2, 3, 4]
    for record in straight_run:
        ids = record["sample_ids"]
        assert len(ids) == 12  # 3 prompts x 4 responses
        groups = {rows[i]["group_id"] for i in ids}
        assert len(groups) == 3 and all(sum(r["group_id"] == g for r in rows) == 4 for g in groups)
        assert record["mean_reward"] == pytest.approx(np.mean([rows[i]["reward"] for i in ids]), abs=1e-12)
        assert 0.0 <= record["clip_fraction"] <= 1.0 and record["approx_kl"] >= 0.0
        assert record["mean_ratio"] == pytest.approx(1.0, abs=1e-5)  # one update per batch: on-policy
        # -log p of the sampled tokens under a fresh model over 128 ids is about log(128) = 4.85
        assert 4.0 < record["entropy_estimate"] < 6.0
        assert 4.0 < record["entropy"] < np.log(128)  # the exact entropy, at most the uniform distribution's
        assert record["logprob_pass_s"] > 0 and record["train_pass_s"] > 0
    assert straight_run[0]["reference_kl"] == pytest.approx(0.0, abs=1e-7)  # policy == reference at step 1
    assert all(r["reference_kl"] > 1e-6 for r in straight_run[1:])  # the updates moved the policy away


def test_resume_continues_with_the_same_losses(tmp_path, straight_run, rollouts_file):
    run_dir = tmp_path / "resumed"
    rollouts = f"grpo.rollouts={rollouts_file[0]}"
    first = train(run_dir, *GRPO, rollouts, "training.steps=2")
    assert first.returncode == 0, first.stderr[-3000:]
    second = train(run_dir, *GRPO, rollouts, "training.steps=4", "resume=true")
    assert second.returncode == 0, second.stderr[-3000:]
    resumed = {r["step"]: r for r in metrics(run_dir)}
    for expected in straight_run[2:]:
        got = resumed[expected["step"]]
        assert got["sample_ids"] == expected["sample_ids"]
        assert abs(got["loss"] - expected["loss"]) <= 1e-6 * max(1.0, abs(expected["loss"])), (got, expected)


@pytest.mark.slow
@pytest.mark.parametrize(
    "layout",
    [
        ["parallel.cp=2"],
        # groups whole in the BSHD micro-batches of the log-prob pass: two groups of 4 rows x <= 41 tokens fit
        # 384, so 3 groups make 2 micro-batches, one per DP rank
        ["sequence_packing.enabled=false", "dynamic_batching.enabled=true", "dynamic_batching.logprob_mb_tokens=384"],
        # dynamic CP: the training pass's responses over 24 tokens run on both ranks, the rest on one; the
        # log-prob pass keeps each group of 4 in one row (160 per rank: CP 1)
        ["parallel.cp=2", "context_parallel.dynamic=true", "sequence_packing.train_mb_tokens=24"],
    ],
    ids=["packed-cp2", "dynamic-dp2", "dynamic-cp2"],
)
def test_two_ranks_give_the_single_rank_losses(tmp_path, straight_run, rollouts_file, layout):
    proc = train(tmp_path, *GRPO, f"grpo.rollouts={rollouts_file[0]}", "training.steps=4", *layout, torchrun=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    if "context_parallel.dynamic=true" in layout:
        sizes = [r["cp_sizes"] for r in metrics(tmp_path)]
        assert all(s["1"] and s["2"] for s in sizes), sizes  # rows of both CP sizes in every training pass
    for got, expected in zip(metrics(tmp_path), straight_run, strict=True):
        assert abs(got["loss"] - expected["loss"]) <= 1e-5 * max(1.0, abs(expected["loss"])), (got, expected)
        assert got["reference_kl"] == pytest.approx(expected["reference_kl"], rel=1e-4, abs=1e-9)


def test_a_shared_prompt_gives_the_same_losses_from_fewer_tokens(tmp_path, straight_run, rollouts_file):
    """grpo.shared_prefix=true (#40), here under dynamic batching (the library's tests run packing too):
    every pass lays a group's prompt out once, in THD rows among the BSHD ones (the log-prob pass's budget
    holds every group shared, the training pass's not all: those fall back to BSHD rows); the losses and
    the KL to the reference are the packed run's without it, and each step computes P + sum(R)
    tokens per shared group."""
    _, rows = rollouts_file
    dynamic = ["sequence_packing.enabled=false", "dynamic_batching.enabled=true",
               "dynamic_batching.logprob_mb_tokens=384"]
    proc = train(tmp_path, *GRPO, f"grpo.rollouts={rollouts_file[0]}", "training.steps=4", "grpo.shared_prefix=true",
                 *dynamic)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    for got, expected in zip(metrics(tmp_path), straight_run, strict=True):
        assert got["sample_ids"] == expected["sample_ids"]
        assert abs(got["loss"] - expected["loss"]) <= 1e-5 * max(1.0, abs(expected["loss"])), (got, expected)
        assert got["reference_kl"] == pytest.approx(expected["reference_kl"], rel=1e-4, abs=1e-9)
        ids, shared = got["sample_ids"], got["shared_prefix"]
        alone = set(shared["fallback_groups"])  # too big to share in one micro-batch: separate sequences
        computed = separate = 0
        for group in {rows[i]["group_id"] for i in ids}:
            members = [rows[i] for i in ids if rows[i]["group_id"] == group]
            prompt, responses = len(members[0]["prompt_tokens"]), sum(len(m["response_tokens"]) for m in members)
            separate += len(members) * prompt + responses
            computed += len(members) * prompt + responses if group in alone else prompt + responses
        assert shared["computed_tokens"] == computed < separate
        assert shared["separate_tokens"] == got["useful_tokens"] == separate
        assert shared["shared_groups"] + len(alone) == 3 and shared["shared_groups"] > 0


def test_minibatches_are_optimizer_steps_of_the_lr_schedule(tmp_path, rollouts_file):
    """3 GRPO steps x 2 minibatches = 6 optimizer steps: cosine decay over 6, so GRPO step 2 starts at
    optimizer step 3 with lr 0.003 * (1 + cos(pi * 2 / 6)) / 2 (over 3 steps it would be a third of that)."""
    overrides = ["grpo.num_minibatches=2", "optimizer.lr_decay_style=cosine", "training.steps=3"]
    proc = train(tmp_path, *GRPO, f"grpo.rollouts={rollouts_file[0]}", *overrides)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = metrics(tmp_path)
    expected = [0.003 * (1 + np.cos(np.pi * k / 6)) / 2 for k in (0, 2, 4)]
    assert [r["lr"] for r in records] == pytest.approx(expected, rel=1e-6)
    assert all(r["microbatches_per_rank"] >= 2 for r in records)  # both minibatches' micro-batches
    assert abs(records[0]["mean_ratio"] - 1) > 1e-6  # the second minibatch saw the first one's update


def _write(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return f"grpo.rollouts={path}"


@pytest.mark.parametrize(
    ("change", "overrides", "fragment"),
    [
        (lambda rows: rows[0].update(response_tokens=[]), [], "r.jsonl:1 (group 'prompt-0') has an empty response"),
        (lambda rows: rows[5].update(reward=float("nan")), [], "r.jsonl:6 (group 'prompt-1') has reward nan"),
        (lambda rows: rows[2].update(generation_logprobs=[-1.0]), [], "r.jsonl:3 has 1 generation log-probs for"),
        (lambda rows: rows.pop(1), [], "grpo.num_generations_per_prompt=4, but group(s) [('prompt-0', 3)]"),
        (lambda rows: rows[0].pop("reward"), [], ":1 lacks ['reward']"),
        (lambda rows: rows[3].update(response_tokens=[5, -1]), [], "r.jsonl:4 (group 'prompt-0'): response_tokens"),
        (lambda rows: rows[3].update(prompt_tokens=[5, 1.5]), [], "prompt_tokens holds [1.5]; token ids are integers"),
        (lambda rows: rows[4].update(generation_logprobs=[0.5] * len(rows[4]["response_tokens"])), [],
         "generation_logprobs must be numbers <= 0"),
        (lambda rows: rows[6].update(reward="1.0"), [], "r.jsonl:7 (group 'prompt-1') has reward '1.0': a reward is"),
        (None, ["grpo.num_prompts_per_step=9"], "grpo.num_prompts_per_step=9 is more than the 8 groups"),
        (None, ["sequence_packing.enabled=false"], "grpo.keep_groups_together=true keeps a group in one micro-batch"),
        (None, ["sequence_packing.logprob_mb_tokens=96"], "Raise sequence_packing.logprob_mb_tokens (x cp) to"),
        (None, ["grpo.num_prompts_per_step=1", "cluster.gpus_per_node=2"], "fewer than the 2 data-parallel ranks"),
        (None, ["grpo.num_minibatches=4"], "grpo.num_minibatches=4 is more than num_prompts_per_step=3"),
        (None, ["loss_fn.ratio_clip_c=0.5"], "loss_fn.ratio_clip_c=0.5 must be > 1"),
        (None, ["loss_fn.kl_estimator=k2"], "loss_fn.kl_estimator must be one of k1, k3"),
        (None, ["algorithm=ppo"], "algorithm must be one of sft, grpo, dpo, rm"),
        (None, ["grpo.shared_prefix=true", "parallel.cp=2", "cluster.gpus_per_node=2"],
         "grpo.shared_prefix=true: it runs without context parallelism (parallel.cp=2): set parallel.cp=1"),
        (lambda rows: rows[1].update(prompt_tokens=[*rows[1]["prompt_tokens"][:-1], 0]), ["grpo.shared_prefix=true"],
         "grpo.shared_prefix: group 'prompt-0' holds different prompts (rollout 1 differs from rollout 0)"),
    ],
)
def test_bad_rollouts_and_settings_exit_2_naming_the_fix(tmp_path, rollouts_file, change, overrides, fragment):
    rows = [dict(r) for r in rollouts_file[1]]
    if change is not None:
        change(rows)
    proc = train(tmp_path / "run", *GRPO, _write(tmp_path / "r.jsonl", rows), *overrides, "--dry-run")
    assert proc.returncode == 2, (proc.stdout[-2000:], proc.stderr[-2000:])
    assert fragment in proc.stderr, proc.stderr[-2000:]


def test_training_without_rollouts_names_the_key(tmp_path):
    proc = train(tmp_path, *GRPO)
    assert proc.returncode == 2 and "algorithm=grpo needs grpo.rollouts=/path/rollouts.jsonl" in proc.stderr


def test_a_grpo_recipe_dry_run_plans_rollouts_and_checks_without_them(tmp_path):
    rng = np.random.default_rng(0)
    rows = []
    for g in range(64):
        prompt = rng.integers(0, 152_000, int(rng.integers(50, 400))).tolist()
        for _ in range(8):
            length = int(min(15_000, rng.zipf(1.6) * 40 + 10))  # most short, a few near the limit
            rows.append({"prompt_tokens": prompt, "response_tokens": rng.integers(0, 152_000, length).tolist(),
                         "reward": float(rng.integers(0, 2)), "group_id": g,
                         "generation_logprobs": (-rng.random(length)).tolist()})  # fmt: skip (the recipe's IS)
    from .test_train import ROOT

    command = ["--recipe", "qwen2_7b_grpo_cp", "--dry-run", "--gpus-per-node", "8"]
    proc = _cli(ROOT, [*command, _write(tmp_path / "r.jsonl", rows)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout[: proc.stdout.rindex("}") + 1])
    assert report["algorithm"] == "grpo" and report["layout"]["cp"] == 2
    assert report["first_global_batch"]["samples"] == 512 and report["data"]["groups"] == 64
    bare = _cli(ROOT, command)
    assert bare.returncode == 0 and "grpo.rollouts is not set" in bare.stdout


def _cli(root, args):
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "mcore_packing", "train", *args], cwd=root, capture_output=True,
                          text=True, timeout=300)  # fmt: skip
