"""`plan` plans the run `train` would run: the same config (one source of defaults, Hydra overrides, recipes),
the same data (the checkpoint's tokenizer and chat template with --hf-path), the same global batches."""

from __future__ import annotations

import json
import warnings

import pytest

from mcore_packing.app import plan_command as plan
from mcore_packing.app.train_command import compose_config
from mcore_packing.app.trainer import dry_run

from .hf_models import make_chat_model


def run_json(capsys, *argv):
    code = plan.main(["--json", "--no-recommend", *argv])
    out = capsys.readouterr()
    assert code == 0, out.err
    return json.loads(out.out)


def test_defaults_are_the_training_configs(tmp_path, capsys):
    lengths = tmp_path / "lengths.json"
    lengths.write_text(json.dumps([100, 3000, 20, 4000, 700, 650, 90, 10] * 8))
    for recipe, extra in ((None, []), ("llama3_8b_sft_packed", ["--recipe", "llama3_8b_sft_packed"])):
        cfg = compose_config(recipe, [])
        c = run_json(capsys, "--lengths", str(lengths), *extra)["config"]
        assert c["train_mb_tokens"] == cfg.sequence_packing.train_mb_tokens
        assert c["global_batch_size"] == cfg.training.global_batch_size
        assert c["algorithm"] == cfg.sequence_packing.algorithm and c["balance"] == cfg.training.balance
        assert (c["tp"], c["sp"]) == (cfg.parallel.tp, cfg.parallel.sequence_parallel)
        assert c["dp"] * c["tp"] * c["pp"] * c["cp"] == cfg.cluster.num_nodes * cfg.cluster.gpus_per_node
    # a Hydra override and a flag each change one key; the flag is applied last
    c = run_json(capsys, "--lengths", str(lengths), "sequence_packing.train_mb_tokens=8192", "parallel.cp=2",
                 "--dp", "2")["config"]  # fmt: skip
    assert (c["train_mb_tokens"], c["cp"], c["dp"], c["row_capacity"]) == (8192, 2, 2, 16384)
    c = run_json(capsys, "--lengths", str(lengths), "sequence_packing.train_mb_tokens=8192", "--mb-tokens", "6000")
    assert c["config"]["train_mb_tokens"] == 6000


def test_the_run_is_planned_in_the_trainers_global_batches(capsys):
    first = dry_run(compose_config(None, []))["first_global_batch"]
    doc = run_json(capsys, "--steps", "1")
    assert doc["source"].startswith("the run's data: champ")
    assert (doc["num_sequences"], doc["num_tokens"]) == (first["samples"], first["tokens"])
    assert doc["summary"]["micro_batches"] == first["num_microbatches_per_rank"]
    # control: the first 32 samples in data order are another batch (the sampler shuffles)
    from mcore_packing.data.sft import load_sft_data

    in_order = load_sft_data(num_samples=512).samples[:32]
    assert sum(len(s) for s in in_order) != doc["num_tokens"]
    assert run_json(capsys, "--steps", "3")["config"]["planned_batches"] == 3


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    return make_chat_model(tmp_path_factory.mktemp("chat_model"))


def _chatml_tokens(folder, conversation) -> int:
    """An independent count: Hugging Face's tokenizers on the ChatML text written out by hand."""
    from tokenizers import Tokenizer

    text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in conversation)
    return len(Tokenizer.from_file(str(folder / "tokenizer.json")).encode(text, add_special_tokens=False).ids)


def test_hf_path_counts_with_the_checkpoints_tokenizer_and_chat_template(tmp_path, capsys, chat_model):
    conversations = [
        [{"role": "user", "content": f"What is {a} + {a}?"}, {"role": "assistant", "content": f"{a} + {a} = {2 * a}."}]
        for a in (3, 17, 250, 4096)
    ]
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({"messages": c}) + "\n" for c in conversations))
    args = ["--jsonl", str(data), "--field", "messages", "--global-batch-size", "4", "--steps", "1"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        doc = run_json(capsys, *args, "--hf-path", str(chat_model))
        assert not [w for w in caught if "is ignored" in str(w.message)]  # the tiny model's defaults were not set
        run_json(capsys, *args, "--hf-path", str(chat_model), "model.num_layers=5")
    assert [str(w.message).split(":")[0] for w in caught if "is ignored" in str(w.message)] == [
        "model.num_layers=5 is ignored"
    ]  # control: a key the user set is named
    assert doc["num_tokens"] == sum(_chatml_tokens(chat_model, c) for c in conversations)
    assert doc["config"]["model_shape"]["vocab_size"] == 384  # the checkpoint's config.json
    assert str(chat_model) in doc["source"]
    bundled = run_json(capsys, *args)  # control: the bundled vocabulary counts differently
    assert bundled["num_tokens"] != doc["num_tokens"]


def test_dpo_pairs_are_planned_together_and_a_grpo_run_without_rollouts_says_what_to_set(tmp_path, capsys):
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({"prompt_tokens": [1, 2, 3], "chosen_tokens": [4] * (5 + i),
                                         "rejected_tokens": [5] * (9 - i)}) + "\n" for i in range(8)))  # fmt: skip
    doc = run_json(capsys, "algorithm=dpo", f"dpo.pairs={pairs}", "--global-batch-size", "4", "--steps", "2")
    assert doc["num_sequences"] == 16 and doc["config"]["planned_batches"] == 2
    assert doc["whole_dataset_packing"] is None  # pairs pack within their batches only
    code = plan.main(["--recipe", "qwen2_7b_grpo_cp"])
    err = capsys.readouterr().err
    assert code == 2 and "grpo.rollouts is not set" in err and "--lengths FILE" in err


def test_a_grpo_run_with_shared_prompts_reports_the_tokens_and_compute_saved(tmp_path, capsys):
    """grpo.shared_prefix (#40): `plan` lays each group's prompt out once, as the step does, and says so."""
    rollouts, groups, prompt = tmp_path / "rollouts.jsonl", 4, list(range(1, 11))
    rows = [{"prompt_tokens": [*prompt[:-1], g], "response_tokens": [7] * (5 + r + g), "reward": float(r),
             "group_id": g} for g in range(groups) for r in range(4)]  # fmt: skip
    rollouts.write_text("".join(json.dumps(row) + "\n" for row in rows))
    args = ("algorithm=grpo", f"grpo.rollouts={rollouts}", f"grpo.num_prompts_per_step={groups}", "--steps", "2")
    doc = run_json(capsys, *args, "grpo.shared_prefix=true")
    shared = doc["summary"]["shared_prefix"]
    separate = sum(len(r["prompt_tokens"]) + len(r["response_tokens"]) for r in rows)
    computed = sum(len(prompt) for _ in range(groups)) + sum(len(r["response_tokens"]) for r in rows)
    assert (shared["separate_tokens"], shared["computed_tokens"]) == (2 * separate, 2 * computed)  # two steps
    assert shared["shared_groups"] == 2 * groups and shared["fallback_groups"] == []
    assert 0 < shared["predicted_compute_saved"] and shared["tokens_saved"] == pytest.approx(1 - computed / separate)
    assert "shared_prefix" not in run_json(capsys, *args)["summary"]  # control: off by default
    assert plan.main([*args, "grpo.shared_prefix=true"]) == 0
    assert f"computed tokens {2 * computed:,} of {2 * separate:,}" in capsys.readouterr().out
