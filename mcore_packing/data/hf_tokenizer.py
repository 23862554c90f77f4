"""A Hugging Face checkpoint's own tokenizer and chat template, without transformers.

`ChatTokenizer(folder)` reads ``tokenizer.json`` with the `tokenizers` library and the chat template from
``tokenizer_config.json`` (or ``chat_template.jinja``), rendered with a sandboxed jinja2 environment like
the one transformers uses (``trim_blocks``, ``lstrip_blocks``, ``raise_exception``, ``tojson``,
``strftime_now``).

Which tokens are learned: the whole conversation is rendered once and tokenized once; each assistant
message's text is located by rendering the conversation up to it with ``add_generation_prompt=True``
(everything before the reply) and up to and including it (the reply and its end-of-turn tokens). Tokens
whose characters fall inside those spans are learned (loss mask 1), everything else (system, user,
template scaffolding) is not. Token boundaries come from one tokenization, so no token is split or
counted twice.
"""

from __future__ import annotations

import hashlib
import json
from datetime import datetime
from pathlib import Path

__all__ = ["ChatTokenizer"]


class ChatTokenizer:
    """Tokenizer and chat template of a Hugging Face model folder."""

    def __init__(self, folder: str | Path):
        from tokenizers import Tokenizer

        self.folder = Path(folder)
        path = self.folder / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(
                f"{path} does not exist: training from model.hf_path tokenizes with the checkpoint's own "
                "tokenizer.json (saved by the Hugging Face tokenizer's save_pretrained)."
            )
        self.tokenizer = Tokenizer.from_file(str(path))
        config_path = self.folder / "tokenizer_config.json"
        self.config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        template_path = self.folder / "chat_template.jinja"
        self.chat_template = template_path.read_text() if template_path.is_file() else self.config.get("chat_template")
        self._template = None  # compiled on first use: jinja's compile costs more than a render

    @property
    def fingerprint(self) -> str:
        """What identifies the tokenization: the sha256 of tokenizer.json and the chat template (a prepared
        store records it; training from the store checks it)."""
        digest = hashlib.sha256((self.folder / "tokenizer.json").read_bytes())
        digest.update((self.chat_template or "").encode())
        return digest.hexdigest()

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def _token(self, key: str) -> str:
        value = self.config.get(key)
        return value.get("content", "") if isinstance(value, dict) else (value or "")

    def encode(self, text: str) -> list[int]:
        """Token ids of plain text (no special tokens added)."""
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        """The chat template applied to ``messages`` (``[{"role": ..., "content": ...}, ...]``)."""
        if not self.chat_template:
            raise ValueError(
                f"{self.folder} has no chat template (tokenizer_config.json 'chat_template' or chat_template.jinja); "
                "conversation data needs one. Use a chat/instruct checkpoint or plain-text data."
            )
        if self._template is None:
            self._template = _environment().from_string(self.chat_template)
        return self._template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self._token("bos_token"),
            eos_token=self._token("eos_token"),
        )

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Token ids of many plain texts at once (the tokenizer's own parallel batch encoding)."""
        return [e.ids for e in self.tokenizer.encode_batch(texts, add_special_tokens=False)]

    def encode_conversation(self, messages: list[dict]) -> tuple[list[int], list[float], list[int]]:
        """``(ids, loss_mask, turn_ends)``: the rendered conversation's tokens, 1.0 on the assistant's
        tokens, and the token count after each message (for truncation at a turn boundary)."""
        return self.encode_conversations([messages])[0]

    def encode_conversations(
        self, conversations: list[list[dict]], *, assistant_ends_only: bool = False
    ) -> list[tuple[list[int], list[float], list[int]]]:
        """`encode_conversation` of many conversations: each rendered and its assistant spans located, then
        all tokenized in one batch (the tokenizer's threads). A token is learned when its characters lie
        inside an assistant span; only the tokens at span and turn boundaries are looked up (the
        tokenizer's char -> token map), not every token's offsets. ``assistant_ends_only``: the turn ends of
        the assistant's messages only (what truncation needs; fewer template renders)."""
        import numpy as np

        located = [self._spans(messages, assistant_ends_only) for messages in conversations]
        encodings = self.tokenizer.encode_batch([text for text, _, _ in located], add_special_tokens=False)
        out = []
        for (_, spans, ends), encoding in zip(located, encodings, strict=True):
            ids = encoding.ids
            learned = np.zeros(len(ids), dtype=np.float32)
            for a, b in spans:
                first, last = _first_inside(encoding, a, len(ids)), _tokens_before(encoding, b, len(ids))
                learned[first:last] = 1.0
            out.append((ids, learned.tolist(), [_tokens_before(encoding, end, len(ids)) for end in ends]))
        return out

    def _spans(self, messages: list[dict], assistant_ends_only: bool = False):
        """The rendered text, the character span of each assistant reply (with its end-of-turn), and the
        character count after each message (each assistant message with ``assistant_ends_only``)."""
        text = self.render(messages)
        spans, ends = [], []
        for i, message in enumerate(messages):
            if assistant_ends_only and message["role"] != "assistant":
                continue
            through = text if i == len(messages) - 1 else self.render(messages[: i + 1])
            if message["role"] == "assistant":
                before = self.render(messages[:i], add_generation_prompt=True)
                if not (text.startswith(before) and text.startswith(through)):
                    raise ValueError(
                        "the chat template does not render conversations prefix by prefix (message "
                        f"{i}); the assistant's tokens cannot be located. Use plain-text data or another template."
                    )
                spans.append((len(before), len(through)))
            ends.append(len(through))
        return text, spans, ends


def _environment():
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise ValueError(f"chat template: {message}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda value, indent=None: json.dumps(value, ensure_ascii=False, indent=indent)
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt))
    return env


def _tokens_before(encoding, char: int, count: int) -> int:
    """How many tokens end at or before character ``char`` (tokens are in text order)."""
    if char <= 0:
        return 0
    t = _token_at(encoding, char - 1, count, backward=True)
    if t is None:
        return 0
    return t + 1 if encoding.token_to_chars(t)[1] <= char else t


def _first_inside(encoding, char: int, count: int) -> int:
    """The first token that starts at or after character ``char``."""
    t = _token_at(encoding, char, count, backward=False)
    if t is None:
        return count
    return t if encoding.token_to_chars(t)[0] >= char else t + 1


def _token_at(encoding, char: int, count: int, *, backward: bool):
    """The token covering ``char``, or the nearest one before (``backward``) or after it when no token
    covers it (characters a normalizer dropped); None past the ends."""
    step = -1 if backward else 1
    limit = encoding.token_to_chars(count - 1)[1] if count else 0
    while 0 <= char < limit:
        t = encoding.char_to_token(char)
        if t is not None:
            return t
        char += step
    return None
