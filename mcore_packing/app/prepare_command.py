"""``python -m mcore_packing prepare``: tokenize a data set once, in parallel, into a store that training
(``data.prepared=STORE``) and planning (``plan --prepared STORE``) read through memory maps.

    python -m mcore_packing prepare --input data.jsonl --out store --hf-path /models/Qwen3-8B [--workers 8]
    python -m mcore_packing prepare --input pairs.parquet --out pairs --kind pairs --hf-path /models/Qwen3-8B
    python -m mcore_packing prepare --input rollouts.jsonl --out rollouts --kind rollouts

``--input`` is a JSONL or Parquet file, a folder of shards, or a Hugging Face ``datasets`` folder from
``save_to_disk`` (`data.sources.RecordSource`); ``--kind`` says what its records are: ``sft`` (text or chat
``messages`` in ``--text-field``), ``pairs`` (DPO: prompt, chosen, rejected) or ``rollouts`` (GRPO:
prompt_tokens, response_tokens, reward, group_id, generation_logprobs). The records are streamed (never
whole in memory) in chunks of ``--chunk-records``; worker processes check and tokenize each chunk exactly as
training does (`app.prepare_records`); the parent writes the chunks in input order in Megatron-Core's
indexed-dataset format (`data.store.IndexedWriter`; the store's layout: `data.store`). Bad records are
gathered over the whole input and reported together (up to 10, ``file:line`` or ``file row N``), and
nothing is written.

The store is built in a hidden ``.<name>.partial`` folder beside ``--out`` and renamed when complete, so
an interrupted prepare never leaves a store that opens. A progress line on stderr gives records, samples
and tokens per second.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np

from ..data.jsonl import BadLines
from ..data.sft import LONG_SAMPLE_POLICIES, WITHOUT_TARGETS, check_outcome
from ..data.sources import RecordSource
from ..data.store import FORMAT, KINDS, MANIFEST, IndexedWriter, file_digest, store_files, token_dtype
from .config import DataConfig
from .prepare_records import encode_chunk, init_worker

__all__ = ["build_parser", "main", "prepare"]

_FLAGS = {"limit": "--max-sample-tokens", "truncate": "pass --long-samples truncate", "learn": "pass --learn-prompt",
          "targets": "pass --samples-without-targets drop"}
"""How the shared data checks name this command's settings (`data.sft.check_outcome`)."""


def build_parser() -> argparse.ArgumentParser:
    defaults = DataConfig()
    p = argparse.ArgumentParser(prog="python -m mcore_packing prepare", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--input", required=True, help="a JSONL or Parquet file, a folder of them, or a datasets folder")
    p.add_argument("--out", required=True, help="the store folder to write (must not exist)")
    p.add_argument("--kind", default="sft", choices=KINDS, help="what the records are (default: sft)")
    p.add_argument("--hf-path", help="the model folder whose tokenizer.json and chat template to use (needed for "
                   "text and chat; token-id pairs and rollouts need none)")  # fmt: skip
    p.add_argument("--split", help="the split of a Hugging Face DatasetDict folder (default: train)")
    p.add_argument("--text-field", default=defaults.text_field, help="data.text_field: the text or the messages")
    p.add_argument("--max-sample-tokens", type=int, default=defaults.max_sample_tokens, help="data.max_sample_tokens")
    p.add_argument("--long-samples", default=defaults.long_samples, choices=LONG_SAMPLE_POLICIES,
                   help="data.long_samples (default: drop conversations, split text)")  # fmt: skip
    p.add_argument("--learn-prompt", action="store_true", help="data.learn_prompt: learn every turn")
    p.add_argument("--samples-without-targets", default=defaults.samples_without_targets, choices=WITHOUT_TARGETS,
                   help="data.samples_without_targets: a record with no learned token is an error (default, naming "
                   "file:line) or dropped and counted")  # fmt: skip
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="tokenizing processes (default: cores)")
    p.add_argument("--chunk-records", type=int, default=1000, help="records per worker task")
    p.add_argument("--no-progress", action="store_true", help="no progress line on stderr")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        manifest = prepare(
            args.input, args.out, kind=args.kind, hf_path=args.hf_path, split=args.split, text_field=args.text_field,
            max_sample_tokens=args.max_sample_tokens, long_samples=args.long_samples, learn_prompt=args.learn_prompt,
            samples_without_targets=args.samples_without_targets, workers=args.workers,
            chunk_records=args.chunk_records, progress=not args.no_progress,
        )  # fmt: skip
    except (ValueError, FileNotFoundError, FileExistsError, ImportError) as exc:
        print(f"prepare error: {exc}", file=sys.stderr)
        return 2
    counts = manifest["counts"]
    what = {"sft": lambda: f"{counts['long_samples_dropped']} dropped, {counts['long_samples_truncated']} "
                           f"truncated, {counts['long_samples_split']} split, "
                           f"{counts['samples_without_targets_dropped']} without a learned token dropped",
            "pairs": lambda: f"{counts['pairs']} pairs, {counts['pairs_dropped_too_long']} dropped as too long",
            "rollouts": lambda: f"{counts['groups']} groups"}[args.kind]()  # fmt: skip
    print(f"prepared {args.out} ({args.kind}): {counts['num_samples']} samples, {counts['num_tokens']} tokens from "
          f"{counts['num_records']} records ({what}) in {manifest['seconds']:.1f} s")  # fmt: skip
    return 0


