"""The planning CLI: real output on a real corpus, JSON that adds up, the PNG, exit code 2 on bad input, and
the run's own config and data (one source of defaults with `train`, the checkpoint's tokenizer, the
trainer's global batches)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from mcore_packing.app import plan_command as plan


def run(capsys, *argv):
    code = plan.main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_default_run_on_real_corpus_writes_a_png(tmp_path, capsys):
    png = tmp_path / "plan.png"
    code, out, _ = run(capsys, "--corpus", "champ", "--mb-tokens", "16384", "--dp", "4", "--png", str(png),
                       "--no-recommend")  # fmt: skip
    assert code == 0
    assert "real:champ" in out and "19,440 sequences" in out
    assert "slowest DP rank / mean" in out and "predicted compute saved" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000


def test_json_from_a_lengths_file_adds_up(tmp_path, capsys):
    lengths = np.array([100, 3000, 20, 4000, 700, 650, 90, 10], dtype=np.int64)
    path = tmp_path / "lengths.npy"
    np.save(path, lengths)
    code, out, _ = run(
        capsys,
        "--lengths",
        str(path),
        "--mb-tokens",
        "4096",
        "--global-batch-size",
        "4",
        "--micro-batch-size",
        "2",
        "--algorithm",
        "ffd",
        "--json",
        "--no-png",
        "--no-recommend",
    )
    assert code == 0
    doc = json.loads(out)
    s = doc["summary"]
    assert doc["num_tokens"] == int(lengths.sum())
    # Pad-to-longest over micro-batches of 2 in data order: (3000 + 4000 + 700 + 90) * 2 tokens.
    assert s["useful_share_pad_to_longest"] == pytest.approx(lengths.sum() / (2 * (3000 + 4000 + 700 + 90)))
    assert s["micro_batches"] >= s["lower_bound"] == 2 + 1  # ceil(3120/4096) + ceil(1450/4096)
    assert 0 < s["compute_saved_with_attention"] < 1


def test_fp8_recipe_pads_rows_not_sequences(tmp_path, capsys):
    """--fp8-recipe is model.fp8_recipe: rows get a tail so each SP rank's share divides by 128; the real
    tokens and the micro-batch count stay, the computed tokens grow by less than a tail per row."""
    path = tmp_path / "lengths.json"
    path.write_text(json.dumps([37, 901, 15, 1200, 333, 64, 7, 480] * 4))
    common = ["--lengths", str(path), "--mb-tokens", "2048", "--global-batch-size", "8", "--tp", "2", "--sp",
              "--dp", "1", "--json", "--no-png", "--no-recommend"]  # fmt: skip
    docs = {}
    for recipe in (None, "blockwise"):
        code, out, err = run(capsys, *common, *(["--fp8-recipe", recipe] if recipe else []))
        assert code == 0, err
        docs[recipe] = json.loads(out)
    plain, fp8 = docs[None]["summary"], docs["blockwise"]["summary"]
    assert docs["blockwise"]["config"]["fp8_recipe"] == "blockwise" and docs[None]["config"]["fp8_recipe"] is None
    assert fp8["micro_batches"] == plain["micro_batches"]
    computed = docs[None]["num_tokens"] / np.array([plain["useful_share_planned"], fp8["useful_share_planned"]])
    assert 0 < computed[1] - computed[0] < fp8["micro_batches"] * 128 * 2  # at most one tail of 2 x 128 per row


@pytest.mark.parametrize(
    ("args", "refine"),
    [
        ([], True),
        (["--refine", "off"], False),
        (["--algorithm", "ffd"], False),
        (["--algorithm", "ffd", "--refine", "on"], True),
    ],
)
def test_refine_flag_reaches_the_plan(tmp_path, capsys, args, refine):
    path = tmp_path / "lengths.json"
    path.write_text(json.dumps([100, 3000, 20, 4000, 700, 650, 90, 10]))
    code, out, _ = run(
        capsys, "--lengths", str(path), "--mb-tokens", "4096", "--json", "--no-png", "--no-recommend", *args
    )
    assert code == 0
    assert json.loads(out)["config"]["refine"] is refine


def test_dynamic_mode_and_budget_recommendation(capsys):
    code, out, _ = run(capsys, "--mode", "dynamic", "--mb-tokens", "12000", "--json", "--global-batch-size", "256",
                       "--steps", "4")  # fmt: skip
    assert code == 0
    doc = json.loads(out)
    assert doc["config"]["mode"] == "dynamic"
    assert doc["summary"]["useful_share_planned"] > doc["summary"]["useful_share_pad_to_longest"]
    budget = doc["budget"]
    assert budget["recommended_train_mb_tokens"] in [c["train_mb_tokens"] for c in budget["candidates"]]


def test_dynamic_cp_report_counts_every_sequence_once(tmp_path, capsys):
    """--dynamic-cp: sequences per CP size add up to the data set, the long ones need CP > 1, the short ones
    run at CP 1; the PNG is written with them; layouts dynamic CP does not run are refused naming the fix."""
    lengths = tmp_path / "lengths.txt"
    values = [100] * 60 + [900] * 6 + [1900] * 2
    lengths.write_text("\n".join(map(str, values)))
    code, out, _ = run(capsys, "--lengths", str(lengths), "--cp", "4", "--dp", "2", "--mb-tokens", "512",
                       "--global-batch-size", "0", "--dynamic-cp", "--json", "--no-recommend")  # fmt: skip
    assert code == 0
    dynamic = json.loads(out)["dynamic_cp"]
    assert dynamic["cp_sizes"] == {"1": 60, "2": 6, "4": 2}
    assert dynamic["static_over_dynamic"] > 0
    assert dynamic["exchange_priced"] is False  # the config's FLOP model: the report says so
    png = tmp_path / "plan.png"
    code, out, _ = run(capsys, "--lengths", str(lengths), "--cp", "4", "--dp", "2", "--mb-tokens", "512",
                       "--global-batch-size", "0", "--dynamic-cp", "--png", str(png), "--no-recommend")  # fmt: skip
    assert code == 0 and "sequences per size CP 1: 60, CP 2: 6, CP 4: 2" in out and png.exists()
    # the flag is context_parallel.dynamic=true: the same document either way
    code, same, _ = run(capsys, "--lengths", str(lengths), "--cp", "4", "--dp", "2", "--mb-tokens", "512",
                        "--global-batch-size", "0", "context_parallel.dynamic=true", "--json",
                        "--no-recommend")  # fmt: skip
    assert code == 0 and json.loads(same)["dynamic_cp"] == dynamic
    # context_parallel.max_tokens_per_rank is the budget per rank when set
    code, out, _ = run(capsys, "--lengths", str(lengths), "--cp", "4", "--dp", "2", "--global-batch-size", "0",
                       "--dynamic-cp", "context_parallel.max_tokens_per_rank=1024", "--json",
                       "--no-recommend")  # fmt: skip
    assert code == 0 and json.loads(out)["dynamic_cp"]["cp_sizes"] == {"1": 66, "2": 2, "4": 0}
    code, _, err = run(capsys, "--lengths", str(lengths), "--mb-tokens", "4096", "--dynamic-cp", "--no-png")
    assert code == 2 and "--dynamic-cp=true picks a CP size per sequence up to parallel.cp, which is 1" in err
    code, _, err = run(capsys, "--lengths", str(lengths), "--cp", "2", "--dp", "1", "--dynamic-cp", "--mode",
                       "padded", "--no-png")  # fmt: skip
    assert code == 2 and "runs packed THD rows (sequence_packing.enabled=true) or dynamic batching's BSHD" in err
    # dynamic batching: BSHD rows per CP size, every sequence once
    code, out, _ = run(capsys, "--lengths", str(lengths), "--cp", "4", "--dp", "2", "--mb-tokens", "512", "--mode",
                       "dynamic", "--global-batch-size", "0", "--dynamic-cp", "--json", "--no-recommend")  # fmt: skip
    assert code == 0 and sum(json.loads(out)["dynamic_cp"]["cp_sizes"].values()) == 68
    code, _, err = run(capsys, "--lengths", str(lengths), "--cp", "2", "--dp", "1", "--mb-tokens", "512",
                       "--global-batch-size", "0", "--dynamic-cp", "--no-png", "--no-recommend")  # fmt: skip
    assert code == 2 and "the longest is sample 66 with 1900 tokens" in err and "at least 950" in err  # one check


def test_vpp_that_does_not_split_the_layers_exits_2_naming_the_flags(capsys):
    code, _, err = run(capsys, "--corpus", "champ", "--pp", "4", "--vpp", "2", "--dp", "1", "--layers", "4", "--no-png")
    assert code == 2 and "--pp x --vpp = 4 x 2 = 8" in err and "divides 4" in err


def test_jsonl_is_tokenized_with_the_bundled_vocabulary(tmp_path, capsys):
    from mcore_packing.data.real_text import get_tokenizer

    texts = ["hello world", "packing sequences saves compute " * 20, "x y"]  # each with a learned token
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(json.dumps({"body": t}) for t in texts) + "\n")
    args = ["--jsonl", str(path), "--field", "body", "--mb-tokens", "512", "--json", "--no-recommend"]
    code, out, _ = run(capsys, *args, "--global-batch-size", "3", "--steps", "1")
    assert code == 0
    enc = get_tokenizer("qwen3")
    assert json.loads(out)["num_tokens"] == sum(len(enc.encode(t)) for t in texts)
    code, _, err = run(capsys, *args)  # the default batch of 32 samples from a file of 3
    assert code == 2 and "training.global_batch_size=32 is larger than the data set (3 samples)" in err


@pytest.mark.parametrize(
    "content, suffix, args, fragment",
    [
        ("1\n2\nx\n", ".txt", [], "entry 2 = 'x' is not an integer"),
        ("", ".txt", [], "holds no lengths"),
        ("[1, 0, 3]", ".json", [], "length 1 is 0"),
        ("[1.5, 2]", ".json", [], "must be integers"),
        (
            "[10, 5000, 6000]",
            ".json",
            ["--mb-tokens", "4096"],
            "2 of 3 samples are longer than a micro-batch (4096 tokens = --mb-tokens 4096 x cp 1)",
        ),
        ("[10, 20]", ".json", ["--mb-tokens", "0"], "--mb-tokens must be an integer >= 1, got 0"),
        ("[10, 20]", ".json", ["--algorithm", "magic"], "Valid names"),
        ("[10, 20]", ".json", ["--algorithm", "concatenative", "--refine", "on"], "not available for 'concatenative'"),
        ("[10, 20]", ".json", ["--dp", "4", "--global-batch-size", "2"], "smaller than --dp 4"),
        ("[10, 20]", ".json", ["--tp", "3"], "pass --dp N to plan N data-parallel ranks"),
        ("[10, 20]", ".json", ["parallel.tpp=2"], "Did you mean 'parallel.tp'?"),
        ("[10, 20]", ".json", ["--mode", "padded", "--bogus"], "unrecognized arguments: --bogus"),
    ],
)
def test_bad_inputs_exit_2_with_message(tmp_path, capsys, content, suffix, args, fragment):
    path = tmp_path / f"lengths{suffix}"
    path.write_text(content)
    try:
        code, _, err = run(capsys, "--lengths", str(path), "--no-png", *args)
    except SystemExit as exc:  # argparse's own errors
        code, err = exc.code, capsys.readouterr().err
    assert code == 2, err
    assert fragment in err


def test_missing_files_and_fields_exit_2(tmp_path, capsys):
    code, _, err = run(capsys, "--lengths", str(tmp_path / "nope.npy"))
    assert code == 2 and "does not exist" in err
    code, _, err = run(capsys, "--jsonl", str(tmp_path / "nope.jsonl"))
    assert code == 2 and "does not exist" in err and "Traceback" not in err
    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "a"}\n{"other": "b"}\n')
    code, _, err = run(capsys, "--jsonl", str(path), "--no-png")
    assert code == 2 and "has no field 'text'" in err
    empty = tmp_path / "e.jsonl"
    empty.write_text("\n")
    code, _, err = run(capsys, "--jsonl", str(empty), "--no-png")
    assert code == 2 and "empty" in err


def test_model_shape_from_a_recipe_changes_the_cost(capsys):
    args = ["--corpus", "champ", "--json", "--no-recommend", "--global-batch-size", "256", "--dp", "4"]
    code, out, _ = run(capsys, *args, "--recipe", "qwen2_7b_grpo_cp")
    assert code == 0
    doc = json.loads(out)
    assert doc["config"]["model_shape"]["num_layers"] == 28 and doc["config"]["model_shape"]["vocab_size"] == 152064
    assert (doc["config"]["tp"], doc["config"]["cp"], doc["config"]["train_mb_tokens"]) == (4, 2, 8192)  # the recipe's
    small_shape = ["--layers", "2", "--hidden", "256", "--heads", "4", "--kv-heads", "2", "--vocab", "1000"]
    code, out, _ = run(capsys, *args, "--mb-tokens", "16384", *small_shape)
    small = json.loads(out)
    assert small["summary"]["attention_share_of_real_work"] > doc["summary"]["attention_share_of_real_work"]
    code, _, err = run(capsys, "--recipe", "nope", "--no-png")
    assert code == 2 and "Available:" in err
    code, _, err = run(capsys, *args, "--recipe", "llama3_8b_sft_packed", "--heads", "4")  # 8 key/value heads
    assert code == 2 and "--heads=4 is not a multiple of num_query_groups=8" in err


def test_no_figure_unless_asked_and_heads_must_split_over_tp(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    lengths = tmp_path / "lengths.json"
    lengths.write_text("[100, 3000, 20, 4000, 700, 650, 90, 10]")
    code, _, _ = run(capsys, "--lengths", str(lengths), "--global-batch-size", "4", "--no-recommend")
    assert code == 0 and list(tmp_path.glob("*.png")) == []  # nothing written unasked
    code, _, err = run(capsys, "--lengths", str(lengths), "--tp", "3", "--dp", "1", "--heads", "4", "--kv-heads", "2")
    assert code == 2 and "--heads=4 heads cannot be split over --tp=3" in err, err
    code, _, _ = run(capsys, "--lengths", str(lengths), "--tp", "2", "--dp", "1", "--heads", "4", "--kv-heads", "2",
                     "--global-batch-size", "4", "--no-recommend")  # fmt: skip
    assert code == 0  # control: heads that split
    from mcore_packing.app.plan_command import build_parser

    recipes = "mcore_packing.app.recipes: gpt_oss_20b_grpo, llama32_1b_sft_single_gpu"
    assert recipes in " ".join(build_parser().format_help().split())


def test_memory_budget_prints_stage_peaks_and_the_largest_budget_that_fits(tmp_path, capsys):
    """plan --memory-budget (#41): each pipeline stage's predicted peak at the run's budget, and the
    largest train_mb_tokens whose plans stay under the budget (re-planned there, the peak is under it and
    64 tokens more is over it); a budget the longest sequence alone exceeds exits 2 naming it and the fix."""
    import dataclasses

    from mcore_packing.app.memory_settings import memory_settings
    from mcore_packing.app.run_settings import plan_config
    from mcore_packing.app.train_command import compose_config
    from mcore_packing.planning import ParallelLayout, plan_step
    from mcore_packing.planning.memory_budget import plan_memory

    lengths = tmp_path / "lengths.json"
    values = [100, 3000, 20, 4000, 700, 650, 90, 10] * 8
    lengths.write_text(json.dumps(values))
    args = ["--json", "--no-recommend", "--lengths", str(lengths), "--global-batch-size", "16", "--recipe",
            "llama3_8b_sft_packed", "--tp", "4", "--pp", "2", "--dp", "1"]  # fmt: skip
    assert plan.main([*args, "--memory-budget", "40GiB"]) == 0
    memory = json.loads(capsys.readouterr().out)["memory"]
    assert [s["stage"] for s in memory["stages"]] == [0, 1] and memory["budget"] == 40 * 2**30
    assert memory["stages"][0]["peak"] > memory["stages"][1]["peak"]  # stage 0 holds pp micro-batches in flight
    fits = memory["largest_train_mb_tokens"]
    assert max(s["peak"] for s in memory["largest_stages"]) <= 40 * 2**30
    cfg = compose_config("llama3_8b_sft_packed", ["parallel.tp=4", "parallel.pp=2"])
    shape = cfg.model.shape(cfg.data.vocab_size)
    config = plan_config(cfg, ParallelLayout(tp=4, pp=2, sequence_parallel=True))
    batches = [np.asarray(values[k : k + 16]) for k in range(0, len(values), 16)]
    over = [plan_memory(plan_step(b, dataclasses.replace(config, train_mb_tokens=fits + 64)), shape,
                        memory_settings(cfg)) for b in batches]  # fmt: skip
    assert max(s["peak"] for stages in over for s in stages) > 40 * 2**30
    assert plan.main([*args, "--memory-budget", "16GiB"]) == 2
    err = capsys.readouterr().err
    assert "the longest sequence (4000 tokens) alone needs" in err and "16.00 GiB" in err
    assert plan.main([*args, "--memory-budget", "lots"]) == 2
    assert "--memory-budget='lots' is not a size" in capsys.readouterr().err
    moe = ["--json", "--no-recommend", "--lengths", str(lengths), "--recipe", "qwen3_30b_a3b_sft_packed",
           "--memory-budget", "80GB"]  # fmt: skip (its recipe runs TP2: the memory model covers MoE at TP1)
    assert plan.main(moe) == 2
    assert "--memory-budget: the memory model covers Mixture-of-Experts layers at parallel.tp=1, not 2" in (
        capsys.readouterr().err)
