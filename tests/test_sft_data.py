"""SFT samples: the checkpoint's tokenizer and chat template, assistant-only loss, long-sample policies."""

from __future__ import annotations

import json

import pytest

from mcore_packing.data.hf_tokenizer import ChatTokenizer
from mcore_packing.data.sft import load_sft_data

from .hf_models import make_tokenizer

CONVERSATION = [
    {"role": "system", "content": "You are a careful mathematician."},
    {"role": "user", "content": "What is 17 * 3?"},
    {"role": "assistant", "content": "17 * 3 = 51."},
    {"role": "user", "content": "And 51 + 9?"},
    {"role": "assistant", "content": "60."},
]


@pytest.fixture(scope="module")
def tokenizer_folder(tmp_path_factory):
    return make_tokenizer(tmp_path_factory.mktemp("tok"), 384)


def test_only_the_assistant_turns_are_learned(tokenizer_folder):
    tok = ChatTokenizer(tokenizer_folder)
    ids, mask, ends = tok.encode_conversation(CONVERSATION)
    assert ids == tok.encode(tok.render(CONVERSATION))  # one tokenization of the whole rendered text
    learned = tok.tokenizer.decode([i for i, m in zip(ids, mask, strict=True) if m], skip_special_tokens=False)
    assert learned == "17 * 3 = 51.<|im_end|>\n60.<|im_end|>\n"  # replies and their end-of-turn, nothing else
    assert len(ends) == len(CONVERSATION) and ends[-1] == len(ids) and ends == sorted(ends)
    # The mask is not trivially all ones: system and user turns and the template scaffolding stay out.
    assert 0 < sum(mask) < len(ids) / 2


def test_missing_tokenizer_or_template_is_a_clear_error(tmp_path, tokenizer_folder):
    with pytest.raises(FileNotFoundError, match=r"tokenizer\.json"):
        ChatTokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_bytes((tokenizer_folder / "tokenizer.json").read_bytes())
    with pytest.raises(ValueError, match="has no chat template"):
        ChatTokenizer(tmp_path).render(CONVERSATION)


def _jsonl(tmp_path, records):
    path = tmp_path / "chat.jsonl"
    path.write_text("\n".join(json.dumps({"messages": r}) for r in records) + "\n")
    return str(path)


def test_long_conversations_drop_by_default_or_truncate_at_a_turn(tmp_path, tokenizer_folder):
    path = _jsonl(tmp_path, [CONVERSATION, CONVERSATION[:3]])
    tok = ChatTokenizer(tokenizer_folder)
    full = len(tok.encode_conversation(CONVERSATION)[0])
    first_turn = tok.encode_conversation(CONVERSATION)[2][2]  # tokens through the first reply
    kwargs = dict(source="jsonl", path=path, text_field="messages", tokenizer_path=str(tokenizer_folder))
    dropped = load_sft_data(**kwargs, max_sample_tokens=full - 1)
    assert dropped.info["long_samples_dropped"] == 1 and len(dropped.samples) == 1
    kept = load_sft_data(**kwargs, max_sample_tokens=full - 1, long_samples="truncate")
    assert kept.info["long_samples_truncated"] == 1 and [len(s) for s in kept.samples] == [first_turn, first_turn]
    with pytest.raises(ValueError, match="lose their prompt"):
        load_sft_data(**kwargs, max_sample_tokens=full - 1, long_samples="split")
    whole = load_sft_data(**kwargs, max_sample_tokens=full)
    assert [len(s) for s in whole.samples] == [full, first_turn] and whole.vocab_size == 384


def test_plain_text_splits_without_losing_a_token(tmp_path):
    path = tmp_path / "text.jsonl"
    path.write_text(json.dumps({"text": "word " * 300}) + "\n")
    data = load_sft_data(source="jsonl", path=str(path), max_sample_tokens=64)
    assert data.info["long_samples_split"] == 1 and sum(len(s) for s in data.samples) == data.info["num_tokens"]
    assert all(len(s) <= 64 for s in data.samples)
    with pytest.raises(ValueError, match="for plain text use split"):
        load_sft_data(source="jsonl", path=str(path), max_sample_tokens=64, long_samples="truncate")


def test_champ_default_drops_and_counts(tmp_path):
    data = load_sft_data(num_samples=64, max_sample_tokens=512)
    assert data.info["long_samples_dropped"] > 0 and data.info["long_samples_split"] == 0
    assert len(data.samples) == 64 - data.info["long_samples_dropped"] and all(len(s) <= 512 for s in data.samples)


def test_preference_pairs_through_the_chat_template_learn_only_the_responses(tmp_path, tokenizer_folder):
    from mcore_packing.data.preference import load_preference_data

    prompt = CONVERSATION[:2]
    rows = [
        {"prompt": prompt, "chosen": "17 * 3 = 51.", "rejected": "17 * 3 = 41."},
        {"prompt": "What is 2 + 2?", "chosen": " 4", "rejected": " 5"},  # text: prompt tokens, then the response
    ]
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = load_preference_data(str(path), tokenizer_path=str(tokenizer_folder))
    tok = ChatTokenizer(tokenizer_folder)
    assert len(data.samples) == 4 and data.vocab_size == tok.vocab_size

    def learned(sample):
        ids = [int(i) for i, m in zip(sample.tokens, sample.loss_mask, strict=True) if m]
        return tok.tokenizer.decode(ids, skip_special_tokens=False)

    chosen, rejected, text_chosen, _ = data.samples
    assert learned(chosen) == "17 * 3 = 51.<|im_end|>\n" and learned(rejected) == "17 * 3 = 41.<|im_end|>\n"
    # the system and user turns are rendered but not learned; the whole sample is one tokenization
    assert list(chosen.tokens) == tok.encode(tok.render([*prompt, {"role": "assistant", "content": "17 * 3 = 51."}]))
    assert learned(text_chosen) == " 4" and list(text_chosen.tokens) == tok.encode("What is 2 + 2?") + tok.encode(" 4")


def test_batched_chat_encoding_equals_one_conversation_at_a_time(tokenizer_folder):
    """load_sft_data encodes every conversation in one batch: the same ids, masks and turn ends as one at a
    time, and the masks of the rule written out plainly (a token is learned when its characters lie inside
    an assistant reply's span)."""
    from mcore_packing.data.sft import _records

    tok = ChatTokenizer(tokenizer_folder)
    conversations = _records("champ_full", None, "text")[1][:150]
    batched = tok.encode_conversations(conversations)
    assert batched == [tok.encode_conversation(c) for c in conversations]
    for conversation, (ids, mask, ends) in zip(conversations[:40], batched, strict=False):
        text, spans, char_ends = tok._spans(conversation)
        offsets = tok.tokenizer.encode(text, add_special_tokens=False).offsets
        assert mask == [1.0 if any(a <= s and e <= b for a, b in spans) else 0.0 for s, e in offsets]
        assert ends == [sum(1 for _, e in offsets if e <= end) for end in char_ends]
        assert 0 < sum(mask) < len(ids)  # control: neither everything nor nothing is learned
    mixed = ["plain text one", conversations[0], "and two"]
    data = load_sft_data(source="champ", tokenizer_path=str(tokenizer_folder), num_samples=20)
    assert data.info["num_samples"] > 0
    from mcore_packing.data.sft import _encode_chat

    out = _encode_chat(mixed, tok, learn_prompt=False)  # plain texts and conversations keep their order
    assert [o.ids for o in out] == [tok.encode(mixed[0]), batched[0][0], tok.encode(mixed[2])]
