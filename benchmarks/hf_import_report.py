"""Hugging Face import on tiny random models of every family: logit error per layout, import time, bytes
read and peak memory per rank (Mixture-of-Experts families also at expert parallelism; their TP runs use
sequence parallelism, which Megatron's MoE layer needs under TP; GPT-OSS's TP runs keep every expert whole,
``etp=1``, and it also runs at CP2 x EP2). The models come from tests/hf_models.py (random weights, every
parameter perturbed); the comparison is the one tests/test_hf_conversion.py asserts. Last, the negative
controls: GPT-OSS without each of its parts (window, sinks, YaRN, clamp, interleaved gate/up), Mistral
without its sliding window (4 tokens on every layer).

    python benchmarks/hf_import_report.py          # about a minute on 2 CPU cores
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from _report import run_config, write_results  # noqa: E402

from tests.distributed_harness import run_distributed  # noqa: E402
from tests.hf_models import FAMILIES, hf_logits, make_tiny  # noqa: E402
from tests.test_hf_conversion import SEQUENCES, check, rel_err  # noqa: E402

LAYOUTS = [(1, 1, 1), (2, 1, 1), (1, 2, 1), (2, 2, 1)]
"""(TP, PP, EP) of the dense families."""
MOE_LAYOUTS = [(1, 1, 1), (1, 1, 2), (2, 1, 1), (1, 2, 1), (2, 1, 2)]
MOE = {"qwen3_moe", "mixtral", "qwen2_moe", "gpt_oss"}
NEGATIVES = {"gpt_oss": ["no_window", "no_sinks", "no_yarn", "no_clamp", "gate_up_halves"], "mistral": ["no_window"]}


def main() -> int:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    config = run_config(argparse_free(), families=sorted(FAMILIES), layouts=LAYOUTS, moe_layouts=MOE_LAYOUTS,
                        sequences=len(SEQUENCES))  # fmt: skip
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for family in sorted(FAMILIES):
            folder = make_tiny(family, Path(tmp) / family)
            reference = hf_logits(folder, SEQUENCES)
            layouts = [(*x, 1) for x in (MOE_LAYOUTS if family in MOE else LAYOUTS)]
            for tp, pp, ep, cp in layouts + ([(1, 1, 2, 2)] if family == "gpt_oss" else []):
                sp = family in MOE and tp > 1
                etp = 1 if family == "gpt_oss" else None
                results = run_distributed("tests.hf_workers:logits_worker", tp * pp * max(ep, cp), folder=str(folder),
                                          sequences=SEQUENCES, tp=tp, pp=pp, ep=ep, sp=sp, cp=cp, etp=etp)  # fmt: skip
                errors = check(results[0], reference)
                ranks = [r["stats"] for r in results]
                row = {"family": family, "tp": tp, "pp": pp, "ep": ep, "cp": cp, "sp": sp, **errors, "ranks": ranks}
                rows.append(row)
                print(
                    f"{family:<11} TP{tp} PP{pp} EP{ep} CP{cp}  logits alone {errors.get('alone', float('nan')):.1e}  "
                    f"packed {errors.get('packed', float('nan')):.1e}  logprobs {errors['logprobs']:.1e}  import "
                    f"{max(r['seconds'] for r in ranks) * 1e3:.0f} ms  read/rank "
                    f"{max(r['bytes_read'] for r in ranks) / 1e3:.0f} kB  peak RSS/rank "
                    f"{max(r['peak_rss_mib'] for r in ranks):.0f} MiB",
                    flush=True,
                )
            if family in NEGATIVES:
                (result,) = run_distributed("tests.hf_workers:variants_worker", 1, folder=str(folder),
                                            sequences=SEQUENCES, patches=NEGATIVES[family])  # fmt: skip
                for patch in NEGATIVES[family]:
                    error = max(rel_err(a, b) for a, b in zip(result[patch], reference, strict=True))
                    rows.append({"family": family, "negative_control": patch, "alone": error})
                    print(f"{family:<11} negative control {patch:<15} logits alone {error:.1e}", flush=True)
    write_results(str(ROOT / "benchmarks/results/hf_import.json"), config, rows)
    return 0


def argparse_free():
    import argparse

    return argparse.Namespace()


if __name__ == "__main__":
    raise SystemExit(main())
