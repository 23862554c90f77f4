"""One error style for every JSONL input (SFT data, DPO pairs, GRPO rollouts): ``file:line`` (1-based), the
field, the value and the fix, and up to ten bad lines in one error, through the real readers and the real
``train --dry-run`` command."""

from __future__ import annotations

import json
import re

import pytest

from mcore_packing.data.jsonl import BadLines, read_jsonl_objects
from mcore_packing.data.preference import load_preference_data
from mcore_packing.data.sft import load_sft_data
from mcore_packing.losses.rollouts import check_rollouts, read_rollouts_jsonl_located


def _write(path, lines):
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return str(path)


def _located_lines(message: str, path: str) -> list[int]:
    return [int(n) for n in re.findall(re.escape(path) + r":(\d+)", message)]


def test_twelve_broken_lines_are_reported_ten_at_once_with_their_1_based_numbers(tmp_path):
    lines = ['{"text": "ok"}'] + ['{"text": "a",}'] * 12 + ["", '{"text": "ok"}']
    path = _write(tmp_path / "d.jsonl", lines)
    with pytest.raises(ValueError) as err:
        read_jsonl_objects(path)
    message = str(err.value)
    assert message.startswith("12 lines are bad (the first 10 shown):")
    assert _located_lines(message, path) == list(range(2, 12))  # lines 2..11: 1-based, in file order
    assert message.endswith("... and 2 more") and "not valid JSON" in message


def test_one_bad_line_is_one_plain_message_and_a_clean_file_reads(tmp_path):
    path = _write(tmp_path / "d.jsonl", ['{"text": "a"}', "[1, 2]", '{"text": "b"}'])
    with pytest.raises(ValueError, match=r"d.jsonl:2 is a list, not a JSON object; one per line.$"):
        read_jsonl_objects(path)
    path = _write(tmp_path / "ok.jsonl", ['{"text": "a"}', "", '{"text": "b"}'])
    assert [n for n, _ in read_jsonl_objects(path)] == [1, 3]  # control: blank lines keep the numbering


def test_bytes_that_are_not_utf8_name_the_line(tmp_path):
    path = tmp_path / "latin.jsonl"
    path.write_bytes(b'{"text": "a"}\n{"text": "caf\xe9"}\n')
    with pytest.raises(ValueError, match=r"latin.jsonl:2 is not UTF-8 text"):
        read_jsonl_objects(str(path))


def test_sft_data_reports_every_bad_record(tmp_path):
    lines = [
        json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}),
        json.dumps({"messages": [{"role": "human", "content": "hi"}, {"role": "gpt", "content": "yo"}]}),
        json.dumps({"text": "no messages key"}),
        json.dumps({"messages": 7}),
    ]
    path = _write(tmp_path / "chat.jsonl", lines)
    with pytest.raises(ValueError) as err:
        load_sft_data(source="jsonl", path=path, text_field="messages")
    message = str(err.value)
    # the missing field is found first (the reader), then the records' shapes: both report every line
    assert message.startswith(f"{path}:3 has no field 'messages'")
    lines[2] = lines[0]
    path = _write(tmp_path / "chat.jsonl", lines)
    with pytest.raises(ValueError) as err:
        load_sft_data(source="jsonl", path=path, text_field="messages")
    message = str(err.value)
    assert message.startswith("2 lines are bad:") and _located_lines(message, path) == [2, 4]
    assert "role(s) ['gpt', 'human']" in message and "messages is 7 (int); it must be the text" in message


def test_preference_pairs_report_every_bad_pair(tmp_path):
    lines = [
        json.dumps({"prompt": "2+2=", "chosen": "4", "rejected": "5"}),
        json.dumps({"prompt": "2+2=", "chosen": "4", "rejected": "4"}),
        json.dumps({"prompt": "3+3=", "chosen": "", "rejected": "7"}),
        json.dumps({"prompt": "1+1=", "chosen": "2", "rejected": "3"}),
    ]
    path = _write(tmp_path / "pairs.jsonl", lines)
    with pytest.raises(ValueError) as err:
        load_preference_data(path)
    message = str(err.value)
    assert message.startswith("2 pairs are bad:") and _located_lines(message, path) == [2, 3]
    assert "chosen equals rejected" in message and "chosen is empty" in message


def test_rollouts_report_every_bad_record_with_field_value_and_fix(tmp_path):
    good = {"prompt_tokens": [1, 2], "response_tokens": [3], "reward": 1.0, "group_id": "q"}
    lines = [json.dumps(good)] * 2 + [
        json.dumps({**good, "reward": "1.0"}),
        json.dumps({**good, "response_tokens": [3, -1]}),
        json.dumps({**good, "prompt_tokens": 5}),
        json.dumps({**good, "generation_logprobs": [0.5]}),
    ]
    path = _write(tmp_path / "rollouts.jsonl", lines)
    rollouts, names = read_rollouts_jsonl_located(path)
    with pytest.raises(ValueError) as err:
        check_rollouts(rollouts, names=names)
    message = str(err.value)
    assert message.startswith("4 rollouts are bad:") and _located_lines(message, path) == [3, 4, 5, 6]
    for fragment in ("reward '1.0': a reward is a number", "response_tokens holds [-1]",
                     "prompt_tokens is 5; it must be a list", "the largest is 0.5"):  # fmt: skip
        assert fragment in message
    check_rollouts(rollouts[:2], names=names[:2])  # control: the good lines pass


def test_the_dry_run_prints_all_bad_rollout_lines_and_exits_2(tmp_path, capsys):
    from mcore_packing.app.train_command import main

    good = {"prompt_tokens": [1, 2], "response_tokens": [3], "reward": 1.0, "group_id": "q"}
    lines = [json.dumps(good)] * 2 + [json.dumps({**good, "reward": None})] * 3
    path = _write(tmp_path / "rollouts.jsonl", lines)
    assert main(["--dry-run", "algorithm=grpo", f"grpo.rollouts={path}", f"run_dir={tmp_path}/run"]) == 2
    err = capsys.readouterr().err
    assert "3 rollouts are bad" in err and _located_lines(err, path) == [3, 4, 5] and "Traceback" not in err


def test_bad_lines_collects_only_value_errors():
    bad = BadLines("records")
    assert bad.check(int, "7") == 7 and bad.check(int, "x") is None
    with pytest.raises(TypeError):
        bad.check(len, 5)  # a programming error is not a bad line
    with pytest.raises(ValueError, match="invalid literal"):
        bad.raise_any()
