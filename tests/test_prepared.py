"""`python -m mcore_packing prepare` and ``data.prepared``: the store holds exactly what training makes from
the JSONL (ids, learned tokens, the long-sample policy's outcomes), Megatron-Core's own reader reads it,
training and planning from it equal training and planning from the JSONL, and a changed, truncated or
unfinished store is refused naming the file."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from mcore_packing.app.prepare_command import prepare
from mcore_packing.data.real_text import champ_conversations
from mcore_packing.data.sft import _role, load_sft_data
from mcore_packing.data.store import PreparedStore, mask_from_spans, spans_from_mask

from .hf_models import make_chat_model


def write_jsonl(path, count: int = 160):
    """CHAMP conversations (some over the limit below), with a plain text every fifth line."""
    with open(path, "w") as f:
        for i, turns in enumerate(champ_conversations()[:count]):
            f.write(json.dumps({"messages": [{"role": _role(r), "content": t} for r, t in turns]}) + "\n")
            if i % 5 == 0:
                f.write(json.dumps({"messages": f"plain text {i}: every token of it is learned " * (i % 7 + 1)}) + "\n")
    return path


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_chat_model(tmp_path_factory.mktemp("model") / "hf")


@pytest.fixture(scope="module")
def jsonl(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("data") / "chat.jsonl")


def test_spans_round_trip_masks():
    rng = np.random.default_rng(0)
    for n in (0, 1, 2, 17, 100):
        mask = (rng.random(n) > 0.5).astype(np.float32)
        assert np.array_equal(mask_from_spans(spans_from_mask(mask), n), mask)
    assert spans_from_mask(np.array([0, 1, 1, 0, 1])).tolist() == [1, 3, 4, 5]


@pytest.mark.parametrize("policy", [None, "truncate"])
def test_the_store_holds_what_load_sft_data_makes_sample_by_sample(tmp_path, model, jsonl, policy):
    settings = {"text_field": "messages", "max_sample_tokens": 1024, "long_samples": policy}
    manifest = prepare(jsonl, tmp_path / "store", hf_path=model, workers=2, chunk_records=23, **settings)
    store = PreparedStore(tmp_path / "store")
    ref = load_sft_data(source="jsonl", path=str(jsonl), num_samples=None, tokenizer_path=str(model), **settings)
    assert len(store) == len(ref.samples) == manifest["counts"]["num_samples"]
    for i, sample in enumerate(ref.samples):
        got = store[i]
        assert np.array_equal(got.tokens, sample.tokens) and np.array_equal(got.loss_mask, sample.loss_mask), i
    assert np.array_equal(store.lengths, [len(s) for s in ref.samples])
    for key in ("num_records", "num_tokens", "long_samples_dropped", "long_samples_truncated"):
        assert manifest["counts"][key] == ref.info[key], key
    assert manifest["counts"]["long_samples_dropped" if policy is None else "long_samples_truncated"] > 0
    assert store.dtype == np.uint16 and store.vocab_size == ref.vocab_size  # 384 ids: two bytes per token


def test_megatron_reads_the_store_and_learn_prompt_changes_only_the_masks(tmp_path, model, jsonl):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    prepare(jsonl, tmp_path / "a", hf_path=model, text_field="messages", max_sample_tokens=1024)
    prepare(jsonl, tmp_path / "b", hf_path=model, text_field="messages", max_sample_tokens=1024, learn_prompt=True)
    a, b = PreparedStore(tmp_path / "a"), PreparedStore(tmp_path / "b")
    theirs = IndexedDataset(str(tmp_path / "a" / "tokens"))
    assert len(theirs) == len(a) and np.array_equal(theirs.sequence_lengths, a.lengths)
    assert all(np.array_equal(np.asarray(theirs[i], dtype=np.int64), a[i].tokens) for i in range(0, len(a), 7))
    assert np.array_equal(a.lengths, b.lengths) and a.fingerprint != b.fingerprint
    assert all(b[i].loss_mask.all() for i in range(len(b)))  # control: every token learned
    assert not all(a[i].loss_mask.all() for i in range(len(a)))


def test_a_changed_truncated_or_unfinished_store_is_refused_naming_the_file(tmp_path, model, jsonl):
    prepare(jsonl, tmp_path / "store", hf_path=model, text_field="messages", max_sample_tokens=1024)
    PreparedStore(tmp_path / "store")  # control: as written, it opens
    bad = tmp_path / "bad"
    for name, damage, message in [
        ("tokens.bin", lambda p: p.write_bytes(p.read_bytes()[:-2]), r"tokens\.bin has \d+ bytes but the manifest"),
        ("spans.idx", lambda p: p.write_bytes(p.read_bytes()[:-1] + b"\x07"), r"spans\.idx differs from the one"),
        ("manifest.json", lambda p: p.unlink(), r"manifest\.json does not exist \(a prepare that did not finish"),
        ("spans.bin", lambda p: p.unlink(), r"spans\.bin is missing"),
    ]:
        import shutil

        shutil.rmtree(bad, ignore_errors=True)
        shutil.copytree(tmp_path / "store", bad)
        damage(bad / name)
        with pytest.raises((ValueError, FileNotFoundError), match=message):
            PreparedStore(bad)


def test_bad_lines_are_reported_together_and_nothing_is_written(tmp_path, model):
    lines = [json.dumps({"messages": "fine text"})] * 30
    lines[3] = "{not json"
    lines[25] = json.dumps({"messages": [{"role": "human", "content": "hi"}]})
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines) + "\n")
    cmd = [sys.executable, "-m", "mcore_packing", "prepare", "--input", str(path), "--out", str(tmp_path / "store"),
           "--hf-path", str(model), "--text-field", "messages", "--chunk-records", "10", "--workers", "2"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert "2 lines are bad" in proc.stderr and "bad.jsonl:4 is not valid JSON" in proc.stderr
    assert "bad.jsonl:26 uses role(s) ['human']" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "store").exists() and not list(tmp_path.glob(".store*"))
    path.write_text("\n".join(lines[:3] + lines[4:25]) + "\n")  # control: the good lines prepare
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and len(PreparedStore(tmp_path / "store")) == 24, proc.stderr
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)  # the store exists now
    assert proc.returncode == 2 and "exists; remove it" in proc.stderr


def test_samples_without_a_learned_token_are_refused_or_dropped_and_contents_must_be_text(tmp_path, model):
    """prepare checks what training checks: a conversation with no assistant turn is refused naming
    file:line (or dropped and counted with --samples-without-targets drop); a content that is a number
    is refused; text parts are joined into the string a text-only chat template renders."""
    def chat(*turns):
        return json.dumps({"messages": [{"role": r, "content": c} for r, c in turns]})

    lines = [chat(("user", "2+2?"), ("assistant", "4"))] * 4
    lines[1] = chat(("user", "hello?"))
    lines[2] = chat(("user", "3+3?"), ("assistant", [{"type": "text", "text": "6"}]))
    path = tmp_path / "chat.jsonl"
    path.write_text("\n".join(lines) + "\n")
    args = {"hf_path": model, "text_field": "messages"}
    with pytest.raises(ValueError, match=r"chat\.jsonl:2 has no learned token \(a conversation without an assistant"):
        prepare(path, tmp_path / "refused", **args)
    assert not (tmp_path / "refused").exists()
    manifest = prepare(path, tmp_path / "dropped", **args, samples_without_targets="drop")
    assert manifest["counts"]["num_samples"] == 3 and manifest["counts"]["samples_without_targets_dropped"] == 1
    assert len(PreparedStore(tmp_path / "dropped")) == 3  # the other three records, each a sample
    parts, plain = (tmp_path / "parts.jsonl"), (tmp_path / "plain.jsonl")
    parts.write_text(lines[2] + "\n")
    plain.write_text(chat(("user", "3+3?"), ("assistant", "6")) + "\n")
    a, b = prepare(parts, tmp_path / "a", **args), prepare(plain, tmp_path / "b", **args)
    assert np.array_equal(PreparedStore(tmp_path / "a")[0].tokens, PreparedStore(tmp_path / "b")[0].tokens)
    assert a["counts"]["num_tokens"] == b["counts"]["num_tokens"]
    path.write_text(chat(("user", "2+2?"), ("assistant", 4)) + "\n")
    with pytest.raises(ValueError, match=r"chat\.jsonl:1: message 1 has content 4 \(int\); content must be a string"):
        prepare(path, tmp_path / "number", **args)


@pytest.mark.slow
def test_training_and_planning_from_the_store_equal_them_from_the_jsonl(tmp_path, model, jsonl):
    from .test_train import metrics

    # the policy the test helper's runs use (data.long_samples=truncate)
    prepare(jsonl, tmp_path / "store", hf_path=model, text_field="messages", max_sample_tokens=1024,
            long_samples="truncate")  # fmt: skip
    # data.num_samples left at its default: every sample, from the file and from the store alike
    common = [f"model.hf_path={model}", "data.max_sample_tokens=1024", "training.steps=2",
              "training.global_batch_size=8", "sequence_packing.train_mb_tokens=1024"]  # fmt: skip
    def run(name: str, *args: str):  # the test helper's settings except its data.num_samples
        from .test_train import SMALL

        small = [o for o in SMALL if not o.startswith("data.num_samples=")]
        return subprocess.run([sys.executable, "-m", "mcore_packing", "train", *small, *common, *args,
                               f"run_dir={tmp_path / name}"], capture_output=True, text=True, timeout=600,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip

    raw = run("raw", "data.source=jsonl", f"data.path={jsonl}", "data.text_field=messages")
    stored = run("stored", f"data.prepared={tmp_path / 'store'}")
    assert raw.returncode == 0 and stored.returncode == 0, stored.stderr[-3000:]
    rows = {run: [(r["loss"], r["grad_norm"], r["sample_ids"]) for r in metrics(tmp_path / run)]
            for run in ("raw", "stored")}  # fmt: skip
    assert rows["raw"] == rows["stored"]
    size = len(PreparedStore(tmp_path / "store"))
    for proc in (raw, stored):  # the log says what the run draws from
        assert f"data: {size} samples; 2 steps x 8 = 16 draws: no sample seen twice" in proc.stdout, proc.stdout[-2000:]
    assert not [line for line in stored.stderr.splitlines() if "data." in line and "is ignored" in line]
    manifest = json.loads(next((tmp_path / "stored").rglob("mcore_packing.json")).read_text())
    assert manifest["data_fingerprint"].startswith(PreparedStore(tmp_path / "store").fingerprint)

    def plan(*args):
        cmd = [sys.executable, "-m", "mcore_packing", "plan", "--hf-path", str(model), "--steps", "2", "--json",
               "--no-png", *args, "data.num_samples=null", "data.max_sample_tokens=1024",
               "data.long_samples=truncate"]  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
        return json.loads(proc.stdout)

    from_store = plan("--prepared", str(tmp_path / "store"))
    from_jsonl = plan("--jsonl", str(jsonl), "--field", "messages")
    for key in ("num_sequences", "num_tokens", "length", "summary", "whole_dataset_packing", "budget"):
        assert from_store[key] == from_jsonl[key], key


def test_the_store_wins_over_the_runs_data_keys_and_says_so(tmp_path, model, jsonl):
    from mcore_packing.app.algorithms.sft import load_data
    from mcore_packing.app.config import ConfigError
    from mcore_packing.app.train_command import compose_config

    prepare(jsonl, tmp_path / "store", hf_path=model, text_field="messages", max_sample_tokens=1024)
    base = [f"data.prepared={tmp_path / 'store'}", f"run_dir={tmp_path}", "data.max_sample_tokens=1024",
            "data.text_field=messages"]  # fmt: skip
    ignored = r"data\.learn_prompt=True is ignored: .* was prepared with learn_prompt=False"
    with pytest.warns(UserWarning, match=ignored):
        data = load_data(compose_config(None, [*base, "data.learn_prompt=true", "data.num_samples=10"]))
    assert len(data.samples) == 10 and len(data.lengths) == 10  # evenly spaced over the store, as from a file
    store = PreparedStore(tmp_path / "store")
    assert np.array_equal(data.samples[9].tokens, store[len(store) - 1].tokens)  # the picks end at the last sample
    other = make_chat_model(tmp_path / "other", vocab_size=320)  # another tokenizer
    with pytest.raises(ConfigError, match=r"tokenizer or chat template differs from model\.hf_path"):
        load_data(compose_config(None, [*base, f"model.hf_path={other}"]))
    load_data(compose_config(None, [*base, f"model.hf_path={model}"]))  # control: its own tokenizer


@pytest.mark.slow
def test_a_run_on_a_store_resumes_exactly_and_refuses_another_store(tmp_path, model, jsonl):
    import shutil

    from .test_train import metrics, train

    prepare(jsonl, tmp_path / "store", hf_path=model, text_field="messages", max_sample_tokens=1024,
            long_samples="truncate")  # fmt: skip
    steps = [f"model.hf_path={model}", f"data.prepared={tmp_path / 'store'}", "data.num_samples=null",
             "training.save_interval=2", "optimizer.lr_decay_iters=4", "training.global_batch_size=8",
             "sequence_packing.train_mb_tokens=1024"]  # fmt: skip
    straight = train(tmp_path / "straight", *steps, "training.steps=4")
    first = train(tmp_path / "run", *steps, "training.steps=2")
    assert straight.returncode == 0 and first.returncode == 0, first.stderr[-3000:]
    resumed = train(tmp_path / "run", *steps, "training.steps=4", "resume=true")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    rows, ref = metrics(tmp_path / "run"), metrics(tmp_path / "straight")
    assert len(rows) == 4 and [r["sample_ids"] for r in rows] == [r["sample_ids"] for r in ref]
    assert all(abs(a["loss"] - b["loss"]) <= 1e-6 * abs(b["loss"]) for a, b in zip(rows[2:], ref[2:], strict=True))
    shutil.rmtree(tmp_path / "store")  # another store at the same path: other masks, another fingerprint
    prepare(jsonl, tmp_path / "store", hf_path=model, text_field="messages", max_sample_tokens=1024,
            long_samples="truncate", learn_prompt=True)  # fmt: skip
    other = train(tmp_path / "run", *steps, "training.steps=6", "resume=true")
    assert other.returncode == 2 and "trained on another data set" in other.stderr, other.stderr[-2000:]


def test_bad_prepare_flags_exit_2_naming_the_flag(tmp_path, model, jsonl, capsys):
    from mcore_packing.app.prepare_command import main

    out = str(tmp_path / "store")
    base = ["--input", str(jsonl), "--out", out, "--hf-path", str(model), "--text-field", "messages"]
    for argv, message in [
        (["--input", str(tmp_path / "none.jsonl"), "--out", out, "--hf-path", str(model)], "none.jsonl does not exist"),
        ([*base, "--workers", "0"], "--workers=0: use a positive integer"),
        ([*base, "--chunk-records", "-3"], "--chunk-records=-3: use a positive integer"),
        ([*base, "--max-sample-tokens", "0"], "--max-sample-tokens=0: use a positive integer"),
        ([*base[:-4], "--hf-path", str(tmp_path)], "tokenizer.json does not exist"),
    ]:
        assert main(argv) == 2, argv
        assert message in capsys.readouterr().err, argv
    assert not (tmp_path / "store").exists()
