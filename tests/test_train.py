"""The training entry point as users run it: Hydra overrides, every mode, resume, errors, torchrun."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SMALL = [
    "model.hidden_size=64",
    "model.num_attention_heads=2",
    "model.num_query_groups=1",
    "model.ffn_hidden_size=128",
    "data.num_samples=48",
    "data.max_sample_tokens=1024",
    "data.long_samples=truncate",
    "data.vocab_size=1024",
    "training.global_batch_size=8",
    "optimizer.lr=0.01",
    "sequence_packing.train_mb_tokens=1024",
    "dynamic_batching.train_mb_tokens=1024",
    "logging.progress_bar=false",
]


def train(run_dir: Path, *overrides: str, torchrun: int = 0, env: dict | None = None, timeout: int = 600):
    cmd = [sys.executable, "-m", "mcore_packing", "train"]
    if torchrun:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={torchrun}",
            "-m",
            "mcore_packing",
            "train",
        ]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    full_env.pop("RANK", None)
    given = {o.split("=", 1)[0].lstrip("+~") for o in overrides}
    small = [o for o in SMALL if o.split("=", 1)[0] not in given]  # an override replaces the default one
    return subprocess.run(
        [*cmd, *small, f"run_dir={run_dir}", *overrides],
        cwd=ROOT,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.parametrize(
    "mode_overrides, mode",
    [
        ([], "packing"),
        # #41 on the way: a memory budget (each step's predicted peak logged and under it), log-probs in
        # chunks, recomputation
        (["sequence_packing.enabled=false", "dynamic_batching.enabled=true", "dynamic_batching.memory_budget=20MiB",
          "model.logprob_chunk_size=256", "model.recompute_granularity=selective"], "dynamic"),
        (["sequence_packing.enabled=false"], "padded"),
    ],
)
def test_each_mode_trains_and_loss_decreases(tmp_path, mode_overrides, mode):
    proc = train(tmp_path / "run", "training.steps=6", *mode_overrides)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"mode={mode}" in proc.stdout
    rows = metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert rows[-1]["loss"] < rows[0]["loss"] - 0.1, [r["loss"] for r in rows]
    if mode == "packing":
        assert all(r["utilization"] == 1.0 for r in rows)  # no padding without CP/TP multiples
        assert all(r["rank_cost_max_over_mean"] >= 1.0 for r in rows)
        assert [r["predicted_step_time_s"] is None for r in rows] == [True] * 4 + [False] * 2
        assert all(r["predicted_step_time_s"] > 0 for r in rows[4:])
    else:
        assert all(r["useful_tokens"] <= r["padded_tokens"] for r in rows)
    if mode == "dynamic":
        log = proc.stderr + proc.stdout
        assert "predicted peak per GPU (first batch, sdpa-math attention)" in log
        assert all(0 < r["predicted_peak_bytes"][0] <= 20 * 2**20 for r in rows)
    assert (tmp_path / "run" / "config.yaml").exists() and (tmp_path / "run" / "run.json").exists()


@pytest.mark.slow
def test_resume_continues_at_the_exact_next_sample(tmp_path):
    schedule = "optimizer.lr_decay_iters=4"  # the 2-step run follows the 4-step run's LR schedule
    straight = train(tmp_path / "a", "training.steps=4", schedule)
    assert straight.returncode == 0, straight.stderr[-3000:]
    first = train(tmp_path / "b", "training.steps=2", schedule)
    assert first.returncode == 0, first.stderr[-3000:]
    resumed = train(tmp_path / "b", "training.steps=4", schedule, "resume=true")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    a, b = metrics(tmp_path / "a"), metrics(tmp_path / "b")
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    assert [r["sample_ids"] for r in a] == [r["sample_ids"] for r in b]  # nothing lost or repeated
    for x, y in zip(a, b, strict=True):
        assert abs(x["loss"] - y["loss"]) <= 1e-6 * abs(x["loss"]), (x["loss"], y["loss"])
        assert x["lr"] == y["lr"] and abs(x["grad_norm"] - y["grad_norm"]) <= 1e-5 * x["grad_norm"]
    # Negative control: a run with another seed consumes different samples.
    other = train(tmp_path / "c", "training.steps=1", "training.seed=7")
    assert other.returncode == 0
    assert metrics(tmp_path / "c")[0]["sample_ids"] != a[0]["sample_ids"]


@pytest.mark.parametrize(
    "overrides, world, fragment",
    [
        (["dynamic_batching.enabled=true"], 1, "are both true"),
        (["+new.key=1"], 1, "Unknown config key 'new'"),
        (["sequence_packing.train_mb_tokens=100"], 1, "samples are longer than a micro-batch (100 tokens = "),
        (["parallel.cp=2", "parallel.make_sequence_length_divisible_by=6"], 2, "incompatible with parallel.cp=2"),
        (["parallel.tp=2"], 1, "World size 1 does not factor"),
        (["parallel.sequence_parallel=true"], 1, "parallel.sequence_parallel=true needs parallel.tp > 1"),
        (["parallel.tp=2"], 2, "model.num_query_groups=1 heads cannot be split over parallel.tp=2"),
        (["sequence_packing.algorithm=magic"], 1, "sequence_packing: Unknown packing algorithm 'magic'"),
        (["sequence_packing.algorithm=concatenative", "sequence_packing.refine=true"], 1, "not available for"),
        (["resume=true"], 1, "holds no complete checkpoint"),
        (["resume=maybe"], 1, "resume must be one of False, True, auto"),
        (["optimizer.min_lr=1.0"], 1, "optimizer.min_lr=1.0 is above optimizer.lr=0.01"),
        (["optimizer.lr=-0.1"], 1, "optimizer.lr=-0.1 must be a number >= 0.0"),
        (["optimizer.optimizer=lion"], 1, "optimizer.optimizer must be one of adam, sgd"),
        (
            ["optimizer.lr_warmup_iters=30", "optimizer.lr_decay_iters=20"],
            1,
            "must exceed optimizer.lr_warmup_iters=30",
        ),
        (
            ["parallel.pp=2", "sequence_packing.enabled=false", "dynamic_batching.enabled=true"],
            2,
            "needs parallel.variable_seq_lengths=true",
        ),
        (["training.balance=greedy"], 1, "training.balance must be one of cost, tokens, round_robin"),
        (["data.max_sample_tokens=0"], 1, "data.max_sample_tokens must be an integer >= 1"),
        (["training.global_batch_size=600"], 1, "larger than the data set"),
        (["parallel.vpp=2"], 1, "parallel.vpp=2 interleaves model chunks over pipeline stages, but pp=1"),
        (["parallel.pp=2", "parallel.vpp=2"], 2, "model.num_layers=2 cannot be split into parallel.pp x parallel.vpp"),
        (["parallel.pp=2", "parallel.vpp=2", "parallel.microbatch_group_size_per_vp_stage=1"], 2,
         "parallel.microbatch_group_size_per_vp_stage=1 must be at least pp=2"),
        (["context_parallel.dynamic=true"], 1, "context_parallel.dynamic=true picks a CP size per sequence up to "
         "parallel.cp, which is 1"),
        (["context_parallel.max_tokens_per_rank=512"], 1,
         "context_parallel.max_tokens_per_rank=512 applies to dynamic CP"),
        (["context_parallel.max_tokens_per_rank=0", "context_parallel.dynamic=true"], 1,
         "context_parallel.max_tokens_per_rank must be an integer >= 1"),
        (["parallel.cp=3", "context_parallel.dynamic=true", "model.num_attention_heads=4"], 3,
         "needs a power-of-two parallel.cp"),
        (["parallel.cp=2", "parallel.pp=2", "context_parallel.dynamic=true"], 4,
         "context_parallel.dynamic runs at parallel.pp=1 (got parallel.pp=2)"),
        (["parallel.cp=2", "context_parallel.dynamic=true", "sequence_packing.enabled=false"], 2,
         "context_parallel.dynamic=true runs packed THD rows (sequence_packing.enabled=true) or dynamic batching"),
        (["parallel.cp=2", "context_parallel.dynamic=true", "sequence_packing.fixed_shape=true"], 2,
         "sequence_packing.fixed_shape does not apply with context_parallel.dynamic=true"),
        (["parallel.cp=2", "context_parallel.dynamic=true", "context_parallel.max_tokens_per_rank=100"], 2,
         "Raise context_parallel.max_tokens_per_rank to at least"),
    ],
)
def test_validation_errors_name_the_key(tmp_path, overrides, world, fragment):
    """In-process: every check that runs before Megatron (`prepare_run`) on the composed Hydra config."""
    from mcore_packing.app.config import ConfigError
    from mcore_packing.app.train_command import compose_config
    from mcore_packing.app.trainer import prepare_run

    with pytest.raises(ConfigError) as err:
        prepare_run(compose_config(None, [*SMALL, f"run_dir={tmp_path}", *overrides]), world)
    assert fragment in str(err.value)


def test_valid_config_passes_the_same_checks(tmp_path):
    """The control for the test above: the same path accepts the defaults."""
    from mcore_packing.app.train_command import compose_config
    from mcore_packing.app.trainer import prepare_run

    inputs = prepare_run(compose_config(None, [*SMALL, f"run_dir={tmp_path}"]), 2)
    assert inputs.layout.dp == 2 and inputs.step_config.mode == "packing" and 8 <= len(inputs.lengths) <= 48


def test_a_zero_learning_rate_is_allowed_with_a_warning(tmp_path):
    """lr=0 checks a conversion round trip or a loss on the starting weights: accepted, said once."""
    from mcore_packing.app.train_command import compose_config
    from mcore_packing.app.trainer import prepare_run

    with pytest.warns(UserWarning, match=r"optimizer.lr=0: no step changes the weights"):
        prepare_run(compose_config(None, [*SMALL, f"run_dir={tmp_path}", "optimizer.lr=0"]), 1)


def test_a_config_error_exits_2_from_the_command_line(tmp_path):
    """One subprocess for the exit-code path: the message on stderr, code 2, no traceback."""
    proc = train(tmp_path / "run", "sequence_packing.train_mb_tokens=100", timeout=120)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "config error: " in proc.stderr and "Raise sequence_packing.train_mb_tokens to at least" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.slow
@pytest.mark.multirank
@pytest.mark.parametrize(
    "parallel",
    [
        ["model.dtype=bfloat16", "optimizer.use_distributed_optimizer=true"],  # DP2: the optimizer state sharded
        ["parallel.cp=2"],
        ["parallel.tp=2", "parallel.sequence_parallel=true", "model.num_query_groups=2"],
    ],
    ids=["dp2-bf16-distributed-optimizer", "cp2", "tp2-sp"],
)
def test_torchrun_two_ranks(tmp_path, parallel):
    proc = train(tmp_path / "run", "training.steps=3", *parallel, torchrun=2)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Warning" not in proc.stderr, proc.stderr[-3000:]  # torch's and Megatron's known noise is filtered
    assert "[rank 0/2]" in proc.stdout and "[rank 1/2]" in proc.stdout
    rows = metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2, 3]  # one writer: rank 0
    assert rows[-1]["loss"] < rows[0]["loss"]
    log = (tmp_path / "run" / "train.log").read_text()
    assert log.count("step 3/3") == 1  # only rank 0 writes the log file


@pytest.fixture(scope="module")
def single_rank_run(tmp_path_factory) -> list[dict]:
    """Three steps on one rank (the reference of the dynamic-CP runs): their metrics."""
    run_dir = tmp_path_factory.mktemp("single")
    single = train(run_dir, "training.steps=3")
    assert single.returncode == 0, single.stderr[-3000:]
    return metrics(run_dir)


@pytest.mark.slow
@pytest.mark.multirank
@pytest.mark.parametrize("kind", ["packing", "dynamic_batching"])
def test_dynamic_cp_trains_with_the_single_rank_losses(tmp_path, kind, single_rank_run):
    """context_parallel.dynamic on 2 ranks (CP2, 768 tokens per rank), with packed THD rows and with dynamic
    batching's BSHD rows: conversations over 768 tokens run on both ranks, the others on one; every step's
    loss equals a single rank's (the step is exact), and the metrics say which CP sizes ran."""
    dynamic = ["parallel.cp=2", "context_parallel.dynamic=true", "context_parallel.max_tokens_per_rank=768"]
    if kind == "dynamic_batching":
        dynamic += ["sequence_packing.enabled=false", "dynamic_batching.enabled=true"]
    proc = train(tmp_path / "dynamic", "training.steps=3", *dynamic, torchrun=2)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "cp=1/2 (dynamic)" in proc.stdout
    rows, expected = metrics(tmp_path / "dynamic"), single_rank_run
    for got, want in zip(rows, expected, strict=True):
        assert abs(got["loss"] - want["loss"]) <= 1e-5 * abs(want["loss"]), (got["loss"], want["loss"])
        assert got["useful_tokens"] == want["useful_tokens"]
    sizes = [r["cp_sizes"] for r in rows]
    assert sum(s["1"] for s in sizes) and sum(s["2"] for s in sizes), sizes  # both sizes ran
    assert "cp_sizes" not in expected[0]


