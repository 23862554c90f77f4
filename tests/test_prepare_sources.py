"""``prepare --input`` in every form a data set comes in: a Parquet file, a Hugging Face ``datasets``
folder written by the real ``save_to_disk`` (a Dataset in shards, and a DatasetDict's split), and a folder
of JSONL shards each give the store the JSONL file gives, byte for byte; bad rows are named by file and
row; folders that cannot be read are refused naming the fix."""

from __future__ import annotations

import json
import shutil

import pytest

from mcore_packing.app.prepare_command import main, prepare
from mcore_packing.data.real_text import champ_conversations
from mcore_packing.data.sft import _role
from mcore_packing.data.sources import RecordSource
from mcore_packing.data.store import PreparedStore

from .hf_models import make_chat_model

pa = pytest.importorskip("pyarrow", reason="pyarrow is in the test lock; without it Parquet cannot be read")
pq = pytest.importorskip("pyarrow.parquet")
datasets = pytest.importorskip("datasets", reason="the real save_to_disk writes the Hugging Face folders")

SETTINGS = {"text_field": "messages", "max_sample_tokens": 1024, "long_samples": "truncate"}
STORE_FILES = ("tokens.bin", "tokens.idx", "spans.bin", "spans.idx")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_chat_model(tmp_path_factory.mktemp("model") / "hf")


@pytest.fixture(scope="module")
def rows():
    """Chat rows (an Arrow column holds one type: conversations here), some over the limit, with an extra
    column the store ignores."""
    return [{"messages": [{"role": _role(r), "content": t} for r, t in turns], "id": i}
            for i, turns in enumerate(champ_conversations()[:90])]  # fmt: skip