def _settings(kind: str, text_field: str, max_sample_tokens: int, long_samples, learn_prompt: bool,
              samples_without_targets: str) -> dict:  # fmt: skip
    """The ``data.*`` settings a store of ``kind`` was tokenized with (its manifest records them)."""
    if kind == "sft":
        return {"text_field": text_field, "max_sample_tokens": max_sample_tokens, "long_samples": long_samples,
                "learn_prompt": learn_prompt, "samples_without_targets": samples_without_targets}  # fmt: skip
    return {"max_sample_tokens": max_sample_tokens} if kind == "pairs" else {}


def prepare(input_path, out, *, kind="sft", hf_path=None, split=None, text_field="text", max_sample_tokens=2048,
            long_samples=None, learn_prompt=False, samples_without_targets="error", workers=1, chunk_records=1000,
            progress=False) -> dict:  # fmt: skip
    """Write the store ``out`` from ``input_path`` (see the module docstring); its manifest."""
    start, out = time.perf_counter(), Path(out)
    if kind not in KINDS:
        raise ValueError(f"--kind {kind}: use one of {', '.join(KINDS)}.")
    source = RecordSource(input_path, split=split)
    if out.exists():
        raise FileExistsError(f"--out {out} exists; remove it or choose another folder.")
    for name, value in (("--workers", workers), ("--chunk-records", chunk_records), ("--max-sample-tokens",
                                                                                     max_sample_tokens)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value}: use a positive integer.")
    if hf_path is None and kind == "sft":
        raise ValueError("--kind sft tokenizes text: pass --hf-path (the model folder with tokenizer.json).")
    tokenizer = None
    if hf_path is not None:
        from ..data.hf_tokenizer import ChatTokenizer

        tokenizer = ChatTokenizer(hf_path)
    if samples_without_targets not in WITHOUT_TARGETS:
        raise ValueError(f"--samples-without-targets {samples_without_targets}: use one of "
                         f"{', '.join(WITHOUT_TARGETS)}.")  # fmt: skip
    settings = _settings(kind, text_field, max_sample_tokens, long_samples, learn_prompt, samples_without_targets)
    partial = out.parent / f".{out.name}.partial"
    shutil.rmtree(partial, ignore_errors=True)  # a previous prepare's remains
    partial.mkdir(parents=True)
    try:
        counts, source_digest = _write(source, partial, kind, tokenizer, settings, workers, chunk_records, progress)
        manifest = {
            "format": FORMAT,
            "kind": kind,
            "source": _source_record(source, source_digest),
            "tokenizer": None if tokenizer is None else {"name": str(hf_path), "sha256": tokenizer.fingerprint},
            "vocab_size": tokenizer.vocab_size if tokenizer is not None else counts["max_token_id"] + 1,
            "settings": settings,
            "counts": counts,
            "files": {name: _file_record(partial / name) for name in store_files(kind)},
            "seconds": time.perf_counter() - start,
        }
        (partial / MANIFEST).write_text(json.dumps(manifest, indent=1))
        partial.rename(out)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return manifest


def _source_record(source: RecordSource, digest: str) -> dict:
    return {"path": str(source.path.resolve()), "form": source.form, "files": len(source.files),
            "bytes": source.bytes, "sha256": digest}  # fmt: skip


def _file_record(path: Path) -> dict:
    """A file's size, and for the small ones (indexes, JSON) their sha256 too."""
    small = path.suffix in (".idx", ".json")
    return {"bytes": path.stat().st_size, **({"sha256": file_digest(path)} if small else {})}


def _write(source: RecordSource, folder: Path, kind: str, tokenizer, settings: dict, workers: int,
           chunk_records: int, progress: bool) -> tuple[dict, str]:  # fmt: skip
    import multiprocessing

    digest = hashlib.sha256()
    what = "lines" if source.form == "jsonl" else "rows"
    writer, bad, meter = _StoreWriter(folder, kind, tokenizer), BadLines(what), _Progress(progress)
    hf_path = None if tokenizer is None else str(tokenizer.folder)
    context = multiprocessing.get_context("fork")
    with context.Pool(workers, initializer=init_worker, initargs=(hf_path, kind, settings)) as pool:
        for result in pool.imap(encode_chunk, source.chunks(chunk_records, digest)):
            for message in result["errors"] + (writer.check_forms(result) if not bad.messages else []):
                bad.add(message)
            if bad.messages:
                continue  # read on: every bad record is reported at once
            writer.add(result)
            meter.update(writer.totals["num_records"], writer.totals["num_samples"], writer.stored)
        meter.close()
    bad.raise_any()
    writer.finalize()
    return writer.counts(source, settings), digest.hexdigest()


