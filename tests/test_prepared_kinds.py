"""Stores of DPO pairs (``prepare --kind pairs``) and GRPO rollouts (``--kind rollouts``): the store holds
what ``load_preference_data`` and the rollouts reader make, record by record (ids, learned tokens, rewards,
groups, generation log-probs); ``data.prepared=STORE`` trains DPO and GRPO with the losses of the JSONL
runs; bad records are named; a store of the wrong kind, or set together with the algorithm's own file, is
refused naming the key."""

from __future__ import annotations

import json
from dataclasses import asdict

import numpy as np
import pytest

from mcore_packing.__main__ import main as cli
from mcore_packing.app.prepare_command import main, prepare
from mcore_packing.data.preference import load_preference_data
from mcore_packing.data.store import PreparedStore
from mcore_packing.losses.rollouts import read_rollouts_jsonl

from .hf_models import make_chat_model
from .rl_workers import make_rollouts
from .test_dpo_train import make_pairs


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_chat_model(tmp_path_factory.mktemp("model") / "hf")


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def rollout_rows(groups: int = 8) -> list[dict]:
    """Rollouts with string group ids, generation log-probs on every other one, an integer reward once."""
    rows = [asdict(r) for r in make_rollouts(groups=groups, per_group=4)]
    rng = np.random.default_rng(3)
    for i, row in enumerate(rows):
        row["group_id"] = f"prompt-{row['group_id']}"
        row["generation_logprobs"] = (-rng.random(len(row["response_tokens"]))).tolist() if i % 2 else None
    rows[min(5, len(rows) - 1)]["reward"] = 1
    return rows


def test_a_pairs_store_holds_what_load_preference_data_makes(tmp_path, model):
    rows = make_pairs(40)
    rows[7]["chosen"] = "a very long answer " * 60  # over the limit: the pair goes whole
    path = _jsonl(tmp_path / "pairs.jsonl", rows)
    manifest = prepare(path, tmp_path / "store", kind="pairs", hf_path=model, workers=2, chunk_records=6,
                       max_sample_tokens=128)  # fmt: skip
    store = PreparedStore(tmp_path / "store")
    ref = load_preference_data(str(path), tokenizer_path=str(model), max_sample_tokens=128)
    assert store.kind == "pairs" and len(store) == len(ref.samples) == 78
    for i, sample in enumerate(ref.samples):
        got = store[i]
        assert np.array_equal(got.tokens, sample.tokens) and np.array_equal(got.loss_mask, sample.loss_mask), i
    assert manifest["counts"]["pairs_dropped_too_long"] == ref.info["pairs_dropped_too_long"] == 1
    ids = [{"prompt_tokens": [3, 4], "chosen_tokens": [5, 6, 7], "rejected_tokens": [9]}] * 3
    prepare(_jsonl(tmp_path / "ids.jsonl", ids), tmp_path / "ids", kind="pairs")  # token ids need no tokenizer
    ids_store, ids_ref = PreparedStore(tmp_path / "ids"), load_preference_data(str(tmp_path / "ids.jsonl"))
    assert [s.tokens.tolist() for s in ids_ref.samples] == [ids_store[i].tokens.tolist() for i in range(6)]
    assert ids_store.vocab_size == ids_ref.vocab_size == 10


def test_a_rollouts_store_holds_what_the_rollouts_reader_reads(tmp_path):
    from mcore_packing.app.algorithms.grpo import StoreRollouts

    path = _jsonl(tmp_path / "r.jsonl", rollout_rows())
    manifest = prepare(path, tmp_path / "store", kind="rollouts", workers=2, chunk_records=5)
    got, ref = StoreRollouts(PreparedStore(tmp_path / "store")), read_rollouts_jsonl(str(path))
    assert len(got) == len(ref) == 32 and manifest["counts"]["groups"] == 8
    for a, b in zip(got, ref, strict=True):
        assert (a.prompt_tokens, a.response_tokens, a.reward, a.group_id) == (
            b.prompt_tokens, b.response_tokens, b.reward, b.group_id)  # fmt: skip
        assert a.generation_logprobs == b.generation_logprobs  # float64: exact, None where none was given
    assert sum(r.generation_logprobs is None for r in got) == 16


