"""The bad inputs of tests/README.md's table not covered by a test of their own: each through the real
command (in-process), each exits 2 with a message that names the value and the fix, none with a traceback.
A control shows each command accepts the same input once fixed."""

from __future__ import annotations

import json

import pytest

from mcore_packing.__main__ import main as cli


def _write(path, text: str) -> str:
    path.write_text(text, encoding="utf-8")
    return str(path)


def _rollouts(path, groups: dict[str, int], logprobs: bool = False) -> str:
    extra = {"generation_logprobs": [-0.5, -1.25]} if logprobs else {}
    lines = [json.dumps({"prompt_tokens": [1, 2], "response_tokens": [3, 4 + k], "reward": float(k), "group_id": g,
                         **extra}) for g, n in groups.items() for k in range(n)]  # fmt: skip
    return _write(path, "\n".join(lines) + "\n")


# a dry run of GRPO on two groups of two rollouts (without generation log-probs)
GRPO_DRY_RUN = ["train", "--dry-run", "algorithm=grpo", "grpo.rollouts={rollouts}", "grpo.num_prompts_per_step=2"]

CASES = {
    # train --dry-run: data
    "data.path missing": (["train", "--dry-run", "data=jsonl"], "data.source=jsonl needs data.path"),
    "data.path absent": (["train", "--dry-run", "data=jsonl", "data.path={tmp}/nope.jsonl"], "does not exist"),
    "data.text_field absent": (
        ["train", "--dry-run", "data=jsonl", "data.path={nofield}"],
        "has no field 'text' (it has ['body']); set data.text_field",
    ),
    "data file empty": (["train", "--dry-run", "data=jsonl", "data.path={empty}"], "holds no records"),
    "long sample with long_samples=error": (
        ["train", "--dry-run", "data.long_samples=error", "data.max_sample_tokens=50"],
        "over data.max_sample_tokens=50. Raise it, or set data.long_samples=drop",
    ),
    "split conversations": (["train", "--dry-run", "data.long_samples=split"], "would cut conversations"),
    "every sample dropped": (["train", "--dry-run", "data.max_sample_tokens=5"], "No samples are left"),
    "batch larger than the data": (
        ["train", "--dry-run", "training.global_batch_size=100000"],
        "training.global_batch_size=100000 is larger than the data set",
    ),
    "budget below the longest sample": (
        ["train", "--dry-run", "sequence_packing.train_mb_tokens=100"],
        "Raise sequence_packing.train_mb_tokens to at least",
    ),
    "non-positive steps": (["train", "--dry-run", "training.steps=0"], "training.steps must be an integer >= 1, got 0"),
    "decay before warmup end": (
        ["train", "--dry-run", "optimizer.lr_warmup_iters=10", "optimizer.lr_decay_iters=5"],
        "optimizer.lr_decay_iters=5 must exceed optimizer.lr_warmup_iters=10",
    ),
    # train --dry-run: model, checkpoints, recipes, commands
    "unknown FP8 recipe": (
        ["train", "--dry-run", "model.fp8_recipe=e4m3"],
        "model.fp8_recipe='e4m3' is not one of ['blockwise', 'delayed', 'mxfp8', 'tensorwise']",
    ),
    "logprob chunks of no tokens": (
        ["train", "--dry-run", "model.logprob_chunk_size=0"], "model.logprob_chunk_size must be an integer >= 1"
    ),
    "a memory budget the longest sequence alone exceeds": (
        ["train", "--dry-run", "sequence_packing.memory_budget=60MiB"],
        "the longest sequence (1548 tokens) alone needs",
    ),
    "an unknown recompute granularity": (
        ["train", "--dry-run", "model.recompute_granularity=some"],
        "model.recompute_granularity must be one of selective, full; got 'some'",
    ),
    "a memory budget that is not a size": (
        ["train", "--dry-run", "dynamic_batching.memory_budget=lots"],
        "dynamic_batching.memory_budget='lots' is not a size",
    ),
    "training with an FP8 recipe": (["train", "model.fp8_recipe=blockwise"], "this trainer does not run FP8 yet"),
    "fixed shapes with variable sequence lengths": (
        ["train", "--dry-run", "sequence_packing.fixed_shape=true", "parallel.variable_seq_lengths=true"],
        "sequence_packing: fixed_shape=True needs mode='packing' with fixed-length rows",
    ),
    "model.hf_path absent": (["train", "--dry-run", "model.hf_path={tmp}/nope"], "config.json does not exist"),
    "model.hf_path without tokenizer": (
        ["train", "--dry-run", "model.hf_path={hf_no_tokenizer}"],
        "tokenizer.json",
    ),
    "resume=true without a checkpoint": (
        ["train", "--dry-run", "resume=true", "run_dir={tmp}/run"],
        "holds no complete checkpoint. Use resume=auto",
    ),
    "unknown recipe": (["train", "--dry-run", "--recipe", "nope"], "Unknown recipe 'nope'. Available:"),
    "unknown command": (["nope"], "unknown command 'nope'; use one of: train, plan, prepare, export, grpo, launch."),
    # the run folder, the batch on the layout, SFT samples, signals, new keys
    "batch below the data-parallel size": (
        ["train", "--dry-run", "cluster.gpus_per_node=2", "training.global_batch_size=1"],
        "training.global_batch_size=1 is below the 2 data-parallel ranks",
    ),
    "conversation without an assistant turn": (
        ["train", "--dry-run", "data=jsonl", "data.path={no_assistant}", "data.text_field=messages"],
        "no_assistant.jsonl:2 has no learned token (a conversation without an assistant turn",
    ),
    "message content a number": (
        ["train", "--dry-run", "data=jsonl", "data.path={number_content}", "data.text_field=messages"],
        "number_content.jsonl:1: message 1 has content 4 (int); content must be a string or a list of text parts",
    ),
    "samples_without_targets unknown": (
        ["train", "--dry-run", "data.samples_without_targets=keep"],
        "data.samples_without_targets must be one of error, drop; got 'keep'",
    ),
    "run_dir is a file": (["train", "--dry-run", "run_dir={afile}"], "a_file is a file; a run writes a folder there"),
    "run_dir of another run": (["train", "--dry-run", "run_dir={another}"], "holds another run"),
    "overwrite with resume=true": (
        ["train", "--dry-run", "run_dir={another}", "overwrite=true", "resume=true"],
        "overwrite=true starts afresh and moves the old run aside; resume=true continues it",
    ),
    "a stop signal no process can catch": (
        ["train", "--dry-run", "training.stop_signals=[SIGTERM,SIGKILL]"],
        "training.stop_signals: 'SIGKILL' is not a signal a process can catch",
    ),
    # GRPO rollouts
    "a group of one response": (
        ["train", "--dry-run", "algorithm=grpo", "grpo.rollouts={single}", "grpo.num_prompts_per_step=1"],
        "GRPO needs several responses per prompt; group(s) ['b'] have one",
    ),
    "more prompts per step than groups": (
        ["train", "--dry-run", "algorithm=grpo", "grpo.rollouts={rollouts}", "grpo.num_prompts_per_step=9"],
        "grpo.num_prompts_per_step=9 is more than the 2 groups",
    ),
    # the policy loss (loss_fn) and the sampling temperature
    "a clip range with low = high": (
        [*GRPO_DRY_RUN, "loss_fn.ratio_clip_min=0", "loss_fn.ratio_clip_max=0"],
        "loss_fn.ratio_clip_min=0 and ratio_clip_max=0 clip the ratio to exactly 1 (low = high)",
    ),
    "importance-sampling bounds with low >= high": (
        [*GRPO_DRY_RUN, "loss_fn.use_importance_sampling_correction=true",
         "loss_fn.truncated_importance_sampling_type=icepop", "loss_fn.truncated_importance_sampling_ratio_min=2",
         "loss_fn.truncated_importance_sampling_ratio=1.5"],
        "loss_fn.truncated_importance_sampling_ratio_min=2.0 must be below truncated_importance_sampling_ratio=1.5",
    ),
    "a temperature <= 0": (
        [*GRPO_DRY_RUN, "grpo.temperature=0"],
        "grpo.temperature=0.0 must be a finite number > 0",
    ),
    "the importance-sampling correction without generation log-probs": (
        [*GRPO_DRY_RUN, "loss_fn.use_importance_sampling_correction=true"],
        "but 4 of 4 rollouts in",
    ),
    "an unknown loss aggregation mode": (
        [*GRPO_DRY_RUN, "loss_fn.loss_agg_mode=seq-sum"],
        "loss_agg_mode must be one of token-mean, seq-mean-token-mean",
    ),
    "seq-mean-token-sum-norm without its constant": (
        [*GRPO_DRY_RUN, "loss_fn.loss_agg_mode=seq-mean-token-sum-norm"],
        "seq-mean-token-sum-norm needs loss_agg_norm_constant: a constant divisor",
    ),
    "token_level_loss against loss_agg_mode": (
        [*GRPO_DRY_RUN, "loss_fn.token_level_loss=true", "loss_fn.loss_agg_mode=seq-mean-token-sum"],
        "token_level_loss=True means loss_agg_mode=token-mean",
    ),
    "prompt-mean on padded batches": (
        [*GRPO_DRY_RUN, "loss_fn.loss_agg_mode=prompt-mean", "sequence_packing.enabled=false"],
        "loss_fn.loss_agg_mode=prompt-mean averages each prompt's responses in one micro-batch",
    ),
    # plan
    "plan --global-batch-size 0 on the run's data": (["plan", "--global-batch-size", "0"], "is for --lengths/--corpus"),
    "plan a GRPO run without rollouts": (["plan", "algorithm=grpo"], "grpo.rollouts is not set"),
    "plan tp that does not divide the cluster": (["plan", "--tp", "2"], "pass --dp N to plan N data-parallel ranks"),
    # export
    "export a folder that is no checkpoint": (
        ["export", "--checkpoint", "{tmp}/nope", "--out", "{tmp}/hf"],
        "is neither a checkpoint step folder (mcore_packing.json) nor holds a complete one",
    ),
    "export --dtype float8": (
        ["export", "--checkpoint", "{tmp}/nope", "--out", "{tmp}/hf", "--dtype", "float8"],
        "invalid choice: 'float8' (choose from",
    ),
}

