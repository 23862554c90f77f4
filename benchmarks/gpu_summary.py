"""Versions before the GPU check, and its summary after (``benchmarks/gpu_check.sh`` calls both).

    python benchmarks/gpu_summary.py --versions        # one JSON document: python, torch, CUDA, GPU, ...
    python benchmarks/gpu_summary.py RESULTS_DIR       # summary.json + a Markdown table for benchmarks/README.md

The summary reads what the check left in RESULTS_DIR: each step's status, the JUnit XML of the test
steps (passed / failed / skipped, with the failures' first lines), ``sync_debug.json`` (the syncs CUDA's
sync debug mode saw in the step's forward and loss, by owner) and ``gpu_step.json``.
"""

from __future__ import annotations

import importlib.metadata
import json
import platform
import sys
import xml.etree.ElementTree as ET
from pathlib import Path


def versions() -> dict:
    def version(name: str) -> str | None:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return None

    out = {"python": platform.python_version(), "machine": platform.machine()}
    out.update({name: version(name) for name in ("torch", "megatron-core", "transformer-engine", "hydra-core")})
    try:
        import torch

        out["cuda"] = torch.version.cuda
        out["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except ImportError:
        out["cuda"] = out["gpu"] = None
    return out


def junit(path: Path) -> dict | None:
    if not path.exists():
        return None
    counts = {"passed": 0, "failed": 0, "skipped": 0, "failures": []}
    for case in ET.parse(path).getroot().iter("testcase"):
        problem = case.find("failure") if case.find("failure") is not None else case.find("error")
        if problem is not None:
            counts["failed"] += 1
            first = (problem.get("message") or "").splitlines()[:1]
            counts["failures"].append(f"{case.get('name')}: {first[0] if first else ''}"[:300])
        elif case.find("skipped") is not None:
            counts["skipped"] += 1
        else:
            counts["passed"] += 1
    return counts


def summarize(results: Path) -> dict:
    summary = {"versions": json.loads((results / "versions.json").read_text())}
    summary["steps"] = {p.stem: p.read_text().strip() for p in sorted(results.glob("*.status"))}
    summary["tests"] = {name: junit(results / f"{name}.xml") for name in ("gpu_tests", "newest_megatron")}
    step, sync = results / "gpu_step.json", results / "sync_debug.json"
    summary["gpu_step"] = json.loads(step.read_text())["results"] if step.exists() else None
    summary["sync_debug"] = json.loads(sync.read_text()) if sync.exists() else None
    (results / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


def markdown(summary: dict) -> str:
    v = summary["versions"]
    lines = [
        f"GPU: {v.get('gpu')}; torch {v.get('torch')} (CUDA {v.get('cuda')}), megatron-core {v.get('megatron-core')}, "
        f"TransformerEngine {v.get('transformer-engine') or 'not installed'}, Python {v.get('python')}",
        "",
    ]
    for name, counts in summary["tests"].items():
        if counts:
            lines.append(f"- {name}: {counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped")
            lines += [f"  - {f}" for f in counts["failures"]]
    if summary.get("sync_debug"):
        counts = summary["sync_debug"]["counts"]
        lines.append(f"- syncs under CUDA's sync debug mode in the step's forward and loss: mcore_packing "
                     f"{counts['mcore_packing']}, Megatron {counts['megatron']}, other {counts['other']}")  # fmt: skip
    for row in summary["gpu_step"] or []:
        lines += ["", f"| {row['attention_backend']} | tokens/s | MFU | peak memory GiB | largest micro-batch |"]
        lines.append("|---|---|---|---|---|")
        for mode in ("padded", "dynamic", "packing"):
            r = row[mode]
            memory = f"{r['peak_memory_gib']:.1f}" if r["peak_memory_gib"] is not None else "n/a"
            lines.append(
                f"| {mode} | {r['tokens_per_s']:.0f} | {r['mfu']:.3f} | {memory} | {r['largest_microbatch_tokens']} |"
            )
        lines.append(
            f"packed/padded {row['packed_over_padded']:.2f}x, dynamic/padded {row['dynamic_over_padded']:.2f}x"
        )
        if "prediction" in row["packing"]:
            lines.append(f"step-time prediction error {row['packing']['prediction']['mean_abs_rel_error']:.1%}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if argv[:1] == ["--versions"]:
        print(json.dumps(versions(), indent=1))
        return 0
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    print(markdown(summarize(Path(argv[0]))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
