"""``python -m mcore_packing prepare``: tokenize a JSONL data set once, in parallel, into a store that
training (``data.prepared=STORE``) and planning (``plan --prepared STORE``) read through memory maps.

    python -m mcore_packing prepare --input data.jsonl --out store --hf-path /models/Qwen3-8B [--workers 8]

The JSONL is streamed (never whole in memory) in chunks of ``--chunk-records`` lines; worker processes
parse and check each chunk (the same checks as training: `data.sft.check_record`), tokenize it with the
checkpoint's tokenizer and chat template in one batch, and apply the long-sample policy
(`data.sft.tokenize_chunk`: exactly what ``load_sft_data`` does); the parent writes the chunks in input
order in Megatron-Core's indexed-dataset format (`data.store.IndexedWriter`; the store's layout:
`data.store`). Bad lines are gathered over the whole file and reported together (up to 10,
``file:line``), and nothing is written.

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

from ..data.jsonl import BadLines, field_of, parse_jsonl_line
from ..data.sft import LONG_SAMPLE_POLICIES, check_outcome, check_record, chunk_info, tokenize_chunk
from ..data.store import FILES, FORMAT, MANIFEST, IndexedWriter, file_digest, spans_from_mask, token_dtype
from .config import DataConfig

__all__ = ["main", "prepare"]

_WORKER: dict = {}
_FLAGS = {"limit": "--max-sample-tokens", "truncate": "pass --long-samples truncate", "learn": "pass --learn-prompt"}
"""How the shared data checks name this command's settings (`data.sft.check_outcome`)."""


def _parser() -> argparse.ArgumentParser:
    defaults = DataConfig()
    p = argparse.ArgumentParser(prog="python -m mcore_packing prepare", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--input", required=True, help="a JSONL file (one record per line)")
    p.add_argument("--out", required=True, help="the store folder to write (must not exist)")
    p.add_argument("--hf-path", required=True, help="the model folder whose tokenizer.json and chat template to use")
    p.add_argument("--text-field", default=defaults.text_field, help="data.text_field: the text or the messages")
    p.add_argument("--max-sample-tokens", type=int, default=defaults.max_sample_tokens, help="data.max_sample_tokens")
    p.add_argument("--long-samples", default=defaults.long_samples, choices=LONG_SAMPLE_POLICIES,
                   help="data.long_samples (default: drop conversations, split text)")  # fmt: skip
    p.add_argument("--learn-prompt", action="store_true", help="data.learn_prompt: learn every turn")
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="tokenizing processes (default: cores)")
    p.add_argument("--chunk-records", type=int, default=1000, help="records per worker task")
    p.add_argument("--no-progress", action="store_true", help="no progress line on stderr")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        manifest = prepare(
            args.input, args.out, hf_path=args.hf_path, text_field=args.text_field,
            max_sample_tokens=args.max_sample_tokens, long_samples=args.long_samples, learn_prompt=args.learn_prompt,
            workers=args.workers, chunk_records=args.chunk_records, progress=not args.no_progress,
        )  # fmt: skip
    except (ValueError, FileNotFoundError, FileExistsError) as exc:
        print(f"prepare error: {exc}", file=sys.stderr)
        return 2
    counts = manifest["counts"]
    print(f"prepared {args.out}: {counts['num_samples']} samples, {counts['num_tokens']} tokens from "
          f"{counts['num_records']} records ({counts['long_samples_dropped']} dropped, "
          f"{counts['long_samples_truncated']} truncated, {counts['long_samples_split']} split) in "
          f"{manifest['seconds']:.1f} s")  # fmt: skip
    return 0


def prepare(input_path, out, *, hf_path, text_field="text", max_sample_tokens=2048, long_samples=None,
            learn_prompt=False, workers=1, chunk_records=1000, progress=False) -> dict:  # fmt: skip
    """Write the store ``out`` from the JSONL ``input_path`` (see the module docstring); its manifest."""
    from ..data.hf_tokenizer import ChatTokenizer

    start = time.perf_counter()
    source, out = Path(input_path), Path(out)
    if not source.is_file():
        raise FileNotFoundError(f"--input {source} does not exist (a JSONL file, one record per line).")
    if out.exists():
        raise FileExistsError(f"--out {out} exists; remove it or choose another folder.")
    for name, value in (("--workers", workers), ("--chunk-records", chunk_records), ("--max-sample-tokens",
                                                                                     max_sample_tokens)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value}: use a positive integer.")
    tokenizer = ChatTokenizer(hf_path)
    settings = {"text_field": text_field, "max_sample_tokens": max_sample_tokens, "long_samples": long_samples,
                "learn_prompt": learn_prompt}  # fmt: skip
    partial = out.parent / f".{out.name}.partial"
    shutil.rmtree(partial, ignore_errors=True)  # a previous prepare's remains
    partial.mkdir(parents=True)
    try:
        counts, source_digest = _write(source, partial, tokenizer, settings, workers, chunk_records, progress)
        manifest = {
            "format": FORMAT,
            "source": {"path": str(source.resolve()), "bytes": source.stat().st_size, "sha256": source_digest},
            "tokenizer": {"name": str(hf_path), "sha256": tokenizer.fingerprint},
            "vocab_size": tokenizer.vocab_size,
            "settings": settings,
            "counts": counts,
            "files": {name: _file_record(partial / name) for name in FILES},
            "seconds": time.perf_counter() - start,
        }
        (partial / MANIFEST).write_text(json.dumps(manifest, indent=1))
        partial.rename(out)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return manifest


