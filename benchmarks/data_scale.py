"""Data sets of many samples: prepare throughput against the tokenizer's own, the training start and
the planner on the store, at one or more sizes, measured in one run on this machine.

Synthetic chat conversations are drawn (seeded) from the bundled CHAMP text: a system turn, then one to
three user/assistant exchanges of CHAMP messages cut at 50-600 characters. The tokenizer is the tests'
byte-level BPE of 384 tokens trained on CHAMP with a ChatML template (tests/hf_models.py).

- prepare: ``python -m mcore_packing prepare`` (workers = cores) on the JSONL; its tokens/s (every record's
  tokens, the long-sample policy's drops included) over the `tokenizers` library's own ``encode_batch``
  of the same rendered texts (its default threads = the same cores; on at most 100,000 texts);
- start: ``train --dry-run data.prepared=STORE data.num_samples=null``: launch to the first step's plan
  (the model is not built), its seconds and peak RSS, against the same on a 1,000-sample store;
- plan: ``plan --prepared STORE --json``: seconds.

    python benchmarks/data_scale.py --samples 10000 100000 1000000     # raw rows in results/data_scale.json
    python benchmarks/data_scale.py --samples 10000 --check           # CI: correctness only, not timed
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from _report import run_config, write_results  # noqa: E402


def write_conversations(path: Path, count: int, seed: int = 0) -> None:
    import numpy as np

    from mcore_packing.data.real_text import champ_conversations

    messages = [text for turns in champ_conversations() for _, text in turns]
    rng = np.random.default_rng(seed)
    with open(path, "w") as f:
        for _ in range(count):
            turns = [{"role": "system", "content": "You are a careful mathematician."}]
            for _ in range(int(rng.integers(1, 4))):
                for role in ("user", "assistant"):
                    text = messages[int(rng.integers(len(messages)))]
                    turns.append({"role": role, "content": text[: int(rng.integers(50, 600))]})
            f.write(json.dumps({"messages": turns}) + "\n")


def raw_throughput(path: Path, tokenizer_folder: Path, limit: int = 50_000, batch: int = 2_000) -> float:
    """tokens/s of tokenizers' encode_batch on the rendered texts of the first ``limit`` records, in batches
    of ``batch`` (only the encode calls are timed; batches keep the encodings' memory small)."""
    from mcore_packing.data.hf_tokenizer import ChatTokenizer

    tok = ChatTokenizer(tokenizer_folder)
    with open(path) as f:
        records = [json.loads(line)["messages"] for _, line in zip(range(limit), f, strict=False)]
    seconds, tokens = 0.0, 0
    for lo in range(0, len(records), batch):
        texts = [tok.render(r) for r in records[lo : lo + batch]]
        start = time.perf_counter()
        encodings = tok.tokenizer.encode_batch(texts, add_special_tokens=False)
        seconds += time.perf_counter() - start
        tokens += sum(len(e.ids) for e in encodings)
    return tokens / seconds


_PEAK = (
    "import runpy, sys\n"
    "sys.argv = ['mcore_packing', *sys.argv[1:]]\n"
    "try:\n    runpy.run_module('mcore_packing', run_name='__main__')\n"
    "except SystemExit as exc:\n    code = exc.code\n"
    "peak = [line for line in open('/proc/self/status') if line.startswith('VmHWM')][0].split()[1]\n"
    "print('PEAK_RSS_KIB', peak, file=sys.stderr)\n"
    "sys.exit(code)\n"
)
"""``python -m mcore_packing ARGS`` that reports its own peak RSS at exit (VmHWM: this process's memory
map only, not the forking parent's nor its workers')."""


def timed(args: list[str]) -> tuple[float, int, subprocess.CompletedProcess]:
    """Wall seconds, peak RSS (MiB) of the command's main process, and the process."""
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", _PEAK, *args], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed:\n{proc.stderr[-3000:]}")
    peak = int(proc.stderr.rsplit("PEAK_RSS_KIB", 1)[1].split()[0])
    return seconds, peak // 1024, proc


def measure(count: int, tmp: Path, tokenizer_folder: Path, check: bool) -> dict:
    from mcore_packing.data.store import PreparedStore

    data, store = tmp / f"chat_{count}.jsonl", tmp / f"store_{count}"
    write_conversations(data, count)
    raw_rate = raw_throughput(data, tokenizer_folder)
    prep_s, _, _ = timed(["prepare", "--input", str(data), "--out", str(store),
                          "--hf-path", str(tokenizer_folder), "--text-field", "messages", "--no-progress"])  # fmt: skip
    manifest = json.loads((store / "manifest.json").read_text())
    opened = PreparedStore(store)
    counts = manifest["counts"]
    assert counts["num_records"] == count and len(opened) == counts["num_samples"] > 0
    assert counts["num_samples"] + counts["long_samples_dropped"] == count  # conversations: kept or dropped
    assert int(opened.lengths.sum()) == counts["stored_tokens"]
    start = ["train", "--dry-run", f"data.prepared={store}", "data.num_samples=null",
             f"run_dir={tmp / 'run'}", "training.steps=1"]  # fmt: skip
    start_s, start_rss, proc = timed(start)
    assert "dry run OK" in proc.stdout, proc.stdout[-2000:]
    plan_s, _, proc = timed(["plan", "--prepared", str(store), "--json", "--no-png",
                             "data.num_samples=null", "--steps", "1"])  # fmt: skip
    planned = json.loads(proc.stdout)
    assert planned["num_sequences"] > 0 and planned["summary"]["micro_batches"] > 0
    row = {
        "samples": count,
        "tokens": counts["num_tokens"],
        "raw_tokens_per_s": raw_rate,
        "prepare_s": prep_s,
        "prepare_tokens_per_s": counts["num_tokens"] / prep_s,
        "prepare_over_raw": counts["num_tokens"] / prep_s / raw_rate,
        "start_s": start_s,
        "start_peak_rss_mib": start_rss,
        "plan_s": plan_s,
        "store_mib": sum(f.stat().st_size for f in store.iterdir()) / 2**20,
    }
    if not check:
        print(f"{count:>9,} samples, {counts['num_tokens']:>12,} tokens: prepare {prep_s:7.1f} s "
              f"({row['prepare_tokens_per_s']:,.0f} tok/s = {row['prepare_over_raw']:.2f}x encode_batch's "
              f"{raw_rate:,.0f}) | start {start_s:5.2f} s, peak RSS {start_rss} MiB | plan {plan_s:5.2f} s | "
              f"store {row['store_mib']:.0f} MiB", flush=True)  # fmt: skip
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, nargs="+", default=[10_000, 100_000])
    parser.add_argument("--check", action="store_true", help="correctness only (CI): no timing printed or written")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "data_scale.json"))
    args = parser.parse_args()
    from tests.hf_models import make_tokenizer

    config = run_config(args)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        tokenizer_folder = make_tokenizer(tmp / "tok", 384)
        baseline = measure(1000, tmp, tokenizer_folder, check=True)
        for count in args.samples:
            row = measure(count, tmp, tokenizer_folder, args.check)
            row["start_rss_over_1000_mib"] = row["start_peak_rss_mib"] - baseline["start_peak_rss_mib"]
            rows.append(row)
            if not args.check:
                print(f"  start RSS over the 1,000-sample store's: {row['start_rss_over_1000_mib']} MiB")
    if args.check:
        print(f"checked {[r['samples'] for r in rows]} samples: stores, training start and plan are consistent")
    else:
        write_results(args.out, config, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