def test_the_warning_filter_keeps_ours_and_unknown_ones():
    import warnings

    from mcore_packing.app.trainer import quiet_megatron_on_cpu

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet_megatron_on_cpu(cpu=True)
        warnings.warn("Transformer Engine and Apex are not installed. Falling back to Torch optimizers.", stacklevel=1)
        warnings.warn("`torch.distributed.reduce_scatter_tensor` is deprecated.", FutureWarning, stacklevel=1)
        warnings.warn("set CUDA_DEVICE_MAX_CONNECTIONS to 1", stacklevel=1)
        warnings.warn("model.num_layers=5 is ignored: config.json says 2.", stacklevel=1)
        warnings.warn("something new from torch", FutureWarning, stacklevel=1)
    assert [str(w.message) for w in caught] == ["model.num_layers=5 is ignored: config.json says 2.",
                                                "something new from torch"]  # fmt: skip


@pytest.mark.slow
def test_fp16_trains_with_dynamic_loss_scaling(tmp_path):
    """fp16 parameters, fp32 master weights, Megatron's dynamic loss scaler: started at 2**20, the
    first updates overflow and are skipped (the scale halves each time), then updates apply and the loss
    falls."""
    overrides = ["optimizer.initial_loss_scale=1048576", "optimizer.hysteresis=1"]  # 2**20: a few overflows
    proc = train(tmp_path / "run", "model.dtype=float16", "training.steps=10", *overrides)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = metrics(tmp_path / "run")
    applied = [r["update_applied"] for r in rows]
    assert not applied[0] and any(applied), applied  # skipped while the scale is too large, then applied
    assert rows[-1]["loss"] < rows[0]["loss"], [r["loss"] for r in rows]