class _StoreWriter:
    """Appends the workers' chunks to the store's files, in order, and adds up their counts."""

    def __init__(self, folder: Path, kind: str, tokenizer):
        self.folder, self.kind, self.tokenizer = folder, kind, tokenizer
        dtype = token_dtype(tokenizer.vocab_size) if tokenizer is not None else np.int32
        self.tokens = IndexedWriter(folder / "tokens", dtype)
        self.spans = IndexedWriter(folder / "spans", np.int32)
        self.logprobs = IndexedWriter(folder / "logprobs", np.float64) if kind == "rollouts" else None
        self.rewards, self.group_ids, self.forms = [], [], {}
        self.totals: dict = {"num_records": 0, "num_samples": 0}
        self.stored, self.largest, self.any_learned = 0, 0, False

    def check_forms(self, result: dict) -> list[str]:
        """Pairs are all token ids or all text/chat: a chunk of the other form than the first is refused."""
        for form, where in result.get("forms", {}).items():
            if self.forms and form not in self.forms:
                (first,) = self.forms.values()
                return [f"{where} mixes token ids and text with {first}; write every pair in one form."]
            self.forms.setdefault(form, where)
        return []

    def add(self, result: dict) -> None:
        self.tokens.add(result["ids"], result["lengths"])
        self.spans.add(result["spans"], result["span_lengths"])
        if self.logprobs is not None:
            self.logprobs.add(result["logprobs"], result["logprob_lengths"])
            self.rewards += result["rewards"]
            self.group_ids += result["group_ids"]
        for key, value in result["info"].items():
            self.totals[key] = self.totals.get(key, 0) + value
        self.stored += int(result["lengths"].sum())
        self.largest = max(self.largest, result["max_token_id"])
        self.any_learned |= result.get("any_learned", False)

    def finalize(self) -> None:
        for writer in (self.tokens, self.spans, self.logprobs):
            if writer is not None:
                writer.finalize()
        if self.kind == "rollouts":
            (self.folder / "rollouts.json").write_text(json.dumps({"rewards": self.rewards,
                                                                   "group_ids": self.group_ids}))  # fmt: skip

    def counts(self, source: RecordSource, settings: dict) -> dict:
        """The manifest's counts, after the kind's checks of the whole data set."""
        totals = dict(self.totals)
        if totals["num_records"] == 0:
            raise ValueError(f"{source.path} holds no records; the data set is empty.")
        if self.tokenizer is not None and self.largest >= self.tokenizer.vocab_size:
            raise ValueError(f"a token id is {self.largest}, but the tokenizer of --hf-path has "
                             f"{self.tokenizer.vocab_size} ids; the ids were made by another tokenizer.")  # fmt: skip
        _check_kind(self.kind, totals, self.any_learned, self.group_ids, settings)
        if self.kind == "sft":
            learned = totals.pop("learned_tokens")
            totals["learned_token_share"] = learned / totals["num_tokens"] if totals["num_tokens"] else 0.0
        if self.kind == "rollouts":
            totals["groups"] = len(set(map(str, self.group_ids)))
        return {**totals, "stored_tokens": self.stored, "max_token_id": self.largest}


def _check_kind(kind: str, totals: dict, any_learned: bool, group_ids: list, settings: dict) -> None:
    """What the whole data set must satisfy, as training's loaders check it."""
    if kind == "sft":
        check_outcome(num_records=totals["num_records"], num_samples=totals["num_samples"],
                      dropped=totals["long_samples_dropped"], any_learned=any_learned,
                      max_sample_tokens=settings["max_sample_tokens"], keys=_FLAGS,
                      without_targets=totals["samples_without_targets_dropped"])  # fmt: skip
    elif kind == "pairs" and totals["pairs"] == 0:
        limit = settings["max_sample_tokens"]
        raise ValueError(f"No pairs are left: all {totals['pairs_dropped_too_long']} have a response longer "
                         f"than --max-sample-tokens={limit} (prompt included). Raise it.")  # fmt: skip
    elif kind == "rollouts":
        from ..losses.rollouts import check_group_sizes

        check_group_sizes(group_ids)


class _Progress:
    """One stderr line, rewritten at most every second: records, samples and tokens so far and per second."""

    def __init__(self, enabled: bool):
        self.enabled, self.start, self.last = enabled, time.perf_counter(), 0.0

    def update(self, records: int, samples: int, tokens: int) -> None:
        now = time.perf_counter()
        if not self.enabled or now - self.last < 1.0:
            return
        self.last, seconds = now, max(now - self.start, 1e-9)
        print(f"\r{records} records, {samples} samples, {tokens} tokens | {samples / seconds:,.0f} samples/s, "
              f"{tokens / seconds:,.0f} tokens/s", end="", file=sys.stderr, flush=True)  # fmt: skip

    def close(self) -> None:
        if self.enabled and self.last:
            print(file=sys.stderr)
