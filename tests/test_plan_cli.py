"""The planning CLI: real output on a real corpus, and exit code 2 with a clear message on bad input."""

from __future__ import annotations

import json

import numpy as np
import pytest

from mcore_packing import plan


def run(capsys, *argv):
    code = plan.main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_default_run_on_real_corpus(capsys):
    code, out, _ = run(capsys, "--algorithm", "ffd", "--algorithm", "concat")
    assert code == 0
    assert "real:champ" in out and "19440 sequences" in out
    assert "first_fit_decreasing" in out and "concatenative" in out


def test_json_from_a_lengths_file_is_consistent(tmp_path, capsys):
    lengths = np.array([100, 3000, 20, 4000, 700, 650, 90, 10], dtype=np.int64)
    path = tmp_path / "lengths.npy"
    np.save(path, lengths)
    code, out, _ = run(capsys, "--lengths", str(path), "--capacity", "4096", "--global-batch-size", "4",
                       "--micro-batch-size", "2", "--algorithm", "ffd", "--json")
    assert code == 0
    doc = json.loads(out)
    row = doc["per_global_batch"][0]
    assert doc["num_tokens"] == int(lengths.sum())
    # Pad-to-longest over micro-batches of 2 in data order: max(100,3000)*2 + max(20,4000)*2 + 700*2 + 90*2.
    assert row["pad_to_longest_tokens"] == 2 * (3000 + 4000 + 700 + 90)
    assert row["packed_tokens"] == row["num_bins"] * 4096
    assert row["num_bins"] >= row["lower_bound_per_batch_sum"]


@pytest.mark.parametrize("content, suffix, fragment", [
    ("1\n2\nx\n", ".txt", "entry 2 = 'x' is not an integer"),
    ("", ".txt", "holds no lengths"),
    ("[1, 0, 3]", ".json", "length 1 is 0"),
    ("[1.5, 2]", ".json", "must be integers"),
    ("[10, 5000, 6000]", ".json", "2 of 3 sequences are longer than --capacity 4096"),
])
def test_bad_inputs_exit_2_with_message(tmp_path, capsys, content, suffix, fragment):
    path = tmp_path / f"lengths{suffix}"
    path.write_text(content)
    code, _, err = run(capsys, "--lengths", str(path), "--capacity", "4096")
    assert code == 2
    assert fragment in err


def test_missing_file_and_bad_algorithm_exit_2(tmp_path, capsys):
    code, _, err = run(capsys, "--lengths", str(tmp_path / "nope.npy"))
    assert code == 2 and "does not exist" in err
    code, _, err = run(capsys, "--algorithm", "magic")
    assert code == 2 and "Valid names" in err