# fmt: off
FIXED = {  # the control: the same command with the input fixed passes
    "data.text_field absent": ["train", "--dry-run", "data=jsonl", "data.path={nofield}", "data.text_field=body",
                               "training.global_batch_size=1"],
    "more prompts per step than groups": ["train", "--dry-run", "algorithm=grpo", "grpo.rollouts={rollouts}",
                                          "grpo.num_prompts_per_step=2"],
    "plan tp that does not divide the cluster": ["plan", "--tp", "2", "--dp", "1", "--steps", "1", "--no-recommend"],
    "batch below the data-parallel size": ["train", "--dry-run", "cluster.gpus_per_node=2",
                                           "training.global_batch_size=2"],
    "conversation without an assistant turn": ["train", "--dry-run", "data=jsonl", "data.path={no_assistant}",
                                               "data.text_field=messages", "data.samples_without_targets=drop",
                                               "training.global_batch_size=1"],
    "message content a number": ["train", "--dry-run", "data=jsonl", "data.path={text_parts}",
                                 "data.text_field=messages", "training.global_batch_size=1"],
    "run_dir of another run": ["train", "--dry-run", "run_dir={another}", "overwrite=true"],
    "the importance-sampling correction without generation log-probs": [
        "train", "--dry-run", "algorithm=grpo", "grpo.rollouts={rollouts_logprobs}", "grpo.num_prompts_per_step=2",
        "loss_fn.use_importance_sampling_correction=true", "loss_fn.truncated_importance_sampling_type=seq-mask-tis",
        "loss_fn.truncated_importance_sampling_ratio_min=0.5", "loss_fn.truncated_importance_sampling_ratio=2",
        "loss_fn.loss_agg_mode=prompt-mean", "grpo.temperature=0.7"],
}
# fmt: on


