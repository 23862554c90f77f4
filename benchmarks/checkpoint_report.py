"""Checkpoints through Megatron's dist_checkpointing: resume-vs-straight loss differences per layout, and
the embedded default model's checkpoint size and save/load time.

Resume: 4 straight steps at (TP, PP, DP) = (1, 1, 2) against 2 steps there + a resume at each layout for
steps 3-4 (the runs tests/test_checkpoint.py asserts), with the distributed optimizer off and on, and the
negative control (the optimizer state not loaded). Timing: the README's main job after one step, the
trainer's own Checkpointer (best of 3).

    python benchmarks/checkpoint_report.py          # about a minute on 2 CPU cores
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from _report import run_config, write_results  # noqa: E402

from tests.distributed_harness import run_distributed  # noqa: E402
from tests.test_checkpoint import LAYOUTS, _rel  # noqa: E402


def resume_rows() -> list[dict]:
    rows = []
    for distributed in (False, True):
        with tempfile.TemporaryDirectory() as tmp:
            (result, _) = run_distributed(
                "tests.checkpoint_workers:resume_layouts_worker",
                2,
                root=tmp,
                distributed_optimizer=distributed,
                layouts=LAYOUTS,
                control=True,
            )
        straight = result["straight"]["losses"][2:]
        for name in [f"tp{tp}pp{pp}" for tp, pp in LAYOUTS] + ["control"]:
            losses = result[name]["losses"]
            rows.append({
                "distributed_optimizer": distributed,
                "resumed_at": name if name != "control" else "tp1pp1, optimizer state not loaded (control)",
                "straight_losses": straight,
                "resumed_losses": losses,
                "max_rel_diff": max(_rel(a, b) for a, b in zip(losses, straight, strict=True)),
            })  # fmt: skip
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/checkpoint_report.json"))
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    config = run_config(args, layouts=LAYOUTS, written_at="tp1pp1dp2")
    rows = resume_rows()
    print("distributed optimizer | resumed at | max relative loss difference (steps 3-4)")
    for r in rows:
        print(f"{r['distributed_optimizer']!s:5} | {r['resumed_at']:45} | {r['max_rel_diff']:.2e}")
    with tempfile.TemporaryDirectory() as tmp:
        (timing,) = run_distributed("tests.checkpoint_workers:save_load_timing_worker", 1, root=tmp)
    print(
        f"embedded default model ({timing['parameters']:,} parameters, fp32 + Adam state): checkpoint "
        f"{timing['bytes'] / 2**20:.1f} MiB, save {timing['save_s']:.3f} s, load {timing['load_s']:.3f} s"
    )
    write_results(args.out, config, [*rows, {"timing": timing}])
    return 0


if __name__ == "__main__":
    sys.exit(main())
