"""Training-step throughput of a ~0.55B GPT on one GPU: pad-to-longest vs dynamic vs packed, one run.

The same loop as `step_throughput.py` (Megatron's schedule through `run_step`, same global batches for
every mode) with GPU defaults: 24 layers, width 1280, 20 heads, MLP 5120, vocabulary 32000, bf16,
heavy-tailed lengths up to 4096 tokens, 64 samples per global batch, `train_mb_tokens=16384`. Attention:
our backend (varlen FlashAttention from torch) and TransformerEngine's when it is installed.

    python benchmarks/gpu_step.py --quick      # about a minute on an H100/H200 (target: < 5 min)
    python benchmarks/gpu_step.py              # more steps; writes benchmarks/results/gpu_step.json
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import step_throughput

GPU_DEFAULTS = dict(
    device="cuda",
    dtype="bfloat16",
    layers=24,
    hidden=1280,
    heads=20,
    ffn=5120,
    vocab=32000,
    distributions=["lognormal", "real:champ/10"],
    batch_size=64,
    max_len=4096,
    mb_tokens=16384,
    padded_rows=4,
    steps=3,
    attention_backends=["local", "te"],
    out="benchmarks/results/gpu_step.json",
)

if __name__ == "__main__":
    quick = "--quick" in sys.argv
    defaults = dict(GPU_DEFAULTS)
    if quick:
        defaults.update(steps=1, distributions=["lognormal"], out="benchmarks/results/gpu_step_quick.json")
    raise SystemExit(step_throughput.main(sys.argv[1:], description=__doc__, defaults=defaults))