@pytest.fixture
def files(tmp_path):
    hf = tmp_path / "hf_no_tokenizer"
    hf.mkdir()
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 4096,
              "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 4096,
              "tie_word_embeddings": False}  # fmt: skip
    (hf / "config.json").write_text(json.dumps(config))
    return {
        "tmp": str(tmp_path),
        "nofield": _write(tmp_path / "nofield.jsonl", '{"body": "some text to learn"}\n'),
        "empty": _write(tmp_path / "empty.jsonl", "\n"),
        "hf_no_tokenizer": str(hf),
        "single": _rollouts(tmp_path / "single.jsonl", {"a": 2, "b": 1}),
        "rollouts": _rollouts(tmp_path / "rollouts.jsonl", {"a": 2, "b": 2}),
        "rollouts_logprobs": _rollouts(tmp_path / "rollouts_logprobs.jsonl", {"a": 2, "b": 2}, logprobs=True),
        "no_assistant": _write(tmp_path / "no_assistant.jsonl",
                               _chat("2+2?", "4") + _chat("hello?") + _chat("3+3?", "6")),
        "number_content": _write(tmp_path / "number_content.jsonl", _chat("2+2?", 4)),
        "text_parts": _write(tmp_path / "text_parts.jsonl", _chat("2+2?", [{"type": "text", "text": "4"}])),
        "afile": _write(tmp_path / "a_file", "not a folder"),
        "another": str(_another_run(tmp_path / "another")),
    }


