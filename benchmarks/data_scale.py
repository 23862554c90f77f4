"""Data sets of many samples: prepare throughput against the tokenizer's own, the training start and
the planner on the store, at one or more sizes, measured in one run on this machine.

Synthetic chat conversations are drawn (seeded) from the bundled CHAMP text: a system turn, then one to
three user/assistant exchanges of CHAMP messages cut at 50-600 characters. The tokenizer is the tests'
byte-level BPE of 384 tokens trained on CHAMP with a ChatML template (tests/hf_models.py).

- prepare: ``python -m mcore_packing prepare`` (workers = cores) on the JSONL; its tokens/s (every record's
  tokens, the long-sample policy's drops included) over the `tokenizers` library's own ``encode_batch``
  of the same rendered texts (its default threads = the same cores; on at most 100,000 texts);
- raw path: ``load_sft_data`` on the JSONL itself (what training without a store does at every start,
  on at most 50,000 records): its tokens/s over encode_batch's on the same records;
- start: ``train --dry-run data.prepared=STORE data.num_samples=null``: launch to the first step's plan
  (the model is not built), its seconds and peak RSS, against the same on a 1,000-sample store;
- ranks: a real one-step run on ``--ranks`` gloo ranks (``torchrun``, the default tiny GPT, Megatron's
  schedule) on the store: the wall seconds over the same run on the 1,000-sample store (what the store's
  size adds to a start: model build and first step are the same), and every rank's peak RSS over its
  peak on the 1,000-sample store;
- plan: ``plan --prepared STORE --json``: seconds.

    python benchmarks/data_scale.py --samples 10000 100000 1000000     # raw rows in results/data_scale.json
                                                                      # (--ranks 2: the real start's ranks)
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


def raw_path_throughput(path: Path, tokenizer_folder: Path, tmp: Path, limit: int = 50_000) -> float:
    """tokens/s of ``load_sft_data`` (the trainer's raw-JSONL path: read, check, tokenize in batches, the
    long-sample policy) on the first ``limit`` records of ``path``."""
    from mcore_packing.data.sft import load_sft_data

    head = tmp / "raw_head.jsonl"
    with open(path) as f, open(head, "w") as out:
        out.writelines(line for _, line in zip(range(limit), f, strict=False))
    start = time.perf_counter()
    data = load_sft_data(source="jsonl", path=str(head), text_field="messages", tokenizer_path=str(tokenizer_folder),
                         num_samples=None)  # fmt: skip
    return data.info["num_tokens"] / (time.perf_counter() - start)


_PEAK = (
    "import runpy, sys\n"
    "if __name__ == '__main__':  # spawned helpers (checkpoint writers) import this file again\n"
    "    sys.argv = ['mcore_packing', *sys.argv[1:]]\n"
    "    try:\n        runpy.run_module('mcore_packing', run_name='__main__')\n"
    "    except SystemExit as exc:\n        code = exc.code\n"
    "    peak = [line for line in open('/proc/self/status') if line.startswith('VmHWM')][0].split()[1]\n"
    "    print('PEAK_RSS_KIB', peak, file=sys.stderr)\n"
    "    sys.exit(code)\n"
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


def ranks_start(store: Path, ranks: int, run_dir: Path) -> tuple[float, list[int]]:
    """Wall seconds of a one-step run on ``ranks`` gloo ranks from ``store``, and each rank's peak RSS (MiB)."""
    script = run_dir.parent / "peak_main.py"
    script.write_text(_PEAK)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}", str(script),
           "train", f"data.prepared={store}", "data.num_samples=null", f"run_dir={run_dir}", "training.steps=1",
           "training.global_batch_size=8", "sequence_packing.train_mb_tokens=2048"]  # fmt: skip
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    peaks = [int(part.split()[0]) // 1024 for part in proc.stderr.split("PEAK_RSS_KIB ")[1:]]
    assert len(peaks) == ranks, proc.stderr[-2000:]
    return seconds, peaks


def measure(count: int, tmp: Path, tokenizer_folder: Path, check: bool, ranks: int = 0) -> dict:
    from mcore_packing.data.store import PreparedStore

    data, store = tmp / f"chat_{count}.jsonl", tmp / f"store_{count}"
    write_conversations(data, count)
    raw_rate = raw_throughput(data, tokenizer_folder)
    raw_path_rate = raw_path_throughput(data, tokenizer_folder, tmp) if not check else raw_rate
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
    ranks_s, ranks_rss = ranks_start(store, ranks, tmp / f"ranks_{count}") if ranks else (0.0, [])
    row = {
        "samples": count,
        "tokens": counts["num_tokens"],
        "raw_tokens_per_s": raw_rate,
        "prepare_s": prep_s,
        "prepare_tokens_per_s": counts["num_tokens"] / prep_s,
        "prepare_over_raw": counts["num_tokens"] / prep_s / raw_rate,
        "raw_path_over_raw": raw_path_rate / raw_rate,
        "ranks": ranks,
        "ranks_run_s": ranks_s,
        "ranks_peak_rss_mib": ranks_rss,
        "start_s": start_s,
        "start_peak_rss_mib": start_rss,
        "plan_s": plan_s,
        "store_mib": sum(f.stat().st_size for f in store.iterdir()) / 2**20,
    }
    if not check:
        print(f"{count:>9,} samples, {counts['num_tokens']:>12,} tokens: prepare {prep_s:7.1f} s "
              f"({row['prepare_tokens_per_s']:,.0f} tok/s = {row['prepare_over_raw']:.2f}x encode_batch's "
              f"{raw_rate:,.0f}; the raw JSONL path {row['raw_path_over_raw']:.2f}x) | start {start_s:5.2f} s, peak "
              f"RSS {start_rss} MiB | plan {plan_s:5.2f} s | store {row['store_mib']:.0f} MiB", flush=True)  # fmt: skip
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, nargs="+", default=[10_000, 100_000])
    parser.add_argument("--check", action="store_true", help="correctness only (CI): no timing printed or written")
    parser.add_argument("--ranks", type=int, default=0, help="also a real one-step run on this many gloo ranks")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "data_scale.json"))
    args = parser.parse_args()
    from tests.hf_models import make_tokenizer

    config = run_config(args)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        tokenizer_folder = make_tokenizer(tmp / "tok", 384)
        baseline = measure(1000, tmp, tokenizer_folder, check=True, ranks=args.ranks)
        for count in args.samples:
            row = measure(count, tmp, tokenizer_folder, args.check, args.ranks)
            row["start_rss_over_1000_mib"] = row["start_peak_rss_mib"] - baseline["start_peak_rss_mib"]
            row["ranks_run_s_over_1000"] = row["ranks_run_s"] - baseline["ranks_run_s"]
            pairs = zip(row["ranks_peak_rss_mib"], baseline["ranks_peak_rss_mib"], strict=True)
            row["ranks_rss_over_1000_mib"] = [a - b for a, b in pairs]
            rows.append(row)
            if not args.check:
                print(f"  start RSS over the 1,000-sample store's: {row['start_rss_over_1000_mib']} MiB")
            if args.ranks and not args.check:
                print(f"  {args.ranks}-rank one-step run: {row['ranks_run_s']:.1f} s, "
                      f"{row['ranks_run_s_over_1000']:+.1f} s over the 1,000-sample store's; peak RSS per rank "
                      f"{row['ranks_peak_rss_mib']} MiB, {row['ranks_rss_over_1000_mib']} over the 1,000-sample "
                      "store's", flush=True)  # fmt: skip
    if args.check:
        print(f"checked {[r['samples'] for r in rows]} samples: stores, training start and plan are consistent")
    else:
        write_results(args.out, config, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