@pytest.fixture(scope="module")
def reference(tmp_path_factory, model, rows):
    folder = tmp_path_factory.mktemp("jsonl")
    (folder / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    prepare(folder / "chat.jsonl", folder / "store", hf_path=model, workers=2, chunk_records=17, **SETTINGS)
    return folder / "store"


def _same_store(store, reference) -> None:
    for name in STORE_FILES:
        assert (store / name).read_bytes() == (reference / name).read_bytes(), name
    assert PreparedStore(store).manifest["counts"] == PreparedStore(reference).manifest["counts"]


def test_parquet_datasets_folders_and_jsonl_shards_give_the_jsonl_store(tmp_path, model, rows, reference):
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "chat.parquet", row_group_size=13)
    data = datasets.Dataset.from_list(rows)
    data.save_to_disk(str(tmp_path / "hf_dataset"), num_shards=3)
    datasets.DatasetDict({"train": data, "test": data.select(range(5))}).save_to_disk(str(tmp_path / "hf_dict"))
    (tmp_path / "shards").mkdir()
    for k, part in enumerate((rows[:40], rows[40:])):  # read in name order
        (tmp_path / "shards" / f"part-{k}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part))
    for name, form in [("chat.parquet", "parquet"), ("hf_dataset", "arrow"), ("hf_dict", "arrow"),
                       ("shards", "jsonl")]:  # fmt: skip
        manifest = prepare(tmp_path / name, tmp_path / f"store-{name}", hf_path=model, workers=2, chunk_records=17,
                           **SETTINGS)  # fmt: skip
        assert manifest["source"]["form"] == form, name
        _same_store(tmp_path / f"store-{name}", reference)
    assert len(RecordSource(tmp_path / "hf_dataset").files) == 3
    prepare(tmp_path / "hf_dict", tmp_path / "test-split", hf_path=model, split="test", **SETTINGS)
    assert PreparedStore(tmp_path / "test-split").manifest["counts"]["num_records"] == 5  # control: --split read
    shuffled = data.shuffle(seed=3)  # a control: the same rows in another order give another store
    shuffled.save_to_disk(str(tmp_path / "hf_shuffled"))
    prepare(tmp_path / "hf_shuffled", tmp_path / "store-shuffled", hf_path=model, **SETTINGS)
    with pytest.raises(AssertionError):
        _same_store(tmp_path / "store-shuffled", reference)


def test_bad_rows_and_unreadable_folders_are_named(tmp_path, model, rows, capsys):
    bad = [dict(r) for r in rows[:30]]
    bad[4] = {"messages": [{"role": "human", "content": "hi"}], "id": 4}
    bad[21] = {"messages": [], "id": 21}
    pq.write_table(pa.Table.from_pylist(bad), tmp_path / "bad.parquet", row_group_size=8)
    base = ["--hf-path", str(model), "--text-field", "messages", "--chunk-records", "10", "--no-progress"]
    assert main(["--input", str(tmp_path / "bad.parquet"), "--out", str(tmp_path / "s"), *base]) == 2
    err = capsys.readouterr().err
    assert "bad.parquet row 4 uses role(s) ['human']" in err and "Traceback" not in err, err
    assert "2 rows are bad" in err and "bad.parquet row 21 has no learned token" in err, err  # rows, not lines
    assert not (tmp_path / "s").exists()
    datasets.DatasetDict({"a": datasets.Dataset.from_list(rows[:3]), "b": datasets.Dataset.from_list(rows[:2])}
                         ).save_to_disk(str(tmp_path / "dict"))  # fmt: skip
    (tmp_path / "mixed").mkdir()
    shutil.copy(tmp_path / "bad.parquet", tmp_path / "mixed" / "a.parquet")
    (tmp_path / "mixed" / "b.jsonl").write_text(json.dumps(rows[0]) + "\n")
    (tmp_path / "empty").mkdir()
    for argv, message in [
        (["--input", str(tmp_path / "dict")], "a DatasetDict with splits ['a', 'b']; pass --split"),
        (["--input", str(tmp_path / "dict"), "--split", "c"], "pass --split with one of them (got 'c')"),
        (["--input", str(tmp_path / "mixed")], "mixes ['jsonl', 'parquet'] files; keep one kind"),
        (["--input", str(tmp_path / "empty")], "is a folder without .jsonl or .parquet files"),
        (["--input", str(tmp_path / "bad.csv")], "does not exist"),
    ]:
        assert main([*argv, "--out", str(tmp_path / "s"), *base]) == 2, argv
        assert message in capsys.readouterr().err, argv
    (tmp_path / "bad.csv").write_text("a,b\n")
    assert main(["--input", str(tmp_path / "bad.csv"), "--out", str(tmp_path / "s"), *base]) == 2
    assert "unknown file type '.csv'" in capsys.readouterr().err
    assert main(["--input", str(tmp_path / "dict"), "--split", "b", "--out", str(tmp_path / "s"), *base]) == 0
    assert len(PreparedStore(tmp_path / "s")) == 2  # control: the split named is read


def test_pairs_and_rollouts_from_parquet_and_datasets_equal_their_jsonl_stores(tmp_path, model):
    from .test_prepared_kinds import make_pairs, rollout_rows

    for kind, rows, flags in [("pairs", make_pairs(20), {"hf_path": model}), ("rollouts", rollout_rows(5), {})]:
        (tmp_path / f"{kind}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        pq.write_table(pa.Table.from_pylist(rows), tmp_path / f"{kind}.parquet", row_group_size=7)
        datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / f"{kind}_hf"), num_shards=2)
        for source in (f"{kind}.jsonl", f"{kind}.parquet", f"{kind}_hf"):
            prepare(tmp_path / source, tmp_path / f"store-{source}", kind=kind, chunk_records=6, workers=2, **flags)
        for source in (f"{kind}.parquet", f"{kind}_hf"):
            _same_store(tmp_path / f"store-{source}", tmp_path / f"store-{kind}.jsonl")
    extras = [(tmp_path / f"store-rollouts{s}" / "rollouts.json").read_text() for s in (".jsonl", ".parquet", "_hf")]
    assert extras[0] == extras[1] == extras[2] and "prompt-4" in extras[0]
    for s in (".parquet", "_hf"):  # the generation log-probs, None (a null) where a row had none
        assert (tmp_path / f"store-rollouts{s}" / "logprobs.bin").read_bytes() == (
            tmp_path / "store-rollouts.jsonl" / "logprobs.bin").read_bytes()  # fmt: skip