def test_bad_pairs_and_rollouts_are_named_and_nothing_is_written(tmp_path, model, capsys):
    pairs = make_pairs(12)
    pairs[3]["rejected"] = pairs[3]["chosen"]
    tokens = [{"prompt_tokens": [1], "chosen_tokens": [2], "rejected_tokens": [3]}]
    rollouts = rollout_rows(4)
    rollouts[6]["reward"] = float("nan")
    rollouts[9]["generation_logprobs"] = [-1.0]
    single = rollout_rows(4)[:13]  # the last group has one response
    hf = ["--hf-path", str(model)]
    cases = [
        ("pairs", make_pairs(3) + pairs, ["--hf-path", str(model)], "p.jsonl:7: chosen equals rejected"),
        ("pairs", make_pairs(9) + tokens, ["--hf-path", str(model)], "p.jsonl:10 mixes token ids and text with "),
        ("pairs", make_pairs(2), [], "p.jsonl:1 is a text or chat pair; tokenizing it needs --hf-path"),
        ("rollouts", rollouts, [], "2 lines are bad"),
        ("rollouts", single, [], "group(s) ['prompt-3'] have one"),
        ("sft", make_pairs(2), hf, "p.jsonl:1 is a preference pair (prompt, chosen, rejected); pass --kind pairs"),
        ("sft", rollout_rows(1), ["--hf-path", str(model)], "pass --kind rollouts"),
        ("sft", [{"messages": "hi"}], [], "--kind sft tokenizes text: pass --hf-path"),
    ]
    for kind, rows, flags, message in cases:
        path = _jsonl(tmp_path / "p.jsonl", rows)
        argv = ["--input", str(path), "--out", str(tmp_path / "s"), "--kind", kind, "--chunk-records", "4",
                "--workers", "2", "--no-progress", "--text-field", "messages", *flags]  # fmt: skip
        assert main(argv) == 2, message
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, err
        assert not (tmp_path / "s").exists()
    err_lines = "p.jsonl:7 (group 'prompt-1') has reward nan", "p.jsonl:10 has 1 generation log-probs"
    path = _jsonl(tmp_path / "p.jsonl", rollouts)
    assert main(["--input", str(path), "--out", str(tmp_path / "s"), "--kind", "rollouts", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert all(line in err for line in err_lines), err
    path = _jsonl(tmp_path / "p.jsonl", [{"prompt_tokens": [1], "chosen_tokens": [2], "rejected_tokens": [999]}])
    argv = ["--input", str(path), "--out", str(tmp_path / "s"), "--kind", "pairs", "--hf-path", str(model)]
    assert main(argv) == 2 and "a token id is 999, but the tokenizer of --hf-path has 384" in capsys.readouterr().err


def test_a_store_of_another_kind_or_beside_the_algorithms_file_is_refused(tmp_path, model):
    from mcore_packing.app.algorithms import get_algorithm
    from mcore_packing.app.config import ConfigError
    from mcore_packing.app.train_command import compose_config

    prepare(_jsonl(tmp_path / "p.jsonl", make_pairs(4)), tmp_path / "pairs", kind="pairs", hf_path=model)
    prepare(_jsonl(tmp_path / "r.jsonl", rollout_rows(2)), tmp_path / "rollouts", kind="rollouts")
    for algorithm, store, extra, message in [
        ("grpo", "pairs", [], r"holds pairs records; algorithm=grpo reads .* --kind rollouts\. Set algorithm=dpo"),
        ("sft", "rollouts", [], r"holds rollouts records; algorithm=sft reads .* --kind sft"),
        ("dpo", "pairs", ["dpo.pairs=p.jsonl"], r"data\.prepared and dpo\.pairs are both set"),
        ("grpo", "rollouts", ["grpo.rollouts=r.jsonl"], r"data\.prepared and grpo\.rollouts are both set"),
    ]:
        cfg = compose_config(None, [f"algorithm={algorithm}", f"data.prepared={tmp_path / store}", *extra])
        with pytest.raises(ConfigError, match=message):
            get_algorithm(algorithm).load_data(cfg)
    cfg = compose_config(None, ["algorithm=grpo", f"data.prepared={tmp_path / 'rollouts'}",
                                "grpo.num_prompts_per_step=2"])  # fmt: skip
    data = get_algorithm("grpo").load_data(cfg)  # control: the right kind loads
    assert data.num_units == 2 and len(data.samples) == 8


@pytest.mark.multirank
def test_each_rank_reads_only_its_own_micro_batches_from_a_store(tmp_path):
    from .distributed_harness import run_distributed
    from .step_workers import VOCAB

    rows = [asdict(r) for r in make_rollouts(groups=6, per_group=4, vocab=VOCAB)]
    prepare(_jsonl(tmp_path / "r.jsonl", rows), tmp_path / "store", kind="rollouts")
    results = run_distributed("tests.step_workers:lazy_store_worker", 2, store=str(tmp_path / "store"))
    for result in results:
        assert result["read"] == result["own"] and 0 < len(result["own"]) < result["n"]
        assert result["store_loss"] == result["list_loss"]  # control: the same step from a list
    assert set(results[0]["own"]) | set(results[1]["own"]) == set(range(results[0]["n"]))


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ["dpo", "grpo"])
def test_dpo_and_grpo_train_from_a_store_with_the_jsonl_runs_losses(tmp_path, model, algorithm, capsys):
    from .test_train import metrics, train

    if algorithm == "dpo":
        path = _jsonl(tmp_path / "pairs.jsonl", make_pairs(16))
        prepare(path, tmp_path / "store", kind="pairs", hf_path=model, workers=2, chunk_records=5)
        common = ["algorithm=dpo", f"model.hf_path={model}", "training.global_batch_size=4",
                  "dpo.reference_policy_kl_penalty=0.5", "sequence_packing.train_mb_tokens=256"]  # fmt: skip
        own = f"dpo.pairs={path}"
    else:
        rows = rollout_rows()
        partial = _jsonl(tmp_path / "partial.jsonl", rows)  # every other rollout without generation log-probs
        prepare(partial, tmp_path / "partial", kind="rollouts", workers=2, chunk_records=5)
        refused = cli(["train", "--dry-run", "algorithm=grpo", f"data.prepared={tmp_path / 'partial'}",
                       "grpo.num_prompts_per_step=3", "loss_fn.use_importance_sampling_correction=true"])  # fmt: skip
        err = capsys.readouterr().err  # the correction would weigh those rollouts' tokens 1: refused, named
        assert refused == 2 and "16 of 32 rollouts" in err and "no generation_logprobs (e.g. rollout 0)" in err, err
        for row in rows:  # the control: every rollout with its log-probs
            row["generation_logprobs"] = row["generation_logprobs"] or [-0.5] * len(row["response_tokens"])
        path = _jsonl(tmp_path / "r.jsonl", rows)
        prepare(path, tmp_path / "store", kind="rollouts", workers=2, chunk_records=5)
        common = ["algorithm=grpo", "grpo.num_prompts_per_step=3", "grpo.num_generations_per_prompt=4",
                  "grpo.keep_groups_together=true", "loss_fn.reference_policy_kl_penalty=0.05",
                  "loss_fn.use_importance_sampling_correction=true", "sequence_packing.train_mb_tokens=96",
                  "sequence_packing.logprob_mb_tokens=160"]  # fmt: skip
        own = f"grpo.rollouts={path}"
    common += ["training.steps=2", "optimizer.lr_warmup_iters=0", "optimizer.lr=0.003"]
    raw = train(tmp_path / "raw", *common, own)
    stored = train(tmp_path / "stored", *common, f"data.prepared={tmp_path / 'store'}")
    assert raw.returncode == 0 and stored.returncode == 0, (raw.stderr + stored.stderr)[-3000:]
    rows = {run: [(r["loss"], r["grad_norm"], r["sample_ids"]) for r in metrics(tmp_path / run)]
            for run in ("raw", "stored")}  # fmt: skip
    assert len(rows["raw"]) == 2 and rows["raw"] == rows["stored"]
