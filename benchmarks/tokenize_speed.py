"""The SFT data path's tokenization against the tokenizer alone, in one run on the same texts and cores.

CHAMP conversations through a checkpoint's tokenizer and chat template (a byte-level BPE trained on CHAMP
with a ChatML template, tests/hf_models.py): the `tokenizers` library's own ``encode_batch`` on the
rendered texts (the ceiling), `ChatTokenizer.encode_conversations` (what ``load_sft_data`` runs: render,
locate the assistant spans, one batch encode, array masks) and one conversation at a time. It prints
tokens/s and each path's ratio to the ceiling.

    python benchmarks/tokenize_speed.py --conversations 2000
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from _report import run_config, write_results  # noqa: E402

from mcore_packing.data.hf_tokenizer import ChatTokenizer  # noqa: E402
from mcore_packing.data.sft import _records  # noqa: E402
from tests.hf_models import make_tokenizer  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--conversations", type=int, default=2000)
    parser.add_argument("--vocab", type=int, default=384)
    args = parser.parse_args()
    config = run_config(args, threads=os.environ.get("RAYON_NUM_THREADS", "tokenizers' default"))
    with tempfile.TemporaryDirectory() as tmp:
        tok = ChatTokenizer(make_tokenizer(Path(tmp) / "tok", args.vocab))
        conversations = _records("champ_full", None, "text")[1][: args.conversations]
        texts = [tok.render(c) for c in conversations]
        start = time.perf_counter()
        raw = tok.encode_batch(texts)
        ceiling = time.perf_counter() - start
        start = time.perf_counter()
        batched = tok.encode_conversations(conversations)
        ours = time.perf_counter() - start
        start = time.perf_counter()
        single = [tok.encode_conversation(c) for c in conversations]
        one_by_one = time.perf_counter() - start
    tokens = sum(len(ids) for ids in raw)
    assert [b[0] for b in batched] == raw and single == batched  # the same tokens on every path
    rows = [
        {"path": "tokenizers encode_batch (ceiling)", "seconds": ceiling},
        {"path": "encode_conversations (load_sft_data)", "seconds": ours},
        {"path": "encode_conversation one at a time", "seconds": one_by_one},
    ]
    print(f"{len(conversations)} conversations, {tokens:,} tokens")
    for row in rows:
        row.update(tokens_per_s=tokens / row["seconds"], ratio_to_ceiling=ceiling / row["seconds"])
        print(f"  {row['path']:<40} {row['seconds']:6.2f} s  {row['tokens_per_s']:>11,.0f} tok/s  "
              f"{row['ratio_to_ceiling']:.2f}x the ceiling")  # fmt: skip
    write_results(str(ROOT / "benchmarks/results/tokenize_speed.json"), config, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
