"""``algorithm=dpo`` through the train command: preference pairs from JSONL (chat messages, text or token
ids), each pair whole in one micro-batch, the reference from the starting weights, the DPO metrics, the
same losses on two ranks (DP=2, CP=2, dynamic batching), and clear errors for bad pairs.

Exactness: on one rank the trainer's DPO steps equal an unpacked computation (one plain forward per
sequence, DPO in plain torch; `rl_workers.dpo_unpacked_worker`), and the two-rank runs equal the one-rank
run step by step, so they equal the unpacked loss too. Controls: chosen and rejected swapped.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from mcore_packing.app.train_command import main

from .distributed_harness import run_distributed
from .test_train import metrics, train

DPO = [
    "algorithm=dpo",
    "training.global_batch_size=4",  # pairs per step
    "training.steps=3",
    "optimizer.lr_warmup_iters=0",
    "optimizer.lr=0.003",
    "dpo.reference_policy_kl_penalty=0.5",
    "sequence_packing.train_mb_tokens=96",
    "sequence_packing.logprob_mb_tokens=160",
    "dynamic_batching.train_mb_tokens=96",
    "data.vocab_size=256",
]


def make_pairs(num_pairs: int = 16, seed: int = 5) -> list[dict]:
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(num_pairs):
        a, b = (int(x) for x in rng.integers(0, 10, 2))
        wrong = a + b + int(rng.integers(1, 4))
        prompt = [{"role": "user", "content": f"What is {a} plus {b}?"}]
        rows.append({"prompt": prompt, "chosen": f"{a} plus {b} is {a + b}.", "rejected": f"It is {wrong}."})
    return rows


def _write(path, rows) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return f"dpo.pairs={path}"


@pytest.fixture(scope="module")
def pairs_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("pairs") / "pairs.jsonl"
    _write(path, make_pairs())
    return path


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory, pairs_file):
    run_dir = tmp_path_factory.mktemp("dpo") / "straight"
    proc = train(run_dir, *DPO, f"dpo.pairs={pairs_file}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return metrics(run_dir)


@pytest.mark.slow
def test_the_first_step_is_log_2_and_each_step_takes_whole_pairs(straight_run):
    first = straight_run[0]
    assert abs(first["loss"] - math.log(2)) <= 1e-6, first["loss"]  # the policy is the reference
    assert first["reward_margin"] == pytest.approx(0.0, abs=1e-6)
    for record in straight_run:
        ids = record["sample_ids"]
        assert len(ids) == 8 and all(c % 2 == 0 and r == c + 1 for c, r in zip(ids[0::2], ids[1::2], strict=True))
        assert 0.0 <= record["accuracy"] <= 1.0 and record["preference_loss"] == pytest.approx(record["loss"])
    assert straight_run[-1]["loss"] < math.log(2)  # it learns to prefer the chosen answers


@pytest.mark.slow
def test_the_trainer_equals_the_unpacked_dpo_loss(tmp_path, pairs_file):
    options = ["dpo.sft_loss_weight=0.1", "dpo.preference_average_log_probs=true", "logging.progress_bar=false",
               "model.hidden_size=64", "model.num_attention_heads=2", "model.num_query_groups=1",
               "model.ffn_hidden_size=128"]  # fmt: skip
    results = run_distributed("tests.rl_workers:dpo_unpacked_worker", 1, root=str(tmp_path), steps=3,
                              overrides=[*DPO, f"dpo.pairs={pairs_file}", *options], timeout=300)[0]  # fmt: skip
    for r in results:
        assert abs(r["reported"] - r["expected"]) <= 1e-5 * abs(r["expected"]), r
        assert abs(r["swapped"] - r["expected"]) > 1e-3 * abs(r["expected"]), r  # the control differs
    print("trainer vs unpacked DPO, relative:", [abs(r["reported"] / r["expected"] - 1) for r in results])


@pytest.mark.slow
@pytest.mark.multirank
@pytest.mark.parametrize(
    "layout",
    [
        [],
        ["parallel.cp=2"],
        ["sequence_packing.enabled=false", "dynamic_batching.enabled=true"],
        # dynamic CP: each pair in one row, on one rank or (a pair of 40 tokens) on both
        ["parallel.cp=2", "context_parallel.dynamic=true", "context_parallel.max_tokens_per_rank=39"],
    ],
    ids=["packed-dp2", "packed-cp2", "dynamic-dp2", "dynamic-cp2"],
)
def test_two_ranks_give_the_single_rank_losses(tmp_path, straight_run, pairs_file, layout):
    proc = train(tmp_path, *DPO, f"dpo.pairs={pairs_file}", *layout, torchrun=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    if "context_parallel.dynamic=true" in layout:
        sizes = [r["cp_sizes"] for r in metrics(tmp_path)]
        assert sum(s["1"] for s in sizes) and sum(s["2"] for s in sizes), sizes  # both sizes ran
    for step, (got, expected) in enumerate(zip(metrics(tmp_path), straight_run, strict=True), 1):
        assert abs(got["loss"] - expected["loss"]) <= 1e-5 * abs(expected["loss"]), (got["loss"], expected["loss"])
        if step > 1:  # at step 1 the policy is the reference: every margin is 0 up to rounding, a tie either way
            assert got["accuracy"] == expected["accuracy"], (step, got["accuracy"], expected["accuracy"])


@pytest.mark.parametrize(
    ("change", "overrides", "fragment"),
    [
        (lambda rows: rows[2].update(chosen=""), [], "pairs.jsonl:3: chosen is empty"),
        (lambda rows: rows[1].update(rejected=rows[1]["chosen"]), [], "pairs.jsonl:2: chosen equals rejected"),
        (lambda rows: rows[0].pop("rejected"), [], "pairs.jsonl:1 has ['prompt', 'chosen'] of the keys"),
        (lambda rows: rows[3].update(chosen=[{"role": "user", "content": "x"}]), [], "must end with an assistant"),
        (lambda rows: rows.insert(1, {"prompt_tokens": [1], "chosen_tokens": [2], "rejected_tokens": [3]}), [],
         "pairs.jsonl:2 mixes token ids and text with line 1"),
        (None, ["sequence_packing.enabled=false"], "algorithm=dpo keeps each (chosen, rejected) pair in one"),
        (None, ["sequence_packing.train_mb_tokens=16"], "Raise sequence_packing.train_mb_tokens"),
        (None, ["dpo.reference_policy_kl_penalty=0"], "dpo.reference_policy_kl_penalty=0 makes the preference"),
        (None, ["training.global_batch_size=17"], "17"),
    ],
)  # fmt: skip
def test_bad_pairs_and_settings_exit_2_naming_the_fix(tmp_path, capsys, change, overrides, fragment):
    rows = make_pairs()
    if change is not None:
        change(rows)
    code = main([*DPO, _write(tmp_path / "pairs.jsonl", rows), f"run_dir={tmp_path}", *overrides, "--dry-run"])
    err = capsys.readouterr().err
    assert code == 2 and fragment in err, err[-2000:]


def test_token_id_pairs_are_refused_when_not_integers(tmp_path, capsys):
    rows = [{"prompt_tokens": [1, 2], "chosen_tokens": [3, 4.5], "rejected_tokens": [5]}] * 4
    code = main([*DPO, _write(tmp_path / "pairs.jsonl", rows), f"run_dir={tmp_path}", "--dry-run"])
    err = capsys.readouterr().err
    assert code == 2 and "pairs.jsonl:1: chosen_tokens must be a list of integer token ids >= 0" in err, err


def test_a_dry_run_plans_whole_pairs_and_checks_without_them(tmp_path, pairs_file, capsys):
    assert main([*DPO, f"dpo.pairs={pairs_file}", f"run_dir={tmp_path}", "--dry-run"]) == 0
    out = capsys.readouterr().out
    report = json.loads(out[: out.rindex("}") + 1])
    assert report["algorithm"] == "dpo" and report["first_global_batch"]["samples"] == 8
    assert report["data"]["pairs"] == 16
    assert main([*DPO, f"run_dir={tmp_path}", "--dry-run"]) == 0
    assert "dpo.pairs is not set" in capsys.readouterr().out


def test_a_line_that_is_not_a_json_object_is_named(tmp_path, capsys):
    path = tmp_path / "pairs.jsonl"
    _write(path, make_pairs(4))
    path.write_text(path.read_text() + '{"prompt": "x", "chosen": \n')
    code = main([*DPO, f"dpo.pairs={path}", f"run_dir={tmp_path}", "--dry-run"])
    assert code == 2 and "pairs.jsonl:5 is not valid JSON" in capsys.readouterr().err

    from mcore_packing.data.jsonl import read_jsonl_objects
    from mcore_packing.losses.rollouts import read_rollouts_jsonl

    path.write_text('{"a": 1}\n\n[1, 2]\n')
    with pytest.raises(ValueError, match=r"pairs.jsonl:3 is a list, not a JSON object"):
        read_jsonl_objects(str(path))
    with pytest.raises(ValueError, match=r"pairs.jsonl:3 is a list"):  # rollouts read through the same reader
        read_rollouts_jsonl(str(path))
    path.write_text('{"a": 1}\n\n{"b": 2}\n')
    assert read_jsonl_objects(str(path)) == [(1, {"a": 1}), (3, {"b": 2})]  # blank lines skipped, numbers kept