@pytest.mark.slow
def test_users_jsonl_data(tmp_path):
    from mcore_packing.data.real_text import stdlib_source_texts

    texts = [t[:3000] for t in stdlib_source_texts()[:40]]  # real text: the first 40 stdlib modules
    path = tmp_path / "mine.jsonl"
    path.write_text("\n".join(json.dumps({"content": t}) for t in texts) + "\n")
    proc = train(
        tmp_path / "run",
        "data=jsonl",
        f"data.path={path}",
        "data.text_field=content",
        "data.num_samples=null",
        "data.long_samples=split",
        "training.steps=3",
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    info = next(line for line in proc.stdout.splitlines() if '"source": "jsonl"' in line)
    assert '"num_records": 40' in info
    assert len(metrics(tmp_path / "run")) == 3
    from mcore_packing.app.config import ConfigError
    from mcore_packing.app.train_command import compose_config
    from mcore_packing.app.trainer import prepare_run

    with pytest.raises(ConfigError, match="has no field 'body'"):
        prepare_run(compose_config(None, [*SMALL, "data=jsonl", f"data.path={path}", "data.text_field=body"]), 1)


@pytest.mark.slow
def test_fine_tune_a_hugging_face_checkpoint_and_export_it(tmp_path):
    """model.hf_path: the checkpoint's weights, tokenizer and chat template; export at the end loads in
    transformers, with the tokenizer files, and differs from the starting weights (it trained)."""
    import torch
    import transformers

    from .hf_models import make_chat_model

    source = make_chat_model(tmp_path / "hf")
    out = tmp_path / "exported"
    proc = train(
        tmp_path / "run",
        f"model.hf_path={source}",
        f"training.export_dir={out}",
        "training.steps=3",
        "data.max_sample_tokens=1024",
        "sequence_packing.train_mb_tokens=2048",
        "data.long_samples=truncate",
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    from safetensors import safe_open

    with safe_open(str(source / "model.safetensors"), framework="pt") as f:
        assert f"loaded {len(list(f.keys()))} tensors from {source}" in proc.stdout  # every one, once
    assert "model.num_attention_heads=2 is ignored" in proc.stderr  # the config.json of model.hf_path wins
    info = json.loads(next(line for line in proc.stdout.splitlines() if '"tokenizer": "' in line).split("data: ")[1])
    assert info["tokenizer"] == str(source) and info["vocab_size"] == 384
    rows = metrics(tmp_path / "run")
    assert rows[-1]["loss"] < rows[0]["loss"]
    assert (out / "tokenizer.json").is_file() and (out / "tokenizer_config.json").is_file()
    tokens = torch.tensor([[5, 100, 7, 300, 42]])
    with torch.no_grad():
        before = transformers.AutoModelForCausalLM.from_pretrained(source).eval()(tokens).logits
        after = transformers.AutoModelForCausalLM.from_pretrained(out).eval()(tokens).logits
    assert (after - before).abs().max() > 1e-3


@pytest.mark.slow
def test_extending_a_finished_run_refuses_or_rebuilds_the_schedule_never_lr_0(tmp_path):
    """A 2-step run's cosine schedule ends at lr 0; extended to 4 steps on resume it would train at lr 0.
    Without the key the run is refused before Megatron starts, naming the key; with
    optimizer.override_opt_param_scheduler=true the schedule is rebuilt over 4 steps from step 3."""
    first = train(tmp_path, "training.steps=2", "optimizer.lr_warmup_iters=0")
    assert first.returncode == 0, first.stderr[-3000:]
    refused = train(tmp_path, "training.steps=4", "optimizer.lr_warmup_iters=0", "resume=true")
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert "optimizer.lr_decay_iters (null: the run's optimizer steps): checkpoint 2, this run 4" in refused.stderr
    assert "optimizer.override_opt_param_scheduler=true" in refused.stderr
    rebuilt = train(tmp_path, "training.steps=4", "optimizer.lr_warmup_iters=0", "resume=true",
                    "optimizer.override_opt_param_scheduler=true")  # fmt: skip
    assert rebuilt.returncode == 0, rebuilt.stderr[-3000:]
    assert "the LR schedule is rebuilt for this run" in rebuilt.stdout + rebuilt.stderr
    lrs = {r["step"]: r["lr"] for r in metrics(tmp_path)}
    # cosine over 4 steps from 0.01: step k uses the schedule at k - 1 (the old schedule gave step 4 lr 0)
    assert lrs[3] == pytest.approx(0.01 * (1 + math.cos(math.pi * 2 / 4)) / 2)
    assert lrs[4] == pytest.approx(0.01 * (1 + math.cos(math.pi * 3 / 4)) / 2) and lrs[4] > 0


@pytest.mark.parametrize(
    ("messages", "fragment"),
    [
        ([{"role": "human", "content": "2+2?"}, {"role": "gpt", "content": "4"}], "uses role(s) ['gpt', 'human']"),
        ([{"role": "user", "content": "2+2?"}], "16 records are bad (the first 10 shown):\n  "),
        ([{"role": "user", "content": "2+2?"}], "chat.jsonl:10 has no learned token (a conversation without an"),
    ],
)
def test_chat_data_that_would_learn_nothing_is_refused_before_megatron(tmp_path, messages, fragment):
    from mcore_packing.app.config import ConfigError
    from mcore_packing.app.train_command import compose_config
    from mcore_packing.app.trainer import prepare_run

    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps({"messages": messages}) + "\n" for _ in range(16)))
    data = ["data=jsonl", f"data.path={path}", "data.text_field=messages", "training.global_batch_size=8"]
    with pytest.raises(ConfigError, match=re.escape(fragment)):
        prepare_run(compose_config(None, [*SMALL, f"run_dir={tmp_path}", *data]), 1)