def _chat(question: str, answer=None) -> str:
    messages = [{"role": "user", "content": question}]
    messages += [] if answer is None else [{"role": "assistant", "content": answer}]
    return json.dumps({"messages": messages}) + "\n"


def _another_run(folder):
    (folder / "checkpoints" / "step_000003").mkdir(parents=True)
    (folder / "run.json").write_text(json.dumps({"job": "elsewhere-1-2.00", "started": "2026-12-01T00:00:00"}))
    return folder


@pytest.mark.parametrize("name", list(CASES))
def test_a_bad_input_exits_2_naming_value_and_fix(name, files, capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    argv, fragment = CASES[name]
    try:
        code = cli([a.format(**files) for a in argv])
    except SystemExit as exc:  # argparse's own errors exit 2 the same way
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2, err
    assert fragment in err and "Traceback" not in err, err
    if name in FIXED:
        code = cli([a.format(**files) for a in FIXED[name]])
        assert code == 0, capsys.readouterr().err


TRAIN_CASES = [name for name, (argv, _) in CASES.items() if argv[:2] == ["train", "--dry-run"]]


@pytest.mark.parametrize("name", TRAIN_CASES)
def test_the_same_bad_input_to_train_is_refused_before_the_model_and_writes_nothing(name, files, capsys,
                                                                                   monkeypatch, tmp_path):  # fmt: skip
    """Not only --dry-run: ``train`` itself refuses each, with exit 2, before Megatron's model is built
    (`setup_training` must not be reached) and before anything is written into ``run_dir``."""
    from mcore_packing.app import trainer

    def no_model(*args, **kwargs):
        raise AssertionError(f"{name}: the model was built before the refusal")

    monkeypatch.setattr(trainer, "setup_training", no_model)
    monkeypatch.chdir(tmp_path)
    argv, fragment = CASES[name]
    argv = [a.format(**files) for a in argv if a != "--dry-run"]
    if "cluster.gpus_per_node=2" in argv:  # train takes its world size from the launcher
        monkeypatch.setenv("WORLD_SIZE", "2")
        monkeypatch.setenv("RANK", "0")
    if not any(a.startswith("run_dir=") for a in argv):
        argv.append(f"run_dir={tmp_path}/run")
    run_dir = tmp_path / next(a for a in argv if a.startswith("run_dir=")).split("=", 1)[1]
    before = sorted(p for p in run_dir.rglob("*")) if run_dir.is_dir() else None
    assert cli(argv) == 2
    err = capsys.readouterr().err
    assert fragment in err and "Traceback" not in err, err
    assert (sorted(run_dir.rglob("*")) if run_dir.is_dir() else None) == before  # nothing written
    assert not (tmp_path / "outputs").exists()