def _file_record(path: Path) -> dict:
    """A file's size, and for the (small) indexes their sha256 too."""
    return {"bytes": path.stat().st_size, **({"sha256": file_digest(path)} if path.suffix == ".idx" else {})}


def _chunks(path: Path, size: int, digest):
    """``(first line number, [lines])`` of ``path``, streamed; ``digest`` sees every byte."""
    lines, first = [], 1
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            digest.update(raw)
            if not lines:
                first = number
            lines.append(raw)
            if len(lines) == size:
                yield str(path), first, lines
                lines = []
    if lines:
        yield str(path), first, lines


def _init_worker(hf_path: str, settings: dict) -> None:
    os.environ.setdefault("RAYON_RS_NUM_CPUS", "1")  # one tokenizer thread per process: processes are the parallelism
    from ..data.hf_tokenizer import ChatTokenizer

    _WORKER.update(tokenizer=ChatTokenizer(hf_path), settings=settings)


def _record(raw: bytes, where: str, field: str):
    """One line's text or conversation, checked as training checks it; None for a blank line."""
    obj = parse_jsonl_line(raw, where)
    if obj is None:
        return None
    record = field_of(obj, field, where, "--text-field (data.text_field)")
    check_record(record, where, field)
    return record


def _tokenize(task) -> dict:
    """One chunk in a worker: parse and check each line, tokenize the good records, the arrays to write."""
    path, first, lines = task
    settings = _WORKER["settings"]
    field = settings["text_field"]
    records, bad = [], BadLines()
    for number, raw in enumerate(lines, first):
        record = bad.check(_record, raw, f"{path}:{number}", field)
        if record is not None:
            records.append(record)
    if bad.messages:
        return {"errors": bad.messages}
    chunk = tokenize_chunk(
        records,
        _WORKER["tokenizer"],
        learn_prompt=settings["learn_prompt"],
        long_samples=settings["long_samples"],
        max_sample_tokens=settings["max_sample_tokens"],
    )
    spans = [spans_from_mask(mask) for _, mask in chunk.samples]
    return {
        "errors": [],
        "ids": np.concatenate([ids for ids, _ in chunk.samples]) if chunk.samples else np.zeros(0, np.int64),
        "lengths": np.array([len(ids) for ids, _ in chunk.samples], dtype=np.int64),
        "spans": np.concatenate(spans) if spans else np.zeros(0, np.int32),
        "span_lengths": np.array([len(s) for s in spans], dtype=np.int64),
        "any_learned": chunk.any_learned,
        "learned_tokens": chunk.learned_tokens,
        "max_token_id": max((int(ids.max()) for ids, _ in chunk.samples if len(ids)), default=0),
        "info": chunk_info(chunk),
    }


def _write(source: Path, folder: Path, tokenizer, settings: dict, workers: int, chunk_records: int,
           progress: bool) -> tuple[dict, str]:  # fmt: skip
    import multiprocessing

    digest = hashlib.sha256()
    tasks = _chunks(source, chunk_records, digest)
    totals = {"num_records": 0, "num_samples": 0, "num_tokens": 0, "long_samples_split": 0,
              "long_samples_truncated": 0, "long_samples_dropped": 0}  # fmt: skip
    learned, stored, any_learned, largest, bad = 0.0, 0, False, 0, BadLines()
    meter = _Progress(progress)
    context = multiprocessing.get_context("fork")
    with context.Pool(workers, initializer=_init_worker, initargs=(str(tokenizer.folder), settings)) as pool:
        tokens = IndexedWriter(folder / "tokens", token_dtype(tokenizer.vocab_size))
        spans = IndexedWriter(folder / "spans", np.int32)
        for result in pool.imap(_tokenize, tasks):
            for message in result["errors"]:
                bad.add(message)
            if bad.messages:
                continue  # read on: every bad line is reported at once
            tokens.add(result["ids"], result["lengths"])
            spans.add(result["spans"], result["span_lengths"])
            info = result["info"]
            for key in totals:
                totals[key] += info[key]
            learned += result["learned_tokens"]
            stored += int(result["lengths"].sum())
            any_learned |= result["any_learned"]
            largest = max(largest, result["max_token_id"])
            meter.update(totals["num_records"], totals["num_samples"], stored)
        meter.close()
        bad.raise_any()
        tokens.finalize()
        spans.finalize()
    if totals["num_records"] == 0:
        raise ValueError(f"{source} holds no records; the data set is empty.")
    check_outcome(num_records=totals["num_records"], num_samples=totals["num_samples"],
                  dropped=totals["long_samples_dropped"], any_learned=any_learned,
                  max_sample_tokens=settings["max_sample_tokens"], keys=_FLAGS)  # fmt: skip
    totals["learned_token_share"] = learned / totals["num_tokens"] if totals["num_tokens"] else 0.0
    totals["stored_tokens"] = stored
    totals["max_token_id"] = largest
    return totals, digest.hexdigest()


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
